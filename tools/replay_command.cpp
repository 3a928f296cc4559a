// gpumem replay TRACE...: runs recorded allocation traces against gpumem's allocators and
// the raw CUDA mechanisms, and reports what each reserved and how fast it was.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "gpumem/pool/pool_factory.hpp"
#include "gpumem/replay/plot.hpp"
#include "gpumem/replay/trace.hpp"
#include "gpumem/telemetry/event_recorder.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/pool/core/overhead.hpp"
#include "gpumem/telemetry/snapshot.hpp"
#include "json_writer.hpp"

namespace gpumem::cli {

namespace {

// An allocator under test with what it stands on; destroyed before its platform.
struct allocator_under_test {
  std::unique_ptr<memory_resource> upstream;
  std::unique_ptr<memory_resource> pool;      // under a step planner (--step-plan)
  std::unique_ptr<memory_resource> resource;  // destroyed first (declared last)
};

// Puts a step planner in front of a pool (other resources are left as they are).
void plan_steps(allocator_under_test& a) {
  auto* pool = dynamic_cast<pool_base*>(a.resource.get());
  if (pool == nullptr) return;
  a.pool = std::move(a.resource);
  a.resource = std::make_unique<step_planner>(*pool);
}

const std::vector<std::string> allocator_names = {"runtime", "driver", "vmm", "caching_pool",
                                                  "vmm_page_pool"};

allocator_under_test make_allocator(const std::string& name, platform& p, int device,
                                    const pool_options& options) {
  resource_spec spec;
  spec.allocator = name;
  spec.device = device;
  spec.options = options;
  made_resource made = make_resource(p, spec);
  allocator_under_test a;
  a.upstream = std::move(made.upstream);
  if (made.pool)
    a.resource = std::move(made.pool);
  else
    a.resource = std::move(made.backend);
  return a;
}

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
                            std::size_t end, bool find_peak, const std::function<void()>& at_stop) {
  platform& p = pool.device_platform();
  std::vector<stream_handle> streams(t.streams.size());
  for (std::size_t i = 1; i < streams.size(); ++i) {
    auto s = p.stream_create(pool.device());
    if (!s) throw cuda_error(std::string(platform_op_name(s.error().call)), s.error().code,
                             s.error().name, s.error().message, "gpumem replay --snapshot");
    streams[i] = s.value();
  }
  auto* lag_sim = gpu_lag > 0 ? dynamic_cast<sim_platform*>(&p) : nullptr;
  if (lag_sim != nullptr) lag_sim->hold_events(true);
  // On the trace's clock, as replay_trace (the same decisions up to the stop).
  trace_clock clock(p, t, &pool);
  std::vector<void*> ptrs(t.allocs, nullptr);
  auto free_live = [&] {
    for (const trace_event& e : t.events)
      if (e.op == trace_event::kind::alloc && ptrs[e.id] != nullptr) {
        pool.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
      }
  };
  prefix_result r;
  const std::size_t n = t.events.size();
  r.stopped_at = std::min(end, n * static_cast<std::size_t>(passes));
  std::size_t peak = 0;
  for (std::size_t g = 0; g < r.stopped_at; ++g) {
    const std::size_t i = g % n;
    if (i == 0 && g > 0) free_live();
    clock.at(static_cast<int>(g / n), i);
    const trace_event& e = t.events[i];
    if (e.op == trace_event::kind::alloc) {
      if (e.size > pool.device_total_bytes()) {  // as replay_trace: an out-of-memory
        r.oom = true;
        r.stopped_at = g;
        break;
      }
      try {
        ptrs[e.id] = pool.allocate(e.size, default_alignment, streams[e.stream]);
      } catch (const out_of_memory&) {
        r.oom = true;
        r.stopped_at = g;
        break;
      }
    } else {
      pool.deallocate(ptrs[e.id], e.size, streams[e.stream]);
      ptrs[e.id] = nullptr;
    }
    if (lag_sim != nullptr && (i + 1) % gpu_lag == 0) lag_sim->complete_events();
    if (find_peak) {
      const std::size_t reserved = pool.stats().reserved_bytes;
      if (reserved > peak) {
        peak = reserved;
        r.peak_at = g;
      }
    }
  }
  if (at_stop) at_stop();
  free_live();
  if (lag_sim != nullptr) {
    lag_sim->complete_events();
    lag_sim->hold_events(false);
  }
  for (std::size_t i = 1; i < streams.size(); ++i) {
    pool.release_stream(streams[i]);
    (void)p.stream_destroy(streams[i]);
  }
  return r;
}

// Where replay_prefix stopped, within its pass: {pass (from 1), event}. After a peak
// (`stopped_at` events ran) the event is the last one run, counted from 1; at an
// out-of-memory, the index of the allocation that failed (from 0, as the table says it).
// A trace with no events stops before any: {1, 0}.
std::pair<std::size_t, std::size_t> pass_and_event(const trace& t, std::size_t stopped_at, bool oom) {
  const std::size_t n = t.events.size();
  if (n == 0) return {1, 0};
  if (oom) return {stopped_at / n + 1, stopped_at % n};
  const std::size_t last = stopped_at - 1;  // with events, a peak comes after at least one
  return {last / n + 1, last % n + 1};
}

// "pass P, after event E of N" (or "at event E" for an out-of-memory).
std::string where_in_trace(const trace& t, std::size_t stopped_at, bool oom, int passes) {
  const auto [pass, event] = pass_and_event(t, stopped_at, oom);
  std::string out = passes > 1 ? "pass " + std::to_string(pass) + ", " : "";
  out += (oom ? "at event " : "after event ") + std::to_string(event);
  return out + " of " + std::to_string(t.events.size());
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

// Refuses an output path that cannot be written, before any replay runs. Opening it to
// append changes no file; one the check creates is removed again.
void check_writable(const std::string& path, const char* option) {
  std::error_code ec;
  const bool existed = std::filesystem::exists(path, ec);
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (f == nullptr)
    throw invalid_argument(std::string("gpumem replay: --") + option + ": cannot write '" + path +
                           "': " + std::strerror(errno));
  std::fclose(f);
  if (!existed) std::remove(path.c_str());
}

// Per allocator over several traces: how many it ran out of memory on, the geometric mean
// of its fragmentation (each trace counts alike, whatever its size) and its worst, and its
// driver time in all. Into `json` (the open top-level object) when given, else printed.
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

}  // namespace

int run_replay(int argc, char** argv) {
  arg_parser parser("gpumem replay",
                    "Replay recorded allocation traces against each allocator and compare "
                    "peak reserved memory, fragmentation and speed.");
  parser.positional("trace", "trace file: PyTorch CSV (action,addr,size,stream,time_us) or "
                             "RMM log CSV, gzip'd or plain; several: each is replayed in "
                             "turn, then a summary per allocator over them all",
                    true, -1)
      .option("allocator", "NAME", "runtime, driver, vmm, caching_pool, vmm_page_pool or all",
              "all", {"all", "runtime", "driver", "vmm", "caching_pool", "vmm_page_pool"})
      .option("device", "KIND", "cuda, sim, or auto (cuda when a GPU is present) (default: "
                                "$GPUMEM_DEVICE, else auto)", std::nullopt, {"auto", "cuda", "sim"})
      .option("capacity", "BYTES", "sim device memory (e.g. 80G), at least one page (2M)", "80G")
      .option("passes", "N", "replay the trace N times on each allocator; the last pass is "
                             "the warm (steady-state) figure, and its driver calls are shown "
                             "on their own (none: the allocator settled)", "2")
      .option("config", "CONF", "pool options, key:value,... (default: GPUMEM_CONF)")
      .option("gpu-lag", "N", "sim only: queued work completes only every N trace events, "
                              "as on a GPU running behind the CPU (0: at once)", "0")
      .option("plot", "FILE.svg", "also draw live and reserved bytes over the trace, per allocator")
      .option("snapshot", "FILE.pickle",
              "also write a PyTorch memory snapshot (torch.cuda.memory._snapshot() format) of "
              "the pool at its peak reserved memory (or its out-of-memory), with the device "
              "trace up to then; of --allocator's pool (vmm_page_pool with all)")
      .option("snapshot-events", "N", "trace events kept in the snapshot, the most recent",
              "100000")
      .flag("explain", "also say where each pool's reserved bytes went at its peak over the "
                       "passes (the pool alone, without a step plan): requested, rounding (and "
                       "the request sizes it costs most), cached, free in shared pages, free "
                       "whole pages, kept pages")
      .flag("step-plan", "put a step planner in front of each pool and mark the steps of the "
                         "loop the trace ends with (its period; see find_steps), as a loop "
                         "calling gpumem.torch.mark_step() would")
      .flag("json", "machine-readable output")
      .epilog("On sim, driver time is modelled from H200 measurements (the table in "
              "src/platform/sim_latency.cpp).\n"
              "A trace that cannot be read or replayed is reported (with --json: as its \"error\") "
              "and the next one replayed; the exit status is then 1.\n"
              "\n"
              "environment:\n"
              "  GPUMEM_DEVICE   platform when --device is not given: auto, cuda or sim");
  const parsed_args args = parser.parse(argc, argv);
  if (args.help_requested()) {
    std::cout << parser.help();
    return 0;
  }
  const std::vector<std::string>& paths = args.positionals();
  if (paths.size() > 1)
    for (const char* one_only : {"plot", "snapshot", "explain"})
      if (args.has(one_only))
        throw invalid_argument(std::string("gpumem replay: --") + one_only +
                               " takes one trace, not " + std::to_string(paths.size()));
  // --device, else $GPUMEM_DEVICE (as gpumem info), else auto.
  std::string device_kind = "auto", device_from = "--device ";
  if (auto d = args.value("device")) {
    device_kind = *d;
  } else if (const char* env = std::getenv("GPUMEM_DEVICE"); env != nullptr && *env != '\0') {
    device_kind = env;
    device_from = "GPUMEM_DEVICE=";
    if (device_kind != "auto" && device_kind != "cuda" && device_kind != "sim")
      throw invalid_argument("GPUMEM_DEVICE: unknown platform '" + device_kind +
                             "': expected cuda, sim or auto");
  }
  const int passes = static_cast<int>(*args.integer("passes", 1, 1000));
  const auto gpu_lag = static_cast<std::size_t>(*args.integer("gpu-lag", 0, 100000000));
  const std::size_t page = sim_options{}.granularity;
  const std::size_t capacity = *args.bytes("capacity", page, "one page of the sim device");
  const pool_options options = args.has("config") ? pool_options::parse(*args.value("config"))
                                                  : pool_options::from_environment();
  std::vector<std::string> names;
  if (args.value_or("allocator", "all") == "all")
    names = allocator_names;
  else
    names = {*args.value("allocator")};

  platform* cuda = nullptr;
  if (device_kind != "sim") {
    std::string why;
    static std::unique_ptr<platform> owned = make_cuda_platform(&why);
    cuda = owned.get();
    if (cuda == nullptr && device_kind == "cuda")
      throw cuda_error("cudaGetDeviceCount", 100, "CUDA_ERROR_NO_DEVICE", why,
                       "gpumem replay (" + device_from + "cuda)");
  }
  const bool on_sim = cuda == nullptr;
  if (on_sim && capacity % page != 0)
    std::fprintf(stderr, "gpumem replay: --capacity %s is not a whole number of %s pages: the sim "
                 "device has %s\n", format_bytes(capacity).c_str(), format_bytes(page).c_str(),
                 format_bytes((capacity + page - 1) / page * page).c_str());
  if (gpu_lag > 0 && !on_sim)
    throw invalid_argument("gpumem replay: --gpu-lag models a GPU on sim; on the GPU the lag is real");

  // Checked before the replays, so a bad snapshot or explain request fails at once.
  auto is_pool = [](const std::string& name) {
    return name == "vmm_page_pool" || name == "caching_pool";
  };
  const std::string chosen = args.value_or("allocator", "all");
  std::string snapshot_allocator;
  if (args.has("snapshot")) {
    snapshot_allocator = chosen == "all" ? "vmm_page_pool" : chosen;
    if (!is_pool(snapshot_allocator))
      throw invalid_argument("gpumem replay: --snapshot needs a pool (caching_pool or "
                             "vmm_page_pool), not '" + snapshot_allocator + "'");
  }
  std::vector<std::string> explained;  // the pools --explain looks at
  if (args.has("explain")) {
    if (chosen != "all" && !is_pool(chosen))
      throw invalid_argument("gpumem replay: --explain needs a pool (caching_pool or "
                             "vmm_page_pool), not '" + chosen + "'");
    explained = chosen == "all" ? std::vector<std::string>{"caching_pool", "vmm_page_pool"}
                                : std::vector<std::string>{chosen};
  }
  const std::size_t snapshot_events =
      args.has("snapshot") ? static_cast<std::size_t>(*args.integer("snapshot-events", 1, 100000000))
                           : 0;

  // Output files are checked before the replays, which may take long. The plot is drawn as
  // SVG only: a path asking for another format (.png, .pdf) is refused, not written as SVG
  // under a name that says otherwise.
  if (args.has("plot")) {
    const std::string plot_path = *args.value("plot");
    const auto dot = plot_path.rfind('.');
    const std::string ext = dot == std::string::npos ? "" : plot_path.substr(dot);
    if (ext != ".svg" && ext != ".SVG")
      throw invalid_argument("gpumem replay --plot: '" + plot_path + "' asks for " +
                             (ext.empty() ? std::string("no format") : ext.substr(1) + " output") +
                             ", which gpumem cannot draw: it writes SVG (give a path ending in "
                             ".svg; rsvg-convert or a browser turns it into PNG)");
  }
  for (const char* output : {"plot", "snapshot"})
    if (args.has(output)) check_writable(*args.value(output), output);

  std::unique_ptr<json_writer> json;
  if (args.has("json")) json = std::make_unique<json_writer>(std::cout);
  if (json != nullptr && paths.size() > 1) json->begin_object().key("traces").begin_array();
  std::vector<std::vector<replay_result>> all_results;  // by trace replayed
  std::vector<std::string> replayed, failed;           // paths
  // A trace that fails is reported (with --json, as an object with its "error", so the
  // output stays one valid JSON text) and the next one replayed.
  for (const std::string& path : paths) try {
    const trace t = load_trace(path);
    std::vector<std::size_t> step_starts;
    if (args.has("step-plan")) {
      step_starts = find_steps(t);
      if (!args.has("json"))
        std::fprintf(stderr, "%s: %zu repeating steps found%s\n", path.c_str(), step_starts.size(),
                     step_starts.empty() ? " (the trace does not end in a loop of equal steps)" : "");
    }

    std::vector<replay_result> results;
    for (const std::string& name : names) {
      // Each allocator gets a fresh sim device so counts and capacity are its own.
      std::unique_ptr<sim_platform> sim;
      std::unique_ptr<timed_platform> timed;  // on the GPU: measures time in each CUDA call
      if (on_sim) {
        sim_options so;
        so.capacity = capacity;
        so.latency = sim_latency::model;
        sim = std::make_unique<sim_platform>(so);
      }
      if (!on_sim) timed = std::make_unique<timed_platform>(*cuda);
      platform& p = on_sim ? static_cast<platform&>(*sim) : static_cast<platform&>(*timed);
      if (!args.has("json")) {
        std::fprintf(stderr, "replaying %s on %s (%s)...\n", path.c_str(), name.c_str(),
                     on_sim ? "sim" : "cuda");
      }
      allocator_under_test a = make_allocator(name, p, 0, options);
      if (args.has("step-plan")) plan_steps(a);
      replay_options ro;
      ro.passes = passes;
      ro.gpu_lag = gpu_lag;
      ro.step_starts = step_starts;
      results.push_back(replay_trace(t, *a.resource, ro));
    }

    if (args.has("plot")) {
      const std::string plot_path = *args.value("plot");
      std::FILE* f = std::fopen(plot_path.c_str(), "w");
      if (f == nullptr) throw invalid_argument("gpumem replay: cannot write the plot to '" + plot_path + "'");
      const std::string svg = render_replay_svg(
          results, "gpumem replay " + path + " (" + (on_sim ? "sim" : "cuda") + ")");
      const bool written = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
      if (std::fclose(f) != 0 || !written)
        throw invalid_argument("gpumem replay: writing the plot to '" + plot_path + "' failed");
      if (!args.has("json")) std::fprintf(stderr, "plot written to %s\n", plot_path.c_str());
    }

    // Replays the trace's passes on a fresh device to find the event after which
    // `allocator`'s reserved bytes peak (or where it ran out of memory), then on another fresh
    // device up to there: `before` sees the pool first, `at_stop` at that point, and `after` last,
    // even when the replay throws (REQUIRES: `after` does not throw). Deterministic on sim;
    // on a GPU the two runs may differ where the map worker's timing does.
    auto replay_to_peak = [&](const std::string& allocator,
                              const std::function<void(pool_base&)>& before,
                              const std::function<void(pool_base&)>& at_stop,
                              const std::function<void(pool_base&)>& after) {
      auto fresh_platform = [&]() -> std::pair<std::unique_ptr<platform>, platform*> {
        if (on_sim) {
          sim_options so;
          so.capacity = capacity;
          so.latency = sim_latency::model;  // as the replays above
          auto sim = std::make_unique<sim_platform>(so);
          platform* raw = sim.get();
          return {std::move(sim), raw};
        }
        return {nullptr, cuda};
      };
      std::size_t stop_after = 0;
      {
        auto [owned, p] = fresh_platform();
        allocator_under_test a = make_allocator(allocator, *p, 0, options);
        auto& pool = dynamic_cast<pool_base&>(*a.resource);
        const prefix_result first = replay_prefix(t, pool, passes, gpu_lag, static_cast<std::size_t>(-1), true, {});
        stop_after = first.oom ? first.stopped_at + 1 : first.peak_at + 1;
      }
      auto [owned, p] = fresh_platform();
      allocator_under_test a = make_allocator(allocator, *p, 0, options);
      auto& pool = dynamic_cast<pool_base&>(*a.resource);
      struct run_after {
        const std::function<void(pool_base&)>& after;
        pool_base& pool;
        ~run_after() {
          if (after) after(pool);
        }
      } at_exit{after, pool};
      if (before) before(pool);
      return replay_prefix(t, pool, passes, gpu_lag, stop_after, false, [&] { at_stop(pool); });
    };

    if (args.has("snapshot")) {
      const std::string snap_path = *args.value("snapshot");
      recorder_options ro;
      ro.capacity = snapshot_events;
      event_recorder recorder(ro);
      std::size_t reserved_at_snapshot = 0;
      const prefix_result second = replay_to_peak(
          snapshot_allocator, [&](pool_base& pool) { recorder.attach(pool); },
          [&](pool_base& pool) {
            write_memory_snapshot(pool, &recorder, snap_path);
            reserved_at_snapshot = pool.stats().reserved_bytes;
          },
          [&](pool_base&) { recorder.detach(); });  // before the pool goes
      if (!args.has("json"))
        std::fprintf(stderr,
                     "snapshot of %s written to %s: %s (%s), %s reserved, "
                     "%zu trace events kept of %llu\n",
                     snapshot_allocator.c_str(), snap_path.c_str(),
                     where_in_trace(t, second.stopped_at, second.oom, passes).c_str(),
                     second.oom ? "out of memory" : "peak reserved",
                     format_bytes(reserved_at_snapshot).c_str(),
                     static_cast<std::size_t>(std::min<std::uint64_t>(recorder.recorded(), snapshot_events)),
                     static_cast<unsigned long long>(recorder.recorded()));
    }

    // --explain: each pool's overhead at its peak over the passes (or out-of-memory).
    struct explanation {
      overhead_breakdown breakdown;
      std::size_t stopped_at = 0;  // global event index (pass * events + index)
      bool oom = false;
    };
    std::map<std::string, explanation> explanations;
    for (const std::string& name : explained) {
      if (!args.has("json"))
        std::fprintf(stderr, "explaining %s's peak...\n", name.c_str());
      explanation& e = explanations[name];
      const prefix_result r = replay_to_peak(name, {}, [&](pool_base& pool) {
        e.breakdown = explain_overhead(pool);
      }, {});
      e.stopped_at = r.stopped_at;
      e.oom = r.oom;
    }

    all_results.push_back(results);
    replayed.push_back(path);
    if (json != nullptr) {
      json_writer& w = *json;
      w.begin_object();
      w.member("trace", path);
      w.member("device", on_sim ? "sim" : "cuda");
      w.member("events", t.events.size());
      w.key("anomalies").begin_object();
      w.member("unmatched_frees", t.unmatched_frees);
      w.member("double_frees", t.double_frees);
      w.member("reused_addresses", t.reused_addresses);
      w.member("mismatched_free_sizes", t.mismatched_free_sizes);
      w.end_object();
      w.member("passes", passes);
      w.member("gpu_lag", gpu_lag);
      w.key("results").begin_array();
      for (const auto& r : results) {
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
        if (passes > 1) {
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
        if (args.has("step-plan")) {
          w.member("steps_marked", r.steps_marked);
          w.member("plans_built", r.plans_built);
          w.member("planned_allocations", r.planned_allocations);
          w.member("steps_left_plan", r.steps_left_plan);
          w.member("steps_rejoined", r.steps_rejoined);
          w.member("regions_handed_over", r.regions_handed_over);
        }
        w.member("oom", r.oom);
        if (auto e = explanations.find(r.allocator); e != explanations.end()) {
          const overhead_breakdown& b = e->second.breakdown;
          w.key("peak_breakdown").begin_object();
          const auto [pass, event] = pass_and_event(t, e->second.stopped_at, e->second.oom);
          w.member("pass", pass);
          w.member(e->second.oom ? "event" : "after_event", event);
          w.member("at", e->second.oom ? "out_of_memory" : "peak_reserved");
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
        if (r.oom) {
          w.member("oom_event", r.oom_event);
          w.member("oom_report", r.oom_message);
        }
        w.end_object();
      }
      w.end_array();
      w.end_object();
      continue;
    }

    if (all_results.size() > 1) std::printf("\n");
    std::printf("trace %s: %zu events (%zu allocs, %zu frees), peak live %s, %zu stream(s)\n",
                path.c_str(), t.events.size(), t.allocs, t.frees,
                format_bytes(t.peak_live_bytes).c_str(), t.streams.size());
    if (const std::string anomalies = describe_anomalies(t); !anomalies.empty())
      std::printf("anomalies: %s\n", anomalies.c_str());
    std::printf("device: %s; %d pass(es), ns/event cold = first pass, warm = last pass%s%s\n\n",
                on_sim ? "sim" : "cuda", passes,
                on_sim ? "; driver ms modelled from H200 latencies" : "; driver ms measured",
                gpu_lag > 0 ? ("; queued work completes every " + std::to_string(gpu_lag) +
                               " events (--gpu-lag)").c_str()
                            : "");
    std::printf("%-14s %12s %12s %8s %10s %10s %10s  %s\n", "allocator", "peak live",
                "peak reserv", "frag", "ns/ev cold", "ns/ev warm", "driver ms", "driver calls");
    for (const auto& r : results) {
      char driver_ms[32];
      std::snprintf(driver_ms, sizeof driver_ms, "%.1f", r.driver_ns / 1e6);
      std::printf("%-14s %12s %12s %8.4f %10.0f %10.0f %10s  %s\n", r.allocator.c_str(),
                  format_bytes(r.peak_live_bytes).c_str(), format_bytes(r.peak_reserved_bytes).c_str(),
                  r.fragmentation, r.ns_per_event_cold, r.ns_per_event_warm, driver_ms,
                  describe_calls(r).c_str());
      if (passes > 1 && !r.oom)
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
      if (r.oom) {
        std::printf("  %s: OUT OF MEMORY replaying %s at event %llu:\n%s\n", r.allocator.c_str(),
                    path.c_str(), static_cast<unsigned long long>(r.oom_event),
                    r.oom_message.c_str());
      }
    }
    for (const auto& [name, e] : explanations) {
      std::printf("\nwhere the reserved bytes went, %s (%s)%s:\n",
                  e.oom ? "at the out-of-memory" : "at peak reserved",
                  where_in_trace(t, e.stopped_at, e.oom, passes).c_str(),
                  args.has("step-plan") ? ", the pool alone (no step plan)" : "");
      std::printf("%s", e.breakdown.to_string("  ").c_str());
    }
  } catch (const std::exception& e) {
    failed.push_back(path);
    if (json != nullptr)
      json->begin_object().member("trace", path).member("error", e.what()).end_object();
    else
      std::fprintf(stderr, "gpumem: error: %s\n", e.what());
  }  // each trace

  if (paths.size() > 1) print_summary(replayed, all_results, json.get(), on_sim, passes);
  if (json != nullptr) {
    if (paths.size() > 1) json->member("failed_traces", failed.size()).end_object();
    std::cout << "\n";
  }
  if (!failed.empty() && paths.size() > 1)
    std::fprintf(stderr, "gpumem replay: %zu of %zu traces failed (first: %s)\n", failed.size(),
                 paths.size(), failed.front().c_str());
  return failed.empty() ? 0 : 1;
}

}  // namespace gpumem::cli
