// sim device: classic allocation (cudaMalloc, cuMemAlloc, cudaMallocAsync, pinned host
// memory).
#include "platform/sim/sim_state.hpp"

namespace gpumem {

// --- classic allocation ------------------------------------------------------------------

namespace {

result<void*> sim_allocate(sim_platform::state& s, platform_op op, int device, std::size_t size) {
  if (!s.valid_device(device))
    return fail(op, failure_kind::invalid_value, "no sim device " + std::to_string(device));
  if (size == 0) return static_cast<void*>(nullptr);  // as cudaMalloc(0)
  if (s.memfd < 0) return fail(op, failure_kind::driver_error, "sim device has no memfd");
  const std::size_t bytes = round_up(size, host_page);
  std::lock_guard lock(s.mutex);
  // Host pages from wherever they are free, as the GPU backs an allocation with pages.
  auto extents = s.take_frames(device, bytes, host_page);
  if (extents.empty())
    return fail(op, failure_kind::out_of_memory,
                "sim device " + std::to_string(device) + " out of memory");
  void* p = nullptr;
  if (extents.size() == 1) {
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.memfd,
               static_cast<off_t>(extents.front().offset));
    if (p == MAP_FAILED) {
      const int err = errno;
      s.return_frames(device, extents);
      return host_vm_failure(op, "mmap", err);
    }
  } else {
    // Several runs: reserve one contiguous host range, then map each run into it.
    p = ::mmap(nullptr, bytes, PROT_NONE, reservation_flags, -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      s.return_frames(device, extents);
      return host_vm_failure(op, "mmap of the allocation's address range", err);
    }
    bool restored = true;
    if (const int err = s.map_extents(reinterpret_cast<std::uintptr_t>(p), bytes, extents,
                                      PROT_READ | PROT_WRITE, restored)) {
      // Drop the range with what was mapped in it.
      const bool dropped = s.with_spare_mapping([&] { return ::munmap(p, bytes) == 0; });
      s.return_frames(device, extents);
      return fail(op, failure_kind::out_of_memory,
                  std::string("host mmap failed (") + std::strerror(err) +
                      "); the host's vm.max_map_count limit on mappings may be reached" +
                      (dropped ? "" : " (host address space leaked)"));
    }
  }
  try {
    s.device_allocations.emplace(p, allocation_record{device, extents, bytes});
  } catch (const std::bad_alloc&) {
    const bool dropped = s.with_spare_mapping([&] { return ::munmap(p, bytes) == 0; });
    s.return_frames(device, extents);
    return fail(op, failure_kind::out_of_memory,
                std::string("host memory exhausted") +
                    (dropped ? "" : " (host address space leaked)"));
  }
  return p;
}

// Frees a device allocation; `freed` receives its size (0 when there is none).
status sim_release(sim_platform::state& s, platform_op op, int device, void* ptr,
                   std::size_t& freed) {
  freed = 0;
  if (ptr == nullptr) return status::success();  // as cudaFree(nullptr)
  std::lock_guard lock(s.mutex);
  auto it = s.device_allocations.find(ptr);
  if (it == s.device_allocations.end() || it->second.device != device)
    return fail(op, failure_kind::invalid_value, "not a device allocation of this device");
  freed = it->second.size;
  // Its mappings may have merged with a neighbour's: at the limit the split is refused,
  // and the allocation stays as it was.
  if (!s.with_spare_mapping([&] { return ::munmap(ptr, it->second.size) == 0; }))
    return host_vm_failure(op, "munmap", errno);
  s.free_frames(device, it->second.extents);
  s.device_allocations.erase(it);
  return status::success();
}

}  // namespace

result<void*> sim_platform::runtime_malloc(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::runtime_malloc);
  GPUMEM_SIM_CHARGE(platform_op::runtime_malloc, size);
  return sim_allocate(*state_, platform_op::runtime_malloc, device, size);
}

status sim_platform::runtime_free(int device, void* ptr) {
  GPUMEM_SIM_ENTER(platform_op::runtime_free);
  std::size_t freed = 0;
  status result = sim_release(*state_, platform_op::runtime_free, device, ptr, freed);
  GPUMEM_SIM_CHARGE(platform_op::runtime_free, freed);
  return result;
}

result<void*> sim_platform::driver_alloc(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::driver_alloc);
  GPUMEM_SIM_CHARGE(platform_op::driver_alloc, size);
  if (size == 0)
    return fail(platform_op::driver_alloc, failure_kind::invalid_value, "cuMemAlloc of 0 bytes");
  return sim_allocate(*state_, platform_op::driver_alloc, device, size);
}

status sim_platform::driver_free(int device, void* ptr) {
  GPUMEM_SIM_ENTER(platform_op::driver_free);
  std::size_t freed = 0;
  status result = sim_release(*state_, platform_op::driver_free, device, ptr, freed);
  GPUMEM_SIM_CHARGE(platform_op::driver_free, freed);
  return result;
}

result<void*> sim_platform::host_alloc_pinned(std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::host_alloc);
  GPUMEM_SIM_CHARGE(platform_op::host_alloc, size);
  if (size == 0) return static_cast<void*>(nullptr);
  const std::size_t bytes = round_up(size, host_page);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return host_vm_failure(platform_op::host_alloc, "mmap", errno);
  std::lock_guard lock(state_->mutex);
  try {
    state_->host_allocations.emplace(p, bytes);
  } catch (const std::bad_alloc&) {
    (void)::munmap(p, bytes);  // the whole new mapping: no split
    return fail(platform_op::host_alloc, failure_kind::out_of_memory, "host memory exhausted");
  }
  return p;
}

status sim_platform::host_free_pinned(void* ptr) {
  GPUMEM_SIM_ENTER(platform_op::host_free);
  std::size_t freed = 0;
  status result = [&] {
    if (ptr == nullptr) return status::success();
    std::lock_guard lock(state_->mutex);
    auto it = state_->host_allocations.find(ptr);
    if (it == state_->host_allocations.end())
      return fail(platform_op::host_free, failure_kind::invalid_value,
                  "not a pinned host allocation");
    freed = it->second;
    if (!state_->with_spare_mapping([&] { return ::munmap(ptr, it->second) == 0; }))
      return host_vm_failure(platform_op::host_free, "munmap", errno);
    state_->host_allocations.erase(it);
    return status::success();
  }();
  GPUMEM_SIM_CHARGE(platform_op::host_free, freed);
  return result;
}

result<void*> sim_platform::async_malloc(int device, std::size_t size, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::async_malloc);
  GPUMEM_SIM_CHARGE(platform_op::async_malloc, size);
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::async_malloc, failure_kind::invalid_value, "unknown stream");
  }
  return sim_allocate(*state_, platform_op::async_malloc, device, size);
}

status sim_platform::async_free(void* ptr, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::async_free);
  std::size_t freed = 0;
  status result = [&] {
    int device = 0;
    {
      std::lock_guard lock(state_->mutex);
      if (!known_stream(*state_, stream))
        return fail(platform_op::async_free, failure_kind::invalid_value, "unknown stream");
      auto it = state_->device_allocations.find(ptr);
      if (it != state_->device_allocations.end()) device = it->second.device;
    }
    return sim_release(*state_, platform_op::async_free, device, ptr, freed);
  }();
  GPUMEM_SIM_CHARGE(platform_op::async_free, freed);
  return result;
}

}  // namespace gpumem
