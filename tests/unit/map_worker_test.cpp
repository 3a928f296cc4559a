// vmm_page_pool with map_worker:on (sim, 1 GiB, 2 MiB pages): access grants and unmaps of
// old mappings run on a helper thread, and a stream that gets memory whose grant is not done
// waits for it on the "GPU" (stream_wait_value), never the allocating thread.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/pool/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::fill;
using gpumem_test::holds;
using gpumem_test::KiB;
using gpumem_test::MiB;
using gpumem_test::overlaps;

pool_options with_worker() {
  pool_options o;
  o.map_worker = map_worker_mode::on;
  return o;
}

class MapWorker : public gpumem_test::sim_pool_test {};

TEST(MapWorkerOption, ParsesAutoOnOffAndRefusesOthers) {
  EXPECT_EQ(pool_options{}.map_worker, map_worker_mode::automatic);
  EXPECT_EQ(pool_options::parse("map_worker:on").map_worker, map_worker_mode::on);
  EXPECT_EQ(pool_options::parse("map_worker:off").map_worker, map_worker_mode::off);
  EXPECT_EQ(pool_options::parse("map_worker:auto").map_worker, map_worker_mode::automatic);
  EXPECT_NE(pool_options::parse("map_worker:on").to_string().find("map_worker:on"), std::string::npos);
  EXPECT_THROW(pool_options::parse("map_worker:sometimes"), invalid_argument);
}

// The allocating stream waits for the grant; on sim that wait returns once it is done, so
// the bytes are usable at once. The default on sim is no worker: no stream waits.
TEST_F(MapWorker, GrownMemoryIsGrantedOnTheWorkerAndTheStreamWaitsForIt) {
  {
    vmm_page_pool plain(sim);
    void* p = plain.allocate(7 * MiB);
    EXPECT_EQ(calls(platform_op::stream_wait_value), 0u) << "auto on sim: no worker";
    plain.deallocate(p, 7 * MiB);
  }
  vmm_page_pool pool(sim, 0, with_worker());
  const auto access = calls(platform_op::set_access);
  const stream_handle s = make_stream();
  void* p = pool.allocate(7 * MiB, 256, s);
  EXPECT_EQ(calls(platform_op::set_access), access + 1);
  // One wait, or none when the worker was done first (the gated test below pins the wait).
  EXPECT_LE(calls(platform_op::stream_wait_value), 1u);
  ASSERT_TRUE(sim.memset_async(p, 0x5a, 7 * MiB, s).ok());  // faults if not granted
  EXPECT_TRUE(holds(p, 7 * MiB, 0x5a));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(p, 7 * MiB, s);
}

// Reclaimed pages are mapped at their new place at once; the old mapping is unmapped on the
// worker, and its address space comes back only after that. Live bytes never move.
TEST_F(MapWorker, RemapsKeepLiveBytesAndOldMappingsAreUnmappedOnTheWorker) {
  vmm_page_pool pool(sim, 0, with_worker());
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool.allocate(4 * MiB));
    fill(blocks.back(), 4 * MiB, static_cast<unsigned char>(i + 1));
  }
  for (int i = 0; i < 16; i += 2) pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB);
  const auto creates = calls(platform_op::create_physical);
  const auto unmaps = calls(platform_op::unmap);
  for (int round = 0; round < 3; ++round) {
    void* big = pool.allocate(16 * MiB);  // gathers the freed pages: a remap
    EXPECT_EQ(calls(platform_op::create_physical), creates) << "round " << round;
    fill(big, 16 * MiB, 0xB1);
    for (int i = 1; i < 16; i += 2)
      ASSERT_TRUE(holds(blocks[static_cast<std::size_t>(i)], 4 * MiB, static_cast<unsigned char>(i + 1)))
          << "live block " << i << " changed in round " << round;
    for (int i = 1; i < 16; i += 2)
      EXPECT_FALSE(overlaps(big, 16 * MiB, blocks[static_cast<std::size_t>(i)], 4 * MiB));
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    pool.deallocate(big, 16 * MiB);
    // Small blocks cut the freed run, so the next round must gather pages again.
    std::vector<void*> cut;
    for (int i = 0; i < 4; ++i) cut.push_back(pool.allocate(3 * MiB));
    for (void* c : cut) pool.deallocate(c, 3 * MiB);
  }
  EXPECT_GT(pool.page_counts().pages_reclaimed, 0u);
  EXPECT_GT(calls(platform_op::unmap), unmaps) << "old mappings were never unmapped";
  EXPECT_GT(pool.trim(), 0u);  // waits for the worker, then gives back every free page
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (int i = 1; i < 16; i += 2) pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB);
  pool.trim();
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(sim.live_objects().mappings, 0u) << "an old mapping outlived trim()";
}

