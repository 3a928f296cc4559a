// The fixed-seed fuzz corpus, replayed as a normal test through the same driver the
// libFuzzer targets use (fuzz_driver.hpp, kv_cache_fuzz_driver.hpp): for every pool and the
// KV cache, seeds 0..N-1 each give a deterministic byte string decoded into 500 operations
// (allocate / free on its stream, another, or one the pool never saw / trim /
// release_stream / held events / bad input, a refused stream among it), checked after each
// step against the reference model (no overlap, alignment, bytes intact until freed, live
// bytes and count, validate(), reserved within reserved_bound() of the peak live bytes),
// then a second corpus with sim faults injected (every failure typed, nothing changed, pool
// usable, no leak), one with several fault rules at once, and one of 2,000 operations
// with most frees on another stream than the allocation's; for the KV cache the same
// without the streams; for the KV cache's C API, pools, caches and sequence sets made and
// destroyed in any order with counts, ids and sizes at the edges of their types, each
// status as the model predicts.
// Runs in every CI build, under ASan+UBSan and TSan too. GPUMEM_FUZZ_SEEDS overrides the
// seed count (for longer local runs); totals are printed for docs/RELIABILITY.md.
#include <algorithm>
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "fuzz/fuzz_driver.hpp"
#include "fuzz/kv_c_api_fuzz_driver.hpp"
#include "fuzz/kv_cache_fuzz_driver.hpp"

