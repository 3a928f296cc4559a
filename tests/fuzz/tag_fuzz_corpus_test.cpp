// The tags' fixed-seed fuzz corpus, replayed as a normal test through the driver the
// libFuzzer target uses (tag_fuzz_driver.hpp): seeds 0..N-1 each give a deterministic byte
// string decoded into 300 operations on a C API pool (tagged and untagged allocations,
// frees, sleep / wake of every tag in every state, trim, record_stream, export / import,
// refused calls), checked after each step against the reference model. Runs in every CI
// build; GPUMEM_FUZZ_SEEDS overrides the seed count (for longer local runs) and
// GPUMEM_FUZZ_FIRST_SEED the first seed.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "fuzz/tag_fuzz_driver.hpp"

namespace {

using namespace gpumem_fuzz;

constexpr std::size_t ops_per_seed = 300;
constexpr std::size_t bytes_per_seed = ops_per_seed * 4;

std::uint64_t tag_seeds() {
  if (const char* s = std::getenv("GPUMEM_FUZZ_SEEDS")) return std::strtoull(s, nullptr, 10);
  return 3;
}

// GPUMEM_FUZZ_FIRST_SEED starts the seeds there (to replay one that failed).
std::uint64_t first_seed() {
  if (const char* s = std::getenv("GPUMEM_FUZZ_FIRST_SEED")) return std::strtoull(s, nullptr, 10);
  return 0;
}

TEST(fuzz_corpus_tags, every_seed_keeps_the_model) {
  fuzz_counts counts;
  for (std::uint64_t seed = first_seed(); seed < first_seed() + tag_seeds(); ++seed) {
    const auto bytes = corpus_bytes(5'000'000 + seed, bytes_per_seed);
    const auto why = run_tag_fuzz(bytes.data(), bytes.size(), ops_per_seed, counts);
    ASSERT_TRUE(why.empty()) << "seed " << seed << ": " << why;
  }
  std::printf("[fuzz] tags: %llu runs, %llu operations, %llu allocations, %llu bad inputs "
              "refused, %llu out_of_memory, %llu MiB checked\n",
              static_cast<unsigned long long>(counts.runs),
              static_cast<unsigned long long>(counts.operations),
              static_cast<unsigned long long>(counts.allocations),
              static_cast<unsigned long long>(counts.bad_inputs),
              static_cast<unsigned long long>(counts.out_of_memory),
              static_cast<unsigned long long>(counts.bytes_checked >> 20));
  EXPECT_GT(counts.allocations, 0u);
}

}  // namespace
