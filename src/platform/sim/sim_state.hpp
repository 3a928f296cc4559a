// Internals of the sim device shared by its source files (src/platform/sim_*.cpp): the
// frame allocator, the records of handles, mappings and allocations, the state behind
// sim_platform, and the entry macros every public call starts with. The model and its
// invariants are in gpumem/platform/sim_platform.hpp.
#pragma once

#include "gpumem/platform/sim_platform.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <vector>

namespace gpumem {

namespace sim_detail {
constexpr std::size_t host_page = 4096;
// Largest total of reserved virtual ranges; the host has 128 TiB of user address space.
constexpr std::size_t max_reserved_va = std::size_t{16} << 40;

// CUDA driver error codes, so sim failures read like the real ones.
constexpr int cuda_invalid_value = 1;
constexpr int cuda_out_of_memory = 2;
constexpr int cuda_no_device = 100;
constexpr int cuda_not_ready = 600;
constexpr int cuda_not_supported = 801;
constexpr int cuda_unknown = 999;

inline std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }
inline bool is_pow2(std::size_t n) { return n != 0 && (n & (n - 1)) == 0; }
inline void* at(std::uintptr_t va) { return reinterpret_cast<void*>(va); }

inline status fail(platform_op op, failure_kind kind, std::string message) {
  switch (kind) {
    case failure_kind::out_of_memory:
      return status::failure(op, kind, cuda_out_of_memory, "CUDA_ERROR_OUT_OF_MEMORY",
                             std::move(message));
    case failure_kind::invalid_value:
      return status::failure(op, kind, cuda_invalid_value, "CUDA_ERROR_INVALID_VALUE",
                             std::move(message));
    case failure_kind::not_ready:
      return status::failure(op, kind, cuda_not_ready, "CUDA_ERROR_NOT_READY",
                             std::move(message));
    case failure_kind::not_supported:
      return status::failure(op, kind, cuda_not_supported, "CUDA_ERROR_NOT_SUPPORTED",
                             std::move(message));
    case failure_kind::no_device:
      return status::failure(op, kind, cuda_no_device, "CUDA_ERROR_NO_DEVICE",
                             std::move(message));
    case failure_kind::driver_error:
    case failure_kind::none:
      break;
  }
  return status::failure(op, failure_kind::driver_error, cuda_unknown, "CUDA_ERROR_UNKNOWN",
                         std::move(message));
}

// A host call on sim's address space failed: at vm.max_map_count the kernel refuses
// mmap / munmap / mprotect calls that would split a mapping, with ENOMEM.
inline status host_vm_failure(platform_op op, const char* what, int err) {
  return fail(op, failure_kind::out_of_memory,
              std::string("host ") + what + " failed (" + std::strerror(err) +
                  "); the host's vm.max_map_count limit on mappings may be reached: map "
                  "larger runs");
}

// A run of frames: [offset, offset + size) of the memfd (absolute) or of one device's
// slice of it (frame_allocator, relative).
struct extent {
  std::size_t offset;
  std::size_t size;
};

inline std::size_t total_size(const std::vector<extent>& extents) {
  std::size_t total = 0;
  for (const auto& e : extents) total += e.size;
  return total;
}

// Best-fit allocator of host-page frames of one device's slice of the memfd.
// Invariant: free runs are disjoint, non-adjacent (merged) and inside [0, size).
class frame_allocator {
 public:
  explicit frame_allocator(std::size_t size) : size_(size) { insert(0, size); }

