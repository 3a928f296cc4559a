// sim device: see sim_platform.hpp for the model and its invariants.
#include "gpumem/platform/sim_platform.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
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

namespace {

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

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }
bool is_pow2(std::size_t n) { return n != 0 && (n & (n - 1)) == 0; }
void* at(std::uintptr_t va) { return reinterpret_cast<void*>(va); }

status fail(platform_op op, failure_kind kind, std::string message) {
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
status host_vm_failure(platform_op op, const char* what, int err) {
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

std::size_t total_size(const std::vector<extent>& extents) {
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
  std::size_t size;             // == sum of the extents
  std::size_t mappings = 0;
  bool released = false;
};

struct mapping_record {
  std::size_t size;
  std::uint64_t handle;
  bool accessible = false;
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
bool reserve_again(std::uintptr_t va, std::size_t len) {
  return ::mmap(at(va), len, PROT_NONE, MAP_FIXED | reservation_flags, -1, 0) != MAP_FAILED;
}

// Whether every page of [va, va+len) is mapped (by anything: a reservation counts).
bool fully_mapped(std::uintptr_t va, std::size_t len) {
  return ::msync(at(va), len, MS_ASYNC) == 0;
}

}  // namespace

std::string sim_live_objects::describe() const {
  std::ostringstream out;
  out << ranges << " ranges, " << handles << " physical handles, " << mappings << " mappings, "
      << device_allocations << " device allocations, " << host_allocations
      << " pinned host allocations, " << streams << " streams, " << events << " events";
  return out.str();
}

struct sim_platform::state {
  sim_options options;
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
    const auto past_end = static_cast<off_t>(options.capacity * options.device_count + host_page);
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

  std::size_t device_base(int device) const {
    return static_cast<std::size_t>(device) * options.capacity;
  }
  bool valid_device(int device) const { return device >= 0 && device < options.device_count; }

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

  void punch(std::size_t file_offset, std::size_t size) {
    // Gives the host memory back; the frames read as zeros afterwards.
    ::fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                static_cast<off_t>(file_offset), static_cast<off_t>(size));
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

sim_platform::sim_platform(sim_options options) : state_(std::make_unique<state>()) {
  auto& s = *state_;
  if (options.device_count < 1) options.device_count = 1;
  if (!is_pow2(options.granularity) || options.granularity % host_page != 0)
    options.granularity = std::size_t{2} << 20;
  options.capacity = round_up(options.capacity, options.granularity);
  s.options = options;
  s.rng.seed(options.seed);
  s.memfd = ::memfd_create("gpumem-sim-device", MFD_CLOEXEC);
  if (s.memfd >= 0) {
    // Sparse: no host memory is used until a frame is written.
    if (::ftruncate(s.memfd, static_cast<off_t>(options.capacity * options.device_count)) != 0) {
      ::close(s.memfd);
      s.memfd = -1;
    }
  }
  for (int d = 0; d < options.device_count; ++d) s.frames.emplace_back(options.capacity);
  s.make_spare_mapping();
}

sim_platform::~sim_platform() {
  auto& s = *state_;
  // Tolerate teardown with objects alive: give the host everything back. Unmapping whole
  // ranges (reservations last) needs no mapping split; a failure here has no remedy and
  // only leaks address space, so results are deliberately not acted on.
  for (auto& [va, m] : s.mappings) (void)::munmap(at(va), m.size);
  for (auto& [base, size] : s.ranges) (void)::munmap(at(base), size);
  for (auto& [p, a] : s.device_allocations) (void)::munmap(p, a.size);
  for (auto& [p, size] : s.host_allocations) (void)::munmap(p, size);
  if (s.spare_mapping != nullptr) (void)::munmap(s.spare_mapping, host_page);
  if (s.memfd >= 0) ::close(s.memfd);
}

const sim_options& sim_platform::options() const noexcept { return state_->options; }

// Every public call starts with GPUMEM_SIM_ENTER: count it, and fail it if an injected
// fault fires (such a call never reaches the modelled driver, so it is charged nothing).
// Then GPUMEM_SIM_CHARGE charges its modelled latency for the bytes it concerns: at once
// where the caller passes the size, and once it is looked up for the frees (0 bytes when
// the lookup fails).
#define GPUMEM_SIM_ENTER(op) \
  calls_.add(op);            \
  if (auto injected = check_fault(*state_, op)) return *injected
#define GPUMEM_SIM_CHARGE(op, bytes) charge(*state_, op, bytes)

namespace {

void charge_ns(sim_platform::state& s, platform_op op, std::uint64_t ns) {
  if (s.options.latency == sim_latency::off) return;
  s.modelled[static_cast<std::size_t>(op)].fetch_add(ns, std::memory_order_relaxed);
  if (s.options.latency == sim_latency::spin) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    while (std::chrono::steady_clock::now() < until) {
    }
  }
}

void charge(sim_platform::state& s, platform_op op, std::size_t bytes) {
  if (s.options.latency == sim_latency::off) return;
  charge_ns(s, op, modelled_latency_ns(op, bytes));
}

// Unmap and set access cost grows with the mappings (handles) they cover: the size-based
// figure for one, plus the per-mapping cost for each further one.
void charge_mappings(sim_platform::state& s, platform_op op, std::uintptr_t va, std::size_t size) {
  if (s.options.latency == sim_latency::off) return;
  std::size_t covered = 0;
  {
    std::lock_guard lock(s.mutex);
    auto it = s.mappings.upper_bound(va);
    if (it != s.mappings.begin()) --it;
    for (; it != s.mappings.end() && it->first < va + size; ++it)
      if (it->first + it->second.size > va) ++covered;
  }
  const std::size_t extra = covered > 1 ? covered - 1 : 0;
  charge_ns(s, op, modelled_latency_ns(op, size) + extra * modelled_per_mapping_ns(op));
}

std::optional<status> check_fault(sim_platform::state& s, platform_op op) {
  std::lock_guard lock(s.mutex);
  auto& f = s.faults[static_cast<std::size_t>(op)];
  if (!f.active) return std::nullopt;
  const std::uint64_t n = ++f.calls_since_set;
  bool fire = false;
  if (f.fault.nth != 0) fire = f.fault.every_after ? n >= f.fault.nth : n == f.fault.nth;
  if (!fire && f.fault.probability > 0.0) {
    fire = std::uniform_real_distribution<double>(0.0, 1.0)(s.rng) < f.fault.probability;
  }
  if (!fire) return std::nullopt;
  return fail(op, f.fault.kind, "injected by sim fault rule (call " + std::to_string(n) + ")");
}

}  // namespace

void sim_platform::inject_fault(platform_op op, sim_fault fault) {
  std::lock_guard lock(state_->mutex);
  state_->faults[static_cast<std::size_t>(op)] = fault_state{fault, 0, true};
}

void sim_platform::clear_faults() {
  std::lock_guard lock(state_->mutex);
  for (auto& f : state_->faults) f = fault_state{};
}

void sim_platform::hold_events(bool hold) {
  std::lock_guard lock(state_->mutex);
  state_->holding_events = hold;
}

void sim_platform::complete_events() {
  std::lock_guard lock(state_->mutex);
  for (auto& [id, e] : state_->events) e.complete = true;
}

sim_live_objects sim_platform::live_objects() const {
  std::lock_guard lock(state_->mutex);
  const auto& s = *state_;
  return sim_live_objects{s.ranges.size(),          s.handles.size(),
                          s.mappings.size(),        s.device_allocations.size(),
                          s.host_allocations.size(), s.streams.size(),
                          s.events.size()};
}

std::size_t sim_platform::used_bytes(int device) const {
  std::lock_guard lock(state_->mutex);
  if (!state_->valid_device(device)) return 0;
  return state_->frames[static_cast<std::size_t>(device)].used();
}

std::uint64_t sim_platform::modelled_ns() const noexcept {
  std::uint64_t total = 0;
  for (auto& m : state_->modelled) total += m.load(std::memory_order_relaxed);
  return total;
}

std::uint64_t sim_platform::modelled_ns(platform_op op) const noexcept {
  return state_->modelled[static_cast<std::size_t>(op)].load(std::memory_order_relaxed);
}

std::string sim_platform::validate() const {
  std::lock_guard lock(state_->mutex);
  const auto& s = *state_;
  const std::size_t g = s.options.granularity;
  std::vector<std::size_t> owned(s.frames.size(), 0);
  auto check = [&](int device, const std::vector<extent>& extents, std::size_t size,
                   std::size_t unit) -> const char* {
    if (extents.empty() || total_size(extents) != size) return "extents do not add up to its size";
    for (const auto& e : extents) {
      if (e.size == 0 || e.size % unit != 0 || e.offset % host_page != 0)
        return "an extent is not a whole number of units";
      if (e.offset < s.device_base(device) ||
          e.offset + e.size > s.device_base(device) + s.options.capacity)
        return "an extent lies outside its device's frames";
    }
    owned[static_cast<std::size_t>(device)] += size;
    return nullptr;
  };
  for (auto& [id, h] : s.handles)
    if (const char* why = check(h.device, h.extents, h.size, g))
      return "physical handle " + std::to_string(id) + ": " + why;
  for (auto& [p, a] : s.device_allocations)
    if (const char* why = check(a.device, a.extents, a.size, host_page))
      return std::string("device allocation: ") + why;
  for (std::size_t d = 0; d < s.frames.size(); ++d) {
    if (owned[d] != s.frames[d].used())
      return "device " + std::to_string(d) + ": frames used " +
             std::to_string(s.frames[d].used()) + " != owned " + std::to_string(owned[d]);
    if (s.frames[d].free_bytes_listed() + s.frames[d].used() != s.frames[d].size())
      return "device " + std::to_string(d) + ": free list does not add up";
  }
  // No frame has two owners, nor is owned and free. Near the host's mapping limit the
  // heap may be unable to grow for this list: then this one check is skipped.
  try {
    std::vector<extent> runs;
    for (std::size_t d = 0; d < s.frames.size(); ++d)
      for (auto& [offset, size] : s.frames[d].free_runs())
        runs.push_back({s.device_base(static_cast<int>(d)) + offset, size});
    for (auto& [id, h] : s.handles) runs.insert(runs.end(), h.extents.begin(), h.extents.end());
    for (auto& [p, a] : s.device_allocations)
      runs.insert(runs.end(), a.extents.begin(), a.extents.end());
    std::sort(runs.begin(), runs.end(),
              [](const extent& a, const extent& b) { return a.offset < b.offset; });
    for (std::size_t i = 1; i < runs.size(); ++i)
      if (runs[i - 1].offset + runs[i - 1].size > runs[i].offset)
        return "frames at memfd offset " + std::to_string(runs[i].offset) +
               " are owned twice (or owned and free)";
  } catch (const std::bad_alloc&) {
  }
  std::map<std::uint64_t, std::size_t> mapped_count;
  std::uintptr_t previous_end = 0;
  for (auto& [va, m] : s.mappings) {
    if (va < previous_end) return "overlapping mappings";
    previous_end = va + m.size;
    if (s.range_containing(va, m.size) == s.ranges.end()) return "mapping outside any range";
    auto h = s.handles.find(m.handle);
    if (h == s.handles.end()) return "mapping of a dead handle";
    if (m.size > h->second.size) return "mapping larger than its handle";
    ++mapped_count[m.handle];
  }
  for (auto& [id, h] : s.handles) {
    if (h.mappings != mapped_count[id]) return "handle mapping count wrong";
    if (h.released && h.mappings == 0) return "released, unmapped handle still alive";
  }
  return {};
}

// --- devices ---------------------------------------------------------------------------

result<int> sim_platform::device_count() {
  GPUMEM_SIM_ENTER(platform_op::device_count);
  GPUMEM_SIM_CHARGE(platform_op::device_count, 0);
  return state_->options.device_count;
}

result<device_properties> sim_platform::properties(int device) {
  GPUMEM_SIM_ENTER(platform_op::device_properties);
  GPUMEM_SIM_CHARGE(platform_op::device_properties, 0);
  if (!state_->valid_device(device))
    return fail(platform_op::device_properties, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  device_properties p;
  p.ordinal = device;
  p.name = "gpumem sim device (host memory, H200-shaped)";
  // Shaped like the H200 the baselines were measured on, so sizing logic behaves alike.
  p.compute_capability_major = 9;
  p.compute_capability_minor = 0;
  p.multiprocessor_count = 132;
  p.total_memory = state_->options.capacity;
  p.memory_bus_width_bits = 5120;
  p.memory_clock_khz = 3201000;
  p.l2_cache_bytes = 60 << 20;
  p.shared_memory_per_multiprocessor = 228 << 10;
  p.shared_memory_per_block = 227 << 10;
  p.registers_per_multiprocessor = 65536;
  p.vmm_supported = true;
  p.memory_pools_supported = false;  // sim has no cudaMallocAsync pool
  p.simulated = true;
  return p;
}

result<allocation_granularity> sim_platform::granularity(int device) {
  GPUMEM_SIM_ENTER(platform_op::granularity);
  GPUMEM_SIM_CHARGE(platform_op::granularity, 0);
  if (!state_->valid_device(device))
    return fail(platform_op::granularity, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  return allocation_granularity{state_->options.granularity, state_->options.granularity};
}

result<memory_info> sim_platform::mem_info(int device) {
  GPUMEM_SIM_ENTER(platform_op::mem_info);
  GPUMEM_SIM_CHARGE(platform_op::mem_info, 0);
  std::lock_guard lock(state_->mutex);
  if (!state_->valid_device(device))
    return fail(platform_op::mem_info, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  const auto& f = state_->frames[static_cast<std::size_t>(device)];
  return memory_info{f.size() - f.used(), f.size()};
}

// --- virtual memory management -----------------------------------------------------------

result<std::uintptr_t> sim_platform::reserve_range(std::size_t size, std::size_t alignment) {
  GPUMEM_SIM_ENTER(platform_op::reserve_range);
  GPUMEM_SIM_CHARGE(platform_op::reserve_range, size);
  auto& s = *state_;
  const std::size_t g = s.options.granularity;
  if (alignment == 0) alignment = g;
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
  if (size == 0 || size % s.options.granularity != 0)
    return fail(platform_op::create_physical, failure_kind::invalid_value,
                "size " + std::to_string(size) + " is not a non-zero multiple of the granularity");
  if (s.memfd < 0)
    return fail(platform_op::create_physical, failure_kind::driver_error,
                "sim device has no backing memfd");
  std::lock_guard lock(s.mutex);
  // Like the GPU's pages, a handle's frames need not be contiguous: whole granules from
  // wherever they are free.
  auto extents = s.take_frames(device, size, s.options.granularity);
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
    if (it->second.mappings == 0) {
      s.free_frames(it->second.device, it->second.extents);
      s.handles.erase(it);
    }
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
  const std::size_t g = s.options.granularity;
  std::lock_guard lock(s.mutex);
  auto h = s.handles.find(handle.value);
  if (h == s.handles.end() || h->second.released)
    return fail(platform_op::map, failure_kind::invalid_value, "unknown physical handle");
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
  if (const int err = s.map_extents(va, size, h->second.extents, PROT_NONE, restored)) {
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
    if (--h->second.mappings == 0 && h->second.released) {
      s.free_frames(h->second.device, h->second.extents);
      s.handles.erase(h);
    }
    m = s.mappings.erase(m);
  }
  return status::success();
}

status sim_platform::set_access(int device, std::uintptr_t va, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::set_access);
  charge_mappings(*state_, platform_op::set_access, va, size);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::set_access, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  std::lock_guard lock(s.mutex);
  // Every byte of the range must be mapped.
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
    cursor = it->first + it->second.size;
    ++it;
  }
  if (::mprotect(at(va), size, PROT_READ | PROT_WRITE) != 0) {
    const int err = errno;
    // mprotect may have changed part of the range before failing: take access back from
    // the mappings that had none (best effort: this too may need a split).
    for (auto m = first; m != it; ++m) {
      if (m->second.accessible) continue;
      const std::uintptr_t lo = std::max(va, m->first);
      const std::uintptr_t hi = std::min(va + size, m->first + m->second.size);
      (void)::mprotect(at(lo), hi - lo, PROT_NONE);
    }
    return host_vm_failure(platform_op::set_access, "mprotect", err);
  }
  for (auto m = first; m != it; ++m) m->second.accessible = true;
  return status::success();
}

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

// --- streams and events --------------------------------------------------------------------
// Sim executes work at once, in call order, so streams only need identity; events
// complete at once unless a test holds them.

result<stream_handle> sim_platform::stream_create(int device) {
  GPUMEM_SIM_ENTER(platform_op::stream_create);
  GPUMEM_SIM_CHARGE(platform_op::stream_create, 0);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::stream_create, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  std::lock_guard lock(s.mutex);
  // Odd ids, so a stream handle never equals 0 (the default stream) nor an event id.
  const std::uintptr_t id = (s.next_object_id++ << 1) | 1;
  s.streams.emplace(id, device);
  return stream_handle{id};
}

namespace {
bool known_stream(const sim_platform::state& s, stream_handle stream) {
  return stream.value == 0 || s.streams.contains(stream.value);
}
}  // namespace

status sim_platform::stream_destroy(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_destroy);
  GPUMEM_SIM_CHARGE(platform_op::stream_destroy, 0);
  std::lock_guard lock(state_->mutex);
  if (stream.value == 0 || state_->streams.erase(stream.value) == 0)
    return fail(platform_op::stream_destroy, failure_kind::invalid_value, "unknown stream");
  return status::success();
}

result<int> sim_platform::stream_device(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_device);
  GPUMEM_SIM_CHARGE(platform_op::stream_device, 0);
  std::lock_guard lock(state_->mutex);
  if (stream.value == 0) return 0;
  auto it = state_->streams.find(stream.value);
  if (it == state_->streams.end())
    return fail(platform_op::stream_device, failure_kind::invalid_value, "unknown stream");
  return it->second;
}

status sim_platform::stream_synchronize(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_synchronize);
  GPUMEM_SIM_CHARGE(platform_op::stream_synchronize, 0);
  std::lock_guard lock(state_->mutex);
  if (!known_stream(*state_, stream))
    return fail(platform_op::stream_synchronize, failure_kind::invalid_value, "unknown stream");
  return status::success();
}

