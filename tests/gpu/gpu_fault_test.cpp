// Faults a kernel must hit on the real device, each in a child process of its own (an
// illegal address ends the CUDA context): a one-byte overrun of a guard-mode allocation,
// and a write through a pointer whose vmm_page_pool was destroyed. The control shows the
// same overrun in a normal pool lands silently in mapped memory. Excluded from the
// compute-sanitizer run (scripts/gpu-check.sh), which would report the faults on purpose.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "gpumem/pool.hpp"

#include "gpu/device_kernels.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::cuda;
using gpumem_test::device_kernels;
using gpumem_test::MiB;

constexpr int illegal_address_exit = 3;

device_kernels& kernels() {
  std::string why;
  device_kernels* k = device_kernels::get(&why);
  if (k == nullptr) {
    std::fprintf(stderr, "no test kernels: %s\n", why.c_str());
    std::abort();
  }
  return *k;
}

// Writes one byte at p[offset] from a kernel and waits: exits with illegal_address_exit when
// the device reports an illegal address, else with 4, printing what happened either way.
[[noreturn]] void poke_and_exit(void* p, std::size_t offset) {
  device_kernels& k = kernels();
  std::string launched = k.poke(p, offset, 0xab, nullptr);
  std::string waited = k.synchronize(nullptr);
  std::fprintf(stderr, "launch: '%s', synchronize: '%s'\n", launched.c_str(), waited.c_str());
  std::_Exit(waited.find("cudaErrorIllegalAddress") != std::string::npos ? illegal_address_exit : 4);
}

class GpuFaultDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(GpuFaultDeathTest, AKernelOverrunOfAGuardedAllocationIsAnIllegalAddress) {
  REQUIRE_GPU();
  vmm_page_pool pool(*cuda(), 0, pool_options::parse("guard:on"));
  void* p = pool.allocate(MiB);
  // The last byte is the allocation's own: the write lands.
  ASSERT_EQ(kernels().poke(p, MiB - 1, 1, nullptr), "");
  ASSERT_EQ(kernels().synchronize(nullptr), "");
  EXPECT_EXIT(poke_and_exit(p, MiB), ::testing::ExitedWithCode(illegal_address_exit),
              "cudaErrorIllegalAddress");
  pool.deallocate(p, MiB);
}

TEST_F(GpuFaultDeathTest, WithoutGuardsTheSameOverrunLandsSilently) {
  REQUIRE_GPU();
  vmm_page_pool pool(*cuda());
  void* p = pool.allocate(MiB);  // a 2 MiB page: the byte after it is mapped
  EXPECT_EQ(kernels().poke(p, MiB, 1, nullptr), "");
  EXPECT_EQ(kernels().synchronize(nullptr), "") << "the overrun went unnoticed: why guards exist";
  pool.deallocate(p, MiB);
}

TEST_F(GpuFaultDeathTest, AWriteThroughAPointerOfADestroyedPoolIsAnIllegalAddress) {
  REQUIRE_GPU();
  void* stale = nullptr;
  {
    vmm_page_pool pool(*cuda());
    stale = pool.allocate(MiB);
    ASSERT_EQ(kernels().fill(stale, MiB, 7, nullptr), "");
    ASSERT_EQ(kernels().synchronize(nullptr), "");
    // Destroyed with the allocation live: its pages are unmapped and the range freed.
  }
  EXPECT_EXIT(poke_and_exit(stale, 0), ::testing::ExitedWithCode(illegal_address_exit),
              "cudaErrorIllegalAddress");
}

}  // namespace
