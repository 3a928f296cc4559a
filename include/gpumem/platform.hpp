// Umbrella header of the platform layer: the seam, the sim device and the cuda device.
#pragma once
#include "gpumem/platform/cuda_platform.hpp"
#include "gpumem/platform/platform.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
