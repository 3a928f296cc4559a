#include "gpumem/pool/plan/step_planner.hpp"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <unordered_map>
#include <utility>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"
#include "pool/plan/plan_region.hpp"
#include "pool/plan/step_plan.hpp"

namespace gpumem {

using detail::step_event;
using detail::step_plan;

// Invariants (validate()):
//  - region_live == the live records marked planned, each inside [region, region + bytes),
//    none overlapping another;
//  - on_plan implies a plan, a region, and cursor <= plan->sequence.size();
//  - while on_plan, the first cursor events of the plan's sequence are exactly what this
//    cycle did so far (so the planned allocations live now are the ones live at that point
//    of the recorded cycle, which the plan laid out apart).
struct step_planner::state {
  struct live_record {
    std::uint64_t step = 0;      // the step (between two marks) that made it
    std::uint32_t id = 0;        // its number within that step
    std::uint64_t cycle = 0;     // the cycle that made it
    std::uint32_t cycle_id = 0;  // its number within that cycle
    std::size_t bytes = 0;
    bool planned = false;        // in the region (else the pool's)
  };

  std::uint64_t step = 0;  // 1 from the first mark
  std::vector<step_event> recording, previous;  // this step's events, the last step's
  std::size_t step_events = 0;  // events of this step so far (recorded or not)
  // A step longer than the planner records (a loop that stopped marking, say): not kept,
  // and never equal to another.
  bool recording_overflow = false, previous_overflow = false;
  std::uint32_t next_id = 0;
  std::unordered_map<std::uintptr_t, live_record> live;  // made since the first mark

  // The plan serves cycles: each begins at event `cycle_start` of a step (its point of
  // fewest live bytes; src/pool/plan/step_plan.hpp) and runs into the next step up to there.
  std::optional<step_plan> plan;
  std::vector<step_event> plan_source;  // the step the plan was built from
  std::size_t cycle_start = 0;
  bool cycle_begun = false;             // this step's cycle has begun
  // A cycle left at its first request (a detour: an evaluation pass, say) may rejoin the
  // plan once the detour's allocations are all freed: the live bytes then (none: no detour).
  // Also set where a step reaches the event its cycle begins at with other live bytes than
  // cycles begin with (the step began with a detour): the cycle begins where it can rejoin.
  std::optional<std::size_t> detour_from_live;
  // The live bytes cycles begin with: computed when the plan is built, then those of the
  // last cycle begun at its event that ran whole on the plan; none after a step whose
  // deferred start never came.
  std::optional<std::size_t> cycle_begin_live;
  bool start_deferred = false;  // this step's cycle waits to rejoin (begin_cycle_if_due)
  std::optional<std::size_t> began_live;  // live bytes when this cycle began at its event
  std::uint64_t cycle = 0;
  std::uint32_t cycle_next_id = 0;
  bool on_plan = false;                 // this cycle follows the plan so far
  std::size_t cursor = 0;               // events of the plan's sequence done this cycle

  // Held (also after the plan is dropped) until its last allocation is freed.
  detail::plan_region region;
  std::size_t region_live = 0, region_live_blocks = 0;

  std::uint64_t retry_at_step = 0;  // after the pool refused a region: back off
  unsigned refusals_in_a_row = 0;
  step_planner_counts counts;

