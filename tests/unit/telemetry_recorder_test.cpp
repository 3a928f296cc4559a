// event_recorder on pools over a sim device: off by default, what each pool operation
// records (alloc, free, segment alloc/free, page map/unmap, OOM), the ring's overwrite
// order, context tags and backtraces, the OOM report naming where live blocks came from,
// attachment rules, and recording from many threads.
#include "gpumem/telemetry/event_recorder.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::KiB;
using gpumem_test::MiB;

class TelemetryRecorder : public gpumem_test::sim_pool_test {};

std::atomic<std::uint64_t> fake_now{1000};
std::uint64_t fake_clock() noexcept { return fake_now.fetch_add(10); }

struct runtime_caching_pool {
  runtime_resource upstream;
  caching_pool pool;
  explicit runtime_caching_pool(platform& p, pool_options o = {}) : upstream(p), pool(upstream, o) {}
};

TEST_F(TelemetryRecorder, RecordsNothingUntilAttachedAndNothingAfterDetach) {
  vmm_page_pool pool(sim);
  event_recorder rec;
  EXPECT_EQ(pool.observer(), nullptr);  // off by default
  pool.deallocate(pool.allocate(MiB), MiB);
  EXPECT_EQ(rec.size(), 0u);
  rec.attach(pool);
  EXPECT_EQ(pool.observer(), &rec);
  pool.deallocate(pool.allocate(MiB), MiB);
  EXPECT_EQ(rec.size(), 2u);
  rec.detach();
  EXPECT_EQ(pool.observer(), nullptr);
  pool.deallocate(pool.allocate(MiB), MiB);
  EXPECT_EQ(rec.size(), 2u);
}

TEST_F(TelemetryRecorder, VmmPoolRecordsPageMapsAllocsFreesAndReclaimUnmaps) {
  vmm_page_pool pool(sim);
  recorder_options o;
  o.clock_ns = &fake_clock;
  event_recorder rec(o);
  rec.attach(pool);
  const auto stream = make_stream();
  void* a = pool.allocate(6 * MiB, 256, stream);
  pool.deallocate(a, 6 * MiB, stream);
  // Trim unmaps the cached pages (reclaim) before giving them back.
  EXPECT_GT(pool.trim(), 0u);
  const auto ev = rec.events();
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0].kind, pool_event_kind::segment_map);
  EXPECT_EQ(ev[0].size, 6 * MiB);
  EXPECT_EQ(ev[0].stream, 0u);  // segments are not tied to a stream
  EXPECT_EQ(ev[1].kind, pool_event_kind::alloc);
  EXPECT_EQ(ev[1].address, reinterpret_cast<std::uintptr_t>(a));
  EXPECT_EQ(ev[1].size, 6 * MiB);
  EXPECT_EQ(ev[1].stream, stream.value);
  EXPECT_EQ(ev[2].kind, pool_event_kind::free);
  EXPECT_EQ(ev[2].address, ev[1].address);
  EXPECT_EQ(ev[3].kind, pool_event_kind::segment_unmap);
  EXPECT_EQ(ev[3].address, ev[0].address);
  EXPECT_EQ(ev[3].size, 6 * MiB);
  for (std::size_t i = 0; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i].sequence, i);
    if (i > 0) {
      EXPECT_GT(ev[i].time_ns, ev[i - 1].time_ns);  // the injected clock
    }
    EXPECT_EQ(ev[i].tag, nullptr);
    EXPECT_EQ(ev[i].frame_count, 0u);
  }
  pool.release_stream(stream);
}

TEST_F(TelemetryRecorder, CachingPoolRecordsSegmentAllocAndFree) {
  runtime_caching_pool env(sim);
  event_recorder rec;
  rec.attach(env.pool);
  void* a = env.pool.allocate(3 * MiB);
  env.pool.deallocate(a, 3 * MiB);
  env.pool.trim();
  const auto ev = rec.events();
  ASSERT_EQ(ev.size(), 4u);
  EXPECT_EQ(ev[0].kind, pool_event_kind::segment_alloc);
  EXPECT_EQ(ev[0].size, 4 * MiB);  // large requests round to 2 MiB
  EXPECT_EQ(ev[1].kind, pool_event_kind::alloc);
  EXPECT_EQ(ev[1].size, 3 * MiB);  // what was asked for
  EXPECT_EQ(ev[2].kind, pool_event_kind::free);
  EXPECT_EQ(ev[3].kind, pool_event_kind::segment_free);
  EXPECT_EQ(ev[3].address, ev[0].address);
}

