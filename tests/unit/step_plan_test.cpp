// Step plans: the planner's layout (build_step_plan) and step_planner in front of a
// vmm_page_pool on the sim device (1 GiB, 2 MiB pages).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/backend.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "pool/plan/step_plan.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using detail::build_step_plan;
using detail::check_step_plan;
using detail::step_event;
using detail::step_plan;
using gpumem_test::fill;
using gpumem_test::holds;
using gpumem_test::KiB;
using gpumem_test::MiB;

step_event alloc(std::uint32_t id, std::size_t bytes, std::uintptr_t stream = 0,
                 std::size_t alignment = 256) {
  return {step_event::kind::alloc, 0, id, bytes, alignment, stream};
}
step_event free_of(std::uint32_t id, std::size_t bytes, std::uintptr_t stream = 0,
                   std::uint8_t age = 0) {
  return {step_event::kind::free, age, id, bytes, 0, stream};
}

TEST(StepPlan, AllocationsLiveTogetherGetApartAndSuccessiveOnesShare) {
  // 0 and 1 live together; 2 comes after both are freed and may take either place.
  const std::vector<step_event> step = {alloc(0, 1000), alloc(1, 3000), free_of(0, 1000),
                                        free_of(1, 3000), alloc(2, 3000), free_of(2, 3000)};
  const step_plan plan = build_step_plan(step, 100);
  ASSERT_EQ(plan.planned_count, 3u);
  EXPECT_EQ(check_step_plan(plan), "");
  const std::size_t b0 = step_plan::block_bytes(1000), b1 = step_plan::block_bytes(3000);
  EXPECT_EQ(plan.lower_bound, b0 + b1);
  EXPECT_EQ(plan.region_bytes, b0 + b1);  // the bound: nothing wasted
  EXPECT_TRUE(plan.offset[0] + b0 <= plan.offset[1] || plan.offset[1] + b1 <= plan.offset[0]);
  EXPECT_EQ(plan.offset[2], plan.offset[1]);  // the largest first, at the bottom
  EXPECT_EQ(plan.sequence.size(), step.size());
}

TEST(StepPlan, WhatLivesAcrossTheMarkLiesTogetherAtTheBottom) {
  // Two small tensors live across the mark (gradients a zero_grad at the top frees); a
  // large one dies before it. Largest first would put the large one at the bottom and the
  // small ones above it; placed first, they leave the rest of the region in one piece.
  const std::vector<step_event> cycle = {alloc(0, 4096), alloc(1, 1 << 20), alloc(2, 4096),
                                         free_of(1, 1 << 20), /* mark */ free_of(0, 4096),
                                         free_of(2, 4096)};
  const step_plan plain = build_step_plan(cycle, 100);
  EXPECT_EQ(plain.offset[1], 0u);
  const step_plan plan = build_step_plan(cycle, 100, step_plan::unit, /*mark=*/4);
  EXPECT_EQ(check_step_plan(plan), "");
  EXPECT_EQ(std::max(plan.offset[0], plan.offset[2]), 4096u);
  EXPECT_EQ(std::min(plan.offset[0], plan.offset[2]), 0u);
  EXPECT_EQ(plan.offset[1], 8192u);
  EXPECT_EQ(plan.region_bytes, plain.region_bytes) << "no larger";
}

TEST(StepPlan, LeavesToThePoolWhatOutlivesTheStepOrUsesAnotherStreamOrAlignment) {
  const std::vector<step_event> step = {
      alloc(0, 4096),                   // never freed in the step: lives past it
      alloc(1, 8192, 7),                // freed on stream 7, the step's main stream is 0
      alloc(2, 1 << 20),                // planned
      alloc(3, 4096, 0, 4096),          // needs 4 KiB alignment
      free_of(1, 8192, 7), free_of(3, 4096), free_of(2, 1 << 20),
      alloc(4, 4096, 0), free_of(4, 4096, 9),  // freed on another stream than its own
  };
  const step_plan plan = build_step_plan(step, 100);
  EXPECT_EQ(plan.stream, 0u);
  EXPECT_FALSE(plan.planned(0));
  EXPECT_FALSE(plan.planned(1));
  EXPECT_TRUE(plan.planned(2));
  EXPECT_FALSE(plan.planned(3));
  EXPECT_FALSE(plan.planned(4));
  EXPECT_EQ(plan.planned_count, 1u);
  // Every allocation stays in the sequence (positions must agree); frees only of planned.
  EXPECT_EQ(std::count_if(plan.sequence.begin(), plan.sequence.end(),
                          [](const step_event& e) { return e.what == step_event::kind::alloc; }),
            5);
  EXPECT_EQ(plan.sequence.size(), 6u);
  EXPECT_EQ(check_step_plan(plan), "");
}

TEST(StepPlan, PlansAtMostTheLargestAllowed) {
  std::vector<step_event> step;
  for (std::uint32_t i = 0; i < 10; ++i) step.push_back(alloc(i, (i + 1) * 1024));
  for (std::uint32_t i = 0; i < 10; ++i) step.push_back(free_of(i, (i + 1) * 1024));
  const step_plan plan = build_step_plan(step, 3);
  EXPECT_EQ(plan.planned_count, 3u);
  for (std::uint32_t i = 0; i < 10; ++i) EXPECT_EQ(plan.planned(i), i >= 7) << i;
  EXPECT_EQ(check_step_plan(plan), "");
}

