// Resources serve the device they were built for; a device that does not exist is refused.
#include <gtest/gtest.h>

#include <string>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

namespace {

using namespace gpumem;

TEST(device_choice, a_device_that_does_not_exist_is_refused) {
  sim_platform sim;  // one device
  try {
    runtime_resource r(sim, 1);
    ADD_FAILURE() << "device 1 of a one-device platform was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  EXPECT_THROW(vmm_page_pool(sim, -1), invalid_argument);
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(device_choice, each_resource_takes_memory_from_its_own_device) {
  sim_options o;
  o.capacity = std::size_t{256} << 20;
  o.device_count = 2;
  sim_platform sim(o);
  {
    runtime_resource on_one(sim, 1);
    vmm_page_pool pool_on_one(sim, 1);
    void* a = on_one.allocate(1 << 20);
    void* b = pool_on_one.allocate(3 << 20);
    EXPECT_EQ(sim.used_bytes(0), 0u);
    EXPECT_GE(sim.used_bytes(1), std::size_t{5} << 20);  // 1 MiB + two 2 MiB pages
    EXPECT_EQ(on_one.device(), 1);
    EXPECT_EQ(pool_on_one.device(), 1);
    on_one.deallocate(a, 1 << 20);
    pool_on_one.deallocate(b, 3 << 20);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

}  // namespace
