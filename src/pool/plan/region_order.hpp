// A plan's region is reused in its stream's order: a planned block freed on another stream
// makes the region's stream wait for the freeing one, so the next block placed there is not
// written while the freeing stream may still read the old one.
#pragma once

#include <cstdint>
#include <string>

#include "gpumem/platform/platform.hpp"
#include "gpumem/platform/status_error.hpp"

namespace gpumem::detail {

// `wait_event` is made on first use and kept by the caller. Throws gpumem::cuda_error,
// naming `who`, when the driver fails; the caller has refused a bad stream before.
inline void region_waits_for(platform& p, int device, event_handle& wait_event,
                             std::uintptr_t region_stream, stream_handle freeing,
                             const std::string& who) {
  if (wait_event.value == 0) {
    auto ev = p.event_create(device);
    if (!ev) throw_cuda_error(ev.error(), who + ": event for a free on another stream");
    wait_event = ev.value();
  }
  if (auto st = p.event_record(wait_event, freeing); !st)
    throw_cuda_error(st, who + ": record the freeing stream");
  if (auto st = p.stream_wait_event(stream_handle{region_stream}, wait_event); !st)
    throw_cuda_error(st, who + ": make the plan's stream wait");
}

}  // namespace gpumem::detail
