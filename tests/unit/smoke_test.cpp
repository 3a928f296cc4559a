#include <gtest/gtest.h>
#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
TEST(smoke, builds) { gpumem::sim_platform sim; EXPECT_EQ(sim.device_count().value(), 1); }
