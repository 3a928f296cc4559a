// Shared by the GPU tests: the process's cuda platform (nullptr without a device), and
// REQUIRE_GPU(), which skips a test saying why when there is none (CI has no GPU).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <memory>
#include <string>

#include "gpumem/platform.hpp"

namespace gpumem_test {

inline constexpr std::size_t MiB = std::size_t{1} << 20;

inline gpumem::platform* cuda() {
  static std::string why;
  static std::unique_ptr<gpumem::platform> p = gpumem::make_cuda_platform(&why);
  return p.get();
}

}  // namespace gpumem_test

#define REQUIRE_GPU()                                            \
  do {                                                           \
    if (gpumem_test::cuda() == nullptr) {                        \
      std::string why;                                           \
      (void)gpumem::make_cuda_platform(&why);                    \
      GTEST_SKIP() << "no CUDA device: " << why;                 \
    }                                                            \
  } while (0)
