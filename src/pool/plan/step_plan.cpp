#include "pool/plan/step_plan.hpp"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

namespace gpumem::detail {

namespace {

// A planned allocation's lifetime, in event positions: live over [birth, death).
struct lifetime {
  std::uint32_t id = 0;
  std::size_t birth = 0, death = 0, block = 0;
};

bool overlap_in_time(const lifetime& a, const lifetime& b) {
  return a.birth < b.death && b.birth < a.death;
}

// Lifetimes of the allocations freed within the step on the stream they were made on,
// with no more alignment than max_alignment. `streams` receives each one's stream.
std::vector<lifetime> candidates(std::span<const step_event> events, std::size_t allocs,
                                 std::size_t max_alignment, std::vector<std::uintptr_t>& streams) {
  std::vector<std::size_t> birth(allocs, 0);
  std::vector<bool> eligible(allocs, false);
  streams.assign(allocs, 0);
  std::vector<lifetime> out;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const step_event& e = events[i];
    if (e.what == step_event::kind::alloc) {
      birth[e.id] = i;
      streams[e.id] = e.stream;
      eligible[e.id] = e.alignment <= max_alignment;
    } else if (e.age == 0 && eligible[e.id] && e.stream == streams[e.id]) {
      out.push_back({e.id, birth[e.id], i, step_plan::block_bytes(e.bytes)});
    }
  }
  return out;
}

}  // namespace

step_cycle cycle_of(std::span<const step_event> step) {
  step_cycle c;
  const std::size_t n = step.size();
  // Live bytes before each event, relative to the step's start; the cycle starts at the
  // least (the first such point).
  std::int64_t live = 0, least = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (live < least) {
      least = live;
      c.start = i;
    }
    const auto b = static_cast<std::int64_t>(step[i].bytes);
    live += step[i].what == step_event::kind::alloc ? b : -b;
  }
  // Allocation positions by id, to tell allocations made before the cycle began.
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < n; ++i)
    if (step[i].what == step_event::kind::alloc) at.push_back(i);
  std::vector<std::uint32_t> in_cycle(at.size(), 0), next_in_cycle(at.size(), 0);
  std::uint32_t next_id = 0;
  constexpr std::uint32_t none = static_cast<std::uint32_t>(-1);
  std::fill(in_cycle.begin(), in_cycle.end(), none);
  std::fill(next_in_cycle.begin(), next_in_cycle.end(), none);
  // This step from the start, then the next (the same events) up to the start.
  for (std::size_t k = 0; k < n; ++k) {
    const bool second = c.start + k >= n;
    const step_event& e = step[second ? c.start + k - n : c.start + k];
    step_event out = e;
    out.age = 0;
    if (e.what == step_event::kind::alloc) {
      out.id = next_id++;
      (second ? next_in_cycle : in_cycle)[e.id] = out.id;
    } else {
      // Whose allocation: this step's (`in_cycle`) or, from the next step, the next's own
      // (age 0) or this step's (age 1). Anything else was made before the cycle.
      std::uint32_t id = none;
      if (!second && e.age == 0) id = in_cycle[e.id];
      if (second && e.age == 0) id = next_in_cycle[e.id];
      if (second && e.age == 1 && e.id < in_cycle.size()) id = in_cycle[e.id];
      if (id == none) continue;
      out.id = id;
    }
    c.events.push_back(out);
    if (!second) c.mark = c.events.size();
  }
  return c;
}

