// block_arena: splitting, quick-list reuse, merging, region linking, carving, alignment,
// stream separation, and a randomized reference-model run. The arena only does
// bookkeeping on addresses, so no memory backs the regions used here.
#include "pool/core/block_arena.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using gpumem::detail::block;
using gpumem::detail::block_arena;

constexpr std::uintptr_t base = std::uintptr_t{1} << 32;  // 4 GiB: aligned to anything used here
constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = 1024 * KiB;

std::vector<const block*> sorted_free(const block_arena& a) {
  std::vector<block*> f = a.free_blocks();
  std::vector<const block*> out(f.begin(), f.end());
  std::sort(out.begin(), out.end(), [](const block* x, const block* y) { return x->addr < y->addr; });
  return out;
}

#define EXPECT_ARENA_VALID(a) EXPECT_EQ((a).validate(), "")

// take_at allocates an exact range out of the free block holding it, a block cached in a
// quick list or freed by another stream included; the parts around it stay free, and a
// range no single free block holds is refused with nothing changed.
TEST(BlockArena, TakeAtAllocatesAnExactRangeOfAFreeBlock) {
  block_arena a;
  a.add_region(base, 8 * MiB, 1, 7);
  block* x = a.allocate(MiB, 256, 7, MiB);
  block* y = a.allocate(MiB, 256, 7, MiB);
  ASSERT_TRUE(x != nullptr && y != nullptr);
  const std::uintptr_t y_addr = y->addr;
  a.release(y, 7, 1);  // to the quick list
  EXPECT_EQ(a.take_at(x->addr, MiB, 7, MiB), nullptr);  // allocated
  EXPECT_EQ(a.take_at(x->addr, 2 * MiB, 7, 2 * MiB), nullptr);  // x and the free y after it
  block* again = a.take_at(y_addr, MiB, 9, 1000);  // another stream: the caller knows it idle
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(again->addr, y_addr);
  EXPECT_EQ(again->size, MiB);
  EXPECT_EQ(again->stream, 9u);
  EXPECT_EQ(again->requested, 1000u);
  EXPECT_ARENA_VALID(a);
  // The middle of the free rest: free parts on both sides.
  const std::uintptr_t mid = base + 4 * MiB;
  block* m = a.take_at(mid + 100, 1000, 7, 1000);
  EXPECT_EQ(m, nullptr);  // not on the arena's unit: never a block's start
  m = a.take_at(mid, 1000, 7, 1000);
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(m->size, a.round(1000));
  const auto free_now = sorted_free(a);
  ASSERT_EQ(free_now.size(), 2u);
  EXPECT_EQ(free_now[0]->addr, y_addr + MiB);
  EXPECT_EQ(free_now[0]->addr + free_now[0]->size, mid);
  EXPECT_EQ(free_now[1]->addr, mid + m->size);
  EXPECT_EQ(free_now[1]->addr + free_now[1]->size, base + 8 * MiB);
  EXPECT_ARENA_VALID(a);
  EXPECT_EQ(a.take_at(base + 8 * MiB, MiB, 7, MiB), nullptr);  // past the region
  EXPECT_EQ(a.take_at(base + 7 * MiB, 2 * MiB, 7, MiB), nullptr);  // crosses its end
  a.release(m, 7, 2);
  a.release(again, 7, 3);
  a.release(x, 7, 4);
  a.flush();
  EXPECT_EQ(sorted_free(a).size(), 1u);  // all merged back
  EXPECT_ARENA_VALID(a);
}

// keep_top_for_last: best fit passes over the free block that ends the highest region (the
// top a heap grows from) while another free block holds the request, smaller or not; the
// top serves only what nothing else holds. A lower region's top is fitted as any block.
// Off, the smaller top wins.
TEST(BlockArena, TheTopKeptForLastServesOnlyWhatNoOtherFreeBlockHolds) {
  for (const bool top_last : {false, true}) {
    block_arena a;
    a.keep_top_for_last(top_last);
    a.add_region(base, 100 * MiB, 1, 7);
    a.add_region(base - 512 * MiB, 10 * MiB, 2, 7);  // a lower region: its top is no heap top
    block* lower = a.allocate(8 * MiB, 256, 7, 8 * MiB);
    ASSERT_NE(lower, nullptr);
    EXPECT_EQ(lower->addr, base - 512 * MiB) << top_last;  // the best fit, a top or not
    block* low = a.allocate(48 * MiB, 256, 7, 48 * MiB);   // [0, 48)
    block* mid = a.allocate(12 * MiB, 256, 7, 12 * MiB);   // [48, 60)
    block* high = a.allocate(12 * MiB, 256, 7, 12 * MiB);  // [60, 72); the top [72, 100) free
    ASSERT_TRUE(low != nullptr && mid != nullptr && high != nullptr);
    a.release(low, 7, 1);
    a.release(high, 7, 2);
    a.flush();  // free: [0, 48) and the top [60, 100), the smaller
    block* b = a.allocate(16 * MiB, 256, 7, 16 * MiB);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->addr, top_last ? base : base + 60 * MiB) << top_last;
    // What no other free block holds goes to the top after all: with tops kept for last,
    // [16, 48) is too small; without, the top [76, 100) is.
    block* big = a.allocate(36 * MiB, 256, 7, 36 * MiB);
    ASSERT_NE(big, nullptr);
    EXPECT_EQ(big->addr, top_last ? base + 60 * MiB : base) << top_last;
    EXPECT_ARENA_VALID(a);
    a.release(b, 7, 3);
    a.release(big, 7, 4);
    a.release(mid, 7, 5);
    a.release(lower, 7, 6);
    a.flush();
    EXPECT_EQ(sorted_free(a).size(), 2u);  // one block per region
    EXPECT_ARENA_VALID(a);
  }
}

