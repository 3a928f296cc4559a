// pool_observer: the hook through which a pool reports what it does, so layers above the
// pool (telemetry's event recorder) can watch it without the pool knowing them.
//
//  - A pool with no observer (the default) pays one predictable branch per operation.
//  - on_event is called with the pool's mutex held, after the operation took effect (an
//    alloc's block is live, a free's block is cached, a segment is mapped), in the order
//    the pool did them; so events seen by an observer replay to the pool's current state.
//  - on_event must not call back into the pool and must not throw (noexcept).
//  - describe_allocation is asked, on the report path only, where a live block came from;
//    "" when the observer does not know.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpumem {

enum class pool_event_kind : std::uint8_t {
  alloc,          // a block handed out: address, requested bytes, stream
  free,           // a block given back by the user: address, requested bytes, stream
  segment_alloc,  // memory taken from upstream (caching_pool segment): base, bytes
  segment_free,   // a segment given back upstream
  segment_map,    // pages mapped into the pool's range (vmm_page_pool): first byte, bytes
  segment_unmap,  // pages unmapped (to be remapped elsewhere or released)
  oom,            // an allocation failed: size = requested bytes, address = device free bytes
};

struct pool_event {
  pool_event_kind kind = pool_event_kind::alloc;
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::uintptr_t stream = 0;
};

class pool_observer {
 public:
  virtual void on_event(const pool_event& event) noexcept = 0;
  virtual std::string describe_allocation(std::uintptr_t address) const {
    (void)address;
    return {};
  }

 protected:
  ~pool_observer() = default;  // not owned through this interface
};

}  // namespace gpumem
