// cuda platform: physical memory shared between processes (POSIX file descriptors).
#include "platform/cuda_internal.hpp"

namespace gpumem::cuda_detail {

result<physical_handle> cuda_platform::create_shareable_physical(int device, std::size_t size) {
  constexpr platform_op op = platform_op::create_physical;
  calls_.add(op);
  relaxed_capture relaxed;
  CUmemAllocationProp prop = pinned_device_prop(device);
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle handle = 0;
  const CUresult r = api_.mem_create(&handle, size, &prop, 0);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return physical_handle{static_cast<std::uint64_t>(handle)};
}

result<int> cuda_platform::export_handle(physical_handle handle) {
  constexpr platform_op op = platform_op::export_handle;
  calls_.add(op);
  const sharing_api& api = sharing();
  if (!api.loaded)
    return status::failure(op, failure_kind::not_supported, CUDA_ERROR_NOT_SUPPORTED,
                           "CUDA_ERROR_NOT_SUPPORTED",
                           "the driver lacks cuMemExportToShareableHandle");
  int fd = -1;
  const CUresult r =
      api.mem_export(&fd, static_cast<CUmemGenericAllocationHandle>(handle.value),
                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  return fd;
}

result<physical_handle> cuda_platform::import_handle(int device, int fd, std::size_t size) {
  constexpr platform_op op = platform_op::import_handle;
  calls_.add(op);
  (void)size;  // the driver reports no size for an imported handle: cuMemMap checks it
  const sharing_api& api = sharing();
  if (!api.loaded)
    return status::failure(op, failure_kind::not_supported, CUDA_ERROR_NOT_SUPPORTED,
                           "CUDA_ERROR_NOT_SUPPORTED",
                           "the driver lacks cuMemImportFromShareableHandle");
  CUmemGenericAllocationHandle handle = 0;
  const CUresult r = api.mem_import(
      &handle, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (r != CUDA_SUCCESS) return driver_failure(op, r);
  CUmemAllocationProp prop{};
  const CUresult q = api.mem_get_properties(&prop, handle);
  // Memory of another device serves `device` when `device` can reach it (the caller
  // grants `device` access after mapping it, as for any peer's memory).
  int reachable = 0;
  if (q == CUDA_SUCCESS && prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE) {
    if (prop.location.id == device) {
      reachable = 1;
    } else if (cudaDeviceCanAccessPeer(&reachable, device, prop.location.id) != cudaSuccess) {
      (void)cudaGetLastError();
      reachable = 0;
    }
  }
  if (q != CUDA_SUCCESS || reachable == 0) {
    (void)api_.mem_release(handle);
    if (q != CUDA_SUCCESS) return driver_failure(op, q);
    return status::failure(op, failure_kind::invalid_value, CUDA_ERROR_INVALID_VALUE,
                           "CUDA_ERROR_INVALID_VALUE",
                           "the exported memory is on device " +
                               std::to_string(prop.location.id) + ", which device " +
                               std::to_string(device) +
                               " cannot reach (cuDeviceCanAccessPeer is 0)");
  }
  return physical_handle{static_cast<std::uint64_t>(handle)};
}

}  // namespace gpumem::cuda_detail
