// guard:on — vmm_page_pool's debug mode: every allocation ends at an unmapped guard page,
// so an overrun faults at once (on sim: SIGSEGV, shown by a death test), frees reuse the
// pages, and bad frees are still refused.
#include <gtest/gtest.h>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

class Guard : public sim_pool_test {
 protected:
  static pool_options guard_on() { return pool_options::parse("guard:on"); }
};

TEST_F(Guard, AllocationsEndAtTheirGuardPageAndReusePages) {
  vmm_page_pool pool(sim, 0, guard_on());
  void* a = pool.allocate(MiB);
  const auto end = reinterpret_cast<std::uintptr_t>(a) + MiB;
  EXPECT_EQ(end % (2 * MiB), 0u) << "the allocation must end at a page boundary";
  fill(a, MiB, 0x42);  // every byte of it is usable
  void* b = pool.allocate(1000);  // not a multiple of the alignment: ends within 255 bytes
  const auto b_end = reinterpret_cast<std::uintptr_t>(b) + 1000;
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % default_alignment, 0u);
  EXPECT_LT((2 * MiB - b_end % (2 * MiB)) % (2 * MiB), default_alignment);
  EXPECT_FALSE(overlaps(a, MiB, b, 1000));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  EXPECT_EQ(pool.stats().live_bytes, MiB + 1000);
  const auto created = pool.page_counts().pages_created;
  pool.deallocate(a, MiB);
  void* c = pool.allocate(MiB);  // the freed page comes back, no new memory
  EXPECT_EQ(pool.page_counts().pages_created, created);
  EXPECT_THROW(pool.deallocate(c, 2 * MiB), gpumem::invalid_argument);  // size mismatch
  pool.deallocate(c, MiB);
  try {
    pool.deallocate(c, MiB);
    ADD_FAILURE() << "double free accepted";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("double free"), std::string::npos) << e.what();
  }
  pool.deallocate(b, 1000);
  EXPECT_EQ(pool.stats().live_allocations, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(Guard, OutOfMemoryIsTypedAndOnlyTheVmmPoolOffersGuards) {
  pool_options o = guard_on();
  o.limit_bytes = 4 * MiB;
  vmm_page_pool pool(sim, 0, o);
  void* a = pool.allocate(3 * MiB);  // two pages
  EXPECT_THROW(pool.allocate(3 * MiB), gpumem::out_of_memory);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(a, 3 * MiB);
  runtime_resource upstream(sim, 0);
  EXPECT_THROW(caching_pool(upstream, guard_on()), gpumem::invalid_argument);
}

using GuardDeathTest = Guard;

TEST_F(GuardDeathTest, AnOverrunOfOneByteFaultsAtOnce) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  vmm_page_pool pool(sim, 0, guard_on());
  auto* p = static_cast<volatile unsigned char*>(pool.allocate(MiB));
  p[MiB - 1] = 1;  // the last byte is fine
  EXPECT_DEATH(p[MiB] = 1, "");
  pool.deallocate(const_cast<unsigned char*>(p), MiB);
}

}  // namespace
