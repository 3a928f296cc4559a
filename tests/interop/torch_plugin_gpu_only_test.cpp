// The PyTorch plug-in never serves simulated memory unless asked: with GPUMEM_DEVICE and
// GPUMEM_CONF unset (cleared before main), on a machine where CUDA cannot start,
// gpumem_torch_malloc throws saying the GPU is missing and how to ask for the simulated
// device, and no pool exists. Skipped on a machine with a GPU (there the pool is the GPU's).
#include <gtest/gtest.h>
#include <sys/types.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "gpumem/interop/gpumem.h"
#include "gpumem/interop/gpumem_torch.h"

namespace {

const bool environment_cleared = [] {
  ::unsetenv("GPUMEM_DEVICE");
  ::unsetenv("GPUMEM_CONF");
  ::unsetenv("GPUMEM_ALLOCATOR");
  return true;
}();

bool gpu_present() {
  gpumem_pool* pool = nullptr;
  if (gpumem_pool_create("platform:cuda,allocator:caching_pool,step_plan:off", &pool) !=
      GPUMEM_SUCCESS)
    return false;
  gpumem_pool_destroy(pool);
  return true;
}

TEST(TorchPluginGpuOnly, WithoutAGpuMallocRefusesInsteadOfServingSimulatedMemory) {
  if (gpu_present()) GTEST_SKIP() << "a CUDA device is present: the plug-in's pool is the GPU's";
  std::string what;
  try {
    void* p = gpumem_torch_malloc(1 << 20, 0, nullptr);
    ADD_FAILURE() << "gpumem_torch_malloc returned " << p << " without a GPU";
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  EXPECT_EQ(what.rfind("gpumem_torch: cannot create the pool for device 0 from 'platform:cuda,", 0),
            0u)
      << what;
  EXPECT_NE(what.find("CUDA_ERROR"), std::string::npos) << what;
  EXPECT_NE(what.find("uses the GPU only; GPUMEM_DEVICE=sim asks for the simulated device"),
            std::string::npos)
      << what;
  EXPECT_EQ(gpumem_torch_pool_exists(0), 0);
  EXPECT_EQ(gpumem_torch_pool(0), nullptr);
  gpumem_stats s{};
  EXPECT_NE(gpumem_torch_stats(0, &s), GPUMEM_SUCCESS);
  gpumem_torch_counts c{};
  EXPECT_NE(gpumem_torch_memory_counts(0, &c), GPUMEM_SUCCESS);
}

}  // namespace
