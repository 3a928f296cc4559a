// PyTorch memory snapshot export: the pickle writer's encodings read back, and snapshots of
// both pools decoded and checked against what PyTorch's tools rely on: every block listed,
// block sizes summing to the segment, the device trace in order and consistent with the
// segments, and the same figures as the pool.
#include "gpumem/telemetry/snapshot.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "gpumem/telemetry/event_recorder.hpp"
#include "telemetry/pickle_writer.hpp"
#include "unit/pool_test_support.hpp"
#include "unit/telemetry_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::KiB;
using gpumem_test::MiB;
using gpumem_test::py_object;
using gpumem_test::read_pickle;

struct runtime_caching_pool {
  runtime_resource upstream;
  caching_pool pool;
  explicit runtime_caching_pool(platform& p, pool_options o = {}) : upstream(p), pool(upstream, o) {}
};

TEST(TelemetryPickle, EncodingsReadBack) {
  std::string out;
  detail::pickle_writer w(out);
  const std::vector<std::int64_t> ints = {0, 1, 255, 256, 65535, 65536, -1, -129,
                                          std::numeric_limits<std::int32_t>::max(),
                                          std::numeric_limits<std::int32_t>::min(),
                                          std::int64_t{1} << 31, std::int64_t{0x7fffffffffff},
                                          std::int64_t{0x80} << 40,  // top bit of a byte set
                                          -(std::int64_t{1} << 40),
                                          std::numeric_limits<std::int64_t>::max(),
                                          std::numeric_limits<std::int64_t>::min()};
  w.begin_dict();
  w.str("ints");
  w.begin_list();
  for (auto v : ints) w.integer(v);
  w.end_list();
  w.item("text", std::string("caf\xc3\xa9"));
  w.item("yes", true);
  w.item("no", false);
  w.item("half", 0.5);
  w.str("none");
  w.none();
  w.str("pair");
  w.tuple2(3, 70000);
  w.str("empty");
  w.begin_list();
  w.end_list();
  w.end_dict();
  w.finish();
  const py_object o = read_pickle(out);
  ASSERT_EQ(o["ints"].list().size(), ints.size());
  for (std::size_t i = 0; i < ints.size(); ++i) EXPECT_EQ(o["ints"].list()[i].integer(), ints[i]) << i;
  EXPECT_EQ(o["text"].str(), "caf\xc3\xa9");
  EXPECT_TRUE(o["yes"].boolean());
  EXPECT_FALSE(o["no"].boolean());
  EXPECT_EQ(o["half"].real(), 0.5);
  EXPECT_TRUE(o["none"].is_none());
  ASSERT_EQ(o["pair"].tuple().items.size(), 2u);
  EXPECT_EQ(o["pair"].tuple().items[1].integer(), 70000);
  EXPECT_TRUE(o["empty"].list().empty());
}

TEST(TelemetryPickle, LargeContainersAreWrittenInBatchesOfAThousand) {
  std::string out;
  detail::pickle_writer w(out);
  w.begin_list();
  for (int i = 0; i < 2500; ++i) w.integer(i);
  w.end_list();
  w.finish();
  // 2500 items: APPENDS after 1000, 2000 and at the end.
  std::size_t appends = 0;
  for (std::size_t i = 0; i + 1 < out.size(); ++i)
    if (out[i] == 'e' && out[i + 1] == '(') ++appends;
  EXPECT_EQ(appends, 2u);
  const py_object o = read_pickle(out);
  ASSERT_EQ(o.list().size(), 2500u);
  EXPECT_EQ(o.list()[2499].integer(), 2499);
}

TEST(TelemetryPickle, MisuseIsRefused) {
  std::string out;
  detail::pickle_writer w(out);
  EXPECT_THROW(w.end_list(), invalid_argument);
  w.begin_dict();
  w.str("key without value");
  EXPECT_THROW(w.end_dict(), invalid_argument);
  w.integer(1);
  EXPECT_THROW(w.end_list(), invalid_argument);
  w.end_dict();
  detail::pickle_writer w2(out);
  w2.begin_list();
  EXPECT_THROW(w2.finish(), invalid_argument);
}