TEST(BlockArena, TheUnitMustBeAPowerOfTwo) {
  // Sizes and addresses are rounded with masks.
  EXPECT_THROW(block_arena(0, 768), std::invalid_argument);
  EXPECT_THROW(block_arena(0, 0), std::invalid_argument);
  block_arena a(0, 1024);
  EXPECT_EQ(a.round(1), 1024u);
  EXPECT_EQ(a.round(1025), 2048u);
}

// Memory moved from another arena (pool_base::move_free_piece) keeps the epoch it was
// freed at: free at once for another stream only if it was there. Merged, the newer epoch.
TEST(BlockArena, ARegionKeepsTheFreeEpochItIsGiven) {
  block_arena a;
  a.add_region(base, 2 * MiB, 1, 7, 5);
  ASSERT_EQ(sorted_free(a).size(), 1u);
  EXPECT_EQ(sorted_free(a)[0]->free_epoch, 5u);
  a.add_region(base + 2 * MiB, 2 * MiB, 1, 7, 9);
  ASSERT_EQ(sorted_free(a).size(), 1u);  // merged
  EXPECT_EQ(sorted_free(a)[0]->size, 4 * MiB);
  EXPECT_EQ(sorted_free(a)[0]->free_epoch, 9u);
  a.add_region(base + 8 * MiB, 2 * MiB, 1, 7);
  EXPECT_EQ(sorted_free(a)[1]->free_epoch, 0u);  // the default: safe at once
  EXPECT_ARENA_VALID(a);
}

// The region maps are hash maps keyed by address, 0 their empty key: no region at 0.
TEST(BlockArena, ARegionAtAddressZeroEmptyOrWrappingIsRefused) {
  block_arena a;
  EXPECT_THROW(a.add_region(0, MiB, 1, 0), std::invalid_argument);
  EXPECT_THROW(a.add_region(base, 0, 1, 0), std::invalid_argument);
  EXPECT_THROW(a.add_region(~std::uintptr_t{0} - 4095, 8192, 1, 0), std::invalid_argument);
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_ARENA_VALID(a);
}

// Regions are visited by address, whatever order they came in; neighbours of one segment
// link into one region.
TEST(BlockArena, RegionsAreVisitedByAddress) {
  block_arena a;
  a.add_region(base + 8 * MiB, MiB, 1, 0);
  a.add_region(base, MiB, 2, 0);
  a.add_region(base + 4 * MiB, MiB, 3, 0);
  a.add_region(base + 5 * MiB, MiB, 3, 0);  // ends where the one before starts: linked
  std::vector<std::uintptr_t> starts;
  a.for_each_region([&](const block* first) { starts.push_back(first->addr); });
  EXPECT_EQ(starts, (std::vector<std::uintptr_t>{base, base + 4 * MiB, base + 8 * MiB}));
  EXPECT_ARENA_VALID(a);
}

// Alignment inside a block: the padding in front stays a free block of its own.
TEST(BlockArena, AnAlignedRequestLeavesTheFrontPaddingFree) {
  block_arena a(0, 512, 0);
  a.add_region(0x100000 + 512, 8 * 4096, 1, 0);
  block* b = a.allocate(4096, 4096, 0, 4096);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->addr % 4096, 0u);
  EXPECT_EQ(b->addr, 0x100000u + 4096);
  EXPECT_EQ(a.free_bytes(), 8 * 4096u - 4096);
  EXPECT_EQ(a.validate(), "");
}

