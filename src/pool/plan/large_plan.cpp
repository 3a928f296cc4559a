#include "gpumem/pool/plan/large_planner.hpp"

#include <algorithm>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"
#include "pool/plan/large_request_detector.hpp"
#include "pool/plan/plan_region.hpp"
#include "pool/plan/step_plan.hpp"

namespace gpumem {

using detail::step_event;
using detail::step_plan;

namespace {

std::uint64_t key_of(std::size_t bytes, std::uintptr_t stream) {
  return static_cast<std::uint64_t>(bytes) * 0x9e3779b97f4a7c15ull ^ static_cast<std::uint64_t>(stream);
}

std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// Invariants (validate()):
//  - the planned live records are exactly the ranges in `occupied`, inside the region,
//    apart;
//  - a region is held while a plan is active or a planned allocation lives.
struct large_planner::state {
  // A large request's event, for plans: an alloc (serial: its number among large requests)
  // or a free (serial: the alloc's). `after`: the serial of the last alloc at or before it.
  struct recorded {
    bool alloc = true;
    std::uint64_t serial = 0, after = 0;
    std::size_t bytes = 0, alignment = 0;
    std::uintptr_t stream = 0;
  };
  struct live_record {
    std::uint64_t serial = 0;
    std::size_t bytes = 0;
    bool planned = false;
    std::size_t offset = 0;  // planned: in the region
  };

  explicit state(std::size_t max_period) : detector(max_period) {}

  detail::large_request_detector detector;
  std::uint64_t next_serial = 0;
  std::deque<recorded> history;  // events of the last 3 x max_period large requests
  std::unordered_map<std::uintptr_t, live_record> live;  // large allocations

  // The plan: cycle id of serial t is ((t - base) - first) mod period.
  std::optional<step_plan> plan;
  std::vector<std::uint64_t> keys;  // by cycle id
  std::size_t period = 0, first = 0;
  std::uint64_t base = 0;
  bool active = false;              // cycles served from the region
  std::uint64_t last_match = 0;  // serial of the last request the plan matched
  // Resynchronization: the last `context` keys, and the cycle id each context of the plan
  // names (those that occur once in the plan's cycle).
  static constexpr std::size_t context = 4;
  std::uint64_t recent[context] = {};
  std::unordered_map<std::uint64_t, std::size_t> id_of_context;
  std::uint64_t context_hash(std::uint64_t key) const {
    std::uint64_t h = key;
    for (std::size_t i = 1; i < context; ++i) h = h * 0x100000001b3ull ^ recent[(i - 1)];
    return h;
  }

  detail::plan_region region;
  std::map<std::size_t, std::size_t> occupied;  // offset -> end, of live planned allocations
  std::size_t planned_live_bytes = 0;
  large_planner_counts counts;

