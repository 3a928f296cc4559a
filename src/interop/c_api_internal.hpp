// What the C API's other files (c_api_kv.cpp) need of c_api.cpp: this thread's error slot
// and a live pool handle's parts. Not part of the public API.
#pragma once

#include "gpumem/interop/gpumem.h"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

namespace gpumem::detail {

// Sets this thread's gpumem_last_status() / gpumem_last_error(); returns status.
gpumem_status c_api_fail(gpumem_status status, const char* text) noexcept;

struct c_api_pool_parts {
  pool_base* pool = nullptr;  // null when the handle is not a live pool (error set)
  platform* device_platform = nullptr;
  int device = 0;
};
// The parts of a live handle; pool == nullptr, with this thread's error set naming `where`,
// for a null, destroyed or foreign handle.
c_api_pool_parts c_api_pool(gpumem_pool* pool, const char* where) noexcept;

}  // namespace gpumem::detail