TEST(BlockArena, AddRegionThenAllocateSplitsFromTheFront) {
  block_arena a;
  a.add_region(base, MiB, 1, 7);
  EXPECT_ARENA_VALID(a);
  EXPECT_EQ(a.free_bytes(), MiB);

  block* x = a.allocate(1000, 256, 7, 1000);
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->addr, base);
  EXPECT_EQ(x->size, 1024u);  // rounded to the 512-byte unit
  EXPECT_EQ(x->requested, 1000u);
  EXPECT_EQ(x->st, block::state::allocated);
  EXPECT_EQ(a.allocated_bytes(), 1024u);
  EXPECT_EQ(a.requested_bytes(), 1000u);
  EXPECT_EQ(a.free_bytes(), MiB - 1024);
  EXPECT_ARENA_VALID(a);

  block* y = a.allocate(512, 256, 7, 512);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->addr, base + 1024);  // split off the remaining tail
  EXPECT_EQ(a.live_blocks(), 2u);
  EXPECT_EQ(x->next, y);  // neighbours, both handed out
  EXPECT_EQ(y->st, block::state::allocated);
  auto f = sorted_free(a);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0]->addr, base + 1536);
  EXPECT_EQ(f[0]->size, MiB - 1536);
  EXPECT_ARENA_VALID(a);

  // Nothing bigger than the region fits; a stream with no memory gets nothing.
  EXPECT_EQ(a.allocate(MiB, 256, 7, MiB), nullptr);
  EXPECT_EQ(a.allocate(512, 256, 8, 512), nullptr);
  EXPECT_ARENA_VALID(a);
}

// Without quick lists (capacity 0, as the pools run with thread caches) a released block is
// merged with its free neighbours at once: best fit sees it immediately.
TEST(BlockArena, WithoutQuickListsAReleaseMergesAtOnce) {
  block_arena a(0, 512, 0);
  a.add_region(base, MiB, 1, 7);
  block* x = a.allocate(4096, 256, 7, 4096);
  block* y = a.allocate(8192, 256, 7, 8192);
  ASSERT_NE(x, nullptr);
  ASSERT_NE(y, nullptr);
  a.release(y, 7, 1);  // merges with the free rest of the region (y's record is the arena's now)
  EXPECT_EQ(a.cached_bytes(), 0u) << "in the merged index, not a quick list";
  EXPECT_EQ(a.largest_free_block(), MiB - 4096) << "merged with the free rest of the region";
  EXPECT_EQ(a.free_bytes(), MiB - 4096);
  a.release(x, 7, 2);
  EXPECT_EQ(a.free_bytes(), MiB);
  EXPECT_EQ(a.largest_free_block(), MiB) << "the region is one free block again, no flush needed";
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, ReleaseGoesToQuickListAndExactSizeReusesIt) {
  block_arena a;
  a.add_region(base, MiB, 1, 7);
  block* x = a.allocate(4096, 256, 7, 4096);
  block* y = a.allocate(4096, 256, 7, 4000);
  ASSERT_NE(x, nullptr);
  ASSERT_NE(y, nullptr);
  const std::uintptr_t x_addr = x->addr;
  const std::size_t free_before = a.free_bytes();

  a.release(x, 7, 1);
  EXPECT_EQ(x->st, block::state::cached);
  EXPECT_EQ(a.cached_bytes(), 4096u);
  EXPECT_EQ(a.free_bytes(), free_before);  // not merged into the free index yet
  EXPECT_EQ(a.allocated_bytes(), 4096u);
  EXPECT_EQ(a.requested_bytes(), 4000u);
  EXPECT_EQ(a.live_blocks(), 1u);
  EXPECT_EQ(x->addr, x_addr);  // still where it was, in the quick list
  EXPECT_ARENA_VALID(a);

  // Another stream never gets it from the quick list.
  EXPECT_EQ(a.allocate(4096, 256, 9, 4096), nullptr);
  EXPECT_EQ(a.cached_bytes(), 4096u);

  // Same stream, same rounded size: the same block.
  block* z = a.allocate(4000, 256, 7, 4000);
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->addr, x_addr);
  EXPECT_EQ(z->requested, 4000u);
  EXPECT_EQ(a.cached_bytes(), 0u);
  EXPECT_EQ(a.free_bytes(), free_before);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, FlushMergesFreedNeighboursIntoOneBlock) {
  block_arena a;
  a.add_region(base, MiB, 1, 7);
  block* b0 = a.allocate(8 * KiB, 256, 7, 8 * KiB);
  block* b1 = a.allocate(8 * KiB, 256, 7, 8 * KiB);
  block* b2 = a.allocate(8 * KiB, 256, 7, 8 * KiB);
  block* fence = a.allocate(8 * KiB, 256, 7, 8 * KiB);  // keeps the tail apart
  ASSERT_TRUE(b0 && b1 && b2 && fence);
  ASSERT_EQ(b1->addr, b0->addr + 8 * KiB);
  ASSERT_EQ(b2->addr, b1->addr + 8 * KiB);
  a.release(b1, 7, 1);
  a.release(b0, 7, 2);
  a.release(b2, 7, 3);
  EXPECT_ARENA_VALID(a);
  EXPECT_EQ(a.cached_bytes(), 24 * KiB);

  a.flush();
  EXPECT_ARENA_VALID(a);
  EXPECT_EQ(a.cached_bytes(), 0u);
  auto f = sorted_free(a);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0]->addr, base);
  EXPECT_EQ(f[0]->size, 24 * KiB);
  EXPECT_EQ(f[1]->addr, base + 32 * KiB);
  EXPECT_EQ(a.largest_free_block(), MiB - 32 * KiB);

  // The merged run serves a request none of the three could alone.
  block* big = a.allocate(20 * KiB, 256, 7, 20 * KiB);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(big->addr, base);  // best fit: the 24 KiB run, not the big tail
  EXPECT_ARENA_VALID(a);

  // Freeing everything and flushing leaves one block spanning the region.
  a.release(big, 7, 4);
  a.release(fence, 7, 5);
  a.flush();
  f = sorted_free(a);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0]->addr, base);
  EXPECT_EQ(f[0]->size, MiB);
  EXPECT_EQ(f[0]->prev, nullptr);
  EXPECT_EQ(f[0]->next, nullptr);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, AdjacentRegionsOfOneSegmentLinkAndMerge) {
  block_arena a;
  a.add_region(base + 64 * KiB, 64 * KiB, 3, 7);
  a.add_region(base + 128 * KiB, 64 * KiB, 3, 7);  // above
  EXPECT_ARENA_VALID(a);
  auto f = sorted_free(a);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0]->addr, base + 64 * KiB);
  EXPECT_EQ(f[0]->size, 128 * KiB);

  a.add_region(base, 64 * KiB, 3, 7);  // below
  EXPECT_ARENA_VALID(a);
  f = sorted_free(a);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0]->addr, base);
  EXPECT_EQ(f[0]->size, 192 * KiB);
  EXPECT_EQ(a.free_bytes(), 192 * KiB);

  // One request spanning all three regions.
  block* x = a.allocate(192 * KiB, 256, 7, 192 * KiB);
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->addr, base);
  EXPECT_ARENA_VALID(a);

  // A region added next to a live block is linked to it and merges once it is freed.
  a.add_region(base + 192 * KiB, 64 * KiB, 3, 7);
  EXPECT_EQ(x->next != nullptr ? x->next->addr : 0, base + 192 * KiB);
  a.release(x, 7, 1);
  a.flush();
  f = sorted_free(a);
  ASSERT_EQ(f.size(), 1u);
  EXPECT_EQ(f[0]->size, 256 * KiB);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, AdjacentRegionsOfDifferentSegmentsStayApart) {
  block_arena a;
  a.add_region(base, 64 * KiB, 1, 7);
  a.add_region(base + 64 * KiB, 64 * KiB, 2, 7);
  EXPECT_ARENA_VALID(a);
  auto f = sorted_free(a);
  ASSERT_EQ(f.size(), 2u);
  EXPECT_EQ(f[0]->next, nullptr);
  EXPECT_EQ(f[1]->prev, nullptr);
  EXPECT_EQ(a.allocate(128 * KiB, 256, 7, 128 * KiB), nullptr);  // never spans segments
  EXPECT_ARENA_VALID(a);
}

