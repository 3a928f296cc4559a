// The pools' per-thread caches (pool_options::thread_cache, src/pool/core/thread_cache.hpp):
// the fast path takes no pool lock, keeps stream order, gives its blocks back before the
// pool grows, trims or reports, and refuses bad frees as the locked path does.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/core/overhead.hpp"
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

class ThreadCache : public gpumem_test::sim_pool_test {};

// Runs f on a thread of its own and waits for it.
template <class F>
void on_another_thread(F&& f) {
  std::thread t(std::forward<F>(f));
  t.join();
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST_F(ThreadCache, TheFastPathTakesNoPoolLock) {
  vmm_page_pool pool(sim, 0);
  std::promise<void> ready, go;
  std::promise<void*> done;
  std::thread worker([&] {
    void* p = pool.allocate(MiB);
    pool.deallocate(p, MiB);  // now in this thread's cache
    ready.set_value();
    go.get_future().wait();
    void* again = pool.allocate(MiB);  // the pool's mutex is held by the main thread now
    pool.deallocate(again, MiB);
    done.set_value(again);
  });
  ready.get_future().wait();
  bool finished = false;
  void* again = nullptr;
  // inspect() holds the pool's mutex while its function runs.
  pool.inspect([&](const std::vector<memory_segment>&) {
    go.set_value();
    auto f = done.get_future();
    finished = f.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
    if (finished) again = f.get();
  });
  worker.join();
  EXPECT_TRUE(finished) << "an allocation from the thread's own cache waited for the pool lock";
  EXPECT_NE(again, nullptr);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, ABlockInAThreadCacheIsReusedOnlyOnTheStreamThatFreedIt) {
  vmm_page_pool pool(sim, 0);
  const stream_handle s1 = make_stream(), s2 = make_stream();
  sim.hold_events(true);
  void* p = pool.allocate(MiB, default_alignment, s1);
  pool.deallocate(p, MiB, s1);
  void* other = pool.allocate(MiB, default_alignment, s2);
  EXPECT_FALSE(overlaps(other, MiB, p, MiB))
      << "s2 got memory whose last use on s1 is not known complete";
  void* again = pool.allocate(MiB, default_alignment, s1);
  EXPECT_EQ(again, p) << "the freeing stream reuses its block at once";
  pool.deallocate(other, MiB, s2);
  pool.deallocate(again, MiB, s1);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  sim.hold_events(false);
}

// A near fit: a kept block up to 1/16 larger than the request serves it from the thread's
// cache, on its own stream only, while the bytes handed out beyond the live bytes stay
// within 1/32 of them (pool_base::near_fit_limit).
TEST_F(ThreadCache, ASlightlyLargerKeptBlockServesARequestOnItsStream) {
  vmm_page_pool pool(sim, 0, pool_options::parse("small_classes:0"));  // 512-byte units
  void* ballast = pool.allocate(64 * MiB);  // live bytes, so the waste allowance is not the limit
  void* p = pool.allocate(100 * KiB);
  pool.deallocate(p, 100 * KiB);
  void* q = pool.allocate(97 * KiB);
  EXPECT_EQ(q, p) << "a block 3% larger, kept by this thread, was not reused";
  const resource_stats s = pool.stats();
  EXPECT_EQ(s.live_bytes, 64 * MiB + 97 * KiB);
  EXPECT_EQ(pool.peak_allocated_block_bytes(), 64 * MiB + 100 * KiB)
      << "the block handed out is counted at its own size";
  pool.deallocate(q, 97 * KiB);
  // Over 1/16 larger: not a near fit (the block stays kept, another one is carved).
  void* r = pool.allocate(90 * KiB);
  EXPECT_NE(r, p);
  EXPECT_EQ(pool.bytes_in_arena(false).allocated + pool.bytes_in_arena(true).allocated,
            64 * MiB + 90 * KiB);
  pool.deallocate(r, 90 * KiB);
  pool.deallocate(ballast, 64 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, ANearFitNeverCrossesStreamsOrTheWasteAllowance) {
  vmm_page_pool pool(sim, 0);
  const stream_handle s1 = make_stream(), s2 = make_stream();
  sim.hold_events(true);
  void* ballast = pool.allocate(64 * MiB, default_alignment, s1);
  void* p = pool.allocate(100 * KiB, default_alignment, s1);
  pool.deallocate(p, 100 * KiB, s1);
  void* other = pool.allocate(99 * KiB, default_alignment, s2);
  EXPECT_FALSE(overlaps(other, 99 * KiB, p, 100 * KiB))
      << "s2 got memory whose last use on s1 is not known complete";
  pool.deallocate(other, 99 * KiB, s2);
  pool.deallocate(ballast, 64 * MiB, s1);
  sim.hold_events(false);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();

  // Alone in a pool, 96 KiB may waste at most 3 KiB (1/32): the kept 100 KiB block is
  // refused; 97 KiB may take it.
  vmm_page_pool alone(sim, 0);
  void* kept = alone.allocate(100 * KiB);
  alone.deallocate(kept, 100 * KiB);
  void* small = alone.allocate(96 * KiB);
  EXPECT_NE(small, kept) << "a near fit wasted more than 1/32 of the live bytes";
  alone.deallocate(small, 96 * KiB);
  void* fits = alone.allocate(97 * KiB);
  EXPECT_EQ(fits, kept);
  alone.deallocate(fits, 97 * KiB);
  EXPECT_TRUE(alone.is_valid()) << alone.validate();
}

// A large block freed on the fast path is not held in the thread's cache: it goes to its
// arena at once and merges with its free neighbours, so a larger request finds the run
// whole, with no page remapped and no new memory. (Kept unmerged, such blocks made
// vmm_page_pool gather pages for the runs they split: thread_cache.hpp.)
TEST_F(ThreadCache, LargeBlocksMergeAtOnceInsteadOfWaitingInTheCache) {
  vmm_page_pool pool(sim, 0);  // thread caches on (the default)
  void* a = pool.allocate(4 * MiB);
  void* b = pool.allocate(4 * MiB);
  void* c = pool.allocate(4 * MiB);
  const auto maps = sim.calls_made(platform_op::map);
  const auto reserved = pool.stats().reserved_bytes;
  pool.deallocate(a, 4 * MiB);
  pool.deallocate(b, 4 * MiB);
  EXPECT_EQ(explain_overhead(pool).cached, 0u) << "held in the thread cache";
  EXPECT_EQ(pool.largest_free_block(), 8 * MiB);
  void* joined = pool.allocate(8 * MiB);
  EXPECT_EQ(joined, a) << "the two freed neighbours did not serve as one run";
  EXPECT_EQ(sim.calls_made(platform_op::map), maps);
  EXPECT_EQ(pool.stats().reserved_bytes, reserved);
  // Small blocks are still kept for this thread: freed and asked for again, the same one.
  void* small = pool.allocate(64 * KiB);
  pool.deallocate(small, 64 * KiB);
  EXPECT_EQ(explain_overhead(pool).cached, 64 * KiB);
  EXPECT_EQ(pool.allocate(64 * KiB), small);
  pool.deallocate(small, 64 * KiB);
  pool.deallocate(joined, 8 * MiB);
  pool.deallocate(c, 4 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A thread whose requests its kept blocks rarely serve (sizes at random) stops keeping
// blocks for a while: its frees go to the arena, under the pool lock, like thread_cache:off.
TEST_F(ThreadCache, AThreadWhoseKeptBlocksRarelyFitStopsKeepingThem) {
  // 512-byte units: with size classes, the sizes below would share classes and fit.
  vmm_page_pool pool(sim, 0, pool_options::parse("small_classes:0"));
  std::promise<void> ready, go, freed;
  std::thread worker([&] {
    // 300 small requests, each a size no kept block can serve (each larger than every
    // before; all under small_threshold: only small requests' blocks are kept and counted).
    std::size_t size = 64 * KiB;
    for (int i = 0; i < 300; ++i, size += 2 * KiB) pool.deallocate(pool.allocate(size), size);
    void* p = pool.allocate(KiB);
    ready.set_value();
    go.get_future().wait();
    pool.deallocate(p, KiB);  // not kept: needs the pool lock, held by the main thread
    freed.set_value();
  });
  ready.get_future().wait();
  bool blocked = false;
  pool.inspect([&](const std::vector<memory_segment>&) {
    go.set_value();
    blocked = freed.get_future().wait_for(std::chrono::milliseconds(200)) ==
              std::future_status::timeout;
  });
  worker.join();
  EXPECT_TRUE(blocked) << "a free was kept in the thread cache although its blocks rarely fit";
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, WhatAnExitedThreadFreedIsReclaimedBeforeOutOfMemory) {
  pool_options o;
  o.limit_bytes = 8 * MiB;  // room for one 8 MiB segment only
  runtime_resource upstream(sim);
  caching_pool pool(upstream, o);
  void* first = nullptr;
  on_another_thread([&] {
    first = pool.allocate(8 * MiB);
    pool.deallocate(first, 8 * MiB);  // kept in that thread's cache, which outlives it
  });
  void* a = pool.allocate(4 * MiB);  // the cached 8 MiB block must be split for this
  void* b = pool.allocate(4 * MiB);
  EXPECT_TRUE(overlaps(a, 4 * MiB, first, 8 * MiB));
  EXPECT_TRUE(overlaps(b, 4 * MiB, first, 8 * MiB));
  EXPECT_EQ(pool.segment_count(), 1u);
  EXPECT_EQ(pool.stats().oom_count, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(a, 4 * MiB);
  pool.deallocate(b, 4 * MiB);
}

TEST_F(ThreadCache, AFreeOnAnotherThreadFindsTheAllocationAndASecondIsADoubleFree) {
  vmm_page_pool pool(sim, 0);
  void* p = nullptr;
  on_another_thread([&] { p = pool.allocate(3 * MiB); });
  EXPECT_EQ(pool.stats().live_allocations, 1u);
  pool.deallocate(p, 3 * MiB);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_EQ(pool.stats().live_allocations, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  const std::string why = error_of([&] { pool.deallocate(p, 3 * MiB); });
  EXPECT_NE(why.find("double free"), std::string::npos) << why;
  // And from the allocating side: a pointer freed on its own thread's fast path.
  void* q = pool.allocate(MiB);
  pool.deallocate(q, MiB);
  std::string again;
  on_another_thread([&] { again = error_of([&] { pool.deallocate(q, MiB); }); });
  EXPECT_NE(again.find("double free"), std::string::npos) << again;
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, ASizeMismatchIsRefusedAndTheAllocationStaysLive) {
  vmm_page_pool pool(sim, 0);
  void* p = pool.allocate(MiB);
  EXPECT_THROW(pool.deallocate(p, 2 * MiB), invalid_argument);
  const std::string why = error_of([&] { pool.deallocate(p, MiB + 1); });
  EXPECT_NE(why.find("size mismatch"), std::string::npos) << why;
  EXPECT_EQ(pool.stats().live_bytes, MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(p, MiB);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
}

TEST_F(ThreadCache, TrimGivesBackWhatThreadsKeep) {
  vmm_page_pool pool(sim, 0);
  on_another_thread([&] {
    void* p = pool.allocate(64 * MiB);
    pool.deallocate(p, 64 * MiB);
  });
  EXPECT_GE(pool.stats().reserved_bytes, 64 * MiB);
  pool.trim();
  EXPECT_EQ(pool.stats().reserved_bytes, 0u) << "a thread's cached block pinned its pages";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, ReportsCountAThreadsFreedBlockAsCachedNotLive) {
  vmm_page_pool pool(sim, 0);
  void* p = pool.allocate(MiB);
  pool.deallocate(p, MiB);
  const resource_stats s = pool.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.cached_bytes, s.reserved_bytes);
  bool seen = false;
  for (const memory_segment& seg : pool.memory_segments())
    for (const memory_block& b : seg.blocks)
      if (b.address == reinterpret_cast<std::uintptr_t>(p)) {
        seen = true;
        EXPECT_EQ(b.st, memory_block::state::cached);
        EXPECT_EQ(b.requested, 0u);
      }
  EXPECT_TRUE(seen);
  EXPECT_EQ(pool.bytes_in_arena(false).allocated + pool.bytes_in_arena(true).allocated, 0u);
  EXPECT_TRUE(pool.biggest_live(10).empty());
}

TEST_F(ThreadCache, StatsCountEveryThreadsCalls) {
  vmm_page_pool pool(sim, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&pool, t] {
      const std::size_t n = MiB + static_cast<std::size_t>(t) * KiB;
      for (int i = 0; i < 1000; ++i) pool.deallocate(pool.allocate(n), n);
    });
  for (auto& t : threads) t.join();
  const resource_stats s = pool.stats();
  EXPECT_EQ(s.allocations, 4000u);
  EXPECT_EQ(s.deallocations, 4000u);
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.live_allocations, 0u);
  // With several threads a peak may miss what other threads have not published yet (each
  // under pool_base::stats_slack), never more than was live at once.
  EXPECT_GE(s.peak_live_bytes, MiB);
  EXPECT_LE(s.peak_live_bytes, 4 * MiB + 6 * KiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, PeaksAreExactWhileOneThreadUsesThePool) {
  vmm_page_pool pool(sim, 0);
  void* a = pool.allocate(3 * MiB);
  void* b = pool.allocate(5 * MiB + 7);
  pool.deallocate(a, 3 * MiB);
  pool.deallocate(b, 5 * MiB + 7);
  void* c = pool.allocate(KiB);
  EXPECT_EQ(pool.stats().peak_live_bytes, 8 * MiB + 7);
  EXPECT_EQ(pool.stats().live_bytes, KiB);
  EXPECT_EQ(pool.peak_allocated_block_bytes(), 8 * MiB + 512);
  pool.deallocate(c, KiB);
}

// A cache hit counts in the cache (pending bytes); a call holding the pool lock counts in
// the pool's own locked totals (pool_base::count): one block may be counted in both.
TEST_F(ThreadCache, TotalsStayExactWhereTheCacheAndTheLockedPathCountOneBlock) {
  vmm_page_pool pool(sim, 0);
  void* warm = pool.allocate(256 * KiB);
  pool.deallocate(warm, 256 * KiB);
  void* small = pool.allocate(256 * KiB);  // from this thread's cache
  EXPECT_EQ(small, warm);
  void* large = pool.allocate(6 * MiB);  // under the pool lock
  EXPECT_EQ(pool.stats().live_bytes, 6 * MiB + 256 * KiB);
  EXPECT_EQ(pool.stats().peak_live_bytes, 6 * MiB + 256 * KiB);
  on_another_thread([&] { pool.deallocate(small, 256 * KiB); });  // the locked path
  EXPECT_EQ(pool.stats().live_bytes, 6 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(large, 6 * MiB);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_EQ(pool.stats().peak_live_bytes, 6 * MiB + 256 * KiB);
  EXPECT_EQ(pool.peak_allocated_block_bytes(), 6 * MiB + 256 * KiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A thread's first small block comes through the locked path and its free through the
// cache: both count in that cache (pool_base::count), so another thread's peak never sees
// the first without the second (the H200, 4 threads, caught a peak of 5 MiB of 4 live).
TEST_F(ThreadCache, APeakNeverCountsBytesAlreadyFreed) {
  vmm_page_pool pool(sim, 0);
  on_another_thread([&] {
    void* s = pool.allocate(256 * KiB);  // the thread's first call: the locked path
    pool.deallocate(s, 256 * KiB);        // into its cache
  });
  void* l = pool.allocate(3 * MiB);
  EXPECT_EQ(pool.stats().peak_live_bytes, 3 * MiB) << "the other thread's block was freed first";
  pool.deallocate(l, 3 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, BlocksFreedAcrossThreadsStayIntact) {
  // Threads allocate into a shared list and free entries that others allocated, checking
  // each block's pattern first: a block handed out twice breaks some pattern.
  vmm_page_pool pool(sim, 0);
  struct held {
    void* p;
    std::size_t n;
    unsigned char byte;
  };
  std::mutex m;
  std::vector<held> shared;
  std::atomic<int> corrupted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(77 + static_cast<std::uint64_t>(t));
      for (int i = 0; i < 2000; ++i) {
        held h{};
        bool do_free = false;
        {
          std::lock_guard lock(m);
          if (shared.size() > 48 || (!shared.empty() && rng() % 2 == 0)) {
            const std::size_t k = rng() % shared.size();
            h = shared[k];
            shared[k] = shared.back();
            shared.pop_back();
            do_free = true;
          }
        }
        if (do_free) {
          if (!holds(h.p, h.n, h.byte)) corrupted.fetch_add(1);
          pool.deallocate(h.p, h.n);
        } else {
          static constexpr std::size_t sizes[] = {512, 4 * KiB, 100 * KiB, MiB, 3 * MiB};
          h.n = sizes[rng() % 5];
          h.byte = static_cast<unsigned char>(rng());
          h.p = pool.allocate(h.n);
          fill(h.p, h.n, h.byte);
          std::lock_guard lock(m);
          shared.push_back(h);
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(corrupted.load(), 0);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (const held& h : shared) pool.deallocate(h.p, h.n);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, ReleasingAStreamRetagsBlocksFreedOnItInThreadCaches) {
  vmm_page_pool pool(sim, 0);
  const stream_handle s = make_stream();
  void* p = pool.allocate(MiB, default_alignment, s);
  pool.deallocate(p, MiB, s);  // in this thread's cache, tagged with s
  pool.release_stream(s);
  // The stream may now be destroyed; its block serves the default stream without any
  // call on the dead stream.
  void* q = pool.allocate(MiB);
  EXPECT_EQ(q, p);
  pool.deallocate(q, MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, ASlotLeftByADestroyedPoolNeverMatchesALaterOne) {
  for (int round = 0; round < 3; ++round) {
    // Later pools often take the same address as the destroyed one.
    vmm_page_pool pool(sim, 0);
    void* p = pool.allocate(MiB);
    pool.deallocate(p, MiB);
    void* again = pool.allocate(MiB);
    EXPECT_EQ(pool.stats().allocations, 2u) << "round " << round;
    pool.deallocate(again, MiB);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
}

struct counting_observer : pool_observer {
  std::atomic<int> allocs{0}, frees{0};
  void on_event(const pool_event& e) noexcept override {
    if (e.kind == pool_event_kind::alloc) allocs.fetch_add(1);
    if (e.kind == pool_event_kind::free) frees.fetch_add(1);
  }
};

TEST_F(ThreadCache, AnAttachedObserverSeesEveryCall) {
  vmm_page_pool pool(sim, 0);
  void* p = pool.allocate(MiB);
  pool.deallocate(p, MiB);  // cached in this thread before the observer comes
  counting_observer seen;
  pool.set_observer(&seen);
  for (int i = 0; i < 10; ++i) pool.deallocate(pool.allocate(MiB), MiB);
  pool.set_observer(nullptr);
  EXPECT_EQ(seen.allocs.load(), 10);
  EXPECT_EQ(seen.frees.load(), 10);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(ThreadCache, TheOptionParsesAndOffKeepsEveryCallCorrect) {
  EXPECT_FALSE(pool_options::parse("thread_cache:off").thread_cache);
  EXPECT_TRUE(pool_options::parse("thread_cache:on").thread_cache);
  EXPECT_TRUE(pool_options{}.thread_cache);
  EXPECT_THROW(pool_options::parse("thread_cache:maybe"), invalid_argument);
  EXPECT_NE(pool_options::parse("thread_cache:off").to_string().find("thread_cache:off"),
            std::string::npos);
  pool_options o;
  o.thread_cache = false;
  vmm_page_pool pool(sim, 0, o);
  EXPECT_EQ(gpumem_test::run_pool_stress(pool, 4, 500, 64 * KiB, 8 * MiB), 0);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

}  // namespace
