// host_memory_resource: pageable host memory in page-aligned mappings; usable bytes,
// stats, and bad frees refused with a typed error, state intact.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::MiB;

class HostMemoryResource : public gpumem_test::sim_pool_test {};

TEST_F(HostMemoryResource, HandsOutWritablePageAlignedMemoryAndCountsIt) {
  host_memory_resource r(sim);
  void* a = r.allocate(3 * MiB + 1);
  void* b = r.allocate(4096, 4096);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a) % 4096, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % 4096, 0u);
  std::memset(a, 0x5a, 3 * MiB + 1);
  std::memset(b, 0xa5, 4096);
  EXPECT_EQ(static_cast<unsigned char*>(a)[3 * MiB], 0x5a);
  auto s = r.stats();
  EXPECT_EQ(s.live_bytes, 3 * MiB + 1 + 4096);
  EXPECT_EQ(s.live_allocations, 2u);
  EXPECT_EQ(s.reserved_bytes, 3 * MiB + 4096 + 4096);  // whole pages
  r.deallocate(a, 3 * MiB + 1);
  r.deallocate(b, 4096);
  s = r.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.reserved_bytes, 0u);
  EXPECT_EQ(r.name(), "host");
}

TEST_F(HostMemoryResource, BadFreesAreRefusedAndChangeNothing) {
  host_memory_resource r(sim);
  void* a = r.allocate(MiB);
  int local = 0;
  EXPECT_THROW(r.deallocate(&local, MiB), invalid_argument);                 // unknown
  EXPECT_THROW(r.deallocate(static_cast<char*>(a) + 64, MiB), invalid_argument);  // interior
  EXPECT_THROW(r.deallocate(a, MiB + 1), invalid_argument);                  // wrong size
  EXPECT_THROW((void)r.allocate(0), invalid_argument);
  EXPECT_EQ(r.stats().live_allocations, 1u);
  static_cast<char*>(a)[MiB - 1] = 1;  // still ours
  r.deallocate(a, MiB);
  EXPECT_THROW(r.deallocate(a, MiB), invalid_argument);  // double free
  EXPECT_EQ(r.stats().live_allocations, 0u);
  EXPECT_EQ(r.validate(), "");
}

}  // namespace
