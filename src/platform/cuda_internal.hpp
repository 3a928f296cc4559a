// The cuda platform's parts shared by its files (cuda_platform*.cpp): the driver entry
// points, the mapping of CUDA results to failures, the device and capture-mode guards and
// the class itself. Not part of the public API; cuda_platform.cpp says why it is shaped so.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "gpumem/platform/cuda_platform.hpp"
#include "gpumem/platform/platform.hpp"

namespace gpumem::cuda_detail {


static_assert(sizeof(CUdeviceptr) == sizeof(std::uintptr_t), "gpumem needs a 64-bit host");
static_assert(sizeof(CUmemGenericAllocationHandle) <= sizeof(std::uint64_t));

// The entry points are requested as of CUDA 12.0, so each name resolves to the ABI of
// that version (cuMemAlloc -> cuMemAlloc_v2, ...), whatever newer driver is installed.
inline constexpr unsigned int driver_abi_version = 12000;

// Own pointer types (libcuda is not linked); the static_asserts tie each to <cuda.h>'s
// declaration, whose macros already name the versioned symbols (cuMemAlloc_v2, ...).
using pfn_get_error_name = CUresult(CUDAAPI*)(CUresult, const char**);
using pfn_get_error_string = CUresult(CUDAAPI*)(CUresult, const char**);
using pfn_device_get = CUresult(CUDAAPI*)(CUdevice*, int);
using pfn_device_get_attribute = CUresult(CUDAAPI*)(int*, CUdevice_attribute, CUdevice);
using pfn_primary_ctx_retain = CUresult(CUDAAPI*)(CUcontext*, CUdevice);
using pfn_primary_ctx_release = CUresult(CUDAAPI*)(CUdevice);
using pfn_ctx_push_current = CUresult(CUDAAPI*)(CUcontext);
using pfn_ctx_pop_current = CUresult(CUDAAPI*)(CUcontext*);
using pfn_ctx_get_current = CUresult(CUDAAPI*)(CUcontext*);
using pfn_ctx_set_current = CUresult(CUDAAPI*)(CUcontext);
using pfn_mem_alloc = CUresult(CUDAAPI*)(CUdeviceptr*, std::size_t);
using pfn_mem_free = CUresult(CUDAAPI*)(CUdeviceptr);
using pfn_mem_get_allocation_granularity = CUresult(CUDAAPI*)(
    std::size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
using pfn_mem_create = CUresult(CUDAAPI*)(CUmemGenericAllocationHandle*, std::size_t,
                                          const CUmemAllocationProp*, unsigned long long);
using pfn_mem_release = CUresult(CUDAAPI*)(CUmemGenericAllocationHandle);
using pfn_mem_address_reserve = CUresult(CUDAAPI*)(CUdeviceptr*, std::size_t, std::size_t,
                                                   CUdeviceptr, unsigned long long);
using pfn_mem_address_free = CUresult(CUDAAPI*)(CUdeviceptr, std::size_t);
using pfn_mem_map = CUresult(CUDAAPI*)(CUdeviceptr, std::size_t, std::size_t,
                                       CUmemGenericAllocationHandle, unsigned long long);
using pfn_mem_unmap = CUresult(CUDAAPI*)(CUdeviceptr, std::size_t);
using pfn_mem_set_access = CUresult(CUDAAPI*)(CUdeviceptr, std::size_t, const CUmemAccessDesc*,
                                              std::size_t);

static_assert(std::is_same_v<pfn_get_error_name, decltype(&::cuGetErrorName)>);
static_assert(std::is_same_v<pfn_get_error_string, decltype(&::cuGetErrorString)>);
static_assert(std::is_same_v<pfn_device_get, decltype(&::cuDeviceGet)>);
static_assert(std::is_same_v<pfn_device_get_attribute, decltype(&::cuDeviceGetAttribute)>);
static_assert(std::is_same_v<pfn_primary_ctx_retain, decltype(&::cuDevicePrimaryCtxRetain)>);
static_assert(std::is_same_v<pfn_primary_ctx_release, decltype(&::cuDevicePrimaryCtxRelease)>);
static_assert(std::is_same_v<pfn_ctx_push_current, decltype(&::cuCtxPushCurrent)>);
static_assert(std::is_same_v<pfn_ctx_pop_current, decltype(&::cuCtxPopCurrent)>);
static_assert(std::is_same_v<pfn_ctx_get_current, decltype(&::cuCtxGetCurrent)>);
static_assert(std::is_same_v<pfn_ctx_set_current, decltype(&::cuCtxSetCurrent)>);
static_assert(std::is_same_v<pfn_mem_alloc, decltype(&::cuMemAlloc)>);
static_assert(std::is_same_v<pfn_mem_free, decltype(&::cuMemFree)>);
static_assert(std::is_same_v<pfn_mem_get_allocation_granularity,
                             decltype(&::cuMemGetAllocationGranularity)>);
static_assert(std::is_same_v<pfn_mem_create, decltype(&::cuMemCreate)>);
static_assert(std::is_same_v<pfn_mem_release, decltype(&::cuMemRelease)>);
static_assert(std::is_same_v<pfn_mem_address_reserve, decltype(&::cuMemAddressReserve)>);
static_assert(std::is_same_v<pfn_mem_address_free, decltype(&::cuMemAddressFree)>);
static_assert(std::is_same_v<pfn_mem_map, decltype(&::cuMemMap)>);
static_assert(std::is_same_v<pfn_mem_unmap, decltype(&::cuMemUnmap)>);
static_assert(std::is_same_v<pfn_mem_set_access, decltype(&::cuMemSetAccess)>);

// The driver functions gpumem uses, all present or the platform is not made.
struct driver_api {
  pfn_get_error_name get_error_name = nullptr;
  pfn_get_error_string get_error_string = nullptr;
  pfn_device_get device_get = nullptr;
  pfn_device_get_attribute device_get_attribute = nullptr;
  pfn_primary_ctx_retain primary_ctx_retain = nullptr;
  pfn_primary_ctx_release primary_ctx_release = nullptr;
  pfn_ctx_push_current ctx_push_current = nullptr;
  pfn_ctx_pop_current ctx_pop_current = nullptr;
  pfn_ctx_get_current ctx_get_current = nullptr;
  pfn_ctx_set_current ctx_set_current = nullptr;
  pfn_mem_alloc mem_alloc = nullptr;
  pfn_mem_free mem_free = nullptr;
  pfn_mem_get_allocation_granularity mem_get_allocation_granularity = nullptr;
  pfn_mem_create mem_create = nullptr;
  pfn_mem_release mem_release = nullptr;
  pfn_mem_address_reserve mem_address_reserve = nullptr;
  pfn_mem_address_free mem_address_free = nullptr;
  pfn_mem_map mem_map = nullptr;
  pfn_mem_unmap mem_unmap = nullptr;
  pfn_mem_set_access mem_set_access = nullptr;

  // REQUIRES: the runtime has loaded and initialised the driver (a successful
  // cudaGetDeviceCount). On failure `why` names the first missing function.
  bool load(std::string* why) {
    return load_one("cuGetErrorName", get_error_name, why) &&
           load_one("cuGetErrorString", get_error_string, why) &&
           load_one("cuDeviceGet", device_get, why) &&
           load_one("cuDeviceGetAttribute", device_get_attribute, why) &&
           load_one("cuDevicePrimaryCtxRetain", primary_ctx_retain, why) &&
           load_one("cuDevicePrimaryCtxRelease", primary_ctx_release, why) &&
           load_one("cuCtxPushCurrent", ctx_push_current, why) &&
           load_one("cuCtxPopCurrent", ctx_pop_current, why) &&
           load_one("cuCtxGetCurrent", ctx_get_current, why) &&
           load_one("cuCtxSetCurrent", ctx_set_current, why) &&
           load_one("cuMemAlloc", mem_alloc, why) &&
           load_one("cuMemFree", mem_free, why) &&
           load_one("cuMemGetAllocationGranularity", mem_get_allocation_granularity, why) &&
           load_one("cuMemCreate", mem_create, why) &&
           load_one("cuMemRelease", mem_release, why) &&
           load_one("cuMemAddressReserve", mem_address_reserve, why) &&
           load_one("cuMemAddressFree", mem_address_free, why) &&
           load_one("cuMemMap", mem_map, why) &&
           load_one("cuMemUnmap", mem_unmap, why) &&
           load_one("cuMemSetAccess", mem_set_access, why);
  }

 private:
  template <class Fn>
  static bool load_one(const char* symbol, Fn& fn, std::string* why) {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &address, driver_abi_version,
                                                           cudaEnableDefault, &found);
    if (e == cudaSuccess && found == cudaDriverEntryPointSuccess && address != nullptr) {
      fn = reinterpret_cast<Fn>(address);
      return true;
    }
    (void)cudaGetLastError();
    std::string reason = std::string("CUDA driver lacks ") + symbol + " (";
    if (e != cudaSuccess) {
      reason += std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
    } else if (found == cudaDriverEntryPointVersionNotSufficent) {
      reason += "driver older than CUDA 12.0";
    } else {
      reason += "symbol not found";
    }
    reason += ")";
    if (why != nullptr) *why = std::move(reason);
    return false;
  }
};

// Entry points for sharing memory between processes: optional (a driver without them
// still serves everything else; sharing then answers not_supported), loaded on first use.
using pfn_mem_export = CUresult(CUDAAPI*)(void*, CUmemGenericAllocationHandle,
                                          CUmemAllocationHandleType, unsigned long long);
using pfn_mem_import = CUresult(CUDAAPI*)(CUmemGenericAllocationHandle*, void*,
                                          CUmemAllocationHandleType);
using pfn_mem_get_properties = CUresult(CUDAAPI*)(CUmemAllocationProp*,
                                                  CUmemGenericAllocationHandle);
static_assert(std::is_same_v<pfn_mem_export, decltype(&::cuMemExportToShareableHandle)>);
static_assert(std::is_same_v<pfn_mem_import, decltype(&::cuMemImportFromShareableHandle)>);
static_assert(std::is_same_v<pfn_mem_get_properties,
                             decltype(&::cuMemGetAllocationPropertiesFromHandle)>);

struct sharing_api {
  pfn_mem_export mem_export = nullptr;
  pfn_mem_import mem_import = nullptr;
  pfn_mem_get_properties mem_get_properties = nullptr;
  bool loaded = false;