result<event_handle> sim_platform::event_create(int device) {
  GPUMEM_SIM_ENTER(platform_op::event_create);
  GPUMEM_SIM_CHARGE(platform_op::event_create, 0);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::event_create, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  std::lock_guard lock(s.mutex);
  const std::uintptr_t id = s.next_object_id++ << 1;
  s.events.emplace(id, event_record_state{device, true});
  return event_handle{id};
}

status sim_platform::event_destroy(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_destroy);
  GPUMEM_SIM_CHARGE(platform_op::event_destroy, 0);
  std::lock_guard lock(state_->mutex);
  if (state_->events.erase(event.value) == 0)
    return fail(platform_op::event_destroy, failure_kind::invalid_value, "unknown event");
  return status::success();
}

status sim_platform::event_record(event_handle event, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::event_record);
  GPUMEM_SIM_CHARGE(platform_op::event_record, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_record, failure_kind::invalid_value, "unknown event");
  if (!known_stream(*state_, stream))
    return fail(platform_op::event_record, failure_kind::invalid_value, "unknown stream");
  it->second.complete = !state_->holding_events;
  return status::success();
}

result<bool> sim_platform::event_query(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_query);
  GPUMEM_SIM_CHARGE(platform_op::event_query, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_query, failure_kind::invalid_value, "unknown event");
  return it->second.complete;
}

