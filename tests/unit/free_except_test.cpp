// pool_base::free_except: an allocation given back except some ranges of it, which become
// live allocations of their own (how a step planner hands its region to the pool while a
// few planned tensors still live in it), on both pools.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::fill;
using gpumem_test::holds;
using gpumem_test::KiB;
using gpumem_test::MiB;

class FreeExcept : public gpumem_test::sim_pool_test {
 protected:
  // The pool under test: 0 a vmm_page_pool, 1 a caching_pool over cudaMalloc.
  std::unique_ptr<pool_base> make_pool(int kind, pool_options o = {}) {
    if (kind == 0) return std::make_unique<vmm_page_pool>(sim, 0, o);
    upstream_ = std::make_unique<runtime_resource>(sim, 0);
    return std::make_unique<caching_pool>(*upstream_, o);
  }
  std::unique_ptr<runtime_resource> upstream_;
};

std::uintptr_t at(void* p, std::size_t offset) { return reinterpret_cast<std::uintptr_t>(p) + offset; }
void* ptr(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

TEST_F(FreeExcept, KeptRangesLiveOnAndTheRestIsReused) {
  for (int kind = 0; kind < 2; ++kind) {
    SCOPED_TRACE(kind == 0 ? "vmm_page_pool" : "caching_pool");
    auto pool = make_pool(kind);
    const std::size_t region = 40 * MiB;
    void* r = pool->allocate(region);
    const auto live_before = pool->stats().live_allocations;
    // Three tensors in it: at the start, in the middle (not 512-byte long), at the end.
    const std::vector<pool_base::kept_range> keep = {
        {at(r, 0), 3 * MiB}, {at(r, 17 * MiB), 5 * MiB + 100}, {at(r, region - MiB), MiB}};
    for (std::size_t i = 0; i < keep.size(); ++i)
      fill(ptr(keep[i].address), keep[i].bytes, static_cast<unsigned char>(0x70 + i));
    ASSERT_TRUE(pool->free_except(r, region, {}, keep));
    EXPECT_EQ(pool->validate(), "");
    const resource_stats s = pool->stats();
    EXPECT_EQ(s.live_allocations, live_before - 1 + keep.size());
    EXPECT_EQ(s.live_bytes, 3 * MiB + 5 * MiB + 100 + MiB);
    const std::size_t reserved = s.reserved_bytes;
    // The 14 MiB gap between the first two is reusable at once, with no growth.
    void* gap = pool->allocate(13 * MiB);
    EXPECT_EQ(pool->stats().reserved_bytes, reserved);
    EXPECT_GE(reinterpret_cast<std::uintptr_t>(gap), at(r, 3 * MiB));
    EXPECT_LE(reinterpret_cast<std::uintptr_t>(gap) + 13 * MiB, at(r, 17 * MiB));
    fill(gap, 13 * MiB, 0x11);
    for (std::size_t i = 0; i < keep.size(); ++i)
      EXPECT_TRUE(holds(ptr(keep[i].address), keep[i].bytes, static_cast<unsigned char>(0x70 + i)));
    // Each kept range is freed with its own size; the old allocation is gone.
    EXPECT_THROW(pool->deallocate(r, region), invalid_argument);
    EXPECT_THROW(pool->deallocate(ptr(keep[1].address), 5 * MiB), invalid_argument);
    for (const auto& k : keep) pool->deallocate(ptr(k.address), k.bytes);
    pool->deallocate(gap, 13 * MiB);
    EXPECT_EQ(pool->stats().live_bytes, 0u);
    EXPECT_EQ(pool->validate(), "");
    // All of it merged back: the region's size fits again without growing.
    void* again = pool->allocate(region);
    EXPECT_EQ(pool->stats().reserved_bytes, reserved);
    pool->deallocate(again, region);
  }
}

TEST_F(FreeExcept, NothingKeptFreesItAll) {
  auto pool = make_pool(0);
  void* r = pool->allocate(8 * MiB);
  ASSERT_TRUE(pool->free_except(r, 8 * MiB, {}, {}));
  EXPECT_EQ(pool->stats().live_bytes, 0u);
  EXPECT_THROW(pool->deallocate(r, 8 * MiB), invalid_argument);
  EXPECT_EQ(pool->validate(), "");
}

TEST_F(FreeExcept, BadInputChangesNothing) {
  for (int kind = 0; kind < 2; ++kind) {
    auto pool = make_pool(kind);
    void* r = pool->allocate(8 * MiB);
    const auto before = pool->stats();
    using ranges = std::vector<pool_base::kept_range>;
    for (const ranges& bad : {ranges{{at(r, 100), 512}},                      // not 512-aligned
                              ranges{{at(r, 0), 0}},                          // empty
                              ranges{{at(r, 7 * MiB), 2 * MiB}},              // past the end
                              ranges{{at(r, 0) - 512, 1024}},                 // before it
                              ranges{{at(r, MiB), MiB}, {at(r, 0), 512}},     // out of order
                              ranges{{at(r, 0), 1000}, {at(r, 512), 512}}}) {  // overlapping
      EXPECT_THROW(pool->free_except(r, 8 * MiB, {}, bad), invalid_argument);
    }
    try {
      pool->free_except(r, 4 * MiB, {}, {});  // wrong size
      ADD_FAILURE() << "a wrong size was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()).rfind("free_except: size mismatch", 0), 0u) << e.what();
    }
    int stranger = 0;
    EXPECT_THROW(pool->free_except(&stranger, 512, {}, {}), invalid_argument);
    EXPECT_EQ(pool->stats().live_bytes, before.live_bytes);
    EXPECT_EQ(pool->stats().live_allocations, before.live_allocations);
    EXPECT_EQ(pool->validate(), "");
    pool->deallocate(r, 8 * MiB);
  }
}

TEST_F(FreeExcept, GuardModeDeclinesAndKeepsTheAllocation) {
  auto pool = make_pool(0, pool_options::parse("guard:on"));
  void* r = pool->allocate(4 * MiB);
  EXPECT_FALSE(pool->free_except(r, 4 * MiB, {}, {{at(r, 0), MiB}}));
  fill(r, 4 * MiB, 0x21);
  pool->deallocate(r, 4 * MiB);
  EXPECT_EQ(pool->validate(), "");
}

}  // namespace