// A restricted segment's free blocks serve only requests of at least its minimum: a smaller
// request takes the next fitting block of another segment (searched bin after bin past
// the restricted ones), or nothing; a larger one, or any with any_segment, takes it.
TEST(BlockArena, ARestrictedSegmentServesOnlyRequestsOfItsMinimum) {
  constexpr std::uint32_t kept = 9;
  block_arena a(0, 512, 0);
  a.restrict_segment(kept, 8 * MiB);
  a.add_region(base, 64 * MiB, kept, 7);                 // the smallest fit for most requests
  a.add_region(base + 128 * MiB, 96 * MiB, 1, 7);        // larger, another bin and segment
  EXPECT_TRUE(a.serves(*sorted_free(a)[0], 8 * MiB));
  EXPECT_FALSE(a.serves(*sorted_free(a)[0], 8 * MiB - 512));
  EXPECT_TRUE(a.serves(*sorted_free(a)[1], 512));

  block* small = a.allocate(3 * MiB, 512, 7, 3 * MiB);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->addr, base + 128 * MiB) << "the restricted block is left whole";
  EXPECT_EQ(small->segment, 1u);
  block* big = a.allocate(16 * MiB, 512, 7, 16 * MiB);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(big->addr, base) << "a request of the minimum or more takes the best fit";
  EXPECT_ARENA_VALID(a);

  // Only restricted memory left that fits: nothing for a small request, but with any_segment.
  a.release(small, 7, 1);
  block* other = a.allocate(96 * MiB, 512, 7, 96 * MiB);  // the whole unrestricted region
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(a.allocate(MiB, 512, 7, MiB), nullptr);
  EXPECT_EQ(a.allocate(MiB, 4 * MiB, 7, MiB), nullptr) << "nor with a larger alignment";
  block* forced = a.allocate(MiB, 512, 7, MiB, static_cast<std::size_t>(-1), true);
  ASSERT_NE(forced, nullptr);
  EXPECT_EQ(forced->segment, kept);
  EXPECT_ARENA_VALID(a);

  // Lifting the restriction: the rest serves any request again.
  a.restrict_segment(kept, 0);
  block* after = a.allocate(MiB, 512, 7, MiB);
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(after->segment, kept);
  for (block* b : {big, other, forced, after}) a.release(b, 7, 2);
  EXPECT_EQ(a.free_bytes(), 160 * MiB);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, CarveRemovesTheMiddleAndLeavesBothSidesFree) {
  block_arena a;
  a.add_region(base, MiB, 1, 7);
  auto f = a.free_blocks();
  ASSERT_EQ(f.size(), 1u);
  a.carve(f[0], base + 256 * KiB, 256 * KiB);
  EXPECT_ARENA_VALID(a);
  EXPECT_EQ(a.free_bytes(), 768 * KiB);
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0]->addr, base);
  EXPECT_EQ(s[0]->size, 256 * KiB);
  EXPECT_EQ(s[0]->next, nullptr);  // the gap is a region edge
  EXPECT_EQ(s[1]->addr, base + 512 * KiB);
  EXPECT_EQ(s[1]->size, 512 * KiB);
  EXPECT_EQ(s[1]->prev, nullptr);
  EXPECT_EQ(a.allocate(512 * KiB + 512, 256, 7, 1), nullptr);  // no run spans the gap

  // Putting the carved part back relinks both sides and merges into the original block.
  a.add_region(base + 256 * KiB, 256 * KiB, 1, 7);
  EXPECT_ARENA_VALID(a);
  s = sorted_free(a);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]->addr, base);
  EXPECT_EQ(s[0]->size, MiB);
}