  // Takes `bytes` (a multiple of `unit`) as runs that are each a multiple of `unit`: one
  // best-fit run when a free run holds it all, otherwise the largest runs first and a
  // best-fit run for the rest, as a GPU backs an allocation with scattered pages.
  // All or nothing: on a shortfall nothing is taken and the result is empty.
  // Runs are returned in the order they back the allocation.
  std::vector<extent> allocate(std::size_t bytes, std::size_t unit) {
    // Plan without touching the lists, so a shortfall (or a throw) leaves them as they were.
    struct piece {
      std::size_t run_offset, run_size, take;
    };
    std::vector<piece> plan;
    std::size_t left = bytes;
    auto largest = by_size_.rbegin();  // runs from here on (downwards) are unused
    while (left > 0 && largest != by_size_.rend()) {
      auto fit = by_size_.lower_bound({left, 0});
      if (fit != by_size_.end() && *fit <= *largest) {
        plan.push_back({fit->second, fit->first, left});
        left = 0;
        break;
      }
      const std::size_t take = largest->first / unit * unit;
      if (take == 0) break;  // every unused run is smaller than a unit
      plan.push_back({largest->second, largest->first, take});
      left -= take;
      ++largest;
    }
    std::vector<extent> out;
    if (left != 0 || bytes == 0) return out;
    out.reserve(plan.size());
    for (const auto& p : plan) out.push_back({p.run_offset, p.take});
    for (const auto& p : plan) {
      erase(p.run_offset, p.run_size);
      if (p.run_size > p.take) insert(p.run_offset + p.take, p.run_size - p.take);
      used_ += p.take;
    }
    return out;
  }

  void free(std::size_t offset, std::size_t bytes) {
    used_ -= bytes;
    auto next = by_offset_.lower_bound(offset);
    if (next != by_offset_.end() && next->first == offset + bytes) {
      bytes += next->second;
      erase(next->first, next->second);
    }
    auto prev = by_offset_.lower_bound(offset);
    if (prev != by_offset_.begin()) {
      --prev;
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        bytes += prev->second;
        erase(prev->first, prev->second);
      }
    }
    insert(offset, bytes);
  }

  std::size_t used() const { return used_; }
  std::size_t size() const { return size_; }
  std::size_t free_bytes_listed() const {
    std::size_t total = 0;
    for (auto& [o, s] : by_offset_) total += s;
    return total;
  }
  // Free runs, by offset, for the self-check.
  const std::map<std::size_t, std::size_t>& free_runs() const { return by_offset_; }

 private:
  void insert(std::size_t offset, std::size_t bytes) {
    by_offset_.emplace(offset, bytes);
    by_size_.emplace(bytes, offset);
  }
  void erase(std::size_t offset, std::size_t bytes) {
    by_offset_.erase(offset);
    by_size_.erase({bytes, offset});
  }

  std::size_t size_;
  std::size_t used_ = 0;
  std::map<std::size_t, std::size_t> by_offset_;
  std::set<std::pair<std::size_t, std::size_t>> by_size_;
};

struct handle_record {
  int device;
  std::vector<extent> extents;  // absolute memfd runs, each a multiple of the granularity
  std::size_t size;             // == sum of the extents (but for an imported handle)
  std::size_t mappings = 0;
  bool released = false;
  // Shareable (create_shareable_physical) and imported handles: the memfd of their own that
  // holds their bytes from offset 0 (extents then only count the device's frames taken).
  int own_fd = -1;
  bool imported = false;  // another sim device's memory: no frames of this one
};

struct mapping_record {
  std::size_t size;
  std::uint64_t handle;
  std::uint64_t access = 0;  // bit d: device d may touch it (set_access)
};

struct allocation_record {
  int device;
  std::vector<extent> extents;  // absolute memfd runs, each a multiple of host pages
  std::size_t size;             // rounded to host pages, == sum of the extents
};

struct event_record_state {
  int device;
  bool complete = true;
};

struct fault_state {
  sim_fault fault;
  std::uint64_t calls_since_set = 0;
  bool active = false;
};

// --- host address space ----------------------------------------------------------------
// Each helper reports failure with errno set.

constexpr int reservation_flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;

// Turns [va, va+len) back into a PROT_NONE reservation, dropping what was mapped there.
inline bool reserve_again(std::uintptr_t va, std::size_t len) {
  return ::mmap(at(va), len, PROT_NONE, MAP_FIXED | reservation_flags, -1, 0) != MAP_FAILED;
}

