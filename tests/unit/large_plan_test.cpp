// Large-request plans without marks: the detector that finds a loop's step from its large
// requests (the step, not the layer), and large_planner in front of a vmm_page_pool on the
// sim device (1 GiB, 2 MiB pages).
#include <gtest/gtest.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/plan/large_planner.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "pool/plan/large_request_detector.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using detail::large_request_detector;
using gpumem_test::fill;
using gpumem_test::holds;
using gpumem_test::MiB;

// A transformer-like step's keys: an embedding, `layers` layers of the same three
// requests, then the loss and the optimizer's.
std::vector<std::uint64_t> layered_step(std::size_t layers) {
  std::vector<std::uint64_t> keys = {100};
  for (std::size_t l = 0; l < layers; ++l) keys.insert(keys.end(), {1, 2, 3});
  keys.insert(keys.end(), {200, 300});
  return keys;
}

TEST(LargeRequestDetector, FindsTheStepNotTheLayer) {
  const std::vector<std::uint64_t> step = layered_step(8);  // 27 keys, the layer 3
  large_request_detector d(4096);
  std::size_t pushed = 0;
  bool layer_seen = false;
  for (int s = 0; s < 6; ++s) {
    for (std::uint64_t k : step) {
      const std::size_t p = d.push(k);
      ++pushed;
      layer_seen |= p == 3;
      // From the third step on (two whole steps matched), the step and nothing else.
      if (pushed >= 2 * step.size()) {
        ASSERT_EQ(p, step.size()) << "after " << pushed << " keys";
      }
    }
  }
  // Within the first steps the layer repeats (16 keys matched at lag 3) before any step
  // has: the detector may report it there, never once the step has repeated.
  EXPECT_TRUE(layer_seen);
  EXPECT_GE(d.run(step.size()), 4 * step.size());
}

TEST(LargeRequestDetector, ReportsNothingWithoutARepeatOfTwoPeriodsAndMinRun) {
  large_request_detector d(64, 16);
  // Two equal keys in a row are no loop; nor is a sequence that never repeats.
  EXPECT_EQ(d.push(7), 0u);
  EXPECT_EQ(d.push(7), 0u);
  for (std::uint64_t k = 0; k < 200; ++k) ASSERT_EQ(d.push(1000 + k), 0u);
  // A period longer than max_period is not seen.
  for (int s = 0; s < 4; ++s)
    for (std::uint64_t k = 0; k < 100; ++k) ASSERT_EQ(d.push(k), 0u);
  // A period of 5 is, once 16 keys and two periods matched.
  d.reset();
  std::size_t found_at = 0;
  for (std::size_t i = 0; i < 40 && found_at == 0; ++i)
    if (d.push(i % 5) == 5) found_at = i + 1;
  EXPECT_EQ(found_at, 5u + 16u);
  EXPECT_EQ(large_request_detector(0).max_period(), 1u);  // clamped, not undefined
}

// --- large_planner on a pool ---

