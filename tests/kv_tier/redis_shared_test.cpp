// kv_cache instances sharing one Redis: two real processes (the second's first request
// with the first's system prompt is a hit, bytes intact), and a decode loop that keeps
// serving while the server is killed, restarted and slow.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <thread>

#include "gpumem/kv.hpp"
#include "gpumem/kv/tier/kv_tiers.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "kv_tier/redis_server.hpp"
#include "kv_tier/redis_test_support.hpp"

namespace {

using namespace gpumem;
using namespace gpumem_test;
using namespace std::chrono_literals;

kv_layout layout() {
  kv_layout l;
  l.layers = 4;
  l.kv_heads = 2;
  l.head_dim = 64;
  l.dtype = kv_dtype::bf16;
  l.block_tokens = 16;
  return l;  // 64 KiB blocks
}

std::vector<token_id> system_prompt() {
  std::vector<token_id> t(16 * 8);  // 8 full blocks
  std::iota(t.begin(), t.end(), 5000);
  return t;
}

unsigned char pattern(std::size_t block, std::size_t byte) {
  return static_cast<unsigned char>((block * 131 + byte * 7 + 3) & 0xff);
}

// One serving instance: its own sim device, page pool, tiers and cache.
struct instance {
  sim_platform sim;
  vmm_page_pool pages{sim, 0};
  std::unique_ptr<kv_tiers> tiers;
  std::unique_ptr<kv_cache> kv;
  explicit instance(const std::string& url, std::size_t max_blocks = 64) {
    std::vector<std::unique_ptr<kv_store>> stores;
    stores.push_back(make_redis_store(url, fast_redis_options(300ms, drop_report)));
    tiers = std::make_unique<kv_tiers>(sim, 0, std::move(stores));
    kv_cache_config c;
    c.layout = layout();
    c.max_blocks = max_blocks;
    c.tiers = tiers.get();
    kv = std::make_unique<kv_cache>(pages, c);
  }
  ~instance() {
    kv.reset();
    tiers.reset();
  }
};

// The first process: computes the system prompt (writes its blocks), evicts them (they
// go to Redis), waits for the write-back, exits. Run by the test below as a child.
TEST(RedisShared, DISABLED_FirstProcess) {
  const char* url = std::getenv("GPUMEM_TEST_REDIS_URL");
  ASSERT_NE(url, nullptr);
  instance a(url);
  auto p = system_prompt();
  p.push_back(1);  // a user token after the system prompt
  auto s = a.kv->add_sequence(p);
  ASSERT_EQ(s.cached_tokens, 0u);
  const auto table = a.kv->block_table(s.id);
  const std::size_t bs = layout().block_stride();
  for (std::size_t b = 0; b < 8; ++b) {
    auto* bytes = static_cast<unsigned char*>(a.kv->block_address(table[b]));
    for (std::size_t i = 0; i < bs; ++i) bytes[i] = pattern(b, i);
  }
  a.kv->free(s.id);
  a.kv->shrink(0, /*drop_cached*/ true);
  a.tiers->flush();
  const auto st = a.tiers->stats();
  EXPECT_EQ(st.writebacks_written, 8u);
  EXPECT_EQ(st.tiers[0].store.puts, 8u);
}

TEST(RedisShared, TheSecondProcessFirstRequestHitsWhatTheFirstComputed) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server;
  // The first instance: another process (this test binary, running the disabled test).
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("GPUMEM_TEST_REDIS_URL", server.url().c_str(), 1);
    const char* argv[] = {"/proc/self/exe", "--gtest_filter=RedisShared.DISABLED_FirstProcess",
                          "--gtest_also_run_disabled_tests", nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the first process failed";

  instance b(server.url());
  auto p = system_prompt();
  p.push_back(2);  // another user
  p.push_back(3);
  auto s = b.kv->add_sequence(p);
  EXPECT_EQ(s.cached_tokens, 16u * 8) << "the first request of a fresh cache is a hit";
  EXPECT_EQ(b.kv->stats().tier_hits, 8u);
  const auto table = b.kv->block_table(s.id);
  const std::size_t bs = layout().block_stride();
  for (std::size_t blk = 0; blk < 8; ++blk) {
    auto* bytes = static_cast<const unsigned char*>(b.kv->block_address(table[blk]));
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < bs; ++i) wrong += bytes[i] != pattern(blk, i);
    EXPECT_EQ(wrong, 0u) << "block " << blk;
  }
  b.kv->free(s.id);
  EXPECT_EQ(b.kv->validate(), "");
}

TEST(RedisShared, TheDecodeLoopKeepsServingThroughKillRestartAndSlowness) {
  GPUMEM_REQUIRE_REDIS();
  redis_server server;
  instance a(server.url(), /*max_blocks*/ 24);
  std::mt19937 rng(7);
  std::vector<std::vector<token_id>> systems;
  for (int i = 0; i < 4; ++i) {
    std::vector<token_id> t(16 * 4);
    std::iota(t.begin(), t.end(), 100000 * (i + 1));
    systems.push_back(t);
  }
  std::size_t served = 0, from_tier_before_kill = 0;
  auto serve = [&](int requests) {
    for (int r = 0; r < requests; ++r) {
      auto p = systems[rng() % systems.size()];
      for (int k = 0; k < 20; ++k) p.push_back(static_cast<token_id>(1 + rng() % 1000));
      kv_cache::admission s;
      ASSERT_NO_THROW(s = a.kv->add_sequence(p));
      for (int step = 0; step < 10; ++step) {
        const token_id t[1] = {static_cast<token_id>(rng() % 1000)};
        ASSERT_NO_THROW(a.kv->append(s.id, t));
      }
      a.kv->free(s.id);
      ++served;
    }
  };
  serve(40);
  a.tiers->flush();
  from_tier_before_kill = a.kv->stats().tier_hits;
  EXPECT_GT(from_tier_before_kill, 0u) << "24 blocks hold one request: prefixes come from Redis";
  server.stop(/*kill_hard*/ true);
  serve(40);
  server.start();
  std::this_thread::sleep_for(250ms);
  serve(20);
  server.cli_async({"DEBUG", "SLEEP", "1"});
  serve(10);
  server.wait_background();
  std::this_thread::sleep_for(250ms);
  serve(20);
  a.tiers->flush();
  // The store's reconnect backoff (up to redis_store's backoff_max) may outlast the requests
  // above on a loaded machine: serve on until Redis answers again, within a deadline.
  const auto deadline = std::chrono::steady_clock::now() + 30s;
  while (a.kv->stats().tier_hits <= from_tier_before_kill &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(100ms);
    serve(5);
    a.tiers->flush();
  }
  EXPECT_GE(served, 130u);
  EXPECT_GT(a.kv->stats().tier_hits, from_tier_before_kill) << "it used Redis again after the restart";
  EXPECT_GT(a.tiers->stats().tiers[0].store.errors, 0u);
  EXPECT_EQ(a.kv->validate(), "");
}

}  // namespace
