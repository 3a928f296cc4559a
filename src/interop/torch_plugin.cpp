// libgpumem_torch.so: gpumem as PyTorch's CUDA allocator, through
// torch.cuda.memory.CUDAPluggableAllocator(lib, "gpumem_torch_malloc", "gpumem_torch_free").
//
// One pool per device, created on the first allocation for that device from GPUMEM_CONF
// (the C API's configuration string) with `allocator` defaulting to GPUMEM_ALLOCATOR, else
// vmm_page_pool, and `device` set to the device PyTorch names. Pools are never destroyed:
// PyTorch frees tensors during interpreter shutdown, after static destructors would run.
//
// Streams: PyTorch passes the current stream at allocation and, at free, the stream the
// tensor was allocated on; both go to the pool unchanged, which reuses a freed block at
// once on that stream and on another only once the free is complete (stream-ordered
// reuse, as PyTorch's own allocator). A tensor also used on another stream must be
// recorded (tensor.record_stream): PyTorch forwards that to a pluggable allocator only
// through CUDAPluggableAllocator::set_record_stream_fn, so gpumem_torch_record_stream has
// that signature; python/gpumem sets it (PyTorch 2.11 exposes the setter on the allocator
// object) or, where it cannot, routes Tensor.record_stream to gpumem_torch_record_stream_on. At free, the
// freeing stream then waits for the recorded streams' work (gpumem_record_stream).
//
// Failures: PyTorch does not check the pointer a pluggable allocator returns (a null one
// becomes a tensor on address 0), so gpumem_torch_malloc throws with gpumem's full text
// instead; PyTorch raises a std::runtime_error in Python as a RuntimeError (measured with
// torch 2.11 on the H200). An out-of-memory's text starts "CUDA out of memory.", as
// PyTorch's own does, for code that looks for it; built against libtorch (GPUMEM_TORCH_C10,
// src/interop/CMakeLists.txt) it is PyTorch's own c10::OutOfMemoryError, raised as
// torch.OutOfMemoryError (a RuntimeError subclass), so `except torch.OutOfMemoryError`
// catches it as it catches PyTorch's allocator's. No other entry point throws: PyTorch
// frees from destructors, so a failed free or record is printed on stderr and counted.
//
// Invariants: pools_[d] is null or a pool of device d, set once.
#include <sys/types.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

#include "gpumem/interop/gpumem.h"
#include "interop/torch_graph_pools.hpp"

#ifdef GPUMEM_TORCH_C10
#include <c10/util/Exception.h>
#endif

namespace {

constexpr int max_devices = 64;

std::array<std::atomic<gpumem_pool*>, max_devices> pools_{};
std::mutex init_mutex_;
// Why device d's pool could not be created ("" if it was not tried or succeeded); guarded
// by init_mutex_. Printed once, thrown by every malloc for d.
std::array<std::string, max_devices> init_error_{};
std::atomic<std::uint64_t> failures_{0};

// On stderr, the one place a failure PyTorch cannot see is said.
void print(const char* what) noexcept { std::fprintf(stderr, "gpumem_torch: %s\n", what); }

// A failed free or record: printed and counted (gpumem_torch_failures).
void report(const char* what) noexcept {
  failures_.fetch_add(1, std::memory_order_relaxed);
  print(what);
}

// The configuration of device `device`'s pool: GPUMEM_CONF, the allocator from
// GPUMEM_ALLOCATOR unless GPUMEM_CONF names one, and the device.
std::string pool_config(int device) {
  std::string config;
  const char* allocator = std::getenv("GPUMEM_ALLOCATOR");
  config = "allocator:";
  config += allocator != nullptr && *allocator != '\0' ? allocator : "vmm_page_pool";
  if (const char* conf = std::getenv("GPUMEM_CONF"); conf != nullptr && *conf != '\0') {
    config += ',';
    config += conf;  // a later key wins, so GPUMEM_CONF's allocator overrides the above
  }
  config += ",device:" + std::to_string(device);
  return config;
}

// Why pool_for last returned null on this thread (set on every such return), for
// gpumem_torch_malloc's exception.
thread_local std::string pool_failure_;

gpumem_pool* pool_for(int device) noexcept {
  try {
    if (device < 0 || device >= max_devices) {
      pool_failure_ = "device " + std::to_string(device) + " is out of range (0.." +
                      std::to_string(max_devices - 1) + ")";
      print(pool_failure_.c_str());
      return nullptr;
    }
    gpumem_pool* pool = pools_[device].load(std::memory_order_acquire);
    if (pool != nullptr) return pool;
    std::lock_guard lock(init_mutex_);
    pool = pools_[device].load(std::memory_order_relaxed);
    if (pool != nullptr) return pool;
    if (!init_error_[device].empty()) {  // every later call fails the same way: printed once
      pool_failure_ = init_error_[device];
      return nullptr;
    }
    const std::string config = pool_config(device);
    if (gpumem_pool_create(config.c_str(), &pool) != GPUMEM_SUCCESS) {
      init_error_[device] = "cannot create the pool for device " + std::to_string(device) +
                            " from '" + config + "': " + gpumem_last_error();
      pool_failure_ = init_error_[device];
      print(pool_failure_.c_str());
      return nullptr;
    }
    pools_[device].store(pool, std::memory_order_release);
    return pool;
  } catch (...) {
    pool_failure_.clear();  // may throw no more: clear() does not allocate
    print("pool creation failed (host memory or locking)");
    return nullptr;
  }
}

// A free of device `device`'s shared pool; a failure is reported (PyTorch frees from
// destructors, which cannot raise).
void free_to_shared_pool(void* ptr, size_t size, int device, void* stream) noexcept {
  gpumem_pool* pool = device >= 0 && device < max_devices
                          ? pools_[device].load(std::memory_order_acquire)
                          : nullptr;
  if (pool == nullptr) {
    report("gpumem_torch_free: no pool for this device (pointer not from gpumem)");
    return;
  }
  if (gpumem_free(pool, ptr, size, stream) != GPUMEM_SUCCESS) report(gpumem_last_error());
}

}  // namespace

