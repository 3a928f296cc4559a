// Finding one address among a pool's segments (pool_base::memory_segments()).
#pragma once

#include <cstdint>
#include <vector>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

// Whether `address` is the start of an allocated block of `segments` (as memory_segments()
// gives them: by address, each segment's blocks by address). O(log segments + log blocks).
bool is_allocated_block(const std::vector<memory_segment>& segments, std::uintptr_t address);

}  // namespace gpumem
