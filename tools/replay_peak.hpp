// gpumem replay's allocators under test, and its partial replays: an allocator built from
// its name (with a step planner in front, for --step-plan), and a trace replayed up to the
// event after which a pool's reserved bytes peak (or where it runs out of memory), the
// point where --snapshot and --explain look at the pool.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/replay/trace.hpp"

namespace gpumem::cli {

// An allocator under test with what it stands on; destroyed before its platform.
struct allocator_under_test {
  std::unique_ptr<memory_resource> upstream;
  std::unique_ptr<memory_resource> pool;      // under a step planner (--step-plan)
  std::unique_ptr<memory_resource> resource;  // destroyed first (declared last)
};

// Puts a step planner in front of a pool (other resources are left as they are).
void plan_steps(allocator_under_test& a);

// The allocator named `name` (runtime, driver, vmm, caching_pool, vmm_page_pool) on `p`.
allocator_under_test make_allocator(const std::string& name, platform& p, int device,
                                    const pool_options& options);

// Runs `passes` passes of `t` on `pool`, on streams of its platform, as replay_trace does
// (allocations still live at the end of a pass are freed before the next; with `gpu_lag`
// on sim, queued work completes only every gpu_lag events), stopping after global event
// `end` (pass * events + index). Returns where it stopped: `end`, or the global index of
// the allocation that ran out of memory; with `find_peak`, also the first global event
// after which reserved bytes reached their peak.
struct prefix_result {
  std::size_t stopped_at = 0;
  bool oom = false;
  std::size_t peak_at = 0;
};

prefix_result replay_prefix(const trace& t, pool_base& pool, int passes, std::size_t gpu_lag,
                            std::size_t end, bool find_peak, const std::function<void()>& at_stop);

// Where the replays to a peak run: passes and lag as the full replays, on a fresh sim
// device of `sim_capacity` bytes for each run, or on `cuda` when it is not null.
struct peak_replay_setup {
  int passes = 1;
  std::size_t gpu_lag = 0;
  std::size_t sim_capacity = 0;
  platform* cuda = nullptr;
  pool_options options;
};

// Replays the passes of `t` on a fresh device to find the event after which `allocator`'s
// reserved bytes peak (or where it ran out of memory), then on another fresh device up to
// there: `before` sees the pool first, `at_stop` at that point, and `after` last, even when
// the replay throws (REQUIRES: `after` does not throw). Deterministic on sim; on a GPU the
// two runs may differ where the map worker's timing does.
prefix_result replay_to_peak(const trace& t, const peak_replay_setup& setup,
                             const std::string& allocator,
                             const std::function<void(pool_base&)>& before,
                             const std::function<void(pool_base&)>& at_stop,
                             const std::function<void(pool_base&)>& after);

// Where replay_prefix stopped, within its pass: {pass (from 1), event}. After a peak
// (`stopped_at` events ran) the event is the last one run, counted from 1; at an
// out-of-memory, the index of the allocation that failed (from 0, as the table says it).
// A trace with no events stops before any: {1, 0}.
std::pair<std::size_t, std::size_t> pass_and_event(const trace& t, std::size_t stopped_at, bool oom);

// "pass P, after event E of N" (or "at event E" for an out-of-memory).
std::string where_in_trace(const trace& t, std::size_t stopped_at, bool oom, int passes);

}  // namespace gpumem::cli
