// Finds the step of a loop from the sequence of its large requests alone (no marks).
//
// Each large request is a key (its size and stream). The detector keeps, for every lag p up
// to max_period, the run of consecutive requests whose key equals the key p requests before
// it. A lag whose run covers at least two whole periods in a row (run >= p) is a period of
// the sequence's recent past. Among those it reports the one whose run is longest (the
// shortest lag among equals): a transformer's step repeats its layers, so the layer's lag
// matches within a step but breaks where the step's own requests (embedding, loss,
// optimizer) come, while the step's lag keeps matching across them; once two steps have
// repeated, the step's run is the longest. A multiple of the step matches for p fewer
// requests than the step itself.
//
// Invariants: period() == 0, or run(period()) >= max(period(), min_run), and no lag with
// run(lag) >= max(lag, min_run) has a longer run.
// Cost: O(max_period) time per request, O(max_period) memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpumem::detail {

class large_request_detector {
 public:
  // REQUIRES: max_period >= 1. A period is reported only once its run is also at least
  // min_run requests (two equal requests in a row are no loop).
  explicit large_request_detector(std::size_t max_period, std::size_t min_run = 16);

  // The next request's key; returns period() after it.
  std::size_t push(std::uint64_t key);
  // The period found (0: none).
  std::size_t period() const noexcept { return period_; }
  // Consecutive requests, up to the last, that equal the one `lag` before them (0 for a lag
  // outside 1..max_period).
  std::size_t run(std::size_t lag) const noexcept {
    return lag >= 1 && lag <= max_period_ ? run_[lag] : 0;
  }
  std::uint64_t pushed() const noexcept { return pushed_; }
  std::size_t max_period() const noexcept { return max_period_; }
  // Forgets the runs (the sequence starts again: a period is found only after two more).
  void reset();

 private:
  std::size_t max_period_;
  std::uint32_t min_run_;
  std::vector<std::uint64_t> ring_;  // the last max_period keys, by pushed_ % max_period
  std::vector<std::uint32_t> run_;   // index lag (1..max_period)
  std::uint64_t pushed_ = 0;
  std::size_t period_ = 0;
};

}  // namespace gpumem::detail
