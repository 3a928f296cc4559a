// Steps found in traces (find_steps) and step plans replaying them: the shipped fixed-shape
// training trace (data/torch_train_fixed.csv.gz, recorded from torch_proof.py's loop).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "gpumem/replay/trace.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::GiB;
using gpumem_test::MiB;

// A warm-up of its own shapes, then `steps` equal steps: nested activations, a scratch
// buffer, and a loss that lives into the next step.
std::string loop_trace_text(int steps) {
  std::string text = "action,addr,size,stream,time_us\n";
  std::uint64_t addr = 1 << 20;
  auto alloc = [&](std::uint64_t size) {
    text += "alloc," + std::to_string(addr) + "," + std::to_string(size) + ",0,0\n";
    addr += size + 4096;
    return std::pair{addr - size - 4096, size};
  };
  auto free = [&](std::pair<std::uint64_t, std::uint64_t> a) {
    text += "free_completed," + std::to_string(a.first) + "," + std::to_string(a.second) + ",0,0\n";
  };
  for (int i = 0; i < 5; ++i) free(alloc(777 * (i + 1)));  // warm-up
  std::pair<std::uint64_t, std::uint64_t> loss{0, 0};
  for (int s = 0; s < steps; ++s) {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> acts;
    for (int i = 0; i < 4; ++i) acts.push_back(alloc((i + 1) * MiB));
    if (loss.second != 0) free(loss);
    const auto scratch = alloc(3000);
    free(scratch);
    while (!acts.empty()) {
      free(acts.back());
      acts.pop_back();
    }
    loss = alloc(512);
  }
  free(loss);
  return text;
}

TEST(FindSteps, FindsTheStepsOfALoopAtItsLeastLivePoint) {
  const trace t = parse_trace(loop_trace_text(6), "loop");
  const std::vector<std::size_t> starts = find_steps(t);
  ASSERT_GE(starts.size(), 5u);
  const std::size_t period = starts[1] - starts[0];
  for (std::size_t i = 1; i < starts.size(); ++i) EXPECT_EQ(starts[i] - starts[i - 1], period);
  for (std::size_t s : starts) EXPECT_EQ(t.events[s].op, trace_event::kind::alloc);
  // The least live point of a step is after its activations are freed, when nothing is
  // live (the previous loss was freed mid-step): each step begins with its loss (512 B).
  EXPECT_EQ(t.events[starts[1]].size, 512u);
  EXPECT_EQ(t.events[starts[1] + 1].size, MiB);
}

TEST(FindSteps, FindsNoStepsWhenTheTraceDoesNotRepeat) {
  std::string text = "action,addr,size,stream,time_us\n";
  for (int i = 0; i < 40; ++i)
    text += "alloc," + std::to_string((i + 1) << 24) + "," + std::to_string(512 * (i + 1)) + ",0,0\n";
  EXPECT_TRUE(find_steps(parse_trace(text, "growing")).empty());
  // Two repeats are not enough to plan (two steps to agree, one to use).
  EXPECT_TRUE(find_steps(parse_trace(loop_trace_text(2), "short")).empty());
}

