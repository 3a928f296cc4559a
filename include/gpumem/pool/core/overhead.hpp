// overhead: where a pool's reserved bytes go beyond the bytes its users asked for, at one
// moment (a replay's peak, an out-of-memory's report, or any time). Fragmentation is peak
// reserved over peak requested; this says what the difference is made of.
//
// The parts sum to reserved exactly (REQUIRES: the pool is quiet while it is read):
//
//   reserved = requested                      bytes live allocations asked for
//            + unit_rounding                  live blocks, up to the 512-byte unit
//            + block_rounding                 live blocks, beyond the unit: large blocks
//                                             rounded to whole pages (vmm_page_pool), near
//                                             fits a thread cache handed out, split
//                                             remainders under a unit kept whole
//            + cached                         freed blocks held for reuse as they are
//                                             (thread caches, quick lists), not yet merged
//            + free_pinned                    free bytes sharing a page (vmm_page_pool) or a
//                                             segment (caching_pool) with a live or cached
//                                             block: nothing can give them back
//            + free_releasable                free whole pages (of a multi-page handle: only
//                                             where all its pages are free), or wholly free
//                                             segments:
//                                             trim() / release_cached() could give them back
//            + kept_unmapped                  physical pages kept unmapped for reuse
//                                             (vmm_page_pool)
//            + other                          reserved outside the segments otherwise:
//                                             guard-mode allocations (0 without guard)
//
// `largest_losses` groups live blocks by (requested bytes, block bytes), biggest loss first:
// the request sizes whose rounding costs the most (e.g. 32 x 5.45 MiB in 6 MiB blocks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace gpumem {

class pool_base;
struct memory_segment;

struct rounding_loss {
  std::size_t requested = 0;  // bytes each allocation asked for
  std::size_t block = 0;      // bytes each block spans
  std::size_t count = 0;      // live allocations of this shape
  std::size_t bytes() const noexcept { return count * (block - requested); }
};

struct overhead_breakdown {
  std::string allocator;
  std::size_t page_size = 0;  // vmm_page_pool's page; 0 where free memory goes by segment
  std::size_t reserved = 0;
  std::size_t requested = 0;
  std::size_t unit_rounding = 0;
  std::size_t block_rounding = 0;
  std::size_t cached = 0;
  std::size_t free_pinned = 0;
  std::size_t free_releasable = 0;
  std::size_t kept_unmapped = 0;
  std::size_t other = 0;
  std::size_t free_in_small_arena = 0;  // of the free bytes: in small-request segments
  std::vector<rounding_loss> largest_losses;  // at most `max_losses`, biggest first

  static constexpr std::size_t max_losses = 5;

  // reserved / requested (0 with nothing requested): 1 + the parts' shares below.
  double ratio() const noexcept;
  // One line per part with its bytes and its share of the requested bytes, then the
  // largest rounding losses; `indent` starts every line.
  std::string to_string(const std::string& indent = "") const;
};

// Reads the pool's segments and statistics under its lock (pool_base::overhead()). Exact
// when no call is in flight on the pool.
overhead_breakdown explain_overhead(const pool_base& pool);

namespace detail {
// The breakdown of `segments`, which hold all of a pool's memory but `kept_unmapped` bytes
// (physical pages not mapped) and guard-mode allocations (live bytes outside them).
// page_size: the page by which free bytes are releasable (0: by whole segment);
// multi_page_handles: mapped (address, bytes) ranges whose pages are releasable only together.
overhead_breakdown breakdown_of(
    std::string allocator, std::size_t reserved, std::size_t live_bytes, std::size_t page_size,
    std::size_t kept_unmapped, const std::vector<memory_segment>& segments,
    const std::vector<std::pair<std::uintptr_t, std::size_t>>& multi_page_handles = {});
}  // namespace detail

}  // namespace gpumem
