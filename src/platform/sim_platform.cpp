// sim device: see sim_platform.hpp for the model and its invariants.
#include "gpumem/platform/sim_platform.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
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

// Best-fit allocator of host-page frames of one device's slice of the memfd.
// Invariant: free runs are disjoint, non-adjacent (merged) and inside [0, size).
class frame_allocator {
 public:
  explicit frame_allocator(std::size_t size) : size_(size) { insert(0, size); }

  std::optional<std::size_t> allocate(std::size_t bytes) {
    auto it = by_size_.lower_bound({bytes, 0});
    if (it == by_size_.end()) return std::nullopt;
    auto [run_size, offset] = *it;
    erase(offset, run_size);
    if (run_size > bytes) insert(offset + bytes, run_size - bytes);
    used_ += bytes;
    return offset;
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
  std::size_t file_offset;  // absolute offset in the memfd
  std::size_t size;
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
  std::size_t file_offset;
  std::size_t size;  // rounded to host pages
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

  void punch(std::size_t file_offset, std::size_t size) {
    // Gives the host memory back; the frames read as zeros afterwards.
    ::fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                static_cast<off_t>(file_offset), static_cast<off_t>(size));
  }

  void free_frames(int device, std::size_t file_offset, std::size_t size) {
    punch(file_offset, size);
    frames[static_cast<std::size_t>(device)].free(file_offset - device_base(device), size);
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
}

sim_platform::~sim_platform() {
  auto& s = *state_;
  // Tolerate teardown with objects alive: give the host everything back.
  for (auto& [va, m] : s.mappings) ::munmap(reinterpret_cast<void*>(va), m.size);
  for (auto& [base, size] : s.ranges) ::munmap(reinterpret_cast<void*>(base), size);
  for (auto& [p, a] : s.device_allocations) ::munmap(p, a.size);
  for (auto& [p, size] : s.host_allocations) ::munmap(p, size);
  if (s.memfd >= 0) ::close(s.memfd);
}

const sim_options& sim_platform::options() const noexcept { return state_->options; }

// Every public call starts here: count it, charge its modelled latency, and apply any
// injected fault. Returns the injected failure, if one fires.
#define GPUMEM_SIM_ENTER(op, bytes)                                     \
  calls_.add(op);                                                       \
  charge(*state_, op, bytes);                                           \
  if (auto injected = check_fault(*state_, op)) return *injected

namespace {

void charge(sim_platform::state& s, platform_op op, std::size_t bytes) {
  if (s.options.latency == sim_latency::off) return;
  const std::uint64_t ns = modelled_latency_ns(op, bytes);
  s.modelled[static_cast<std::size_t>(op)].fetch_add(ns, std::memory_order_relaxed);
  if (s.options.latency == sim_latency::spin) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
    while (std::chrono::steady_clock::now() < until) {
    }
  }
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
  std::vector<std::size_t> owned(s.frames.size(), 0);
  for (auto& [id, h] : s.handles) owned[static_cast<std::size_t>(h.device)] += h.size;
  for (auto& [p, a] : s.device_allocations) owned[static_cast<std::size_t>(a.device)] += a.size;
  for (std::size_t d = 0; d < s.frames.size(); ++d) {
    if (owned[d] != s.frames[d].used())
      return "device " + std::to_string(d) + ": frames used " +
             std::to_string(s.frames[d].used()) + " != owned " + std::to_string(owned[d]);
    if (s.frames[d].free_bytes_listed() + s.frames[d].used() != s.frames[d].size())
      return "device " + std::to_string(d) + ": free list does not add up";
  }
  std::map<std::uint64_t, std::size_t> mapped_count;
  std::uintptr_t previous_end = 0;
  for (auto& [va, m] : s.mappings) {
    if (va < previous_end) return "overlapping mappings";
    previous_end = va + m.size;
    if (s.range_containing(va, m.size) == s.ranges.end()) return "mapping outside any range";
    if (!s.handles.contains(m.handle)) return "mapping of a dead handle";
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
  GPUMEM_SIM_ENTER(platform_op::device_count, 0);
  return state_->options.device_count;
}

result<device_properties> sim_platform::properties(int device) {
  GPUMEM_SIM_ENTER(platform_op::device_properties, 0);
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
  GPUMEM_SIM_ENTER(platform_op::granularity, 0);
  if (!state_->valid_device(device))
    return fail(platform_op::granularity, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  return allocation_granularity{state_->options.granularity, state_->options.granularity};
}

result<memory_info> sim_platform::mem_info(int device) {
  GPUMEM_SIM_ENTER(platform_op::mem_info, 0);
  std::lock_guard lock(state_->mutex);
  if (!state_->valid_device(device))
    return fail(platform_op::mem_info, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  const auto& f = state_->frames[static_cast<std::size_t>(device)];
  return memory_info{f.size() - f.used(), f.size()};
}

// --- virtual memory management -----------------------------------------------------------

result<std::uintptr_t> sim_platform::reserve_range(std::size_t size, std::size_t alignment) {
  GPUMEM_SIM_ENTER(platform_op::reserve_range, size);
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
  void* raw = ::mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED)
    return fail(platform_op::reserve_range, failure_kind::out_of_memory,
                std::string("host mmap of the reservation failed: ") + std::strerror(errno));
  const auto start = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t base = round_up(start, alignment);
  if (base > start) ::munmap(raw, base - start);
  if (start + span > base + size) ::munmap(reinterpret_cast<void*>(base + size), start + span - base - size);
  s.ranges.emplace(base, size);
  s.reserved_va += size;
  return base;
}

status sim_platform::free_range(std::uintptr_t base, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::free_range, size);
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
  ::munmap(reinterpret_cast<void*>(base), size);
  s.reserved_va -= size;
  s.ranges.erase(it);
  return status::success();
}

result<physical_handle> sim_platform::create_physical(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::create_physical, size);
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
  auto offset = s.frames[static_cast<std::size_t>(device)].allocate(size);
  if (!offset)
    return fail(platform_op::create_physical, failure_kind::out_of_memory,
                "sim device " + std::to_string(device) + " has no " + std::to_string(size) +
                    " free bytes in one run");
  const std::uint64_t id = s.next_handle++;
  s.handles.emplace(id, handle_record{device, s.device_base(device) + *offset, size});
  return physical_handle{id};
}

status sim_platform::release_physical(physical_handle handle) {
  GPUMEM_SIM_ENTER(platform_op::release_physical, 0);
  auto& s = *state_;
  std::lock_guard lock(s.mutex);
  auto it = s.handles.find(handle.value);
  if (it == s.handles.end() || it->second.released)
    return fail(platform_op::release_physical, failure_kind::invalid_value,
                "unknown or already released physical handle");
  // As on CUDA: the memory lives on while mappings of it remain.
  it->second.released = true;
  if (it->second.mappings == 0) {
    s.free_frames(it->second.device, it->second.file_offset, it->second.size);
    s.handles.erase(it);
  }
  return status::success();
}

status sim_platform::map(std::uintptr_t va, std::size_t size, physical_handle handle,
                         std::size_t offset) {
  GPUMEM_SIM_ENTER(platform_op::map, size);
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
  void* got = ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE, MAP_FIXED | MAP_SHARED,
                     s.memfd, static_cast<off_t>(h->second.file_offset + offset));
  if (got == MAP_FAILED) {
    const int err = errno;
    // Put the reservation back as it was.
    ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
           MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return fail(platform_op::map, failure_kind::out_of_memory,
                std::string("host mmap failed (") + std::strerror(err) +
                    "); vm.max_map_count may be reached: map larger runs");
  }
  s.mappings.emplace(va, mapping_record{size, handle.value, false});
  ++h->second.mappings;
  return status::success();
}

