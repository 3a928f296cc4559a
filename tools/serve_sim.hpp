// The serving simulation behind `gpumem serve-sim`: a seeded, deterministic stream of
// chat-like requests served step by step (one decode token per running sequence per
// step) by each KV memory strategy on the same memory budget, with the real kv_cache
// doing the paged strategies' block work.
//
// Strategies:
//   contiguous     each sequence reserves max_model_len tokens up front (the pre-paging way)
//   paged          fixed-size blocks allocated as tokens arrive, all memory mapped at start
//   paged_prefix   paged + prefix caching of full blocks (shared system prompts)
//   elastic        paged_prefix whose blocks are mapped on demand and given back to the
//                  page pool when free (capacity follows load)
// A request that could not finish even with the whole budget to itself is rejected at
// admission (counted, not served).
// Preemption (no block for a decode token): the most recently admitted request is
// preempted — recomputed later (freed and re-queued first) or, with preempt_swap, swapped
// to pinned host memory and swapped back in before new admissions.
//
// Tiers below the GPU (paged_prefix and elastic only; they need prefix caching):
// host_tier_bytes of pinned host memory per instance and/or a Redis store (kv_store_url,
// one connection per instance). With instances > 1, each instance is a cache of its own
// (the same budget each, as one GPU each) and requests go round robin; instances share
// the store, so a prefix one evicted is found by the others. Each run uses a key space
// of its own, so strategies (and earlier runs) never hit each other's blocks. Each step
// waits for its write-backs (a real engine's steps are slow enough for them), so tier hits
// do not depend on the speed of the host running the simulation.
//
// Determinism: the workload depends on the seed alone (or is the one given); each strategy serves the same
// requests in the same order; metrics other than host speed are reproducible.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpumem/kv/kv_layout.hpp"
#include "gpumem/platform/platform.hpp"
#include "serve_workload.hpp"

namespace gpumem::cli {

struct serve_sim_config {
  kv_layout layout{32, 8, 128, kv_dtype::bf16, 16};  // Llama-3-8B: 128 KiB per token
  std::size_t budget_bytes = std::size_t{8} << 30;    // KV memory, the same for each strategy
  std::size_t max_model_len = 4096;
  std::size_t requests = 1000;
  double arrival_rate = 30.0;        // requests per second at the peak, Poisson
  // Load swings between 10% and 100% of arrival_rate over this period (0: constant rate),
  // like traffic that rises and falls; elastic capacity follows it.
  double load_period_seconds = 60.0;
  double step_seconds = 0.025;       // one decode step
  double prompt_median = 256, prompt_sigma = 1.0;   // log-normal, clamped to [4, max/2]
  double output_median = 160, output_sigma = 1.0;   // log-normal, clamped to [1, max/4]
  double shared_prefix_fraction = 0.4;  // requests opening with a shared system prompt
  std::size_t system_prompts = 8;
  std::size_t system_prompt_tokens = 384;
  double multi_sample_fraction = 0.1;   // requests with n in [2, max_samples]
  std::size_t max_samples = 4;
  bool preempt_swap = false;
  std::uint64_t seed = 1;
  std::size_t instances = 1;
  std::size_t host_tier_bytes = 0;  // 0: no host tier
  std::string kv_store_url;         // "": no Redis tier
  bool tier_write_through = false;  // every evicted block to every tier
  // The requests to serve; empty: generated from the seed and the fields above (requests,
  // rate, lengths, shared prompts, samples).
  std::vector<serve_request> workload;
};

struct serve_sim_tier_result {
  std::string name;       // "host", or the store URL
  std::uint64_t hits = 0; // blocks brought back from this tier
  std::uint64_t puts = 0, errors = 0, corrupt = 0;
};

struct serve_sim_result {
  std::string strategy;
  std::size_t max_concurrent = 0;      // peak running sequences
  double waste_fraction = 0;           // allocated-but-empty KV slots / allocated, time-averaged
  double prefix_hit_rate = 0;          // full prompt blocks found cached / looked up
  std::uint64_t preemptions = 0;
  std::size_t completed = 0;
  std::size_t rejected = 0;            // could not finish even alone in the budget
  double sim_seconds = 0;              // simulated time to serve every request
  double mean_concurrent = 0;
  double kv_bytes_mean = 0;            // KV memory held (mapped, or reserved), time-averaged
  std::size_t kv_bytes_peak = 0;
  std::uint64_t block_ops = 0;         // block allocations + releases
  double block_ops_per_second = 0;     // per second of host time spent in the simulation
  double host_seconds = 0;
  // Tiers (empty without): per tier, then totals over the instances.
  std::vector<serve_sim_tier_result> tiers;
  std::uint64_t tier_lookups = 0;             // prompt blocks the GPU missed, asked below
  std::uint64_t tier_puts = 0, tier_errors = 0;
  std::uint64_t writebacks_dropped = 0;
  std::uint64_t recomputed_tokens_saved = 0;  // prompt tokens brought back, not recomputed
  std::uint64_t prompt_tokens = 0;            // prompt tokens admitted (recomputes included)
  std::uint64_t cached_prompt_tokens = 0;     // of them, not computed (GPU or tier hits)
};

std::vector<std::string> serve_sim_strategies();
// true when the strategy can use tiers (it caches prefixes).
bool serve_sim_uses_tiers(const std::string& strategy);
// Runs one strategy on device 0 of `p`. Throws gpumem::invalid_argument for a bad config
// or strategy name.
serve_sim_result run_serve_sim(const serve_sim_config& config, const std::string& strategy,
                               platform& p);

}  // namespace gpumem::cli
