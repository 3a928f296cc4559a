// Minimal reproductions of what the reference-model fuzzer found (fuzz_driver.hpp), kept
// as plain tests so each stays fixed.
#include <gtest/gtest.h>

#include <cstring>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

namespace {

using namespace gpumem;
constexpr std::size_t MiB = std::size_t{1} << 20;

// caching_pool over vmm_resource: trim() gives a free segment back; vmm_resource's free
// unmaps it, then cuMemRelease fails. The segment is still owned upstream (a retry
// resumes) but no longer mapped, so the pool must not hand its memory out again: the
// next allocation of that size must be writable, and the pool valid.
TEST(fuzz_regression, caching_pool_does_not_reuse_a_segment_whose_upstream_free_failed_halfway) {
  sim_platform sim(sim_options{.capacity = 256 * MiB, .granularity = 2 * MiB});
  {
    vmm_resource upstream(sim);
    caching_pool pool(upstream);
    void* p = pool.allocate(4 * MiB);
    pool.deallocate(p, 4 * MiB);
    sim.inject_fault(platform_op::release_physical,
                     sim_fault{.nth = 1, .kind = failure_kind::driver_error});
    (void)pool.trim();  // the failure is kept inside: the segment stays the pool's
    sim.clear_faults();
    EXPECT_EQ(pool.validate(), "");
    void* q = pool.allocate(4 * MiB);
    std::memset(q, 0x5a, 4 * MiB);  // SIGSEGV when the pool reused the unmapped segment
    pool.deallocate(q, 4 * MiB);
    EXPECT_EQ(pool.stats().live_bytes, 0u);
    (void)pool.trim();
    EXPECT_EQ(pool.stats().reserved_bytes, 0u) << "the segment is given back once the driver allows";
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

}  // namespace

namespace {

// pool_options::release_threshold: a deallocate that frees the block, then fails to give
// cached memory back (a driver call fails), must not throw: the block IS freed, and a
// caller told otherwise would free it again (double free) or count it as still live.
TEST(fuzz_regression, a_free_whose_opportunistic_release_fails_still_succeeds) {
  gpumem::sim_platform sim(gpumem::sim_options{.capacity = 256 * MiB, .granularity = 2 * MiB});
  {
    gpumem::runtime_resource upstream(sim);
    gpumem::pool_options o;
    o.release_threshold = 0;
    gpumem::caching_pool pool(upstream, o);
    void* p = pool.allocate(1 * MiB);
    sim.inject_fault(gpumem::platform_op::stream_synchronize,
                     gpumem::sim_fault{.nth = 1, .kind = gpumem::failure_kind::driver_error});
    EXPECT_NO_THROW(pool.deallocate(p, 1 * MiB));
    sim.clear_faults();
    EXPECT_EQ(pool.stats().live_allocations, 0u);
    EXPECT_EQ(pool.validate(), "");
    EXPECT_THROW(pool.deallocate(p, 1 * MiB), gpumem::invalid_argument) << "it was freed once";
    (void)pool.trim();
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

}  // namespace

#include "fuzz/fuzz_driver.hpp"

namespace {

// OPEN (disabled so CI stays green; enable once fixed): vmm_page_pool throws
// out_of_memory for requests of a few MiB while the device has most of its memory free
// and the pool has no limit (e.g. "device: 1.00 GiB total, 1008.00 MiB free ... reserved
// 16 MiB, 8 pages mapped, 0 kept unmapped" in pool_stress.vmm_page_pool's first refusal).
// The fuzz corpus (no faults) hits it deterministically on these seeds; a trim() makes
// the same request succeed. caching_pool and pinned_host_pool never do this on the same
// inputs. Found by the reference-model fuzzer; reported in docs/RELIABILITY.md.
TEST(fuzz_regression, DISABLED_vmm_page_pool_never_refuses_while_the_device_has_memory_free) {
  gpumem_fuzz::fuzz_counts counts;
  for (std::uint64_t seed = 0; seed < 10; ++seed) {
    const auto bytes = gpumem_fuzz::corpus_bytes(seed, 6000);
    ASSERT_EQ(gpumem_fuzz::run_pool_fuzz(gpumem_fuzz::pool_target::vmm_page, bytes.data(),
                                         bytes.size(), false, 500, counts),
              "");
  }
  EXPECT_EQ(counts.oom_with_device_memory_free, 0u);
}

}  // namespace