TEST(StepPlan, RandomStepsNeverOverlapLiveAllocationsAndStayNearTheBound) {
  std::mt19937_64 rng(7);
  double worst = 1.0;
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<step_event> step;
    std::vector<std::pair<std::uint32_t, std::size_t>> live;
    std::uint32_t next = 0;
    const int events = 20 + static_cast<int>(rng() % 400);
    for (int i = 0; i < events; ++i) {
      if (live.empty() || rng() % 3 != 0) {
        const std::size_t bytes = rng() % 2 == 0 ? 1 + rng() % 65536 : 1 + rng() % (8 << 20);
        step.push_back(alloc(next, bytes));
        live.emplace_back(next++, bytes);
      } else {
        const std::size_t k = rng() % live.size();
        step.push_back(free_of(live[k].first, live[k].second));
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      }
    }
    const step_plan plan = build_step_plan(step, 1 << 20);
    ASSERT_EQ(check_step_plan(plan), "") << "trial " << trial;
    ASSERT_GE(plan.region_bytes, plan.lower_bound);
    if (plan.lower_bound > 0)
      worst = std::max(worst, static_cast<double>(plan.region_bytes) /
                                  static_cast<double>(plan.lower_bound));
  }
  // Random lifetimes are far harder than a training step's nested ones; the greedy layout
  // still stays within a small factor of the bound (a failure here is a placement bug).
  EXPECT_LT(worst, 1.6);
}

// A loop that frees the step before's gradients at its top (zero_grad first) and makes
// new ones late: marked at the top, the gradients cross the mark. The cycle begins at the
// least live point (after the old gradients are freed), so they are born and freed in it.
TEST(StepPlan, TheCycleBeginsAtTheLeastLivePointSoWhatCrossesTheMarkIsPlanned) {
  const std::vector<step_event> step = {
      free_of(2, 50, 0, /*age=*/1),  // the previous step's gradient
      alloc(0, 100), alloc(1, 200), free_of(1, 200), free_of(0, 100),
      alloc(2, 50),                  // this step's gradient, freed by the next step
  };
  const detail::step_cycle c = detail::cycle_of(step);
  EXPECT_EQ(c.start, 1u);
  ASSERT_EQ(c.events.size(), 6u);
  EXPECT_EQ(c.events.back(), free_of(2, 50));  // the next step's free, of this cycle's id 2
  EXPECT_EQ(c.mark, 5u) << "the step's own 5 events come before its mark";
  const step_plan plan = build_step_plan(c.events, 100);
  EXPECT_EQ(plan.planned_count, 3u);
  EXPECT_EQ(check_step_plan(plan), "");
  // Without the rotation (a cycle starting at the mark) only the activations are planned.
  EXPECT_EQ(build_step_plan(step, 100).planned_count, 2u);
}

TEST(StepPlan, CheckFindsOverlappingLiveAllocations) {
  const std::vector<step_event> step = {alloc(0, 1024), alloc(1, 1024), free_of(0, 1024),
                                        free_of(1, 1024)};
  step_plan plan = build_step_plan(step, 100);
  ASSERT_EQ(check_step_plan(plan), "");
  plan.offset[1] = plan.offset[0];
  EXPECT_NE(check_step_plan(plan).find("overlap"), std::string::npos);
  plan.offset[1] = plan.region_bytes;
  EXPECT_NE(check_step_plan(plan).find("outside"), std::string::npos);
}

// --- step_planner on a pool ---

class StepPlanner : public gpumem_test::sim_pool_test {
 public:
  // One step of a loop: activations made and freed in a nested order, a big "logits"
  // tensor, small scratch, and one tensor that lives into the next step (the loss).
  struct loop {
    std::vector<std::pair<void*, std::size_t>> carried;  // freed by the next step
  };
  // before_loss: more requests (an evaluation pass, say) just before the step's last one.
  void run_step(memory_resource& r, loop& l, stream_handle s, std::size_t variant = 0,
                const std::function<void()>& before_loss = {}) {
    std::vector<std::pair<void*, std::size_t>> acts;
    for (std::size_t i = 0; i < 6; ++i) {
      const std::size_t n = (3 + i) * MiB + 4096 * i + variant;
      void* p = r.allocate(n, 256, s);
      fill(p, n, static_cast<unsigned char>(i + 1));
      acts.emplace_back(p, n);
    }
    for (auto [p, n] : l.carried) r.deallocate(p, n, s);
    l.carried.clear();
    void* logits = r.allocate(40 * MiB, 256, s);
    fill(logits, 40 * MiB, 0xAA);
    void* scratch = r.allocate(12345, 256, s);
    fill(scratch, 12345, 0xBB);
    for (std::size_t i = 0; i < acts.size(); ++i)
      ASSERT_TRUE(holds(acts[i].first, acts[i].second, static_cast<unsigned char>(i + 1)));
    ASSERT_TRUE(holds(logits, 40 * MiB, 0xAA));
    r.deallocate(scratch, 12345, s);
    r.deallocate(logits, 40 * MiB, s);
    while (!acts.empty()) {
      r.deallocate(acts.back().first, acts.back().second, s);
      acts.pop_back();
    }
    if (before_loss) before_loss();
    void* loss = r.allocate(512, 256, s);
    l.carried.emplace_back(loss, 512);
  }
  void finish(memory_resource& r, loop& l, stream_handle s) {
    for (auto [p, n] : l.carried) r.deallocate(p, n, s);
    l.carried.clear();
  }
  // A step of the other common loop: zero_grad at the top (so the gradients live across
  // the mark), forward, backward, the optimizer's scratch, the mark (by the optimizer's
  // hook, as gpumem.torch marks), then `after_optimizer` (an evaluation pass, say).
  using tensors = std::vector<std::pair<void*, std::size_t>>;
  void zero_grad_first_step(step_planner& planner, tensors& grads,
                            const std::function<void()>& after_optimizer = {}) {
    for (std::size_t i = 0; i < grads.size(); ++i) {  // zero_grad(set_to_none=True)
      ASSERT_TRUE(holds(grads[i].first, grads[i].second, static_cast<unsigned char>(0x40 + i)));
      planner.deallocate(grads[i].first, grads[i].second, {});
    }
    grads.clear();
    tensors acts;
    for (std::size_t i = 0; i < 6; ++i) {  // forward
      const std::size_t n = (4 + i) * MiB + 4096 * i;
      acts.emplace_back(planner.allocate(n, 256, {}), n);
      fill(acts.back().first, n, static_cast<unsigned char>(i + 1));
    }
    for (std::size_t i = 0; i < 4; ++i) {  // backward: a gradient made, an activation freed
      const std::size_t n = 6 * MiB + 512 * i;
      grads.emplace_back(planner.allocate(n, 256, {}), n);
      fill(grads.back().first, n, static_cast<unsigned char>(0x40 + i));
      planner.deallocate(acts.back().first, acts.back().second, {});
      acts.pop_back();
    }
    for (auto [p, n] : acts) planner.deallocate(p, n, {});
    void* state = planner.allocate(20 * MiB, 256, {});  // the optimizer's scratch
    planner.deallocate(state, 20 * MiB, {});
    planner.mark_step();
    if (after_optimizer) after_optimizer();
  }
  // Ends such a loop: the last gradients freed, the planner consistent, nothing live.
  void end_zero_grad_first_loop(step_planner& planner, tensors& grads) {
    for (auto [p, n] : grads) planner.deallocate(p, n, {});
    grads.clear();
    EXPECT_EQ(planner.validate(), "");
    EXPECT_EQ(planner.stats().live_bytes, 0u);
  }
};

