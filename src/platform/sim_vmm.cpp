// sim device: virtual memory management (ranges, physical handles, map, access).
#include "platform/sim/sim_state.hpp"

namespace gpumem {

// --- virtual memory management -----------------------------------------------------------

result<std::uintptr_t> sim_platform::reserve_range(std::size_t size, std::size_t alignment) {
  GPUMEM_SIM_ENTER(platform_op::reserve_range);
  GPUMEM_SIM_CHARGE(platform_op::reserve_range, size);
  auto& s = *state_;
  // A range serves every device: sizes in the finest granularity, aligned (by default) to
  // the coarsest, so any device's pages can be mapped at its start.
  const std::size_t g = s.min_granularity;
  if (alignment == 0) alignment = s.max_granularity;
  if (size == 0 || size % g != 0)
    return fail(platform_op::reserve_range, failure_kind::invalid_value,
                "size " + std::to_string(size) + " is not a non-zero multiple of the granularity " +
                    std::to_string(g));
  if (!is_pow2(alignment) || alignment % g != 0)
    return fail(platform_op::reserve_range, failure_kind::invalid_value,
                "alignment " + std::to_string(alignment) +
                    " is not a power-of-two multiple of the granularity");
  std::lock_guard lock(s.mutex);
  if (size > max_reserved_va || s.reserved_va + size > max_reserved_va)
    return fail(platform_op::reserve_range, failure_kind::out_of_memory,
                "virtual address space exhausted");
  // Over-reserve, then trim to an aligned window.
  const std::size_t span = size + alignment;
  void* raw = ::mmap(nullptr, span, PROT_NONE, reservation_flags, -1, 0);
  if (raw == MAP_FAILED)
    return host_vm_failure(platform_op::reserve_range, "mmap of the reservation", errno);
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t base = round_up(start, alignment);
  // Trimming splits the new mapping (or one it merged with), which fails at the limit.
  const bool trimmed =
      (base == start || ::munmap(raw, base - start) == 0) &&
      (start + span == base + size ||
       ::munmap(at(base + size), start + span - base - size) == 0);
  if (!trimmed) {
    const int err = errno;
    (void)::munmap(raw, span);  // whatever of the over-reservation is left
    return host_vm_failure(platform_op::reserve_range, "munmap trimming the reservation", err);
  }
  s.ranges.emplace(base, size);
  s.reserved_va += size;
  return base;
}

status sim_platform::free_range(std::uintptr_t base, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::free_range);
  GPUMEM_SIM_CHARGE(platform_op::free_range, size);
  auto& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.ranges.find(base);
  if (it == s.ranges.end() || it->second != size)
    return fail(platform_op::free_range, failure_kind::invalid_value,
                "not a reserved range (base and size must match the reservation)");
  auto m = s.mappings.lower_bound(base);
  if (m != s.mappings.end() && m->first < base + size)
    return fail(platform_op::free_range, failure_kind::invalid_value,
                "range still has mappings; unmap them first");
  // The reservation may have merged with a neighbouring one, so this may split: at the
  // limit it fails and the range stays reserved.
  if (!s.with_spare_mapping([&] { return ::munmap(at(base), size) == 0; }))
    return host_vm_failure(platform_op::free_range, "munmap of the reservation", errno);
  s.reserved_va -= size;
  s.ranges.erase(it);
  return status::success();
}

result<physical_handle> sim_platform::create_physical(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::create_physical);
  GPUMEM_SIM_CHARGE(platform_op::create_physical, size);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::create_physical, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  if (size == 0 || size % s.granularity(device) != 0)
    return fail(platform_op::create_physical, failure_kind::invalid_value,
                "size " + std::to_string(size) + " is not a non-zero multiple of the granularity");
  if (s.memfd < 0)
    return fail(platform_op::create_physical, failure_kind::driver_error,
                "sim device has no backing memfd");
  std::lock_guard lock(s.mutex);
  // Like the GPU's pages, a handle's frames need not be contiguous: whole granules from
  // wherever they are free.
  auto extents = s.take_frames(device, size, s.granularity(device));
  if (extents.empty())
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                "sim device " + std::to_string(device) + " has fewer than " +
                    std::to_string(size) + " free bytes in whole granules");
  const std::uint64_t id = s.next_handle;
  try {
    s.handles.emplace(id, handle_record{device, extents, size});
  } catch (const std::bad_alloc&) {
    s.return_frames(device, extents);
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                "host memory exhausted");
  }
  ++s.next_handle;
  return physical_handle{id};
}