class LargePlanner : public gpumem_test::sim_pool_test {
 protected:
  static large_plan_options one_mib() {
    large_plan_options o;
    o.threshold = 1 * MiB;
    return o;
  }
  // One step: nested large requests (4 of them), with a small one in the middle. `c`: the
  // third request's size (a differing step passes another); late_b: the second is freed
  // only after the fourth is made (the same requests, another lifetime).
  void run_step(memory_resource& r, std::size_t c = 6 * MiB, bool late_b = false) {
    void* a = r.allocate(8 * MiB, 256, {});
    fill(a, 8 * MiB, 0xA1);
    void* b = r.allocate(4 * MiB, 256, {});
    fill(b, 4 * MiB, 0xB2);
    void* small = r.allocate(4096, 256, {});
    void* cc = r.allocate(c, 256, {});
    fill(cc, c, 0xC3);
    ASSERT_TRUE(holds(a, 8 * MiB, 0xA1));
    ASSERT_TRUE(holds(b, 4 * MiB, 0xB2));
    if (!late_b) r.deallocate(b, 4 * MiB, {});
    void* d = r.allocate(10 * MiB, 256, {});
    fill(d, 10 * MiB, 0xD4);
    if (late_b) {
      EXPECT_TRUE(holds(b, 4 * MiB, 0xB2));
      r.deallocate(b, 4 * MiB, {});
    }
    ASSERT_TRUE(holds(a, 8 * MiB, 0xA1));
    ASSERT_TRUE(holds(cc, c, 0xC3));
    r.deallocate(small, 4096, {});
    r.deallocate(a, 8 * MiB, {});
    r.deallocate(cc, c, {});
    ASSERT_TRUE(holds(d, 10 * MiB, 0xD4));
    r.deallocate(d, 10 * MiB, {});
  }
  // Another loop: other sizes, the same shape.
  void run_other_step(memory_resource& r) {
    void* a = r.allocate(3 * MiB, 256, {});
    void* b = r.allocate(5 * MiB, 256, {});
    r.deallocate(a, 3 * MiB, {});
    void* c = r.allocate(7 * MiB, 256, {});
    r.deallocate(b, 5 * MiB, {});
    r.deallocate(c, 7 * MiB, {});
  }
};

TEST_F(LargePlanner, ARepeatingLoopIsPlannedWithoutMarksAndServedWithoutTheDriver) {
  vmm_page_pool pool(sim, 0);
  large_planner planner(pool, one_mib());
  // 4 large requests a step: found once 16 match (5 steps), served from the next cycle.
  for (int i = 0; i < 6; ++i) run_step(planner);
  auto c = planner.counts();
  EXPECT_EQ(c.plans_built, 1u);
  EXPECT_EQ(c.period, 4u);
  EXPECT_EQ(c.region_takes, 1u);
  const auto maps = calls(platform_op::map), creates = calls(platform_op::create_physical);
  const auto served = c.planned_allocations;
  for (int i = 0; i < 5; ++i) {
    run_step(planner);
    ASSERT_EQ(planner.validate(), "");
  }
  c = planner.counts();
  EXPECT_EQ(c.planned_allocations, served + 5 * 4u);
  EXPECT_EQ(c.misses, 0u);
  EXPECT_EQ(calls(platform_op::map), maps);
  EXPECT_EQ(calls(platform_op::create_physical), creates);
  // Stats count the planned allocations, not the region.
  EXPECT_EQ(planner.stats().live_bytes, 0u);
}

TEST_F(LargePlanner, ADifferingStepFallsBackToThePoolAndTheNextIsPlannedAgain) {
  vmm_page_pool pool(sim, 0);
  large_planner planner(pool, one_mib());
  for (int i = 0; i < 7; ++i) run_step(planner);
  const auto before = planner.counts();
  ASSERT_GT(before.planned_allocations, 0u);
  run_step(planner, 6 * MiB + 4096);  // the third request differs
  auto c = planner.counts();
  EXPECT_GE(c.misses, 1u);
  // The cycle left the plan: the region went back to the pool at once (a planned
  // allocation still live in it became the pool's).
  EXPECT_EQ(c.region_bytes, 0u);
  EXPECT_EQ(planner.validate(), "");
  for (int i = 0; i < 3; ++i) run_step(planner);
  c = planner.counts();
  EXPECT_EQ(c.plans_built, 1u);  // the same plan, taken up again where a cycle begins
  EXPECT_GT(c.region_takes, before.region_takes);
  EXPECT_GT(c.planned_allocations, before.planned_allocations + 4u);
  EXPECT_EQ(planner.validate(), "");
  EXPECT_EQ(planner.stats().live_bytes, 0u);
}

TEST_F(LargePlanner, AnAllocationLivingLongerThanPlannedMakesTheRequestOverItGoToThePool) {
  vmm_page_pool pool(sim, 0);
  large_planner planner(pool, one_mib());
  for (int i = 0; i < 7; ++i) run_step(planner);
  const auto before = planner.counts();
  // The plan puts the fourth request where the second lay (dead by then); here the second
  // still lives: the fourth is the pool's, and neither is overwritten (run_step checks).
  run_step(planner, 6 * MiB, /*late_b=*/true);
  const auto c = planner.counts();
  EXPECT_EQ(c.conflicts, before.conflicts + 1);
  EXPECT_EQ(c.planned_allocations, before.planned_allocations + 3);
  EXPECT_EQ(c.misses, 0u);
  EXPECT_EQ(planner.validate(), "");
  EXPECT_EQ(planner.stats().live_bytes, 0u);
}

