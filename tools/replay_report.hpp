// gpumem replay's output: per trace, a table (or, with --json, an object) of each
// allocator's memory, speed and driver calls, with where a pool's reserved bytes went at
// its peak (--explain); over several traces, a summary per allocator.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "gpumem/pool/core/overhead.hpp"
#include "gpumem/replay/trace.hpp"
#include "json_writer.hpp"

namespace gpumem::cli {

// A pool's overhead at its peak over the passes (or at its out-of-memory), for --explain.
struct explanation {
  overhead_breakdown breakdown;
  std::size_t stopped_at = 0;  // global event index (pass * events + index)
  bool oom = false;
};

// One trace's replays, as reported.
struct trace_report {
  const trace& t;
  const std::string& path;
  const std::vector<replay_result>& results;       // in the allocators' order
  const std::map<std::string, explanation>& explanations;  // by allocator
  bool on_sim = true;
  int passes = 1;
  std::size_t gpu_lag = 0;
  bool step_plan = false;
  bool large_plan = false;
};

// The trace's object (trace, device, anomalies, results with their breakdowns) into `w`.
void write_trace_json(json_writer& w, const trace_report& report);
// The trace's table on stdout; `after_another`: a blank line first.
void print_trace_table(const trace_report& report, bool after_another);

// Per allocator over several traces: how many it ran out of memory on, the geometric mean
// of its fragmentation (each trace counts alike, whatever its size) and its worst, and its
// driver time in all. Into `json` (the open top-level object) when given, else printed.
void print_summary(const std::vector<std::string>& paths,
                   const std::vector<std::vector<replay_result>>& by_trace, json_writer* json,
                   bool on_sim, int passes);

}  // namespace gpumem::cli