step_plan build_step_plan(std::span<const step_event> events, std::size_t max_planned,
                          std::size_t max_alignment, std::size_t mark) {
  step_plan plan;
  std::size_t allocs = 0;
  for (const step_event& e : events)
    if (e.what == step_event::kind::alloc) ++allocs;
  plan.offset.assign(allocs, step_plan::unplanned);

  std::vector<std::uintptr_t> streams;
  std::vector<lifetime> items =
      candidates(events, allocs, std::min(max_alignment, step_plan::unit), streams);
  // One stream: the one whose candidates hold the most bytes (reuse within the region is
  // then always in that stream's order).
  std::map<std::uintptr_t, std::size_t> bytes_by_stream;
  for (const lifetime& l : items) bytes_by_stream[streams[l.id]] += l.block;
  if (bytes_by_stream.empty()) return plan;
  plan.stream = std::max_element(bytes_by_stream.begin(), bytes_by_stream.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; })
                    ->first;
  std::erase_if(items, [&](const lifetime& l) { return streams[l.id] != plan.stream; });

  // Largest first (earliest born among equals): big blocks take the low offsets, and the
  // small ones fill the gaps they leave.
  std::sort(items.begin(), items.end(), [](const lifetime& a, const lifetime& b) {
    return a.block != b.block ? a.block > b.block : a.birth < b.birth;
  });
  if (items.size() > max_planned) items.resize(max_planned);
  // Those live at the mark first: side by side at the bottom, so a pass run at the mark
  // while they live (an evaluation with gradients a zero_grad at the top of the loop frees)
  // finds the rest of the region in one piece when it is handed over (step_planner).
  std::stable_sort(items.begin(), items.end(), [mark](const lifetime& a, const lifetime& b) {
    return (a.birth < mark && mark <= a.death) > (b.birth < mark && mark <= b.death);
  });

  std::vector<std::pair<lifetime, std::size_t>> placed;  // with its offset
  placed.reserve(items.size());
  std::vector<std::pair<std::size_t, std::size_t>> busy;  // [offset, end) live meanwhile
  for (const lifetime& item : items) {
    busy.clear();
    for (const auto& [other, at] : placed)
      if (overlap_in_time(item, other)) busy.emplace_back(at, at + other.block);
    std::sort(busy.begin(), busy.end());
    // The smallest gap that fits (best fit), else above everything live meanwhile.
    std::size_t pos = 0, best = step_plan::unplanned, best_gap = step_plan::unplanned;
    for (const auto& [lo, hi] : busy) {
      if (lo > pos && lo - pos >= item.block && lo - pos < best_gap) {
        best_gap = lo - pos;
        best = pos;
      }
      pos = std::max(pos, hi);
    }
    const std::size_t at = best != step_plan::unplanned ? best : pos;
    placed.emplace_back(item, at);
    plan.offset[item.id] = at;
    plan.region_bytes = std::max(plan.region_bytes, at + item.block);
  }
  plan.planned_count = placed.size();

  // The sequence to follow, and the peak of planned bytes live at once.
  std::size_t live = 0;
  std::vector<std::size_t> block(allocs, 0);
  for (const step_event& e : events) {
    if (e.what == step_event::kind::alloc) {
      plan.sequence.push_back(e);
      if (plan.planned(e.id)) {
        block[e.id] = step_plan::block_bytes(e.bytes);
        live += block[e.id];
        plan.lower_bound = std::max(plan.lower_bound, live);
      }
    } else if (e.age == 0 && plan.planned(e.id)) {
      plan.sequence.push_back(e);
      live -= block[e.id];
    }
  }
  return plan;
}

std::string check_step_plan(const step_plan& plan) {
  std::vector<lifetime> planned;
  std::vector<std::size_t> birth(plan.offset.size(), 0);
  for (std::size_t i = 0; i < plan.sequence.size(); ++i) {
    const step_event& e = plan.sequence[i];
    if (e.id >= plan.offset.size()) return "an event names allocation " + std::to_string(e.id);
    if (!plan.planned(e.id)) continue;
    if (e.what == step_event::kind::alloc)
      birth[e.id] = i;
    else
      planned.push_back({e.id, birth[e.id], i, step_plan::block_bytes(e.bytes)});
  }
  if (planned.size() != plan.planned_count)
    return std::to_string(plan.planned_count) + " planned allocations, " +
           std::to_string(planned.size()) + " freed in the sequence";
  for (const lifetime& l : planned) {
    const std::size_t at = plan.offset[l.id];
    if (at % step_plan::unit != 0 || at + l.block > plan.region_bytes)
      return "allocation " + std::to_string(l.id) + " lies outside the region or off the unit";
  }
  // Sweep by offset: only neighbours in address can collide, but lifetimes vary, so
  // compare each with those that start below its end (sorted by offset).
  std::sort(planned.begin(), planned.end(), [&](const lifetime& a, const lifetime& b) {
    return plan.offset[a.id] < plan.offset[b.id];
  });
  for (std::size_t i = 0; i < planned.size(); ++i) {
    const std::size_t end = plan.offset[planned[i].id] + planned[i].block;
    for (std::size_t j = i + 1; j < planned.size() && plan.offset[planned[j].id] < end; ++j)
      if (overlap_in_time(planned[i], planned[j]))
        return "allocations " + std::to_string(planned[i].id) + " and " +
               std::to_string(planned[j].id) + " overlap while both are live";
  }
  return {};
}

}  // namespace gpumem::detail