class TelemetrySnapshot : public gpumem_test::sim_pool_test {
 protected:
  // What PyTorch's viewer and torch.cuda._memory_viz rely on, checked on the decoded dict.
  // Returns the sum of total_size.
  std::size_t check_segments(const py_object& snap, bool expandable) {
    std::size_t total = 0;
    for (const py_object& seg : snap["segments"].list()) {
      for (const char* key : {"device", "address", "total_size", "allocated_size", "active_size",
                              "requested_size", "stream", "segment_type", "segment_pool_id",
                              "is_expandable", "frames", "blocks"})
        EXPECT_TRUE(seg.has(key)) << key;
      EXPECT_EQ(seg["is_expandable"].boolean(), expandable);
      EXPECT_EQ(seg["stream"].integer(), 0);
      std::int64_t addr = seg["address"].integer(), allocated = 0, requested = 0;
      EXPECT_FALSE(seg["blocks"].list().empty());
      for (const py_object& b : seg["blocks"].list()) {
        EXPECT_EQ(b["address"].integer(), addr);  // back to back
        EXPECT_GT(b["size"].integer(), 0);
        const std::string state = b["state"].str();
        EXPECT_TRUE(state == "active_allocated" || state == "inactive") << state;
        if (state == "active_allocated") {
          allocated += b["size"].integer();
          requested += b["requested_size"].integer();
          EXPECT_LE(b["requested_size"].integer(), b["size"].integer());
        }
        addr += b["size"].integer();
      }
      EXPECT_EQ(addr - seg["address"].integer(), seg["total_size"].integer());  // blocks tile it
      EXPECT_EQ(seg["allocated_size"].integer(), allocated);
      EXPECT_EQ(seg["requested_size"].integer(), requested);
      total += static_cast<std::size_t>(seg["total_size"].integer());
    }
    return total;
  }
};

TEST_F(TelemetrySnapshot, VmmPoolSnapshotListsMappedRunsAndTheTrace) {
  vmm_page_pool pool(sim);
  recorder_options o;
  o.context = record_context::tag;
  event_recorder rec(o);
  rec.attach(pool);
  const auto stream = make_stream();
  void* a = nullptr;
  {
    scoped_context_tag tag("weights");
    a = pool.allocate(5 * MiB, 256, stream);
  }
  void* b = pool.allocate(100 * KiB);
  void* c = pool.allocate(3 * MiB);
  pool.deallocate(c, 3 * MiB);
  const py_object snap = read_pickle(memory_snapshot_pickle(pool, &rec));

  // Segments: the mapped pages, every block listed.
  const std::size_t in_segments = check_segments(snap, true);
  EXPECT_EQ(in_segments, pool.page_counts().mapped_pages * pool.page_size());
  std::size_t live = 0;
  std::vector<std::string> frames_of_a;
  for (const py_object& seg : snap["segments"].list())
    for (const py_object& blk : seg["blocks"].list())
      if (blk["state"].str() == "active_allocated") {
        ++live;
        if (blk["address"].integer() == static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(a)))
          for (const py_object& f : blk["frames"].list()) frames_of_a.push_back(f["name"].str());
      }
  EXPECT_EQ(live, 2u);
  ASSERT_EQ(frames_of_a.size(), 1u);  // its tag, as a frame
  EXPECT_EQ(frames_of_a[0], "weights");

  // The trace: one per device, the recorder's events in order, a free as requested then
  // completed, closed by a snapshot entry.
  ASSERT_EQ(snap["device_traces"].list().size(), 1u);
  std::vector<std::string> actions;
  for (const py_object& e : snap["device_traces"].list()[0].list()) {
    actions.push_back(e["action"].str());
    for (const char* key : {"addr", "size", "stream", "time_us", "frames"}) EXPECT_TRUE(e.has(key)) << key;
  }
  const std::vector<std::string> expected = {"segment_map", "alloc", "segment_map", "alloc",
                                             "segment_map", "alloc", "free_requested",
                                             "free_completed", "snapshot"};
  EXPECT_EQ(actions, expected);
  const py_object& first_alloc = snap["device_traces"].list()[0].list()[1];
  EXPECT_EQ(first_alloc["stream"].integer(), static_cast<std::int64_t>(stream.value));
  EXPECT_EQ(first_alloc["size"].integer(), static_cast<std::int64_t>(5 * MiB));
  EXPECT_GT(first_alloc["time_us"].integer(), 1'600'000'000'000'000);  // after 2020, in us

  EXPECT_TRUE(snap["allocator_settings"]["expandable_segments"].boolean());
  EXPECT_EQ(snap["gpumem"]["allocator"].str(), "vmm_page_pool");
  EXPECT_EQ(snap["gpumem"]["stats"]["reserved_bytes.all.current"].integer(),
            static_cast<std::int64_t>(pool.stats().reserved_bytes));
  pool.deallocate(a, 5 * MiB, stream);
  pool.deallocate(b, 100 * KiB);
  pool.release_stream(stream);
}

