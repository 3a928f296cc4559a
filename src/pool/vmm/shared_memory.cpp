// shared_memory: see gpumem/pool/vmm/shared_memory.hpp.
#include "gpumem/pool/vmm/shared_memory.hpp"

#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <limits>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"

namespace gpumem {

namespace {

// A failed platform call as the typed error: bad input is the caller's, a missing feature
// is not_supported, exhaustion out_of_memory, the rest a driver error.
[[noreturn]] void throw_for(const status& s, const std::string& where) {
  switch (s.kind) {
    case failure_kind::invalid_value:
      throw invalid_argument(where + ": " + s.describe());
    case failure_kind::not_supported:
      throw not_supported(where + ": " + s.describe());
    case failure_kind::out_of_memory:
      throw out_of_memory("gpumem: out of memory: " + where + ": " + s.describe());
    default:
      throw_cuda_error(s, where);
  }
}

}  // namespace

shared_memory::shared_memory(platform& platform, int device) : platform_(platform), device_(device) {
  auto g = platform_.granularity(device);
  if (!g) throw_for(g.error(), "shared_memory: granularity");
  page_ = std::max(g.value().recommended, g.value().minimum);
}

shared_memory::~shared_memory() {
  for (auto& [va, e] : entries_) drop(va, e);
}

void shared_memory::drop(std::uintptr_t va, const entry& e) noexcept {
  std::size_t at = 0;
  for (const piece& p : e.pieces) {
    (void)platform_.unmap(va + at, p.bytes);
    at += p.bytes;
  }
  for (const piece& p : e.pieces) (void)platform_.release_physical(p.handle);
  (void)platform_.free_range(va, e.mapped);
}

void* shared_memory::map_new(const std::vector<piece>& pieces, std::size_t mapped,
                             const char* caller) {
  auto release_all = [&] {
    for (const piece& p : pieces) (void)platform_.release_physical(p.handle);
  };
  auto range = platform_.reserve_range(mapped, page_);
  if (!range) {
    release_all();
    throw_for(range.error(), std::string(caller) + ": reserve a virtual range");
  }
  const std::uintptr_t va = range.value();
  std::size_t at = 0;
  for (const piece& p : pieces) {
    if (auto s = platform_.map(va + at, p.bytes, p.handle, 0); !s) {
      for (std::size_t back = 0, i = 0; back < at; back += pieces[i++].bytes)
        (void)platform_.unmap(va + back, pieces[i].bytes);
      (void)platform_.free_range(va, mapped);
      release_all();
      throw_for(s, std::string(caller) + ": map");
    }
    at += p.bytes;
  }
  if (auto s = platform_.set_access(device_, va, mapped); !s) {
    for (std::size_t back = 0, i = 0; back < mapped; back += pieces[i++].bytes)
      (void)platform_.unmap(va + back, pieces[i].bytes);
    (void)platform_.free_range(va, mapped);
    release_all();
    throw_for(s, std::string(caller) + ": grant access");
  }
  return reinterpret_cast<void*>(va);
}

void* shared_memory::allocate(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("shared_memory::allocate: 0 bytes");
  if (bytes > std::numeric_limits<std::size_t>::max() - page_)
    throw invalid_argument("shared_memory::allocate: " + std::to_string(bytes) +
                           " bytes cannot be rounded to pages");
  const std::size_t mapped = (bytes + page_ - 1) / page_ * page_;
  std::lock_guard lock(mutex_);
  auto h = platform_.create_shareable_physical(device_, mapped);
  if (!h) throw_for(h.error(), "shared_memory::allocate: create shareable memory");
  std::vector<piece> pieces{piece{h.value(), mapped}};
  void* p = map_new(pieces, mapped, "shared_memory::allocate");
  entries_.emplace(reinterpret_cast<std::uintptr_t>(p),
                   entry{bytes, mapped, std::move(pieces), false});
  stats_.live_bytes += bytes;
  stats_.live_allocations += 1;
  stats_.allocations += 1;
  stats_.reserved_bytes += mapped;
  stats_.peak_live_bytes = std::max(stats_.peak_live_bytes, stats_.live_bytes);
  stats_.peak_reserved_bytes = std::max(stats_.peak_reserved_bytes, stats_.reserved_bytes);
  return p;
}

int shared_memory::export_fd(void* ptr) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == entries_.end())
    throw invalid_argument("shared_memory::export: not a live shareable allocation "
                           "(allocate it with the shared tag)");
  if (it->second.imported)
    throw invalid_argument("shared_memory::export: an imported allocation is exported by "
                           "the process that made it");
  auto fd = platform_.export_handle(it->second.pieces.front().handle);
  if (!fd) throw_for(fd.error(), "shared_memory::export");
  return fd.value();
}

