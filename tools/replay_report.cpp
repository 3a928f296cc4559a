#include "replay_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "replay_peak.hpp"

namespace gpumem::cli {

namespace {

// "call=count(time)" for each call made (the time where it is >= 1 ms); with `last_pass`,
// the last pass's counts alone, calls it did not make left out.
std::string describe_calls(const replay_result& r, bool last_pass = false) {
  std::string out;
  for (auto& [call, total] : last_pass ? r.last_pass_driver_calls : r.driver_calls) {
    const std::uint64_t n = total;
    if (call == "cudaStreamCreate" || call == "cudaStreamDestroy" || n == 0) continue;
    if (!out.empty()) out += " ";
    out += call + "=" + std::to_string(n);
    if (last_pass) continue;
    auto ns = r.driver_call_ns.find(call);
    if (ns != r.driver_call_ns.end() && ns->second >= 1e6) {  // time where it is >= 1 ms
      char ms[32];
      std::snprintf(ms, sizeof ms, "(%.0fms)", ns->second / 1e6);
      out += ms;
    }
  }
  return out.empty() ? "-" : out;
}

// The last pass's memory-moving driver calls per allocation, as a percentage ("0%" when none).
double last_pass_share(const replay_result& r) {
  return r.last_pass_allocs == 0 ? 0.0
                                 : 100.0 * static_cast<double>(r.last_pass_memory_calls) /
                                       static_cast<double>(r.last_pass_allocs);
}

std::string call_share(const replay_result& r) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f%%", last_pass_share(r));
  return text;
}

// What `t` holds that a well-formed trace never does, in words, or "" when nothing.
std::string describe_anomalies(const trace& t) {
  std::string out;
  auto add = [&](std::size_t n, const char* one, const char* many, const char* handled) {
    if (n == 0) return;
    if (!out.empty()) out += "; ";
    out += std::to_string(n) + " " + (n == 1 ? one : many) + " (" + handled + ")";
  };
  add(t.unmatched_frees, "free of an address never allocated", "frees of addresses never allocated",
      "dropped");
  add(t.double_frees, "double free", "double frees", "dropped");
  add(t.reused_addresses, "allocation at an address still live",
      "allocations at addresses still live", "the earlier one stays live to the end");
  add(t.mismatched_free_sizes, "free naming a size other than its allocation's",
      "frees naming sizes other than their allocations'", "the allocation is freed");
  return out;
}

// Where the reserved bytes went at the pool's peak (--explain), as the "peak_breakdown"
// member of a result's object.
void write_breakdown_json(json_writer& w, const trace& t, const explanation& e) {
  const overhead_breakdown& b = e.breakdown;
  w.key("peak_breakdown").begin_object();
  const auto [pass, event] = pass_and_event(t, e.stopped_at, e.oom);
  w.member("pass", pass);
  w.member(e.oom ? "event" : "after_event", event);
  w.member("at", e.oom ? "out_of_memory" : "peak_reserved");
  w.member("reserved_bytes", b.reserved);
  w.member("requested_bytes", b.requested);
  w.member("unit_rounding_bytes", b.unit_rounding);
  w.member("block_rounding_bytes", b.block_rounding);
  w.member("cached_bytes", b.cached);
  w.member("free_pinned_bytes", b.free_pinned);
  w.member("free_releasable_bytes", b.free_releasable);
  w.member("free_in_small_arena_bytes", b.free_in_small_arena);
  w.member("kept_unmapped_bytes", b.kept_unmapped);
  w.member("other_bytes", b.other);
  w.key("largest_rounding_losses").begin_array();
  for (const rounding_loss& l : b.largest_losses) {
    w.begin_object();
    w.member("requested_bytes", l.requested);
    w.member("block_bytes", l.block);
    w.member("count", l.count);
    w.member("lost_bytes", l.bytes());
    w.end_object();
  }
  w.end_array();
  w.end_object();
}

// One allocator's result as an object of the trace's "results".
void write_result_json(json_writer& w, const trace_report& report, const replay_result& r) {
  const bool on_sim = report.on_sim;
  w.begin_object();
  w.member("allocator", r.allocator);
  w.member("peak_live_bytes", r.peak_live_bytes);
  w.member("peak_reserved_bytes", r.peak_reserved_bytes);
  w.member("fragmentation", r.fragmentation);
  w.member("allocs", r.allocs);
  w.member("frees", r.frees);
  w.member("ns_per_event", r.ns_per_event_warm);
  w.member("ns_per_event_cold", r.ns_per_event_cold);
  w.key("driver_calls").begin_object();
  for (auto& [call, n] : r.driver_calls) w.member(call, n);
  w.end_object();
  if (report.passes > 1) {
    w.key("last_pass_driver_calls").begin_object();
    for (auto& [call, n] : r.last_pass_driver_calls) w.member(call, n);
    w.end_object();
    w.member("last_pass_memory_calls", r.last_pass_memory_calls);
    w.member("last_pass_allocs", r.last_pass_allocs);
  }
  w.key(on_sim ? "modelled_driver_ms_by_call" : "driver_ms_by_call").begin_object();
  for (auto& [call, ns] : r.driver_call_ns) w.member(call, ns / 1e6);
  w.end_object();
  w.member(on_sim ? "modelled_driver_ms" : "driver_ms", r.driver_ns / 1e6);
  if (on_sim) {
    // Host time per event plus the modelled H200 driver time per event of the same pass.
    w.member("modelled_driver_ns_per_event", r.driver_ns_per_event_warm);
    w.member("modelled_driver_ns_per_event_cold", r.driver_ns_per_event_cold);
    w.member("modelled_ns_per_event", r.ns_per_event_warm + r.driver_ns_per_event_warm);
    w.member("modelled_ns_per_event_cold", r.ns_per_event_cold + r.driver_ns_per_event_cold);
  }
  if (report.step_plan) {
    w.member("steps_marked", r.steps_marked);
    w.member("plans_built", r.plans_built);
    w.member("planned_allocations", r.planned_allocations);
    w.member("steps_left_plan", r.steps_left_plan);
    w.member("steps_rejoined", r.steps_rejoined);
    w.member("regions_handed_over", r.regions_handed_over);
  }
  if (report.large_plan) {
    w.member("large_requests", r.large_requests);
    w.member("plans_built", r.plans_built);
    w.member("planned_allocations", r.planned_allocations);
    w.member("large_plan_misses", r.large_plan_misses);
    w.member("large_plan_conflicts", r.large_plan_conflicts);
    w.member("large_plan_region_takes", r.large_plan_region_takes);
    w.member("regions_handed_over", r.regions_handed_over);
  }
  w.member("oom", r.oom);
  if (auto e = report.explanations.find(r.allocator); e != report.explanations.end())
    write_breakdown_json(w, report.t, e->second);
  if (r.oom) {
    w.member("oom_event", r.oom_event);
    w.member("oom_report", r.oom_message);
  }
  w.end_object();
}

// One allocator's row of the trace's table, with its last pass, step plan and
// out-of-memory lines under it.
void print_result_row(const trace_report& report, const replay_result& r) {
  char driver_ms[32];
  std::snprintf(driver_ms, sizeof driver_ms, "%.1f", r.driver_ns / 1e6);
  std::printf("%-14s %12s %12s %8.4f %10.0f %10.0f %10s  %s\n", r.allocator.c_str(),
              format_bytes(r.peak_live_bytes).c_str(), format_bytes(r.peak_reserved_bytes).c_str(),
              r.fragmentation, r.ns_per_event_cold, r.ns_per_event_warm, driver_ms,
              describe_calls(r).c_str());
  if (report.passes > 1 && !r.oom)
    std::printf("%-14s %s memory-moving driver calls for %s allocations (%s): %s\n",
                "  last pass:", std::to_string(r.last_pass_memory_calls).c_str(),
                std::to_string(r.last_pass_allocs).c_str(), call_share(r).c_str(),
                describe_calls(r, true).c_str());
  if (r.steps_marked > 0)
    std::printf("%-14s %llu steps marked, %llu plan(s) built, %llu allocations served from "
                "a plan; %llu steps left it, %llu rejoined, %llu handed the region over\n",
                "  step plan:", static_cast<unsigned long long>(r.steps_marked),
                static_cast<unsigned long long>(r.plans_built),
                static_cast<unsigned long long>(r.planned_allocations),
                static_cast<unsigned long long>(r.steps_left_plan),
                static_cast<unsigned long long>(r.steps_rejoined),
                static_cast<unsigned long long>(r.regions_handed_over));
  if (report.large_plan && !r.oom)
    std::printf("%-14s %llu large requests, %llu plan(s) built, %llu served from a plan, "
                "%llu differed from it, %llu found their place taken; %llu region(s) taken\n",
                "  large plan:", static_cast<unsigned long long>(r.large_requests),
                static_cast<unsigned long long>(r.plans_built),
                static_cast<unsigned long long>(r.planned_allocations),
                static_cast<unsigned long long>(r.large_plan_misses),
                static_cast<unsigned long long>(r.large_plan_conflicts),
                static_cast<unsigned long long>(r.large_plan_region_takes));
  if (r.oom) {
    std::printf("  %s: OUT OF MEMORY replaying %s at event %llu:\n%s\n", r.allocator.c_str(),
                report.path.c_str(), static_cast<unsigned long long>(r.oom_event),
                r.oom_message.c_str());
  }
}

}  // namespace