status sim_platform::unmap(std::uintptr_t va, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::unmap, size);
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
  ::mmap(reinterpret_cast<void*>(va), size, PROT_NONE,
         MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  for (auto m = first; m != it;) {
    auto h = s.handles.find(m->second.handle);
    if (--h->second.mappings == 0 && h->second.released) {
      s.free_frames(h->second.device, h->second.file_offset, h->second.size);
      s.handles.erase(h);
    }
    m = s.mappings.erase(m);
  }
  return status::success();
}

status sim_platform::set_access(int device, std::uintptr_t va, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::set_access, size);
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
  if (::mprotect(reinterpret_cast<void*>(va), size, PROT_READ | PROT_WRITE) != 0)
    return fail(platform_op::set_access, failure_kind::out_of_memory,
                std::string("host mprotect failed: ") + std::strerror(errno));
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
  auto offset = s.frames[static_cast<std::size_t>(device)].allocate(bytes);
  if (!offset)
    return fail(op, failure_kind::out_of_memory,
                "sim device " + std::to_string(device) + " out of memory");
  const std::size_t file_offset = s.device_base(device) + *offset;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.memfd,
                   static_cast<off_t>(file_offset));
  if (p == MAP_FAILED) {
    s.frames[static_cast<std::size_t>(device)].free(*offset, bytes);
    return fail(op, failure_kind::out_of_memory,
                std::string("host mmap failed: ") + std::strerror(errno));
  }
  s.device_allocations.emplace(p, allocation_record{device, file_offset, bytes});
  return p;
}

status sim_release(sim_platform::state& s, platform_op op, int device, void* ptr) {
  if (ptr == nullptr) return status::success();  // as cudaFree(nullptr)
  std::lock_guard lock(s.mutex);
  auto it = s.device_allocations.find(ptr);
  if (it == s.device_allocations.end() || it->second.device != device)
    return fail(op, failure_kind::invalid_value, "not a device allocation of this device");
  ::munmap(ptr, it->second.size);
  s.free_frames(device, it->second.file_offset, it->second.size);
  s.device_allocations.erase(it);
  return status::success();
}

}  // namespace