void* shared_memory::import(int fd, std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("shared_memory::import: 0 bytes");
  if (bytes > std::numeric_limits<std::size_t>::max() - page_)
    throw invalid_argument("shared_memory::import: " + std::to_string(bytes) +
                           " bytes cannot be rounded to pages");
  const std::size_t mapped = (bytes + page_ - 1) / page_ * page_;
  std::lock_guard lock(mutex_);
  auto h = platform_.import_handle(device_, fd, mapped);
  if (!h) throw_for(h.error(), "shared_memory::import");
  std::vector<piece> pieces{piece{h.value(), mapped}};
  void* p = map_new(pieces, mapped, "shared_memory::import");
  entries_.emplace(reinterpret_cast<std::uintptr_t>(p), entry{bytes, mapped, std::move(pieces), true});
  imported_bytes_ += mapped;
  return p;
}

void* shared_memory::import_pieces(std::span<const int> fds, std::span<const std::size_t> bytes) {
  if (fds.empty() || fds.size() != bytes.size())
    throw invalid_argument("shared_memory::import_pieces: " + std::to_string(fds.size()) +
                           " descriptors for " + std::to_string(bytes.size()) + " sizes");
  std::size_t mapped = 0;
  for (const std::size_t b : bytes) {
    if (b == 0 || b % page_ != 0)
      throw invalid_argument("shared_memory::import_pieces: a piece of " + std::to_string(b) +
                             " bytes is not a whole number of " + std::to_string(page_) +
                             "-byte pages");
    if (b > std::numeric_limits<std::size_t>::max() - mapped)
      throw invalid_argument("shared_memory::import_pieces: the pieces' sizes overflow");
    mapped += b;
  }
  std::lock_guard lock(mutex_);
  std::vector<piece> pieces;
  pieces.reserve(fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i) {
    auto h = platform_.import_handle(device_, fds[i], bytes[i]);
    if (!h) {
      for (const piece& p : pieces) (void)platform_.release_physical(p.handle);
      throw_for(h.error(), "shared_memory::import_pieces: piece " + std::to_string(i));
    }
    pieces.push_back(piece{h.value(), bytes[i]});
  }
  void* p = map_new(pieces, mapped, "shared_memory::import_pieces");
  entries_.emplace(reinterpret_cast<std::uintptr_t>(p), entry{mapped, mapped, std::move(pieces), true});
  imported_bytes_ += mapped;
  return p;
}