  std::size_t cycle_id(std::uint64_t serial) const {
    const std::uint64_t phase = (serial - base) % period;
    return static_cast<std::size_t>((phase + period - first) % period);
  }
  // Builds the plan of the period of `period` large requests that ended `period` requests
  // before serial `now` (the earlier of the two that matched). False: nothing to plan.
  bool build(std::uint64_t now, std::size_t period, std::size_t align);
  bool range_free(std::size_t at, std::size_t end) const {
    auto it = occupied.lower_bound(end);  // first starting at or after end
    if (it == occupied.begin()) return true;
    --it;
    return it->second <= at;
  }
};

large_planner::large_planner(pool_base& pool, large_plan_options options)
    : memory_resource(pool.device_platform(), pool.device()),
      pool_(pool),
      options_(options),
      name_("large_plan+" + std::string(pool.name())),
      s_(std::make_unique<state>(options.max_period)) {}

large_planner::~large_planner() { s_->region.release(pool_, device_platform()); }

void large_planner::give_region_back_if_idle(state& s) {
  if (!s.region.held() || !s.occupied.empty()) return;
  pool_.deallocate(reinterpret_cast<void*>(s.region.base), s.region.bytes, stream_handle{s.region.stream});
  s.region.base = 0;
  s.region.bytes = 0;
  s.counts.region_bytes = 0;
}

void large_planner::take_region(state& s) {
  if (!s.region.held()) {
    void* r = nullptr;
    try {
      r = pool_.allocate(s.plan->region_bytes, step_plan::unit, stream_handle{s.plan->stream});
    } catch (const out_of_memory&) {
      // Not now: the pool serves this cycle; the next cycle asks again.
    } catch (const invalid_argument&) {
      // A region larger than the device: the same.
    }
    if (r == nullptr) {
      ++s.counts.region_failures;
      return;
    }
    ++s.counts.region_takes;
    s.region.base = reinterpret_cast<std::uintptr_t>(r);
    s.region.bytes = s.plan->region_bytes;
    s.region.stream = s.plan->stream;
    s.counts.region_bytes = s.region.bytes;
  }
  s.active = true;
}

void large_planner::leave_cycle(state& s) {
  s.active = false;
  if (!s.region.held()) return;
  if (s.occupied.empty()) return give_region_back_if_idle(s);
  // The planned allocations still live become the pool's own, the rest goes back.
  std::vector<pool_base::kept_range> keep;
  keep.reserve(s.occupied.size());
  for (const auto& [addr, rec] : s.live)
    if (rec.planned) keep.push_back({addr, rec.bytes});
  std::sort(keep.begin(), keep.end(),
            [](const auto& a, const auto& b) { return a.address < b.address; });
  if (!pool_.free_except(reinterpret_cast<void*>(s.region.base), s.region.bytes,
                         stream_handle{s.region.stream}, keep))
    return;  // the pool cannot (guard or scrub mode): the region goes back once idle
  for (auto& [addr, rec] : s.live) rec.planned = false;
  s.occupied.clear();
  s.planned_live_bytes = 0;
  s.region.base = 0;
  s.region.bytes = 0;
  s.counts.region_bytes = 0;
  ++s.counts.regions_handed_over;
}

void large_planner::drop_plan(state& s) {
  if (s.plan) ++s.counts.plans_dropped;
  s.plan.reset();
  s.active = false;
  s.counts.period = 0;
  give_region_back_if_idle(s);  // else when its last planned allocation is freed
}

void* large_planner::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  if (bytes < options_.threshold) return pool_.allocate(bytes, alignment, stream);
  std::lock_guard lock(mutex_);
  state& s = *s_;
  ++s.counts.large_requests;
  const std::uint64_t serial = s.next_serial;
  const std::uint64_t key = key_of(bytes, stream.value);
  std::optional<std::size_t> planned_at;
  if (s.plan) {
    std::size_t id = s.cycle_id(serial);
    if (key != s.keys[id] && serial >= s.period) {
      // Maybe the loop moved within its cycle (a request skipped or added): where the last
      // few keys occur once in the cycle, the cycle continues from there.
      const auto c = s.id_of_context.find(s.context_hash(key));
      if (c != s.id_of_context.end() && c->second != static_cast<std::size_t>(-1)) {
        id = c->second;
        s.base = serial - (id + s.first) % s.period;
        ++s.counts.resyncs;
      }
    }
    if (key != s.keys[id]) {
      ++s.counts.misses;
      // The cycle leaves the plan: the region goes back now (an idle region would be memory
      // the pool cannot use for what the loop does instead), and is taken again where a
      // cycle begins on the plan.
      if (s.active) leave_cycle(s);
      // A plan that matches no request for two periods (and at least 2 x min_window
      // requests) no longer describes the loop: dropped.
      if (serial - s.last_match > 2 * std::max(s.period, options_.min_window))
        drop_plan(s);
    } else {
      s.last_match = serial;
      if (!s.active && id == 0 && s.occupied.empty()) take_region(s);
      if (s.active && s.plan->planned(static_cast<std::uint32_t>(id)) &&
          alignment <= step_plan::unit) {
        const std::size_t at = s.plan->offset[id];
        // (A request matching the plan's key has the plan's size: inside the region.)
        if (at + step_plan::block_bytes(bytes) <= s.region.bytes &&
            s.range_free(at, at + step_plan::block_bytes(bytes)))
          planned_at = at;
        else
          ++s.counts.conflicts;
      }
    }
  }
  void* ptr = planned_at ? reinterpret_cast<void*>(s.region.base + *planned_at)
                         : pool_.allocate(bytes, alignment, stream);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  s.live[addr] = state::live_record{serial, bytes, planned_at.has_value(), planned_at.value_or(0)};
  if (planned_at) {
    s.occupied.emplace(*planned_at, *planned_at + step_plan::block_bytes(bytes));
    s.planned_live_bytes += bytes;
    ++s.counts.planned_allocations;
  }
  s.history.push_back({true, serial, serial, bytes, alignment, stream.value});
  ++s.next_serial;
  const std::uint64_t keep_from =
      s.next_serial > 3 * options_.max_period ? s.next_serial - 3 * options_.max_period : 0;
  while (!s.history.empty() && s.history.front().after < keep_from) s.history.pop_front();
  for (std::size_t i = state::context - 1; i > 0; --i) s.recent[i] = s.recent[i - 1];
  s.recent[0] = key;
  const std::size_t period = s.detector.push(key);
  if (s.plan && period > s.period) {
    // A longer period repeats (the step, where the plan held a layer): the plan goes, and
    // the new one is built once the region is back. A shorter one never replaces a plan:
    // within a step the layer repeats, and the step's plan resynchronizes.
    drop_plan(s);
  }
  if (!s.plan && !s.region.held() && period > 0) {
    if (s.build(s.next_serial, period, std::min<std::size_t>(step_plan::unit, pool_.max_alignment()))) {
      ++s.counts.plans_built;
      s.counts.period = period;
    }
  }
  return ptr;
}

void large_planner::do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  if (bytes < options_.threshold) return pool_.deallocate(ptr, bytes, stream);
  std::lock_guard lock(mutex_);
  state& s = *s_;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const auto it = s.live.find(addr);
  if (it == s.live.end()) {
    if (s.region.held() && addr >= s.region.base && addr < s.region.base + s.region.bytes)
      throw invalid_argument("free of " + hex(addr) +
                             ": inside the large-request plan's region but not a live "
                             "allocation (freed twice, or not an address allocate returned)");
    return pool_.deallocate(ptr, bytes, stream);  // not one the planner saw
  }
  const state::live_record rec = it->second;
  if (!rec.planned) {
    pool_.deallocate(ptr, bytes, stream);  // the pool checks the size; a throw leaves it live
  } else {
    if (bytes != rec.bytes)
      throw invalid_argument("free of " + hex(addr) + " with size " + std::to_string(bytes) +
                             ": it was allocated with " + std::to_string(rec.bytes) + " bytes");
    if (stream.value != s.region.stream) {
      pool_.check_stream(stream, "deallocate");
      s.region.waits_for(device_platform(), device(), stream, "large plan");
    }
    s.occupied.erase(rec.offset);
    s.planned_live_bytes -= rec.bytes;
  }
  s.live.erase(it);
  s.history.push_back({false, rec.serial, s.next_serial == 0 ? 0 : s.next_serial - 1, bytes, 0,
                       stream.value});
  if (rec.planned && !s.active) give_region_back_if_idle(s);  // the last of a cycle left
}