// Whether every page of [va, va+len) is mapped (by anything: a reservation counts).
inline bool fully_mapped(std::uintptr_t va, std::size_t len) {
  return ::msync(at(va), len, MS_ASYNC) == 0;
}


}  // namespace sim_detail

// Only sim's own sources include this header: its helpers are theirs unqualified.
using namespace sim_detail;

struct sim_platform::state {
  sim_options options;
  // Per device: where its slice of the memfd starts, and the granularity; the memfd's size.
  std::vector<std::size_t> bases;
  std::vector<std::size_t> granularities;
  std::size_t total_capacity = 0;
  std::size_t min_granularity = 0, max_granularity = 0;
  // Row-major device_count x device_count: peer_path[a*n+b] when a can reach b's memory;
  // peer_enabled when enable_peer_access(a, b) succeeded.
  std::vector<std::uint8_t> peer_path;
  std::vector<std::uint8_t> peer_enabled;
  int memfd = -1;
  mutable std::mutex mutex;
  std::vector<frame_allocator> frames;  // one per device
  std::map<std::uintptr_t, std::size_t> ranges;  // base -> size
  std::size_t reserved_va = 0;
  std::map<std::uint64_t, handle_record> handles;
  std::uint64_t next_handle = 1;
  std::map<std::uintptr_t, mapping_record> mappings;  // va -> mapping
  std::map<void*, allocation_record> device_allocations;
  std::map<void*, std::size_t> host_allocations;
  std::map<std::uintptr_t, int> streams;  // id -> device
  std::map<std::uintptr_t, event_record_state> events;
  std::uintptr_t next_object_id = 1;
  bool holding_events = false;
  std::array<fault_state, platform_op_count> faults{};
  std::mt19937_64 rng;
  std::array<std::atomic<std::uint64_t>, platform_op_count> modelled{};
  // One host mapping sim holds in reserve for vm.max_map_count. The kernel lets the
  // mapping count reach the limit plus one, and from there refuses every mmap, even one
  // that only replaces a whole mapping (as unmap does). Giving this mapping up lets such
  // a call, which does not add to the count, through. It maps the memfd past its end, so
  // it never merges with another mapping (and faults if touched).
  void* spare_mapping = nullptr;

  void make_spare_mapping() {
    if (spare_mapping != nullptr || memfd < 0) return;
    const auto past_end = static_cast<off_t>(total_capacity + host_page);
    void* p = ::mmap(nullptr, host_page, PROT_NONE, MAP_SHARED, memfd, past_end);
    if (p != MAP_FAILED) spare_mapping = p;
  }

  // Runs a host call that releases address space (`call` returns false with errno set on
  // failure); should it fail for want of a mapping slot, gives up the spare mapping and
  // tries once more. errno is that of the last try.
  template <class Call>
  bool with_spare_mapping(Call&& call) {
    if (call()) {
      make_spare_mapping();  // if it was given up earlier
      return true;
    }
    if (errno != ENOMEM || spare_mapping == nullptr) return false;
    (void)::munmap(spare_mapping, host_page);  // a whole, unmergeable mapping: no split
    spare_mapping = nullptr;
    const bool ok = call();
    const int err = errno;
    make_spare_mapping();
    errno = err;
    return ok;
  }

