// timed_platform forwards every call and books its measured time per operation.
#include <gtest/gtest.h>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"

namespace {

using namespace gpumem;

TEST(timed_platform, forwards_calls_and_measures_at_least_the_spun_latency) {
  sim_options o;
  o.capacity = std::size_t{1} << 30;
  o.latency = sim_latency::spin;  // each sim call busy-waits its modelled H200 latency
  sim_platform sim(o);
  timed_platform timed(sim);
  EXPECT_EQ(timed.kind(), "sim");
  {
    vmm_resource vmm(timed, 0);
    void* p = vmm.allocate(4 << 20);
    vmm.deallocate(p, 4 << 20);
  }
  for (platform_op op : {platform_op::reserve_range, platform_op::create_physical, platform_op::map,
                         platform_op::set_access, platform_op::unmap, platform_op::release_physical,
                         platform_op::free_range}) {
    EXPECT_EQ(timed.calls_made(op), 1u) << platform_op_name(op);
    EXPECT_EQ(sim.calls_made(op), 1u) << platform_op_name(op);
    EXPECT_GE(timed.measured_ns(op), sim.modelled_ns(op)) << platform_op_name(op);
  }
  EXPECT_GE(timed.measured_ns(), sim.modelled_ns());
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(timed_platform, failures_pass_through_unchanged) {
  sim_platform sim;
  timed_platform timed(sim);
  sim.inject_fault(platform_op::create_physical, sim_fault{.nth = 1, .kind = failure_kind::driver_error});
  auto h = timed.create_physical(0, 2 << 20);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.error().kind, failure_kind::driver_error);
  EXPECT_EQ(h.error().call, platform_op::create_physical);
  EXPECT_EQ(timed.calls_made(platform_op::create_physical), 1u);
}

}  // namespace
