// cuda platform: the real GPU behind the platform seam.
//
// Why this shape:
//  - The CUDA runtime is linked statically and loads libcuda.so.1 itself on the first call,
//    so a binary built here starts on machines without a driver; make_cuda_platform then
//    returns nullptr with the reason and the sim serves instead.
//  - Driver API functions (VMM, primary contexts, cuMemAlloc) are fetched from the driver the
//    runtime loaded, with cudaGetDriverEntryPointByVersion, never linked: linking libcuda
//    would make the binary fail to start where no driver is installed. <cuda.h> is included
//    for its types only; every pointer type below is checked against its declaration.
//  - Calls that act on a device make that device current for the call and then put back
//    the caller's context (device_guard): a library under PyTorch must not move the
//    caller's current device behind its back.
//  - Runtime failures are returned as values, so the runtime's "last error" is cleared
//    after each one; otherwise a later cudaGetLastError() in user code (e.g. a kernel launch
//    check) would report our already-handled failure as its own.
//
// Invariants:
//  - every call does calls_.add(op) first, and every CUDA result is checked and reported
//    as status::failure(op, kind, code, CUDA error name, CUDA error message);
//  - driver_alloc / driver_free leave the caller's current context as it was, on failure
//    too (push the primary context, call, pop);
//  - each device's primary context is retained at most once and released in the
//    destructor, which ignores a driver already shut down;
//  - set_access and set_access_for are one cuMemSetAccess over the whole range.
#include "platform/cuda_internal.hpp"

namespace gpumem::cuda_detail {

result<int> cuda_platform::device_count() {
  calls_.add(platform_op::device_count);
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return runtime_failure(platform_op::device_count, e);
  return count;
}

result<device_properties> cuda_platform::properties(int device) {
  constexpr platform_op op = platform_op::device_properties;
  calls_.add(op);
  cudaDeviceProp p{};
  const cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e != cudaSuccess) return runtime_failure(op, e);

  device_properties out;
  out.ordinal = device;
  out.name = p.name;
  out.compute_capability_major = p.major;
  out.compute_capability_minor = p.minor;
  out.multiprocessor_count = p.multiProcessorCount;
  out.total_memory = p.totalGlobalMem;
  out.memory_bus_width_bits = p.memoryBusWidth;
  out.l2_cache_bytes = static_cast<std::size_t>(p.l2CacheSize);
  out.shared_memory_per_multiprocessor = p.sharedMemPerMultiprocessor;
  out.shared_memory_per_block = p.sharedMemPerBlockOptin;  // the opt-in maximum
  out.registers_per_multiprocessor = p.regsPerMultiprocessor;
  out.memory_pools_supported = p.memoryPoolsSupported != 0;

  // CUDA 13 dropped memoryClockRate from cudaDeviceProp; the attribute remains but a
  // device may not report it: 0 then, as the field documents.
  int clock_khz = 0;
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, device) != cudaSuccess) {
    (void)cudaGetLastError();
    clock_khz = 0;
  }
  out.memory_clock_khz = clock_khz;

  // The runtime has no VMM attribute; ask the driver. Unknown counts as unsupported.
  CUdevice cu_device = 0;
  int vmm = 0;
  if (api_.device_get(&cu_device, device) != CUDA_SUCCESS ||
      api_.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                cu_device) != CUDA_SUCCESS) {
    vmm = 0;
  }
  out.vmm_supported = vmm != 0;
  out.simulated = false;
  return out;
}