TEST_F(StepPlanner, BeforeTheFirstMarkEverythingGoesToThePool) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  for (int i = 0; i < 3; ++i) run_step(planner, l, {});
  finish(planner, l, {});
  EXPECT_EQ(planner.counts().plans_built, 0u);
  EXPECT_EQ(planner.counts().planned_allocations, 0u);
  EXPECT_EQ(planner.stats().live_bytes, 0u);
  EXPECT_EQ(planner.validate(), "");
}

// Marks until the plan is built and its cycles run (the first step after the first mark
// frees nothing of an earlier step, so it differs from the next: steps 2 and 3 agree).
void run_until_planned(StepPlanner& f, step_planner& planner, StepPlanner::loop& l, int steps) {
  for (int i = 0; i < steps; ++i) {
    planner.mark_step();
    f.run_step(planner, l, {});
  }
}

// Ends the loop: a last mark, the carried loss freed, and the planner consistent.
void end_loop(StepPlanner& f, step_planner& planner, StepPlanner::loop& l) {
  planner.mark_step();
  f.finish(planner, l, {});
  EXPECT_EQ(planner.validate(), "");
}

// Runs the loop until its plan serves it: the first cycle on the plan has begun.
void start_on_plan(StepPlanner& f, step_planner& planner, StepPlanner::loop& l) {
  run_until_planned(f, planner, l, 5);
  planner.mark_step();
}

TEST_F(StepPlanner, TwoEqualStepsMakeAPlanThatServesLaterStepsWithoutTheDriver) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  run_until_planned(*this, planner, l, 3);
  EXPECT_EQ(planner.counts().plans_built, 0u);
  planner.mark_step();  // steps 2 and 3 agree
  auto c = planner.counts();
  EXPECT_EQ(c.plans_built, 1u);
  // 6 activations, logits, scratch and the loss: the loss outlives its step, but the
  // cycle begins at the step's least live point (before the loss is made), and it is freed
  // within the cycle.
  EXPECT_EQ(c.planned_count, 9u);
  run_step(planner, l, {});  // the first cycle begins at this step's loss
  planner.mark_step();
  c = planner.counts();
  EXPECT_EQ(c.region_bytes, c.plan_lower_bound);
  EXPECT_EQ(c.planned_allocations, 1u);
  const auto maps_before = calls(platform_op::map);
  const auto creates_before = calls(platform_op::create_physical);
  for (int i = 0; i < 5; ++i) {
    const auto served = planner.counts().planned_allocations;
    run_step(planner, l, {});
    planner.mark_step();
    ASSERT_EQ(planner.validate(), "");
    EXPECT_EQ(planner.counts().planned_allocations, served + 9u) << "step " << i;
  }
  c = planner.counts();
  EXPECT_EQ(c.planned_steps, 6u);
  EXPECT_EQ(c.steps_left_plan, 0u);
  EXPECT_EQ(calls(platform_op::map), maps_before);
  EXPECT_EQ(calls(platform_op::create_physical), creates_before);
  finish(planner, l, {});
  EXPECT_EQ(planner.stats().live_bytes, 0u);
  EXPECT_EQ(planner.stats().live_allocations, 0u);
}

TEST_F(StepPlanner, PeakLiveCountsPlannedAllocationsNotTheRegion) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  run_step(planner, l, {});
  const std::size_t peak_one_step = planner.stats().peak_live_bytes;
  for (int i = 0; i < 6; ++i) {
    planner.mark_step();
    run_step(planner, l, {});
  }
  ASSERT_GE(planner.counts().planned_allocations, 8u);
  // The same requests every step: the same peak (plus the carried loss of the step before).
  EXPECT_LE(planner.stats().peak_live_bytes, peak_one_step + 512);
  EXPECT_GE(planner.stats().peak_live_bytes, peak_one_step);
  EXPECT_EQ(planner.stats().reserved_bytes, pool.stats().reserved_bytes);
  finish(planner, l, {});
}