TEST_F(TelemetryRecorder, RingKeepsTheNewestEventsOldestFirst) {
  vmm_page_pool pool(sim);
  recorder_options o;
  o.capacity = 4;
  event_recorder rec(o);
  rec.attach(pool);
  void* warm = pool.allocate(MiB);  // map + alloc
  pool.deallocate(warm, MiB);       // free
  for (int i = 0; i < 4; ++i) pool.deallocate(pool.allocate(MiB), MiB);  // 8 more, no maps
  EXPECT_EQ(rec.recorded(), 11u);
  EXPECT_EQ(rec.size(), 4u);
  EXPECT_EQ(rec.dropped(), 7u);
  const auto ev = rec.events();
  ASSERT_EQ(ev.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(ev[i].sequence, 7 + i);
  EXPECT_EQ(ev[0].kind, pool_event_kind::alloc);
  EXPECT_EQ(ev[3].kind, pool_event_kind::free);
  rec.clear();
  EXPECT_EQ(rec.size(), 0u);
  EXPECT_EQ(rec.recorded(), 0u);
  EXPECT_EQ(rec.dropped(), 0u);
  pool.deallocate(pool.allocate(MiB), MiB);
  EXPECT_EQ(rec.events().front().sequence, 11u);
}

TEST_F(TelemetryRecorder, OomIsRecordedWithTheDeviceFreeBytes) {
  pool_options opts;
  opts.limit_bytes = 8 * MiB;
  vmm_page_pool pool(sim, 0, opts);
  event_recorder rec;
  rec.attach(pool);
  EXPECT_THROW(pool.allocate(16 * MiB), out_of_memory);
  const auto ev = rec.events();
  ASSERT_FALSE(ev.empty());
  EXPECT_EQ(ev.back().kind, pool_event_kind::oom);
  EXPECT_EQ(ev.back().size, 16 * MiB);
  EXPECT_EQ(ev.back().address, sim.mem_info(0).value().free);
  EXPECT_EQ(pool.stats().oom_count, 1u);
}

TEST_F(TelemetryRecorder, TagContextRecordsTheThreadsTagAndNests) {
  vmm_page_pool pool(sim);
  recorder_options o;
  o.context = record_context::tag;
  event_recorder rec(o);
  rec.attach(pool);
  void* a = nullptr;
  void* b = nullptr;
  {
    scoped_context_tag outer("layer0.attention");
    a = pool.allocate(MiB);
    {
      scoped_context_tag inner("layer0.kv");
      b = pool.allocate(MiB);
    }
    EXPECT_STREQ(current_context_tag(), "layer0.attention");
  }
  EXPECT_EQ(current_context_tag(), nullptr);
  pool.deallocate(a, MiB);
  std::vector<const char*> tags;
  for (const auto& e : rec.events())
    if (e.kind != pool_event_kind::segment_map) tags.push_back(e.tag);
  ASSERT_EQ(tags.size(), 3u);
  EXPECT_STREQ(tags[0], "layer0.attention");
  EXPECT_STREQ(tags[1], "layer0.kv");
  EXPECT_EQ(tags[2], nullptr);
  EXPECT_EQ(rec.describe_allocation(reinterpret_cast<std::uintptr_t>(b)), "tag layer0.kv");
  EXPECT_EQ(rec.describe_allocation(0x1234), "");
  pool.deallocate(b, MiB);
}

// Not inlined, so it is a frame of its own in the captured stack.
[[gnu::noinline]] void* allocate_from_a_known_place(pool_base& pool, std::size_t bytes) {
  void* p = pool.allocate(bytes);
  asm volatile("" ::: "memory");  // not a tail call
  return p;
}

TEST_F(TelemetryRecorder, BacktraceContextCapturesTheCallStackAndSymbolizesOnRequest) {
  vmm_page_pool pool(sim);
  recorder_options o;
  o.context = record_context::backtrace;
  o.max_frames = 32;
  event_recorder rec(o);
  rec.attach(pool);
  void* p = allocate_from_a_known_place(pool, MiB);
  std::uint64_t seq = 0;
  bool found = false;
  for (const auto& e : rec.events())
    if (e.kind == pool_event_kind::alloc) {
      seq = e.sequence;
      found = true;
      EXPECT_GT(e.frame_count, 3u);
    }
  ASSERT_TRUE(found);
  const auto frames = rec.frames(seq);
  ASSERT_GT(frames.size(), 2u);
  // The test binary's frames: named where the symbol is exported, else binary+offset.
  for (const auto& f : frames) {
    EXPECT_FALSE(f.filename.empty());
    EXPECT_FALSE(f.name.empty());
  }
  EXPECT_TRUE(rec.frames(seq + 1000).empty());  // not kept: no frames
  const std::string where = rec.describe_allocation(reinterpret_cast<std::uintptr_t>(p));
  EXPECT_FALSE(where.empty());
  EXPECT_NE(where.find(frames.front().name), std::string::npos) << where;
  pool.deallocate(p, MiB);
}

TEST_F(TelemetryRecorder, OomReportSaysWhereTheBiggestLiveAllocationsCameFrom) {
  pool_options opts;
  opts.limit_bytes = 16 * MiB;
  vmm_page_pool pool(sim, 0, opts);
  recorder_options o;
  o.context = record_context::tag;
  event_recorder rec(o);
  rec.attach(pool);
  void* big = nullptr;
  void* small = nullptr;
  {
    scoped_context_tag t("embedding.weights");
    big = pool.allocate(10 * MiB);
  }
  {
    scoped_context_tag t("optimizer.state");
    small = pool.allocate(2 * MiB);
  }
  try {
    pool.allocate(8 * MiB);
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    const std::string r = e.report();
    EXPECT_NE(r.find("requested: 8388608 bytes"), std::string::npos) << r;
    EXPECT_NE(r.find("device:"), std::string::npos) << r;
    EXPECT_NE(r.find("largest free block"), std::string::npos) << r;
    EXPECT_NE(r.find("limit: 16.00 MiB"), std::string::npos) << r;
    EXPECT_NE(r.find("retried after releasing cached memory"), std::string::npos) << r;
    EXPECT_NE(r.find("biggest live allocations (2 of 2)"), std::string::npos) << r;
    const auto first = r.find("10.00 MiB at");
    const auto tag1 = r.find("allocated at: tag embedding.weights");
    const auto second = r.find("2.00 MiB at");
    const auto tag2 = r.find("allocated at: tag optimizer.state");
    ASSERT_NE(first, std::string::npos) << r;
    ASSERT_NE(tag1, std::string::npos) << r;
    ASSERT_NE(second, std::string::npos) << r;
    ASSERT_NE(tag2, std::string::npos) << r;
    EXPECT_LT(first, tag1);  // each tag under its allocation, biggest first
    EXPECT_LT(tag1, second);
    EXPECT_LT(second, tag2);
  }
  // Without context the report names no origin.
  rec.detach();
  EXPECT_EQ(pool.memory_report(8 * MiB).find("allocated at"), std::string::npos);
  pool.deallocate(big, 10 * MiB);
  pool.deallocate(small, 2 * MiB);
}

TEST_F(TelemetryRecorder, AttachmentRulesAreEnforced) {
  vmm_page_pool a(sim);
  vmm_page_pool b(sim);
  event_recorder r1, r2;
  r1.attach(a);
  r1.attach(a);  // again: no-op
  EXPECT_THROW(r1.attach(b), invalid_argument);  // one pool at a time
  EXPECT_THROW(r2.attach(a), invalid_argument);  // the pool has an observer
  EXPECT_EQ(r2.attached_pool(), nullptr);
  EXPECT_EQ(a.observer(), &r1);
  recorder_options bad;
  bad.capacity = 0;
  EXPECT_THROW(event_recorder{bad}, invalid_argument);
  bad.capacity = 8;
  bad.max_frames = 65;
  EXPECT_THROW(event_recorder{bad}, invalid_argument);
  {
    event_recorder scoped;
    scoped.attach(b);
    EXPECT_EQ(b.observer(), &scoped);
  }
  EXPECT_EQ(b.observer(), nullptr);  // its destructor detached it
}

TEST_F(TelemetryRecorder, ManyThreadsRecordEveryEventExactlyOnce) {
  vmm_page_pool pool(sim);
  recorder_options o;
  o.capacity = 1 << 16;
  o.context = record_context::tag;
  event_recorder rec(o);
  rec.attach(pool);
  constexpr int threads = 4, rounds = 500;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t)
    ts.emplace_back([&pool] {
      scoped_context_tag tag("worker");
      for (int i = 0; i < rounds; ++i) pool.deallocate(pool.allocate(64 * KiB), 64 * KiB);
    });
  // A reader alongside the writers.
  std::size_t seen = 0;
  for (int i = 0; i < 20; ++i) seen = std::max(seen, rec.events().size());
  for (auto& t : ts) t.join();
  std::size_t allocs = 0, frees = 0;
  const auto ev = rec.events();
  for (std::size_t i = 0; i < ev.size(); ++i) {
    EXPECT_EQ(ev[i].sequence, i);
    if (ev[i].kind == pool_event_kind::alloc) ++allocs;
    if (ev[i].kind == pool_event_kind::free) ++frees;
    if (ev[i].kind == pool_event_kind::alloc) {
      EXPECT_STREQ(ev[i].tag, "worker");
    }
  }
  EXPECT_EQ(allocs, static_cast<std::size_t>(threads * rounds));
  EXPECT_EQ(frees, allocs);
  EXPECT_LE(seen, ev.size());
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

}  // namespace