result<allocation_granularity> cuda_platform::granularity(int device) {
  constexpr platform_op op = platform_op::granularity;
  calls_.add(op);
  const CUmemAllocationProp prop = pinned_device_prop(device);
  allocation_granularity g;
  CUresult r = api_.mem_get_allocation_granularity(&g.minimum, &prop,
                                                   CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  r = api_.mem_get_allocation_granularity(&g.recommended, &prop,
                                          CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return g;
}

result<memory_info> cuda_platform::mem_info(int device) {
  constexpr platform_op op = platform_op::mem_info;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  memory_info info;
  e = cudaMemGetInfo(&info.free, &info.total);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return info;
}

result<std::uintptr_t> cuda_platform::reserve_range(std::size_t size, std::size_t alignment) {
  constexpr platform_op op = platform_op::reserve_range;
  calls_.add(op);
  relaxed_capture relaxed;
  CUdeviceptr base = 0;
  const CUresult r = api_.mem_address_reserve(&base, size, alignment, 0, 0);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return static_cast<std::uintptr_t>(base);
}

status cuda_platform::free_range(std::uintptr_t base, std::size_t size) {
  constexpr platform_op op = platform_op::free_range;
  calls_.add(op);
  relaxed_capture relaxed;
  const CUresult r = api_.mem_address_free(static_cast<CUdeviceptr>(base), size);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

result<physical_handle> cuda_platform::create_physical(int device, std::size_t size) {
  constexpr platform_op op = platform_op::create_physical;
  calls_.add(op);
  relaxed_capture relaxed;
  const CUmemAllocationProp prop = pinned_device_prop(device);
  CUmemGenericAllocationHandle handle = 0;
  const CUresult r = api_.mem_create(&handle, size, &prop, 0);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return physical_handle{static_cast<std::uint64_t>(handle)};
}

status cuda_platform::release_physical(physical_handle handle) {
  constexpr platform_op op = platform_op::release_physical;
  calls_.add(op);
  relaxed_capture relaxed;
  const CUresult r = api_.mem_release(static_cast<CUmemGenericAllocationHandle>(handle.value));
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

status cuda_platform::map(std::uintptr_t va, std::size_t size, physical_handle handle,
           std::size_t offset) {
  constexpr platform_op op = platform_op::map;
  calls_.add(op);
  relaxed_capture relaxed;
  const CUresult r = api_.mem_map(static_cast<CUdeviceptr>(va), size, offset,
                                  static_cast<CUmemGenericAllocationHandle>(handle.value), 0);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

status cuda_platform::unmap(std::uintptr_t va, std::size_t size) {
  constexpr platform_op op = platform_op::unmap;
  calls_.add(op);
  relaxed_capture relaxed;
  const CUresult r = api_.mem_unmap(static_cast<CUdeviceptr>(va), size);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

status cuda_platform::set_access(int device, std::uintptr_t va, std::size_t size) {
  constexpr platform_op op = platform_op::set_access;
  calls_.add(op);
  relaxed_capture relaxed;
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  // One call over the whole range: the driver's cost is per call, not per page.
  const CUresult r = api_.mem_set_access(static_cast<CUdeviceptr>(va), size, &access, 1);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

status cuda_platform::set_access_for(std::span<const int> devices, std::uintptr_t va,
                      std::size_t size) {
  constexpr platform_op op = platform_op::set_access;
  calls_.add(op);
  relaxed_capture relaxed;
  constexpr std::size_t max_descriptors = 64;
  if (devices.empty() || devices.size() > max_descriptors)
    return status::failure(op, failure_kind::invalid_value, CUDA_ERROR_INVALID_VALUE,
                           "CUDA_ERROR_INVALID_VALUE",
                           "cuMemSetAccess takes 1 to 64 devices, not " +
                               std::to_string(devices.size()));
  CUmemAccessDesc access[max_descriptors]{};
  for (std::size_t i = 0; i < devices.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = devices[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  const CUresult r =
      api_.mem_set_access(static_cast<CUdeviceptr>(va), size, access, devices.size());
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return status::success();
}

result<bool> cuda_platform::can_access_peer(int device, int peer) {
  constexpr platform_op op = platform_op::can_access_peer;
  calls_.add(op);
  if (device == peer) return true;
  int can = 0;
  const cudaError_t e = cudaDeviceCanAccessPeer(&can, device, peer);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return can != 0;
}

status cuda_platform::enable_peer_access(int device, int peer) {
  constexpr platform_op op = platform_op::enable_peer_access;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
    return status::success();
  }
  if (e == cudaErrorPeerAccessUnsupported) {
    (void)cudaGetLastError();
    return status::failure(op, failure_kind::not_supported, static_cast<int>(e),
                           cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

void cuda_platform::note_captured(event_handle event, bool captured) {
  std::lock_guard lock(captured_mutex_);
  if (captured)
    captured_events_.insert(event.value);
  else if (!captured_events_.empty())
    captured_events_.erase(event.value);
}

status cuda_platform::driver_failure(platform_op op, CUresult r) const {
  const char* name = nullptr;
  const char* message = nullptr;
  if (api_.get_error_name(r, &name) != CUDA_SUCCESS || name == nullptr) {
    name = "CUDA_ERROR_UNRECOGNIZED";
  }
  if (api_.get_error_string(r, &message) != CUDA_SUCCESS || message == nullptr) {
    message = "unrecognized CUresult";
  }
  return status::failure(op, driver_failure_kind(r), static_cast<int>(r), name, message);
}

status cuda_platform::primary_context(platform_op op, int device, CUcontext* ctx) {
  if (device < 0 || device >= device_count_) return driver_failure(op, CUDA_ERROR_INVALID_DEVICE);
  const auto index = static_cast<std::size_t>(device);
  *ctx = primary_contexts_[index].load(std::memory_order_acquire);
  if (*ctx != nullptr) return status::success();

  std::lock_guard<std::mutex> lock(primary_mutex_);
  *ctx = primary_contexts_[index].load(std::memory_order_relaxed);
  if (*ctx != nullptr) return status::success();
  CUdevice cu_device = 0;
  CUresult r = api_.device_get(&cu_device, device);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  CUcontext retained = nullptr;
  r = api_.primary_ctx_retain(&retained, cu_device);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  primary_devices_[index] = cu_device;
  primary_contexts_[index].store(retained, std::memory_order_release);
  *ctx = retained;
  return status::success();
}

}  // namespace gpumem::cuda_detail

namespace gpumem {

namespace {

// Why the runtime could not see a usable GPU, in the user's terms.
std::string unavailable_reason(cudaError_t e) {
  std::string detail = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  switch (e) {
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorInitializationError:
    case cudaErrorSystemDriverMismatch:
      return "no CUDA driver (" + detail + ")";
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
      return "no CUDA device (" + detail + ")";
    default:
      return "CUDA unavailable (" + detail + ")";
  }
}


}  // namespace


bool cuda_platform_compiled() noexcept { return true; }

std::unique_ptr<platform> make_cuda_platform(std::string* why) {
  // cudaGetDeviceCount makes the runtime load and initialise the driver without creating
  // a context (cudaFree(0) would create one on device 0, costing memory and time).
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (why != nullptr) *why = unavailable_reason(e);
    return nullptr;
  }
  if (count < 1) {
    if (why != nullptr) *why = "no CUDA device (cudaGetDeviceCount reported 0)";
    return nullptr;
  }
  cuda_detail::driver_api api;
  std::string missing;
  if (!api.load(&missing)) {
    if (why != nullptr) *why = std::move(missing);
    return nullptr;
  }
  try {
    auto made = std::make_unique<cuda_detail::cuda_platform>(api, count);
    if (why != nullptr) why->clear();
    return made;
  } catch (const std::bad_alloc&) {
    if (why != nullptr) *why = "out of host memory creating the cuda platform";
    return nullptr;
  }
}

}  // namespace gpumem