status sim_platform::release_physical(physical_handle handle) {
  GPUMEM_SIM_ENTER(platform_op::release_physical);
  auto& s = *state_;
  std::size_t released_bytes = 0;
  status result = [&] {
    std::lock_guard lock(s.mutex);
    auto it = s.handles.find(handle.value);
    if (it == s.handles.end() || it->second.released)
      return fail(platform_op::release_physical, failure_kind::invalid_value,
                  "unknown or already released physical handle");
    released_bytes = it->second.size;
    // As on CUDA: the memory lives on while mappings of it remain.
    it->second.released = true;
    if (it->second.mappings == 0) s.drop_handle(it);
    return status::success();
  }();
  GPUMEM_SIM_CHARGE(platform_op::release_physical, released_bytes);
  return result;
}

status sim_platform::map(std::uintptr_t va, std::size_t size, physical_handle handle,
                         std::size_t offset) {
  GPUMEM_SIM_ENTER(platform_op::map);
  GPUMEM_SIM_CHARGE(platform_op::map, size);
  auto& s = *state_;
  std::lock_guard lock(s.mutex);
  auto h = s.handles.find(handle.value);
  if (h == s.handles.end() || h->second.released)
    return fail(platform_op::map, failure_kind::invalid_value, "unknown physical handle");
  const std::size_t g = s.granularity(h->second.device);
  // As the real driver (CUDA 13): a mapping starts at offset 0 of its handle.
  if (offset != 0)
    return fail(platform_op::map, failure_kind::not_supported,
                "cuMemMap offset must be 0 (the driver maps handles from their start)");
  if (size == 0 || va % g != 0 || size % g != 0 || offset + size > h->second.size)
    return fail(platform_op::map, failure_kind::invalid_value,
                "address, size or offset not granularity-aligned, or past the handle's end");
  if (s.range_containing(va, size) == s.ranges.end())
    return fail(platform_op::map, failure_kind::invalid_value,
                "address range is not inside one reserved range");
  auto next = s.mappings.lower_bound(va);
  if (next != s.mappings.end() && next->first < va + size)
    return fail(platform_op::map, failure_kind::invalid_value, "address range already mapped");
  if (next != s.mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > va)
      return fail(platform_op::map, failure_kind::invalid_value, "address range already mapped");
  }
  // Record first: near the mapping limit the heap may be unable to grow either, and then
  // nothing has been mapped yet.
  std::map<std::uintptr_t, mapping_record>::iterator record;
  try {
    record = s.mappings.emplace_hint(next, va, mapping_record{size, handle.value, false});
  } catch (const std::bad_alloc&) {
    return fail(platform_op::map, failure_kind::out_of_memory, "host memory exhausted");
  }
  // One host mapping per extent, PROT_NONE until set_access.
  bool restored = true;
  // A shareable or imported handle's bytes are its own memfd's, from offset 0.
  const int err = h->second.own_fd >= 0
                      ? s.map_own_fd(va, size, h->second.own_fd)
                      : s.map_extents(va, size, h->second.extents, PROT_NONE, restored);
  if (err != 0) {
    s.mappings.erase(record);
    return fail(platform_op::map, failure_kind::out_of_memory,
                std::string("host mmap failed (") + std::strerror(err) +
                    "); the host's vm.max_map_count limit on mappings may be reached: map "
                    "larger runs" +
                    (restored ? "" : " (part of the range is left mapped PROT_NONE)"));
  }
  ++h->second.mappings;
  return status::success();
}