// A grant that fails on the worker (both tries) still releases the waiting stream; the
// pool grants again on its own thread and reports the failure at its next call.
TEST_F(MapWorker, AFailedGrantIsGrantedAgainAndReportedAtTheNextCall) {
  vmm_page_pool pool(sim, 0, with_worker());
  sim.inject_fault(platform_op::set_access, sim_fault{.nth = 1, .every_after = true,
                                                      .kind = failure_kind::driver_error});
  void* p = pool.allocate(4 * MiB);  // returns: its stream's wait is released anyway
  sim.clear_faults();
  try {
    void* q = pool.allocate(64 * MiB);  // the next growth collects the failure
    pool.deallocate(q, 64 * MiB);
    FAIL() << "the failed grant was not reported";
  } catch (const cuda_error& e) {
    EXPECT_NE(std::string(e.what()).find("map worker"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("granted again"), std::string::npos) << e.what();
  }
  fill(p, 4 * MiB, 0x33);  // granted again: usable
  EXPECT_TRUE(holds(p, 4 * MiB, 0x33));
  void* q = pool.allocate(64 * MiB);  // and the pool goes on
  fill(q, 64 * MiB, 0x44);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(q, 64 * MiB);
  pool.deallocate(p, 4 * MiB);
}

// A platform whose access grants block until the test opens a gate, and whose stream waits
// are recorded rather than waited (as on a GPU): it shows which streams were made to wait.
class gated_platform final : public platform {
 public:
  explicit gated_platform(sim_platform& inner) : inner_(inner) {}
  void open() { open_.store(true); }
  void refuse_waits() { refuse_waits_ = true; }  // as a platform without stream memory ops
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> waits() const {
    std::lock_guard lock(mutex_);
    return waits_;
  }

  std::string_view kind() const noexcept override { return inner_.kind(); }
  result<int> device_count() override { return inner_.device_count(); }
  result<device_properties> properties(int d) override { return inner_.properties(d); }
  result<allocation_granularity> granularity(int d) override { return inner_.granularity(d); }
  result<memory_info> mem_info(int d) override { return inner_.mem_info(d); }
  result<std::uintptr_t> reserve_range(std::size_t s, std::size_t a) override { return inner_.reserve_range(s, a); }
  status free_range(std::uintptr_t b, std::size_t s) override { return inner_.free_range(b, s); }
  result<physical_handle> create_physical(int d, std::size_t s) override { return inner_.create_physical(d, s); }
  status release_physical(physical_handle h) override { return inner_.release_physical(h); }
  status map(std::uintptr_t va, std::size_t s, physical_handle h, std::size_t o) override { return inner_.map(va, s, h, o); }
  status unmap(std::uintptr_t va, std::size_t s) override { return inner_.unmap(va, s); }
  status set_access(int d, std::uintptr_t va, std::size_t s) override {
    while (!open_.load()) std::this_thread::yield();
    return inner_.set_access(d, va, s);
  }
  result<void*> runtime_malloc(int d, std::size_t s) override { return inner_.runtime_malloc(d, s); }
  status runtime_free(int d, void* p) override { return inner_.runtime_free(d, p); }
  result<void*> driver_alloc(int d, std::size_t s) override { return inner_.driver_alloc(d, s); }
  status driver_free(int d, void* p) override { return inner_.driver_free(d, p); }
  result<void*> host_alloc_pinned(std::size_t s) override { return inner_.host_alloc_pinned(s); }
  status host_free_pinned(void* p) override { return inner_.host_free_pinned(p); }
  result<stream_handle> stream_create(int d) override { return inner_.stream_create(d); }
  status stream_destroy(stream_handle s) override { return inner_.stream_destroy(s); }
  status stream_synchronize(stream_handle s) override { return inner_.stream_synchronize(s); }
  result<event_handle> event_create(int d) override { return inner_.event_create(d); }
  status event_destroy(event_handle e) override { return inner_.event_destroy(e); }
  status event_record(event_handle e, stream_handle s) override { return inner_.event_record(e, s); }
  result<bool> event_query(event_handle e) override { return inner_.event_query(e); }
  status event_synchronize(event_handle e) override { return inner_.event_synchronize(e); }
  status stream_wait_event(stream_handle s, event_handle e) override { return inner_.stream_wait_event(s, e); }
  status memcpy_async(void* d, const void* s, std::size_t n, stream_handle st) override {
    return inner_.memcpy_async(d, s, n, st);
  }
  status memset_async(void* d, int v, std::size_t n, stream_handle s) override { return inner_.memset_async(d, v, n, s); }
  result<void*> async_malloc(int d, std::size_t n, stream_handle s) override { return inner_.async_malloc(d, n, s); }
  status async_free(void* p, stream_handle s) override { return inner_.async_free(p, s); }
  status stream_wait_value(stream_handle s, const std::uint32_t*, std::uint32_t v) override {
    std::lock_guard lock(mutex_);
    waits_.emplace_back(s.value, v);
    if (refuse_waits_)
      return status::failure(platform_op::stream_wait_value, failure_kind::not_supported, 801,
                             "CUDA_ERROR_NOT_SUPPORTED", "refused by the test");
    return status::success();
  }

 private:
  sim_platform& inner_;
  std::atomic<bool> open_{false};
  bool refuse_waits_ = false;
  mutable std::mutex mutex_;
  std::vector<std::pair<std::uintptr_t, std::uint32_t>> waits_;
};

// While a grown run's grant is still pending, the rest of that run handed to ANOTHER stream
// makes that stream wait for the grant too; once granted, no more waits are queued.
TEST_F(MapWorker, AnotherStreamGettingMemoryOfAPendingGrantWaitsForItToo) {
  gated_platform gated(sim);
  const stream_handle s1 = make_stream();
  const stream_handle s2 = make_stream();
  const stream_handle s3 = make_stream();
  {
    // Opens the gate however the block ends, before the pool's end waits for its worker.
    struct opener {
      gated_platform& g;
      ~opener() { g.open(); }
    };
    vmm_page_pool pool(gated, 0, with_worker());
    opener open_at_exit{gated};
    void* a = pool.allocate(256 * KiB, 256, s1);  // a fresh page; grant queued, not done
    ASSERT_EQ(gated.waits().size(), 1u);
    EXPECT_EQ(gated.waits()[0].first, s1.value);
    const std::uint32_t ticket = gated.waits()[0].second;
    void* b = pool.allocate(256 * KiB, 256, s2);  // the same page's free rest, for s2
    EXPECT_TRUE(overlaps(b, 256 * KiB, a, 2 * MiB)) << "b should come from a's page";
    auto waits = gated.waits();
    ASSERT_EQ(waits.size(), 2u) << "s2 got memory of a pending grant without waiting";
    EXPECT_EQ(waits[1], std::make_pair(s2.value, ticket));

    gated.open();
    pool.trim();  // waits for the worker
    void* c = pool.allocate(256 * KiB, 256, s3);
    EXPECT_EQ(gated.waits().size(), 2u) << "a granted run needs no more waits";
    fill(a, 256 * KiB, 1);
    fill(b, 256 * KiB, 2);
    fill(c, 256 * KiB, 3);
    EXPECT_TRUE(holds(a, 256 * KiB, 1));
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    pool.deallocate(a, 256 * KiB, s1);
    pool.deallocate(b, 256 * KiB, s2);
    pool.deallocate(c, 256 * KiB, s3);
    for (auto s : {s1, s2, s3}) pool.release_stream(s);
  }
}

// A platform without stream memory operations: the pool waits for the grant on the host
// once, then stops using the worker (grants on the caller's thread again).
TEST_F(MapWorker, WithoutStreamWaitsThePoolFallsBackToGrantingItself) {
  gated_platform gated(sim);
  gated.refuse_waits();
  vmm_page_pool pool(gated, 0, with_worker());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    gated.open();
  });
  void* p = pool.allocate(4 * MiB);  // its grant is done by the worker once the gate opens
  opener.join();
  EXPECT_EQ(gated.waits().size(), 1u) << "the stream was never asked to wait";
  fill(p, 4 * MiB, 0x21);            // granted before allocate returned
  const auto access = calls(platform_op::set_access);
  void* q = pool.allocate(8 * MiB);
  EXPECT_EQ(gated.waits().size(), 1u) << "kept asking a stream to wait";
  EXPECT_EQ(calls(platform_op::set_access), access + 1);
  fill(q, 8 * MiB, 0x22);
  EXPECT_TRUE(holds(p, 4 * MiB, 0x21));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(q, 8 * MiB);
  pool.deallocate(p, 4 * MiB);
}

