// explain_overhead: a pool's reserved bytes split into requested, rounding, cached, free
// (sharing a page or segment with live blocks, or not) and kept pages, the parts summing
// to reserved; the request shapes whose rounding costs most, biggest first.
#include "gpumem/pool/core/overhead.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpumem/backend/backends.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::KiB;
using gpumem_test::MiB;

class PoolOverhead : public gpumem_test::sim_pool_test {};

std::size_t parts(const overhead_breakdown& o) {
  return o.requested + o.unit_rounding + o.block_rounding + o.cached + o.free_pinned +
         o.free_releasable + o.kept_unmapped + o.other;
}

pool_options no_thread_cache() {
  pool_options o;
  o.thread_cache = false;  // a freed block merges at once: free, not cached
  return o;
}

TEST_F(PoolOverhead, PageRoundingAndItsRequestShapeAreNamed) {
  vmm_page_pool pool(sim, 0, no_thread_cache());
  void* base = pool.allocate(64 * MiB);         // live bytes that can absorb a rounding loss
  void* a = pool.allocate(5 * MiB + 1000);      // rounded to 6 MiB: whole pages
  void* b = pool.allocate(5 * MiB + 1000);
  void* small = pool.allocate(1000);            // a 1024-byte block in the small arena's page
  const overhead_breakdown o = explain_overhead(pool);
  EXPECT_EQ(o.allocator, "vmm_page_pool");
  EXPECT_EQ(o.page_size, 2 * MiB);
  EXPECT_EQ(o.reserved, pool.stats().reserved_bytes);
  EXPECT_EQ(o.requested, 64 * MiB + 2 * (5 * MiB + 1000) + 1000);
  EXPECT_EQ(o.unit_rounding, 2 * 24u + 24u);  // 5 MiB + 1000 -> 5 MiB + 1024; 1000 -> 1024
  EXPECT_EQ(o.block_rounding, 2 * (MiB - 1024));
  ASSERT_EQ(o.largest_losses.size(), 1u);
  EXPECT_EQ(o.largest_losses[0].requested, 5 * MiB + 1000);
  EXPECT_EQ(o.largest_losses[0].block, 6 * MiB);
  EXPECT_EQ(o.largest_losses[0].count, 2u);
  EXPECT_EQ(o.largest_losses[0].bytes(), 2 * (MiB - 1000));
  // The small arena's page holds the 1 KiB block: the rest of it is free but pinned.
  EXPECT_EQ(o.free_pinned, 2 * MiB - 1024);
  EXPECT_EQ(o.free_in_small_arena, 2 * MiB - 1024);
  EXPECT_EQ(o.free_releasable, 0u);
  EXPECT_EQ(o.cached, 0u);
  EXPECT_EQ(parts(o), o.reserved);
  EXPECT_EQ(o.other, 0u);
  EXPECT_NEAR(o.ratio(), static_cast<double>(o.reserved) / static_cast<double>(o.requested), 1e-12);
  const std::string text = o.to_string();
  EXPECT_NE(text.find("2 x 5.00 MiB in 6.00 MiB blocks"), std::string::npos) << text;
  pool.deallocate(base, 64 * MiB);
  pool.deallocate(a, 5 * MiB + 1000);
  pool.deallocate(b, 5 * MiB + 1000);
  pool.deallocate(small, 1000);
}

// The pool's own out-of-memory report (the C++ exception, so also the C API, the PyTorch
// plug-in and Python) ends with the same breakdown, read under the pool's lock.
TEST_F(PoolOverhead, AnOutOfMemoryReportEndsWithWhereTheReservedBytesGo) {
  pool_options options = no_thread_cache();
  options.limit_bytes = 80 * MiB;
  vmm_page_pool pool(sim, 0, options);
  void* base = pool.allocate(64 * MiB);
  void* a = pool.allocate(5 * MiB + 1000);  // rounded to 6 MiB: whole pages
  void* b = pool.allocate(5 * MiB + 1000);
  std::string what;
  try {
    (void)pool.allocate(8 * MiB);  // 76 MiB reserved + 8 MiB is over the limit
    ADD_FAILURE() << "an allocation over the limit did not throw";
  } catch (const out_of_memory& e) {
    what = e.what();
  }
  const std::size_t at = what.find("  where the reserved bytes go now:\n");
  ASSERT_NE(at, std::string::npos) << what;
  const std::string breakdown = explain_overhead(pool).to_string("    ");
  EXPECT_EQ(what.substr(at + std::string("  where the reserved bytes go now:\n").size()), breakdown);
  EXPECT_NE(breakdown.find("2 x 5.00 MiB in 6.00 MiB blocks"), std::string::npos) << breakdown;
  EXPECT_EQ(pool.validate(), "");
  pool.deallocate(b, 5 * MiB + 1000);
  pool.deallocate(a, 5 * MiB + 1000);
  pool.deallocate(base, 64 * MiB);
}