TEST(BlockArena, CarveAtTheEdgesOfABlockNextToLiveBlocks) {
  block_arena a;
  a.add_region(base, MiB, 1, 7);
  block* lo = a.allocate(64 * KiB, 256, 7, 1);
  block* mid = a.allocate(128 * KiB, 256, 7, 1);
  block* hi = a.allocate(64 * KiB, 256, 7, 1);
  ASSERT_TRUE(lo && mid && hi);
  a.release(mid, 7, 1);
  a.flush();
  // Carve the whole free block between two live ones.
  block* m = nullptr;
  for (block* b : a.free_blocks())
    if (b->addr == base + 64 * KiB) m = b;
  ASSERT_NE(m, nullptr);
  a.carve(m, base + 64 * KiB, 128 * KiB);
  EXPECT_ARENA_VALID(a);
  EXPECT_EQ(lo->next, nullptr);
  EXPECT_EQ(hi->prev, nullptr);
  EXPECT_EQ(a.free_bytes(), MiB - 256 * KiB);
  // Re-adding it links to both live neighbours; freeing them merges everything.
  a.add_region(base + 64 * KiB, 128 * KiB, 1, 7);
  EXPECT_ARENA_VALID(a);
  a.release(lo, 7, 2);
  a.release(hi, 7, 3);
  a.flush();
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]->size, MiB);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, AlignmentAboveTheUnitAlignsAndKeepsThePaddingFree) {
  block_arena a;
  a.add_region(base, MiB, 1, 7);
  block* x = a.allocate(512, 256, 7, 512);
  ASSERT_NE(x, nullptr);
  ASSERT_EQ(x->addr, base);
  block* y = a.allocate(4096, 64 * KiB, 7, 4096);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->addr % (64 * KiB), 0u);
  EXPECT_EQ(y->addr, base + 64 * KiB);
  EXPECT_EQ(y->size, 4096u);
  EXPECT_ARENA_VALID(a);
  // The padding [base+512, base+64K) is a free block of its own.
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0]->addr, base + 512);
  EXPECT_EQ(s[0]->size, 64 * KiB - 512);
  EXPECT_EQ(a.free_bytes() + a.allocated_bytes(), MiB);
  // It is usable afterwards.
  block* z = a.allocate(60 * KiB, 256, 7, 1);
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->addr, base + 512);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, LargeAlignmentIsFoundEvenInAnExactFitOfTheRequest) {
  // A free block exactly the requested size but misaligned must not be used; a bigger
  // one where the aligned block fits must.
  block_arena a;
  a.add_region(base + 512, 8 * KiB, 1, 7);           // misaligned, exactly 8 KiB
  a.add_region(base + MiB + 512, 64 * KiB, 2, 7);    // misaligned, room to align
  block* x = a.allocate(8 * KiB, 32 * KiB, 7, 1);
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->addr % (32 * KiB), 0u);
  EXPECT_GE(x->addr, base + MiB + 512);
  EXPECT_LE(x->addr + x->size, base + MiB + 512 + 64 * KiB);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, DifferentStreamsNeverMerge) {
  block_arena a;
  a.add_region(base, 64 * KiB, 1, 1);
  a.add_region(base + 64 * KiB, 64 * KiB, 1, 2);
  EXPECT_ARENA_VALID(a);
  ASSERT_EQ(a.free_blocks().size(), 2u);  // linked, but different streams
  EXPECT_EQ(a.allocate(128 * KiB, 256, 1, 1), nullptr);

  // A stream-1 block freed in stream 2's order becomes stream 2's and merges with
  // stream 2's free memory, never with stream 1's.
  block* x = a.allocate(32 * KiB, 256, 1, 1);
  ASSERT_NE(x, nullptr);
  ASSERT_EQ(x->addr, base);
  a.release(x, 2, 1);
  a.flush();
  EXPECT_ARENA_VALID(a);
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0]->stream, 2u);
  EXPECT_EQ(s[1]->stream, 1u);
  EXPECT_EQ(s[2]->stream, 2u);
  EXPECT_EQ(a.allocate(64 * KiB, 256, 1, 1), nullptr);   // stream 1 has only 32 KiB
  EXPECT_EQ(a.allocate(96 * KiB, 256, 2, 1), nullptr);   // stream 2's runs are not adjacent
  block* y = a.allocate(64 * KiB, 256, 2, 1);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->addr, base + 64 * KiB);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, OtherStreamsAreTakenOnlyWhenUsableAndReTagged) {
  block_arena a;
  a.add_region(base, 64 * KiB, 1, 1);
  a.add_region(base + MiB, 128 * KiB, 2, 2);
  int asked = 0;
  block* none = a.allocate_from_other_streams(16 * KiB, 256, 3, 1, [&](const block&) {
    ++asked;
    return false;
  });
  EXPECT_EQ(none, nullptr);
  EXPECT_GE(asked, 1);
  block* x = a.allocate_from_other_streams(16 * KiB, 256, 3, 1,
                                           [](const block& b) { return b.stream == 2; });
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->addr, base + MiB);
  EXPECT_EQ(x->stream, 3u);
  EXPECT_ARENA_VALID(a);
  // Best fit among usable ones.
  block* y = a.allocate_from_other_streams(16 * KiB, 256, 3, 1, [](const block&) { return true; });
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(y->addr, base);
  EXPECT_ARENA_VALID(a);
}