void write_trace_json(json_writer& w, const trace_report& report) {
  const trace& t = report.t;
  w.begin_object();
  w.member("trace", report.path);
  w.member("device", report.on_sim ? "sim" : "cuda");
  w.member("events", t.events.size());
  w.key("anomalies").begin_object();
  w.member("unmatched_frees", t.unmatched_frees);
  w.member("double_frees", t.double_frees);
  w.member("reused_addresses", t.reused_addresses);
  w.member("mismatched_free_sizes", t.mismatched_free_sizes);
  w.end_object();
  w.member("passes", report.passes);
  w.member("gpu_lag", report.gpu_lag);
  w.key("results").begin_array();
  for (const auto& r : report.results) write_result_json(w, report, r);
  w.end_array();
  w.end_object();
}

void print_trace_table(const trace_report& report, bool after_another) {
  const trace& t = report.t;
  const bool on_sim = report.on_sim;
  if (after_another) std::printf("\n");
  std::printf("trace %s: %zu events (%zu allocs, %zu frees), peak live %s, %zu stream(s)\n",
              report.path.c_str(), t.events.size(), t.allocs, t.frees,
              format_bytes(t.peak_live_bytes).c_str(), t.streams.size());
  if (const std::string anomalies = describe_anomalies(t); !anomalies.empty())
    std::printf("anomalies: %s\n", anomalies.c_str());
  std::printf("device: %s; %d pass(es), ns/event cold = first pass, warm = last pass%s%s\n\n",
              on_sim ? "sim" : "cuda", report.passes,
              on_sim ? "; driver ms modelled from H200 latencies" : "; driver ms measured",
              report.gpu_lag > 0 ? ("; queued work completes every " +
                                    std::to_string(report.gpu_lag) + " events (--gpu-lag)").c_str()
                                 : "");
  std::printf("%-14s %12s %12s %8s %10s %10s %10s  %s\n", "allocator", "peak live",
              "peak reserv", "frag", "ns/ev cold", "ns/ev warm", "driver ms", "driver calls");
  for (const auto& r : report.results) print_result_row(report, r);
  for (const auto& [name, e] : report.explanations) {
    std::printf("\nwhere the reserved bytes went, %s (%s)%s:\n",
                e.oom ? "at the out-of-memory" : "at peak reserved",
                where_in_trace(t, e.stopped_at, e.oom, report.passes).c_str(),
                report.step_plan ? ", the pool alone (no step plan)" : "");
    std::printf("%s", e.breakdown.to_string("  ").c_str());
  }
}

