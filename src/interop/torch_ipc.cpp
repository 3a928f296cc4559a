// CUDA IPC handles in PyTorch's expandable-segment format for memory of the plug-in's pools
// (gpumem_torch.h: gpumem_torch_ipc_share / _open / _forget).
//
// The handle, as PyTorch's own allocator writes it for an expandable segment:
//   byte 0: 2 (the handle format's version), byte 1: 'e',
//   then {pid_t pid; size_t segment_size; size_t handles} (native layout and padding),
//   then one int per physical handle: a file descriptor number in process `pid`.
// The opener takes each descriptor from the exporter with pidfd_getfd (no socket is
// needed, so the handle travels as bytes through torch.multiprocessing's pickles), imports
// the handles and maps them side by side. A consumer running PyTorch's own allocator opens
// it the same way. Handles of unequal sizes (gpumem's large-growth handles beside one-page
// ones) cannot be said in that format: they are written as 'g', the same but for a size
// per handle after the descriptors (uint64), which only gpumem opens.
//
// The exporter keeps the descriptors open while the allocation lives (pidfd_getfd needs
// them then); gpumem_torch_ipc_forget, called when the allocation is freed, closes them.
// Sharing one allocation again gives the same handle.
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpumem/interop/gpumem.h"
#include "gpumem/interop/gpumem_torch.h"
#include "interop/c_api_internal.hpp"

namespace {

constexpr char handle_version = 2;
constexpr char type_expandable = 'e';  // PyTorch's own: handles of one size
constexpr char type_sized = 'g';       // gpumem's: a size per handle

struct share_header {
  pid_t pid;
  std::size_t segment_size;
  std::size_t handles;
};

// At most this many handles in one handle string: 64 TiB of one-page handles.
constexpr std::size_t max_handles = std::size_t{1} << 25;

struct shared_allocation {
  std::vector<int> fds;
  std::string handle;
  std::size_t offset = 0;
};

std::mutex shared_mutex;
std::unordered_map<std::uintptr_t, shared_allocation> shared_by_ptr;

gpumem_status refuse(gpumem_status status, const std::string& text) {
  return gpumem::detail::c_api_fail(status, text.c_str());
}

std::string encode(const std::vector<int>& fds, const std::vector<std::size_t>& bytes) {
  bool uniform = true;
  for (const std::size_t b : bytes) uniform = uniform && b == bytes.front();
  std::string out;
  out.push_back(handle_version);
  out.push_back(uniform ? type_expandable : type_sized);
  const share_header h{::getpid(), bytes.front(), fds.size()};
  out.append(reinterpret_cast<const char*>(&h), sizeof h);
  out.append(reinterpret_cast<const char*>(fds.data()), fds.size() * sizeof(int));
  if (!uniform)
    for (const std::size_t b : bytes) {
      const std::uint64_t v = b;
      out.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
  return out;
}

// A descriptor of process `pidfd`'s, as a new one of this process (-1, errno set, on failure).
int take_fd(int pidfd, int fd) {
  return static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, fd, 0));
}

}  // namespace

extern "C" {

GPUMEM_API int gpumem_torch_ipc_share(int device, void* ptr, size_t size, char* handle_out,
                                      size_t capacity, size_t* length_out, size_t* offset_out) {
  if (length_out == nullptr || offset_out == nullptr || (capacity != 0 && handle_out == nullptr))
    return refuse(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_torch_ipc_share: null output pointer");
  *length_out = 0;
  *offset_out = 0;
  gpumem_pool* pool = gpumem_torch_pool(device);
  if (pool == nullptr) return gpumem_last_status();
  std::lock_guard lock(shared_mutex);
  auto it = shared_by_ptr.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == shared_by_ptr.end()) {
    std::size_t count = 0, offset = 0;
    // First ask with no room: the count comes back, nothing is exported.
    gpumem_status s = gpumem_export_pages(pool, ptr, size, nullptr, nullptr, 0, &count, &offset);
    if (s != GPUMEM_SUCCESS && count == 0) return s;
    if (count > max_handles)
      return refuse(GPUMEM_ERROR_INVALID_ARGUMENT,
                    "gpumem_torch_ipc_share: " + std::to_string(count) + " handles");
    std::vector<int> fds(count, -1);
    std::vector<std::size_t> bytes(count, 0);
    s = gpumem_export_pages(pool, ptr, size, fds.data(), bytes.data(), count, &count, &offset);
    if (s != GPUMEM_SUCCESS) return s;
    shared_allocation a;
    a.handle = encode(fds, bytes);
    a.fds = std::move(fds);
    a.offset = offset;
    it = shared_by_ptr.emplace(reinterpret_cast<std::uintptr_t>(ptr), std::move(a)).first;
  }
  *length_out = it->second.handle.size();
  *offset_out = it->second.offset;
  if (it->second.handle.size() > capacity)
    return refuse(GPUMEM_ERROR_INVALID_ARGUMENT,
                  "gpumem_torch_ipc_share: the handle takes " +
                      std::to_string(it->second.handle.size()) + " bytes, room for " +
                      std::to_string(capacity));
  std::memcpy(handle_out, it->second.handle.data(), it->second.handle.size());
  return GPUMEM_SUCCESS;
}

GPUMEM_API void gpumem_torch_ipc_forget(void* ptr) {
  std::lock_guard lock(shared_mutex);
  auto it = shared_by_ptr.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == shared_by_ptr.end()) return;
  for (const int fd : it->second.fds) ::close(fd);
  shared_by_ptr.erase(it);
}

