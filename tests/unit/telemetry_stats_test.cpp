// memory_stats over pools on a sim device: PyTorch's names with gpumem's meaning
// (allocated = rounded blocks, requested = asked-for bytes), inactive split bytes, retries
// and OOMs, page counts of the VMM pool, driver calls from the platform's counters.
#include "gpumem/telemetry/memory_stats.hpp"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::KiB;
using gpumem_test::MiB;

class TelemetryStats : public gpumem_test::sim_pool_test {};

struct runtime_caching_pool {
  runtime_resource upstream;
  caching_pool pool;
  explicit runtime_caching_pool(platform& p, pool_options o = {}) : upstream(p), pool(upstream, o) {}
};

std::map<std::string, double> as_map(const memory_stats& m) {
  std::map<std::string, double> out;
  for (const auto& [k, v] : m.torch_keys()) out[k] = v;
  return out;
}

TEST_F(TelemetryStats, AllocatedIsRoundedBlocksRequestedIsWhatWasAsked) {
  vmm_page_pool pool(sim);
  void* a = pool.allocate(1000);      // a 1024-byte block (512-byte units)
  void* b = pool.allocate(3 * MiB + 1);
  memory_stats m = collect_memory_stats(pool);
  EXPECT_EQ(m.allocator, "vmm_page_pool");
  EXPECT_EQ(m.requested_bytes.current, 1000 + 3 * MiB + 1);
  EXPECT_EQ(m.allocated_bytes.current, 1024 + 3 * MiB + 512);
  EXPECT_EQ(m.active_bytes.current, m.allocated_bytes.current);
  EXPECT_EQ(m.live_allocations, 2u);
  pool.deallocate(b, 3 * MiB + 1);
  m = collect_memory_stats(pool);
  EXPECT_EQ(m.requested_bytes.current, 1000u);
  EXPECT_EQ(m.requested_bytes.peak, 1000 + 3 * MiB + 1);
  EXPECT_EQ(m.allocated_bytes.current, 1024u);
  EXPECT_EQ(m.allocated_bytes.peak, 1024 + 3 * MiB + 512);
  EXPECT_EQ(m.num_allocs, 2u);
  EXPECT_EQ(m.num_frees, 1u);
  EXPECT_EQ(m.reserved_bytes.current, pool.stats().reserved_bytes);
  EXPECT_EQ(m.reserved_bytes.peak, pool.stats().peak_reserved_bytes);
  EXPECT_GE(m.reserved_bytes.current, m.allocated_bytes.current + m.inactive_split_bytes);
  pool.deallocate(a, 1000);
}

TEST_F(TelemetryStats, InactiveSplitCountsIdleBytesOnlyInSegmentsThatAreInUse) {
  runtime_caching_pool env(sim);
  // Two 2 MiB small segments: one partly used, one wholly free.
  void* a = env.pool.allocate(512 * KiB);
  void* b = env.pool.allocate(1 * MiB);
  void* c = env.pool.allocate(1 * MiB);  // does not fit the rest of the first: a second one
  env.pool.deallocate(c, 1 * MiB);
  env.pool.deallocate(b, 1 * MiB);
  memory_stats m = collect_memory_stats(env.pool);
  ASSERT_EQ(env.pool.segment_count(), 2u);
  EXPECT_EQ(m.segments, 2u);
  EXPECT_EQ(m.allocated_bytes.current, 512 * KiB);
  // The first segment's idle 1.5 MiB is split off a used block; the second is wholly free.
  EXPECT_EQ(m.inactive_split_bytes, 2 * MiB - 512 * KiB);
  EXPECT_EQ(m.cached_bytes, 4 * MiB - 512 * KiB);
  EXPECT_FALSE(m.has_pages);
  env.pool.deallocate(a, 512 * KiB);
  EXPECT_EQ(collect_memory_stats(env.pool).inactive_split_bytes, 0u);
}

TEST_F(TelemetryStats, RetriesOomsAndFragmentationFollowThePool) {
  pool_options o;
  o.limit_bytes = 8 * MiB;
  vmm_page_pool pool(sim, 0, o);
  void* a = pool.allocate(4 * MiB);
  EXPECT_THROW(pool.allocate(6 * MiB), out_of_memory);
  memory_stats m = collect_memory_stats(pool);
  EXPECT_EQ(m.num_ooms, 1u);
  EXPECT_EQ(m.num_alloc_retries, 1u);  // it released cached memory before giving up
  EXPECT_DOUBLE_EQ(m.fragmentation, pool.stats().fragmentation());
  const auto keys = as_map(m);
  EXPECT_EQ(keys.at("num_ooms"), 1.0);
  EXPECT_EQ(keys.at("num_alloc_retries"), 1.0);
  EXPECT_EQ(keys.at("allocated_bytes.all.current"), static_cast<double>(4 * MiB));
  EXPECT_EQ(keys.at("reserved_bytes.all.peak"), static_cast<double>(m.reserved_bytes.peak));
  EXPECT_TRUE(keys.count("requested_bytes.all.peak"));
  EXPECT_TRUE(keys.count("inactive_split_bytes.all.current"));
  EXPECT_TRUE(keys.count("active_bytes.all.current"));
  pool.deallocate(a, 4 * MiB);
}

TEST_F(TelemetryStats, VmmPoolReportsPagesMappedAndKeptAndDriverCalls) {
  vmm_page_pool pool(sim);
  void* a = pool.allocate(8 * MiB);
  void* b = pool.allocate(4 * MiB);
  pool.deallocate(a, 8 * MiB);
  pool.deallocate(pool.allocate(6 * MiB), 6 * MiB);  // fits the freed 8 MiB: no change
  memory_stats m = collect_memory_stats(pool);
  const vmm_page_counts c = pool.page_counts();
  ASSERT_TRUE(m.has_pages);
  EXPECT_EQ(m.page_size, 2 * MiB);
  EXPECT_EQ(m.pages_mapped, c.mapped_pages);
  EXPECT_EQ(m.pages_mapped, 6u);
  EXPECT_EQ(m.pages_kept, c.spare_pages);
  EXPECT_EQ(m.physical_handles, c.handles);
  EXPECT_EQ(m.reserved_bytes.current, (m.pages_mapped + m.pages_kept) * m.page_size);
  // Driver calls are the platform's counters, by CUDA name.
  EXPECT_EQ(m.driver_calls.at(std::string(platform_op_name(platform_op::create_physical))),
            sim.calls_made(platform_op::create_physical));
  EXPECT_EQ(m.driver_calls.at(std::string(platform_op_name(platform_op::map))),
            sim.calls_made(platform_op::map));
  const auto keys = as_map(m);
  EXPECT_EQ(keys.at("gpumem.pages_mapped"), 6.0);
  EXPECT_TRUE(keys.count("gpumem.driver_calls." +
                         std::string(platform_op_name(platform_op::map))));
  const std::string text = m.to_string();
  EXPECT_NE(text.find("6 mapped"), std::string::npos) << text;
  EXPECT_NE(text.find("allocated_bytes: 4.00 MiB"), std::string::npos) << text;
  pool.deallocate(b, 4 * MiB);
  // Reclaimed into kept pages by trim's reclaim, then released: none kept afterwards.
  pool.trim();
  m = collect_memory_stats(pool);
  EXPECT_EQ(m.pages_mapped, 0u);
  EXPECT_EQ(m.pages_kept, 0u);
  EXPECT_EQ(m.reserved_bytes.current, 0u);
  EXPECT_EQ(m.pages_released, m.pages_created);
}

}  // namespace
