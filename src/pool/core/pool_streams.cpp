// pool_base's stream ordering: which streams the pool accepts, when a block freed on one
// stream is safe for another (events, waits), reclaiming other streams' free blocks, and
// the per-stream state kept for streams that hold free blocks.
#include "gpumem/pool/core/pool_base.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <limits>
#include <sstream>
#include <unordered_map>

#include "gpumem/errors.hpp"
#include "backend/ownership_registry.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/core/lifetime_hints.hpp"
#include "pool/core/thread_cache.hpp"

namespace gpumem {

bool pool_base::free_known_complete(const detail::block& b) {
  return free_is_complete(b.stream, b.free_epoch, nullptr);
}

bool pool_base::free_is_complete(std::uintptr_t freed_on, std::uint64_t epoch,
                                 const stream_handle* wanted_by, bool stream_wait) {
  auto& s = streams_.states[freed_on];
  if (s.completed_epoch >= epoch) return true;
  platform& p = device_platform();
  if (s.event.value == 0 && !streams_.spare_events.empty()) {
    s.event = streams_.spare_events.back();
    streams_.spare_events.pop_back();
  } else if (s.event.value == 0) {
    auto ev = p.event_create(device());
    if (!ev) throw_cuda_error(ev.error(), "pool: event for cross-stream reuse");
    s.event = ev.value();
  }
  if (!s.event_pending || s.event_epoch < epoch) {
    // The event covers all work queued on the stream so far, which includes every use of
    // blocks freed up to now.
    if (auto st = p.event_record(s.event, stream_handle{freed_on}); !st) {
      if (st.kind != failure_kind::invalid_value)
        throw_cuda_error(st, "pool: cross-stream event record");
      s.completed_epoch = s.frees;  // destroyed: its work is taken as finished (as above)
      return true;
    }
    s.event_pending = true;
    s.event_epoch = s.frees;
  }
  if (wanted_by != nullptr && (stream_wait || options_.cross_stream == cross_stream_policy::wait)) {
    if (auto st = p.stream_wait_event(*wanted_by, s.event); !st)
      throw_cuda_error(st, "pool: cross-stream wait");
    return true;  // wanted_by's later work now runs after the freed block's last use
  }
  auto done = p.event_query(s.event);
  if (!done) throw_cuda_error(done.error(), "pool: cross-stream event query");
  if (done.value()) {
    s.completed_epoch = s.event_epoch;
    s.event_pending = false;
  }
  return s.completed_epoch >= epoch;
}

void pool_base::release_stream(stream_handle stream) {
  std::lock_guard lock(mutex_);
  // Blocks freed on the stream may sit in thread caches: into the arenas first, so they
  // are re-tagged below (the stream's state is made as they go back).
  if (stream.value != 0) drain_thread_caches();
  auto it = streams_.states.find(stream.value);
  if (it == streams_.states.end() || stream.value == 0) return;
  // Its blocks become the default stream's, safe at once: the stream's work is done.
  if (auto st = device_platform().stream_synchronize(stream);
      !st && st.kind != failure_kind::invalid_value)  // invalid: already destroyed (as above)
    throw_cuda_error(st, "pool: synchronize a stream being released");
  for (auto& a : arenas_) a->retag_free(stream.value, 0);
  for (auto& a : arenas_) a->drop_empty_bins();
  if (it->second.event.value != 0) (void)device_platform().event_destroy(it->second.event);
  streams_.states.erase(it);
  streams_.last_state = nullptr;
  // A later free on that handle is checked again (it may name a new stream, or none).
  for (auto& c : caches_) {
    std::uintptr_t known = stream.value;
    c->known_stream.compare_exchange_strong(known, 0, std::memory_order_relaxed);
  }
}

std::size_t pool_base::tracked_streams() const {
  std::lock_guard lock(mutex_);
  return streams_.states.size();
}

void pool_base::check_stream(stream_handle stream, std::string_view caller) {
  std::lock_guard lock(mutex_);
  check_stream_locked(stream, caller);
}

void pool_base::check_stream_locked(stream_handle stream, std::string_view caller) {
  if (stream.value == 0 || streams_.states.find(stream.value) != streams_.states.end()) return;
  // A query that enqueues nothing: legal while a CUDA graph is being captured on the stream.
  auto owner = device_platform().stream_device(stream);
  if (!owner) {
    if (owner.error().kind != failure_kind::invalid_value)
      throw_cuda_error(owner.error(), "pool: the device of a new stream");
    throw invalid_argument(std::string(caller) + ": stream " + hex_address(stream.value) +
                           " is not a stream the '" + std::string(name()) + "' pool (device " +
                           std::to_string(device()) + ") can use (" + owner.error().describe() +
                           "); nothing was changed");
  }
  if (owner.value() != device())
    throw invalid_argument(std::string(caller) + ": stream " + hex_address(stream.value) +
                           " belongs to device " + std::to_string(owner.value()) + ", the '" +
                           std::string(name()) + "' pool to device " + std::to_string(device()) +
                           "; nothing was changed");
  if (streams_.states.size() >= streams_.prune_at) prune_stream_states();
  streams_.states.try_emplace(stream.value);
}

bool pool_base::reclaim_other_streams_free(std::uintptr_t to, bool wait, bool stream_wait) {
  std::vector<std::uintptr_t> others;
  for (auto& a : arenas_) {
    a->flush();
    for (std::uintptr_t s : a->free_streams())
      if (s != to) others.push_back(s);
  }
  if (others.empty()) return false;
  std::sort(others.begin(), others.end());
  others.erase(std::unique(others.begin(), others.end()), others.end());
  platform& p = device_platform();
  bool moved = false;
  for (std::uintptr_t from : others) {
    auto it = streams_.states.find(from);
    if (it != streams_.states.end() && (stream_wait || options_.cross_stream == cross_stream_policy::wait)) {
      // Policy wait: `to` is made to wait on `from`'s frees instead (an event recorded on
      // `from` and waited on by `to`: legal inside a CUDA graph capture, where a query or a
      // synchronize is not). The blocks are then safe in `to`'s order only, so they take a
      // new free epoch of `to`: another stream reuses them once `to` has passed the wait.
      const stream_handle to_handle{to};
      (void)free_is_complete(from, it->second.frees, &to_handle, true);
      const std::uint64_t epoch = ++stream_state_of(to).frees;
      for (auto& a : arenas_) moved = a->retag_free(from, to, it->second.frees, epoch) != 0 || moved;
      continue;
    }
    std::uint64_t complete_up_to = 0;  // no state: only blocks safe at once (epoch 0)
    if (it != streams_.states.end()) {
      detail::stream_state& s = it->second;
      if (wait) {
        // A stream the platform no longer knows (destroyed without release_stream) has
        // its work taken as finished, as in synchronize_streams_with_free_blocks.
        if (auto st = p.stream_synchronize(stream_handle{from});
            !st && st.kind != failure_kind::invalid_value)
          throw_cuda_error(st, "pool: synchronize a stream holding free blocks");
        s.completed_epoch = s.frees;
      } else if (s.completed_epoch < s.frees) {
        (void)free_is_complete(from, s.frees, nullptr);
      }
      complete_up_to = s.completed_epoch;
    }
    for (auto& a : arenas_) moved = a->retag_free(from, to, complete_up_to) != 0 || moved;
  }
  for (auto& a : arenas_) a->drop_empty_bins();
  if (streams_.states.size() >= streams_.prune_at) prune_stream_states();
  return moved;
}

void pool_base::prune_stream_states() {
  constexpr std::size_t spare_event_limit = 64;
  for (auto& a : arenas_) a->flush();
  for (auto& [from, s] : streams_.states) {
    if (from == 0) continue;
    if (s.completed_epoch < s.frees) {
      try {
        (void)free_is_complete(from, s.frees, nullptr);
      } catch (const cuda_error&) {
        continue;  // not known complete: its blocks stay its own
      }
    }
    for (auto& a : arenas_) a->retag_free(from, 0, s.completed_epoch);
  }
  for (auto it = streams_.states.begin(); it != streams_.states.end();) {
    bool holds = it->first == 0;  // the default stream's state stays
    for (auto& a : arenas_) holds = holds || a->holds_stream(it->first);
    if (holds) {
      ++it;
      continue;
    }
    // Blocks of this stream still in thread caches get a fresh state when they come back:
    // their epochs then start again, and an event recorded after that covers their use.
    if (it->second.event.value != 0) {
      if (streams_.spare_events.size() < spare_event_limit)
        streams_.spare_events.push_back(it->second.event);
      else
        (void)device_platform().event_destroy(it->second.event);
    }
    it = streams_.states.erase(it);
  }
  streams_.last_state = nullptr;
  for (auto& a : arenas_) a->drop_empty_bins();
  streams_.prune_at = std::max<std::size_t>(64, 2 * streams_.states.size());
}

void pool_base::synchronize_streams_with_free_blocks() {
  for (auto& [stream, s] : streams_.states) {
    // A stream the platform no longer knows was destroyed: its work is taken as finished
    // (see the header: destroy a stream after its work, or release_stream it first).
    if (auto st = device_platform().stream_synchronize(stream_handle{stream});
        !st && st.kind != failure_kind::invalid_value)
      throw_cuda_error(st, "pool: synchronize before giving memory back");
    s.completed_epoch = s.frees;
  }
}

}  // namespace gpumem