TEST(BlockArena, ReleaseFlushesWhenTheQuickListIsFull) {
  block_arena a(0, 512, 4);
  a.add_region(base, MiB, 1, 7);
  std::vector<block*> blocks;
  for (int i = 0; i < 6; ++i) blocks.push_back(a.allocate(512 * (i + 1), 256, 7, 1));
  for (int i = 0; i < 6; ++i) {
    a.release(blocks[static_cast<std::size_t>(i)], 7, static_cast<std::uint64_t>(i + 1));
    EXPECT_ARENA_VALID(a);
  }
  // The fifth release found four cached blocks and flushed them (merged: they are
  // adjacent); the fifth and sixth are cached.
  EXPECT_EQ(a.cached_bytes(), 512u * (5 + 6));
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0]->addr, base);
  EXPECT_EQ(s[0]->size, 512u * (1 + 2 + 3 + 4));
  a.flush();
  ASSERT_EQ(a.free_blocks().size(), 1u);
  EXPECT_EQ(a.free_bytes(), MiB);
}

// --- stream-ordered reuse needs each free block to remember the latest free it contains ---
// pool_base hands a free block of stream S to another stream only when S's free counter
// has passed the block's free_epoch. A block that loses its epoch on split or merge is
// handed to another stream before the work that used it is known complete.

TEST(BlockArena, SplittingAFreedBlockKeepsItsFreeEpoch) {
  block_arena a;
  a.add_region(base, 64 * KiB, 1, 7);
  block* x = a.allocate(64 * KiB, 256, 7, 1);
  ASSERT_NE(x, nullptr);
  a.release(x, 7, 5);
  a.flush();
  // Reuse part of it on its own stream: the rest stays free, still covered by free #5.
  block* y = a.allocate(16 * KiB, 256, 7, 1);
  ASSERT_NE(y, nullptr);
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]->stream, 7u);
  EXPECT_EQ(s[0]->free_epoch, 5u) << "the tail split off a block freed at epoch 5 lost its epoch";
}

