// vmm_page_pool: growth slack and the remap budget that raises it, and the timing of growths.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>
#include <cmath>

namespace gpumem {

std::size_t vmm_page_pool::split_limit(std::size_t size) const {
  constexpr std::size_t any = static_cast<std::size_t>(-1);
  const double slack = slack_now();
  if (fast() || slack <= 0.0 || options_.guard) return any;
  const std::size_t pages = (size + page_ - 1) / page_;
  const double budget = static_cast<double>(peak_live_so_far()) * (1.0 + slack);
  if (static_cast<double>(reserved_locked() + pages * page_) > budget) return any;
  // Large: twice the request and a 32nd of what the pool holds (a large tensor's run, such
  // as a training step's logits, that its next request of that size wants whole).
  return std::max(2 * size, reserved_locked() / large_run_share);
}

void vmm_page_pool::note_gather_time(std::uint64_t started_ns, std::size_t request) noexcept {
  const std::uint64_t now = now_ns();
  const std::uint64_t spent = now > started_ns ? now - started_ns : 0;
  counts_.remap_ns += spent;
  if (options_.remap_budget <= 0.0 || raised_slack_ >= remap_slack_max) return;
  if (window_start_ns_ == 0 || now - window_start_ns_ > remap_window_max_ns) {
    // A window opens at a gather's start: the quiet time before it says nothing about
    // what gathers cost now.
    window_start_ns_ = std::max<std::uint64_t>(started_ns, 1);
    window_remap_ns_ = 0;
    window_peak_live_ = peak_live_so_far();
    window_largest_gather_ = 0;
  }
  window_remap_ns_ += spent;
  window_largest_gather_ = std::max(window_largest_gather_, request);
  const std::uint64_t elapsed = now - window_start_ns_;
  if (elapsed < remap_window_min_ns) return;
  const std::size_t peak = peak_live_so_far();
  auto open_window = [&] {
    window_start_ns_ = now;
    window_remap_ns_ = 0;
    window_peak_live_ = peak;
    window_largest_gather_ = 0;
  };
  if (static_cast<double>(window_remap_ns_) <= options_.remap_budget * static_cast<double>(elapsed)) {
    // Within budget: judged, and a new window opens, so a slow start (a first step's
    // warm-up, quiet between gathers) does not dilute what gathers cost later.
    open_window();
    return;
  }
  if (peak > window_peak_live_ + window_peak_live_ / remap_new_peak_share) {
    // New peaks: the pool is still learning the workload's size, and the gathers hold
    // it there. Judged again once the peak holds. (Within a 64th it holds: the peak a
    // thread sees includes other threads' unpublished counts, which wobble.)
    open_window();
    return;
  }
  // One step for each budget's worth the gathers took, so a pool far over its budget gets
  // there in one judgement; and at least the share of the largest request that gathered,
  // so its run can stay whole between its uses (smaller steps only moved the gathers:
  // H200, PyTorch, docs/RESULTS.md).
  const double over = static_cast<double>(window_remap_ns_) /
                      (options_.remap_budget * static_cast<double>(elapsed));
  const double largest_share =
      peak == 0 ? 0.0 : static_cast<double>(window_largest_gather_) / static_cast<double>(peak);
  raised_slack_ = std::min(remap_slack_max, std::max(slack_now() + remap_slack_step * std::floor(over),
                                                     largest_share));
  counts_.slack_raises += 1;
  open_window();
}

bool vmm_page_pool::grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                         std::size_t alignment, stream_handle stream, growth kind) {
  // A growth that gathers pages is timed for the remap budget, however it ends.
  struct gather_timer {
    vmm_page_pool& pool;
    std::uint64_t started_ns;
    std::uint64_t reclaimed_before;
    std::size_t request;
    ~gather_timer() {
      if (pool.counts_.pages_reclaimed != reclaimed_before) pool.note_gather_time(started_ns, request);
    }
  } timer{*this, now_ns(), counts_.pages_reclaimed, size};
  // The unmaps of old mappings made ready during this growth (its gather's, and those whose
  // work turned out complete at its start) go to the worker once its maps and access grant
  // are made (hold_unmaps_), however it ends. Not thrown from here: a run left unqueued is
  // queued or unmapped by the next retire_completed.
  hold_unmaps_ = worker_ != nullptr;
  struct held_unmaps {
    vmm_page_pool& pool;
    ~held_unmaps() {
      if (!pool.hold_unmaps_) return;
      pool.hold_unmaps_ = false;
      try {
        pool.queue_held_unmaps();
      } catch (...) {
      }
    }
  } unmaps{*this};
  return grow_untimed(arena, arena_id, size, alignment, stream, kind);
}

}  // namespace gpumem
