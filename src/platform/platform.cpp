// The seam's shared pieces: operation names, status text, and the default platform.
#include "gpumem/platform/platform.hpp"

#include <cstdlib>
#include <mutex>

#include "gpumem/errors.hpp"
#include "gpumem/platform/cuda_platform.hpp"
#include "gpumem/platform/sim_platform.hpp"

namespace gpumem {

std::string_view platform_op_name(platform_op op) noexcept {
  switch (op) {
    case platform_op::device_count: return "cudaGetDeviceCount";
    case platform_op::device_properties: return "cudaGetDeviceProperties";
    case platform_op::granularity: return "cuMemGetAllocationGranularity";
    case platform_op::mem_info: return "cudaMemGetInfo";
    case platform_op::reserve_range: return "cuMemAddressReserve";
    case platform_op::free_range: return "cuMemAddressFree";
    case platform_op::create_physical: return "cuMemCreate";
    case platform_op::release_physical: return "cuMemRelease";
    case platform_op::map: return "cuMemMap";
    case platform_op::unmap: return "cuMemUnmap";
    case platform_op::set_access: return "cuMemSetAccess";
    case platform_op::runtime_malloc: return "cudaMalloc";
    case platform_op::runtime_free: return "cudaFree";
    case platform_op::driver_alloc: return "cuMemAlloc";
    case platform_op::driver_free: return "cuMemFree";
    case platform_op::host_alloc: return "cudaMallocHost";
    case platform_op::host_free: return "cudaFreeHost";
    case platform_op::stream_create: return "cudaStreamCreate";
    case platform_op::stream_destroy: return "cudaStreamDestroy";
    case platform_op::stream_synchronize: return "cudaStreamSynchronize";
    case platform_op::stream_device: return "cudaStreamGetDevice";
    case platform_op::event_create: return "cudaEventCreate";
    case platform_op::event_destroy: return "cudaEventDestroy";
    case platform_op::event_record: return "cudaEventRecord";
    case platform_op::event_query: return "cudaEventQuery";
    case platform_op::event_synchronize: return "cudaEventSynchronize";
    case platform_op::stream_wait_event: return "cudaStreamWaitEvent";
    case platform_op::memcpy_async: return "cudaMemcpyAsync";
    case platform_op::memset_async: return "cudaMemsetAsync";
    case platform_op::async_malloc: return "cudaMallocAsync";
    case platform_op::async_free: return "cudaFreeAsync";
    case platform_op::export_handle: return "cuMemExportToShareableHandle";
    case platform_op::import_handle: return "cuMemImportFromShareableHandle";
    case platform_op::can_access_peer: return "cuDeviceCanAccessPeer";
    case platform_op::enable_peer_access: return "cudaDeviceEnablePeerAccess";
    case platform_op::count_: break;
  }
  return "unknown";
}

// One set_access per device, for platforms without a call that takes several.
status platform::set_access_for(std::span<const int> devices, std::uintptr_t va,
                                std::size_t size) {
  for (int device : devices)
    if (auto s = set_access(device, va, size); !s) return s;
  return status::success();
}

// Platforms that know no peers: a device reaches its own memory only.
result<bool> platform::can_access_peer(int device, int peer) {
  calls_.add(platform_op::can_access_peer);
  return device == peer;
}

status platform::enable_peer_access(int device, int peer) {
  calls_.add(platform_op::enable_peer_access);
  return status::failure(platform_op::enable_peer_access, failure_kind::not_supported, 801,
                         "CUDA_ERROR_NOT_SUPPORTED",
                         "this platform has no peer access (device " + std::to_string(device) +
                             " to device " + std::to_string(peer) + ")");
}

// Platforms without sharing between processes.
result<physical_handle> platform::create_shareable_physical(int device, std::size_t size) {
  (void)device, (void)size;
  calls_.add(platform_op::create_physical);
  return status::failure(platform_op::create_physical, failure_kind::not_supported, 801,
                         "CUDA_ERROR_NOT_SUPPORTED",
                         "this platform has no shareable physical memory");
}

result<int> platform::export_handle(physical_handle handle) {
  (void)handle;
  calls_.add(platform_op::export_handle);
  return status::failure(platform_op::export_handle, failure_kind::not_supported, 801,
                         "CUDA_ERROR_NOT_SUPPORTED", "this platform cannot export memory");
}

result<physical_handle> platform::import_handle(int device, int fd, std::size_t size) {
  (void)device, (void)fd, (void)size;
  calls_.add(platform_op::import_handle);
  return status::failure(platform_op::import_handle, failure_kind::not_supported, 801,
                         "CUDA_ERROR_NOT_SUPPORTED", "this platform cannot import memory");
}

std::string status::describe() const {
  if (ok()) return "success";
  std::string text{platform_op_name(call)};
  text += ": ";
  text += name.empty() ? "error " + std::to_string(code) : name;
  if (!message.empty()) text += " (" + message + ")";
  return text;
}

namespace {

struct default_platforms {
  std::mutex mutex;
  platform* cuda = nullptr;   // leaked on purpose: resources may outlive main()
  platform* sim = nullptr;
  std::string cuda_reason;
  bool cuda_probed = false;

  platform* probe_cuda() {
    if (!cuda_probed) {
      cuda_probed = true;
      cuda = make_cuda_platform(&cuda_reason).release();
    }
    return cuda;
  }
  platform* get_sim() {
    if (sim == nullptr) sim = new sim_platform(sim_options_from_environment());
    return sim;
  }
};

default_platforms& platforms() {
  static auto* instance = new default_platforms();  // never destroyed
  return *instance;
}

}  // namespace

std::string cuda_unavailable_reason() {
  auto& p = platforms();
  std::lock_guard lock(p.mutex);
  p.probe_cuda();
  return p.cuda_reason;
}

platform& platform_by_name(std::string_view name) {
  auto& p = platforms();
  std::lock_guard lock(p.mutex);
  if (name == "sim") return *p.get_sim();
  if (name == "cuda") {
    if (auto* cuda = p.probe_cuda()) return *cuda;
    throw cuda_error("cuInit", 100, "CUDA_ERROR_NO_DEVICE", p.cuda_reason,
                     "gpumem::platform_by_name(\"cuda\")");
  }
  if (name == "auto" || name.empty()) {
    if (auto* cuda = p.probe_cuda()) return *cuda;
    return *p.get_sim();
  }
  throw invalid_argument("unknown platform '" + std::string(name) +
                         "': expected cuda, sim or auto");
}

platform& default_platform() {
  const char* env = std::getenv("GPUMEM_DEVICE");
  return platform_by_name(env != nullptr ? env : "auto");
}

}  // namespace gpumem