TEST_F(LargePlanner, ALoopThatChangesDropsThePlanAndGivesItsRegionBack) {
  vmm_page_pool pool(sim, 0);
  large_planner planner(pool, one_mib());
  for (int i = 0; i < 7; ++i) run_step(planner);
  ASSERT_EQ(planner.counts().plans_built, 1u);
  // Another loop of 3 large requests a step: the first plan matches none of 64 requests and
  // goes; the new loop's is built.
  for (int i = 0; i < 40; ++i) run_other_step(planner);
  const auto c = planner.counts();
  EXPECT_EQ(c.plans_dropped, 1u);
  EXPECT_EQ(c.plans_built, 2u);
  EXPECT_EQ(c.period, 3u);
  // Nothing is live between steps: the pool holds the new plan's region alone.
  EXPECT_EQ(pool.stats().live_bytes, c.region_bytes);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(LargePlanner, AFreeOfTheStepBeforeWithAnotherSizeDoesNotSizeThePlannedBlock) {
  // 16 large requests a step; the last (the "loss") lives into the next step. The first
  // step's loss is smaller: its free, in the step the plan is recorded from, is not the
  // recorded loss's. Every planned block stays inside the region.
  vmm_page_pool pool(sim, 0);
  large_planner planner(pool, one_mib());
  std::pair<void*, std::size_t> loss{nullptr, 0};
  for (int step = 0; step < 8; ++step) {
    for (std::size_t i = 0; i < 15; ++i) {
      const std::size_t n = (1 + i % 3) * MiB + i * 4096;
      void* p = planner.allocate(n, 256, {});
      if (i == 0 && loss.first != nullptr) planner.deallocate(loss.first, loss.second, {});
      planner.deallocate(p, n, {});
    }
    const std::size_t n = step == 0 ? 1 * MiB : 24 * MiB;
    loss = {planner.allocate(n, 256, {}), n};
    fill(loss.first, n, static_cast<unsigned char>(step));
    ASSERT_EQ(planner.validate(), "") << "step " << step;
  }
  EXPECT_GE(planner.counts().plans_built, 1u);
  EXPECT_GT(planner.counts().planned_allocations, 0u);
  EXPECT_TRUE(holds(loss.first, loss.second, 7));
  planner.deallocate(loss.first, loss.second, {});
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(LargePlanner, BadFreesAreRefusedAndLeaveThePlanIntact) {
  vmm_page_pool pool(sim, 0);
  large_planner planner(pool, one_mib());
  for (int i = 0; i < 7; ++i) run_step(planner);
  ASSERT_NE(planner.counts().region_bytes, 0u);
  const auto served = planner.counts().planned_allocations;
  void* a = planner.allocate(8 * MiB, 256, {});  // the cycle's first request: planned
  ASSERT_EQ(planner.counts().planned_allocations, served + 1);
  fill(a, 8 * MiB, 0x5A);
  EXPECT_THROW(planner.deallocate(a, 8 * MiB + 512, {}), invalid_argument);  // wrong size
  EXPECT_THROW(planner.deallocate(static_cast<char*>(a) + 2 * MiB, 8 * MiB, {}),
               invalid_argument);  // inside the region, not an allocation
  EXPECT_EQ(planner.validate(), "");
  EXPECT_TRUE(holds(a, 8 * MiB, 0x5A));
  planner.deallocate(a, 8 * MiB, {});
  EXPECT_THROW(planner.deallocate(a, 8 * MiB, {}), invalid_argument);  // twice
  EXPECT_EQ(planner.validate(), "");
  EXPECT_EQ(planner.stats().live_bytes, 0u);
}

}  // namespace