TEST_F(StepPlanner, ADifferentRequestTakesTheRestOfTheStepToThePoolAndTheNextStepIsPlannedAgain) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  start_on_plan(*this, planner, l);
  ASSERT_EQ(planner.counts().plans_built, 1u);
  ASSERT_GT(planner.counts().planned_allocations, 0u);
  const auto served = planner.counts().planned_allocations;
  run_step(planner, l, {}, /*variant=*/512);  // every activation 512 bytes larger
  EXPECT_EQ(planner.counts().steps_left_plan, 1u);
  // Nothing from the region but, at most, the loss that begins the next cycle.
  EXPECT_LE(planner.counts().planned_allocations, served + 1u);
  EXPECT_EQ(planner.validate(), "");
  planner.mark_step();
  const auto before = planner.counts().planned_allocations;
  run_step(planner, l, {});  // as planned again
  EXPECT_EQ(planner.counts().planned_allocations, before + 9u);
  EXPECT_EQ(planner.counts().plans_built, 1u);
  EXPECT_EQ(planner.counts().steps_left_plan, 1u);
  // The odd step gave the region back (the pool used its memory); this one took it again.
  EXPECT_EQ(planner.counts().region_takes, 2u);
  end_loop(*this, planner, l);
}

// Planned addresses come from the region without the pool: while the pool sleeps (the
// region's pages released with the rest) the planner refuses them as the pool refuses its
// own, changing nothing; after the wake the plan serves the same step again.
TEST_F(StepPlanner, APlannedRequestWhileThePoolSleepsIsRefusedAndThePlanServesAfterTheWake) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  start_on_plan(*this, planner, l);
  ASSERT_TRUE(planner.counts().region_bytes > 0);
  const step_planner_counts before = planner.counts();
  pool.sleep(sleep_mode::discard);
  EXPECT_THROW((void)planner.allocate(3 * MiB, 256, {}), invalid_argument);  // the step's first
  EXPECT_EQ(planner.counts().planned_allocations, before.planned_allocations);
  EXPECT_EQ(planner.counts().steps_left_plan, before.steps_left_plan);
  EXPECT_EQ(planner.validate(), "");
  pool.wake();
  run_step(planner, l, {});  // writes and checks every allocation's bytes
  EXPECT_EQ(planner.counts().planned_allocations, before.planned_allocations + 9u);
  end_loop(*this, planner, l);
}

TEST_F(StepPlanner, AMarkWhileThePoolSleepsDefersTheCycleToTheWakeWithoutABackoff) {
  // A loop whose cycle begins at the mark (everything freed within the step), marked while
  // its tag sleeps, as an RL trainer marks its step: the cycle begins with the first
  // request after the wake, on the plan, and no refusal is counted or backed off from.
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  const auto step = [&] {
    void* a = planner.allocate(5 * MiB, 256, {});
    void* b = planner.allocate(7 * MiB + 512, 256, {});
    fill(a, 5 * MiB, 0x11);
    fill(b, 7 * MiB + 512, 0x22);
    ASSERT_TRUE(holds(a, 5 * MiB, 0x11));
    planner.deallocate(b, 7 * MiB + 512, {});
    planner.deallocate(a, 5 * MiB, {});
  };
  planner.mark_step();
  step();
  planner.mark_step();
  step();
  pool.sleep(sleep_mode::discard);
  planner.mark_step();  // the plan is built while the pool sleeps: no region yet
  auto c = planner.counts();
  ASSERT_EQ(c.plans_built, 1u);
  EXPECT_EQ(c.region_takes, 0u);
  EXPECT_EQ(c.region_failures, 0u);
  pool.wake();
  step();
  c = planner.counts();
  EXPECT_EQ(c.region_takes, 1u) << "taken by the first request after the wake";
  EXPECT_EQ(c.region_failures, 0u);
  EXPECT_EQ(c.planned_allocations, 2u);
  EXPECT_EQ(c.planned_steps, 1u);
  // Marked again while asleep, the region held: the next step after the wake is planned.
  pool.sleep(sleep_mode::discard);
  planner.mark_step();
  pool.wake();
  step();
  c = planner.counts();
  EXPECT_EQ(c.planned_allocations, 4u);
  EXPECT_EQ(c.planned_steps, 2u);
  EXPECT_EQ(c.region_failures, 0u);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, AStepThatLeavesAtItsCycleStartRejoinsWhereTheNextCycleBegins) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  start_on_plan(*this, planner, l);
  ASSERT_EQ(planner.counts().region_takes, 1u);
  // An evaluation pass where the cycle begins (before the loss): other sizes, large and
  // small, all freed before the loss comes. The plan is left there, the pass runs on the
  // pool, and the loss (the request a cycle begins with) rejoins it.
  auto evaluation = [&] {
    std::vector<std::pair<void*, std::size_t>> held;
    for (std::size_t i = 0; i < 4; ++i) held.emplace_back(planner.allocate((5 + i) * MiB + 1024, 256, {}), (5 + i) * MiB + 1024);
    for (int i = 0; i < 16; ++i) held.emplace_back(planner.allocate(64 * KiB, 256, {}), 64 * KiB);
    for (auto [p, n] : held) fill(p, n, 0x5e);
    for (auto [p, n] : held) planner.deallocate(p, n, {});
  };
  const auto served = planner.counts().planned_allocations;
  const auto maps = calls(platform_op::map);
  run_step(planner, l, {}, 0, evaluation);
  // The pass ran in the region's memory, given back to the pool, and left it whole: taking
  // it again mapped nothing.
  EXPECT_EQ(calls(platform_op::map), maps);
  auto c = planner.counts();
  EXPECT_EQ(c.steps_left_plan, 1u);
  EXPECT_EQ(c.steps_rejoined, 1u);
  EXPECT_EQ(c.planned_allocations, served + 9u) << "the step's own 8 and the loss, planned";
  EXPECT_EQ(planner.validate(), "");
  planner.mark_step();
  run_step(planner, l, {});  // the cycle the loss began runs on, and the next begins
  planner.mark_step();
  c = planner.counts();
  EXPECT_EQ(c.planned_allocations, served + 18u);
  EXPECT_EQ(c.steps_left_plan, 1u);
  EXPECT_EQ(c.region_takes, 2u);  // given back for the pass, taken again by the loss
  // A detour, then a request that only looks like a cycle's beginning: the step rejoins,
  // leaves at the next difference, and does not rejoin again (the loss goes to the pool).
  auto odd = [&] {
    void* x = planner.allocate(MiB, 256, {});  // unlike the plan: leaves
    planner.deallocate(x, MiB, {});
    void* p = planner.allocate(512, 256, {});                // as the loss: rejoins
    void* q = planner.allocate(3 * MiB + 7 * 512, 256, {});  // unlike the plan: leaves
    planner.deallocate(q, 3 * MiB + 7 * 512, {});
    planner.deallocate(p, 512, {});
  };
  const auto before_odd = planner.counts();
  run_step(planner, l, {}, 0, odd);
  c = planner.counts();
  EXPECT_EQ(c.steps_rejoined, before_odd.steps_rejoined + 1);
  EXPECT_EQ(c.steps_left_plan, before_odd.steps_left_plan + 2);
  EXPECT_EQ(c.planned_allocations, before_odd.planned_allocations + 8u + 1u)
      << "the step's 8 (its cycle began a step earlier) and p; not the loss";
  EXPECT_EQ(planner.validate(), "");
  planner.mark_step();
  run_step(planner, l, {});  // the loss of the odd step was not planned: this step is not
  planner.mark_step();
  run_step(planner, l, {});  // on the plan again
  EXPECT_GT(planner.counts().planned_allocations, c.planned_allocations);
  planner.mark_step();
  // A detour whose allocation still lives when the loss comes: not the same point of the
  // loop (the live bytes differ), so no rejoining.
  void* kept = nullptr;
  c = planner.counts();
  run_step(planner, l, {}, 0, [&] { kept = planner.allocate(MiB, 256, {}); });
  EXPECT_EQ(planner.counts().steps_rejoined, c.steps_rejoined);
  EXPECT_EQ(planner.counts().steps_left_plan, c.steps_left_plan + 1);
  planner.deallocate(kept, MiB, {});
  planner.mark_step();
  finish(planner, l, {});
  EXPECT_EQ(planner.validate(), "");
  EXPECT_EQ(planner.stats().live_bytes, 0u);
}

