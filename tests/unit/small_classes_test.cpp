// pool_options::small_classes / small_cache: small requests rounded up to size classes (N to
// an octave; 4 by default), and each thread's cache keeping up to small_cache bytes of small
// blocks, which a small miss leaves in place while the pool grows from pages it holds
// (kept unmapped, or gathered from free runs), and takes back before it makes pages.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/core/pool_observer.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "gpumem/backend/backends.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::KiB;
using gpumem_test::MiB;

class SmallClasses : public gpumem_test::sim_pool_test {};

pool_options with_classes(unsigned n, std::size_t cache = 16 * MiB) {
  pool_options o;
  o.small_classes = n;
  o.small_cache = cache;
  return o;
}

TEST_F(SmallClasses, ParsesZeroOrPowersOfTwoUpTo64) {
  EXPECT_EQ(pool_options{}.small_classes, 4u) << "four to an octave by default";
  EXPECT_EQ(pool_options::parse("small_classes:4").small_classes, 4u);
  EXPECT_EQ(pool_options::parse("small_classes:0").small_classes, 0u);
  EXPECT_EQ(pool_options::parse("small_classes:64").small_classes, 64u);
  EXPECT_THROW(pool_options::parse("small_classes:3"), invalid_argument);
  EXPECT_THROW(pool_options::parse("small_classes:128"), invalid_argument);
  EXPECT_THROW(pool_options::parse("small_classes:x"), invalid_argument);
  EXPECT_THROW(pool_options::parse("small_classes:1.5"), invalid_argument);
  EXPECT_THROW(pool_options::parse("small_classes:4K"), invalid_argument);
  EXPECT_THROW(pool_options::parse("small_classes:1e30"), invalid_argument);
  EXPECT_EQ(pool_options::parse("small_cache:4M").small_cache, 4 * MiB);
  const std::string text = pool_options::parse("small_classes:8,small_cache:1M").to_string();
  EXPECT_NE(text.find("small_classes:8"), std::string::npos) << text;
  EXPECT_NE(text.find("small_cache:1048576"), std::string::npos) << text;
  EXPECT_EQ(pool_options::parse(text).small_classes, 8u) << "to_string parses back";
}

TEST_F(SmallClasses, APoolRefusesANonPowerOfTwoSetInCode) {
  // Options built in code skip parse(): the pool checks them itself (a class step of a
  // third of an octave of 4 units would be 1.33 units; it used to divide by zero).
  runtime_resource upstream(sim, 0);
  for (unsigned n : {3u, 6u, 128u}) {
    EXPECT_THROW(vmm_page_pool(sim, 0, with_classes(n)), invalid_argument) << n;
    EXPECT_THROW(caching_pool(upstream, with_classes(n)), invalid_argument) << n;
  }
  EXPECT_NO_THROW(vmm_page_pool(sim, 0, with_classes(64)));
}

// Block bytes handed out for one small request of `bytes` (the arena's allocated bytes).
std::size_t block_for(vmm_page_pool& pool, std::size_t bytes) {
  void* p = pool.allocate(bytes);
  const std::size_t block = pool.bytes_in_arena(true).allocated;
  pool.deallocate(p, bytes);
  return block;
}

