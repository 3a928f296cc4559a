#include "pool/plan/large_request_detector.hpp"

#include <algorithm>
#include <cstdint>

namespace gpumem::detail {

large_request_detector::large_request_detector(std::size_t max_period, std::size_t min_run)
    : max_period_(std::max<std::size_t>(1, max_period)),
      min_run_(static_cast<std::uint32_t>(min_run)),
      ring_(max_period_, 0),
      run_(max_period_ + 1, 0) {}

void large_request_detector::reset() {
  std::fill(run_.begin(), run_.end(), 0);
  pushed_ = 0;
  period_ = 0;
}

std::size_t large_request_detector::push(std::uint64_t key) {
  const std::size_t lags = static_cast<std::size_t>(std::min<std::uint64_t>(pushed_, max_period_));
  const std::size_t at = static_cast<std::size_t>(pushed_ % max_period_);
  period_ = 0;
  std::uint32_t best = 0;
  // The key `lag` requests before this one is at ring_[at - lag], wrapping below 0.
  auto step = [&](std::size_t lag, std::uint64_t earlier) {
    std::uint32_t& r = run_[lag];
    r = earlier != key ? 0 : r == UINT32_MAX ? r : r + 1;  // saturates
    if (r >= lag && r >= min_run_ && r > best) {
      best = r;
      period_ = lag;
    }
  };
  const std::size_t unwrapped = std::min(lags, at);
  for (std::size_t lag = 1; lag <= unwrapped; ++lag) step(lag, ring_[at - lag]);
  for (std::size_t lag = unwrapped + 1; lag <= lags; ++lag) step(lag, ring_[at + max_period_ - lag]);
  ring_[at] = key;
  ++pushed_;
  return period_;
}

}  // namespace gpumem::detail
