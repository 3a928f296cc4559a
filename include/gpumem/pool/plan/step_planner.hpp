// Step plans in front of a pool: a loop that repeats the same requests every step (a
// training step, a fixed-shape serving step) is served from a precomputed layout.
//
// The loop calls mark_step() once per step (gpumem.torch.mark_step() from Python), at any
// fixed point of it. From the first mark, the planner records each step's allocations and
// frees. When two steps in a row are the same (sizes, alignments, streams, and the order of
// allocations and frees), it plans the loop's cycle (src/pool/plan/step_plan.hpp): the step's
// requests begun at its point of fewest live bytes rather than at the mark, so what lives
// across the mark (gradients freed by a zero_grad at the top of the loop, the loss) is
// planned too. Every allocation born and freed within the cycle, on its main stream, gets
// an offset in one region, laid out so that allocations live at the same time never
// overlap. The region is one allocation from the pool, taken when a cycle begins on the
// plan (out of memory then: that cycle runs on the pool, and the region is asked for again
// later). Cycles on the plan are served by position: the n-th request of a cycle, if it is
// the one recorded, gets its planned address with no search and no driver call, and the
// memory a step needs is the plan's peak, not what a pool's placement left free and
// scattered (the pool's remapping of scattered pages at a step's peak is what made a tight
// VMM pool cost 1-17% of a training step). A cycle that leaves the plan gives the region
// back at once (so another phase of the loop, an evaluation say, runs on the pool's memory,
// not beside the region): the planned allocations still live in it become the pool's own
// (pool_base::free_except), which is why the layout puts those that live across the mark
// (gradients a zero_grad at the top of the loop frees) together at the bottom. The next
// cycle takes the region again. A cycle left at its first request (an evaluation pass
// where the next training step begins) rejoins the plan when the pass's allocations are all
// freed and the request a cycle begins with comes (once a step); so does a step that
// reaches its cycle's first event with other live bytes than cycles begin with (a pass
// after the optimizer's mark). Taking the region again maps only the pages the pool moved
// out of it meanwhile (vmm_page_pool grows a huge request's free run in place): 14-18 maps
// for four evaluations on the H200, where a gather of its pages costs ~0.45 s for 15.6 GB.
//
// Safety: a planned cycle follows the recorded sequence exactly. The first request or
// planned free that differs (another size or stream, a free out of order) takes the cycle
// off the plan: its remaining requests go to the pool, so a planned address is handed out
// only when the same allocations as in the recorded cycle have been freed before it, on
// the plan's stream (reuse in that stream's order, as the pool's own). A planned
// allocation freed on another stream makes the plan's stream wait for that stream's work.
// A cycle begins on the plan only when no planned allocation is live. When the loop
// changes (two steps in a row the same but not the plan), the plan is rebuilt once the
// region is idle. Allocations made before the first mark, those that outlive their cycle,
// and those of other streams are the pool's, as without a plan. While the pool sleeps
// (vmm_page_pool::sleep) every allocation is refused with the pool's own
// gpumem::invalid_argument, planned ones too (the region's pages sleep with the pool's).
//
// Threads: before the first mark every call goes straight to the pool (one atomic load
// more, no shared write: a planner no one marks costs nothing); from it on, calls take the
// planner's lock (a step's order is one thread's order; a loop that allocates from several
// threads at once does not repeat and is not planned).
//
// Stats: the pool's until the first mark; from it, live and peak live bytes and counts are
// the planner's own, continuing the pool's figures at the mark (as exact as the pool's
// shared totals are then, with other threads allocating) with planned allocations in and
// the region out; reserved bytes are always the pool's.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

namespace detail {
struct step_event;
}

