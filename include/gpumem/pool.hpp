// Umbrella header of the pool layer.
#pragma once
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/fixed_block_pool.hpp"
#include "gpumem/pool/core/overhead.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/pool_factory.hpp"
#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "gpumem/pool/plan/large_planner.hpp"
#include "gpumem/pool/plan/step_planner.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