result<void*> sim_platform::runtime_malloc(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::runtime_malloc, size);
  return sim_allocate(*state_, platform_op::runtime_malloc, device, size);
}

status sim_platform::runtime_free(int device, void* ptr) {
  GPUMEM_SIM_ENTER(platform_op::runtime_free, 0);
  return sim_release(*state_, platform_op::runtime_free, device, ptr);
}

result<void*> sim_platform::driver_alloc(int device, std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::driver_alloc, size);
  if (size == 0)
    return fail(platform_op::driver_alloc, failure_kind::invalid_value, "cuMemAlloc of 0 bytes");
  return sim_allocate(*state_, platform_op::driver_alloc, device, size);
}

status sim_platform::driver_free(int device, void* ptr) {
  GPUMEM_SIM_ENTER(platform_op::driver_free, 0);
  return sim_release(*state_, platform_op::driver_free, device, ptr);
}

result<void*> sim_platform::host_alloc_pinned(std::size_t size) {
  GPUMEM_SIM_ENTER(platform_op::host_alloc, size);
  if (size == 0) return static_cast<void*>(nullptr);
  const std::size_t bytes = round_up(size, host_page);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return fail(platform_op::host_alloc, failure_kind::out_of_memory,
                std::string("host mmap failed: ") + std::strerror(errno));
  std::lock_guard lock(state_->mutex);
  state_->host_allocations.emplace(p, bytes);
  return p;
}

status sim_platform::host_free_pinned(void* ptr) {
  GPUMEM_SIM_ENTER(platform_op::host_free, 0);
  if (ptr == nullptr) return status::success();
  std::lock_guard lock(state_->mutex);
  auto it = state_->host_allocations.find(ptr);
  if (it == state_->host_allocations.end())
    return fail(platform_op::host_free, failure_kind::invalid_value,
                "not a pinned host allocation");
  ::munmap(ptr, it->second);
  state_->host_allocations.erase(it);
  return status::success();
}

// --- streams and events --------------------------------------------------------------------
// Sim executes work at once, in call order, so streams only need identity; events
// complete at once unless a test holds them.

result<stream_handle> sim_platform::stream_create(int device) {
  GPUMEM_SIM_ENTER(platform_op::stream_create, 0);
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
  GPUMEM_SIM_ENTER(platform_op::stream_destroy, 0);
  std::lock_guard lock(state_->mutex);
  if (stream.value == 0 || state_->streams.erase(stream.value) == 0)
    return fail(platform_op::stream_destroy, failure_kind::invalid_value, "unknown stream");
  return status::success();
}

status sim_platform::stream_synchronize(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_synchronize, 0);
  std::lock_guard lock(state_->mutex);
  if (!known_stream(*state_, stream))
    return fail(platform_op::stream_synchronize, failure_kind::invalid_value, "unknown stream");
  return status::success();
}

result<event_handle> sim_platform::event_create(int device) {
  GPUMEM_SIM_ENTER(platform_op::event_create, 0);
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
  GPUMEM_SIM_ENTER(platform_op::event_destroy, 0);
  std::lock_guard lock(state_->mutex);
  if (state_->events.erase(event.value) == 0)
    return fail(platform_op::event_destroy, failure_kind::invalid_value, "unknown event");
  return status::success();
}

status sim_platform::event_record(event_handle event, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::event_record, 0);
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
  GPUMEM_SIM_ENTER(platform_op::event_query, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_query, failure_kind::invalid_value, "unknown event");
  return it->second.complete;
}

status sim_platform::event_synchronize(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_synchronize, 0);
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
  GPUMEM_SIM_ENTER(platform_op::stream_wait_event, 0);
  std::lock_guard lock(state_->mutex);
  if (!known_stream(*state_, stream))
    return fail(platform_op::stream_wait_event, failure_kind::invalid_value, "unknown stream");
  if (!state_->events.contains(event.value))
    return fail(platform_op::stream_wait_event, failure_kind::invalid_value, "unknown event");
  return status::success();
}

status sim_platform::memcpy_async(void* dst, const void* src, std::size_t bytes,
                                  stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::memcpy_async, bytes);
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
  GPUMEM_SIM_ENTER(platform_op::memset_async, bytes);
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
  GPUMEM_SIM_ENTER(platform_op::async_malloc, size);
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::async_malloc, failure_kind::invalid_value, "unknown stream");
  }
  return sim_allocate(*state_, platform_op::async_malloc, device, size);
}

status sim_platform::async_free(void* ptr, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::async_free, 0);
  int device = 0;
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::async_free, failure_kind::invalid_value, "unknown stream");
    auto it = state_->device_allocations.find(ptr);
    if (it != state_->device_allocations.end()) device = it->second.device;
  }
  return sim_release(*state_, platform_op::async_free, device, ptr);
}

}  // namespace gpumem
