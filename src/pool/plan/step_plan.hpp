// A step plan: where, in one region, each allocation of a repeating step goes.
//
// A training or serving loop makes the same requests in the same order every step. Given
// one step's events, build_step_plan places every allocation that is born and freed
// within the step, on the step's stream, at an offset of a region, so that no two
// allocations live at the same time overlap: the dynamic storage allocation problem,
// solved greedily by size (largest first, each in the smallest gap left by the ones
// already placed that overlap it in time), as static memory planners of DNN compilers do.
// On real training steps that meets the lower bound (the peak of planned bytes live at
// once) or comes close; it is never below it.
//
// Pure computation over numbers: no memory is touched here (step_planner serves it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace gpumem::detail {

// One event of a recorded step. Allocations are numbered in the order they were made
// within the step (id); a free names the allocation it ends: one of this step (age 0), of
// the step before (age 1, id in that step), or older (age 2, id 0).
struct step_event {
  enum class kind : std::uint8_t { alloc, free };
  kind what = kind::alloc;
  std::uint8_t age = 0;
  std::uint32_t id = 0;
  std::size_t bytes = 0;      // alloc: requested bytes; free: the bytes passed to free
  std::size_t alignment = 0;  // alloc only
  std::uintptr_t stream = 0;
  friend bool operator==(const step_event&, const step_event&) = default;
};

// A loop's cycle: the requests of a step (between two marks), begun at the step's point of
// fewest live bytes instead of at the mark, and ending there in the next step. So what
// lives across the mark (gradients made in backward and freed by zero_grad at the top of
// the next step, the loss) is born and freed within the cycle, wherever the loop marks.
struct step_cycle {
  std::size_t start = 0;           // the cycle begins before this event of the step
  std::vector<step_event> events;  // ids numbered from the cycle's start (all age 0); frees
                                   // of allocations made before the cycle left out
  std::size_t mark = 0;            // events of the cycle before the step's mark (its end)
};

// REQUIRES: `step` is one step as recorded, and the next step repeats it.
step_cycle cycle_of(std::span<const step_event> step);

struct step_plan {
  static constexpr std::size_t unplanned = static_cast<std::size_t>(-1);
  // Offsets are multiples of `unit`; a planned block spans its bytes rounded up to it.
  static constexpr std::size_t unit = 512;

  // Per allocation id: its offset in the region, or `unplanned` (it lives past the step,
  // is used on another stream, or needs more alignment than the region has: the pool
  // serves it).
  std::vector<std::size_t> offset;
  // The sequence a planned step follows: every allocation (planned or not, so positions
  // agree) and the frees of planned allocations, in the recorded order.
  std::vector<step_event> sequence;
  std::uintptr_t stream = 0;       // the stream of every planned allocation
  std::size_t region_bytes = 0;    // end of the highest planned block
  std::size_t lower_bound = 0;     // peak of planned (rounded) bytes live at once
  std::size_t planned_count = 0;

  bool planned(std::uint32_t id) const { return offset[id] != unplanned; }
  static std::size_t block_bytes(std::size_t bytes) { return (bytes + unit - 1) / unit * unit; }
};

// REQUIRES: `events` is one cycle (ids 0.. in alloc order, each freed at most once, after
// its alloc; every free of age 0). Plans at most `max_planned` allocations (the largest first):
// placement costs O(n^2) in the planned count. Only allocations asking at most
// `max_alignment` (<= unit; the region's own alignment) are planned. Those live across
// event `mark` (the loop's mark; step_cycle::mark) are placed first, together at the bottom.
step_plan build_step_plan(std::span<const step_event> events, std::size_t max_planned,
                          std::size_t max_alignment = step_plan::unit,
                          std::size_t mark = 0);

// "" when no two planned allocations that are live at the same time overlap and every
// block lies inside the region; else what is wrong (tests and step_planner::validate).
std::string check_step_plan(const step_plan& plan);

}  // namespace gpumem::detail