bool large_planner::state::build(std::uint64_t now, std::size_t period, std::size_t align) {
  state& s = *this;
  // The two matching periods are serials [now - 2p, now - p) and [now - p, now); the earlier
  // is recorded whole with the frees that follow it up to the next period.
  if (now < 2 * period) return false;
  const std::uint64_t from = now - 2 * period, to = now - period;
  // The earlier period's allocations by id (its serial less `from`).
  std::vector<const recorded*> made(period, nullptr);
  for (const auto& e : s.history)
    if (e.alloc && e.serial >= from && e.serial < to) made[e.serial - from] = &e;
  std::vector<step_event> events;
  for (const auto& e : s.history) {
    if (e.after < from || e.after >= to) continue;
    if (e.alloc) {
      events.push_back({step_event::kind::alloc, 0, static_cast<std::uint32_t>(e.serial - from),
                        e.bytes, e.alignment, e.stream});
    } else if (e.serial >= from) {
      events.push_back({step_event::kind::free, 0, static_cast<std::uint32_t>(e.serial - from),
                        e.bytes, 0, e.stream});
    } else if (const std::uint64_t id = e.serial + period - from;
               e.serial + period >= from && made[id] != nullptr && made[id]->bytes == e.bytes &&
               made[id]->stream == e.stream) {
      // The period before's allocation at this place, as this period's would be freed (the
      // same request there: else the frees of the period before tell nothing of this one).
      events.push_back({step_event::kind::free, 1, static_cast<std::uint32_t>(id), e.bytes, 0,
                        e.stream});
    } else {
      events.push_back({step_event::kind::free, 2, 0, e.bytes, 0, e.stream});
    }
  }
  const detail::step_cycle cycle = detail::cycle_of(events);
  step_plan plan = detail::build_step_plan(cycle.events, period, align);
  if (plan.planned_count == 0) return false;
  // Allocs of the period before the cycle's start: the cycle's first request's phase.
  std::size_t first = 0;
  for (std::size_t i = 0; i < cycle.start && i < events.size(); ++i)
    if (events[i].what == step_event::kind::alloc) ++first;
  s.keys.assign(period, 0);
  for (const step_event& e : cycle.events)
    if (e.what == step_event::kind::alloc) s.keys[e.id] = key_of(e.bytes, e.stream);
  s.period = period;
  s.first = first % period;
  s.id_of_context.clear();
  for (std::size_t j = 0; j < period; ++j) {
    std::uint64_t h = s.keys[j];
    for (std::size_t i = 1; i < context; ++i) h = h * 0x100000001b3ull ^ s.keys[(j + period - i) % period];
    auto [it, fresh] = s.id_of_context.try_emplace(h, j);
    if (!fresh) it->second = static_cast<std::size_t>(-1);
  }
  s.base = from;
  s.plan = std::move(plan);
  s.active = false;
  s.last_match = now;
  return true;
}

