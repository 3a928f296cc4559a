// vmm_page_pool with map_worker:on (sim, 1 GiB, 2 MiB pages): the old mappings of remapped
// pages are unmapped on a helper thread, and their address space is reused only after that.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::fill;
using gpumem_test::holds;
using gpumem_test::KiB;
using gpumem_test::MiB;
using gpumem_test::overlaps;

pool_options with_worker() {
  pool_options o = gpumem_test::tight_footprint();
  o.map_worker = map_worker_mode::on;
  return o;
}

class MapWorker : public gpumem_test::sim_pool_test {
 protected:
  // Frees remap_once's blocks (below), gives everything back, and checks nothing is left:
  // no mapping, old or new, and no reserved byte.
  void free_remap_and_expect_nothing_held(vmm_page_pool& pool, void* big,
                                          const std::vector<void*>& blocks) {
    pool.deallocate(big, 16 * MiB);
    for (int i = 1; i < 8; i += 2) pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB);
    pool.trim();
    EXPECT_EQ(sim.live_objects().mappings, 0u);
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  }
};

TEST(MapWorkerOption, ParsesAutoOnOffAndRefusesOthers) {
  EXPECT_EQ(pool_options{}.map_worker, map_worker_mode::automatic);
  EXPECT_EQ(pool_options::parse("map_worker:on").map_worker, map_worker_mode::on);
  EXPECT_EQ(pool_options::parse("map_worker:off").map_worker, map_worker_mode::off);
  EXPECT_EQ(pool_options::parse("map_worker:auto").map_worker, map_worker_mode::automatic);
  EXPECT_NE(pool_options::parse("map_worker:on").to_string().find("map_worker:on"), std::string::npos);
  EXPECT_THROW(pool_options::parse("map_worker:sometimes"), invalid_argument);
}

