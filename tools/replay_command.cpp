// gpumem replay TRACE...: runs recorded allocation traces against gpumem's allocators and
// the raw CUDA mechanisms, and reports what each reserved and how fast it was. The command
// line and the loop over traces live here; the allocators and the replays to a pool's peak
// in replay_peak.hpp, the tables and JSON in replay_report.hpp.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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
#include "gpumem/pool/plan/large_planner.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/replay/plot.hpp"
#include "gpumem/replay/trace.hpp"
#include "gpumem/telemetry/event_recorder.hpp"
#include "gpumem/telemetry/snapshot.hpp"
#include "json_writer.hpp"
#include "replay_peak.hpp"
#include "replay_report.hpp"
#include "tradeoff_points.hpp"

namespace gpumem::cli {

namespace {

const std::vector<std::string> allocator_names = {"runtime", "driver", "vmm", "caching_pool",
                                                  "vmm_page_pool"};

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

arg_parser replay_parser() {
  arg_parser parser("gpumem replay",
                    "Replay recorded allocation traces against each allocator and compare "
                    "peak reserved memory, fragmentation and speed.");
  parser.positional("trace", "trace file: PyTorch CSV (action,addr,size,stream,time_us) or "
                             "RMM log CSV, gzip'd or plain; several: each is replayed in "
                             "turn, then a summary per allocator over them all "
                             "(none: only with --tradeoff-points)",
                    false, -1)
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
      .option("tradeoff-plot", "FILE.svg",
              "also draw fragmentation against warm ns per event (on sim: modelled), a point "
              "per trace and allocator, of the traces replayed and of --tradeoff-points")
      .option("tradeoff-points", "FILE.json",
              "points for --tradeoff-plot from a file: gpumem replay --json output, or an "
              "array of {trace, allocator, fragmentation, ns_per_event} (GPU figures, "
              "torch_replay_bench --json)")
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
      .option("large-plan", "BYTES", "put a large-request planner in front of each pool: "
                                     "requests of at least BYTES (e.g. 32M) are planned per "
                                     "step found without marks (docs/PAGE_POOL.md)")
      .flag("json", "machine-readable output")
      .epilog("On sim, driver time is modelled from H200 measurements (the table in "
              "src/platform/sim_latency.cpp).\n"
              "A trace that cannot be read or replayed is reported (with --json: as its \"error\") "
              "and the next one replayed; the exit status is then 1.\n"
              "\n"
              "environment:\n"
              "  GPUMEM_DEVICE   platform when --device is not given: auto, cuda or sim");
  return parser;
}

// The command line, checked before any replay runs (a bad request fails at once).
struct replay_settings {
  std::vector<std::string> names;  // the allocators, in the tables' order
  peak_replay_setup setup;         // passes, lag, the sim's capacity, the GPU (null: sim)
  bool on_sim = true;
  bool json = false;
  bool step_plan = false;
  std::size_t large_plan_bytes = 0;  // 0 unless --large-plan
  std::string plot_path;           // "" unless --plot
  std::string tradeoff_path;       // "" unless --tradeoff-plot
  std::vector<tradeoff_point> tradeoff_points;  // read from --tradeoff-points
  std::string snapshot_path;       // "" unless --snapshot
  std::string snapshot_allocator;
  std::size_t snapshot_events = 0;
  std::vector<std::string> explained;  // the pools --explain looks at
};

// --device, else $GPUMEM_DEVICE (as gpumem info), else auto: {kind, where it came from}.
std::pair<std::string, std::string> device_choice(const parsed_args& args) {
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
  return {device_kind, device_from};
}

// --snapshot's pool and --explain's pools, checked.
void choose_pools(const parsed_args& args, replay_settings& s) {
  auto is_pool = [](const std::string& name) {
    return name == "vmm_page_pool" || name == "caching_pool";
  };
  const std::string chosen = args.value_or("allocator", "all");
  if (args.has("snapshot")) {
    s.snapshot_allocator = chosen == "all" ? "vmm_page_pool" : chosen;
    if (!is_pool(s.snapshot_allocator))
      throw invalid_argument("gpumem replay: --snapshot needs a pool (caching_pool or "
                             "vmm_page_pool), not '" + s.snapshot_allocator + "'");
  }
  if (args.has("explain")) {
    if (chosen != "all" && !is_pool(chosen))
      throw invalid_argument("gpumem replay: --explain needs a pool (caching_pool or "
                             "vmm_page_pool), not '" + chosen + "'");
    s.explained = chosen == "all" ? std::vector<std::string>{"caching_pool", "vmm_page_pool"}
                                  : std::vector<std::string>{chosen};
  }
  s.snapshot_events =
      args.has("snapshot") ? static_cast<std::size_t>(*args.integer("snapshot-events", 1, 100000000))
                           : 0;
}

// Output files are checked before the replays, which may take long. The plot is drawn as
// SVG only: a path asking for another format (.png, .pdf) is refused, not written as SVG
// under a name that says otherwise.
void check_outputs(const parsed_args& args) {
  for (const char* svg_output : {"plot", "tradeoff-plot"}) {
    if (!args.has(svg_output)) continue;
    const std::string plot_path = *args.value(svg_output);
    const auto dot = plot_path.rfind('.');
    const std::string ext = dot == std::string::npos ? "" : plot_path.substr(dot);
    if (ext != ".svg" && ext != ".SVG")
      throw invalid_argument(std::string("gpumem replay --") + svg_output + ": '" + plot_path + "' asks for " +
                             (ext.empty() ? std::string("no format") : ext.substr(1) + " output") +
                             ", which gpumem cannot draw: it writes SVG (give a path ending in "
                             ".svg; rsvg-convert or a browser turns it into PNG)");
  }
  for (const char* output : {"plot", "tradeoff-plot", "snapshot"})
    if (args.has(output)) check_writable(*args.value(output), output);
}

replay_settings parse_settings(const parsed_args& args) {
  const std::vector<std::string>& paths = args.positionals();
  if (paths.empty() && !args.has("tradeoff-points"))
    throw usage_error("gpumem replay: give a trace (or --tradeoff-points with --tradeoff-plot)");
  if (args.has("tradeoff-points") && !args.has("tradeoff-plot"))
    throw usage_error("gpumem replay: --tradeoff-points is drawn by --tradeoff-plot: give both");
  if (paths.size() > 1)
    for (const char* one_only : {"plot", "snapshot", "explain"})
      if (args.has(one_only))
        throw invalid_argument(std::string("gpumem replay: --") + one_only +
                               " takes one trace, not " + std::to_string(paths.size()));
  const auto [device_kind, device_from] = device_choice(args);
  replay_settings s;
  s.setup.passes = static_cast<int>(*args.integer("passes", 1, 1000));
  s.setup.gpu_lag = static_cast<std::size_t>(*args.integer("gpu-lag", 0, 100000000));
  const std::size_t page = sim_options{}.granularity;
  const std::size_t capacity = *args.bytes("capacity", page, "one page of the sim device");
  s.setup.sim_capacity = capacity;
  s.setup.options = args.has("config") ? pool_options::parse(*args.value("config"))
                                       : pool_options::from_environment();
  if (args.value_or("allocator", "all") == "all")
    s.names = allocator_names;
  else
    s.names = {*args.value("allocator")};

  if (device_kind != "sim") {
    std::string why;
    static std::unique_ptr<platform> owned = make_cuda_platform(&why);
    s.setup.cuda = owned.get();
    if (s.setup.cuda == nullptr && device_kind == "cuda")
      throw cuda_error("cudaGetDeviceCount", 100, "CUDA_ERROR_NO_DEVICE", why,
                       "gpumem replay (" + device_from + "cuda)");
  }
  s.on_sim = s.setup.cuda == nullptr;
  if (s.on_sim && capacity % page != 0)
    std::fprintf(stderr, "gpumem replay: --capacity %s is not a whole number of %s pages: the sim "
                 "device has %s\n", format_bytes(capacity).c_str(), format_bytes(page).c_str(),
                 format_bytes((capacity + page - 1) / page * page).c_str());
  if (s.setup.gpu_lag > 0 && !s.on_sim)
    throw invalid_argument("gpumem replay: --gpu-lag models a GPU on sim; on the GPU the lag is real");

  choose_pools(args, s);
  check_outputs(args);
  s.json = args.has("json");
  s.step_plan = args.has("step-plan");
  s.large_plan_bytes = args.bytes("large-plan", 1).value_or(0);
  if (s.step_plan && s.large_plan_bytes != 0)
    throw usage_error("--step-plan and --large-plan are two planners for one pool: give one");
  s.plot_path = args.value_or("plot", "");
  s.tradeoff_path = args.value_or("tradeoff-plot", "");
  if (args.has("tradeoff-points")) s.tradeoff_points = read_tradeoff_points(*args.value("tradeoff-points"));
  s.snapshot_path = args.value_or("snapshot", "");
  return s;
}

// The full replays of `t` on each allocator, each on a fresh device (on sim, so counts and
// capacity are its own; on the GPU, through a timed_platform measuring each CUDA call).
std::vector<replay_result> replay_allocators(const trace& t, const std::string& path,
                                             const replay_settings& s,
                                             const std::vector<std::size_t>& step_starts) {
  std::vector<replay_result> results;
  for (const std::string& name : s.names) {
    std::unique_ptr<sim_platform> sim;
    std::unique_ptr<timed_platform> timed;
    if (s.on_sim) {
      sim_options so;
      so.capacity = s.setup.sim_capacity;
      so.latency = sim_latency::model;
      sim = std::make_unique<sim_platform>(so);
    }
    if (!s.on_sim) timed = std::make_unique<timed_platform>(*s.setup.cuda);
    platform& p = s.on_sim ? static_cast<platform&>(*sim) : static_cast<platform&>(*timed);
    if (!s.json) {
      std::fprintf(stderr, "replaying %s on %s (%s)...\n", path.c_str(), name.c_str(),
                   s.on_sim ? "sim" : "cuda");
    }
    allocator_under_test a = make_allocator(name, p, 0, s.setup.options);
    if (s.step_plan) plan_steps(a);
    if (s.large_plan_bytes != 0) {
      if (auto* pool = dynamic_cast<pool_base*>(a.resource.get())) {
        large_plan_options o;
        o.threshold = s.large_plan_bytes;
        a.pool = std::move(a.resource);
        a.resource = std::make_unique<large_planner>(*pool, o);
      }
    }
    replay_options ro;
    ro.passes = s.setup.passes;
    ro.gpu_lag = s.setup.gpu_lag;
    ro.step_starts = step_starts;
    results.push_back(replay_trace(t, *a.resource, ro));
  }
  return results;
}

void write_plot(const std::vector<replay_result>& results, const std::string& path,
                const replay_settings& s) {
  const std::string& plot_path = s.plot_path;
  std::FILE* f = std::fopen(plot_path.c_str(), "w");
  if (f == nullptr) throw invalid_argument("gpumem replay: cannot write the plot to '" + plot_path + "'");
  const std::string svg = render_replay_svg(
      results, "gpumem replay " + path + " (" + (s.on_sim ? "sim" : "cuda") + ")");
  const bool written = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
  if (std::fclose(f) != 0 || !written)
    throw invalid_argument("gpumem replay: writing the plot to '" + plot_path + "' failed");
  if (!s.json) std::fprintf(stderr, "plot written to %s\n", plot_path.c_str());
}

// --tradeoff-plot: the points of the traces replayed here, then those of --tradeoff-points.
void write_tradeoff_plot(const std::vector<std::string>& replayed,
                         const std::vector<std::vector<replay_result>>& all_results,
                         const replay_settings& s) {
  std::vector<tradeoff_point> points;
  for (std::size_t i = 0; i < replayed.size(); ++i)
    add_tradeoff_points(replayed[i], all_results[i], s.on_sim, points);
  points.insert(points.end(), s.tradeoff_points.begin(), s.tradeoff_points.end());
  const std::string svg = render_tradeoff_svg(
      points, std::string("gpumem replay: fragmentation against warm ns/event") +
                  (replayed.empty() ? "" : s.on_sim ? " (sim: modelled H200 driver time)" : " (cuda)"));
  std::FILE* f = std::fopen(s.tradeoff_path.c_str(), "w");
  if (f == nullptr)
    throw invalid_argument("gpumem replay: cannot write the plot to '" + s.tradeoff_path + "'");
  const bool written = std::fwrite(svg.data(), 1, svg.size(), f) == svg.size();
  if (std::fclose(f) != 0 || !written)
    throw invalid_argument("gpumem replay: writing the plot to '" + s.tradeoff_path + "' failed");
  if (!s.json)
    std::fprintf(stderr, "trade-off plot (%zu points) written to %s\n", points.size(),
                 s.tradeoff_path.c_str());
}

// --snapshot: the pool at its peak reserved memory (or its out-of-memory), with the device
// trace up to then.
void write_snapshot(const trace& t, const replay_settings& s) {
  recorder_options ro;
  ro.capacity = s.snapshot_events;
  event_recorder recorder(ro);
  std::size_t reserved_at_snapshot = 0;
  const prefix_result second = replay_to_peak(
      t, s.setup, s.snapshot_allocator, [&](pool_base& pool) { recorder.attach(pool); },
      [&](pool_base& pool) {
        write_memory_snapshot(pool, &recorder, s.snapshot_path);
        reserved_at_snapshot = pool.stats().reserved_bytes;
      },
      [&](pool_base&) { recorder.detach(); });  // before the pool goes
  if (!s.json)
    std::fprintf(stderr,
                 "snapshot of %s written to %s: %s (%s), %s reserved, "
                 "%zu trace events kept of %llu\n",
                 s.snapshot_allocator.c_str(), s.snapshot_path.c_str(),
                 where_in_trace(t, second.stopped_at, second.oom, s.setup.passes).c_str(),
                 second.oom ? "out of memory" : "peak reserved",
                 format_bytes(reserved_at_snapshot).c_str(),
                 static_cast<std::size_t>(std::min<std::uint64_t>(recorder.recorded(), s.snapshot_events)),
                 static_cast<unsigned long long>(recorder.recorded()));
}

// --explain: each pool's overhead at its peak over the passes (or out-of-memory).
std::map<std::string, explanation> explain_peaks(const trace& t, const replay_settings& s) {
  std::map<std::string, explanation> explanations;
  for (const std::string& name : s.explained) {
    if (!s.json) std::fprintf(stderr, "explaining %s's peak...\n", name.c_str());
    explanation& e = explanations[name];
    const prefix_result r = replay_to_peak(t, s.setup, name, {}, [&](pool_base& pool) {
      e.breakdown = explain_overhead(pool);
    }, {});
    e.stopped_at = r.stopped_at;
    e.oom = r.oom;
  }
  return explanations;
}

}  // namespace

int run_replay(int argc, char** argv) {
  const arg_parser parser = replay_parser();
  const parsed_args args = parser.parse(argc, argv);
  if (args.help_requested()) {
    std::cout << parser.help();
    return 0;
  }
  const std::vector<std::string>& paths = args.positionals();
  const replay_settings s = parse_settings(args);

  std::unique_ptr<json_writer> json;
  if (s.json && !paths.empty()) json = std::make_unique<json_writer>(std::cout);
  if (json != nullptr && paths.size() > 1) json->begin_object().key("traces").begin_array();
  std::vector<std::vector<replay_result>> all_results;  // by trace replayed
  std::vector<std::string> replayed, failed;           // paths
  // A trace that fails is reported (with --json, as an object with its "error", so the
  // output stays one valid JSON text) and the next one replayed.
  for (const std::string& path : paths) try {
    const trace t = load_trace(path);
    std::vector<std::size_t> step_starts;
    if (s.step_plan) {
      step_starts = find_steps(t);
      if (!s.json)
        std::fprintf(stderr, "%s: %zu repeating steps found%s\n", path.c_str(), step_starts.size(),
                     step_starts.empty() ? " (the trace does not end in a loop of equal steps)" : "");
    }
    const std::vector<replay_result> results = replay_allocators(t, path, s, step_starts);
    if (!s.plot_path.empty()) write_plot(results, path, s);
    if (!s.snapshot_path.empty()) write_snapshot(t, s);
    const std::map<std::string, explanation> explanations = explain_peaks(t, s);

    all_results.push_back(results);
    replayed.push_back(path);
    const trace_report report{t, path, results, explanations, s.on_sim, s.setup.passes,
                              s.setup.gpu_lag, s.step_plan, s.large_plan_bytes != 0};
    if (json != nullptr)
      write_trace_json(*json, report);
    else
      print_trace_table(report, all_results.size() > 1);
  } catch (const std::exception& e) {
    failed.push_back(path);
    if (json != nullptr)
      json->begin_object().member("trace", path).member("error", e.what()).end_object();
    else
      std::fprintf(stderr, "gpumem: error: %s\n", e.what());
  }  // each trace

  if (paths.size() > 1) print_summary(replayed, all_results, json.get(), s.on_sim, s.setup.passes);
  if (!s.tradeoff_path.empty()) write_tradeoff_plot(replayed, all_results, s);
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
