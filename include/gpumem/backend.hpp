// Umbrella header of the backend layer.
#pragma once
#include "gpumem/backend/backends.hpp"
#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/backend/vmm_mapping.hpp"