// A caching_pool out of memory with enough free bytes, but in pieces around a live block,
// says so and names what would join them; with too few free bytes it does not.
TEST_F(PoolOverhead, ACachingPoolOutOfMemoryInFreePiecesSaysWhatJoinsThem) {
  runtime_resource upstream(sim, 0);
  pool_options options = no_thread_cache();
  options.limit_bytes = 64 * MiB;
  caching_pool pool(upstream, options);
  pool.deallocate(pool.allocate(60 * MiB), 60 * MiB);  // one 60 MiB segment, cached
  void* a = pool.allocate(20 * MiB);                   // split from it: a | b | c
  void* b = pool.allocate(20 * MiB);
  void* c = pool.allocate(20 * MiB);
  ASSERT_EQ(pool.stats().reserved_bytes, 60 * MiB);
  pool.deallocate(a, 20 * MiB);
  pool.deallocate(c, 20 * MiB);  // 40 MiB free, in two pieces around b
  auto report_of = [&](std::size_t bytes) {
    try {
      (void)pool.allocate(bytes);
      ADD_FAILURE() << "an allocation of " << bytes << " bytes over the limit did not throw";
    } catch (const out_of_memory& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string split = report_of(30 * MiB);
  EXPECT_NE(split.find("40.00 MiB of it is free, enough for the request, but in pieces: a "
                       "caching_pool cannot join"),
            std::string::npos)
      << split;
  EXPECT_NE(split.find("allocator:vmm_page_pool"), std::string::npos) << split;
  const std::string short_of_bytes = report_of(50 * MiB);  // more than the 40 MiB free
  EXPECT_EQ(short_of_bytes.find("in pieces"), std::string::npos) << short_of_bytes;
  EXPECT_EQ(pool.validate(), "");
  pool.deallocate(b, 20 * MiB);
}

// A multi-page handle goes back whole: its free pages are releasable only once none of its
// pages holds a block. Checked against trim, which gives back exactly the releasable bytes:
// footprint:fast's handle per growth, and big_chunk:4's 4-page handles.
TEST_F(PoolOverhead, AMultiPageHandleIsReleasableOnlyOnceAllItsPagesAreFree) {
  for (const char* conf : {"thread_cache:off", "thread_cache:off,big_chunk:4"}) {
    SCOPED_TRACE(conf);
    vmm_page_pool pool(sim, 0, pool_options::parse(conf));
    void* first = pool.allocate(16 * MiB);  // pages 0-7: one 8-page or two 4-page handles
    void* second = pool.allocate(3 * MiB);  // pages 8-9
    pool.deallocate(first, 16 * MiB);
    overhead_breakdown o = explain_overhead(pool);
    EXPECT_EQ(o.free_releasable, 16 * MiB) << "every page of the free handles is free";
    // The next block takes page 0: the handle holding it keeps its other pages.
    void* third = pool.allocate(MiB + 512);
    o = explain_overhead(pool);
    const std::size_t handle = std::string(conf).find("big_chunk") != std::string::npos ? 8 * MiB : 16 * MiB;
    EXPECT_EQ(o.free_releasable, 16 * MiB - handle);
    EXPECT_EQ(o.free_pinned, (handle - MiB - 512) + MiB);
    EXPECT_EQ(parts(o), o.reserved);
    EXPECT_EQ(pool.trim(), 16 * MiB - handle) << "trim gives back what the report calls releasable";
    o = explain_overhead(pool);
    EXPECT_EQ(o.free_releasable, 0u);
    EXPECT_EQ(parts(o), o.reserved);
    pool.deallocate(second, 3 * MiB);
    pool.deallocate(third, MiB + 512);
  }
}

TEST_F(PoolOverhead, FreeWholePagesAreReleasableAndPagesSharedWithALiveBlockAreNot) {
  pool_options one_page = no_thread_cache();
  one_page.huge_growth_bytes = 0;  // one page per handle: each free page goes back alone
  vmm_page_pool pool(sim, 0, one_page);
  void* first = pool.allocate(8 * MiB);   // pages 0-3
  void* second = pool.allocate(3 * MiB);  // pages 4-5, not rounded (over a 32nd of 11 MiB)
  overhead_breakdown o = explain_overhead(pool);
  EXPECT_EQ(o.free_pinned, 1 * MiB) << "the rest of the second block's last page";
  EXPECT_EQ(o.free_releasable, 0u);
  pool.deallocate(first, 8 * MiB);
  o = explain_overhead(pool);
  EXPECT_EQ(o.cached, 0u) << "a large block is never held in a quick list: it merges at once";
  EXPECT_EQ(o.free_releasable, 8 * MiB);
  EXPECT_EQ(o.requested, 3 * MiB);
  EXPECT_EQ(parts(o), o.reserved);
  // Best fit puts the next request at the start of the 8 MiB run (the 1 MiB left after the
  // second block is too small): page 0 is shared with it, pages 1-3 are free whole.
  void* third = pool.allocate(MiB + 512);
  o = explain_overhead(pool);
  EXPECT_EQ(o.cached, 0u);
  EXPECT_EQ(o.free_releasable, 6 * MiB);
  EXPECT_EQ(o.free_pinned, (MiB - 512) + MiB);
  EXPECT_EQ(o.free_in_small_arena, 0u);
  EXPECT_EQ(parts(o), o.reserved);
  // trim gives the free whole pages back: nothing releasable is left.
  pool.trim();
  o = explain_overhead(pool);
  EXPECT_EQ(o.free_releasable, 0u);
  EXPECT_EQ(o.free_pinned, (MiB - 512) + MiB);
  EXPECT_EQ(parts(o), o.reserved);
  pool.deallocate(second, 3 * MiB);
  pool.deallocate(third, MiB + 512);
}

TEST_F(PoolOverhead, AThreadCachesFreedBlocksAreCachedNotFree) {
  vmm_page_pool pool(sim, 0);  // thread caches on (the default)
  void* keep = pool.allocate(4 * MiB);
  void* p = pool.allocate(256 * KiB);
  pool.deallocate(p, 256 * KiB);  // kept by this thread's cache, for reuse on its stream
  const overhead_breakdown o = explain_overhead(pool);
  EXPECT_EQ(o.cached, 256 * KiB);
  EXPECT_EQ(o.requested, 4 * MiB);
  EXPECT_EQ(parts(o), o.reserved);
  pool.deallocate(keep, 4 * MiB);
}

TEST_F(PoolOverhead, CachingPoolFreeBytesGoBySegment) {
  runtime_resource upstream(sim, 0);
  caching_pool pool(upstream, no_thread_cache());
  void* a = pool.allocate(3 * MiB);
  void* b = pool.allocate(100 * KiB);
  overhead_breakdown o = explain_overhead(pool);
  EXPECT_EQ(o.allocator, "caching_pool");
  EXPECT_EQ(o.page_size, 0u);
  EXPECT_EQ(o.free_releasable, 0u) << "every segment holds a live block";
  // 100 KiB in 512-byte units: no size classes with the thread caches off.
  EXPECT_EQ(o.free_pinned, o.reserved - 3 * MiB - 100 * KiB);
  EXPECT_EQ(parts(o), o.reserved);
  pool.deallocate(a, 3 * MiB);
  o = explain_overhead(pool);
  EXPECT_EQ(o.cached, 0u) << "a large block is never held in a quick list: it merges at once";
  EXPECT_EQ(o.requested, 100 * KiB);
  EXPECT_EQ(parts(o), o.reserved);
  // One 4 MiB segment holds both (a small request may take the large arena's free space,
  // here the 1 MiB after a): not idle, so nothing is releasable and trim keeps it.
  EXPECT_EQ(o.reserved, 4 * MiB);
  EXPECT_EQ(o.free_releasable, 0u);
  EXPECT_EQ(o.free_pinned, o.reserved - 100 * KiB);
  pool.trim();
  o = explain_overhead(pool);
  EXPECT_EQ(o.reserved, 4 * MiB);
  EXPECT_EQ(parts(o), o.reserved);
  // Freed too, the segment is idle: all of it is releasable, and trim gives it back.
  pool.deallocate(b, 100 * KiB);
  o = explain_overhead(pool);
  EXPECT_EQ(o.cached, 0u);
  EXPECT_EQ(o.free_releasable, 4 * MiB);
  pool.trim();
  EXPECT_EQ(explain_overhead(pool).reserved, 0u);
}

TEST_F(PoolOverhead, GuardedAllocationsCountAsRequestedAndTheirGuardPagesAsOther) {
  pool_options g;
  g.guard = true;
  vmm_page_pool pool(sim, 0, g);
  void* p = pool.allocate(3 * MiB);
  overhead_breakdown o = explain_overhead(pool);
  EXPECT_EQ(o.requested, 3 * MiB);
  EXPECT_GT(o.other, 0u);
  EXPECT_EQ(parts(o), o.reserved);
  // Freed, its pages are kept unmapped for the next guarded allocation.
  pool.deallocate(p, 3 * MiB);
  o = explain_overhead(pool);
  EXPECT_EQ(o.requested, 0u);
  EXPECT_GT(o.kept_unmapped, 0u);
  EXPECT_EQ(o.kept_unmapped, pool.page_counts().spare_pages * pool.page_counts().page_size);
  EXPECT_EQ(parts(o), o.reserved);
}

// Random work on both pools: after every step the parts sum to reserved, and the vmm pool's
// kept pages are its spare pages. The parts the work reaches are each seen non-zero.
TEST_F(PoolOverhead, PartsSumToReservedThroughRandomWork) {
  vmm_page_pool vmm(sim, 0);
  runtime_resource upstream(sim, 0);
  caching_pool cp(upstream);
  for (pool_base* pool : {static_cast<pool_base*>(&vmm), static_cast<pool_base*>(&cp)}) {
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<std::size_t> size(1, 24 * MiB);
    std::vector<std::pair<void*, std::size_t>> live;
    std::size_t seen_rounding = 0, seen_pinned = 0, seen_releasable = 0, seen_cached = 0;
    for (int step = 0; step < 600; ++step) {
      if (live.size() < 40 && (live.empty() || rng() % 2 == 0)) {
        const std::size_t n = rng() % 3 == 0 ? size(rng) / 64 + 1 : size(rng);
        live.emplace_back(pool->allocate(n), n);
      } else {
        const std::size_t i = rng() % live.size();
        pool->deallocate(live[i].first, live[i].second);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (step % 97 == 0) pool->trim();
      const overhead_breakdown o = explain_overhead(*pool);
      ASSERT_EQ(parts(o), o.reserved) << pool->name() << " step " << step << "\n" << o.to_string();
      ASSERT_EQ(o.other, 0u);
      if (pool == &vmm) {
        ASSERT_EQ(o.kept_unmapped, vmm.page_counts().spare_pages * vmm.page_counts().page_size);
      }
      seen_rounding += o.block_rounding;
      seen_pinned += o.free_pinned;
      seen_releasable += o.free_releasable;
      seen_cached += o.cached;
    }
    EXPECT_GT(seen_pinned, 0u) << pool->name();
    EXPECT_GT(seen_releasable, 0u) << pool->name();
    EXPECT_GT(seen_cached, 0u) << pool->name();
    if (pool == &vmm) {
      EXPECT_GT(seen_rounding, 0u);
    }
    for (auto& [p, n] : live) pool->deallocate(p, n);
  }
}

}  // namespace
