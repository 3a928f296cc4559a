// Use after a pool is destroyed, C++ API on the sim device. A destroyed pool gives its
// memory back: vmm_page_pool unmaps its pages and frees its address range, caching_pool
// returns its segments upstream (on sim, cudaFree munmaps them). So on sim:
//  - a write through a pointer of a destroyed pool faults at once (SIGSEGV, death tests);
//  - that pointer, freed through another live pool, is refused with invalid_argument and
//    the live pool is left as it was (stats, validate()).
// What these tests cannot show, because it cannot be caught: a call on a destroyed pool
// object itself (a dangling C++ reference), and a stale pointer whose address a later
// allocation has reused (it is then that allocation's pointer). The C API's handles are
// covered in c_api_test.cpp.
#include <gtest/gtest.h>

#include <csignal>
#include <string>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;

class UseAfterDestroy : public sim_pool_test {
 protected:
  // Frees `stale` through `live`, which must refuse it with invalid_argument and change
  // nothing; returns the refusal's text.
  static std::string expect_refused_and_intact(pool_base& live, void* stale, std::size_t size) {
    const resource_stats before = live.stats();
    std::string what;
    try {
      live.deallocate(stale, size);
      ADD_FAILURE() << "a pointer of a destroyed pool was accepted by a live pool";
    } catch (const gpumem::invalid_argument& e) {
      what = e.what();
    }
    const resource_stats after = live.stats();
    EXPECT_EQ(after.live_bytes, before.live_bytes);
    EXPECT_EQ(after.live_allocations, before.live_allocations);
    EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
    EXPECT_EQ(after.cached_bytes, before.cached_bytes);
    EXPECT_EQ(after.deallocations, before.deallocations);
    EXPECT_TRUE(live.is_valid()) << live.validate();
    return what;
  }
};

using UseAfterDestroyDeathTest = UseAfterDestroy;

TEST_F(UseAfterDestroyDeathTest, AWriteThroughAPointerOfADestroyedVmmPagePoolFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  volatile unsigned char* stale = nullptr;
  {
    vmm_page_pool pool(sim, 0, pool_options{});
    stale = static_cast<volatile unsigned char*>(pool.allocate(MiB));
    stale[0] = 1;  // fine while the pool lives
  }  // live allocation and all: unmapped, range freed
  EXPECT_EXIT(stale[0] = 2, ::testing::KilledBySignal(SIGSEGV), "");
}

// sim's cudaFree munmaps the allocation, so the caching pool's segments fault once it is
// gone too. (On a GPU, whether freed memory faults is up to the driver.)
TEST_F(UseAfterDestroyDeathTest, AWriteThroughAPointerOfADestroyedCachingPoolFaultsOnSim) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  runtime_resource upstream(sim, 0);
  volatile unsigned char* stale = nullptr;
  {
    caching_pool pool(upstream, pool_options{});
    stale = static_cast<volatile unsigned char*>(pool.allocate(MiB));
    stale[0] = 1;
  }
  EXPECT_EQ(upstream.stats().live_allocations, 0u) << "the pool kept a segment upstream";
  EXPECT_EXIT(stale[0] = 2, ::testing::KilledBySignal(SIGSEGV), "");
}

TEST_F(UseAfterDestroy, APointerOfADestroyedVmmPagePoolIsRefusedByLivePools) {
  // The live pools come first, so their address ranges cannot reuse the dead pool's.
  vmm_page_pool live_vmm(sim, 0, pool_options{});
  runtime_resource upstream(sim, 0);
  caching_pool live_caching(upstream, pool_options{});
  void* kept_vmm = live_vmm.allocate(MiB);
  void* kept_caching = live_caching.allocate(MiB);

  void* first = nullptr;   // at the start of the dead pool's range
  void* second = nullptr;  // further in
  {
    vmm_page_pool dead(sim, 0, pool_options{});
    first = dead.allocate(MiB);
    second = dead.allocate(MiB);
  }
  for (pool_base* live : {static_cast<pool_base*>(&live_vmm),
                          static_cast<pool_base*>(&live_caching)}) {
    SCOPED_TRACE(live->name());
    // Anywhere in the dead pool's range, its start too: the registry remembers the range
    // it gave back (not "double free": the caller never freed it).
    for (void* stale : {first, second}) {
      const std::string why = expect_refused_and_intact(*live, stale, MiB);
      EXPECT_NE(why.find("has given back"), std::string::npos) << why;
      EXPECT_NE(why.find("'vmm_page_pool'"), std::string::npos) << why;
      EXPECT_EQ(why.find("double free"), std::string::npos) << why;
    }
  }
  live_vmm.deallocate(kept_vmm, MiB);
  live_caching.deallocate(kept_caching, MiB);
}

TEST_F(UseAfterDestroy, APointerOfADestroyedCachingPoolIsRefusedByLivePools) {
  vmm_page_pool live_vmm(sim, 0, pool_options{});
  runtime_resource upstream(sim, 0);
  caching_pool live_caching(upstream, pool_options{});
  void* kept_vmm = live_vmm.allocate(MiB);
  void* kept_caching = live_caching.allocate(MiB);

  void* first = nullptr;
  void* second = nullptr;
  {
    caching_pool dead(upstream, pool_options{});  // the same upstream outlives it
    first = dead.allocate(MiB);
    second = dead.allocate(MiB);
  }
  for (pool_base* live : {static_cast<pool_base*>(&live_vmm),
                          static_cast<pool_base*>(&live_caching)}) {
    SCOPED_TRACE(live->name());
    // Both allocations came from one segment, which went back upstream: either pointer
    // lies in memory the caching pool gave back.
    for (void* stale : {first, second}) {
      const std::string why = expect_refused_and_intact(*live, stale, MiB);
      EXPECT_NE(why.find("has given back"), std::string::npos) << why;
      EXPECT_NE(why.find("'caching_pool'"), std::string::npos) << why;
    }
  }
  live_vmm.deallocate(kept_vmm, MiB);
  live_caching.deallocate(kept_caching, MiB);
}

}  // namespace
