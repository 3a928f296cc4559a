// gpumem serve-sim: a seeded LLM-serving simulation comparing KV memory strategies on one
// budget (tools/serve_sim.hpp): peak concurrent sequences, KV waste, prefix hit rate,
// preemptions and block operations per second.
#include <cstdio>
#include <limits>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "json_writer.hpp"
#include "serve_sim.hpp"

namespace gpumem::cli {

namespace {

arg_parser serve_sim_parser() {
  arg_parser parser("gpumem serve-sim",
                    "simulate LLM serving and compare KV cache memory strategies on one budget");
  parser.option("strategy", "NAME", "contiguous, paged, paged_prefix, elastic or all", "all",
                {"contiguous", "paged", "paged_prefix", "elastic", "all"})
      .option("device", "KIND", "sim, cuda, or auto (cuda when a GPU is present)", "sim",
              {"auto", "sim", "cuda"})
      .option("budget", "BYTES", "KV memory budget, the same for every strategy", "8G")
      .option("requests", "N", "requests to serve", "1000")
      .option("rate", "R", "mean arrivals per second (Poisson); any finite positive rate "
                           "(a very large one: every request arrives at once)", "30")
      .option("load-period", "SECONDS",
              "arrivals swing between 10% and 100% of --rate over this period (0: constant)", "60")
      .option("seed", "N", "workload seed", "1")
      .option("workload", "PATH",
              "serve the requests of this file instead of generated ones: one per line, "
              "ARRIVAL_SECONDS OUTPUT_TOKENS SAMPLES TOKEN... (examples/serve_llama.py --workload-out writes one)")
      .option("max-model-len", "TOKENS", "longest sequence (what contiguous reserves)", "4096")
      .option("prompt-median", "TOKENS", "median user prompt (log-normal, sigma 1)", "256")
      .option("output-median", "TOKENS", "median output (log-normal, sigma 1)", "160")
      .option("shared-prefix", "F", "fraction of requests opening with a shared system prompt", "0.4")
      .option("multi-sample", "F", "fraction of requests sampling n = 2..4 outputs", "0.1")
      .option("preempt", "HOW", "recompute or swap (to pinned host memory)", "recompute",
              {"recompute", "swap"})
      .option("layers", "N", "model layers", "32")
      .option("kv-heads", "N", "KV heads", "8")
      .option("head-dim", "N", "head dimension", "128")
      .option("dtype", "T", "KV dtype: fp8, f16, bf16, f32", "bf16")
      .option("block-tokens", "N", "tokens per KV block", "16")
      .option("kv-store", "URL",
              "a Redis tier below the GPU: redis://HOST:PORT or redis-cluster://HOST:PORT,...", "")
      .option("host-tier", "BYTES", "a pinned host memory tier below the GPU, per instance (0: none)", "0")
      .option("instances", "N", "serving instances (one cache each, the same budget each) "
                                "sharing the tiers; requests round robin", "1")
      .flag("tier-write-through", "every evicted block to every tier (not only the first with room)")
      .flag("json", "machine-readable output")
      .epilog("Default model: Llama-3-8B's KV shape (32 layers, 8 KV heads, 128 dims, bf16).\n"
              "Example:\n  gpumem serve-sim --requests 2000 --rate 40 --json\n"
              "  gpumem serve-sim --budget 2G --instances 4 --kv-store redis://127.0.0.1:6379\n"
              "Tiers (docs/KV_TIERS.md) apply to paged_prefix and elastic.\n");
  return parser;
}

serve_sim_config serve_sim_config_from(const parsed_args& args) {
  serve_sim_config c;
  c.layout.layers = static_cast<std::size_t>(*args.integer("layers", 1, 1024));
  c.layout.kv_heads = static_cast<std::size_t>(*args.integer("kv-heads", 1, 1024));
  c.layout.head_dim = static_cast<std::size_t>(*args.integer("head-dim", 1, 4096));
  c.layout.dtype = parse_kv_dtype(args.value_or("dtype", "bf16"));
  c.layout.block_tokens = static_cast<std::size_t>(*args.integer("block-tokens", 1, 4096));
  c.budget_bytes = *args.bytes("budget", 1);
  c.requests = static_cast<std::size_t>(*args.integer("requests", 1, 10000000));
  c.seed = static_cast<std::uint64_t>(*args.integer("seed", 0));
  c.max_model_len = static_cast<std::size_t>(*args.integer("max-model-len", 16, 1 << 22));
  // Rates and periods: any finite positive value has a meaning. Lengths: up to the longest
  // --max-model-len (a sampled length must fit a size_t).
  constexpr double longest = 1 << 22;
  c.arrival_rate = *args.number("rate", 0, std::numeric_limits<double>::max(), true);
  c.load_period_seconds = *args.number("load-period", 0, std::numeric_limits<double>::max());
  c.prompt_median = *args.number("prompt-median", 1, longest);
  c.output_median = *args.number("output-median", 1, longest);
  c.shared_prefix_fraction = *args.number("shared-prefix", 0, 1);
  c.multi_sample_fraction = *args.number("multi-sample", 0, 1);
  c.preempt_swap = args.value_or("preempt", "recompute") == "swap";
  c.kv_store_url = args.value_or("kv-store", "");
  c.host_tier_bytes = *args.bytes("host-tier", 0);
  c.instances = static_cast<std::size_t>(*args.integer("instances", 1, 1024));
  c.tier_write_through = args.has("tier-write-through");
  if (args.has("workload")) {
    c.workload = read_serve_workload(args.value_or("workload", ""));
    c.requests = c.workload.size();
  }
  // A bad URL, or a build without the Redis tier, says so before anything runs.
  if (!c.kv_store_url.empty()) (void)make_redis_store(c.kv_store_url);
  return c;
}

void write_json(const std::vector<serve_sim_result>& results) {
  json_writer w(std::cout);
  w.begin_array();
  for (const auto& r : results) {
    w.begin_object()
        .member("strategy", r.strategy)
        .member("max_concurrent", r.max_concurrent)
        .member("waste_fraction", r.waste_fraction)
        .member("prefix_hit_rate", r.prefix_hit_rate)
        .member("preemptions", r.preemptions)
        .member("completed", r.completed)
        .member("rejected", r.rejected)
        .member("sim_seconds", r.sim_seconds)
        .member("mean_concurrent", r.mean_concurrent)
        .member("kv_bytes_mean", r.kv_bytes_mean)
        .member("kv_bytes_peak", r.kv_bytes_peak)
        .member("block_ops", r.block_ops)
        .member("block_ops_per_second", r.block_ops_per_second)
        .member("prompt_tokens", r.prompt_tokens)
        .member("cached_prompt_tokens", r.cached_prompt_tokens);
    w.key("tier_hits").begin_object();
    for (const auto& t : r.tiers) w.member(t.name, t.hits);
    w.end_object();
    w.member("tier_lookups", r.tier_lookups)
        .member("tier_puts", r.tier_puts)
        .member("tier_errors", r.tier_errors)
        .member("writebacks_dropped", r.writebacks_dropped)
        .member("recomputed_tokens_saved", r.recomputed_tokens_saved)
        .end_object();
  }
  w.end_array();
  std::cout << "\n";
}

void print_table(const serve_sim_config& c, const std::vector<serve_sim_result>& results,
                 bool on_cuda) {
  std::printf("serve-sim: %zu requests at up to %.6g/s, seed %llu, budget %s, %s KV (%s per token), "
              "%s device, preempt by %s\n",
              c.requests, c.arrival_rate, static_cast<unsigned long long>(c.seed),
              format_bytes(c.budget_bytes).c_str(), std::string(kv_dtype_name(c.layout.dtype)).c_str(),
              format_bytes(c.layout.bytes_per_token()).c_str(), on_cuda ? "cuda" : "sim",
              c.preempt_swap ? "swap" : "recompute");
  std::printf("%-13s %8s %8s %7s %7s %8s %9s %11s %12s %9s\n", "strategy", "peak_seq", "mean_seq",
              "waste", "prefix", "preempt", "sim_time", "kv_mean", "block_ops/s", "rejected");
  for (const auto& r : results)
    std::printf("%-13s %8zu %8.1f %6.2f%% %6.1f%% %8llu %8.1fs %11s %12.3g %9zu\n", r.strategy.c_str(),
                r.max_concurrent, r.mean_concurrent, 100 * r.waste_fraction,
                100 * r.prefix_hit_rate, static_cast<unsigned long long>(r.preemptions),
                r.sim_seconds, format_bytes(static_cast<std::size_t>(r.kv_bytes_mean)).c_str(),
                r.block_ops_per_second, r.rejected);
}

void print_tiers(const serve_sim_config& c, const std::vector<serve_sim_result>& results) {
  bool any_tiers = false;
  for (const auto& r : results) any_tiers = any_tiers || !r.tiers.empty();
  if (!any_tiers) return;
  std::printf("\ntiers below the GPU (%zu instance(s)%s):\n", c.instances,
              c.tier_write_through ? ", write-through" : "");
  for (const auto& r : results) {
    if (r.tiers.empty()) continue;
    std::printf("%-13s prompt tokens %llu, not recomputed %llu (%.1f%%), from tiers %llu; "
                "lookups %llu, puts %llu, errors %llu, write-backs dropped %llu\n",
                r.strategy.c_str(), static_cast<unsigned long long>(r.prompt_tokens),
                static_cast<unsigned long long>(r.cached_prompt_tokens),
                r.prompt_tokens ? 100.0 * static_cast<double>(r.cached_prompt_tokens) /
                                      static_cast<double>(r.prompt_tokens)
                                : 0.0,
                static_cast<unsigned long long>(r.recomputed_tokens_saved),
                static_cast<unsigned long long>(r.tier_lookups),
                static_cast<unsigned long long>(r.tier_puts),
                static_cast<unsigned long long>(r.tier_errors),
                static_cast<unsigned long long>(r.writebacks_dropped));
    for (const auto& t : r.tiers)
      std::printf("  %-28s hits %llu (%.1f%% of lookups), puts %llu, errors %llu, corrupt %llu\n",
                  t.name.c_str(), static_cast<unsigned long long>(t.hits),
                  r.tier_lookups ? 100.0 * static_cast<double>(t.hits) /
                                       static_cast<double>(r.tier_lookups)
                                 : 0.0,
                  static_cast<unsigned long long>(t.puts),
                  static_cast<unsigned long long>(t.errors),
                  static_cast<unsigned long long>(t.corrupt));
  }
}

}  // namespace

int run_serve_sim(int argc, char** argv) {
  const arg_parser parser = serve_sim_parser();
  const parsed_args args = parser.parse(argc, argv);
  if (args.help_requested()) {
    std::cout << parser.help();
    return 0;
  }
  const serve_sim_config c = serve_sim_config_from(args);
  const std::string device_kind = args.value_or("device", "sim");
  std::unique_ptr<platform> cuda;
  if (device_kind != "sim") {
    std::string why;
    cuda = make_cuda_platform(&why);
    if (cuda == nullptr && device_kind == "cuda")
      throw cuda_error("cudaGetDeviceCount", 100, "CUDA_ERROR_NO_DEVICE", why, "gpumem serve-sim");
  }
  std::vector<std::string> names = serve_sim_strategies();
  if (args.value_or("strategy", "all") != "all") names = {*args.value("strategy")};

  std::vector<serve_sim_result> results;
  for (const auto& name : names) {
    // A fresh sim device per strategy, sized to the budget with room for the host side.
    std::unique_ptr<sim_platform> sim;
    if (cuda == nullptr) {
      sim_options so;
      so.capacity = c.instances * (c.budget_bytes + c.host_tier_bytes) + (std::size_t{1} << 30);
      sim = std::make_unique<sim_platform>(so);
    }
    platform& p = cuda ? *cuda : *sim;
    results.push_back(run_serve_sim(c, name, p));
  }

  if (args.has("json")) {
    write_json(results);
    return 0;
  }
  print_table(c, results, cuda != nullptr);
  print_tiers(c, results);
  return 0;
}

}  // namespace gpumem::cli
