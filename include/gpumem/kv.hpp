// Umbrella header of the KV cache layer.
#pragma once
#include "gpumem/kv/kv_block_storage.hpp"
#include "gpumem/kv/kv_cache.hpp"
#include "gpumem/kv/kv_layout.hpp"
#include "gpumem/kv/kv_virtual_sequences.hpp"
#include "gpumem/kv/prefix_hash.hpp"
#include "gpumem/kv/tier/host_store.hpp"
#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/kv_store.hpp"
#include "gpumem/kv/tier/kv_tiers.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
