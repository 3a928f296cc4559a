// GPU tests: the real driver under the VMM seam and the pools. Each test skips, saying
// why, when no CUDA device is present (CI has none).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

#include "gpu/gpu_test_support.hpp"

namespace {

using namespace gpumem;

using gpumem_test::cuda;
using gpumem_test::MiB;

// Copies `bytes` of a pattern into device memory and back; true when they round-trip.
bool round_trip(platform& p, void* device_ptr, std::size_t bytes, unsigned char seed) {
  std::vector<unsigned char> in(bytes), out(bytes, 0);
  for (std::size_t i = 0; i < bytes; ++i) in[i] = static_cast<unsigned char>(seed + i * 7);
  if (!p.memcpy_async(device_ptr, in.data(), bytes, {})) return false;
  if (!p.memcpy_async(out.data(), device_ptr, bytes, {})) return false;
  if (!p.stream_synchronize({})) return false;
  return in == out;
}

std::vector<unsigned char> read_back(platform& p, const void* device_ptr, std::size_t bytes) {
  std::vector<unsigned char> out(bytes);
  EXPECT_TRUE(p.memcpy_async(out.data(), device_ptr, bytes, {}).ok());
  EXPECT_TRUE(p.stream_synchronize({}).ok());
  return out;
}

TEST(gpu_platform, one_handle_mapped_twice_shows_the_same_bytes) {
  REQUIRE_GPU();
  platform& p = *cuda();
  const std::size_t g = p.granularity(0).value().recommended;
  auto a = p.reserve_range(g, g);
  auto b = p.reserve_range(g, g);
  auto h = p.create_physical(0, g);
  ASSERT_TRUE(a && b && h);
  ASSERT_TRUE(p.map(a.value(), g, h.value(), 0));
  ASSERT_TRUE(p.map(b.value(), g, h.value(), 0));
  ASSERT_TRUE(p.set_access(0, a.value(), g));
  ASSERT_TRUE(p.set_access(0, b.value(), g));
  ASSERT_TRUE(p.memset_async(reinterpret_cast<void*>(a.value()), 0x5a, 4096, {}));
  auto seen = read_back(p, reinterpret_cast<void*>(b.value()), 4096);
  EXPECT_EQ(seen, std::vector<unsigned char>(4096, 0x5a));
  EXPECT_TRUE(p.unmap(a.value(), g));
  EXPECT_TRUE(p.unmap(b.value(), g));
  EXPECT_TRUE(p.release_physical(h.value()));
  EXPECT_TRUE(p.free_range(a.value(), g));
  EXPECT_TRUE(p.free_range(b.value(), g));
}

// Whether one cuMemUnmap may span two adjacent mappings decides how the VMM page pool
// reclaims runs (it falls back to one call per mapping when refused). Either way every
// byte must end unmapped and the handles releasable.
TEST(gpu_platform, unmap_spanning_two_adjacent_mappings) {
  REQUIRE_GPU();
  platform& p = *cuda();
  const std::size_t g = p.granularity(0).value().recommended;
  auto va = p.reserve_range(2 * g, g);
  auto h1 = p.create_physical(0, g);
  auto h2 = p.create_physical(0, g);
  ASSERT_TRUE(va && h1 && h2);
  ASSERT_TRUE(p.map(va.value(), g, h1.value(), 0));
  ASSERT_TRUE(p.map(va.value() + g, g, h2.value(), 0));
  ASSERT_TRUE(p.set_access(0, va.value(), 2 * g));
  const status both = p.unmap(va.value(), 2 * g);
  RecordProperty("batched_unmap", both.ok() ? "accepted" : both.describe());
  std::printf("one cuMemUnmap over two mappings: %s\n", both.ok() ? "accepted" : both.describe().c_str());
  if (!both.ok()) {
    EXPECT_TRUE(p.unmap(va.value(), g));
    EXPECT_TRUE(p.unmap(va.value() + g, g));
  }
  // Unmapped now: the range can be freed and the handles released.
  EXPECT_TRUE(p.release_physical(h1.value()));
  EXPECT_TRUE(p.release_physical(h2.value()));
  EXPECT_TRUE(p.free_range(va.value(), 2 * g));
}

TEST(gpu_platform, async_malloc_round_trip) {
  REQUIRE_GPU();
  platform& p = *cuda();
  auto ptr = p.async_malloc(0, 1 << 20, {});
  ASSERT_TRUE(ptr);
  EXPECT_TRUE(round_trip(p, ptr.value(), 1 << 20, 3));
  EXPECT_TRUE(p.async_free(ptr.value(), {}));
  EXPECT_TRUE(p.stream_synchronize({}));
}

TEST(gpu_pools, vmm_page_pool_blocks_hold_data) {
  REQUIRE_GPU();
  vmm_page_pool pool(*cuda(), 0);
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t size : {512ul, 4096ul, 1ul << 20, 3ul << 20, 64ul << 20}) {
    void* ptr = pool.allocate(size);
    ASSERT_TRUE(round_trip(*cuda(), ptr, size, static_cast<unsigned char>(size)));
    live.emplace_back(ptr, size);
  }
  for (auto [ptr, size] : live) pool.deallocate(ptr, size);
  EXPECT_EQ(pool.validate(), "");
  EXPECT_GT(pool.trim(), 0u);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
}