large_planner_counts large_planner::counts() const {
  std::lock_guard lock(mutex_);
  return s_->counts;
}

resource_stats large_planner::stats() const {
  resource_stats r = pool_.stats();
  std::lock_guard lock(mutex_);
  const state& s = *s_;
  if (s.region.held()) {
    r.live_bytes = r.live_bytes - s.region.bytes + s.planned_live_bytes;
    r.cached_bytes += s.region.bytes - s.planned_live_bytes;
  }
  return r;
}

std::string large_planner::validate() const {
  if (std::string v = pool_.validate(); !v.empty()) return v;
  std::lock_guard lock(mutex_);
  const state& s = *s_;
  std::size_t planned = 0;
  for (const auto& [addr, rec] : s.live) {
    if (!rec.planned) continue;
    ++planned;
    if (!s.region.held() || addr != s.region.base + rec.offset ||
        rec.offset + step_plan::block_bytes(rec.bytes) > s.region.bytes)
      return "large plan: planned allocation " + hex(addr) + " lies outside the region";
    const auto o = s.occupied.find(rec.offset);
    if (o == s.occupied.end() || o->second != rec.offset + step_plan::block_bytes(rec.bytes))
      return "large plan: planned allocation " + hex(addr) + " not in the occupied ranges";
  }
  if (planned != s.occupied.size())
    return "large plan: " + std::to_string(s.occupied.size()) + " occupied ranges, " +
           std::to_string(planned) + " planned allocations";
  std::size_t end = 0;
  for (const auto& [at, e] : s.occupied) {
    if (at < end) return "large plan: planned allocations overlap";
    end = e;
  }
  return {};
}

void large_planner::release_stream(stream_handle stream) {
  {
    std::lock_guard lock(mutex_);
    state& s = *s_;
    // The region lives in this stream's order: no plan on it from now on.
    if (s.region.held() && s.region.stream == stream.value) drop_plan(s);
  }
  pool_.release_stream(stream);
}

}  // namespace gpumem