GPUMEM_API int gpumem_torch_ipc_open(int device, const char* handle, size_t length,
                                     void** base_out, size_t* mapped_out) {
  if (base_out == nullptr || mapped_out == nullptr || (length != 0 && handle == nullptr))
    return refuse(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_torch_ipc_open: null pointer");
  *base_out = nullptr;
  *mapped_out = 0;
  const std::size_t fixed = 2 + sizeof(share_header);
  if (length < fixed || handle[0] != handle_version ||
      (handle[1] != type_expandable && handle[1] != type_sized))
    return refuse(GPUMEM_ERROR_INVALID_ARGUMENT,
                  "gpumem_torch_ipc_open: not a CUDA IPC handle of an expandable segment "
                  "(version 2, type 'e' or 'g')");
  share_header h{};
  std::memcpy(&h, handle + 2, sizeof h);
  const bool sized = handle[1] == type_sized;
  const std::size_t per_handle = sizeof(int) + (sized ? sizeof(std::uint64_t) : 0);
  if (h.pid <= 0 || h.handles == 0 || h.handles > max_handles ||
      length != fixed + h.handles * per_handle || (!sized && h.segment_size == 0))
    return refuse(GPUMEM_ERROR_INVALID_ARGUMENT,
                  "gpumem_torch_ipc_open: the handle's header (pid " + std::to_string(h.pid) +
                      ", " + std::to_string(h.handles) + " handles) does not match its " +
                      std::to_string(length) + " bytes");
  std::vector<int> theirs(h.handles);
  std::memcpy(theirs.data(), handle + fixed, h.handles * sizeof(int));
  std::vector<std::size_t> bytes(h.handles, h.segment_size);
  if (sized)
    for (std::size_t i = 0; i < h.handles; ++i) {
      std::uint64_t v = 0;
      std::memcpy(&v, handle + fixed + h.handles * sizeof(int) + i * sizeof v, sizeof v);
      bytes[i] = static_cast<std::size_t>(v);
    }
  gpumem_pool* pool = gpumem_torch_pool(device);
  if (pool == nullptr) return gpumem_last_status();
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, h.pid, 0));
  if (pidfd < 0)
    return refuse(GPUMEM_ERROR_INVALID_ARGUMENT,
                  "gpumem_torch_ipc_open: the exporting process " + std::to_string(h.pid) +
                      " cannot be reached (pidfd_open: " + std::strerror(errno) + ")");
  std::vector<int> mine;
  mine.reserve(h.handles);
  auto close_all = [&] {
    for (const int fd : mine) ::close(fd);
    ::close(pidfd);
  };
  for (const int fd : theirs) {
    const int own = take_fd(pidfd, fd);
    if (own < 0) {
      const int err = errno;
      close_all();
      return refuse(GPUMEM_ERROR_INVALID_ARGUMENT,
                    "gpumem_torch_ipc_open: descriptor " + std::to_string(fd) + " of process " +
                        std::to_string(h.pid) + " cannot be taken (pidfd_getfd: " +
                        std::strerror(err) +
                        (err == EPERM ? "; the exporter must allow this process to trace it: "
                                        "kernel.yama.ptrace_scope 0, or the same parent"
                                      : "") +
                        "): has the exporter freed the memory?");
    }
    mine.push_back(own);
  }
  const gpumem_status s = gpumem_import_pages(pool, mine.data(), bytes.data(), mine.size(), base_out);
  close_all();
  if (s != GPUMEM_SUCCESS) return s;
  for (const std::size_t b : bytes) *mapped_out += b;
  return GPUMEM_SUCCESS;
}

}  // extern "C"