TEST(gpu_pools, vmm_page_pool_reservation_is_mapped_up_front_and_holds_data) {
  REQUIRE_GPU();
  platform& p = *cuda();
  pool_options options;
  options.reserve_bytes = 64ul << 20;
  const auto access_before = p.calls_made(platform_op::set_access);
  vmm_page_pool pool(p, 0, options);
  const std::size_t page = pool.page_size();
  EXPECT_EQ(pool.page_counts().mapped_pages, (64ul << 20) / page);
  EXPECT_EQ(p.calls_made(platform_op::set_access), access_before + 1) << "one access grant";
  const auto maps = p.calls_made(platform_op::map);
  const auto creates = p.calls_made(platform_op::create_physical);
  void* a = pool.allocate(40ul << 20);
  void* b = pool.allocate(8ul << 20);
  EXPECT_EQ(p.calls_made(platform_op::map), maps) << "served from the mapped reservation";
  EXPECT_EQ(p.calls_made(platform_op::create_physical), creates);
  ASSERT_TRUE(round_trip(p, a, 40ul << 20, 0x2a));
  ASSERT_TRUE(round_trip(p, b, 8ul << 20, 0x2b));
  pool.deallocate(a, 40ul << 20);
  pool.deallocate(b, 8ul << 20);
  EXPECT_EQ(pool.validate(), "");
}

// The driver side of vmm_page_pool's rule that a spare multi-page handle is not mapped
// where fewer pages are missing (it would pin a page beside the block): released, and
// one-page handles made instead; the block then holds data.
TEST(gpu_pools, vmm_page_pool_releases_a_spare_big_handle_that_would_overshoot) {
  REQUIRE_GPU();
  platform& p = *cuda();
  const std::size_t page = p.granularity(0).value().recommended;
  pool_options options;
  options.huge_growth_bytes = 64 * page;  // growths of 64 pages take 4-page handles
  vmm_page_pool pool(p, 0, options);
  ASSERT_EQ(pool.page_size(), page);
  void* a = pool.allocate(64 * page);     // sixteen 4-page handles
  void* b = pool.allocate(page);          // one page above them
  pool.deallocate(a, 64 * page);
  // Lending a page reclaims a 4-page handle of a's free run into the spare ones.
  std::vector<physical_handle> lent = pool.lend_pages(1);
  ASSERT_EQ(lent.size(), 1u);
  ASSERT_EQ(pool.page_counts().spare_pages, 4u);
  const auto released = pool.page_counts().pages_released;
  const auto releases = p.calls_made(platform_op::release_physical);
  void* c = pool.allocate(63 * page);     // 60 pages from a's handles, 3 missing
  const vmm_page_counts after = pool.page_counts();
  EXPECT_EQ(after.pages_released, released + 4) << "the spare 4-page handle was mapped";
  EXPECT_EQ(p.calls_made(platform_op::release_physical), releases + 1);
  EXPECT_EQ(after.spare_pages, 0u);
  EXPECT_EQ(after.mapped_pages, 63u + 1u);
  ASSERT_TRUE(round_trip(p, c, 63 * page, 0x3c));
  ASSERT_TRUE(round_trip(p, b, page, 0x3d));
  pool.return_pages(lent);
  EXPECT_EQ(pool.validate(), "");
  pool.deallocate(c, 63 * page);
  pool.deallocate(b, page);
}