extern "C" {

// Throws on failure (see the top of this file): an out-of-memory as c10::OutOfMemoryError
// when built against libtorch, anything else (and any failure without libtorch) as
// std::runtime_error. Null only for size 0.
GPUMEM_API void* gpumem_torch_malloc(ssize_t size, int device, void* stream) {
  if (size == 0) return nullptr;  // PyTorch's own allocator returns null for empty tensors
  std::string why;
  bool out_of_memory = false;
  if (size < 0) {
    why = "gpumem_torch_malloc: negative size " + std::to_string(size);
  } else if (gpumem_torch::graph_pool* graph = gpumem_torch::graph_pool_for(device, stream)) {
    // A capture (or MemPool context) routes this stream's allocations to its private pool.
    if (void* ptr = gpumem_torch::graph_pool_allocate(graph, static_cast<size_t>(size), stream))
      return ptr;
    why = gpumem_last_error();
    out_of_memory = gpumem_last_status() == GPUMEM_ERROR_OUT_OF_MEMORY;
    if (out_of_memory) why = "CUDA out of memory. " + why;
  } else if (gpumem_pool* pool = pool_for(device); pool == nullptr) {
    why = "gpumem_torch: " + (pool_failure_.empty() ? std::string("pool creation failed")
                                                    : pool_failure_);
  } else if (void* ptr = gpumem_malloc(pool, static_cast<size_t>(size), stream)) {
    return ptr;
  } else {
    why = gpumem_last_error();
    out_of_memory = gpumem_last_status() == GPUMEM_ERROR_OUT_OF_MEMORY;
    if (out_of_memory) why = "CUDA out of memory. " + why;
  }
  failures_.fetch_add(1, std::memory_order_relaxed);
#ifdef GPUMEM_TORCH_C10
  if (out_of_memory)
    throw c10::OutOfMemoryError(
        c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)}, why);
#endif
  throw std::runtime_error(why);
}

// 1 when gpumem_torch_malloc's out-of-memory is PyTorch's c10::OutOfMemoryError (built
// against libtorch), 0 when it is a std::runtime_error.
GPUMEM_API int gpumem_torch_oom_is_torch_type(void) {
#ifdef GPUMEM_TORCH_C10
  return 1;
#else
  return 0;
#endif
}

GPUMEM_API void gpumem_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  if (ptr == nullptr) return;
  if (gpumem_status st = GPUMEM_SUCCESS;
      gpumem_torch::graph_pool_free(ptr, static_cast<size_t>(size), stream, &st)) {
    if (st != GPUMEM_SUCCESS) report(gpumem_last_error());
    return;
  }
  if (gpumem_torch::graph_pool_for(device, stream) != nullptr) {
    try {
      gpumem_torch::defer_free({ptr, static_cast<size_t>(size), device, stream});
      return;
    } catch (...) {
      // No memory to note it: freed now, as without a capture.
    }
  }
  free_to_shared_pool(ptr, static_cast<size_t>(size), device, stream);
}

