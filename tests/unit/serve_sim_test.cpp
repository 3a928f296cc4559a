// gpumem serve-sim's engine on small sim workloads: every strategy serves every request,
// runs are reproducible, and the strategies differ the way their memory use says.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "../../tools/serve_sim.hpp"
#include "../../tools/serve_workload.hpp"

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

// A workload file in a temporary directory, removed with the object.
struct workload_file {
  std::string path;
  explicit workload_file(const std::string& text) {
    path = (::testing::TempDir().empty() ? std::string("/tmp/") : ::testing::TempDir()) +
           "gpumem_workload_" + std::to_string(::getpid()) + "_" +
           std::to_string(reinterpret_cast<std::uintptr_t>(this)) + ".txt";
    std::ofstream(path) << text;
  }
  ~workload_file() { std::remove(path.c_str()); }
};

std::string tokens(int first, int count) {
  std::string out;
  for (int i = 0; i < count; ++i) out += " " + std::to_string(first + i);
  return out;
}

TEST(ServeSim, ServesTheRequestsOfAWorkloadFile) {
  // Two requests with one 65-token prompt (4 full blocks looked up each; the second finds
  // all 4 cached) and one of 33 other tokens (2 looked up, none found): 4 hits of 10.
  const workload_file f("# arrival output samples tokens\n"
                        "0 8 1" + tokens(100, 65) + "\n\n"
                        "5.5 4 2" + tokens(1000, 33) + "\n"
                        "60 8 1" + tokens(100, 65) + "\n");
  auto c = small();
  c.workload = gpumem::cli::read_serve_workload(f.path);
  ASSERT_EQ(c.workload.size(), 3u);
  EXPECT_EQ(c.workload[1].samples, 2u);
  EXPECT_EQ(c.workload[1].output, 4u);
  EXPECT_DOUBLE_EQ(c.workload[1].arrival, 5.5);
  EXPECT_EQ(c.workload[2].prompt.front(), 100);
  EXPECT_EQ(c.workload[2].prompt.size(), 65u);
  c.requests = 0;  // ignored: the file's requests are served
  const auto r = run(c, "paged_prefix");
  EXPECT_EQ(r.completed, 3u);
  EXPECT_DOUBLE_EQ(r.prefix_hit_rate, 0.4);
  EXPECT_DOUBLE_EQ(run(c, "paged").prefix_hit_rate, 0.0);
}

TEST(ServeSim, RefusesBadWorkloadFilesNamingTheLine) {
  const auto refused = [](const std::string& text, const std::string& says) {
    const workload_file f(text);
    try {
      (void)gpumem::cli::read_serve_workload(f.path);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused("# nothing\n\n", "holds no request");
  refused("0 8 1 5\nx 8 1 5\n", ":2: arrival 'x'");
  refused("0 8 1 5\n-1 8 1 5\n", ":2: arrival '-1' is not a number of seconds in 0..86400");
  refused("3 8 1 5\n2 8 1 5\n", ":2: arrival 2 is before");
  refused("0 0 1 5\n", ":1: output tokens '0'");
  refused("0 8 0 5\n", ":1: samples '0'");
  refused("0 8 1\n", ":1: no prompt token");
  refused("0 8 1 5 -3\n", ":1: token '-3'");
  refused("0 8 1 5 2147483648\n", ":1: token '2147483648'");
  refused("0 8\n", ":1: no samples");
  refused("inf 8 1 5\n", ":1: arrival 'inf'");
  EXPECT_THROW((void)gpumem::cli::read_serve_workload("/nonexistent/gpumem/workload.txt"),
               gpumem::invalid_argument);
}

TEST(ServeSim, WorkloadFieldsNameTheFieldTheValueAndTheRange) {
  const auto refused = [](const std::string& text, const std::string& says) {
    const workload_file f(text);
    try {
      (void)gpumem::cli::read_serve_workload(f.path);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(f.path + says), std::string::npos) << e.what();
    }
  };
  refused("0 8 1 5\n1e300 8 1 5\n", ":2: arrival '1e300' is not a number of seconds in 0..86400");
  refused("86400.5 8 1 5\n", ":1: arrival '86400.5' is not a number of seconds in 0..86400");
  refused("0 99999999999 1 5\n", ":1: output tokens '99999999999' is not a whole number in 1..4294967296");
  refused("0 8 2000 5\n", ":1: samples '2000' is not a whole number in 1..1024");
  refused("0 8 1 +5\n", ":1: token '+5' is not a whole number in 0..2147483647");
  refused("0 8 1 0x10\n", ":1: token '0x10' is not a whole number");
}

TEST(ServeSim, WorkloadTextFollowsTheSharedTextRule) {
  const auto refused = [](const std::string& text, const std::string& says) {
    const workload_file f(text);
    try {
      (void)gpumem::cli::read_serve_workload(f.path);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(f.path + says), std::string::npos) << e.what();
    }
  };
  // A NUL inside a token never cuts it: the line is binary data.
  refused(std::string("0 8 1 5\n0 8 1 12\0" "99\n", 20), ":2: binary data, not text (byte 0x00 at column 9: a NUL)");
  refused("0 8 1 5\r7\n", ":1: binary data, not text (byte 0x0d at column 8: a carriage return");
  refused("0 8 1 5\x1b[0m\n", ":1: binary data");
  // A byte-order mark at the start and CRLF line ends read as plain text (as a trace's).
  const workload_file f("\xEF\xBB\xBF# exported\r\n0 8 1 5 6\r\n\r\n2.5\t4 2 7\r\n");
  const auto w = gpumem::cli::read_serve_workload(f.path);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(w[0].prompt, (std::vector<gpumem::token_id>{5, 6}));
  EXPECT_DOUBLE_EQ(w[1].arrival, 2.5);
  EXPECT_EQ(w[1].samples, 2u);
  // A mark anywhere else is no number.
  refused("0 8 1 5\n\xEF\xBB\xBF" "1 8 1 5\n", ":2: arrival '\xEF\xBB\xBF" "1'");
}

TEST(ServeSim, AWorkloadFileOverItsLimitIsRefusedWhileStreaming) {
  std::string text;
  while (text.size() < (1u << 20)) text += "0 8 1 5 6 7 8 9\n";
  const workload_file f(text);
  try {
    (void)gpumem::cli::read_serve_workload(f.path, 256 << 10);
    ADD_FAILURE() << "a file over the limit was read";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("serve-sim: workload: " + f.path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("more than 256.00 KiB, this reader's limit"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(gpumem::cli::read_serve_workload(f.path, 1 << 20).size(), text.size() / 16);
}

TEST(ServeSim, ALongGapBetweenArrivalsIsServedNotTakenForALivelock) {
  // 30,000 s between two requests: 1.2 million idle steps of 25 ms, more than the
  // million steps without a completion that stop a livelocked run.
  const workload_file f("0 8 1 5 6\n30000 8 1 5 6\n");
  auto c = small();
  c.workload = gpumem::cli::read_serve_workload(f.path);
  c.requests = 0;
  const auto r = run(c, "paged");
  EXPECT_EQ(r.completed, 2u);
  EXPECT_GE(r.sim_seconds, 30000.0);
}

}  // namespace