  // Maps the first `len` bytes of `extents` at consecutive addresses from va, MAP_FIXED
  // over what is there: one mmap per extent (the kernel merges neighbours with adjacent
  // file offsets into one mapping). On failure returns the errno, having put [va, va+len)
  // back as a PROT_NONE reservation where it could (`restored` says whether it could: if
  // not, what is left there is PROT_NONE and faults like the reservation).
  int map_extents(std::uintptr_t va, std::size_t len, const std::vector<extent>& extents,
                  int prot, bool& restored) {
    restored = true;
    std::size_t done = 0;
    for (const auto& e : extents) {
      if (done == len) break;
      const std::size_t piece = std::min(e.size, len - done);
      void* got = ::mmap(at(va + done), piece, prot, MAP_FIXED | MAP_SHARED, memfd,
                         static_cast<off_t>(e.offset));
      if (got == MAP_FAILED) {
        const int err = errno;
        // Undo the extents mapped so far (a whole run of mappings unless the first merged
        // with a neighbour before va).
        if (done > 0 && !with_spare_mapping([&] { return reserve_again(va, done); }))
          restored = false;
        // The failed mmap leaves the old reservation in place on current kernels; should
        // it have dropped it, fill the hole.
        if (!fully_mapped(va + done, len - done) &&
            !with_spare_mapping([&] { return reserve_again(va + done, len - done); }))
          restored = false;
        return err;
      }
      done += piece;
    }
    return 0;
  }

  // Maps [0, len) of a handle's own memfd at va, MAP_FIXED over the reservation, PROT_NONE
  // until set_access. Returns 0 or the errno (the reservation is then still in place).
  int map_own_fd(std::uintptr_t va, std::size_t len, int fd) {
    if (::mmap(at(va), len, PROT_NONE, MAP_FIXED | MAP_SHARED, fd, 0) != MAP_FAILED) return 0;
    const int err = errno;
    if (!fully_mapped(va, len)) (void)with_spare_mapping([&] { return reserve_again(va, len); });
    return err;
  }

  std::size_t device_base(int device) const { return bases[static_cast<std::size_t>(device)]; }
  std::size_t granularity(int device) const {
    return granularities[static_cast<std::size_t>(device)];
  }
  bool valid_device(int device) const { return device >= 0 && device < options.device_count; }
  std::size_t pair(int a, int b) const {
    return static_cast<std::size_t>(a) * static_cast<std::size_t>(options.device_count) +
           static_cast<std::size_t>(b);
  }
  // Whether `device` can reach memory living on `owner` (both valid).
  bool reaches(int device, int owner) const { return device == owner || peer_path[pair(device, owner)] != 0; }

  // A range that contains [va, va+size), if any.
  std::map<std::uintptr_t, std::size_t>::const_iterator range_containing(std::uintptr_t va,
                                                                        std::size_t size) const {
    auto it = ranges.upper_bound(va);
    if (it == ranges.begin()) return ranges.end();
    --it;
    if (va + size <= it->first + it->second) return it;
    return ranges.end();
  }

  // Takes `bytes` of device frames as runs of whole `unit`s (absolute memfd offsets);
  // empty when the device has too little free.
  std::vector<extent> take_frames(int device, std::size_t bytes, std::size_t unit) {
    auto runs = frames[static_cast<std::size_t>(device)].allocate(bytes, unit);
    for (auto& r : runs) r.offset += device_base(device);
    return runs;
  }

