// cuda platform, absent: built when the CUDA toolkit was not found at build time, so the
// library still links and default_platform() falls back to sim with a clear reason.
#include <memory>
#include <string>

#include "gpumem/platform/cuda_platform.hpp"

namespace gpumem {

bool cuda_platform_compiled() noexcept { return false; }

std::unique_ptr<platform> make_cuda_platform(std::string* why) {
  if (why != nullptr) *why = "gpumem was built without the CUDA toolkit";
  return nullptr;
}

}  // namespace gpumem
