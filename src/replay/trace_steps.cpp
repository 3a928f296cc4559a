// Step detection on a loaded trace: where the loop the trace ends with begins each step
// (find_steps, trace.hpp).
#include "gpumem/replay/trace.hpp"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

namespace gpumem {

std::vector<std::size_t> find_steps(const trace& t, std::size_t min_repeats) {
  // The allocations, as (size, stream), with their event indices.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> req;
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].op == trace_event::kind::alloc) {
      req.emplace_back(t.events[i].size, t.events[i].stream);
      at.push_back(i);
    }
  const std::size_t n = req.size();
  std::size_t period = 0;
  for (std::size_t p = 1; p <= n / 2 && period == 0; ++p)
    if (std::equal(req.end() - static_cast<std::ptrdiff_t>(p), req.end(),
                   req.end() - static_cast<std::ptrdiff_t>(2 * p)))
      period = p;
  if (period == 0) return {};
  std::size_t first = n - 2 * period;  // the repeat holds for allocations [first, n)
  while (first > 0 && req[first - 1] == req[first - 1 + period]) --first;
  if ((n - first) / period < min_repeats) return {};

  // Live bytes after each event of the last full period; the step begins at the first
  // allocation after the least.
  std::size_t live = 0, least = static_cast<std::size_t>(-1), least_at = 0;
  const std::size_t from = at[n - 2 * period], to = at[n - period];
  for (std::size_t i = 0; i < to; ++i) {
    const trace_event& e = t.events[i];
    live = e.op == trace_event::kind::alloc ? live + e.size : live - e.size;
    if (i >= from && live < least) {
      least = live;
      least_at = i;
    }
  }
  const auto next_alloc = std::upper_bound(at.begin(), at.end(), least_at);
  const std::size_t phase = static_cast<std::size_t>(next_alloc - at.begin()) % period;
  std::vector<std::size_t> starts;
  for (std::size_t k = phase; k < n; k += period)
    if (k >= first) starts.push_back(at[k]);
  return starts;
}

}  // namespace gpumem
