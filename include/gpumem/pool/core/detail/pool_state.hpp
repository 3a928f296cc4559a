// pool_base's private bookkeeping, apart from its interface: the per-stream state behind
// stream-ordered reuse, the ring of recent frees that tells a double free from a
// stranger's pointer, and the shared totals of live bytes. Held by value in pool_base (no indirection on its paths); nothing
// outside pool_base uses them.
//
// Invariants: completed_epoch <= frees, event_epoch <= frees; while event_pending, `event`
// was recorded on the stream when its free count was event_epoch. last_state is null or
// points at states[last] (an unordered_map's elements keep their address).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "gpumem/platform.hpp"

namespace gpumem::detail {

struct stream_state {
  std::uint64_t frees = 0;            // blocks freed on this stream so far
  event_handle event{};               // recorded lazily when another stream wants memory
  std::uint64_t event_epoch = 0;      // `frees` when the event was recorded
  bool event_pending = false;
  std::uint64_t completed_epoch = 0;  // frees up to here are known complete
};

// The streams a pool keeps state for: those holding free blocks, the default stream, and
// those met since the last prune (pool_base::prune_stream_states, run as their number
// doubles past prune_at).
struct stream_states {
  std::unordered_map<std::uintptr_t, stream_state> states;
  std::size_t prune_at = 64;
  std::vector<event_handle> spare_events;  // of dropped stream states, for reuse
  // The stream last looked up and its state (reset when a state is dropped): most frees
  // are on the stream of the last.
  std::uintptr_t last = 0;
  stream_state* last_state = nullptr;
};

// The addresses of the last frees the pool took itself (guarded allocations; the thread
// caches keep their own), to tell a double free from a pointer the pool never owned.
struct recent_frees {
  std::array<std::uintptr_t, 1024> addresses{};
  std::size_t next = 0;
  void note(std::uintptr_t addr) noexcept {
    addresses[next] = addr;
    next = (next + 1) % addresses.size();
  }
  bool contains(std::uintptr_t addr) const noexcept {
    return std::find(addresses.begin(), addresses.end(), addr) != addresses.end();
  }
};

struct live_and_held {
  std::size_t live, held;
};

// Shared totals of live bytes (requested; rounded blocks handed out) and their peaks; the
// thread caches' pending_* complete them (pool_base::count). Aligned to a cache line of
// their own, away from the state every call reads.
struct alignas(64) live_totals {
  std::atomic<std::size_t> live{0};
  std::atomic<std::size_t> peak_live{0};
  std::atomic<std::size_t> blocks{0}, peak_blocks{0};
  // What calls holding the pool's mutex published (the locked paths: large blocks, misses;
  // see pool_base::count): written only with the mutex held, by a load and a store (the
  // mutex orders them: no atomic read-modify-write, where publishing a large block's bytes
  // took two), read without it where an estimate will do. Signed: what one thread
  // published here may be freed by another, which publishes to the shared totals.
  std::atomic<std::int64_t> locked_live{0}, locked_blocks{0};

  // locked_live and locked_blocks, to add to the unsigned totals (two's complement).
  live_and_held locked() const noexcept {
    return {static_cast<std::size_t>(locked_live.load(std::memory_order_relaxed)),
            static_cast<std::size_t>(locked_blocks.load(std::memory_order_relaxed))};
  }
};

}  // namespace gpumem::detail
