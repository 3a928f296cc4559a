// Large-request plans in front of a pool, found without marks: the large requests of a loop
// (a training step's activations and largest temporaries) served from one region laid out
// ahead, at the same address every step, with no driver call.
//
// Every request of at least `threshold` bytes is a key (size, stream) fed to a detector
// (src/pool/plan/large_request_detector.hpp) that finds the period of their sequence: the
// step, not the layer. Once two periods in a row match, the large requests of the earlier
// one, with their lifetimes as recorded (positions among large requests and their frees),
// are laid out in one region by build_step_plan, begun at the period's point of fewest live
// large bytes (step_cycle), so lifetimes crossing the period's boundary are planned too.
// Each later large request has a place in the cycle (its count modulo the period). One whose
// key is the plan's for its place, and whose planned range no live planned allocation
// overlaps, gets its planned address; any other goes to the pool as without a plan. So a
// planned address is only ever handed out over free bytes of the region, in the region's
// stream order (a planned allocation freed on another stream makes that stream wait).
//
// The region is one allocation from the pool, taken where a cycle begins on the plan (its
// first request matching). A request whose key differs (a miss) first tries to
// resynchronize: where its last 4 keys occur once in the cycle, the cycle continues from
// there. Otherwise the cycle leaves the plan and the region goes back to the pool at once
// (planned allocations still live in it become the pool's, pool_base::free_except): an idle
// region beside what the loop does instead would be memory the pool cannot use. A plan
// that matches nothing for two periods is dropped; a longer period found (the step, where
// the plan held a layer) replaces it; a shorter one never does.
//
// Measured on sim over the traces in data/ (docs/PAGE_POOL.md): the region, laid out for
// the large requests alone, cannot lend its free gaps to the rest of the loop, and each
// return and re-take of it moves its pages; it is an option of the replay (--large-plan),
// not a default.
//
// Threads: small requests go straight to the pool; large ones take the planner's lock.
// Stats: the pool's, with live bytes those of the planned allocations rather than the
// region's and the region's unused part counted as cached; the peak of live bytes is the
// pool's (the region counted whole while held).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

struct large_plan_options {
  std::size_t threshold = std::size_t{32} << 20;  // the smallest request planned
  std::size_t max_period = 4096;                  // in large requests
  std::size_t min_window = 32;                    // a plan matching none of 2 x max(period,
                                                  // this) requests is dropped
};

struct large_planner_counts {
  std::uint64_t large_requests = 0;
  std::uint64_t plans_built = 0;
  std::uint64_t plans_dropped = 0;
  std::uint64_t planned_allocations = 0;  // served from a region
  std::uint64_t misses = 0;               // requests whose key differed from the plan's
  std::uint64_t resyncs = 0;              // differing requests whose last 4 keys name
                                          // another place of the cycle: the cycle moved there
  std::uint64_t conflicts = 0;            // planned place not free: served by the pool
  std::uint64_t region_takes = 0;
  std::uint64_t regions_handed_over = 0;  // given back with planned allocations live in it
  std::uint64_t region_failures = 0;
  std::size_t period = 0;                 // of the plan held now (0: none)
  std::size_t region_bytes = 0;
};

class large_planner final : public memory_resource {
 public:
  // REQUIRES: `pool` outlives the planner.
  explicit large_planner(pool_base& pool, large_plan_options options = {});
  ~large_planner() override;

  large_planner_counts counts() const;
  pool_base& pool() const noexcept { return pool_; }

  std::string_view name() const noexcept override { return name_; }
  std::size_t max_alignment() const noexcept override { return pool_.max_alignment(); }
  resource_stats stats() const override;
  std::string validate() const override;
  void release_stream(stream_handle stream) override;

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;

 private:
  struct state;  // large_plan.cpp
  // REQUIRES: mutex_ held.
  void give_region_back_if_idle(state& s);  // to the pool, when no planned allocation lives
  void drop_plan(state& s);                 // the region goes back once idle
  void take_region(state& s);               // a cycle begins on the plan, if the pool gives it
  void leave_cycle(state& s);               // the region goes back now (its live planned
                                            // allocations become the pool's)
  pool_base& pool_;
  const large_plan_options options_;
  const std::string name_;
  mutable std::mutex mutex_;
  std::unique_ptr<state> s_;
};

}  // namespace gpumem
