// pool_clock: the time a pool judges its own driver cost against (pool_options::remap_budget).
//
// A running program's pool reads the host's steady clock. A replay runs a recorded workload
// far faster than it ran (no kernels, no Python), so on the host's clock every page it
// remaps would look costly; it gives the pool the trace's own time instead, plus the driver
// time spent so far (replay/trace.hpp: trace_clock).
#pragma once

#include <chrono>
#include <cstdint>

namespace gpumem {

class pool_clock {
 public:
  virtual ~pool_clock() = default;
  // Nanoseconds since an arbitrary start; never decreases.
  virtual std::uint64_t now_ns() const noexcept = 0;
};

// The host's steady clock: every pool's, unless one is set (pool_base::set_clock).
class steady_pool_clock final : public pool_clock {
 public:
  std::uint64_t now_ns() const noexcept override {
    return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          std::chrono::steady_clock::now().time_since_epoch())
                                          .count());
  }
};

}  // namespace gpumem
