// A failed platform status as the typed error public entry points throw: one place that
// turns `status` into gpumem::cuda_error (call name, CUDA error name, message, where).
#pragma once

#include <string>

#include "gpumem/errors.hpp"
#include "gpumem/platform/platform.hpp"

namespace gpumem {

// REQUIRES: !failed.ok().
[[noreturn]] inline void throw_cuda_error(const status& failed, const std::string& where) {
  throw cuda_error(std::string(platform_op_name(failed.call)), failed.code, failed.name,
                   failed.message, where);
}

}  // namespace gpumem