TEST(BlockArena, AlignmentPaddingOfAFreedBlockKeepsItsFreeEpoch) {
  block_arena a;
  a.add_region(base, 128 * KiB, 1, 7);
  block* x = a.allocate(128 * KiB, 256, 7, 1);
  ASSERT_NE(x, nullptr);
  a.release(x, 7, 3);
  a.flush();
  block* big = a.allocate(512, 256, 7, 1);   // base: makes the rest misaligned for 64 KiB
  ASSERT_NE(big, nullptr);
  block* y = a.allocate(4096, 64 * KiB, 7, 1);
  ASSERT_NE(y, nullptr);
  for (const block* b : sorted_free(a))
    EXPECT_EQ(b->free_epoch, 3u) << "free block at +" << (b->addr - base) << " lost its epoch";
}

TEST(BlockArena, MergingKeepsTheLatestFreeEpoch) {
  block_arena a;
  a.add_region(base, 64 * KiB, 1, 7);
  block* x = a.allocate(32 * KiB, 256, 7, 1);
  block* y = a.allocate(32 * KiB, 256, 7, 1);
  ASSERT_TRUE(x && y);
  a.release(y, 7, 1);
  a.release(x, 7, 2);
  a.flush();
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]->free_epoch, 2u)
      << "a block merged from frees #1 and #2 must count as free only after #2";
}

TEST(BlockArena, AddingARegionNextToAFreedBlockKeepsItsFreeEpoch) {
  block_arena a;
  a.add_region(base, 64 * KiB, 1, 7);
  block* x = a.allocate(64 * KiB, 256, 7, 1);
  ASSERT_NE(x, nullptr);
  a.release(x, 7, 4);
  a.flush();
  a.add_region(base + 64 * KiB, 64 * KiB, 1, 7);  // fresh memory, merges with the freed block
  auto s = sorted_free(a);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]->size, 128 * KiB);
  EXPECT_EQ(s[0]->free_epoch, 4u);
}

// --- randomized reference model ------------------------------------------------------------

struct region_desc {
  std::uintptr_t addr;
  std::size_t size;
  std::uint32_t segment;
  std::uintptr_t stream;
};

struct live_desc {
  block* b;
  std::size_t size;
  std::uintptr_t stream;
};

bool inside_some(const std::vector<region_desc>& regions, std::uintptr_t addr, std::size_t size) {
  for (const auto& r : regions)
    if (addr >= r.addr && addr + size <= r.addr + r.size) return true;
  // A block may span linked regions (same segment, adjacent): check coverage piecewise.
  std::uintptr_t at = addr;
  const std::uintptr_t end = addr + size;
  while (at < end) {
    bool advanced = false;
    for (const auto& r : regions)
      if (at >= r.addr && at < r.addr + r.size) {
        at = r.addr + r.size;
        advanced = true;
        break;
      }
    if (!advanced) return false;
  }
  return true;
}