TEST(gpu_pools, remap_reuses_free_pages_and_keeps_live_bytes) {
  REQUIRE_GPU();
  platform& p = *cuda();
  pool_options options;
  options.small_threshold = 0;
  vmm_page_pool pool(p, 0, options);
  const std::size_t page = pool.page_size();
  // 16 blocks of 4 pages; free every other one: 32 free pages, no free run over 4 pages.
  std::vector<void*> blocks;
  for (int i = 0; i < 16; ++i) {
    blocks.push_back(pool.allocate(4 * page));
    ASSERT_TRUE(p.memset_async(blocks.back(), i + 1, 4 * page, {}));
  }
  for (int i = 0; i < 16; i += 2) pool.deallocate(blocks[i], 4 * page);
  const auto creates = p.calls_made(platform_op::create_physical);
  void* big = pool.allocate(24 * page);  // needs stitching
  EXPECT_EQ(p.calls_made(platform_op::create_physical), creates) << "grew instead of remapping";
  EXPECT_GT(pool.page_counts().pages_reclaimed, 0u);
  EXPECT_TRUE(round_trip(p, big, 24 * page, 9));
  for (int i = 1; i < 16; i += 2) {
    auto bytes = read_back(p, blocks[i], 4 * page);
    EXPECT_EQ(bytes.front(), i + 1);
    EXPECT_EQ(bytes.back(), i + 1);
    pool.deallocate(blocks[i], 4 * page);
  }
  pool.deallocate(big, 24 * page);
  EXPECT_EQ(pool.validate(), "");
}

TEST(gpu_pools, caching_pool_over_each_backend) {
  REQUIRE_GPU();
  platform& p = *cuda();
  runtime_resource runtime(p, 0);
  driver_resource driver(p, 0);
  vmm_resource vmm(p, 0);
  for (memory_resource* upstream : {static_cast<memory_resource*>(&runtime),
                                    static_cast<memory_resource*>(&driver),
                                    static_cast<memory_resource*>(&vmm)}) {
    caching_pool pool(*upstream);
    void* a = pool.allocate(1000);
    void* b = pool.allocate(5 << 20);
    EXPECT_TRUE(round_trip(p, a, 1000, 1)) << upstream->name();
    EXPECT_TRUE(round_trip(p, b, 5 << 20, 2)) << upstream->name();
    pool.deallocate(a, 1000);
    pool.deallocate(b, 5 << 20);
    EXPECT_EQ(pool.validate(), "");
  }
}

TEST(gpu_pools, cross_stream_reuse_waits_for_the_free) {
  REQUIRE_GPU();
  platform& p = *cuda();
  auto s1 = p.stream_create(0);
  auto s2 = p.stream_create(0);
  ASSERT_TRUE(s1 && s2);
  {
    pool_options options;
    options.cross_stream = cross_stream_policy::wait;
    vmm_page_pool pool(p, 0, options);
    void* a = pool.allocate(4 << 20, 256, s1.value());  // large: no thread cache keeps it
    ASSERT_TRUE(p.memset_async(a, 1, 4 << 20, s1.value()));
    pool.deallocate(a, 4 << 20, s1.value());
    const auto waits = p.calls_made(platform_op::stream_wait_event);
    void* b = pool.allocate(4 << 20, 256, s2.value());
    EXPECT_EQ(a, b);
    EXPECT_GT(p.calls_made(platform_op::stream_wait_event), waits);
    ASSERT_TRUE(p.memset_async(b, 2, 4 << 20, s2.value()));
    ASSERT_TRUE(p.stream_synchronize(s2.value()));
    pool.deallocate(b, 4 << 20, s2.value());
  }
  EXPECT_TRUE(p.stream_destroy(s1.value()));
  EXPECT_TRUE(p.stream_destroy(s2.value()));
}

