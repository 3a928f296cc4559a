// sim device: see sim_platform.hpp for the model and its invariants; the shared internals
// are in sim/sim_state.hpp, the calls by concept in sim_*.cpp.
#include "platform/sim/sim_state.hpp"

#include <cstdlib>

#include "gpumem/errors.hpp"

namespace gpumem {

std::string sim_live_objects::describe() const {
  std::ostringstream out;
  out << ranges << " ranges, " << handles << " physical handles, " << mappings << " mappings, "
      << device_allocations << " device allocations, " << host_allocations
      << " pinned host allocations, " << streams << " streams, " << events << " events";
  return out.str();
}

std::size_t sim_options::capacity_of(int device) const noexcept {
  const auto d = static_cast<std::size_t>(device);
  return device >= 0 && d < capacities.size() && capacities[d] != 0 ? capacities[d] : capacity;
}

std::size_t sim_options::granularity_of(int device) const noexcept {
  const auto d = static_cast<std::size_t>(device);
  return device >= 0 && d < granularities.size() && granularities[d] != 0 ? granularities[d]
                                                                          : granularity;
}

sim_options sim_options_from_environment() {
  sim_options o;
  const char* env = std::getenv("GPUMEM_SIM_DEVICES");
  if (env == nullptr || *env == '\0') return o;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (*end != '\0' || n < 1 || n > sim_max_devices)
    throw invalid_argument("GPUMEM_SIM_DEVICES must be a number of devices from 1 to " +
                           std::to_string(sim_max_devices) + ", not '" + env + "'");
  o.device_count = static_cast<int>(n);
  return o;
}

sim_platform::sim_platform(sim_options options) : state_(std::make_unique<state>()) {
  auto& s = *state_;
  options.device_count = std::clamp(options.device_count, 1, sim_max_devices);
  const auto usable = [](std::size_t g) { return is_pow2(g) && g % host_page == 0; };
  if (!usable(options.granularity)) options.granularity = std::size_t{2} << 20;
  for (auto& g : options.granularities)
    if (g != 0 && !usable(g)) g = options.granularity;
  const auto n = static_cast<std::size_t>(options.device_count);
  for (int d = 0; d < options.device_count; ++d) {
    const std::size_t g = options.granularity_of(d);
    s.granularities.push_back(g);
    s.bases.push_back(s.total_capacity);
    s.total_capacity += round_up(options.capacity_of(d), g);
    s.min_granularity = d == 0 ? g : std::min(s.min_granularity, g);
    s.max_granularity = std::max(s.max_granularity, g);
  }
  s.peer_path.assign(n * n, 1);
  s.peer_enabled.assign(n * n, 0);
  for (auto [a, b] : options.no_peer)
    if (a >= 0 && b >= 0 && a < options.device_count && b < options.device_count && a != b) {
      s.peer_path[static_cast<std::size_t>(a) * n + static_cast<std::size_t>(b)] = 0;
      s.peer_path[static_cast<std::size_t>(b) * n + static_cast<std::size_t>(a)] = 0;
    }
  options.capacity = round_up(options.capacity, options.granularity);
  s.options = options;
  s.rng.seed(options.seed);
  s.memfd = ::memfd_create("gpumem-sim-device", MFD_CLOEXEC);
  if (s.memfd >= 0) {
    // Sparse: no host memory is used until a frame is written.
    if (::ftruncate(s.memfd, static_cast<off_t>(s.total_capacity)) != 0) {
      ::close(s.memfd);
      s.memfd = -1;
    }
  }
  for (int d = 0; d < options.device_count; ++d)
    s.frames.emplace_back(round_up(options.capacity_of(d), s.granularity(d)));
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
  for (auto& [id, h] : s.handles)
    if (h.own_fd >= 0) ::close(h.own_fd);
  if (s.memfd >= 0) ::close(s.memfd);
}

const sim_options& sim_platform::options() const noexcept { return state_->options; }

namespace sim_detail {

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

}  // namespace sim_detail

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
  auto check = [&](int device, const std::vector<extent>& extents, std::size_t size,
                   std::size_t unit) -> const char* {
    if (extents.empty() || total_size(extents) != size) return "extents do not add up to its size";
    for (const auto& e : extents) {
      if (e.size == 0 || e.size % unit != 0 || e.offset % host_page != 0)
        return "an extent is not a whole number of units";
      if (e.offset < s.device_base(device) ||
          e.offset + e.size > s.device_base(device) + s.frames[static_cast<std::size_t>(device)].size())
        return "an extent lies outside its device's frames";
    }
    owned[static_cast<std::size_t>(device)] += size;
    return nullptr;
  };
  for (auto& [id, h] : s.handles)
    if (const char* why = h.imported ? (h.own_fd < 0 ? "imported without its memfd" : nullptr)
                                     : check(h.device, h.extents, h.size, s.granularity(h.device)))
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
    for (int d = 0; d < s.options.device_count; ++d)
      if ((m.access >> d & 1) != 0 && !s.reaches(d, h->second.device))
        return "device " + std::to_string(d) + " has access to a mapping of device " +
               std::to_string(h->second.device) + "'s memory without a peer path";
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
  p.total_memory = state_->frames[static_cast<std::size_t>(device)].size();
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
  const std::size_t g = state_->granularity(device);
  return allocation_granularity{g, g};
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

// --- several devices -------------------------------------------------------------------

result<bool> sim_platform::can_access_peer(int device, int peer) {
  GPUMEM_SIM_ENTER(platform_op::can_access_peer);
  GPUMEM_SIM_CHARGE(platform_op::can_access_peer, 0);
  if (!state_->valid_device(device) || !state_->valid_device(peer))
    return fail(platform_op::can_access_peer, failure_kind::invalid_value,
                "no sim device " + std::to_string(state_->valid_device(device) ? peer : device));
  return state_->reaches(device, peer);
}

status sim_platform::enable_peer_access(int device, int peer) {
  GPUMEM_SIM_ENTER(platform_op::enable_peer_access);
  GPUMEM_SIM_CHARGE(platform_op::enable_peer_access, 0);
  auto& s = *state_;
  if (!s.valid_device(device) || !s.valid_device(peer))
    return fail(platform_op::enable_peer_access, failure_kind::invalid_value,
                "no sim device " + std::to_string(s.valid_device(device) ? peer : device));
  if (device == peer)
    return fail(platform_op::enable_peer_access, failure_kind::invalid_value,
                "a device is not its own peer (device " + std::to_string(device) + ")");
  if (!s.reaches(device, peer))
    return fail(platform_op::enable_peer_access, failure_kind::not_supported,
                "sim device " + std::to_string(device) + " has no peer path to device " +
                    std::to_string(peer) + " (sim_options::no_peer)");
  std::lock_guard lock(s.mutex);
  s.peer_enabled[s.pair(device, peer)] = 1;
  return status::success();
}

}  // namespace gpumem
