// pool_base's block sizes: the block serving a request (block_size_for) and how much larger
// a thread cache's block may be (near_fit_limit), with the live and handed-out totals both
// read. Inline, for the allocate path (pool_base.cpp) and the out-of-memory report.
#pragma once

#include <algorithm>
#include <bit>

#include "gpumem/pool/core/pool_base.hpp"
#include "pool/core/thread_cache.hpp"

namespace gpumem {

inline pool_base::live_and_held pool_base::totals(const detail::thread_cache* mine) const noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  const live_and_held l = live_totals_.locked();
  live_and_held t{live_totals_.live.load(relaxed) + l.live,
                  live_totals_.blocks.load(relaxed) + l.held};
  if (mine != nullptr) {
    t.live += static_cast<std::size_t>(mine->pending_live.load(relaxed));
    t.held += static_cast<std::size_t>(mine->pending_blocks.load(relaxed));
  }
  return t;
}

inline std::size_t pool_base::block_size_for(std::size_t bytes,
                                      const detail::thread_cache* mine) const noexcept {
  constexpr std::size_t unit = 512;
  const std::size_t units = (bytes + unit - 1) / unit;
  if (bytes <= options_.small_threshold) {
    if (const std::size_t n = options_.small_classes; units > n && small_classes_on()) {
      // Its class: the octave (2^(b-1), 2^b] of units cut in n equal steps. Always (no
      // allowance): a freed block then serves every later request of its class.
      // n is a power of two (the constructor checks), and units > n puts the octave at
      // log2(n) or above: the step is a power of two, rounded to with a mask (two
      // divisions before).
      const int octave = std::bit_width(units - 1) - 1;
      const std::size_t step = std::size_t{1} << (octave - std::countr_zero(n));
      return ((units + step - 1) & ~(step - 1)) * unit;
    }
  } else if (const std::size_t g = options_.round_large; g > unit && large_rounding_) {
    // Up to whole units of g only when that loses less than half of one. The loss is
    // certain while the block lives; a tail left sharing its unit with the next block costs
    // nothing while both live, and no more than the loss would when the next one dies
    // first. So a request just over a multiple (a flat buffer and a few KiB more) keeps
    // its 512-byte units instead of taking most of a page it will never use.
    if (const std::size_t tail = bytes & (g - 1); tail > g / 2) {  // g: a power of two
      const std::size_t r = bytes - tail + g;
      const live_and_held t = totals(mine);
      const std::size_t live = t.live + bytes;
      if (t.held + r <= live + live / round_waste_share) return r;
    }
  }
  return units * unit;
}

inline std::size_t pool_base::near_fit_limit(std::size_t bytes, std::size_t size,
                                      const detail::thread_cache& mine) const noexcept {
  const live_and_held t = totals(&mine);
  const std::size_t live = t.live + bytes, held = t.held + size;
  const std::size_t allowed = live + live / round_waste_share;
  if (held >= allowed) return size;
  return size + std::min(size / near_fit_share, allowed - held);
}

}  // namespace gpumem