void print_summary(const std::vector<std::string>& paths,
                   const std::vector<std::vector<replay_result>>& by_trace, json_writer* json,
                   bool on_sim, int passes) {
  struct summary {
    std::size_t traces = 0, ooms = 0;
    double log_frag_sum = 0, worst = 0, driver_ns = 0;
    std::string worst_trace;
    // The last pass's memory-moving calls in all, and the worst share of them per allocation.
    std::uint64_t last_pass_calls = 0;
    double worst_share = 0;
    std::string worst_share_trace;
  };
  std::vector<std::pair<std::string, summary>> rows;  // in the tables' order
  for (std::size_t i = 0; i < by_trace.size(); ++i)
    for (const replay_result& r : by_trace[i]) {
      auto row = std::find_if(rows.begin(), rows.end(),
                              [&](const auto& x) { return x.first == r.allocator; });
      if (row == rows.end()) row = rows.insert(rows.end(), {r.allocator, summary{}});
      summary& s = row->second;
      s.traces += 1;
      s.driver_ns += r.driver_ns;
      if (r.oom) {  // its fragmentation then covers the trace only up to the failure
        s.ooms += 1;
        continue;
      }
      s.last_pass_calls += r.last_pass_memory_calls;
      if (s.worst_share_trace.empty() || last_pass_share(r) > s.worst_share) {
        s.worst_share = last_pass_share(r);
        s.worst_share_trace = paths[i];
      }
      s.log_frag_sum += std::log(r.fragmentation);
      if (r.fragmentation > s.worst) {
        s.worst = r.fragmentation;
        s.worst_trace = paths[i];
      }
    }
  auto geomean = [](const summary& s) {
    const std::size_t n = s.traces - s.ooms;
    return n == 0 ? 0.0 : std::exp(s.log_frag_sum / static_cast<double>(n));
  };
  if (json != nullptr) {
    json->end_array().key("summary").begin_array();
    for (const auto& [name, s] : rows) {
      json->begin_object();
      json->member("allocator", name);
      json->member("traces", s.traces);
      json->member("oom_traces", s.ooms);
      json->member("fragmentation_geomean", geomean(s));
      json->member("fragmentation_worst", s.worst);
      json->member("fragmentation_worst_trace", s.worst_trace);
      json->member(on_sim ? "modelled_driver_ms" : "driver_ms", s.driver_ns / 1e6);
      if (passes > 1) {
        json->member("last_pass_memory_calls", s.last_pass_calls);
        json->member("last_pass_calls_per_alloc_worst", s.worst_share / 100.0);
        json->member("last_pass_calls_per_alloc_worst_trace", s.worst_share_trace);
      }
      json->end_object();
    }
    json->end_array();
    return;
  }
  std::printf("\nsummary over %zu traces (%s, %d pass(es)); fragmentation over the traces "
              "replayed without running out of memory\n",
              paths.size(), on_sim ? "sim, driver ms modelled" : "cuda, driver ms measured",
              passes);
  std::printf("%-14s %6s %5s %12s %10s  %s\n", "allocator", "traces", "OOMs", "frag geomean",
              "driver ms", "worst frag (trace)");
  for (const auto& [name, s] : rows)
    std::printf("%-14s %6zu %5zu %12.4f %10.1f  %.4f (%s)\n", name.c_str(), s.traces, s.ooms,
                geomean(s), s.driver_ns / 1e6, s.worst,
                s.worst_trace.empty() ? "-" : s.worst_trace.c_str());
  if (passes < 2) return;
  std::printf("\nlast pass: memory-moving driver calls (create, map, unmap, set access, release, "
              "malloc, free)\n%-14s %10s  %s\n", "allocator", "calls", "worst per allocation (trace)");
  for (const auto& [name, s] : rows)
    std::printf("%-14s %10llu  %.2f%% (%s)\n", name.c_str(),
                static_cast<unsigned long long>(s.last_pass_calls), s.worst_share,
                s.worst_share_trace.empty() ? "-" : s.worst_share_trace.c_str());
}

}  // namespace gpumem::cli
