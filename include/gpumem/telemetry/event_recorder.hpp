// event_recorder: a fixed-capacity ring buffer of what a pool did — allocs, frees, segment
// (page) maps and unmaps, OOMs — with time, address, size and stream, and optionally where
// each came from: a caller-supplied context tag, or the call stack (backtrace()).
//
//  - Off by default: a pool records nothing until a recorder is attached (the pool then
//    pays one branch per operation). Attached, an event costs a clock read, an uncontended
//    lock and a slot write: no allocation (the ring and the frame storage are allocated
//    once, at construction). With record_context::backtrace, also one backtrace() call;
//    symbols are resolved only when events are exported.
//  - Invariants: size() <= capacity(); recorded() == size() + dropped(); events() returns
//    the last size() events in the order the pool did them (oldest first), so a trace of
//    them replays to the pool's current state from some earlier one.
//  - One pool at a time. Thread-safe: events come under the pool's mutex, readers lock the
//    recorder's own mutex (lock order: pool, then recorder).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "gpumem/pool/core/pool_observer.hpp"

namespace gpumem {

class pool_base;

enum class record_context : std::uint8_t {
  none,       // time, address, size, stream only
  tag,        // plus the calling thread's context tag (scoped_context_tag)
  backtrace,  // plus the tag and the call stack (up to max_frames return addresses)
};

struct recorder_options {
  std::size_t capacity = 100000;  // events kept (PyTorch's default max_entries)
  record_context context = record_context::none;
  std::size_t max_frames = 16;
  // Nanoseconds from a monotonic clock (tests inject one); nullptr: std::chrono::steady_clock.
  std::uint64_t (*clock_ns)() noexcept = nullptr;
};

// Sets the calling thread's context tag for its lifetime (nesting restores the outer one).
// The tag is recorded by pointer: REQUIRES it outlives the recorder (a string literal).
class scoped_context_tag {
 public:
  explicit scoped_context_tag(const char* tag) noexcept;
  ~scoped_context_tag();
  scoped_context_tag(const scoped_context_tag&) = delete;
  scoped_context_tag& operator=(const scoped_context_tag&) = delete;

 private:
  const char* outer_;
};
// The calling thread's current tag, or nullptr.
const char* current_context_tag() noexcept;

struct recorded_event {
  pool_event_kind kind = pool_event_kind::alloc;
  std::uint64_t time_ns = 0;    // recorder clock
  std::uintptr_t address = 0;   // oom: the device's free bytes (as PyTorch's trace)
  std::size_t size = 0;
  std::uintptr_t stream = 0;
  const char* tag = nullptr;    // record_context::tag and ::backtrace
  std::uint32_t frame_count = 0;
  std::uint64_t sequence = 0;   // 0, 1, 2... over the recorder's life
};

struct stack_frame {
  std::string filename;  // the binary (executable or shared library)
  int line = 0;          // 0: not known without debug info lookups
  std::string name;      // demangled function name, else the address
};

class event_recorder final : public pool_observer {
 public:
  // Throws gpumem::invalid_argument for a capacity of 0 or max_frames over 64.
  explicit event_recorder(recorder_options options = {});
  ~event_recorder();  // detaches from its pool
  event_recorder(const event_recorder&) = delete;
  event_recorder& operator=(const event_recorder&) = delete;

  // Starts recording `pool`'s events. REQUIRES: the pool outlives the attachment. Throws
  // gpumem::invalid_argument when this recorder or the pool is already attached elsewhere.
  void attach(pool_base& pool);
  void detach() noexcept;
  const pool_base* attached_pool() const noexcept { return pool_; }

  const recorder_options& options() const noexcept { return options_; }
  std::size_t capacity() const noexcept { return options_.capacity; }
  std::size_t size() const;
  std::uint64_t recorded() const;  // events seen since construction or clear()
  std::uint64_t dropped() const;   // overwritten by newer ones
  void clear();

  // The kept events, oldest first.
  std::vector<recorded_event> events() const;
  // The call stack of the event with this sequence number, innermost first; empty when
  // none was captured or the event is no longer kept. Symbolized here (dladdr).
  std::vector<stack_frame> frames(std::uint64_t sequence) const;
  // The same stack as return addresses (innermost first), not symbolized: exporters
  // symbolize each distinct address once.
  std::vector<void*> return_addresses(std::uint64_t sequence) const;
  // Wall-clock microseconds since the Unix epoch for a recorder timestamp (the default
  // clock is steady; its offset to the system clock is taken at construction). With an
  // injected clock there is no offset: its nanoseconds / 1000.
  std::int64_t to_unix_us(std::uint64_t time_ns) const noexcept;

  void on_event(const pool_event& event) noexcept override;
  // "tag: <tag>; fn1 <- fn2 <- ..." for the latest alloc kept at `address`; "" if none.
  std::string describe_allocation(std::uintptr_t address) const override;

 private:
  std::vector<stack_frame> frames_locked(std::size_t slot) const;

  recorder_options options_;
  pool_base* pool_ = nullptr;
  mutable std::mutex mutex_;
  std::vector<recorded_event> ring_;
  std::vector<void*> frame_store_;  // capacity * max_frames when recording backtraces
  std::uint64_t next_ = 0;          // sequence of the next event
  std::uint64_t first_kept_ = 0;    // sequence of the oldest kept event
  std::uint64_t cleared_at_ = 0;    // next_ at the last clear()
  std::int64_t unix_offset_ns_ = 0;
};

// Symbolizes return addresses (dladdr + demangling), innermost first.
std::vector<stack_frame> symbolize_frames(void* const* addresses, std::size_t count);

}  // namespace gpumem