  template <class Fn>
  static bool load_one(const char* symbol, Fn& fn) {
    void* address = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t e = cudaGetDriverEntryPointByVersion(symbol, &address, driver_abi_version,
                                                           cudaEnableDefault, &found);
    if (e == cudaSuccess && found == cudaDriverEntryPointSuccess && address != nullptr) {
      fn = reinterpret_cast<Fn>(address);
      return true;
    }
    (void)cudaGetLastError();
    return false;
  }
  void load() {
    loaded = load_one("cuMemExportToShareableHandle", mem_export) &&
             load_one("cuMemImportFromShareableHandle", mem_import) &&
             load_one("cuMemGetAllocationPropertiesFromHandle", mem_get_properties);
  }
};

// Two helpers: what kind of failure a CUDA error code is, for layers above that know no
// CUDA codes. An invalid device ordinal is "no such device", hence no_device.
inline failure_kind runtime_failure_kind(cudaError_t e) noexcept {
  switch (e) {
    case cudaSuccess:
      return failure_kind::none;
    case cudaErrorMemoryAllocation:
      return failure_kind::out_of_memory;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidPitchValue:
      return failure_kind::invalid_value;
    case cudaErrorNotReady:
      return failure_kind::not_ready;
    case cudaErrorNotSupported:
    case cudaErrorCallRequiresNewerDriver:
      return failure_kind::not_supported;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorInitializationError:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCudartUnloading:
      return failure_kind::no_device;
    default:
      return failure_kind::driver_error;
  }
}

inline failure_kind driver_failure_kind(CUresult r) noexcept {
  switch (r) {
    case CUDA_SUCCESS:
      return failure_kind::none;
    case CUDA_ERROR_OUT_OF_MEMORY:
      return failure_kind::out_of_memory;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_HANDLE:
    case CUDA_ERROR_NOT_MAPPED:
    case CUDA_ERROR_ALREADY_MAPPED:
      return failure_kind::invalid_value;
    case CUDA_ERROR_NOT_READY:
      return failure_kind::not_ready;
    case CUDA_ERROR_NOT_SUPPORTED:
      return failure_kind::not_supported;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
      return failure_kind::no_device;
    default:
      return failure_kind::driver_error;
  }
}

inline status runtime_failure(platform_op op, cudaError_t e) {
  // The failure is handed back as a value: clear it from the runtime's last-error slot so
  // user code checking cudaGetLastError() later does not see it (sticky errors stay).
  (void)cudaGetLastError();
  return status::failure(op, runtime_failure_kind(e), static_cast<int>(e), cudaGetErrorName(e),
                         cudaGetErrorString(e));
}

// Pinned device memory on `device`: the only kind gpumem creates and maps.
inline CUmemAllocationProp pinned_device_prop(int device) noexcept {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

// cudaStreamLegacy (1) and cudaStreamPerThread (2) are, like 0, the default stream of the
// calling thread's current device rather than objects with a device of their own.
inline bool is_default_stream(stream_handle s) noexcept { return s.value <= 2; }

inline cudaStream_t to_cuda(stream_handle s) noexcept { return reinterpret_cast<cudaStream_t>(s.value); }
inline cudaEvent_t to_cuda(event_handle e) noexcept { return reinterpret_cast<cudaEvent_t>(e.value); }

// Makes `device` current for one scope and then restores the caller's exact context (with
// cuCtxSetCurrent, so a caller's non-primary context survives too). A thread that had no
// context at all keeps `device`: restoring "none" through the runtime would mean
// cudaSetDevice(0), which creates a context on device 0 the process may never use.
// In the common case (device already current) this costs one cudaGetDevice.
// The device of `stream`. cudaStreamGetDevice refuses a stream being captured into a CUDA
// graph (cudaErrorStreamCaptureUnsupported, in every capture mode, and the refusal
// invalidates the capture; CUDA 13 on the H200), so the capture status is asked first (legal
// at any time): a capturing stream is known valid and is taken to be on the calling thread's
// current device, where PyTorch captures.
inline cudaError_t stream_device_of(stream_handle stream, int* device) noexcept {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(to_cuda(stream), &capturing);
  if (e != cudaSuccess) return e;
  if (capturing != cudaStreamCaptureStatusNone) return cudaGetDevice(device);
  return cudaStreamGetDevice(to_cuda(stream), device);
}

class device_guard {
 public:
  explicit device_guard(const driver_api& api) noexcept : api_(api) {}
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  ~device_guard() {
    if (restore_) (void)api_.ctx_set_current(saved_);
  }

  cudaError_t enter(int device) noexcept {
    int current = -1;
    const cudaError_t e = cudaGetDevice(&current);
    if (e != cudaSuccess) return e;
    if (current == device) return cudaSuccess;
    CUcontext saved = nullptr;
    if (api_.ctx_get_current(&saved) != CUDA_SUCCESS) saved = nullptr;
    const cudaError_t set = cudaSetDevice(device);
    if (set != cudaSuccess) return set;
    saved_ = saved;
    restore_ = saved != nullptr;
    return cudaSuccess;
  }

  // The device a stream was created on; default streams, and streams being captured into a
  // CUDA graph, stay on the current device (stream_device_of).
  cudaError_t enter_stream_device(stream_handle stream) noexcept {
    if (is_default_stream(stream)) return cudaSuccess;
    int device = -1;
    const cudaError_t e = stream_device_of(stream, &device);
    if (e != cudaSuccess) return e;
    return enter(device);
  }

 private:
  const driver_api& api_;
  CUcontext saved_ = nullptr;
  bool restore_ = false;
};

// The calls gpumem makes on its own behalf (growth, unmaps, queries, synchronization, the
// events of stream-ordered reuse) run with the calling thread's stream-capture mode relaxed,
// as PyTorch's allocator does around cudaMalloc: in the default (global) mode, such a call on
// any thread while a CUDA graph is being captured is refused (cudaStreamGetDevice and
// cudaEventRecord included, seen with CUDA 13 on the H200) and invalidates that capture. An
// event recorded or waited on in a capturing stream is still captured. Copies and memsets
// keep the caller's mode: they are the caller's work.
class relaxed_capture {
 public:
  relaxed_capture() noexcept { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~relaxed_capture() { (void)cudaThreadExchangeStreamCaptureMode(&mode_); }
  relaxed_capture(const relaxed_capture&) = delete;
  relaxed_capture& operator=(const relaxed_capture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

class cuda_platform final : public platform {
 public:
  cuda_platform(const driver_api& api, int device_count)
      : api_(api),
        device_count_(device_count),
        primary_contexts_(std::make_unique<std::atomic<CUcontext>[]>(
            static_cast<std::size_t>(device_count))),
        primary_devices_(std::make_unique<CUdevice[]>(static_cast<std::size_t>(device_count))) {}

  // Releases what driver_alloc retained. Never throws; at process exit the driver may
  // already be shut down (CUDA_ERROR_DEINITIALIZED), which is ignored like every result here.
  ~cuda_platform() override {
    for (int d = 0; d < device_count_; ++d) {
      if (primary_contexts_[static_cast<std::size_t>(d)].load(std::memory_order_acquire)) {
        (void)api_.primary_ctx_release(primary_devices_[static_cast<std::size_t>(d)]);
      }
    }
  }

  std::string_view kind() const noexcept override { return "cuda"; }

  // --- devices -------------------------------------------------------------------------
  result<int> device_count() override;

  result<device_properties> properties(int device) override;

  result<allocation_granularity> granularity(int device) override;

  result<memory_info> mem_info(int device) override;

  // --- virtual memory management ---------------------------------------------------------
  // The VMM calls take devices and addresses explicitly and need no current context, only
  // an initialised driver (done by cudaGetDeviceCount in make_cuda_platform).
  result<std::uintptr_t> reserve_range(std::size_t size, std::size_t alignment) override;

  status free_range(std::uintptr_t base, std::size_t size) override;

  result<physical_handle> create_physical(int device, std::size_t size) override;

  status release_physical(physical_handle handle) override;

  status map(std::uintptr_t va, std::size_t size, physical_handle handle,
             std::size_t offset) override;

  status unmap(std::uintptr_t va, std::size_t size) override;

  status set_access(int device, std::uintptr_t va, std::size_t size) override;

  status set_access_for(std::span<const int> devices, std::uintptr_t va,
                        std::size_t size) override;

  // --- sharing between processes ---------------------------------------------------------
  result<physical_handle> create_shareable_physical(int device, std::size_t size) override;

  result<int> export_handle(physical_handle handle) override;

  result<physical_handle> import_handle(int device, int fd, std::size_t size) override;

  // --- several devices -------------------------------------------------------------------
  result<bool> can_access_peer(int device, int peer) override;

  status enable_peer_access(int device, int peer) override;

  // --- classic allocation --------------------------------------------------------------
  result<void*> runtime_malloc(int device, std::size_t size) override;

  status runtime_free(int device, void* ptr) override;

  // cuMemAlloc / cuMemFree act on the current context, which on a runtime-only thread may
  // be none (CUDA_ERROR_INVALID_CONTEXT) or another device's. Pushing the device's primary
  // context (the one the runtime uses too) and popping it afterwards makes the call work on
  // any thread and leaves the caller's context as it was, on failure too.
  result<void*> driver_alloc(int device, std::size_t size) override;

  status driver_free(int device, void* ptr) override;

  result<void*> host_alloc_pinned(std::size_t size) override;

  status host_free_pinned(void* ptr) override;

  // --- streams and events --------------------------------------------------------------
  // Stream calls run with the stream's device current (cudaStreamGetDevice, so streams
  // made outside gpumem, e.g. PyTorch's, work as well). Handles 0, 1 and 2 are the
  // default streams of the caller's current device.
  result<stream_handle> stream_create(int device) override;

  status stream_destroy(stream_handle stream) override;

  status stream_synchronize(stream_handle stream) override;

  result<int> stream_device(stream_handle stream) override;

  result<event_handle> event_create(int device) override;

  // Destroy, query and synchronize act on the event's own context whatever device is
  // current (CUDA programming guide, "Stream and Event Behavior"), so no device switch.
  status event_destroy(event_handle event) override;

  // REQUIRES: a default stream (0) is on the device the event was created for.
  status event_record(event_handle event, stream_handle stream) override;

  result<bool> event_query(event_handle event) override;

  status event_synchronize(event_handle event) override;

  status stream_wait_event(stream_handle stream, event_handle event) override;

  status memcpy_async(void* dst, const void* src, std::size_t bytes,
                      stream_handle stream) override;

  status memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) override;

  result<void*> async_malloc(int device, std::size_t size, stream_handle stream) override;

  status async_free(void* ptr, stream_handle stream) override;

 private:
  // Events whose last record was into a stream being captured into a CUDA graph: querying
  // or synchronizing one is refused by the driver (cudaErrorCapturedEvent) and ends the
  // capture, so it is answered here (not complete) instead. Few at a time: a set under a lock.
  void note_captured(event_handle event, bool captured);
  bool was_captured(event_handle event) {
    std::lock_guard lock(captured_mutex_);
    return !captured_events_.empty() && captured_events_.count(event.value) != 0;
  }
  std::mutex captured_mutex_;
  std::unordered_set<std::uintptr_t> captured_events_;

  status driver_failure(platform_op op, CUresult r) const;

  // The device's primary context, retained on first use. Lock-free once retained; the
  // mutex only orders the one-time retain so it happens once per device.
  status primary_context(platform_op op, int device, CUcontext* ctx);

  const sharing_api& sharing() {
    std::call_once(sharing_once_, [this] { sharing_.load(); });
    return sharing_;
  }

  const driver_api api_;
  std::once_flag sharing_once_;
  sharing_api sharing_;
  const int device_count_;
  std::unique_ptr<std::atomic<CUcontext>[]> primary_contexts_;  // nullptr: not retained
  std::unique_ptr<CUdevice[]> primary_devices_;  // written before its context is published
  std::mutex primary_mutex_;
};

}  // namespace gpumem::cuda_detail
