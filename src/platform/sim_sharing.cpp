// sim device: physical memory shared between processes, as CUDA's POSIX file descriptor
// handles.
//
// A shareable handle takes its device's frames (so it counts in used_bytes and mem_info as
// any handle) but keeps its bytes in a memfd of its own, named "gpumem-sim-shared-d<N>"
// after its device. Exporting gives a duplicate of that memfd; another process (its own
// sim device) imports it as a handle with no frames of its own, and maps it. The kernel
// keeps the memory while any process holds the fd or a mapping of it: an importer that is
// killed drops its share and nothing of the exporter's, and the exporter's release gives
// its frames back at once (the importer's mapping keeps the bytes, which a GPU would
// still count on the device; sim counts them nowhere). An importer of another device uses
// the memory as a peer's: its handle is of the exporter's device, and set_access for the
// importer's device needs a peer path.
#include <sys/stat.h>

#include <cstdio>

#include "platform/sim/sim_state.hpp"

namespace gpumem {

namespace {

constexpr std::string_view shared_name_prefix = "gpumem-sim-shared-d";

// The device a sim-exported memfd belongs to, from its name; -1 when `fd` is not one.
int shared_fd_device(int fd) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  char target[256];
  const ssize_t n = ::readlink(path, target, sizeof target - 1);
  if (n <= 0) return -1;
  target[n] = '\0';
  const std::string_view name(target, static_cast<std::size_t>(n));
  const std::string_view memfd_prefix = "/memfd:";
  if (!name.starts_with(memfd_prefix)) return -1;
  std::string_view rest = name.substr(memfd_prefix.size());
  if (!rest.starts_with(shared_name_prefix)) return -1;
  rest.remove_prefix(shared_name_prefix.size());
  int device = 0;
  std::size_t digits = 0;
  while (digits < rest.size() && digits < 6 && rest[digits] >= '0' && rest[digits] <= '9')
    device = device * 10 + (rest[digits++] - '0');
  return digits == 0 ? -1 : device;
}

}  // namespace

result<physical_handle> sim_platform::create_shareable_physical(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::create_physical);
  GPUMEM_SIM_CHARGE(platform_op::create_physical, size);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::create_physical, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  if (size == 0 || size % s.granularity(device) != 0)
    return fail(platform_op::create_physical, failure_kind::invalid_value,
                "size " + std::to_string(size) + " is not a non-zero multiple of the granularity");
  const std::string name = std::string(shared_name_prefix) + std::to_string(device);
  const int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0)
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                std::string("memfd_create failed (") + std::strerror(errno) + ")");
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                std::string("ftruncate of the shared memfd failed (") + std::strerror(err) + ")");
  }
  std::lock_guard lock(s.mutex);
  auto extents = s.take_frames(device, size, s.granularity(device));
  if (extents.empty()) {
    ::close(fd);
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                "sim device " + std::to_string(device) + " has fewer than " +
                    std::to_string(size) + " free bytes in whole granules");
  }
  const std::uint64_t id = s.next_handle;
  try {
    handle_record record{device, extents, size};
    record.own_fd = fd;
    s.handles.emplace(id, std::move(record));
  } catch (const std::bad_alloc&) {
    s.return_frames(device, extents);
    ::close(fd);
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                "host memory exhausted");
  }
  ++s.next_handle;
  return physical_handle{id};
}

result<int> sim_platform::export_handle(physical_handle handle) {
  GPUMEM_SIM_ENTER(platform_op::export_handle);
  GPUMEM_SIM_CHARGE(platform_op::export_handle, 0);
  auto& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.handles.find(handle.value);
  if (it == s.handles.end() || it->second.released)
    return fail(platform_op::export_handle, failure_kind::invalid_value,
                "unknown or released physical handle");
  if (it->second.own_fd < 0)
    return fail(platform_op::export_handle, failure_kind::invalid_value,
                "the handle was not created shareable (create_shareable_physical; CUDA: "
                "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR at cuMemCreate)");
  const int fd = ::fcntl(it->second.own_fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0)
    return fail(platform_op::export_handle, failure_kind::out_of_memory,
                std::string("dup of the shared memfd failed (") + std::strerror(errno) + ")");
  return fd;
}

result<physical_handle> sim_platform::import_handle(int device, int fd, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::import_handle);
  GPUMEM_SIM_CHARGE(platform_op::import_handle, size);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  if (fd < 0 || ::fcntl(fd, F_GETFD) < 0)
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                "file descriptor " + std::to_string(fd) + " is not open");
  const int owner = shared_fd_device(fd);
  if (owner < 0)
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                "file descriptor " + std::to_string(fd) +
                    " is not an exported gpumem memory handle");
  // The memory stays on its device; `device` uses it as a peer's, when it can reach it.
  if (!s.valid_device(owner))
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                "the exported memory is on device " + std::to_string(owner) +
                    ", which this sim platform does not have");
  if (!s.reaches(device, owner))
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                "the exported memory is on device " + std::to_string(owner) + ", which device " +
                    std::to_string(device) + " cannot reach (no peer path)");
  const std::size_t g = s.granularity(owner);
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                std::string("fstat failed (") + std::strerror(errno) + ")");
  const auto exported = static_cast<std::size_t>(st.st_size);
  if (size == 0 || round_up(size, g) != exported)
    return fail(platform_op::import_handle, failure_kind::invalid_value,
                "size " + std::to_string(size) + " does not match the exported memory's " +
                    std::to_string(exported) + " bytes");
  const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0)
    return fail(platform_op::import_handle, failure_kind::out_of_memory,
                std::string("dup of the file descriptor failed (") + std::strerror(errno) + ")");
  std::lock_guard lock(s.mutex);
  const std::uint64_t id = s.next_handle;
  try {
    handle_record record{owner, {}, exported};
    record.own_fd = own;
    record.imported = true;
    s.handles.emplace(id, std::move(record));
  } catch (const std::bad_alloc&) {
    ::close(own);
    return fail(platform_op::import_handle, failure_kind::out_of_memory, "host memory exhausted");
  }
  ++s.next_handle;
  return physical_handle{id};
}

}  // namespace gpumem