  bool in_region(std::uintptr_t addr) const { return region.contains(addr); }
};

namespace {

std::string hex(std::uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

step_planner::step_planner(pool_base& pool, std::size_t max_planned)
    : memory_resource(pool.device_platform(), pool.device()),
      pool_(pool),
      max_planned_(max_planned),
      name_("step_plan+" + std::string(pool.name())),
      s_(std::make_unique<state>()) {}

step_planner::~step_planner() { s_->region.release(pool_, device_platform()); }

void step_planner::count_alloc(std::size_t bytes) noexcept {
  const std::size_t live = live_bytes_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  std::size_t peak = peak_live_bytes_.load(std::memory_order_relaxed);
  while (live > peak && !peak_live_bytes_.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
  }
  live_count_.fetch_add(1, std::memory_order_relaxed);
  allocations_.fetch_add(1, std::memory_order_relaxed);
}

void step_planner::count_free(std::size_t bytes) noexcept {
  live_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
  live_count_.fetch_sub(1, std::memory_order_relaxed);
  deallocations_.fetch_add(1, std::memory_order_relaxed);
}

void* step_planner::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  if (!recording_.load(std::memory_order_acquire)) return pool_.allocate(bytes, alignment, stream);
  std::lock_guard lock(mutex_);
  // Planned addresses are handed out without the pool: while it sleeps (the region's pages
  // released with the rest) they are refused as the pool refuses its own, before anything
  // changes.
  if (pool_.asleep_now()) pool_.check_awake("allocate");
  state& s = *s_;
  begin_cycle_if_due(s);
  const step_event e{step_event::kind::alloc, 0, s.next_id, bytes, alignment, stream.value};
  rejoin_if_due(s, step_event{step_event::kind::alloc, 0, 0, bytes, alignment, stream.value});
  const step_event in_cycle{step_event::kind::alloc, 0, s.cycle_next_id, bytes, alignment,
                            stream.value};
  bool planned = false;
  if (s.on_plan) {
    if (s.cursor < s.plan->sequence.size() && s.plan->sequence[s.cursor] == in_cycle) {
      planned = s.plan->planned(in_cycle.id);
    } else {
      leave_plan(s);  // the rest of this cycle goes to the pool
    }
  }
  const std::uintptr_t addr =
      planned ? s.region.base + s.plan->offset[in_cycle.id]
              : reinterpret_cast<std::uintptr_t>(pool_.allocate(bytes, alignment, stream));
  try {
    s.live.emplace(addr, state::live_record{s.step, e.id, s.cycle, in_cycle.id, bytes, planned});
    record(s, e);
  } catch (...) {
    s.live.erase(addr);
    if (!planned) pool_.deallocate(reinterpret_cast<void*>(addr), bytes, stream);
    throw;
  }
  ++s.next_id;
  ++s.cycle_next_id;
  if (s.on_plan) ++s.cursor;
  if (planned) {
    ++s.region_live;
    s.region_live_blocks += step_plan::block_bytes(bytes);
    s.counts.planned_live_bytes += bytes;
    ++s.counts.planned_allocations;
  }
  count_alloc(bytes);
  return reinterpret_cast<void*>(addr);
}

void step_planner::do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  if (!recording_.load(std::memory_order_acquire)) return pool_.deallocate(ptr, bytes, stream);
  std::lock_guard lock(mutex_);
  state& s = *s_;
  begin_cycle_if_due(s);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const auto it = s.live.find(addr);
  if (it == s.live.end()) {
    if (s.in_region(addr))
      throw invalid_argument("free of " + hex(addr) +
                             ": inside the step plan's region but not a live allocation "
                             "(freed twice, or not an address allocate returned)");
    pool_.deallocate(ptr, bytes, stream);  // made before the first mark, or not ours
    record(s, {step_event::kind::free, 2, 0, bytes, 0, stream.value});
    count_free(bytes);
    return;
  }
  const state::live_record rec = it->second;
  if (!rec.planned) {
    pool_.deallocate(ptr, bytes, stream);  // the pool checks the size; throws leave it live
  } else {
    if (bytes != rec.bytes)
      throw invalid_argument("free of " + hex(addr) + " with size " + std::to_string(bytes) +
                             ": it was allocated with " + std::to_string(rec.bytes) + " bytes");
    if (stream.value != s.region.stream) {
      // A stream the platform refuses is bad input, refused before anything changes (as the
      // pool refuses it), not a driver failure of the event record below.
      pool_.check_stream(stream, "deallocate");
      s.region.waits_for(device_platform(), device(), stream, "step_plan");
    }
  }
  s.live.erase(it);
  const std::uint8_t age = rec.step == s.step ? 0 : rec.step + 1 == s.step ? 1 : 2;
  // May throw bad_alloc: the step then only fails to match the next.
  record(s, {step_event::kind::free, age, age < 2 ? rec.id : 0, bytes, 0, stream.value});
  if (rec.planned) {
    --s.region_live;
    s.region_live_blocks -= step_plan::block_bytes(bytes);
    s.counts.planned_live_bytes -= bytes;
  }
  if (s.on_plan && rec.planned) {
    // While a cycle follows the plan, every live planned allocation is this cycle's.
    const step_event in_cycle{step_event::kind::free, 0, rec.cycle_id, bytes, 0, stream.value};
    if (s.cursor < s.plan->sequence.size() && s.plan->sequence[s.cursor] == in_cycle)
      ++s.cursor;
    else
      leave_plan(s);  // (this allocation is no longer counted as the region's)
  }
  if (rec.planned && s.region_live == 0 && !s.on_plan)
    give_region_back(s);  // idle until a step follows it
  count_free(bytes);
}

void step_planner::record(state& s, const step_event& e) {
  ++s.step_events;
  if (s.recording_overflow) return;
  if (s.recording.size() >= max_planned_ * events_per_planned) {
    s.recording.clear();
    s.recording.shrink_to_fit();
    s.recording_overflow = true;
    ++s.counts.steps_too_long;
    return;
  }
  s.recording.push_back(e);
}

void step_planner::leave_plan(state& s) {
  if (s.cursor == 0 && s.region_live == 0)
    s.detour_from_live = live_bytes_.load(std::memory_order_relaxed);
  s.on_plan = false;
  ++s.counts.steps_left_plan;
  // An idle region would be memory the pool cannot use for the rest of the step (a loop's
  // evaluation phase, say): it goes back, and is taken again when a step follows the plan.
  if (s.region_live == 0)
    give_region_back(s);
  else
    hand_region_over(s);
}

void step_planner::hand_region_over(state& s) {
  // The planned allocations still live (gradients a zero_grad at the top of the loop frees,
  // while an evaluation pass runs after the optimizer step, say) become the pool's own, and
  // the rest of the region goes back: the pass runs in the region's free memory, not beside
  // the region. Their frees go to the pool; the next cycle takes a region again.
  std::vector<pool_base::kept_range> keep;
  keep.reserve(s.region_live);
  for (const auto& [addr, rec] : s.live)
    if (rec.planned) keep.push_back({addr, rec.bytes});
  std::sort(keep.begin(), keep.end(),
            [](const auto& a, const auto& b) { return a.address < b.address; });
  if (!pool_.free_except(reinterpret_cast<void*>(s.region.base), s.region.bytes,
                         stream_handle{s.region.stream}, keep))
    return;  // the pool cannot (guard or scrub mode): the region goes back when they die
  for (auto& [addr, rec] : s.live) rec.planned = false;
  s.region_live = 0;
  s.region_live_blocks = 0;
  s.counts.planned_live_bytes = 0;
  s.region.base = 0;
  s.region.bytes = 0;
  s.counts.region_bytes = 0;
  ++s.counts.regions_handed_over;
}

void step_planner::give_region_back(state& s) {
  if (!s.region.held()) return;
  pool_.deallocate(reinterpret_cast<void*>(s.region.base), s.region.bytes, stream_handle{s.region.stream});
  s.region.base = 0;
  s.region.bytes = 0;
  s.counts.region_bytes = 0;
}

void step_planner::mark_step() {
  std::lock_guard lock(mutex_);
  state& s = *s_;
  ++s.counts.steps;
  if (!recording_.load(std::memory_order_relaxed)) {
    // Counting starts from the pool's figures (every earlier call went straight to it).
    const resource_stats ps = pool_.stats();
    live_bytes_ = ps.live_bytes;
    peak_live_bytes_ = ps.peak_live_bytes;
    live_count_ = ps.live_allocations;
    allocations_ = ps.allocations;
    deallocations_ = ps.deallocations;
    s.step = 1;
    recording_.store(true, std::memory_order_release);
    return;
  }
  const bool repeated = !s.recording_overflow && !s.previous_overflow &&
                        !s.recording.empty() && s.recording == s.previous;
  s.previous = std::move(s.recording);
  s.recording.clear();
  s.previous_overflow = s.recording_overflow;
  s.recording_overflow = false;
  s.step_events = 0;
  s.next_id = 0;
  ++s.step;
  s.cycle_begun = false;  // the cycle under way (if any) runs on to this step's start
  s.detour_from_live.reset();
  if (s.start_deferred) s.cycle_begin_live.reset();  // it never came: trust the event again
  s.start_deferred = false;

  // The loop changed (two steps alike, not as planned): drop the plan; its region goes
  // back once its last allocation is freed.
  if (s.plan && repeated && s.previous != s.plan_source) {
    s.plan.reset();
    s.plan_source.clear();
    s.on_plan = false;
    if (s.region_live == 0) give_region_back(s);
  }
  if (!s.plan && repeated && !s.region.held() && s.step >= s.retry_at_step) {
    const detail::step_cycle cycle = detail::cycle_of(s.previous);
    step_plan plan =
        detail::build_step_plan(cycle.events, max_planned_, region_alignment(), cycle.mark);
    if (plan.planned_count > 0) {
      s.counts.plan_lower_bound = plan.lower_bound;
      s.counts.planned_count = plan.planned_count;
      ++s.counts.plans_built;
      s.plan_source = s.previous;
      s.plan = std::move(plan);
      s.began_live.reset();
      s.cycle_start = cycle.start;
      // The live bytes where that step's cycle began: those now, less what the step did
      // after that point. Steps repeat, so cycles begin with them (begin_cycle_if_due).
      std::int64_t after_start = 0;
      for (std::size_t i = cycle.start; i < s.previous.size(); ++i) {
        const auto b = static_cast<std::int64_t>(s.previous[i].bytes);
        after_start += s.previous[i].what == step_event::kind::alloc ? b : -b;
      }
      s.cycle_begin_live = static_cast<std::size_t>(
          static_cast<std::int64_t>(live_bytes_.load(std::memory_order_relaxed)) - after_start);
    }
  }
  begin_cycle_if_due(s);
}

void step_planner::begin_cycle_if_due(state& s) {
  if (!s.plan || s.cycle_begun || s.step_events != s.cycle_start) return;
  // While the pool sleeps the region can be neither taken nor served from: the cycle begins
  // at the first request after the wake that still comes at its event (a mark made while
  // the tag sleeps, then the step after the wake), and nothing counts as a refusal.
  if (pool_.asleep_now()) return;
  s.cycle_begun = true;
  const std::size_t live = live_bytes_.load(std::memory_order_relaxed);
  // The cycle before ran whole on the plan: it began where cycles begin. (One that began
  // at its event may not have: an evaluation pass may hold that event when the first plan
  // is built.)
  if (s.on_plan && s.began_live) s.cycle_begin_live = s.began_live;
  if (!s.on_plan && s.cycle_begin_live && live != *s.cycle_begin_live) {
    // Not the point where cycles begin, though at its event: the cycle before left the plan
    // and this step began with other requests (an evaluation pass run after the optimizer
    // step's mark, with gradients a zero_grad frees later, say). Taking the region here
    // would take a second one beside the memory still live. The cycle begins where its
    // first request comes with the live bytes cycles begin with (rejoin_if_due); if that
    // never comes this step, the next one begins where its event says (mark_step).
    s.detour_from_live = *s.cycle_begin_live;
    s.start_deferred = true;
    s.began_live.reset();
    return;
  }
  begin_cycle(s);
  // Only a cycle begun at its event tells where cycles begin (a rejoin may be a request
  // that merely looks like a cycle's first), once it has run whole on the plan.
  s.began_live.reset();
  if (s.on_plan) s.began_live = live;
}

void step_planner::begin_cycle(state& s) {
  ++s.cycle;
  s.cycle_next_id = 0;
  s.cursor = 0;
  // A cycle begins on the plan when no planned allocation is live and the region is held.
  s.on_plan = s.region_live == 0 && (s.region.held() || take_region(s));
  if (s.on_plan) ++s.counts.planned_steps;
}

void step_planner::rejoin_if_due(state& s, const step_event& request) {
  // A cycle left at its first request (an evaluation pass run where the training step
  // begins, say) rejoins the plan when the detour's allocations are all freed (the live
  // bytes are back where it left) and the request a cycle begins with comes: the rest of
  // the step is the cycle, and it ends where the next one begins. So does a cycle whose
  // event came with other live bytes than cycles begin with (begin_cycle_if_due). Once a
  // step: a request that only looks like the beginning leaves again at the next difference
  // and gives the region back. (A looser sign, live bytes near the last cycle's start, let the warm-up
  // steps of a replay pass rejoin and hold the region while the pool served them: sim,
  // torch_train_fixed 1.41.)
  if (s.on_plan || !s.plan || !s.detour_from_live || s.region_live != 0) return;
  if (s.plan->sequence.empty() || !(s.plan->sequence.front() == request)) return;
  if (live_bytes_.load(std::memory_order_relaxed) != *s.detour_from_live) return;
  s.detour_from_live.reset();
  s.start_deferred = false;
  s.began_live.reset();
  begin_cycle(s);
  if (s.on_plan) ++s.counts.steps_rejoined;
}

bool step_planner::take_region(state& s) {
  if (s.step < s.retry_at_step) return false;
  void* region = nullptr;
  try {
    region = pool_.allocate(s.plan->region_bytes, region_alignment(), stream_handle{s.plan->stream});
  } catch (const out_of_memory&) {
    // Not now: the loop runs on the pool as before; try again after 2, 4, ... steps.
  } catch (const invalid_argument&) {
    // A region larger than the device: the same. A pool that fell asleep since
    // begin_cycle_if_due looked refuses too; that is no failure of the region.
    if (pool_.asleep_now()) return false;
  }
  if (region == nullptr) {
    ++s.counts.region_failures;
    s.refusals_in_a_row = std::min(s.refusals_in_a_row + 1, 16u);
    s.retry_at_step = s.step + (std::uint64_t{1} << s.refusals_in_a_row);
    return false;
  }
  s.refusals_in_a_row = 0;
  ++s.counts.region_takes;
  s.region.base = reinterpret_cast<std::uintptr_t>(region);
  s.region.bytes = s.plan->region_bytes;
  s.region.stream = s.plan->stream;
  s.counts.region_bytes = s.region.bytes;
  return true;
}

step_planner_counts step_planner::counts() const {
  std::lock_guard lock(mutex_);
  return s_->counts;
}

resource_stats step_planner::stats() const {
  resource_stats r = pool_.stats();
  if (!recording_.load(std::memory_order_acquire)) return r;  // the pool's own, so far
  r.live_bytes = live_bytes_.load(std::memory_order_relaxed);
  r.peak_live_bytes = peak_live_bytes_.load(std::memory_order_relaxed);
  r.live_allocations = live_count_.load(std::memory_order_relaxed);
  r.allocations = allocations_.load(std::memory_order_relaxed);
  r.deallocations = deallocations_.load(std::memory_order_relaxed);
  std::lock_guard lock(mutex_);
  r.cached_bytes += s_->region.bytes - s_->region_live_blocks;  // the region's unused part
  return r;
}

std::string step_planner::validate() const {
  if (std::string v = pool_.validate(); !v.empty()) return v;
  std::lock_guard lock(mutex_);
  const state& s = *s_;
  std::vector<std::pair<std::uintptr_t, std::size_t>> planned;  // [addr, end)
  for (const auto& [addr, rec] : s.live) {
    if (!rec.planned) continue;
    if (!s.in_region(addr) || addr + rec.bytes > s.region.base + s.region.bytes)
      return "step_plan: planned allocation " + hex(addr) + " lies outside the region";
    planned.emplace_back(addr, addr + step_plan::block_bytes(rec.bytes));
  }
  if (planned.size() != s.region_live)
    return "step_plan: " + std::to_string(planned.size()) + " planned allocations live, " +
           std::to_string(s.region_live) + " counted";
  std::sort(planned.begin(), planned.end());
  for (std::size_t i = 1; i < planned.size(); ++i)
    if (planned[i].first < planned[i - 1].second)
      return "step_plan: planned allocations " + hex(planned[i - 1].first) + " and " +
             hex(planned[i].first) + " overlap";
  if (s.on_plan && (!s.plan || !s.region.held() || s.cursor > s.plan->sequence.size()))
    return "step_plan: on a plan without a plan, a region or a valid position";
  if (s.plan) {
    if (std::string v = detail::check_step_plan(*s.plan); !v.empty()) return "step_plan: " + v;
    if (s.region.held() && s.plan->region_bytes != s.region.bytes)
      return "step_plan: the region is not the plan's size";
  }
  return {};
}

void step_planner::release_stream(stream_handle stream) {
  {
    std::lock_guard lock(mutex_);
    state& s = *s_;
    if (s.region.held() && s.region.stream == stream.value) {
      // The region lives in this stream's order: no plan on it from now on.
      s.plan.reset();
      s.plan_source.clear();
      s.on_plan = false;
      if (s.region_live == 0) give_region_back(s);
    }
  }
  pool_.release_stream(stream);
}

std::vector<memory_segment> step_planner::memory_segments() const {
  std::vector<memory_segment> segments = pool_.memory_segments();
  show_plan_in(segments);
  return segments;
}

void step_planner::show_plan_in(std::vector<memory_segment>& segments) const {
  std::lock_guard lock(mutex_);
  const state& s = *s_;
  if (!s.region.held()) return;
  std::vector<memory_block> inside;  // the planned allocations live now, by address
  for (const auto& [addr, rec] : s.live)
    if (rec.planned)
      inside.push_back({addr, step_plan::block_bytes(rec.bytes), rec.bytes, s.region.stream,
                        memory_block::state::allocated});
  std::sort(inside.begin(), inside.end(),
            [](const memory_block& a, const memory_block& b) { return a.address < b.address; });
  for (memory_segment& seg : segments) {
    for (std::size_t i = 0; i < seg.blocks.size(); ++i) {
      const memory_block region = seg.blocks[i];
      if (region.address != s.region.base || region.st != memory_block::state::allocated) continue;
      // The region's block (possibly rounded up by the pool) becomes planned blocks and
      // free gaps that tile it.
      std::vector<memory_block> tiles;
      std::uintptr_t at = region.address;
      for (const memory_block& b : inside) {
        if (b.address > at) tiles.push_back({at, b.address - at, 0, s.region.stream, memory_block::state::free});
        tiles.push_back(b);
        at = b.address + b.size;
      }
      if (region.address + region.size > at)
        tiles.push_back({at, region.address + region.size - at, 0, s.region.stream,
                         memory_block::state::free});
      seg.blocks.erase(seg.blocks.begin() + static_cast<std::ptrdiff_t>(i));
      seg.blocks.insert(seg.blocks.begin() + static_cast<std::ptrdiff_t>(i), tiles.begin(), tiles.end());
      return;
    }
  }
}

}  // namespace gpumem