TEST_F(SmallClasses, RoundsSmallRequestsToTheirClassAndLeavesLargeOnesAlone) {
  vmm_page_pool pool(sim, 0, with_classes(4));
  // Up to 8 units of 512 B: the units themselves (the octave's steps are < 1 unit).
  EXPECT_EQ(block_for(pool, 1), 512u);
  EXPECT_EQ(block_for(pool, 7 * 512 + 1), 8 * 512u);
  // (8, 16] units in steps of 2, (16, 32] in steps of 4, (1024, 2048] in steps of 256.
  EXPECT_EQ(block_for(pool, 9 * 512 + 1), 10 * 512u);
  EXPECT_EQ(block_for(pool, 16 * 512 + 1), 20 * 512u);
  EXPECT_EQ(block_for(pool, 20 * 512), 20 * 512u) << "a class size is its own class";
  EXPECT_EQ(block_for(pool, 1024 * 512 + 1), 1280 * 512u);
  EXPECT_EQ(block_for(pool, MiB), MiB);
  // Large requests: the page rounding of vmm_page_pool, as without classes.
  void* base = pool.allocate(256 * MiB);
  void* large = pool.allocate(MiB + 1);
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, 256 * MiB + 2 * MiB);
  pool.deallocate(large, MiB + 1);
  pool.deallocate(base, 256 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(SmallClasses, ABlockExceedsItsRequestByUnderOneNth) {
  for (unsigned n : {1u, 2u, 4u, 8u, 64u}) {
    vmm_page_pool pool(sim, 0, with_classes(n));
    for (std::size_t bytes = 1; bytes <= MiB; bytes = bytes * 5 / 4 + 511) {
      const std::size_t block = block_for(pool, bytes);
      const std::size_t units = (bytes + 511) / 512 * 512;
      ASSERT_GE(block, units) << n << " classes, " << bytes << " bytes";
      ASSERT_EQ(block % 512, 0u);
      ASSERT_LT(block - units, units / n) << n << " classes, " << bytes << " bytes";
    }
  }
}

TEST_F(SmallClasses, ZeroKeeps512ByteUnits) {
  vmm_page_pool pool(sim, 0, with_classes(0));
  EXPECT_EQ(block_for(pool, 9 * 512 + 1), 10 * 512u);
  EXPECT_EQ(block_for(pool, 16 * 512 + 1), 17 * 512u);
  EXPECT_EQ(block_for(pool, 1024 * 512 + 1), 1025 * 512u);
}

TEST_F(SmallClasses, TheDefaultsRoundToFourClassesAnOctave) {
  vmm_page_pool pool(sim, 0);
  EXPECT_EQ(block_for(pool, 3 * 512), 3 * 512u) << "up to 4 units: units";
  EXPECT_EQ(block_for(pool, 9 * 512 + 1), 10 * 512u) << "octave (8, 16]: steps of 2 units";
  EXPECT_EQ(block_for(pool, 16 * 512 + 1), 20 * 512u) << "octave (16, 32]: steps of 4";
  EXPECT_EQ(block_for(pool, 1024 * 512 + 1), 1280 * 512u) << "octave (1024, 2048]: of 256";
}

// The classes serve the thread caches; where the caches are off, a freed block merges at
// once and a rounded one would only waste its excess.
struct silent_observer final : pool_observer {
  void on_event(const pool_event&) noexcept override {}
};

TEST_F(SmallClasses, WithTheThreadCachesOffRequestsKeep512ByteUnits) {
  vmm_page_pool locked(sim, 0, pool_options::parse("thread_cache:off"));
  EXPECT_EQ(block_for(locked, 16 * 512 + 1), 17 * 512u);
  vmm_page_pool pool(sim, 0);
  silent_observer watch;
  pool.set_observer(&watch);
  EXPECT_EQ(block_for(pool, 16 * 512 + 1), 17 * 512u) << "an observer turns the caches off";
  pool.set_observer(nullptr);
  EXPECT_EQ(block_for(pool, 16 * 512 + 1), 20 * 512u) << "detached: classes again";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// The thread caches keep one list per class (thread_cache.hpp): every class size of every
// allowed n finds its list, and the block comes back for the same request.
TEST_F(SmallClasses, EveryClassIsKeptAndServedAgainForEveryN) {
  for (unsigned n : {1u, 2u, 4u, 8u, 64u}) {
    vmm_page_pool pool(sim, 0, with_classes(n));
    for (std::size_t bytes = 1; bytes <= MiB; bytes = bytes * 5 / 4 + 511) {
      void* p = pool.allocate(bytes);
      const std::size_t block = pool.bytes_in_arena(true).allocated;
      const std::size_t cached = pool.bytes_in_arena(true).cached;
      pool.deallocate(p, bytes);
      ASSERT_EQ(pool.bytes_in_arena(true).cached, cached + block)
          << n << " classes, " << bytes << " bytes: kept in the thread's cache";
      ASSERT_TRUE(pool.is_valid()) << n << " classes, " << bytes << " bytes: " << pool.validate();
      void* q = pool.allocate(bytes);
      ASSERT_EQ(q, p) << n << " classes, " << bytes << " bytes";
      ASSERT_EQ(pool.bytes_in_arena(true).cached, cached);
      pool.deallocate(q, bytes);
    }
  }
}

TEST_F(SmallClasses, ABlockMadeWhileTheClassesWereOffGoesBackToItsArena) {
  vmm_page_pool pool(sim, 0);
  silent_observer watch;
  pool.set_observer(&watch);
  void* odd = pool.allocate(17 * 512);  // 17 units: not a class of four an octave
  pool.set_observer(nullptr);
  pool.deallocate(odd, 17 * 512);  // no class list for it: merged in its arena at once
  EXPECT_EQ(pool.bytes_in_arena(true).allocated, 0u);
  EXPECT_EQ(pool.bytes_in_arena(true).cached, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  void* p = pool.allocate(17 * 512);  // a class block (20 units) from the merged run
  EXPECT_EQ(p, odd);
  pool.deallocate(p, 17 * 512);
  EXPECT_EQ(pool.bytes_in_arena(true).cached, 20 * 512u) << "a class block is kept";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(SmallClasses, AFreedBlockServesEveryRequestOfItsClass) {
  vmm_page_pool pool(sim, 0, with_classes(4));
  void* a = pool.allocate(12 * 512);  // class 12 units
  pool.deallocate(a, 12 * 512);
  const auto maps = calls(platform_op::map);
  void* b = pool.allocate(11 * 512 - 100);  // 11 units: the same class
  EXPECT_EQ(b, a);
  EXPECT_EQ(calls(platform_op::map), maps);
  EXPECT_EQ(pool.stats().live_bytes, 11 * 512 - 100u) << "requested bytes, not the class";
  pool.deallocate(b, 11 * 512 - 100);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(SmallClasses, EachThreadKeepsAtMostSmallCacheBytesOfSmallBlocks) {
  vmm_page_pool pool(sim, 0, with_classes(4, 64 * KiB));
  std::vector<void*> held;
  for (int i = 0; i < 20; ++i) held.push_back(pool.allocate(8 * KiB));
  for (void* p : held) pool.deallocate(p, 8 * KiB);
  const auto small = pool.bytes_in_arena(true);
  EXPECT_EQ(small.allocated, 0u);
  EXPECT_EQ(small.cached, 64 * KiB) << "the cache keeps 8 blocks, the rest went back";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.trim();
  EXPECT_EQ(pool.bytes_in_arena(true).cached, 0u) << "trim takes them back";
}

// Four 512 KiB blocks fill one 2 MiB page of the small arena; `between` runs; the first two
// are freed into the thread cache, so a 1 MiB request finds no free block in the arena.
struct four_quarters {
  vmm_page_pool& pool;
  void* q[4];
  template <class F>
  four_quarters(vmm_page_pool& p, F&& between) : pool(p) {
    for (auto& b : q) b = pool.allocate(512 * KiB);
    between();
    pool.deallocate(q[0], 512 * KiB);
    pool.deallocate(q[1], 512 * KiB);
  }
  explicit four_quarters(vmm_page_pool& p) : four_quarters(p, [] {}) {}
  // Frees the 1 MiB block and the two live quarters; the pool must be valid.
  void finish(void* big) {
    pool.deallocate(big, MiB);
    pool.deallocate(q[2], 512 * KiB);
    pool.deallocate(q[3], 512 * KiB);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
};

TEST_F(SmallClasses, ASmallMissGrowsFromKeptPagesAndLeavesTheCachedBlocks) {
  vmm_page_pool pool(sim, 0, with_classes(4));
  four_quarters page(pool, [&] {
    pool.return_pages(pool.lend_pages(1));  // one page made and kept unmapped
  });
  ASSERT_EQ(pool.page_counts().spare_pages, 1u);
  ASSERT_EQ(pool.stats().reserved_bytes, 4 * MiB);
  ASSERT_EQ(pool.bytes_in_arena(true).cached, MiB);
  void* big = pool.allocate(MiB);
  EXPECT_NE(big, page.q[0]) << "grown on the kept page, not merged from the cache";
  EXPECT_EQ(pool.page_counts().spare_pages, 0u);
  EXPECT_EQ(pool.bytes_in_arena(true).cached, MiB) << "the cached blocks stay for this thread";
  EXPECT_EQ(pool.stats().reserved_bytes, 4 * MiB) << "no page made";
  page.finish(big);
}

// As above, with a free run of the large arena instead: its page is gathered, and the
// cached blocks stay.
TEST_F(SmallClasses, ASmallMissGathersAFreePageAndLeavesTheCachedBlocks) {
  pool_options o = with_classes(4);
  o.footprint = footprint_mode::tight;  // footprint:fast makes a page instead, within its budget
  vmm_page_pool pool(sim, 0, o);
  four_quarters page(pool, [&] {
    pool.deallocate(pool.allocate(4 * MiB), 4 * MiB);  // two free pages, mapped, large arena
  });
  ASSERT_EQ(pool.bytes_in_arena(true).cached, MiB);
  const auto reserved = pool.stats().reserved_bytes;
  const auto creates = calls(platform_op::create_physical);
  void* big = pool.allocate(MiB);
  EXPECT_NE(big, page.q[0]) << "gathered, not merged from the cache";
  EXPECT_EQ(pool.bytes_in_arena(true).cached, MiB) << "the cached blocks stay for this thread";
  EXPECT_EQ(calls(platform_op::create_physical), creates) << "no page made";
  EXPECT_EQ(pool.stats().reserved_bytes, reserved);
  page.finish(big);
}

// With no page held beyond the live ones: the cached blocks go back and merge before the
// pool makes a page, so they never make it reserve more.
TEST_F(SmallClasses, ASmallMissTakesTheCachedBlocksBackBeforeMakingPages) {
  vmm_page_pool pool(sim, 0, with_classes(4));
  four_quarters page(pool);
  ASSERT_EQ(pool.bytes_in_arena(true).cached, MiB);
  const auto creates = calls(platform_op::create_physical);
  void* big = pool.allocate(MiB);
  EXPECT_EQ(big, page.q[0]) << "the two cached neighbours, merged";
  EXPECT_EQ(calls(platform_op::create_physical), creates);
  EXPECT_EQ(pool.bytes_in_arena(true).cached, 0u);
  EXPECT_EQ(pool.stats().reserved_bytes, 2 * MiB);
  page.finish(big);
}

TEST_F(SmallClasses, WhenGrowingFailsTheCachedBlocksMergeAndServe) {
  pool_options o = with_classes(4);
  o.limit_bytes = 2 * MiB;  // one page: no growth past it
  vmm_page_pool pool(sim, 0, o);
  four_quarters page(pool);
  void* big = pool.allocate(MiB);
  EXPECT_EQ(big, page.q[0]) << "the two cached neighbours, merged";
  EXPECT_EQ(pool.stats().reserved_bytes, 2 * MiB);
  EXPECT_EQ(pool.stats().oom_count, 0u);
  page.finish(big);
}

TEST_F(SmallClasses, WithoutClassesASmallMissMergesTheCachedBlocksFirst) {
  vmm_page_pool pool(sim, 0, with_classes(0));
  four_quarters page(pool);
  void* big = pool.allocate(MiB);
  EXPECT_EQ(big, page.q[0]);
  EXPECT_EQ(pool.stats().reserved_bytes, 2 * MiB);
  page.finish(big);
}

TEST_F(SmallClasses, TheCachingPoolRoundsAlike) {
  runtime_resource upstream(sim, 0);
  caching_pool pool(upstream, with_classes(4));
  void* p = pool.allocate(16 * 512 + 1);
  EXPECT_EQ(pool.bytes_in_arena(true).allocated, 20 * 512u);
  pool.deallocate(p, 16 * 512 + 1);
  void* again = pool.allocate(18 * 512);
  EXPECT_EQ(again, p) << "the same class, from the thread cache";
  pool.deallocate(again, 18 * 512);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// caching_pool lets a small request use the large arena's free space: a small miss moves
// a 2 MiB piece of it into the small arena (pool_base::move_free_piece), where the next
// small requests are served. Where less than a piece is free there, the request takes its
// block from the large arena itself, so a thread cache can hold small requests' blocks of
// both arenas: a small request finds either (the fast path), and a small miss gives back
// the large arena's only, leaving the small ones kept.
TEST_F(SmallClasses, TheCachingPoolKeepsSmallBlocksOfBothArenasAndASmallMissDrainsOnlyTheLarge) {
  runtime_resource upstream(sim, 0);
  caching_pool pool(upstream, with_classes(4));
  auto total = [](const pool_base::arena_bytes& a) { return a.allocated + a.cached + a.free; };
  void* q[4];
  for (auto& p : q) p = pool.allocate(512 * KiB);  // fill one 2 MiB small segment
  void* big = pool.allocate(8 * MiB);
  pool.deallocate(big, 8 * MiB);  // the large arena now has 8 MiB free
  const std::size_t reserved = pool.stats().reserved_bytes;
  void* in_piece[4];
  for (auto& p : in_piece) p = pool.allocate(512 * KiB);
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, 0u) << "a small block in the large arena";
  EXPECT_EQ(total(pool.bytes_in_arena(true)), 4 * MiB) << "the segment and one piece";
  EXPECT_EQ(pool.stats().reserved_bytes, reserved) << "served without growing";
  void* most = pool.allocate(5 * MiB);  // 1 MiB of the large arena left free: no piece
  void* from_large = pool.allocate(512 * KiB);
  ASSERT_EQ(pool.bytes_in_arena(false).allocated, 5 * MiB + 512 * KiB) << "served by the large arena";
  pool.deallocate(from_large, 512 * KiB);
  pool.deallocate(q[0], 512 * KiB);
  EXPECT_EQ(pool.bytes_in_arena(true).cached, 512 * KiB);
  EXPECT_EQ(pool.bytes_in_arena(false).cached, 512 * KiB) << "both kept by this thread";

  void* again = pool.allocate(512 * KiB);
  EXPECT_EQ(again, q[0]) << "two kept blocks fit as well: the small arena's is taken";
  pool.deallocate(again, 512 * KiB);
  ASSERT_EQ(pool.bytes_in_arena(false).cached, 512 * KiB);

  // Another class: no kept block fits, the small arena is full, so the miss gives back the
  // large arena's kept block (merged there) and takes its space; the small one stays.
  void* other = pool.allocate(256 * KiB);
  EXPECT_EQ(other, from_large) << "the large arena's merged free run, from its start";
  EXPECT_EQ(pool.bytes_in_arena(false).cached, 0u);
  EXPECT_EQ(pool.bytes_in_arena(true).cached, 512 * KiB) << "the small arena's block stays kept";
  EXPECT_EQ(pool.stats().reserved_bytes, reserved) << "served without growing";
  pool.deallocate(other, 256 * KiB);
  pool.deallocate(most, 5 * MiB);
  for (void* p : in_piece) pool.deallocate(p, 512 * KiB);
  for (int i = 1; i < 4; ++i) pool.deallocate(q[i], 512 * KiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.trim();
  EXPECT_EQ(pool.bytes_in_arena(true).cached + pool.bytes_in_arena(false).cached, 0u);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u) << "every segment went back whole";
}

}  // namespace
