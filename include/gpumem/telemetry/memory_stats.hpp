// memory_stats: a pool's numbers under the names PyTorch users know
// (torch.cuda.memory_stats()), plus gpumem's own: driver calls by kind, fragmentation,
// pages mapped and pages kept for reuse.
//
// What each name means here (docs/TELEMETRY.md maps them to PyTorch's keys):
//  - allocated_bytes: rounded block bytes handed out (PyTorch's allocated_bytes counts
//    block sizes too); requested_bytes: the bytes users asked for (gpumem's live_bytes);
//  - reserved_bytes: device memory held from the driver (mapped and kept pages, segments);
//  - active_bytes == allocated_bytes: a freed block here is reusable in its stream's order
//    at once, so no block is "active but freed" as PyTorch's record_stream blocks are;
//  - inactive_split_bytes: cached or free bytes inside segments that also hold allocated
//    blocks (current only: its peak is not tracked);
//  - num_alloc_retries / num_ooms: allocations that had to release cached memory first,
//    and out_of_memory thrown.
//
// Invariants: allocated_bytes.current + inactive_split_bytes <= reserved_bytes.current;
// requested_bytes.current <= allocated_bytes.current; every peak >= its current.
// Collected from several locked reads: exact when the pool is quiet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace gpumem {

class pool_base;

struct stat_value {
  std::size_t current = 0;
  std::size_t peak = 0;
};

struct memory_stats {
  std::string allocator;  // the pool's name()
  int device = 0;

  stat_value allocated_bytes;
  stat_value requested_bytes;
  stat_value reserved_bytes;
  stat_value active_bytes;
  std::size_t inactive_split_bytes = 0;
  std::size_t cached_bytes = 0;        // reserved, not handed out
  std::size_t largest_free_block = 0;  // the largest request served without growing
  std::size_t live_allocations = 0;
  std::size_t segments = 0;            // memory_segments(): upstream segments or mapped runs
  std::uint64_t num_allocs = 0;
  std::uint64_t num_frees = 0;
  std::uint64_t num_alloc_retries = 0;
  std::uint64_t num_ooms = 0;
  double fragmentation = 0;            // peak reserved / peak requested (0 before any)

  // The platform's call counters (every pool on that platform), by CUDA call name.
  std::map<std::string, std::uint64_t> driver_calls;

  // vmm_page_pool only (has_pages false otherwise).
  bool has_pages = false;
  std::size_t page_size = 0;
  std::size_t pages_mapped = 0;
  std::size_t pages_kept = 0;  // unmapped physical pages kept for reuse
  std::size_t physical_handles = 0;
  std::uint64_t pages_created = 0;
  std::uint64_t pages_reclaimed = 0;
  std::uint64_t pages_released = 0;

  // PyTorch's flat keys ("allocated_bytes.all.current", "num_ooms", ...) with gpumem's
  // extras under "gpumem.*", in a stable order.
  std::vector<std::pair<std::string, double>> torch_keys() const;
  // One "name: value" line per figure, for people.
  std::string to_string() const;
};

memory_stats collect_memory_stats(const pool_base& pool);

}  // namespace gpumem