TEST_F(StepPlanner, ARegionTakenAgainAfterADetourMapsOnlyThePagesItLost) {
  // The region (~74 MiB) counts as a huge request here, as a training step's does with
  // the default huge_growth (1 GiB).
  vmm_page_pool pool(sim, 0, pool_options::parse("huge_growth:64M"));
  step_planner planner(pool);
  loop l;
  start_on_plan(*this, planner, l);
  ASSERT_EQ(planner.counts().region_takes, 1u);
  const std::size_t region_pages = planner.counts().region_bytes / (2 * MiB);
  // The detour's small requests need pages: the small arena takes them from the top of
  // the region given back. The loss rejoins the plan and takes the region again.
  auto evaluation = [&] {
    std::vector<std::pair<void*, std::size_t>> held;
    for (int i = 0; i < 80; ++i) held.emplace_back(planner.allocate(64 * KiB, 256, {}), 64 * KiB);
    held.emplace_back(planner.allocate(9 * MiB, 256, {}), 9 * MiB);
    for (auto [p, n] : held) fill(p, n, 0x3d);
    for (auto [p, n] : held) planner.deallocate(p, n, {});
  };
  const auto maps = calls(platform_op::map);
  run_step(planner, l, {}, 0, evaluation);
  EXPECT_EQ(planner.counts().steps_rejoined, 1u);
  EXPECT_EQ(planner.counts().region_takes, 2u);
  const auto remapped = calls(platform_op::map) - maps;
  // The small arena's pages, and as many mapped again beside the rest of the region.
  EXPECT_GT(remapped, 0u);
  EXPECT_LE(remapped, 6u) << "of a region of " << region_pages << " pages";
  planner.mark_step();
  run_step(planner, l, {});
  planner.mark_step();
  EXPECT_EQ(planner.counts().steps_left_plan, 1u);
  finish(planner, l, {});
  EXPECT_EQ(planner.validate(), "");
}