// Threads and streams hammer a small pool with the worker on: every block's bytes are its
// own, and the pool's invariants hold afterwards.
TEST_F(MapWorker, ThreadsAndStreamsNeverShareABlock) {
  pool_options o = with_worker();
  o.limit_bytes = 96 * MiB;  // tight: pages are reclaimed and remapped all the time
  vmm_page_pool pool(sim, 0, o);
  std::vector<stream_handle> streams;
  for (int t = 0; t < 4; ++t) streams.push_back(make_stream());
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(t + 1);
      std::vector<std::pair<void*, std::size_t>> mine;
      for (int i = 0; i < 400; ++i) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        if (mine.size() < 4 && (x & 1)) {
          const std::size_t size = (x >> 8) % (5 * MiB) + 1;
          try {
            void* p = pool.allocate(size, 256, streams[static_cast<std::size_t>(t)]);
            fill(p, size, static_cast<unsigned char>(t + 1));
            mine.emplace_back(p, size);
          } catch (const out_of_memory&) {
          }
        } else if (!mine.empty()) {
          auto [p, size] = mine.back();
          mine.pop_back();
          if (!holds(p, size, static_cast<unsigned char>(t + 1))) bad.fetch_add(1);
          pool.deallocate(p, size, streams[static_cast<std::size_t>(t)]);
        }
      }
      for (auto [p, size] : mine) {
        if (!holds(p, size, static_cast<unsigned char>(t + 1))) bad.fetch_add(1);
        pool.deallocate(p, size, streams[static_cast<std::size_t>(t)]);
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (auto s : streams) pool.release_stream(s);
}

}  // namespace