TEST(StepPlanReplay, TheFixedShapeTrainingTraceRunsItsPlannedStepsWithNoDriverCall) {
  const std::string path = gpumem_test::find_in_source_tree("data/torch_train_fixed.csv.gz");
  if (path.empty()) GTEST_SKIP() << gpumem_test::not_in_source_tree("data/torch_train_fixed.csv.gz");
  const trace t = load_trace(path);
  const std::vector<std::size_t> starts = find_steps(t);
  ASSERT_GE(starts.size(), 4u);  // 6 steps recorded; the first is warm-up

  sim_options so;
  so.capacity = 32 * GiB;  // sparse: untouched pages cost no host memory
  so.granularity = 2 * MiB;
  sim_platform sim(so);
  {
    // footprint:tight: the plan within 1.01 of the live bytes (over footprint:fast the
    // warm-up steps grow the pool as a cache: 1.0408).
    vmm_page_pool pool(sim, 0, gpumem_test::tight_footprint());
    step_planner planner(pool);
    std::vector<void*> ptrs(t.allocs, nullptr);
    std::size_t next = 0;
    std::vector<std::uint64_t> maps_at_mark;  // cuMemMap calls so far, at each mark
    std::vector<std::uint64_t> planned_at_mark;  // cycles begun on the plan, at each mark
    for (std::size_t i = 0; i < t.events.size(); ++i) {
      if (next < starts.size() && starts[next] == i) {
        planner.mark_step();
        maps_at_mark.push_back(sim.calls_made(platform_op::map));
        planned_at_mark.push_back(planner.counts().planned_steps);
        ++next;
      }
      const trace_event& e = t.events[i];
      if (e.op == trace_event::kind::alloc)
        ptrs[e.id] = planner.allocate(e.size);
      else
        planner.deallocate(std::exchange(ptrs[e.id], nullptr), e.size);
    }
    const step_planner_counts c = planner.counts();
    EXPECT_EQ(c.plans_built, 1u);
    EXPECT_EQ(c.steps_left_plan, 0u);
    EXPECT_EQ(c.region_bytes, c.plan_lower_bound);  // the greedy layout meets the bound here
    // The first cycle on the plan takes the region (one gather of the pool's free pages);
    // every step after that maps nothing.
    const auto first = static_cast<std::size_t>(
        std::find_if(planned_at_mark.begin(), planned_at_mark.end(),
                     [](std::uint64_t n) { return n > 0; }) - planned_at_mark.begin());
    ASSERT_LT(first + 1, maps_at_mark.size()) << "no step ran wholly on the plan";
    EXPECT_GE(c.planned_steps, maps_at_mark.size() - first);
    for (std::size_t m = first + 1; m < maps_at_mark.size(); ++m)
      EXPECT_EQ(maps_at_mark[m], maps_at_mark[first]) << "step " << m;
    EXPECT_EQ(sim.calls_made(platform_op::map), maps_at_mark.back());
    const double fragmentation = static_cast<double>(planner.stats().peak_reserved_bytes) /
                                 static_cast<double>(t.peak_live_bytes);
    EXPECT_EQ(planner.stats().peak_live_bytes, t.peak_live_bytes);
    EXPECT_LE(fragmentation, 1.01);
    EXPECT_EQ(planner.validate(), "");
    for (const trace_event& e : t.events)
      if (e.op == trace_event::kind::alloc && ptrs[e.id] != nullptr)
        planner.deallocate(std::exchange(ptrs[e.id], nullptr), e.size);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(StepPlanReplay, ReplayMarksStepsAndReportsWhatThePlanServed) {
  const trace t = parse_trace(loop_trace_text(8), "loop");
  sim_options so;
  so.capacity = 4 * GiB;
  so.granularity = 2 * MiB;
  sim_platform sim(so);
  {
    vmm_page_pool pool(sim);
    step_planner planner(pool);
    replay_options o;
    o.passes = 2;
    o.step_starts = find_steps(t);
    const replay_result r = replay_trace(t, planner, o);
    EXPECT_FALSE(r.oom);
    EXPECT_EQ(r.steps_marked, 2 * o.step_starts.size());
    EXPECT_EQ(r.plans_built, 1u);
    // Each planned step serves its 4 activations and the scratch buffer (the loss lives on).
    EXPECT_GE(r.planned_allocations, 5u * (o.step_starts.size() - 2));
    EXPECT_EQ(r.allocator, "step_plan+vmm_page_pool");
    // The planner's own counts, as it reports them.
    const step_planner_counts c = planner.counts();
    EXPECT_EQ(r.steps_left_plan, c.steps_left_plan);
    EXPECT_EQ(r.steps_rejoined, c.steps_rejoined);
    EXPECT_EQ(r.regions_handed_over, c.regions_handed_over);
    // The second pass restarts the trace's first steps, unlike the plan: it leaves at least once.
    EXPECT_GE(r.steps_left_plan, 1u);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

}  // namespace