status sim_platform::event_synchronize(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_synchronize);
  GPUMEM_SIM_CHARGE(platform_op::event_synchronize, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_synchronize, failure_kind::invalid_value, "unknown event");
  // A held event would block forever: report it rather than hang the test.
  if (!it->second.complete)
    return fail(platform_op::event_synchronize, failure_kind::not_ready,
                "event is held incomplete by the test (sim_platform::hold_events)");
  return status::success();
}

status sim_platform::stream_wait_event(stream_handle stream, event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::stream_wait_event);
  GPUMEM_SIM_CHARGE(platform_op::stream_wait_event, 0);
  std::lock_guard lock(state_->mutex);
  if (!known_stream(*state_, stream))
    return fail(platform_op::stream_wait_event, failure_kind::invalid_value, "unknown stream");
  if (!state_->events.contains(event.value))
    return fail(platform_op::stream_wait_event, failure_kind::invalid_value, "unknown event");
  return status::success();
}

status sim_platform::memcpy_async(void* dst, const void* src, std::size_t bytes,
                                  stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::memcpy_async);
  GPUMEM_SIM_CHARGE(platform_op::memcpy_async, bytes);
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::memcpy_async, failure_kind::invalid_value, "unknown stream");
  }
  if (bytes != 0 && (dst == nullptr || src == nullptr))
    return fail(platform_op::memcpy_async, failure_kind::invalid_value, "null pointer");
  std::memmove(dst, src, bytes);  // unmapped memory faults here, like an illegal address
  return status::success();
}

status sim_platform::memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::memset_async);
  GPUMEM_SIM_CHARGE(platform_op::memset_async, bytes);
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::memset_async, failure_kind::invalid_value, "unknown stream");
  }
  if (bytes != 0 && dst == nullptr)
    return fail(platform_op::memset_async, failure_kind::invalid_value, "null pointer");
  std::memset(dst, value, bytes);
  return status::success();
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