// The other common loop: zero_grad at the top, so the gradients live across the mark, and
// an evaluation pass after the optimizer step, while they still live. The plan is left with
// planned allocations live: they become the pool's, the rest of the region goes back, and
// the pass runs in it instead of beside it.
TEST_F(StepPlanner, AnEvaluationWhileGradientsLiveRunsInTheRegionsFreeMemory) {
  // The region (~63 MiB) counts as a huge request, as a training step's does with the
  // default huge_growth (1 GiB): taken again, it grows its old free run in place.
  vmm_page_pool pool(sim, 0, pool_options::parse("footprint:tight,huge_growth:32M"));
  step_planner planner(pool);
  tensors grads;
  auto train_step = [&](const std::function<void()>& after_optimizer) {
    zero_grad_first_step(planner, grads, after_optimizer);
  };
  for (int i = 0; i < 7; ++i) train_step({});
  ASSERT_EQ(planner.counts().plans_built, 1u);
  ASSERT_GT(planner.counts().planned_steps, 0u);
  const std::size_t region = planner.counts().region_bytes;
  ASSERT_GT(region, 0u);
  const std::size_t reserved = pool.stats().reserved_bytes;
  // Other sizes than the plan's, 24 MiB at once: less than the region holds free while the
  // gradients (~24 MiB) live, more than the pool holds outside it.
  auto evaluation = [&] {
    std::vector<std::pair<void*, std::size_t>> held;
    for (std::size_t i = 0; i < 3; ++i) held.emplace_back(planner.allocate(8 * MiB - 512 * i, 256, {}), 8 * MiB - 512 * i);
    held.emplace_back(planner.allocate(64 * KiB, 256, {}), 64 * KiB);
    for (auto [p, n] : held) fill(p, n, 0x5e);
    for (auto [p, n] : held) ASSERT_TRUE(holds(p, n, 0x5e));
    for (auto [p, n] : held) planner.deallocate(p, n, {});
  };
  const auto served = planner.counts().planned_allocations;
  train_step(evaluation);
  auto c = planner.counts();
  EXPECT_EQ(c.steps_left_plan, 1u);
  EXPECT_EQ(c.regions_handed_over, 1u);
  EXPECT_EQ(c.region_bytes, 0u);
  EXPECT_EQ(c.planned_live_bytes, 0u) << "the gradients are the pool's now";
  EXPECT_EQ(pool.stats().reserved_bytes, reserved) << "the pass ran beside the region";
  EXPECT_EQ(planner.validate(), "");
  EXPECT_EQ(pool.validate(), "");
  // The gradients are freed by the next step's zero_grad (through the pool). The pass's
  // requests came first in that step, so the cycle does not begin at its usual event: it
  // begins (rejoins) where its first request comes with the live bytes a cycle begins with.
  const auto maps = calls(platform_op::map);
  train_step({});
  train_step({});
  c = planner.counts();
  // 11 planned a cycle (6 activations, 4 gradients, the optimizer's scratch): the cycle
  // the pass followed, and the two after it.
  EXPECT_EQ(c.planned_allocations, served + 3 * 11u);
  EXPECT_EQ(c.steps_left_plan, 1u);
  EXPECT_EQ(c.steps_rejoined, 1u);
  EXPECT_EQ(c.region_takes, 2u);
  EXPECT_EQ(c.region_bytes, region);
  // The pass's small request took a page of the free region for the small arena; taking
  // the region again maps only what it lacks, where it was.
  EXPECT_LE(calls(platform_op::map) - maps, 2u);
  EXPECT_EQ(pool.stats().reserved_bytes, reserved);
  end_zero_grad_first_loop(planner, grads);
}

// The same loop with an evaluation pass right after the first cycle on the plan: the next
// cycle's event falls inside the pass, and a request of the pass looks like a cycle's
// first. No step is lost, this pass's or a later one's.
TEST_F(StepPlanner, APassWhereTheFirstCycleBeginsDoesNotMisleadLaterCycles) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  tensors grads;
  auto evaluation = [&] {
    void* a = planner.allocate(10 * MiB, 256, {});
    void* b = planner.allocate(10 * MiB, 256, {});
    planner.deallocate(a, 10 * MiB, {});
    planner.deallocate(b, 10 * MiB, {});
    void* like_first = planner.allocate(4 * MiB, 256, {});  // as the forward's first request
    void* c = planner.allocate(20 * MiB + 512, 256, {});
    fill(like_first, 4 * MiB, 0x61);
    fill(c, 20 * MiB + 512, 0x62);
    ASSERT_TRUE(holds(like_first, 4 * MiB, 0x61));
    planner.deallocate(c, 20 * MiB + 512, {});
    planner.deallocate(like_first, 4 * MiB, {});
  };
  planner.mark_step();
  for (int i = 0; i < 3; ++i) zero_grad_first_step(planner, grads);
  ASSERT_EQ(planner.counts().plans_built, 1u) << "built at the last mark";
  ASSERT_EQ(planner.counts().planned_steps, 0u);
  zero_grad_first_step(planner, grads, evaluation);
  // The pass found the first cycle on the plan (begun in the step before) and left it,
  // with gradients live: handed over. The next cycle's event came inside the pass, with
  // other live bytes than the plan's step had there: not begun there (that would take a
  // second region beside the pass and the gradients, and a request of the pass looks like
  // the cycle's first), but where the forward's first request came with those bytes.
  zero_grad_first_step(planner, grads);  // (the forward of the step the pass began)
  auto c = planner.counts();
  EXPECT_EQ(c.steps_left_plan, 1u);
  EXPECT_EQ(c.regions_handed_over, 1u);
  EXPECT_EQ(c.steps_rejoined, 1u);
  EXPECT_EQ(c.planned_steps, 2u);
  EXPECT_EQ(c.region_takes, 2u);
  for (int i = 0; i < 3; ++i) zero_grad_first_step(planner, grads);
  EXPECT_EQ(planner.counts().planned_steps, 5u) << "every later cycle on the plan";
  c = planner.counts();
  const auto rejoined = c.steps_rejoined;
  // A later pass, gradients live: handed over, and the next cycle rejoins where it begins.
  zero_grad_first_step(planner, grads, evaluation);
  zero_grad_first_step(planner, grads);
  zero_grad_first_step(planner, grads);
  EXPECT_EQ(planner.counts().steps_rejoined, rejoined + 1);
  EXPECT_EQ(planner.counts().planned_steps, c.planned_steps + 3u);
  planner.mark_step();
  end_zero_grad_first_loop(planner, grads);
}