// With the worker, growth is unchanged: mapped and granted on the allocating thread.
TEST_F(MapWorker, GrowthIsMappedAndGrantedOnTheAllocatingThread) {
  vmm_page_pool pool(sim, 0, with_worker());
  const auto access = calls(platform_op::set_access);
  void* p = pool.allocate(7 * MiB);
  EXPECT_EQ(calls(platform_op::set_access), access + 1);
  fill(p, 7 * MiB, 0x5a);  // faults if not granted
  EXPECT_TRUE(holds(p, 7 * MiB, 0x5a));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(p, 7 * MiB);
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

// A platform whose unmaps block until the test opens a gate: it shows which thread unmaps.
class gated_platform final : public platform {
 public:
  explicit gated_platform(sim_platform& inner) : inner_(inner) {}
  void open() { open_.store(true); }
  bool unmap_waiting() const { return unmap_waiting_.load(); }
  std::vector<std::thread::id> unmap_threads() const {
    std::lock_guard lock(mutex_);
    return unmap_threads_;
  }
  // From now on each access grant first gives the worker 100 ms to reach the gate with an
  // unmap already queued (a thread's wake-up takes far less).
  void let_unmaps_catch_up() { catch_up_.store(true); }
  // For each access grant, in order: whether an unmap was blocked in the gate meanwhile
  // (on the H200, the driver makes the grant wait for it).
  std::vector<bool> grants_beside_an_unmap() const {
    std::lock_guard lock(mutex_);
    return grants_beside_unmap_;
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
  status unmap(std::uintptr_t va, std::size_t s) override {
    {
      std::lock_guard lock(mutex_);
      unmap_threads_.push_back(std::this_thread::get_id());
    }
    unmap_waiting_.store(true);
    while (!open_.load()) std::this_thread::yield();
    unmap_waiting_.store(false);
    return inner_.unmap(va, s);
  }
  status set_access(int d, std::uintptr_t va, std::size_t s) override {
    for (int i = 0; catch_up_.load() && i < 100 && !unmap_waiting_.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    {
      std::lock_guard lock(mutex_);
      grants_beside_unmap_.push_back(unmap_waiting_.load());
    }
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
  result<int> stream_device(stream_handle s) override { return inner_.stream_device(s); }
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

 private:
  sim_platform& inner_;
  std::atomic<bool> open_{false};
  std::atomic<bool> unmap_waiting_{false};
  std::atomic<bool> catch_up_{false};
  mutable std::mutex mutex_;
  std::vector<std::thread::id> unmap_threads_;
  std::vector<bool> grants_beside_unmap_;
};

// Opens the gate however a test's block ends, before the pool's end waits for its worker
// (declared after the pool, so destroyed first).
struct gate_opener {
  gated_platform& g;
  ~gate_opener() { g.open(); }
};

// The access grants made since the first `since` ran with no worker unmap beside them, and
// the unmaps held back meanwhile reached the worker afterwards (it waits in the gate now).
void expect_grants_alone_then_unmaps_queued(const gated_platform& gated, std::size_t since) {
  const std::vector<bool> grants = gated.grants_beside_an_unmap();
  ASSERT_GT(grants.size(), since) << "the growth granted no access";
  for (std::size_t i = since; i < grants.size(); ++i)
    EXPECT_FALSE(grants[i]) << "access grant " << i << " ran while the worker unmapped";
  for (int i = 0; i < 1000 && !gated.unmap_waiting(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(gated.unmap_waiting()) << "the old mappings' unmaps were never queued";
}

// Frees every other one of eight 4 MiB blocks, then asks for 16 MiB: a remap of the freed
// pages. Returns the big block; `blocks` keeps the live ones.
void* remap_once(vmm_page_pool& pool, std::vector<void*>& blocks) {
  for (int i = 0; i < 8; ++i) {
    blocks.push_back(pool.allocate(4 * MiB));
    fill(blocks.back(), 4 * MiB, static_cast<unsigned char>(i + 1));
  }
  for (int i = 0; i < 8; i += 2) pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB);
  return pool.allocate(16 * MiB);
}

// Who unmaps the old mapping of a remap: the allocating thread by default on sim ("auto":
// no driver time to hide), the worker with map_worker:on.
TEST_F(MapWorker, SimDefaultsToUnmappingOnTheAllocatingThread) {
  for (const bool worker : {false, true}) {
    SCOPED_TRACE(worker ? "map_worker:on" : "defaults");
    gated_platform gated(sim);
    gated.open();
    vmm_page_pool pool(gated, 0, worker ? with_worker() : gpumem_test::tight_footprint());
    std::vector<void*> blocks;
    void* big = remap_once(pool, blocks);
    pool.trim();  // waits for the worker
    const auto threads = gated.unmap_threads();
    ASSERT_FALSE(threads.empty()) << "the remap unmapped nothing";
    EXPECT_EQ(threads.front() == std::this_thread::get_id(), !worker);
    pool.deallocate(big, 16 * MiB);
    for (int i = 1; i < 8; i += 2) pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB);
  }
}

// A remap returns while the old mapping's unmap is still blocked in the driver: the unmap
// is on the worker, not the allocating thread. Until it is done that address space is not
// reused; trim() waits for it.
TEST_F(MapWorker, ARemapReturnsBeforeTheOldMappingIsUnmapped) {
  gated_platform gated(sim);
  {
    vmm_page_pool pool(gated, 0, with_worker());
    gate_opener open_at_exit{gated};
    std::vector<void*> blocks;
    void* big = remap_once(pool, blocks);  // the four freed blocks' pages, remapped
    EXPECT_EQ(pool.stats().reserved_bytes, 32 * MiB) << "new memory instead of a remap";
    fill(big, 16 * MiB, 0xB1);
    for (int i = 1; i < 8; i += 2)
      EXPECT_TRUE(holds(blocks[static_cast<std::size_t>(i)], 4 * MiB, static_cast<unsigned char>(i + 1)));
    // The worker is stuck in the first old mapping's unmap; allocate returned all the same.
    for (int i = 0; i < 1000 && !gated.unmap_waiting(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_TRUE(gated.unmap_waiting()) << "no unmap was queued to the worker";
    for (int i = 1; i < 8; i += 2)
      EXPECT_FALSE(overlaps(big, 16 * MiB, blocks[static_cast<std::size_t>(i)], 4 * MiB));
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    EXPECT_GT(sim.live_objects().mappings, pool.page_counts().mapped_pages)
        << "old mappings should still exist beside the new ones";
    gated.open();
    free_remap_and_expect_nothing_held(pool, big, blocks);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
}

// A growth that gathers pages maps them and grants access before the worker is given the
// old mappings' unmaps: the driver serializes the calls, and a map beside the worker's
// unmaps took ~21-25 us on the H200 against ~1 us alone (vmm_worker.hpp). Here the worker's
// unmap blocks in the gate until the test opens it, so a grant made after the job was
// queued would find it waiting.
TEST_F(MapWorker, AGrowthGrantsAccessBeforeTheWorkerUnmapsTheOldMappings) {
  gated_platform gated(sim);
  {
    vmm_page_pool pool(gated, 0, with_worker());
    gate_opener open_at_exit{gated};
    std::vector<void*> blocks;
    for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(4 * MiB));
    for (int i = 0; i < 8; i += 2) pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB);
    const std::size_t grants_before = gated.grants_beside_an_unmap().size();
    gated.let_unmaps_catch_up();
    void* big = pool.allocate(16 * MiB);  // gathers the four freed blocks' pages
    EXPECT_GT(pool.page_counts().pages_reclaimed, 0u) << "no remap";
    expect_grants_alone_then_unmaps_queued(gated, grants_before);
    gated.open();
    free_remap_and_expect_nothing_held(pool, big, blocks);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
}

// Old mappings whose last use was still running when they were gathered wait in the pool;
// the next growth finds that use complete as it starts. It hands them to the worker only
// once it has mapped and granted its own pages, as for its own gather's (the test above).
TEST_F(MapWorker, AGrowthHandsOverOldMappingsFoundDoneAsItStartsOnlyAfterItsGrant) {
  gated_platform gated(sim);
  {
    vmm_page_pool pool(gated, 0, with_worker());
    gate_opener open_at_exit{gated};
    const stream_handle s1 = make_stream();
    sim.hold_events(true);  // the frees below are not known complete
    std::vector<void*> blocks;
    for (int i = 0; i < 8; ++i) blocks.push_back(pool.allocate(4 * MiB, default_alignment, s1));
    for (int i = 0; i < 8; i += 2)
      pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB, s1);
    void* big = pool.allocate(16 * MiB, default_alignment, s1);  // gathers them, deferred
    ASSERT_EQ(pool.page_counts().pages_reclaimed, 8u) << "no remap of the freed pages";
    EXPECT_FALSE(gated.unmap_waiting()) << "an old mapping was queued while its use may run";
    sim.complete_events();
    const std::size_t grants_before = gated.grants_beside_an_unmap().size();
    gated.let_unmaps_catch_up();
    void* more = pool.allocate(6 * MiB, default_alignment, s1);  // new pages: a growth
    expect_grants_alone_then_unmaps_queued(gated, grants_before);
    gated.open();
    sim.hold_events(false);
    pool.deallocate(more, 6 * MiB, s1);
    pool.deallocate(big, 16 * MiB, s1);
    for (int i = 1; i < 8; i += 2)
      pool.deallocate(blocks[static_cast<std::size_t>(i)], 4 * MiB, s1);
    pool.trim();
    EXPECT_EQ(sim.live_objects().mappings, 0u);
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
}

// An unmap that fails on the worker fails no call: the old mapping stays (its address space
// out of use), is counted, and the pool's next call unmaps it on its own thread.
TEST_F(MapWorker, AFailedUnmapOnTheWorkerFailsNoCallAndIsRetriedByTheCaller) {
  gated_platform gated(sim);
  gated.open();
  vmm_page_pool pool(gated, 0, with_worker());
  sim.inject_fault(platform_op::unmap, sim_fault{.nth = 1, .kind = failure_kind::driver_error});
  std::vector<void*> blocks;
  void* big = remap_once(pool, blocks);  // the worker's first unmap fails
  fill(big, 16 * MiB, 0xB1);
  void* more = nullptr;
  ASSERT_NO_THROW(more = pool.allocate(6 * MiB)) << "an allocation paid for the worker's failure";
  ASSERT_NO_THROW(pool.trim());  // collects the failure, and retries it here
  EXPECT_EQ(pool.page_counts().unmap_failures, 1u);
  // One-page chunks: each mapped once, unless an old mapping were still there.
  EXPECT_EQ(sim.live_objects().mappings, pool.page_counts().mapped_pages)
      << "the failed unmap was not retried";
  // The retry may run while the worker still unmaps the other runs: count, not order.
  const auto threads = gated.unmap_threads();
  EXPECT_EQ(std::count(threads.begin(), threads.end(), std::this_thread::get_id()), 1)
      << "the retry went back to the worker";
  EXPECT_TRUE(holds(big, 16 * MiB, 0xB1));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(more, 6 * MiB);
  free_remap_and_expect_nothing_held(pool, big, blocks);
}

// The worker unmaps one mapping per call, from the top of each old run down; where one
// fails, the mappings above it are gone and give their address space back, and the caller
// retries only those below.
TEST_F(MapWorker, TheWorkerUnmapsOneMappingPerCallAndKeepsWhatAFailureLeft) {
  gated_platform gated(sim);
  gated.open();
  vmm_page_pool pool(gated, 0, with_worker());
  // The first old run (a freed 4 MiB block: two one-page mappings): its top page unmaps,
  // the one below fails.
  sim.inject_fault(platform_op::unmap, sim_fault{.nth = 2, .kind = failure_kind::driver_error});
  std::vector<void*> blocks;
  void* big = remap_once(pool, blocks);  // four old runs of two mappings each
  ASSERT_NO_THROW(pool.trim());          // waits for the worker, retries the failure here
  const auto threads = gated.unmap_threads();
  ASSERT_EQ(threads.size(), 9u) << "8 mappings one call each, and the one retry";
  // The retry may run while the worker still unmaps the other runs: count, not order.
  EXPECT_EQ(std::count(threads.begin(), threads.end(), std::this_thread::get_id()), 1)
      << "the worker's 8 calls and one retry on this thread";
  EXPECT_EQ(pool.page_counts().unmap_failures, 1u) << "the retry unmapped a page twice";
  EXPECT_EQ(sim.live_objects().mappings, pool.page_counts().mapped_pages);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  free_remap_and_expect_nothing_held(pool, big, blocks);
}

// When the caller's retry fails too, allocations still go on; the calls that need old
// mappings gone (trim) throw, and succeed once the driver does.
TEST_F(MapWorker, AnUnmapThatKeepsFailingIsThrownOnlyByTrim) {
  vmm_page_pool pool(sim, 0, with_worker());
  sim.inject_fault(platform_op::unmap,
                   sim_fault{.nth = 1, .every_after = true, .kind = failure_kind::driver_error});
  std::vector<void*> blocks;
  void* big = remap_once(pool, blocks);
  fill(big, 16 * MiB, 0xB2);
  std::vector<void*> more;
  for (int i = 0; i < 4; ++i) ASSERT_NO_THROW(more.push_back(pool.allocate(2 * MiB)));
  try {
    pool.trim();
    ADD_FAILURE() << "trim left an old mapping it could not unmap and said nothing";
  } catch (const cuda_error& e) {
    EXPECT_NE(std::string(e.what()).find("unmap"), std::string::npos) << e.what();
  }
  EXPECT_GE(pool.page_counts().unmap_failures, 2u);  // the worker's and trim's retry
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  EXPECT_TRUE(holds(big, 16 * MiB, 0xB2));
  sim.clear_faults();
  EXPECT_NO_THROW(pool.trim());
  for (void* p : more) pool.deallocate(p, 2 * MiB);
  free_remap_and_expect_nothing_held(pool, big, blocks);
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
