// The Redis tier's reference-model fuzzer (redis_fuzz_driver.hpp) on fixed seeds, for a
// redis:// store and a redis-cluster:// store (where MOVED and ASK are followed), against
// fake_redis_server: runs in CI without redis-server.
#include <gtest/gtest.h>

#include "kv_tier/redis_fuzz_driver.hpp"

namespace {

using gpumem_test::redis_fuzz_config;
using gpumem_test::redis_fuzz_driver;

class RedisFuzz : public ::testing::TestWithParam<std::uint64_t> {};

TEST_P(RedisFuzz, OneServerAnswersRightOrFailsTypedWithinTheDeadline) {
  if (!gpumem::redis_tier_available()) GTEST_SKIP() << "this build has no Redis tier";
  redis_fuzz_config c;
  c.seed = GetParam();
  redis_fuzz_driver d(c);
  d.run();
  EXPECT_GE(d.clean_steps(), c.steps / 4);
  EXPECT_GE(d.faults(), static_cast<std::uint64_t>(c.steps / 8));
}

TEST_P(RedisFuzz, AClusterAnswersRightOrFailsTypedWithinTheDeadline) {
  if (!gpumem::redis_tier_available()) GTEST_SKIP() << "this build has no Redis tier";
  redis_fuzz_config c;
  c.seed = GetParam() + 1000;
  c.cluster = true;
  redis_fuzz_driver d(c);
  d.run();
  EXPECT_GE(d.clean_steps(), c.steps / 4);
  EXPECT_GE(d.faults(), static_cast<std::uint64_t>(c.steps / 8));
}

INSTANTIATE_TEST_SUITE_P(FixedSeeds, RedisFuzz, ::testing::Values(1, 2));

}  // namespace