struct step_planner_counts {
  std::uint64_t steps = 0;                // mark_step calls
  std::uint64_t plans_built = 0;
  std::uint64_t planned_steps = 0;        // steps (cycles) begun on a plan
  std::uint64_t steps_left_plan = 0;      // of those, steps that left it (a difference)
  std::uint64_t steps_rejoined = 0;       // steps that left it and rejoined it where a
                                          // cycle begins (after an evaluation pass, say)
  std::uint64_t planned_allocations = 0;  // served from a region
  std::uint64_t region_failures = 0;      // marks where the pool could not give the region
  std::uint64_t region_takes = 0;         // regions taken from the pool (one more after each
                                          // step that left the plan and gave it back)
  std::uint64_t regions_handed_over = 0;  // regions given back while planned allocations
                                          // lived in them (those became the pool's)
  std::uint64_t steps_too_long = 0;       // steps of more events than are recorded
  std::size_t region_bytes = 0;           // the region held now (0: none)
  std::size_t plan_lower_bound = 0;       // peak planned bytes live at once, of that plan
  std::size_t planned_count = 0;          // allocations per step the plan serves
  std::size_t planned_live_bytes = 0;     // requested bytes of live planned allocations
};

class step_planner final : public memory_resource {
 public:
  // Plans at most this many allocations of a step (the largest): building a plan costs
  // O(n^2) in them, once per change of the loop.
  static constexpr std::size_t default_max_planned = 32768;
  // A step is recorded up to max_planned x this many events (frees, allocations of other
  // streams, ...); a longer one is dropped and not planned, so host memory stays bounded
  // (~10 MB a recording by default) however rarely the loop marks.
  static constexpr std::size_t events_per_planned = 8;

  // REQUIRES: `pool` outlives the planner.
  explicit step_planner(pool_base& pool, std::size_t max_planned = default_max_planned);
  // Gives the region back to the pool (planned allocations still live die with it, as
  // a pool's live allocations die with the pool). Never throws.
  ~step_planner() override;

  // The loop's step boundary. Throws what the pool throws for the region only if it is a
  // driver failure (out of memory, or a region larger than the device, just leaves the
  // step unplanned; the region is asked for again later).
  void mark_step();

  step_planner_counts counts() const;
  pool_base& pool() const noexcept { return pool_; }

  std::string_view name() const noexcept override { return name_; }
  std::size_t max_alignment() const noexcept override { return pool_.max_alignment(); }
  resource_stats stats() const override;
  std::string validate() const override;
  void release_stream(stream_handle stream) override;
  // The pool's segments, with the region's block shown as the planned allocations live in
  // it (allocated) and the rest of the region (free), for snapshots.
  std::vector<memory_segment> memory_segments() const;
  // The same change to segments read from this planner's pool (snapshots read them under
  // the pool's lock, then call this without it: the planner's lock comes first).
  void show_plan_in(std::vector<memory_segment>& segments) const;

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;

 private:
  struct state;  // recordings, the plan, the region, live allocations (step_planner.cpp)

  // REQUIRES: mutex_ held.
  bool take_region(state& s);        // from the pool, for s.plan; false: not now
  // The region's alignment, and so the most a planned request may ask for.
  std::size_t region_alignment() const noexcept {
    return std::min<std::size_t>(512, pool_.max_alignment());
  }
  void give_region_back(state& s);   // REQUIRES: no planned allocation live
  void hand_region_over(state& s);   // the planned allocations live become the pool's
  void leave_plan(state& s);         // the rest of this cycle goes to the pool
  void record(state& s, const detail::step_event& e);  // this step's next event
  void begin_cycle_if_due(state& s); // at the plan's cycle start: on the plan if it can
  void begin_cycle(state& s);        // a cycle begins here, on the plan if it can
  // Before an allocation: a step that left the plan rejoins it where `request` begins a
  // cycle (once a step).
  void rejoin_if_due(state& s, const detail::step_event& request);
  void count_alloc(std::size_t bytes) noexcept;
  void count_free(std::size_t bytes) noexcept;

  pool_base& pool_;
  const std::size_t max_planned_;
  const std::string name_;
  // False until the first mark_step; then every call takes mutex_.
  std::atomic<bool> recording_{false};
  mutable std::mutex mutex_;
  std::unique_ptr<state> s_;
  // From the first mark (written under mutex_, read by stats() without it).
  std::atomic<std::size_t> live_bytes_{0}, peak_live_bytes_{0}, live_count_{0};
  std::atomic<std::uint64_t> allocations_{0}, deallocations_{0};
};

}  // namespace gpumem
