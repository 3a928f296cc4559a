// plan_region: the block of the pool a plan serves its allocations from.
//
//  - It is held while `base` is not 0, `bytes` long, and used in the order of `stream`
//    (the stream it was taken on).
//  - A planned block freed on another stream makes the region's stream wait for that
//    stream (waits_for). Then the next block placed there is not written while the freeing
//    stream may still read the old one.
//  - release() ends it with its planner: the block goes back to the pool and the event is
//    destroyed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "gpumem/platform/platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem::detail {

struct plan_region {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  std::uintptr_t stream = 0;

  bool held() const noexcept { return base != 0; }
  bool contains(std::uintptr_t addr) const noexcept {
    return base != 0 && addr >= base && addr < base + bytes;
  }

  // Throws gpumem::cuda_error, naming `who`, when the driver fails; a bad stream is the
  // caller's to refuse before.
  void waits_for(platform& p, int device, stream_handle freeing, const std::string& who) {
    if (wait_event_.value == 0) {
      auto ev = p.event_create(device);
      if (!ev) throw_cuda_error(ev.error(), who + ": event for a free on another stream");
      wait_event_ = ev.value();
    }
    if (auto st = p.event_record(wait_event_, freeing); !st)
      throw_cuda_error(st, who + ": record the freeing stream");
    if (auto st = p.stream_wait_event(stream_handle{stream}, wait_event_); !st)
      throw_cuda_error(st, who + ": make the plan's stream wait");
  }

  // The block back to the pool (a failure is the pool's to report: the planner's
  // destructor cannot) and the event destroyed.
  void release(pool_base& pool, platform& p) noexcept {
    if (base != 0) {
      try {
        pool.deallocate(reinterpret_cast<void*>(base), bytes, stream_handle{stream});
      } catch (...) {
      }
      base = 0;
    }
    if (wait_event_.value != 0) (void)p.event_destroy(wait_event_);
    wait_event_ = {};
  }

 private:
  event_handle wait_event_{};
};

}  // namespace gpumem::detail