// A step planner over the vmm_page_pool on the device: steps of nested tensors, each
// filled on the stream with its own byte while the others live; after two equal steps the
// rest come from the plan (no mapping call), and every live tensor still holds its byte
// when read back; a free on another stream makes the plan's stream wait for it.
TEST(gpu_pools, step_planner_serves_equal_steps_and_keeps_live_tensors_apart) {
  REQUIRE_GPU();
  platform& p = *cuda();
  auto side = p.stream_create(0);
  ASSERT_TRUE(side);
  {
    vmm_page_pool pool(p, 0);
    step_planner planner(pool);
    const std::size_t sizes[] = {6 * MiB, 3 * MiB + 512, 40 * MiB, 1000, 9 * MiB};
    std::uint64_t maps_after_plan = 0;
    for (int step = 0; step < 6; ++step) {
      planner.mark_step();
      if (step == 3) maps_after_plan = p.calls_made(platform_op::map);
      std::vector<void*> live;
      for (std::size_t i = 0; i < std::size(sizes); ++i) {
        live.push_back(planner.allocate(sizes[i], 256, {}));
        ASSERT_TRUE(p.memset_async(live.back(), static_cast<int>(0x10 + i), sizes[i], {}));
      }
      for (std::size_t i = 0; i < live.size(); ++i) {
        const auto bytes = read_back(p, live[i], sizes[i]);
        ASSERT_TRUE(std::all_of(bytes.begin(), bytes.end(),
                                [&](unsigned char b) { return b == 0x10 + i; }))
            << "step " << step << " tensor " << i;
      }
      for (std::size_t i = live.size(); i-- > 0;) planner.deallocate(live[i], sizes[i], {});
    }
    const step_planner_counts c = planner.counts();
    EXPECT_EQ(c.plans_built, 1u);
    EXPECT_EQ(c.planned_allocations, 4u * std::size(sizes));  // steps 2..5
    EXPECT_EQ(p.calls_made(platform_op::map), maps_after_plan);
    // A planned tensor freed on another stream: the plan's stream waits for that stream.
    planner.mark_step();
    void* a = planner.allocate(sizes[0], 256, {});
    ASSERT_TRUE(p.memset_async(a, 0x77, sizes[0], side.value()));
    const auto waits = p.calls_made(platform_op::stream_wait_event);
    planner.deallocate(a, sizes[0], side.value());
    EXPECT_EQ(p.calls_made(platform_op::stream_wait_event), waits + 1);
    ASSERT_TRUE(p.stream_synchronize({}));
    EXPECT_EQ(planner.validate(), "");
    planner.release_stream(side.value());
  }
  EXPECT_TRUE(p.stream_destroy(side.value()));
}

TEST(gpu_pools, fixed_block_pool_on_vmm_pages) {
  REQUIRE_GPU();
  vmm_page_pool pages(*cuda(), 0);
  fixed_block_pool blocks(pages, 64 << 10);
  std::vector<fixed_block_pool::block_id> ids;
  for (int i = 0; i < 100; ++i) ids.push_back(blocks.allocate());
  for (auto id : ids) ASSERT_TRUE(round_trip(*cuda(), blocks.address(id), 64 << 10, id & 0xff));
  for (auto id : ids) blocks.free(id);
  EXPECT_EQ(blocks.validate(), "");
  EXPECT_GT(blocks.shrink(), 0u);
}

TEST(gpu_backends, driver_alloc_restores_no_context_state_and_oom_is_typed) {
  REQUIRE_GPU();
  driver_resource driver(*cuda(), 0);
  void* a = driver.allocate(1 << 20);
  EXPECT_TRUE(round_trip(*cuda(), a, 1 << 20, 4));
  driver.deallocate(a, 1 << 20);
  vmm_resource vmm(*cuda(), 0);
  // Larger than free memory but within the device total: a typed OOM with a report.
  auto info = cuda()->mem_info(0).value();
  const std::size_t too_big = info.total - (info.total - info.free) / 2;
  if (too_big > info.free) {
    try {
      void* p = vmm.allocate(too_big);
      vmm.deallocate(p, too_big);
      ADD_FAILURE() << "expected out_of_memory";
    } catch (const out_of_memory& e) {
      EXPECT_NE(std::string(e.what()).find("free"), std::string::npos);
    }
  }
}

}  // namespace