void shared_memory::release(void* ptr, std::size_t bytes, stream_handle stream) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == entries_.end())
    throw invalid_argument("shared_memory::release: not a live shared allocation or import");
  if (it->second.requested != bytes)
    throw invalid_argument("shared_memory::release: size " + std::to_string(bytes) +
                           " differs from the " + std::to_string(it->second.requested) +
                           " bytes allocated");
  const std::uintptr_t va = it->first;
  entry& e = it->second;
  if (auto s = platform_.stream_synchronize(stream); !s)
    throw_cuda_error(s, "shared_memory::release: wait for the freeing stream");
  // Each piece is its own mapping, unmapped alone (a driver may refuse one unmap over
  // several mappings). The first piece's failure changes nothing.
  if (auto s = platform_.unmap(va, e.pieces.front().bytes); !s)
    throw_cuda_error(s, "shared_memory::release: unmap");
  // From here on the entry goes whatever the driver says (a mapping it refuses to unmap, a
  // handle it refuses to release, or a range it refuses to free, cannot be used again).
  std::size_t at = e.pieces.front().bytes;
  for (std::size_t i = 1; i < e.pieces.size(); at += e.pieces[i++].bytes)
    (void)platform_.unmap(va + at, e.pieces[i].bytes);
  for (const piece& p : e.pieces) (void)platform_.release_physical(p.handle);
  (void)platform_.free_range(va, e.mapped);
  if (e.imported) {
    imported_bytes_ -= e.mapped;
  } else {
    stats_.live_bytes -= e.requested;
    stats_.live_allocations -= 1;
    stats_.deallocations += 1;
    stats_.reserved_bytes -= e.mapped;
  }
  entries_.erase(it);
}

bool shared_memory::owns(const void* ptr) const {
  std::lock_guard lock(mutex_);
  return entries_.contains(reinterpret_cast<std::uintptr_t>(ptr));
}

bool shared_memory::is_import(const void* ptr) const {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return it != entries_.end() && it->second.imported;
}

resource_stats shared_memory::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::size_t shared_memory::imported_bytes() const {
  std::lock_guard lock(mutex_);
  return imported_bytes_;
}

std::string shared_memory::validate() const {
  std::lock_guard lock(mutex_);
  std::size_t live = 0, reserved = 0, imported = 0;
  for (auto& [va, e] : entries_) {
    if (e.mapped % page_ != 0 || e.requested > e.mapped) return "a shared entry's size is wrong";
    std::size_t sum = 0;
    for (const piece& p : e.pieces) sum += p.bytes;
    if (e.pieces.empty() || sum != e.mapped || (!e.imported && e.pieces.size() != 1))
      return "a shared entry's pieces do not tile it";
    (e.imported ? imported : reserved) += e.mapped;
    if (!e.imported) live += e.requested;
  }
  if (live != stats_.live_bytes || reserved != stats_.reserved_bytes || imported != imported_bytes_)
    return "shared memory's counts disagree with its entries";
  return {};
}

bool send_fd(int socket, int fd, std::uint64_t size) {
  iovec io{&size, sizeof size};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  ssize_t n;
  do n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  while (n < 0 && errno == EINTR);
  return n == static_cast<ssize_t>(sizeof size);
}

int receive_fd(int socket, std::uint64_t* size) {
  std::uint64_t got = 0;
  iovec io{&got, sizeof got};
  // Room for more descriptors than a message of send_fd carries: extra ones arrive here and
  // are closed, rather than being cut off by the kernel (MSG_CTRUNC, which closes them
  // too, but says the message was not send_fd's).
  constexpr std::size_t room = 16;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * room)] = {};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  // Every descriptor the message carried, over every SCM_RIGHTS header: each is returned
  // or closed, whatever else is wrong with the message.
  int fds[room * 2];
  std::size_t count = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t in_header = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t k = 0; k < in_header && count < std::size(fds); ++k)
      std::memcpy(&fds[count++], CMSG_DATA(c) + k * sizeof(int), sizeof(int));
  }
  int error = 0;
  if (n == 0 && count == 0)
    error = ECONNRESET;  // the peer closed the socket
  else if (n != static_cast<ssize_t>(sizeof got) || count != 1 ||
           (msg.msg_flags & (MSG_CTRUNC | MSG_TRUNC)) != 0)
    error = EBADMSG;  // a short message, none or several descriptors, or a cut one
  if (error != 0) {
    for (std::size_t k = 0; k < count; ++k) ::close(fds[k]);
    errno = error;
    return -1;
  }
  if (size != nullptr) *size = got;
  return fds[0];
}

}  // namespace gpumem
