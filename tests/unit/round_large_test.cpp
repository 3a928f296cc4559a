// pool_options::round_large: large requests get blocks rounded up to a multiple of it
// (vmm_page_pool's default: its page size, so large blocks own whole pages) when that loses
// less than half of one, while the bytes lost to rounding stay within 1/32 of the live
// bytes; small ones, and large ones at most half a unit past a multiple, stay in 512-byte
// units.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::KiB;
using gpumem_test::MiB;

class RoundLarge : public gpumem_test::sim_pool_test {};

TEST_F(RoundLarge, ParsesPowersOfTwoOnly) {
  EXPECT_EQ(pool_options::parse("round_large:2M").round_large, 2 * MiB);
  EXPECT_EQ(pool_options{}.round_large, 0u);
  EXPECT_THROW(pool_options::parse("round_large:3M"), invalid_argument);
  EXPECT_THROW(pool_options::parse("round_large:x"), invalid_argument);
  EXPECT_NE(pool_options::parse("round_large:4096").to_string().find("round_large:4096"),
            std::string::npos);
}

TEST_F(RoundLarge, APoolRefusesANonPowerOfTwoSetInCode) {
  // Options built in code skip parse(): the pool checks (block_size_for masks by it).
  pool_options o;
  o.round_large = 3 * MiB;
  EXPECT_THROW(vmm_page_pool(sim, 0, o), invalid_argument);
  o.round_large = 2 * MiB;
  EXPECT_NO_THROW(vmm_page_pool(sim, 0, o));
}

TEST_F(RoundLarge, LargeBlocksOwnWholePagesAndSmallOnesDoNot) {
  pool_options o;
  o.round_large = 2 * MiB;
  vmm_page_pool pool(sim, 0, o);
  void* base = pool.allocate(256 * MiB);  // live bytes that can absorb a rounding loss
  void* large = pool.allocate(3 * MiB + 1);
  void* small = pool.allocate(100 * KiB + 1);
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, 256 * MiB + 4 * MiB);
  EXPECT_EQ(pool.bytes_in_arena(true).allocated, 112 * KiB) << "its size class, not a page";
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(large) % (2 * MiB), 0u);
  EXPECT_EQ(pool.stats().live_bytes, 256 * MiB + 3 * MiB + 1 + 100 * KiB + 1)
      << "requested bytes, not blocks";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(large, 3 * MiB + 1);
  pool.deallocate(small, 100 * KiB + 1);
  pool.deallocate(base, 256 * MiB);
}

TEST_F(RoundLarge, TheVmmPagePoolRoundsToItsPageByDefaultAnd512TurnsItOff) {
  {
    vmm_page_pool pool(sim, 0);
    EXPECT_EQ(pool.options().round_large, 2 * MiB);
    void* base = pool.allocate(256 * MiB);
    void* p = pool.allocate(5 * MiB + 512 * KiB);
    EXPECT_EQ(pool.bytes_in_arena(false).allocated, 256 * MiB + 6 * MiB);
    pool.deallocate(p, 5 * MiB + 512 * KiB);
    pool.deallocate(base, 256 * MiB);
  }
  pool_options o;
  o.round_large = 512;
  vmm_page_pool pool(sim, 0, o);
  void* base = pool.allocate(256 * MiB);
  void* p = pool.allocate(5 * MiB + 512 * KiB);
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, 256 * MiB + 5 * MiB + 512 * KiB);
  pool.deallocate(p, 5 * MiB + 512 * KiB);
  pool.deallocate(base, 256 * MiB);
}

TEST_F(RoundLarge, ARequestAtMostHalfAPagePastAMultipleIsNotRounded) {
  // FSDP-style flat buffers: 48 MiB of weights and 8 KiB of norms each. A whole page for
  // each would lose almost 2 MiB a buffer for its life; their tails share pages instead.
  vmm_page_pool pool(sim, 0);
  void* base = pool.allocate(256 * MiB);
  const std::size_t flat = 48 * MiB + 8 * KiB, half = 49 * MiB;  // tail: exactly half a page
  std::vector<void*> held;
  for (int i = 0; i < 4; ++i) held.push_back(pool.allocate(flat));
  held.push_back(pool.allocate(half));
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, 256 * MiB + 4 * flat + half);
  const std::size_t pages = pool.stats().reserved_bytes / (2 * MiB);
  EXPECT_LE(pages, (256 * MiB + 4 * flat + half) / (2 * MiB) + 2)
      << "consecutive buffers share their tails' pages";
  void* over = pool.allocate(flat + 1 * MiB);  // tail over half a page: rounded
  EXPECT_EQ(pool.bytes_in_arena(false).allocated, 256 * MiB + 4 * flat + half + 50 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(over, flat + 1 * MiB);
  for (int i = 0; i < 4; ++i) pool.deallocate(held[i], flat);
  pool.deallocate(held[4], half);
  pool.deallocate(base, 256 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(RoundLarge, RoundingNeverWastesMoreThanAThirtySecondOfTheLiveBytes) {
  // The worst case for rounding: every request just over a page and a half (a loss of
  // nearly half a page each; at most half a page past a multiple is not rounded at all).
  // Without lifetime hints: requests of one size that all stay live are guessed
  // long-lived after the second, and long-lived blocks are never rounded.
  pool_options o;
  o.lifetime_hints = false;
  vmm_page_pool pool(sim, 0, o);
  std::vector<void*> held;
  const std::size_t n = 3 * MiB + 4 * KiB;
  for (int i = 0; i < 100; ++i) held.push_back(pool.allocate(n));
  const std::size_t live = 100 * n;
  const std::size_t blocks = pool.bytes_in_arena(false).allocated;
  EXPECT_GT(blocks, live) << "some requests were rounded";
  EXPECT_LE(blocks, live + live / 32);
  for (void* p : held) pool.deallocate(p, n);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(RoundLarge, ATensorGrowingEachStepReusesItsPredecessorsBlock) {
  // A KV tensor re-allocated 32 KiB longer each step, the new one made before the old is
  // freed: with whole-page blocks, step t+1 fits the block step t-1 freed, without moving
  // or mapping pages. (Its tail is over half a page: one at most half a page past a
  // multiple is not rounded, and has no such slack.)
  pool_options o;
  o.round_large = 2 * MiB;
  vmm_page_pool pool(sim, 0, o);
  void* base = pool.allocate(512 * MiB);  // other live tensors: the loss stays under 1/32
  std::size_t n = 21 * MiB + 64 * KiB;
  void* old_block = pool.allocate(n);
  void* prev_freed = nullptr;
  auto maps_before = calls(platform_op::map);
  int reused = 0;
  for (int step = 0; step < 20; ++step) {
    if (step == 1) maps_before = calls(platform_op::map);  // after the second block's growth
    const std::size_t next = n + 32 * KiB;
    void* grown = pool.allocate(next);
    reused += grown == prev_freed ? 1 : 0;
    pool.deallocate(old_block, n);
    prev_freed = old_block;
    old_block = grown;
    n = next;
  }
  EXPECT_GE(reused, 18) << "the freed predecessor should serve the next step";
  EXPECT_EQ(calls(platform_op::map) - maps_before, 0u);
  pool.deallocate(old_block, n);
  pool.deallocate(base, 512 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

}  // namespace
