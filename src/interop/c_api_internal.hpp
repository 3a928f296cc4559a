// What the C API's other files (c_api_kv.cpp, c_api_vmm.cpp) need of c_api.cpp: this
// thread's error slot and a live pool handle's parts. Not part of the public API.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>

#include "gpumem/interop/gpumem.h"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

namespace gpumem::detail {

// Sets this thread's gpumem_last_status() / gpumem_last_error(); returns status.
gpumem_status c_api_fail(gpumem_status status, const char* text) noexcept;

// Tags, sleep / wake and sharing of one pool (c_api_vmm.cpp), made on first use.
struct c_api_vmm_state;

struct c_api_pool_parts {
  pool_base* pool = nullptr;  // null when the handle is not a live pool (error set)
  platform* device_platform = nullptr;
  int device = 0;
  memory_resource* front = nullptr;  // what untagged allocations go through (the planner)
  std::atomic<c_api_vmm_state*>* vmm = nullptr;  // the pool's slot for its vmm state
  std::mutex* vmm_mutex = nullptr;               // guards making it
};
// The parts of a live handle; pool == nullptr, with this thread's error set naming `where`,
// for a null, destroyed or foreign handle.
c_api_pool_parts c_api_pool(gpumem_pool* pool, const char* where) noexcept;

// c_api_vmm.cpp, for c_api.cpp: destroys the state (before the pool); whether untagged
// allocations are refused (tag 0 asleep); whether `ptr` is one of the state's (another
// tag's, shared or imported) and, if so, frees it (the status is the call's).
void c_api_vmm_destroy(c_api_vmm_state* state) noexcept;
bool c_api_vmm_untagged_asleep(const c_api_vmm_state* state) noexcept;
bool c_api_vmm_free(c_api_vmm_state* state, void* ptr, std::size_t size, void* stream,
                    gpumem_status& result) noexcept;

}  // namespace gpumem::detail