namespace {

using namespace gpumem_fuzz;

constexpr std::size_t ops_per_seed = 500;
constexpr std::size_t bytes_per_seed = ops_per_seed * 12;
constexpr std::size_t kv_bytes_per_seed = ops_per_seed * 80;  // prompts take 2 bytes a token

// Seeds per test: 20; 10 under ASan and 5 under TSan (this single-threaded replay costs
// ~2-3x and ~5x there, and CI's time is bounded); GPUMEM_FUZZ_SEEDS overrides.
std::uint64_t seeds() {
  if (const char* s = std::getenv("GPUMEM_FUZZ_SEEDS")) return std::strtoull(s, nullptr, 10);
#if defined(__SANITIZE_THREAD__)
  return 5;
#elif defined(__SANITIZE_ADDRESS__)
  return 10;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
  return 5;
#elif __has_feature(address_sanitizer)
  return 10;
#endif
#endif
  return 20;
}

void report(const char* what, const fuzz_counts& c) {
  std::printf(
      "[fuzz] %s: %llu runs, %llu operations, %llu allocations, %llu bad inputs refused, "
      "%llu faults armed, %llu typed failures, %llu out_of_memory (%llu with device memory free), "
      "%llu MiB checked\n",
      what, static_cast<unsigned long long>(c.runs), static_cast<unsigned long long>(c.operations),
      static_cast<unsigned long long>(c.allocations), static_cast<unsigned long long>(c.bad_inputs),
      static_cast<unsigned long long>(c.faults_armed),
      static_cast<unsigned long long>(c.typed_failures),
      static_cast<unsigned long long>(c.out_of_memory),
      static_cast<unsigned long long>(c.oom_with_device_memory_free),
      static_cast<unsigned long long>(c.bytes_checked >> 20));
}

class fuzz_corpus : public ::testing::TestWithParam<pool_target> {};

TEST_P(fuzz_corpus, every_seed_keeps_the_model) {
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(seed, bytes_per_seed);
    const auto why = run_pool_fuzz(GetParam(), bytes.data(), bytes.size(), false, ops_per_seed, counts);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report(target_name(GetParam()), counts);
  EXPECT_EQ(counts.oom_with_device_memory_free, 0u) << "memory the device had was refused";
  EXPECT_EQ(counts.operations, n * ops_per_seed) << "every seed ran its operations";
  EXPECT_GT(counts.allocations, n * 50);
  EXPECT_GT(counts.bad_inputs, n * 10);
}

TEST_P(fuzz_corpus, injected_faults_are_typed_and_leave_the_pool_valid) {
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(1'000'000 + seed, bytes_per_seed);
    const auto why = run_pool_fuzz(GetParam(), bytes.data(), bytes.size(), true, ops_per_seed, counts);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report((std::string(target_name(GetParam())) + " with faults").c_str(), counts);
  EXPECT_GT(counts.faults_armed, n * 2);
  EXPECT_GT(counts.typed_failures, 0u) << "some injected fault must have made a call fail";
}

// Most frees on another stream than the allocation's (streams the pool knows, and new ones
// it never saw), at most 24 MiB live: the reserved bytes stay within reserved_bound() of
// the peak live bytes after every step (a pool that keeps a freed block apart for the
// stream that freed it grows past it), and every refused stream leaves the pool intact.
TEST_P(fuzz_corpus, frees_on_any_stream_keep_reserved_within_the_bound) {
  if (GetParam() == pool_target::fixed_block_over_vmm_page ||
      GetParam() == pool_target::fixed_block_over_caching)
    GTEST_SKIP() << "fixed_block_pool takes no stream";
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(6'000'000 + seed, 4 * bytes_per_seed);
    const auto why = run_pool_fuzz(GetParam(), bytes.data(), bytes.size(), false,
                                   4 * ops_per_seed, counts, 1, true);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report((std::string(target_name(GetParam())) + " with frees on any stream").c_str(), counts);
  std::printf("[fuzz]   %llu frees on another stream, %llu calls on a refused stream, reserved at "
              "most %zu KiB over twice the peak live\n",
              static_cast<unsigned long long>(counts.foreign_frees),
              static_cast<unsigned long long>(counts.bad_stream_calls),
              counts.worst_reserved_over_peak >> 10);
  EXPECT_GT(counts.foreign_frees, n * 80);
  EXPECT_GT(counts.bad_stream_calls, n * 12);
}

// The same corpus run twice, the second time with the host's address space cut into holes
// of assorted sizes first (so the sim device's allocations, which are host mappings, land
// elsewhere and in another order): every decision, and so the reserved bytes after every
// step, must be the same. A pool whose choices follow host addresses passes or fails the
// bound above by luck of the layout.
TEST_P(fuzz_corpus, decisions_do_not_depend_on_host_addresses) {
  if (GetParam() == pool_target::fixed_block_over_vmm_page ||
      GetParam() == pool_target::fixed_block_over_caching)
    GTEST_SKIP() << "fixed_block_pool takes no stream";
  const auto run = [&](std::uint64_t seed) {
    fuzz_counts counts;
    const auto bytes = corpus_bytes(6'000'000 + seed, 4 * bytes_per_seed);
    EXPECT_EQ(run_pool_fuzz(GetParam(), bytes.data(), bytes.size(), false, 4 * ops_per_seed,
                            counts, 1, true), "");
    return counts;
  };
  for (std::uint64_t seed = 0; seed < 2; ++seed) {
    const fuzz_counts plain = run(seed);
    // Holes of 2 to 30 MiB between kept mappings.
    std::vector<std::pair<void*, std::size_t>> kept;
    for (std::size_t k = 0; k < 24; ++k) {
      const std::size_t size = (2 + (k * 7 + seed * 5) % 29) * MiB;
      void* p = ::mmap(nullptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      ASSERT_NE(p, MAP_FAILED);
      kept.emplace_back(p, size);
    }
    for (std::size_t k = 0; k < kept.size(); k += 2) ::munmap(kept[k].first, kept[k].second);
    const fuzz_counts moved = run(seed);
    for (std::size_t k = 1; k < kept.size(); k += 2) ::munmap(kept[k].first, kept[k].second);
    EXPECT_EQ(plain.reserved_sum, moved.reserved_sum) << "seed " << seed;
    EXPECT_EQ(plain.worst_reserved_over_peak, moved.worst_reserved_over_peak) << "seed " << seed;
    EXPECT_EQ(plain.out_of_memory, moved.out_of_memory) << "seed " << seed;
  }
}

// Up to three fault rules armed at once for the pools too (half the seeds): a failure inside
// another's undo must still leave the pool valid and leak nothing.
TEST_P(fuzz_corpus, several_faults_at_once_are_typed_and_leak_nothing) {
  fuzz_counts counts;
  const auto n = std::max<std::uint64_t>(1, seeds() / 2);
  // Some targets rarely fail a call under faults (caching_pool with release threshold 0:
  // about one typed failure in five seeds, and which seed depends on host addresses, so on
  // what ran before in the process): more seeds, up to 4n, until one has.
  for (std::uint64_t seed = 0; seed < n || (counts.typed_failures == 0 && seed < 4 * n); ++seed) {
    const auto bytes = corpus_bytes(5'000'000 + seed, bytes_per_seed);
    const auto why = run_pool_fuzz(GetParam(), bytes.data(), bytes.size(), true, ops_per_seed, counts, 3);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report((std::string(target_name(GetParam())) + " with up to 3 faults at once").c_str(), counts);
  EXPECT_GT(counts.faults_armed, n * 2);
  EXPECT_GT(counts.typed_failures, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    pools, fuzz_corpus,
    ::testing::Values(pool_target::caching_over_runtime, pool_target::caching_over_vmm,
                      pool_target::caching_release_threshold, pool_target::vmm_page,
                      pool_target::vmm_page_big_chunk, pool_target::pinned_host,
                      pool_target::fixed_block_over_vmm_page, pool_target::fixed_block_over_caching,
                      pool_target::vmm_page_map_worker, pool_target::vmm_page_growth_slack,
                      pool_target::caching_release_idle, pool_target::vmm_page_small_classes,
                      pool_target::caching_small_classes),
    [](const ::testing::TestParamInfo<pool_target>& info) { return std::string(target_name(info.param)); });

TEST(fuzz_corpus_kv_cache, every_seed_keeps_the_model) {
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(2'000'000 + seed, kv_bytes_per_seed);
    const auto why = run_kv_cache_fuzz(bytes.data(), bytes.size(), false, ops_per_seed, counts);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report("kv_cache", counts);
  EXPECT_EQ(counts.operations, n * ops_per_seed);
  EXPECT_GT(counts.bad_inputs, n * 5);
}

TEST(fuzz_corpus_kv_cache, injected_faults_are_typed_and_leave_the_cache_valid) {
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(3'000'000 + seed, kv_bytes_per_seed);
    const auto why = run_kv_cache_fuzz(bytes.data(), bytes.size(), true, ops_per_seed, counts);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report("kv_cache with faults", counts);
  EXPECT_GT(counts.faults_armed, n * 2);
  EXPECT_GT(counts.typed_failures, 0u);
}

// Up to three fault rules armed at once, so a failure strikes inside another's undo (two
// faults in a row: RELIABILITY.md finding 4). Undo paths must still leave the cache and the
// page pool valid and leak nothing.
TEST(fuzz_corpus_kv_cache, several_faults_at_once_are_typed_and_leak_nothing) {
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(4'000'000 + seed, kv_bytes_per_seed);
    const auto why = run_kv_cache_fuzz(bytes.data(), bytes.size(), true, ops_per_seed, counts, 3);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report("kv_cache with up to 3 faults at once", counts);
  EXPECT_GT(counts.faults_armed, n * 2);
  EXPECT_GT(counts.typed_failures, 0u);
}

// The C API (gpumem_kv.h) with counts, ids and sizes at the edges of their types and
// handles destroyed in any order: every status as the model predicts (invalid argument for
// what can never fit, success or out of memory for what can), every structure valid.
TEST(fuzz_corpus_kv_c_api, every_seed_keeps_the_model) {
  fuzz_counts counts;
  const auto n = seeds();
  for (std::uint64_t seed = 0; seed < n; ++seed) {
    const auto bytes = corpus_bytes(7'000'000 + seed, ops_per_seed * 16);
    const auto why = run_kv_c_api_fuzz(bytes.data(), bytes.size(), ops_per_seed, counts);
    ASSERT_EQ(why, "") << "seed " << seed;
  }
  report("kv C API", counts);
  EXPECT_EQ(counts.operations, n * ops_per_seed);
  EXPECT_GT(counts.bad_inputs, n * 50);
  EXPECT_GT(counts.allocations, n * 10);
}

}  // namespace