TEST_F(StepPlanner, AFreeOutOfOrderLeavesThePlanAndNothingOverlaps) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  const stream_handle s{};
  auto step = [&](bool swap) {
    void* a = planner.allocate(4 * MiB, 256, s);
    void* b = planner.allocate(2 * MiB, 256, s);
    fill(b, 2 * MiB, 0x22);
    if (swap) {
      planner.deallocate(b, 2 * MiB, s);
      b = nullptr;
    }
    planner.deallocate(a, 4 * MiB, s);
    void* c = planner.allocate(6 * MiB, 256, s);  // the plan had b freed here, not a
    fill(c, 6 * MiB, 0x33);
    if (b != nullptr) {
      EXPECT_TRUE(holds(b, 2 * MiB, 0x22));
      planner.deallocate(b, 2 * MiB, s);
    }
    planner.deallocate(c, 6 * MiB, s);
  };
  for (int i = 0; i < 3; ++i) {
    planner.mark_step();
    step(false);
  }
  planner.mark_step();
  ASSERT_EQ(planner.counts().plans_built, 1u);
  step(true);
  EXPECT_EQ(planner.counts().steps_left_plan, 1u);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, APlannedAllocationLivingPastTheMarkKeepsTheNextStepOffThePlan) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  const stream_handle s{};
  std::vector<void*> kept;
  auto step = [&](bool keep) {
    void* a = planner.allocate(8 * MiB, 256, s);
    fill(a, 8 * MiB, 0x44);
    if (keep)
      kept.push_back(a);
    else
      planner.deallocate(a, 8 * MiB, s);
  };
  for (int i = 0; i < 3; ++i) {
    planner.mark_step();
    step(false);
  }
  planner.mark_step();
  step(true);  // served from the region, and not freed
  planner.mark_step();
  const auto served = planner.counts().planned_allocations;
  step(false);  // must not get the kept one's address
  EXPECT_EQ(planner.counts().planned_allocations, served);
  EXPECT_TRUE(holds(kept[0], 8 * MiB, 0x44));
  planner.deallocate(kept[0], 8 * MiB, s);
  planner.mark_step();
  step(false);  // the region is idle again: planned
  EXPECT_EQ(planner.counts().planned_allocations, served + 1);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, ALoopThatChangesIsPlannedAgain) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  run_until_planned(*this, planner, l, 4);
  planner.mark_step();
  ASSERT_EQ(planner.counts().plans_built, 1u);
  for (int i = 0; i < 3; ++i) {
    run_step(planner, l, {}, 1024);  // a new shape, from now on
    planner.mark_step();
  }
  EXPECT_EQ(planner.counts().plans_built, 2u);
  run_step(planner, l, {}, 1024);  // the new plan's first cycle begins at its loss
  planner.mark_step();
  const auto served = planner.counts().planned_allocations;
  run_step(planner, l, {}, 1024);
  EXPECT_EQ(planner.counts().planned_allocations, served + 9u);
  end_loop(*this, planner, l);
}

TEST_F(StepPlanner, BadFreesAreRefusedAndChangeNothing) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  const stream_handle s{};
  auto step = [&]() {
    void* a = planner.allocate(MiB, 256, s);
    planner.deallocate(a, MiB, s);
  };
  for (int i = 0; i < 3; ++i) {
    planner.mark_step();
    step();
  }
  planner.mark_step();
  void* a = planner.allocate(MiB, 256, s);
  ASSERT_EQ(planner.counts().planned_live_bytes, MiB);
  EXPECT_THROW(planner.deallocate(a, MiB + 1, s), invalid_argument);
  EXPECT_THROW(planner.deallocate(static_cast<char*>(a) + 512, MiB, s), invalid_argument);
  EXPECT_EQ(planner.counts().planned_live_bytes, MiB);
  planner.deallocate(a, MiB, s);
  EXPECT_THROW(planner.deallocate(a, MiB, s), invalid_argument);  // twice
  EXPECT_EQ(planner.counts().planned_live_bytes, 0u);
  EXPECT_EQ(planner.counts().steps_left_plan, 0u);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, APlannedFreeOnAnotherStreamMakesThePlanStreamWait) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  const stream_handle s = make_stream(), t = make_stream();
  for (int i = 0; i < 3; ++i) {
    planner.mark_step();
    void* a = planner.allocate(MiB, 256, s);
    planner.deallocate(a, MiB, s);
  }
  planner.mark_step();
  void* a = planner.allocate(MiB, 256, s);
  ASSERT_EQ(planner.counts().planned_live_bytes, MiB);
  const auto waits = calls(platform_op::stream_wait_event);
  planner.deallocate(a, MiB, t);
  EXPECT_EQ(calls(platform_op::stream_wait_event), waits + 1);
  EXPECT_EQ(planner.counts().steps_left_plan, 1u);  // not the recorded free
  planner.release_stream(s);
  planner.release_stream(t);
  EXPECT_EQ(planner.counts().region_bytes, 0u);  // the region went back with its stream
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, NoRoomForTheRegionLeavesTheLoopOnThePoolAndIsTriedAgainLater) {
  pool_options o;
  o.limit_bytes = 64 * MiB;
  vmm_page_pool pool(sim, 0, o);
  step_planner planner(pool);
  const stream_handle s{};
  void* held = planner.allocate(44 * MiB, 256, s);  // made before the marks: the pool's
  auto step = [&]() {
    void* a = planner.allocate(10 * MiB, 256, s);
    void* b = planner.allocate(10 * MiB, 256, s);
    fill(a, 10 * MiB, 1);
    planner.deallocate(a, 10 * MiB, s);
    planner.deallocate(b, 10 * MiB, s);
  };
  planner.mark_step();
  step();
  planner.mark_step();
  step();
  // Someone else takes the memory the step freed: at the mark the region (20 MiB) cannot
  // be had within the limit.
  void* blocker = pool.allocate(20 * MiB, 256, s);
  planner.mark_step();
  EXPECT_EQ(planner.counts().plans_built, 1u);
  EXPECT_EQ(planner.counts().region_failures, 1u);
  EXPECT_EQ(planner.counts().region_bytes, 0u);
  EXPECT_EQ(planner.counts().planned_steps, 0u);
  pool.deallocate(blocker, 20 * MiB, s);
  step();  // on the pool, as without a plan
  EXPECT_EQ(planner.counts().planned_allocations, 0u);
  planner.mark_step();  // too soon to ask again (backing off)
  EXPECT_EQ(planner.counts().planned_steps, 0u);
  step();
  planner.mark_step();  // asked again: the memory is back
  EXPECT_EQ(planner.counts().planned_steps, 1u);
  EXPECT_EQ(planner.counts().region_bytes, 20 * MiB);
  step();
  EXPECT_EQ(planner.counts().planned_allocations, 2u);
  planner.deallocate(held, 44 * MiB, s);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, OverACachingPoolPlannedAddressesKeepTheirAlignment) {
  runtime_resource upstream(sim, 0);
  caching_pool pool(upstream);  // aligns to 256 bytes at most
  step_planner planner(pool);
  const stream_handle s{};
  std::vector<void*> got;
  for (int i = 0; i < 5; ++i) {
    planner.mark_step();
    void* a = planner.allocate(1000, 256, s);
    void* b = planner.allocate(3 * MiB + 7, 128, s);
    got.push_back(a);
    got.push_back(b);
    planner.deallocate(a, 1000, s);
    planner.deallocate(b, 3 * MiB + 7, s);
  }
  EXPECT_EQ(planner.counts().planned_allocations, 3u * 2u);
  for (void* p : got) EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, AStepLongerThanRecordedIsNotKeptAndNotPlanned) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool, /*max_planned=*/2);  // records up to 16 events a step
  const stream_handle s{};
  auto step = [&](int n) {
    for (int i = 0; i < n; ++i) {
      void* a = planner.allocate(MiB, 256, s);
      planner.deallocate(a, MiB, s);
    }
  };
  for (int i = 0; i < 4; ++i) {
    planner.mark_step();
    step(20);  // 40 events
  }
  planner.mark_step();
  EXPECT_EQ(planner.counts().steps_too_long, 4u);
  EXPECT_EQ(planner.counts().plans_built, 0u);
  for (int i = 0; i < 3; ++i) {
    step(5);  // 10 events: recorded, and planned once two agree
    planner.mark_step();
  }
  EXPECT_EQ(planner.counts().plans_built, 1u);
  EXPECT_EQ(planner.counts().steps_too_long, 4u);
  EXPECT_EQ(planner.validate(), "");
}

