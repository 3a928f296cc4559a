// shared_memory: device memory shared between processes, without copies.
//
// An allocation here owns one physical handle created shareable (CUDA: the POSIX file
// descriptor handle type requested at cuMemCreate; sim: a memfd of its own), mapped in a
// virtual range of its own with access granted. export_fd gives a file descriptor for it,
// which another process receives (send_fd / receive_fd: SCM_RIGHTS over a Unix socket)
// and passes to import: the same physical memory mapped in a range of the importer's.
// The memory lives while any process holds a handle or a mapping of it: the exporter may
// free its allocation while an importer still reads it, and an importer that exits or is
// killed without closing takes nothing of the exporter's.
//
// Invariants (validate()): every entry's range is reserved and mapped over its whole size,
// an own allocation with one handle, an import with one handle per exported piece, side by
// side; live_bytes == sum of the requested sizes of own allocations;
// reserved_bytes == sum of their page-rounded sizes (imports are another process's
// memory and count in imported_bytes only).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"

namespace gpumem {

class shared_memory {
 public:
  shared_memory(platform& platform, int device);
  ~shared_memory();  // unmaps and releases what is left; never throws
  shared_memory(const shared_memory&) = delete;
  shared_memory& operator=(const shared_memory&) = delete;

  // Throws gpumem::invalid_argument (0 bytes), gpumem::out_of_memory, gpumem::not_supported
  // (no shareable memory on this platform), gpumem::cuda_error; nothing is left behind.
  void* allocate(std::size_t bytes);
  // A new file descriptor for own allocation `ptr` (the caller closes it). Throws
  // gpumem::invalid_argument for a pointer that is not one (an import, an interior one).
  int export_fd(void* ptr);
  // Maps memory another process exported as `fd` (the fd stays the caller's). Throws
  // gpumem::invalid_argument for a closed or foreign fd, a size that does not match the
  // exported memory, memory on a device this one cannot reach; gpumem::cuda_error
  // otherwise. A peer's memory is mapped and this device granted access.
  void* import(int fd, std::size_t bytes);
  // Maps, side by side in one range, the pieces another process exported as `fds` with
  // sizes `bytes` (vmm_page_pool::export_pages; the fds stay the caller's): the start of
  // the range, released with release(ptr, sum of bytes). Throws gpumem::invalid_argument,
  // mapping nothing, for no piece, counts that differ, a size that is not a multiple of the
  // page or does not match its piece, a sum that overflows, or a fd import() refuses.
  void* import_pieces(std::span<const int> fds, std::span<const std::size_t> bytes);
  // Frees an own allocation or unmaps an import (`bytes` as given at allocate / import),
  // once the work queued on `stream` is done: the mapping goes at once, so kernels still
  // reading it would fault. Throws gpumem::invalid_argument, changing nothing, for an unknown
  // pointer or size; gpumem::cuda_error, changing nothing, when the stream cannot be waited.
  void release(void* ptr, std::size_t bytes, stream_handle stream = {});
  bool owns(const void* ptr) const;
  bool is_import(const void* ptr) const;

  resource_stats stats() const;
  std::size_t imported_bytes() const;
  std::string validate() const;
  int device() const noexcept { return device_; }
  std::size_t page_size() const noexcept { return page_; }

 private:
  struct piece {
    physical_handle handle{};
    std::size_t bytes = 0;  // mapped, a multiple of the page
  };
  struct entry {
    std::size_t requested = 0;
    std::size_t mapped = 0;  // page-rounded: the pieces' sum
    std::vector<piece> pieces;  // side by side from the entry's address
    bool imported = false;
  };
  // Reserves a range for `pieces`, maps them side by side and grants access; on failure
  // releases every handle of `pieces` and throws.
  void* map_new(const std::vector<piece>& pieces, std::size_t mapped, const char* caller);
  // Unmaps an entry's range, releases its handles and the range; never throws.
  void drop(std::uintptr_t va, const entry& e) noexcept;

  platform& platform_;
  int device_;
  std::size_t page_ = 0;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, entry> entries_;
  resource_stats stats_{};
  std::size_t imported_bytes_ = 0;
};

// Passing a file descriptor to another process over a connected Unix domain socket
// (SCM_RIGHTS), with `size` as the message. send_fd returns false (errno set) on failure;
// receive_fd returns -1 (errno set) on failure, ECONNRESET when the peer closed the
// socket, EBADMSG for a message that is not send_fd's (short, cut, with no or several
// descriptors). Every descriptor a message carried is either returned or closed.
bool send_fd(int socket, int fd, std::uint64_t size);
int receive_fd(int socket, std::uint64_t* size);

}  // namespace gpumem