status sim_platform::unmap(std::uintptr_t va, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::unmap);
  charge_mappings(*state_, platform_op::unmap, va, size);
  auto& s = *state_;
  std::lock_guard lock(s.mutex);
  // The range must start at a mapping and end exactly at one's end, with no gaps.
  auto first = s.mappings.find(va);
  if (first == s.mappings.end())
    return fail(platform_op::unmap, failure_kind::invalid_value, "no mapping starts at address");
  std::uintptr_t cursor = va;
  auto it = first;
  while (it != s.mappings.end() && cursor < va + size) {
    if (it->first != cursor)
      return fail(platform_op::unmap, failure_kind::invalid_value, "range has unmapped gaps");
    cursor += it->second.size;
    ++it;
  }
  if (cursor != va + size)
    return fail(platform_op::unmap, failure_kind::invalid_value,
                "range does not end at a mapping's end");
  // Put the reservation back over the range. At vm.max_map_count the kernel may refuse
  // (always when the count is past the limit; or when the memory's mapping merged with a
  // neighbour's, adjacent in the file, and must be split): then nothing is unmapped,
  // nothing freed, and the caller is told.
  if (!s.with_spare_mapping([&] { return reserve_again(va, size); }))
    return fail(platform_op::unmap, failure_kind::out_of_memory,
                std::string("host mmap replacing the mapping failed (") +
                    std::strerror(errno) +
                    "): the host's vm.max_map_count limit on mappings is reached; the range "
                    "is still mapped");
  for (auto m = first; m != it;) {
    auto h = s.handles.find(m->second.handle);
    if (--h->second.mappings == 0 && h->second.released) s.drop_handle(h);
    m = s.mappings.erase(m);
  }
  return status::success();
}

status sim_platform::set_access(int device, std::uintptr_t va, std::size_t size) {
  const int devices[] = {device};
  return set_access_for(devices, va, size);
}

status sim_platform::set_access_for(std::span<const int> devices, std::uintptr_t va,
                                    std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::set_access);
  charge_mappings(*state_, platform_op::set_access, va, size);
  auto& s = *state_;
  std::uint64_t granted = 0;
  if (devices.empty())
    return fail(platform_op::set_access, failure_kind::invalid_value, "no device to grant access to");
  for (int device : devices) {
    if (!s.valid_device(device))
      return fail(platform_op::set_access, failure_kind::invalid_value,
                  "no sim device " + std::to_string(device));
    granted |= std::uint64_t{1} << device;
  }
  std::lock_guard lock(s.mutex);
  // Every byte of the range must be mapped, with memory every device named can reach.
  auto it = s.mappings.upper_bound(va);
  if (it == s.mappings.begin())
    return fail(platform_op::set_access, failure_kind::invalid_value, "range is not mapped");
  --it;
  std::uintptr_t cursor = va;
  auto first = it;
  while (cursor < va + size) {
    if (it == s.mappings.end() || it->first > cursor || it->first + it->second.size <= cursor)
      return fail(platform_op::set_access, failure_kind::invalid_value,
                  "range is not fully mapped");
    const int owner = s.handles.at(it->second.handle).device;
    for (int device : devices)
      if (!s.reaches(device, owner))
        return fail(platform_op::set_access, failure_kind::invalid_value,
                    "sim device " + std::to_string(device) + " cannot reach device " +
                        std::to_string(owner) +
                        "'s memory (no peer path: cuDeviceCanAccessPeer is 0)");
    cursor = it->first + it->second.size;
    ++it;
  }
  if (::mprotect(at(va), size, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    // mprotect may have changed part of the range before failing: take access back from
    // the mappings that had none (best effort: this too may need a split).
    for (auto m = first; m != it; ++m) {
      if (m->second.access != 0) continue;
      const std::uintptr_t lo = std::max(va, m->first);
      const std::uintptr_t hi = std::min(va + size, m->first + m->second.size);
      (void)::mprotect(at(lo), hi - lo, PROT_NONE);
    }
    return host_vm_failure(platform_op::set_access, "mprotect", err);
  }
  for (auto m = first; m != it; ++m) m->second.access |= granted;
  return status::success();
}
}  // namespace gpumem
