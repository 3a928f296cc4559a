#include "gpumem/telemetry/event_recorder.hpp"

#include <cxxabi.h>
#include <dlfcn.h>
#include <execinfo.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <unordered_map>

#include "gpumem/errors.hpp"
#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

namespace {

thread_local const char* thread_tag = nullptr;

std::uint64_t steady_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

// "0x..." after `prefix`, formatted whole: GCC 12 warns -Wrestrict (a libstdc++ false
// positive in char_traits) on "+" + hex(...) and on a short string assigned then appended to.
std::string hex(std::uintptr_t v, const char* prefix = "") {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%s0x%llx", prefix, static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

scoped_context_tag::scoped_context_tag(const char* tag) noexcept : outer_(thread_tag) {
  thread_tag = tag;
}
scoped_context_tag::~scoped_context_tag() { thread_tag = outer_; }
const char* current_context_tag() noexcept { return thread_tag; }

std::vector<stack_frame> symbolize_frames(void* const* addresses, std::size_t count) {
  std::vector<stack_frame> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    stack_frame f;
    Dl_info info{};
    const auto pc = reinterpret_cast<std::uintptr_t>(addresses[i]);
    if (dladdr(addresses[i], &info) != 0) {
      if (info.dli_fname != nullptr) f.filename = info.dli_fname;
      if (info.dli_sname != nullptr) {
        int status = -1;
        std::unique_ptr<char, void (*)(void*)> demangled(
            abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status), std::free);
        f.name = status == 0 && demangled ? demangled.get() : info.dli_sname;
      } else if (info.dli_fbase != nullptr) {
        // A symbol the dynamic table does not export: the offset in its binary, so
        // addr2line -e <filename> <offset> names it.
        f.name = hex(pc - reinterpret_cast<std::uintptr_t>(info.dli_fbase), "+");
      }
    }
    if (f.filename.empty()) f.filename = "??";
    if (f.name.empty()) f.name = hex(pc);
    out.push_back(std::move(f));
  }
  return out;
}

event_recorder::event_recorder(recorder_options options) : options_(options) {
  if (options_.capacity == 0)
    throw invalid_argument("event_recorder: capacity must be at least 1 event");
  if (options_.max_frames == 0 || options_.max_frames > 64)
    throw invalid_argument("event_recorder: max_frames must be 1..64, got " +
                           std::to_string(options_.max_frames));
  ring_.resize(options_.capacity);
  if (options_.context == record_context::backtrace) {
    frame_store_.resize(options_.capacity * options_.max_frames);
    // The first backtrace() loads the unwinder (and allocates): do it now, not mid-event.
    void* warm[4];
    (void)::backtrace(warm, 4);
  }
  if (options_.clock_ns == nullptr) {
    options_.clock_ns = &steady_ns;
    const auto unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
    unix_offset_ns_ = static_cast<std::int64_t>(unix_ns) - static_cast<std::int64_t>(steady_ns());
  }
}

event_recorder::~event_recorder() { detach(); }

void event_recorder::attach(pool_base& pool) {
  if (pool_ == &pool) return;
  if (pool_ != nullptr)
    throw invalid_argument("event_recorder: already attached to the '" +
                           std::string(pool_->name()) + "' pool; detach it first");
  pool.set_observer(this);  // throws if the pool has another observer
  pool_ = &pool;
}

void event_recorder::detach() noexcept {
  if (pool_ == nullptr) return;
  try {
    pool_->set_observer(nullptr);
  } catch (...) {
    // set_observer(nullptr) does not refuse; a failing mutex leaves nothing to undo.
  }
  pool_ = nullptr;
}

