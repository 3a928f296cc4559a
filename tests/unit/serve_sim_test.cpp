// gpumem serve-sim's engine on small sim workloads: every strategy serves every request,
// runs are reproducible, and the strategies differ the way their memory use says.
#include <gtest/gtest.h>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "../../tools/serve_sim.hpp"

namespace {

using namespace gpumem;
using gpumem::cli::run_serve_sim;
using gpumem::cli::serve_sim_config;
using gpumem::cli::serve_sim_result;

serve_sim_config small() {
  serve_sim_config c;
  c.budget_bytes = std::size_t{1} << 30;  // 512 blocks of 2 MiB
  c.requests = 80;
  c.max_model_len = 2048;
  c.arrival_rate = 40;
  return c;
}

serve_sim_result run(const serve_sim_config& c, const std::string& strategy) {
  sim_options o;
  o.capacity = c.budget_bytes + (std::size_t{1} << 30);
  sim_platform sim(o);
  auto r = run_serve_sim(c, strategy, sim);
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
  return r;
}

TEST(ServeSim, EveryStrategyServesEveryRequestReproducibly) {
  const auto c = small();
  for (const auto& s : gpumem::cli::serve_sim_strategies()) {
    const auto a = run(c, s);
    const auto b = run(c, s);
    EXPECT_EQ(a.completed, c.requests) << s;
    EXPECT_EQ(a.rejected, 0u) << s;
    EXPECT_EQ(a.max_concurrent, b.max_concurrent) << s;
    EXPECT_EQ(a.preemptions, b.preemptions) << s;
    EXPECT_EQ(a.block_ops, b.block_ops) << s;
    EXPECT_DOUBLE_EQ(a.waste_fraction, b.waste_fraction) << s;
    EXPECT_DOUBLE_EQ(a.sim_seconds, b.sim_seconds) << s;
  }
}

TEST(ServeSim, PagingHoldsMoreSequencesAndWastesLessThanReservingMaxLength) {
  const auto c = small();
  const auto contiguous = run(c, "contiguous");
  const auto paged = run(c, "paged");
  const auto prefix = run(c, "paged_prefix");
  const auto elastic = run(c, "elastic");
  EXPECT_EQ(contiguous.max_concurrent, 4u);  // 1 GiB / (2048 tokens * 128 KiB)
  EXPECT_GT(paged.max_concurrent, 4 * contiguous.max_concurrent);
  EXPECT_GT(contiguous.waste_fraction, 0.5);
  EXPECT_LT(paged.waste_fraction, 0.05);
  EXPECT_EQ(paged.prefix_hit_rate, 0.0);
  EXPECT_GT(prefix.prefix_hit_rate, 0.1);
  EXPECT_GT(paged.block_ops, 0u);
  // The same decisions as paged_prefix, on less memory held on average.
  EXPECT_EQ(elastic.max_concurrent, prefix.max_concurrent);
  EXPECT_LT(elastic.kv_bytes_mean, prefix.kv_bytes_mean);
  EXPECT_LE(elastic.kv_bytes_peak, c.budget_bytes);
}

TEST(ServeSim, SwapPreemptionKeepsServing) {
  auto c = small();
  c.budget_bytes = std::size_t{256} << 20;  // tight: preemption is certain
  c.requests = 60;
  c.preempt_swap = true;
  const auto r = run(c, "paged_prefix");
  EXPECT_EQ(r.completed + r.rejected, c.requests);
  EXPECT_GT(r.completed, r.rejected);
  EXPECT_GT(r.preemptions, 0u);
}

// Two instances, each with a host tier: prefixes evicted under a tight budget come back
// from the tier instead of being recomputed, and the counts agree with each other.
TEST(ServeSim, HostTierBringsEvictedPrefixesBack) {
  auto c = small();
  c.budget_bytes = std::size_t{256} << 20;
  c.requests = 40;
  c.instances = 2;
  c.host_tier_bytes = std::size_t{256} << 20;
  sim_options o;
  o.capacity = 2 * (c.budget_bytes + c.host_tier_bytes) + (std::size_t{1} << 30);
  sim_platform sim(o);
  const auto r = run_serve_sim(c, "paged_prefix", sim);
  EXPECT_EQ(r.completed + r.rejected, c.requests);
  ASSERT_EQ(r.tiers.size(), 1u);
  EXPECT_EQ(r.tiers[0].name, "host");
  EXPECT_GT(r.tiers[0].hits, 0u);
  EXPECT_GT(r.tier_puts, 0u);
  EXPECT_EQ(r.tier_errors, 0u);
  EXPECT_EQ(r.recomputed_tokens_saved, r.tiers[0].hits * c.layout.block_tokens);
  EXPECT_GE(r.cached_prompt_tokens, r.recomputed_tokens_saved);
  EXPECT_LE(r.cached_prompt_tokens, r.prompt_tokens);
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
  // Strategies without prefix caching take no tiers.
  const auto paged = run_serve_sim(c, "paged", sim);
  EXPECT_TRUE(paged.tiers.empty());
  EXPECT_EQ(paged.recomputed_tokens_saved, 0u);
}

// The command line takes any finite positive --rate (tools/serve_sim_command.cpp): the
// largest double is a burst in which every request arrives at once, and is served.
TEST(ServeSim, TheLargestRateIsABurstServedWhole) {
  auto c = small();
  c.arrival_rate = 1e308;
  const auto r = run(c, "paged");
  EXPECT_EQ(r.completed, c.requests);
  EXPECT_EQ(r.rejected, 0u);
  EXPECT_GT(r.sim_seconds, 0.0);
  EXPECT_GT(r.max_concurrent, run(small(), "paged").max_concurrent)
      << "a burst holds more sequences at once than arrivals at 40/s";
}

TEST(ServeSim, RefusesBadConfigs) {
  sim_platform sim;
  auto c = small();
  EXPECT_THROW(run_serve_sim(c, "bogus", sim), gpumem::invalid_argument);
  c.requests = 0;
  EXPECT_THROW(run_serve_sim(c, "paged", sim), gpumem::invalid_argument);
  c = small();
  c.layout.kv_heads = 0;
  EXPECT_THROW(run_serve_sim(c, "paged", sim), gpumem::invalid_argument);
  c = small();
  c.budget_bytes = std::size_t{64} << 20;  // under one max-length sequence
  EXPECT_THROW(run_serve_sim(c, "contiguous", sim), gpumem::invalid_argument);
  c = small();
  c.instances = 0;
  EXPECT_THROW(run_serve_sim(c, "paged", sim), gpumem::invalid_argument);
  c = small();
  c.kv_store_url = "memcached://127.0.0.1:1";
  EXPECT_THROW(run_serve_sim(c, "paged_prefix", sim), gpumem::invalid_argument);
}

}  // namespace
