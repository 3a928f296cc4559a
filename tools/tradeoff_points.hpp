// The points of `gpumem replay --tradeoff-plot`: fragmentation against warm ns per event,
// one per trace and allocator, from this run's replays or from a JSON file of figures.
#pragma once

#include <string>
#include <vector>

#include "gpumem/replay/plot.hpp"

namespace gpumem::cli {

// One point per result of a replay of `trace`; on sim the modelled ns per event (host time
// plus the modelled H200 driver time of the warm pass).
void add_tradeoff_points(const std::string& trace, const std::vector<replay_result>& results,
                         bool on_sim, std::vector<tradeoff_point>& points);

// Reads points from `path`, in any of these shapes:
//  - what `gpumem replay --json` writes: one trace's object {"trace", "results": [...]}, or
//    {"traces": [...]} of several (a trace that failed, with its "error", is skipped);
//  - an array of {"trace", "allocator", "fragmentation", "ns_per_event"} (torch_replay_bench
//    --json writes these; GPU figures by hand); one with "oom": true is left out.
// In results, "modelled_ns_per_event" is taken where present, else "ns_per_event".
// Throws gpumem::invalid_argument naming the file for one that cannot be read, is not JSON,
// or has another shape, or a point lacking a field.
std::vector<tradeoff_point> read_tradeoff_points(const std::string& path);

}  // namespace gpumem::cli