// The signature of CUDAPluggableAllocator::set_record_stream_fn. The device is not given:
// each existing pool is asked, and the one whose live allocation `ptr` is records it (the
// others refuse a pointer they did not hand out). A failure is reported when no pool
// recorded it: the owner's refusal if one had it, else the last pool's.
GPUMEM_API void gpumem_torch_record_stream(void* ptr, void* stream) {
  bool tried = false;
  for (auto& slot : pools_)
    if (gpumem_pool* pool = slot.load(std::memory_order_acquire)) {
      tried = true;
      if (gpumem_record_stream(pool, ptr, stream) == GPUMEM_SUCCESS) return;
      // A refusal other than "not ours" is the owner's: say it.
      if (std::string_view(gpumem_last_error()).find("not a live allocation") ==
          std::string_view::npos) {
        report(gpumem_last_error());
        return;
      }
    }
  if (tried) report(gpumem_last_error());
}

// As above, for a caller that knows the device (python/gpumem's Tensor.record_stream).
GPUMEM_API int gpumem_torch_record_stream_on(int device, void* ptr, void* stream) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  return gpumem_record_stream(pool, ptr, stream);
}

// The device's pool (created now if needed), for the C API and ctypes; NULL on failure.
GPUMEM_API gpumem_pool* gpumem_torch_pool(int device) { return pool_for(device); }

// Has the device's pool been created (by an allocation or gpumem_torch_pool)?
GPUMEM_API int gpumem_torch_pool_exists(int device) {
  return device >= 0 && device < max_devices &&
         pools_[device].load(std::memory_order_acquire) != nullptr;
}

GPUMEM_API int gpumem_torch_stats(int device, gpumem_stats* out) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  return gpumem_pool_stats(pool, out);
}

GPUMEM_API int gpumem_torch_snapshot(int device, const char* path) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  return gpumem_snapshot(pool, path);
}

// Gives cached memory of every pool back (torch.cuda.empty_cache's counterpart).
GPUMEM_API unsigned long long gpumem_torch_empty_cache(void) {
  unsigned long long total = 0;
  for (auto& slot : pools_)
    if (gpumem_pool* pool = slot.load(std::memory_order_acquire)) {
      uint64_t released = 0;
      if (gpumem_pool_trim(pool, &released) == GPUMEM_SUCCESS) total += released;
    }
  return total;
}

// The signature of CUDAPluggableAllocator::set_reset_fn, which torch.cuda.empty_cache()
// calls: gives every pool's cached memory back.
GPUMEM_API void gpumem_torch_reset(void) { (void)gpumem_torch_empty_cache(); }

// A step boundary of the training or serving loop, for every pool created so far (see
// gpumem_pool_mark_step). Returns the first failure's status, 0 when all succeeded.
GPUMEM_API int gpumem_torch_mark_step(void) {
  int first_failure = GPUMEM_SUCCESS;
  for (auto& slot : pools_)
    if (gpumem_pool* pool = slot.load(std::memory_order_acquire))
      if (const gpumem_status st = gpumem_pool_mark_step(pool); st != GPUMEM_SUCCESS) {
        report(gpumem_last_error());
        if (first_failure == GPUMEM_SUCCESS) first_failure = st;
      }
  return first_failure;
}

// CUDA graph pools (torch_graph_pools.hpp): the signatures of
// CUDAPluggableAllocator::set_begin_allocate_to_pool, set_end_allocate_to_pool_fn and
// set_release_pool. A private pool that cannot be created throws: PyTorch raises it in
// Python before the capture begins.
GPUMEM_API void gpumem_torch_begin_allocate_to_pool(int device, gpumem_torch::mempool_id id,
                                                    gpumem_torch::capture_filter filter) {
  gpumem_torch::begin_allocate_to_pool(device, id, std::move(filter), pool_config(device).c_str());
}

GPUMEM_API void gpumem_torch_end_allocate_to_pool(int device, gpumem_torch::mempool_id id) {
  // PyTorch ends the stream capture before it calls this: the deferred frees are made on
  // streams no longer capturing.
  for (const gpumem_torch::deferred_free& f : gpumem_torch::end_allocate_to_pool(device, id))
    free_to_shared_pool(f.ptr, f.size, f.device, f.stream);
}

GPUMEM_API void gpumem_torch_release_pool(int device, gpumem_torch::mempool_id id) {
  gpumem_torch::release_pool(device, id);
}

// Private graph pools alive now and the bytes they hold from the driver (for tests).
GPUMEM_API void gpumem_torch_graph_pools(unsigned long long* pools,
                                         unsigned long long* reserved_bytes,
                                         unsigned long long* live_allocations) {
  const gpumem_torch::graph_pool_totals t = gpumem_torch::graph_pools_totals();
  if (pools != nullptr) *pools = t.pools;
  if (reserved_bytes != nullptr) *reserved_bytes = t.reserved_bytes;
  if (live_allocations != nullptr) *live_allocations = t.live_allocations;
}

// Failures reported on stderr so far (allocation, free, record, pool creation).
GPUMEM_API unsigned long long gpumem_torch_failures(void) {
  return failures_.load(std::memory_order_relaxed);
}

}  // extern "C"