TEST_F(StepPlanner, SegmentsShowPlannedAllocationsInsideTheRegion) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  start_on_plan(*this, planner, l);
  void* a = planner.allocate(3 * MiB, 256, {});  // the step's first activation, planned
  ASSERT_EQ(planner.counts().planned_live_bytes, 3 * MiB + 512);  // with the loss
  bool found = false;
  for (const memory_segment& seg : planner.memory_segments()) {
    std::size_t sum = 0;
    for (const memory_block& b : seg.blocks) {
      sum += b.size;
      if (b.address == reinterpret_cast<std::uintptr_t>(a)) {
        found = true;
        EXPECT_EQ(b.requested, 3 * MiB);
        EXPECT_EQ(b.st, memory_block::state::allocated);
      }
    }
    EXPECT_EQ(sum, seg.size);  // the blocks still tile the segment
  }
  EXPECT_TRUE(found);
  planner.deallocate(a, 3 * MiB, {});
  finish(planner, l, {});
}

}  // namespace

namespace {

// A planned allocation freed on a stream the platform refuses (a value it never made, or a
// stream destroyed since) is refused as the pool refuses such a free: invalid_argument,
// the allocation live and planned as before, nothing recorded; the right free then works.
TEST_F(StepPlanner, APlannedFreeOnAStreamThePlatformRefusesChangesNothing) {
  vmm_page_pool pool(sim, 0);
  step_planner planner(pool);
  loop l;
  start_on_plan(*this, planner, l);
  const auto planned_before = planner.counts().planned_allocations;
  void* p = planner.allocate(3 * MiB, 256, {});  // the first activation of run_step: planned
  ASSERT_EQ(planner.counts().planned_allocations, planned_before + 1) << "the allocation is planned";
  fill(p, 3 * MiB, 0x3c);
  const auto made = sim.stream_create(0);
  ASSERT_TRUE(made.ok());
  const stream_handle gone = made.value();
  ASSERT_TRUE(sim.stream_destroy(gone).ok());
  for (const stream_handle bad : {stream_handle{0x1234}, gone}) {
    const auto before = planner.stats();
    const auto counts_before = planner.counts();
    EXPECT_THROW(planner.deallocate(p, 3 * MiB, bad), invalid_argument);
    const auto after = planner.stats();
    EXPECT_EQ(after.live_bytes, before.live_bytes);
    EXPECT_EQ(after.live_allocations, before.live_allocations);
    EXPECT_EQ(after.deallocations, before.deallocations);
    EXPECT_EQ(planner.counts().planned_live_bytes, counts_before.planned_live_bytes);
    EXPECT_EQ(planner.counts().steps_left_plan, counts_before.steps_left_plan);
    EXPECT_EQ(planner.validate(), "");
    EXPECT_TRUE(holds(p, 3 * MiB, 0x3c));
  }
  planner.deallocate(p, 3 * MiB, {});
  planner.mark_step();
  finish(planner, l, {});
  EXPECT_EQ(planner.stats().live_bytes, 0u);
  EXPECT_EQ(planner.validate(), "");
}

}  // namespace
