// scrub:on — every pool zeroes a block at free, in stream order, before another owner can
// get it: checked by reading the block a later allocation receives (sim memory is host
// memory). A failing memset refuses the free and leaves the allocation live.
#include <gtest/gtest.h>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

class Scrub : public sim_pool_test {
 protected:
  static pool_options scrub_on() { return pool_options::parse("scrub:on"); }

  // Allocates, dirties, frees, allocates the same size again on the same stream (the pool
  // hands back the same block) and checks it reads zero.
  void check_reused_block_is_zero(memory_resource& pool, std::size_t bytes) {
    void* a = pool.allocate(bytes);
    fill(a, bytes, 0xc3);
    pool.deallocate(a, bytes);
    void* b = pool.allocate(bytes);
    EXPECT_EQ(b, a) << "the test expects the freed block back";
    EXPECT_TRUE(holds(b, bytes, 0)) << pool.name() << " handed out a block holding old bytes";
    pool.deallocate(b, bytes);
  }
};

TEST_F(Scrub, ParsesAndPrints) {
  EXPECT_TRUE(pool_options::parse("scrub:on").scrub);
  EXPECT_FALSE(pool_options::parse("scrub:off").scrub);
  EXPECT_FALSE(pool_options{}.scrub);
  EXPECT_TRUE(pool_options::parse(scrub_on().to_string()).scrub);
  EXPECT_THROW(pool_options::parse("scrub:maybe"), gpumem::invalid_argument);
}

TEST_F(Scrub, EveryPoolHandsOutZeroedBlocks) {
  {
    vmm_page_pool pool(sim, 0, scrub_on());
    check_reused_block_is_zero(pool, 3 * MiB + 5);
    check_reused_block_is_zero(pool, 4 * KiB);
  }
  {
    runtime_resource upstream(sim, 0);
    caching_pool pool(upstream, scrub_on());
    check_reused_block_is_zero(pool, 6 * MiB);
    check_reused_block_is_zero(pool, 512);
  }
  {
    pinned_host_pool host(sim, 0, scrub_on());
    void* a = host.allocate(2 * MiB);
    fill(a, 2 * MiB, 0x11);
    host.deallocate(a, 2 * MiB);
    void* b = host.allocate(2 * MiB);
    EXPECT_TRUE(holds(b, 2 * MiB, 0));
    host.deallocate(b, 2 * MiB);
  }
}

TEST_F(Scrub, WithoutScrubTheOldBytesStay) {
  // The control: the same sequence without scrub shows the old bytes, so the check above
  // can fail.
  vmm_page_pool pool(sim);
  void* a = pool.allocate(MiB);
  fill(a, MiB, 0xc3);
  pool.deallocate(a, MiB);
  void* b = pool.allocate(MiB);
  ASSERT_EQ(b, a);
  EXPECT_TRUE(holds(b, MiB, 0xc3));
  pool.deallocate(b, MiB);
}

TEST_F(Scrub, AFailedMemsetRefusesTheFreeAndKeepsTheAllocation) {
  vmm_page_pool pool(sim, 0, scrub_on());
  void* a = pool.allocate(MiB);
  sim_fault f;
  f.nth = 1;
  f.kind = failure_kind::driver_error;
  sim.inject_fault(platform_op::memset_async, f);
  try {
    pool.deallocate(a, MiB);
    ADD_FAILURE() << "free accepted though its scrub failed";
  } catch (const gpumem::cuda_error& e) {
    EXPECT_EQ(e.call(), "cudaMemsetAsync");
  }
  sim.clear_faults();
  EXPECT_EQ(pool.stats().live_allocations, 1u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(a, MiB);  // the retry succeeds
  EXPECT_EQ(pool.stats().live_allocations, 0u);
}

}  // namespace