  // Whether `device` may touch [p, p+bytes) (REQUIRES: mutex held). "" when it may or when
  // the bytes are not sim device memory (host memory: `host` is then set); otherwise why
  // not. A copy (`copy`) reaches another device's classic allocation without peer access,
  // as the driver stages such copies; a kernel does not.
  std::string access_denied(int device, std::uintptr_t p, std::size_t bytes, bool copy,
                            bool* host = nullptr) const {
    if (host != nullptr) *host = false;
    if (bytes == 0) return {};
    auto a = device_allocations.upper_bound(at(p));
    if (a != device_allocations.begin()) {
      --a;
      const auto start = reinterpret_cast<std::uintptr_t>(a->first);
      if (p >= start && p < start + a->second.size) {
        const int owner = a->second.device;
        if (device == owner || copy || peer_enabled[pair(device, owner)] != 0) return {};
        return "device " + std::to_string(device) + " has no peer access to device " +
               std::to_string(owner) + "'s allocation at " + hex(p) +
               " (enable_peer_access, cudaDeviceEnablePeerAccess)";
      }
    }
    if (range_containing(p, 1) == ranges.end()) {
      if (host != nullptr) *host = true;
      return {};
    }
    std::uintptr_t cursor = p;
    auto m = mappings.upper_bound(p);
    if (m != mappings.begin()) --m;
    while (cursor < p + bytes) {
      if (m == mappings.end() || m->first > cursor || m->first + m->second.size <= cursor)
        return "illegal address " + hex(cursor) + ": not mapped";
      if ((m->second.access >> device & 1) == 0) {
        const int owner = handles.at(m->second.handle).device;
        return "illegal address " + hex(cursor) + ": device " + std::to_string(device) +
               " has no access to these pages of device " + std::to_string(owner) +
               "'s memory (grant it with set_access for the device; vmm_page_pool: peer_access)";
      }
      cursor = m->first + m->second.size;
      ++m;
    }
    return {};
  }
  // The device whose memory holds `p`, or -1 for host memory (REQUIRES: mutex held).
  int owner_of(std::uintptr_t p) const {
    auto a = device_allocations.upper_bound(at(p));
    if (a != device_allocations.begin()) {
      --a;
      const auto start = reinterpret_cast<std::uintptr_t>(a->first);
      if (p >= start && p < start + a->second.size) return a->second.device;
    }
    auto m = mappings.upper_bound(p);
    if (m == mappings.begin()) return -1;
    --m;
    if (p >= m->first + m->second.size) return -1;
    return handles.at(m->second.handle).device;
  }
  static std::string hex(std::uintptr_t p) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%#zx", static_cast<std::size_t>(p));
    return buf;
  }

  void punch(std::size_t file_offset, std::size_t size) {
    // Gives the host memory back; the frames read as zeros afterwards.
    ::fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                static_cast<off_t>(file_offset), static_cast<off_t>(size));
  }

  // A handle released and no longer mapped: its frames go back, its own memfd is closed
  // (the memory lives on while another process maps or holds it), its record goes.
  void drop_handle(std::map<std::uint64_t, handle_record>::iterator it) {
    free_frames(it->second.device, it->second.extents);
    if (it->second.own_fd >= 0) ::close(it->second.own_fd);
    handles.erase(it);
  }

  void free_frames(int device, const std::vector<extent>& extents) {
    for (const auto& e : extents) {
      punch(e.offset, e.size);
      frames[static_cast<std::size_t>(device)].free(e.offset - device_base(device), e.size);
    }
  }
  // Frames never written (taken, then given back on a failure): nothing to punch.
  void return_frames(int device, const std::vector<extent>& extents) {
    for (const auto& e : extents)
      frames[static_cast<std::size_t>(device)].free(e.offset - device_base(device), e.size);
  }
};

namespace sim_detail {

void charge_ns(sim_platform::state& s, platform_op op, std::uint64_t ns);
void charge(sim_platform::state& s, platform_op op, std::size_t bytes);
// Unmap and set access cost grows with the mappings (handles) they cover: the size-based
// figure for one, plus the per-mapping cost for each further one.
void charge_mappings(sim_platform::state& s, platform_op op, std::uintptr_t va, std::size_t size);
// The injected failure for this call of `op`, if a fault rule fires.
std::optional<status> check_fault(sim_platform::state& s, platform_op op);

inline bool known_stream(const sim_platform::state& s, stream_handle stream) {
  return stream.value == 0 || s.streams.contains(stream.value);
}

}  // namespace sim_detail

// Every public call starts with GPUMEM_SIM_ENTER: count it, and fail it if an injected
// fault fires (such a call never reaches the modelled driver, so it is charged nothing).
// Then GPUMEM_SIM_CHARGE charges its modelled latency for the bytes it concerns: at once
// where the caller passes the size, and once it is looked up for the frees (0 bytes when
// the lookup fails).
#define GPUMEM_SIM_ENTER(op) \
  calls_.add(op);            \
  if (auto injected = check_fault(*state_, op)) return *injected
#define GPUMEM_SIM_CHARGE(op, bytes) charge(*state_, op, bytes)

}  // namespace gpumem