void event_recorder::on_event(const pool_event& event) noexcept {
  const std::uint64_t now = options_.clock_ns();
  const char* tag = options_.context != record_context::none ? thread_tag : nullptr;
  std::lock_guard lock(mutex_);
  const std::size_t slot = static_cast<std::size_t>(next_ % options_.capacity);
  recorded_event& e = ring_[slot];
  e.kind = event.kind;
  e.time_ns = now;
  e.address = event.address;
  e.size = event.size;
  e.stream = event.stream;
  e.tag = tag;
  e.sequence = next_;
  e.frame_count = 0;
  if (options_.context == record_context::backtrace) {
    void** frames = frame_store_.data() + slot * options_.max_frames;
    const int n = ::backtrace(frames, static_cast<int>(options_.max_frames));
    e.frame_count = n > 0 ? static_cast<std::uint32_t>(n) : 0;
  }
  ++next_;
  if (next_ - first_kept_ > options_.capacity) first_kept_ = next_ - options_.capacity;
}

std::size_t event_recorder::size() const {
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(next_ - first_kept_);
}

std::uint64_t event_recorder::recorded() const {
  std::lock_guard lock(mutex_);
  return next_ - cleared_at_;
}

std::uint64_t event_recorder::dropped() const {
  std::lock_guard lock(mutex_);
  return first_kept_ - cleared_at_;
}

void event_recorder::clear() {
  std::lock_guard lock(mutex_);
  first_kept_ = next_;
  cleared_at_ = next_;
}

std::vector<recorded_event> event_recorder::events() const {
  std::lock_guard lock(mutex_);
  std::vector<recorded_event> out;
  out.reserve(static_cast<std::size_t>(next_ - first_kept_));
  for (std::uint64_t s = first_kept_; s < next_; ++s)
    out.push_back(ring_[static_cast<std::size_t>(s % options_.capacity)]);
  return out;
}

std::vector<stack_frame> event_recorder::frames_locked(std::size_t slot) const {
  // Frame 0 is on_event itself (backtrace() reports its caller first): not worth showing.
  if (frame_store_.empty() || ring_[slot].frame_count <= 1) return {};
  void* const* frames = frame_store_.data() + slot * options_.max_frames;
  return symbolize_frames(frames + 1, ring_[slot].frame_count - 1);
}

std::vector<stack_frame> event_recorder::frames(std::uint64_t sequence) const {
  std::lock_guard lock(mutex_);
  if (sequence < first_kept_ || sequence >= next_) return {};
  return frames_locked(static_cast<std::size_t>(sequence % options_.capacity));
}

std::vector<void*> event_recorder::return_addresses(std::uint64_t sequence) const {
  std::lock_guard lock(mutex_);
  if (sequence < first_kept_ || sequence >= next_ || frame_store_.empty()) return {};
  const std::size_t slot = static_cast<std::size_t>(sequence % options_.capacity);
  if (ring_[slot].frame_count <= 1) return {};
  void* const* frames = frame_store_.data() + slot * options_.max_frames;
  return {frames + 1, frames + ring_[slot].frame_count};  // frame 0 is on_event
}

std::int64_t event_recorder::to_unix_us(std::uint64_t time_ns) const noexcept {
  return (static_cast<std::int64_t>(time_ns) + unix_offset_ns_) / 1000;
}

std::string event_recorder::describe_allocation(std::uintptr_t address) const {
  std::lock_guard lock(mutex_);
  if (options_.context == record_context::none) return {};
  for (std::uint64_t s = next_; s > first_kept_; --s) {
    const std::size_t slot = static_cast<std::size_t>((s - 1) % options_.capacity);
    const recorded_event& e = ring_[slot];
    if (e.kind != pool_event_kind::alloc || e.address != address) continue;
    std::string out;
    if (e.tag != nullptr) out = std::string("tag ") + e.tag;
    std::size_t shown = 0;
    for (const stack_frame& f : frames_locked(slot)) {
      if (shown == 8) break;  // enough to place it; the snapshot has the whole stack
      out += out.empty() ? "" : (shown == 0 ? "; " : " <- ");
      out += f.name;
      ++shown;
    }
    return out;
  }
  return {};
}

}  // namespace gpumem
