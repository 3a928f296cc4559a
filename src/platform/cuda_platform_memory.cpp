// cuda platform: classic allocations (cudaMalloc, cuMemAlloc in the primary context, pinned host memory).
#include "platform/cuda_internal.hpp"

namespace gpumem::cuda_detail {

result<void*> cuda_platform::runtime_malloc(int device, std::size_t size) {
  constexpr platform_op op = platform_op::runtime_malloc;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  void* ptr = nullptr;
  e = cudaMalloc(&ptr, size);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return ptr;
}

status cuda_platform::runtime_free(int device, void* ptr) {
  constexpr platform_op op = platform_op::runtime_free;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaFree(ptr);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

result<void*> cuda_platform::driver_alloc(int device, std::size_t size) {
  constexpr platform_op op = platform_op::driver_alloc;
  calls_.add(op);
  relaxed_capture relaxed;
  CUcontext ctx = nullptr;
  if (status s = primary_context(op, device, &ctx); !s) return s;
  CUresult r = api_.ctx_push_current(ctx);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  CUdeviceptr ptr = 0;
  const CUresult alloc = api_.mem_alloc(&ptr, size);
  CUcontext popped = nullptr;
  r = api_.ctx_pop_current(&popped);
  if (alloc != CUDA_SUCCESS) return driver_failure(op, alloc);
  if (r != CUDA_SUCCESS) {
    // The caller's context could not be restored: report it, and leave nothing behind.
    (void)api_.mem_free(ptr);
    return driver_failure(op, r);
  }
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
}

status cuda_platform::driver_free(int device, void* ptr) {
  constexpr platform_op op = platform_op::driver_free;
  calls_.add(op);
  relaxed_capture relaxed;
  CUcontext ctx = nullptr;
  if (status s = primary_context(op, device, &ctx); !s) return s;
  CUresult r = api_.ctx_push_current(ctx);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  const CUresult freed =
      api_.mem_free(static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr)));
  CUcontext popped = nullptr;
  r = api_.ctx_pop_current(&popped);
  if (freed != CUDA_SUCCESS) return driver_failure(op, freed);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

result<void*> cuda_platform::host_alloc_pinned(std::size_t size) {
  constexpr platform_op op = platform_op::host_alloc;
  calls_.add(op);
  relaxed_capture relaxed;
  void* ptr = nullptr;
  const cudaError_t e = cudaMallocHost(&ptr, size);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return ptr;
}

status cuda_platform::host_free_pinned(void* ptr) {
  constexpr platform_op op = platform_op::host_free;
  calls_.add(op);
  relaxed_capture relaxed;
  const cudaError_t e = cudaFreeHost(ptr);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

}  // namespace gpumem::cuda_detail