TEST_F(TelemetrySnapshot, CachingPoolSnapshotHasOneSegmentPerUpstreamSegment) {
  runtime_caching_pool env(sim);
  void* small = env.pool.allocate(4 * KiB);
  void* large = env.pool.allocate(7 * MiB);
  void* large2 = env.pool.allocate(7 * MiB);
  env.pool.deallocate(large2, 7 * MiB);
  const py_object snap = read_pickle(memory_snapshot_pickle(env.pool, nullptr));
  const auto& segs = snap["segments"].list();
  ASSERT_EQ(segs.size(), env.pool.segment_count());
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(check_segments(snap, false), env.pool.stats().reserved_bytes);
  std::size_t small_segments = 0;
  for (const py_object& s : segs) small_segments += s["segment_type"].str() == "small";
  EXPECT_EQ(small_segments, 1u);
  // No recorder: one empty trace for the device, still well formed.
  ASSERT_EQ(snap["device_traces"].list().size(), 1u);
  EXPECT_TRUE(snap["device_traces"].list()[0].list().empty());
  EXPECT_FALSE(snap["allocator_settings"]["expandable_segments"].boolean());
  env.pool.deallocate(small, 4 * KiB);
  env.pool.deallocate(large, 7 * MiB);
}

TEST_F(TelemetrySnapshot, MemorySegmentsTileAndAddUpToWhatTheArenasHold) {
  vmm_page_pool pool(sim);
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t i = 1; i <= 12; ++i) live.emplace_back(pool.allocate(i * 700 * KiB), i * 700 * KiB);
  for (std::size_t i = 0; i < live.size(); i += 3) pool.deallocate(live[i].first, live[i].second);
  const auto segments = pool.memory_segments();
  std::size_t total = 0, allocated = 0;
  for (const memory_segment& s : segments) {
    std::uintptr_t at = s.address;
    for (const memory_block& b : s.blocks) {
      EXPECT_EQ(b.address, at);
      at += b.size;
      if (b.st == memory_block::state::allocated) allocated += b.size;
    }
    EXPECT_EQ(at - s.address, s.size);
    total += s.size;
  }
  for (std::size_t i = 1; i < segments.size(); ++i)  // runs do not touch: they would be one
    EXPECT_LT(segments[i - 1].address + segments[i - 1].size, segments[i].address);
  EXPECT_EQ(total, pool.page_counts().mapped_pages * pool.page_size());
  const auto small = pool.bytes_in_arena(true), large = pool.bytes_in_arena(false);
  EXPECT_EQ(allocated, small.allocated + large.allocated);
  EXPECT_EQ(total, small.allocated + small.cached + small.free + large.allocated + large.cached + large.free);
  for (std::size_t i = 0; i < live.size(); ++i)
    if (i % 3 != 0) pool.deallocate(live[i].first, live[i].second);
}

TEST_F(TelemetrySnapshot, WritesTheFileAndRefusesAPathItCannotWrite) {
  vmm_page_pool pool(sim);
  void* p = pool.allocate(MiB);
  const std::string path = ::testing::TempDir() + "gpumem_telemetry_snapshot.pickle";
  write_memory_snapshot(pool, nullptr, path);
  std::ifstream f(path, std::ios::binary);
  std::stringstream bytes;
  bytes << f.rdbuf();
  EXPECT_EQ(bytes.str(), memory_snapshot_pickle(pool, nullptr));
  std::remove(path.c_str());
  std::ostringstream stream_out;
  write_memory_snapshot(pool, nullptr, stream_out);
  EXPECT_EQ(stream_out.str(), bytes.str());
  try {
    write_memory_snapshot(pool, nullptr, std::string("/nonexistent-dir/x.pickle"));
    FAIL() << "expected invalid_argument";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x.pickle"), std::string::npos);
  }
  pool.deallocate(p, MiB);
}

TEST_F(TelemetrySnapshot, OomEntryCarriesDeviceFreeInsteadOfAnAddress) {
  pool_options o;
  o.limit_bytes = 4 * MiB;
  vmm_page_pool pool(sim, 0, o);
  event_recorder rec;
  rec.attach(pool);
  EXPECT_THROW(pool.allocate(8 * MiB), out_of_memory);
  const py_object snap = read_pickle(memory_snapshot_pickle(pool, &rec));
  const auto& trace = snap["device_traces"].list()[0].list();
  ASSERT_EQ(trace.size(), 2u);
  EXPECT_EQ(trace[0]["action"].str(), "oom");
  EXPECT_FALSE(trace[0].has("addr"));
  EXPECT_EQ(trace[0]["device_free"].integer(), static_cast<std::int64_t>(sim.mem_info(0).value().free));
  EXPECT_EQ(trace[0]["size"].integer(), static_cast<std::int64_t>(8 * MiB));
  EXPECT_EQ(trace[1]["action"].str(), "snapshot");
}

}  // namespace