// With `top_last`, the run checks keep_top_for_last too: a free block that fits (the top
// included) is never missed.
void randomized_against_a_reference_model(bool top_last) {
  std::mt19937_64 rng(20240611);
  block_arena a(0, 512, 64);  // a small quick-list cap exercises the automatic flush too
  a.keep_top_for_last(top_last);
  // Regions 0 and 1 are adjacent in one segment (they link and merge), region 2 is
  // adjacent to 1 in another segment (never merges), region 3 stands apart.
  std::vector<region_desc> regions = {
      {base, 2 * MiB, 1, 1},
      {base + 2 * MiB, 2 * MiB, 1, 1},
      {base + 4 * MiB, 2 * MiB, 2, 2},
      {base + 64 * MiB, 4 * MiB, 3, 2},
  };
  std::size_t region_total = 0;
  for (const auto& r : regions) {
    a.add_region(r.addr, r.size, r.segment, r.stream);
    region_total += r.size;
    ASSERT_EQ(a.validate(), "");
  }
  // Carved-out parts (no longer the arena's) that may be added back later.
  std::vector<region_desc> carved;
  std::size_t carved_total = 0;
  std::map<std::uintptr_t, live_desc> live;  // addr -> block
  std::uint64_t epoch[3] = {0, 0, 0};
  const std::size_t alignments[] = {1, 256, 512, 4096, 64 * KiB};

  auto check_no_overlap = [&](std::uintptr_t addr, std::size_t size) {
    auto it = live.lower_bound(addr);
    if (it != live.end() && it->first < addr + size) return false;
    if (it != live.begin()) {
      auto p = std::prev(it);
      if (p->first + p->second.size > addr) return false;
    }
    for (const auto& c : carved)
      if (addr < c.addr + c.size && c.addr < addr + size) return false;
    return true;
  };

  int allocs = 0, misses = 0, frees = 0, carves = 0;
  for (int op = 0; op < 20000; ++op) {
    const int what = static_cast<int>(rng() % 100);
    const std::uintptr_t stream = 1 + rng() % 2;
    if (what < 50 || live.empty()) {
      std::size_t size = rng() % 4 == 0 ? 1 + rng() % (512 * KiB) : 1 + rng() % (16 * KiB);
      const std::size_t alignment = alignments[rng() % 5];
      block* b = a.allocate(size, alignment, stream, size);
      if (b == nullptr) {
        a.flush();  // what the pool does on a miss
        b = a.allocate(size, alignment, stream, size);
      }
      if (b == nullptr) {
        // Nothing free on this stream may fit the aligned request.
        ++misses;
        const std::size_t need = a.round(size) + (alignment > 512 ? alignment - 512 : 0);
        for (const block* f : a.free_blocks()) {
          if (f->stream == stream) {
            ASSERT_LT(f->size, need) << "op " << op << ": a fitting free block was missed";
          }
        }
      } else {
        ++allocs;
        ASSERT_EQ(b->st, block::state::allocated);
        ASSERT_EQ(b->stream, stream);
        ASSERT_GE(b->size, a.round(size));
        ASSERT_EQ(b->size % 512, 0u);
        ASSERT_EQ(b->addr % std::max<std::size_t>(alignment, 512), 0u) << "op " << op;
        ASSERT_TRUE(inside_some(regions, b->addr, b->size)) << "op " << op;
        ASSERT_TRUE(check_no_overlap(b->addr, b->size)) << "op " << op << ": overlap";
        live.emplace(b->addr, live_desc{b, b->size, stream});
      }
    } else if (what < 90) {
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      // Mostly freed on the allocating stream, sometimes on the other one.
      const std::uintptr_t on = rng() % 8 == 0 ? 3 - it->second.stream : it->second.stream;
      ASSERT_EQ(it->second.b->st, block::state::allocated);
      ASSERT_EQ(it->second.b->addr, it->first);
      a.release(it->second.b, on, ++epoch[on]);
      live.erase(it);
      ++frees;
    } else if (what < 95) {
      a.flush();
    } else if (what < 98 && carved.size() < 8) {
      // Carve a unit-aligned piece out of a random free block.
      a.flush();
      auto f = a.free_blocks();
      if (!f.empty()) {
        block* b = f[rng() % f.size()];
        if (b->size >= 2 * 512) {
          const std::size_t units = b->size / 512;
          const std::size_t off = (rng() % units) * 512;
          const std::size_t len = (1 + rng() % (units - off / 512)) * 512;
          const region_desc piece{b->addr + off, len, b->segment, b->stream};
          a.carve(b, piece.addr, piece.size);
          carved.push_back(piece);
          carved_total += len;
          ++carves;
        }
      }
    } else if (!carved.empty()) {
      // Give a carved piece back (possibly to the other stream).
      const std::size_t i = rng() % carved.size();
      region_desc piece = carved[i];
      carved.erase(carved.begin() + static_cast<long>(i));
      carved_total -= piece.size;
      a.add_region(piece.addr, piece.size, piece.segment, stream);
    }
    ASSERT_EQ(a.validate(), "") << "after op " << op;
    ASSERT_EQ(a.free_bytes() + a.cached_bytes() + a.allocated_bytes(), region_total - carved_total)
        << "after op " << op;
    ASSERT_EQ(a.live_blocks(), live.size());
    if (op % 500 == 0) {
      // Free blocks overlap neither live blocks nor carved pieces, and lie in regions.
      for (const block* f : a.free_blocks()) {
        ASSERT_TRUE(inside_some(regions, f->addr, f->size));
        ASSERT_TRUE(check_no_overlap(f->addr, f->size)) << "free block overlaps, op " << op;
      }
    }
  }
  // The run did exercise every path.
  EXPECT_GT(allocs, 5000);
  EXPECT_GT(frees, 4000);
  EXPECT_GT(misses, 0);
  EXPECT_GT(carves, 50);

  // Everything back: all memory is one free block per stream-and-segment run.
  for (auto& [addr, l] : live) a.release(l.b, l.stream, ++epoch[l.stream]);
  for (const auto& piece : carved) a.add_region(piece.addr, piece.size, piece.segment, 1);
  a.flush();
  EXPECT_EQ(a.validate(), "");
  EXPECT_EQ(a.allocated_bytes(), 0u);
  EXPECT_EQ(a.free_bytes(), region_total);
}

TEST(BlockArena, RandomizedAgainstAReferenceModel) { randomized_against_a_reference_model(false); }

TEST(BlockArena, RandomizedAgainstAReferenceModelWithTheTopKeptForLast) {
  randomized_against_a_reference_model(true);
}

}  // namespace
