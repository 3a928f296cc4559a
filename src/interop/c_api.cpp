// The C API (gpumem/interop/gpumem.h) over the pool layer.
//
// Every entry point is noexcept and funnels C++ exceptions through `guarded`, which maps
// each typed error to its status code and keeps the text in a thread-local buffer.
//
// A handle (gpumem_pool) is a small shell around a pool_body. The body owns, in
// declaration order, a private sim device (if asked for), the caching pool's upstream
// resource and the pool, so they are destroyed in reverse. gpumem_pool_destroy deletes the
// body but keeps the shell forever, marked destroyed, so any later call on the handle is
// refused with a typed error instead of reading freed memory.
//
// Invariants:
//  - a shell's state is handle_live while its body exists and handle_destroyed after, and
//    never changes back; a destroyed shell is never freed or reused (its address is never
//    handed out again), and it is on the `tombstones` list, so it stays reachable;
//  - `recorded` holds, for each live allocation passed to gpumem_record_stream, the
//    streams recorded for it, each once; an entry goes away when the allocation is freed,
//    and a stream's entries when it is destroyed through gpumem_stream_destroy. A key is
//    always a live allocation: record_stream refuses any other pointer, and gpumem_free is
//    the only way an allocation of a live pool dies.
#include "gpumem/interop/gpumem.h"
#include "interop/c_api_config.hpp"
#include "interop/c_api_internal.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/core/overhead.hpp"
#include "gpumem/pool/option_table.hpp"
// The telemetry layer's PyTorch snapshot writer, where this tree has it (it is built in
// the same library, so the header's presence means the function's).
#if __has_include("gpumem/telemetry/snapshot.hpp")
#include "gpumem/telemetry/snapshot.hpp"
#define GPUMEM_C_API_HAS_SNAPSHOT 1
#endif

namespace {

// What a handle serves while it is live.
struct pool_body {
  std::unique_ptr<gpumem::sim_platform> own_sim;  // only for the sim_* keys
  // Every call of this pool goes through it: the pool's own call counts and the time spent
  // in each kind (a steady-clock read around a driver call of a microsecond or more).
  std::unique_ptr<gpumem::timed_platform> timed;
  gpumem::platform* platform = nullptr;  // timed
  std::unique_ptr<gpumem::memory_resource> upstream;  // caching_pool's
  std::unique_ptr<gpumem::pool_base> pool;
  std::unique_ptr<gpumem::step_planner> planner;  // in front of pool (step_plan:on)
  std::string allocator;
  std::string config;
  int device = 0;

  // gpumem_record_stream bookkeeping; see the file comment.
  std::mutex recorded_mutex;
  std::unordered_map<std::uintptr_t, std::vector<std::uintptr_t>> recorded;
  gpumem::event_handle wait_event{};  // reused: a wait captures the event's latest record
  std::atomic<bool> any_recorded{false};
  std::atomic<std::uint64_t> cross_stream_waits{0};

  // Streams gpumem_stream_create made and gpumem_stream_destroy has not destroyed: they
  // die with the pool (no handle is left to destroy them through).
  std::mutex streams_mutex;
  std::vector<std::uintptr_t> made_streams;

  // Tags, sleep / wake, sharing (c_api_vmm.cpp): made on first use, destroyed first.
  std::mutex vmm_mutex;
  std::atomic<gpumem::detail::c_api_vmm_state*> vmm{nullptr};

  ~pool_body() {
    gpumem::detail::c_api_vmm_destroy(vmm.load());
    planner.reset();  // before the pool it stands on
    // The pool first: its destructor may still wait for work on these streams.
    pool.reset();
    upstream.reset();
    if (wait_event.value != 0) (void)platform->event_destroy(wait_event);
    for (std::uintptr_t s : made_streams) {
      (void)platform->stream_synchronize(gpumem::stream_handle{s});
      (void)platform->stream_destroy(gpumem::stream_handle{s});
    }
  }

  // What allocations go through: the step planner, or the pool itself.
  gpumem::memory_resource& front() const {
    return planner != nullptr ? static_cast<gpumem::memory_resource&>(*planner) : *pool;
  }
};

// Distinctive values, so a pointer to something else is unlikely to pass for a handle
// (best effort only: reading a pointer that was never a handle is undefined anyway).
enum : std::uint32_t {
  handle_live = 0x6c697665,       // "live"
  handle_destroyed = 0x64656164,  // "dead"
};

}  // namespace

// The handle: 24 bytes that outlive the pool (see the file comment).
struct gpumem_pool {
  std::atomic<std::uint32_t> state{handle_live};
  pool_body* body = nullptr;             // owned while live; null once destroyed
  gpumem_pool* next_tombstone = nullptr;  // the tombstones list, once destroyed
};
static_assert(sizeof(gpumem_pool) <= 24, "gpumem.h promises 24 bytes per destroyed pool");

namespace {

thread_local std::string last_error_text;
thread_local gpumem_status last_error_status = GPUMEM_SUCCESS;

gpumem_status fail(gpumem_status status, const char* text) noexcept {
  last_error_status = status;
  try {
    last_error_text = text;
  } catch (...) {
    // No memory even for the message: keep the code, say so in a text that needs none.
    last_error_text.clear();
  }
  return status;
}

// Runs f, turning every exception into a status and this thread's error text.
template <class F>
gpumem_status guarded(const char* where, F&& f) noexcept {
  auto with_where = [where](const char* what) {
    return std::string(where) + ": " + what;
  };
  try {
    f();
    return GPUMEM_SUCCESS;
  } catch (const gpumem::out_of_memory& e) {
    // The report is the message; a prefix would hide its first line's "gpumem: out of memory".
    return fail(GPUMEM_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const gpumem::invalid_argument& e) {
    try { return fail(GPUMEM_ERROR_INVALID_ARGUMENT, with_where(e.what()).c_str()); }
    catch (...) { return fail(GPUMEM_ERROR_INVALID_ARGUMENT, e.what()); }
  } catch (const gpumem::cuda_error& e) {
    try { return fail(GPUMEM_ERROR_CUDA, with_where(e.what()).c_str()); }
    catch (...) { return fail(GPUMEM_ERROR_CUDA, e.what()); }
  } catch (const std::bad_alloc&) {
    return fail(GPUMEM_ERROR_INTERNAL, "gpumem: host memory exhausted");
  } catch (const std::exception& e) {
    try { return fail(GPUMEM_ERROR_INTERNAL, with_where(e.what()).c_str()); }
    catch (...) { return fail(GPUMEM_ERROR_INTERNAL, e.what()); }
  } catch (...) {
    return fail(GPUMEM_ERROR_INTERNAL, "gpumem: unknown exception");
  }
}

gpumem::stream_handle to_stream(void* stream) noexcept {
  return gpumem::stream_handle{reinterpret_cast<std::uintptr_t>(stream)};
}

std::unique_ptr<pool_body> make_pool(const char* config) {
  const gpumem::detail::c_api_pool_spec spec =
      gpumem::detail::parse_c_api_config(config != nullptr ? config : "");
  // Parse the pool options before touching a device, so a typo costs no driver call.
  const gpumem::pool_options options = gpumem::pool_options::parse(spec.pool_options);
  auto handle = std::make_unique<pool_body>();
  if (spec.own_sim) {
    handle->own_sim = std::make_unique<gpumem::sim_platform>(spec.sim);
    handle->platform = handle->own_sim.get();
  } else {
    handle->platform = spec.platform.empty() ? &gpumem::default_platform()
                                             : &gpumem::platform_by_name(spec.platform);
  }
  handle->timed = std::make_unique<gpumem::timed_platform>(*handle->platform);
  handle->platform = handle->timed.get();
  gpumem::platform& p = *handle->platform;
  gpumem::resource_spec what;
  what.allocator = spec.allocator;
  what.backend = spec.backend;
  what.device = spec.device;
  what.options = options;
  gpumem::made_resource made = gpumem::make_resource(p, what);
  handle->upstream = std::move(made.upstream);
  handle->pool = std::move(made.pool);
  if (spec.step_plan) handle->planner = std::make_unique<gpumem::step_planner>(*handle->pool);
  handle->allocator = spec.allocator;
  handle->device = spec.device;
  handle->config = handle->pool->options().to_string() +
                   (spec.step_plan ? ",step_plan:on" : ",step_plan:off");
  return handle;
}

gpumem_status null_pool(const char* where) noexcept {
  try {
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, (std::string(where) + ": null pool handle").c_str());
  } catch (...) {
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem: null pool handle");
  }
}

// Every destroyed handle, newest first: never freed, so a stale handle stays readable.
std::atomic<gpumem_pool*> tombstones{nullptr};

// Refuses a non-null handle whose state is not handle_live: sets this thread's error to
// say whether the pool was destroyed or the pointer was never a handle.
gpumem_status refuse_handle(const gpumem_pool* pool, std::uint32_t state,
                            const char* where) noexcept {
  char text[256];
  if (state == handle_destroyed)
    std::snprintf(text, sizeof text,
                  "%s: the pool %p was destroyed (gpumem_pool_destroy); its handle cannot be "
                  "used any more",
                  where, static_cast<const void*>(pool));
  else
    std::snprintf(text, sizeof text,
                  "%s: %p is not a gpumem pool handle (gpumem_pool_create never returned it)",
                  where, static_cast<const void*>(pool));
  return fail(GPUMEM_ERROR_INVALID_ARGUMENT, text);
}

// The body of a live handle; otherwise nullptr, with this thread's error set to say why
// (null handle, destroyed pool, not a handle). On a live handle: one atomic load.
pool_body* live_body(gpumem_pool* pool, const char* where) noexcept {
  if (pool == nullptr) {
    null_pool(where);
    return nullptr;
  }
  const std::uint32_t state = pool->state.load(std::memory_order_acquire);
  if (state == handle_live) [[likely]] return pool->body;
  refuse_handle(pool, state, where);
  return nullptr;
}

// Whether untagged allocations are refused because tag 0 sleeps (gpumem_sleep); sets the
// error then. One atomic load while no tag was ever used.
bool untagged_asleep(const pool_body& body, const char* where) noexcept {
  const auto* vmm = body.vmm.load(std::memory_order_acquire);
  if (vmm == nullptr || !gpumem::detail::c_api_vmm_untagged_asleep(vmm)) return false;
  char text[160];
  std::snprintf(text, sizeof text,
                "%s: the untagged memory (tag 0) is asleep; gpumem_wake it before allocating",
                where);
  fail(GPUMEM_ERROR_INVALID_ARGUMENT, text);
  return true;
}

// Whether `addr` is the address of a live allocation this pool handed out (through the
// planner when there is one: its planned allocations too).
// The pool has no lookup of one address, so this reads every segment's blocks: O(blocks),
// paid once per allocation recorded (a pointer already in `recorded` is known live).
// Guarded allocations (pool_options::guard) are in no segment: in guard mode every
// pointer passes, as before this check.
// REQUIRES: pool.recorded_mutex held (no free of `addr` runs meanwhile).
bool is_live_allocation(const pool_body& pool, std::uintptr_t addr) {
  if (pool.pool->options().guard) return true;
  const std::vector<gpumem::memory_segment> segments =
      pool.planner != nullptr ? pool.planner->memory_segments() : pool.pool->memory_segments();
  // Segments and their blocks are by address.
  auto seg = std::upper_bound(segments.begin(), segments.end(), addr,
                              [](std::uintptr_t a, const gpumem::memory_segment& s) {
                                return a < s.address;
                              });
  if (seg == segments.begin()) return false;
  --seg;
  if (addr >= seg->address + seg->size) return false;
  auto b = std::lower_bound(seg->blocks.begin(), seg->blocks.end(), addr,
                            [](const gpumem::memory_block& x, std::uintptr_t a) {
                              return x.address < a;
                            });
  return b != seg->blocks.end() && b->address == addr &&
         b->st == gpumem::memory_block::state::allocated;
}

std::string hex(std::uintptr_t value) {
  char text[32];
  std::snprintf(text, sizeof text, "0x%llx", static_cast<unsigned long long>(value));
  return text;
}

// The pool's reusable event, made on first use. REQUIRES: pool.recorded_mutex held.
gpumem::event_handle wait_event_of(pool_body& pool, const char* where) {
  if (pool.wait_event.value == 0) {
    auto ev = pool.platform->event_create(pool.device);
    if (!ev) gpumem::throw_cuda_error(ev.error(), where);
    pool.wait_event = ev.value();
  }
  return pool.wait_event;
}

// Makes `free_stream` wait for the work queued so far on each stream recorded for an
// allocation. A recorded stream the platform no longer knows (destroyed without
// gpumem_stream_destroy) is skipped: gpumem.h says the caller finished its work before
// destroying it. On failure nothing is forgotten, so a retried free waits again; a
// free stream the platform refuses is an invalid argument.
// REQUIRES: pool.recorded_mutex held.
void wait_for_recorded_streams(pool_body& pool, const std::vector<std::uintptr_t>& streams,
                               gpumem::stream_handle free_stream) {
  gpumem::platform& p = *pool.platform;
  for (std::uintptr_t s : streams) {
    if (s == free_stream.value) continue;
    const gpumem::event_handle ev = wait_event_of(pool, "gpumem_free: event for a recorded stream");
    if (auto st = p.event_record(ev, gpumem::stream_handle{s}); !st) {
      if (st.kind == gpumem::failure_kind::invalid_value) continue;  // the stream is gone
      gpumem::throw_cuda_error(st, "gpumem_free: record on a recorded stream");
    }
    if (auto st = p.stream_wait_event(free_stream, ev); !st) {
      if (st.kind == gpumem::failure_kind::invalid_value)
        throw gpumem::invalid_argument("the free stream " + hex(free_stream.value) +
                                       " is not a stream of device " +
                                       std::to_string(pool.device) + " (" + st.describe() +
                                       "); the allocation stays live");
      gpumem::throw_cuda_error(st, "gpumem_free: wait for a recorded stream");
    }
    pool.cross_stream_waits.fetch_add(1, std::memory_order_relaxed);
  }
}

}  // namespace

extern "C" {

const char* gpumem_version(void) {
#define GPUMEM_STR2(x) #x
#define GPUMEM_STR(x) GPUMEM_STR2(x)
  return GPUMEM_STR(GPUMEM_VERSION_MAJOR) "." GPUMEM_STR(GPUMEM_VERSION_MINOR) "." GPUMEM_STR(
      GPUMEM_VERSION_PATCH);
#undef GPUMEM_STR
#undef GPUMEM_STR2
}

int gpumem_version_number(void) {
  return GPUMEM_VERSION_MAJOR * 10000 + GPUMEM_VERSION_MINOR * 100 + GPUMEM_VERSION_PATCH;
}

const char* gpumem_last_error(void) { return last_error_text.c_str(); }

gpumem_status gpumem_last_status(void) { return last_error_status; }

const char* gpumem_status_name(gpumem_status status) {
  switch (status) {
    case GPUMEM_SUCCESS: return "GPUMEM_SUCCESS";
    case GPUMEM_ERROR_INVALID_ARGUMENT: return "GPUMEM_ERROR_INVALID_ARGUMENT";
    case GPUMEM_ERROR_OUT_OF_MEMORY: return "GPUMEM_ERROR_OUT_OF_MEMORY";
    case GPUMEM_ERROR_CUDA: return "GPUMEM_ERROR_CUDA";
    case GPUMEM_ERROR_NOT_SUPPORTED: return "GPUMEM_ERROR_NOT_SUPPORTED";
    case GPUMEM_ERROR_INTERNAL: return "GPUMEM_ERROR_INTERNAL";
  }
  return "GPUMEM_ERROR_UNKNOWN";
}

gpumem_status gpumem_pool_create(const char* config, gpumem_pool** out) {
  if (out == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_pool_create: null output pointer");
  *out = nullptr;
  return guarded("gpumem_pool_create", [&] {
    auto shell = std::make_unique<gpumem_pool>();  // first: a failure here leaks no pool
    shell->body = make_pool(config).release();
    *out = shell.release();
  });
}

void gpumem_pool_destroy(gpumem_pool* pool) {
  if (pool == nullptr) return;
  // The state changes once: of two destroys (even racing ones) only one deletes the body.
  std::uint32_t state = handle_live;
  if (!pool->state.compare_exchange_strong(state, handle_destroyed, std::memory_order_acq_rel)) {
    refuse_handle(pool, state, "gpumem_pool_destroy");
    return;
  }
  // Destructors of pools never throw; the delete itself cannot either.
  delete pool->body;
  pool->body = nullptr;
  // The shell stays, reachable from the list (so leak checkers do not report it).
  gpumem_pool* head = tombstones.load(std::memory_order_relaxed);
  do {
    pool->next_tombstone = head;
  } while (!tombstones.compare_exchange_weak(head, pool, std::memory_order_release,
                                             std::memory_order_relaxed));
}

gpumem_status gpumem_allocate(gpumem_pool* pool, size_t size, size_t alignment, void* stream,
                              void** out) {
  if (out == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_allocate: null output pointer");
  *out = nullptr;
  pool_body* body = live_body(pool, "gpumem_allocate");
  if (body == nullptr) return last_error_status;
  if (untagged_asleep(*body, "gpumem_allocate")) return last_error_status;
  return guarded("gpumem_allocate",
                 [&] { *out = body->front().allocate(size, alignment, to_stream(stream)); });
}

void* gpumem_malloc(gpumem_pool* pool, size_t size, void* stream) {
  void* ptr = nullptr;
  pool_body* body = live_body(pool, "gpumem_malloc");
  if (body == nullptr) return nullptr;
  if (untagged_asleep(*body, "gpumem_malloc")) return nullptr;
  guarded("gpumem_malloc", [&] {
    ptr = body->front().allocate(size, gpumem::default_alignment, to_stream(stream));
  });
  return ptr;
}

gpumem_status gpumem_free(gpumem_pool* pool, void* ptr, size_t size, void* stream) {
  pool_body* body = live_body(pool, "gpumem_free");
  if (body == nullptr) return last_error_status;
  if (auto* vmm = body->vmm.load(std::memory_order_acquire); vmm != nullptr) {
    gpumem_status result = GPUMEM_SUCCESS;
    if (gpumem::detail::c_api_vmm_free(vmm, ptr, size, stream, result)) return result;
  }
  return guarded("gpumem_free", [&] {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    const gpumem::stream_handle s = to_stream(stream);
    if (body->any_recorded.load(std::memory_order_acquire)) {
      std::unique_lock lock(body->recorded_mutex);
      auto it = body->recorded.find(addr);
      if (it != body->recorded.end()) {
        // Waits first: once the pool has the block, `stream` may reuse it at once.
        wait_for_recorded_streams(*body, it->second, s);
        std::vector<std::uintptr_t> streams = std::move(it->second);
        body->recorded.erase(it);
        try {
          body->front().deallocate(ptr, size, s);
        } catch (...) {
          body->recorded.emplace(addr, std::move(streams));  // refused: nothing changed
          throw;
        }
        return;
      }
    }
    body->front().deallocate(ptr, size, s);
  });
}

gpumem_status gpumem_record_stream(gpumem_pool* pool, void* ptr, void* stream) {
  pool_body* body = live_body(pool, "gpumem_record_stream");
  if (body == nullptr) return last_error_status;
  if (ptr == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_record_stream: null pointer");
  return guarded("gpumem_record_stream", [&] {
    const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    const auto s = reinterpret_cast<std::uintptr_t>(stream);
    std::lock_guard lock(body->recorded_mutex);
    auto it = body->recorded.find(addr);
    if (it == body->recorded.end() && !is_live_allocation(*body, addr))
      throw gpumem::invalid_argument(
          "pointer " + hex(addr) + " is not a live allocation of this '" + body->allocator +
          "' pool (never allocated by it, already freed, or inside an allocation); nothing "
          "was recorded");
    if (it != body->recorded.end() &&
        std::find(it->second.begin(), it->second.end(), s) != it->second.end())
      return;  // recorded already
    // The stream must be one the platform knows on this device: recording the pool's event
    // on it is what the free does, so a stream that fails here would fail the free. Its
    // device is asked first, so another device's stream is named as such.
    if (s != 0) {
      auto owner = body->platform->stream_device(gpumem::stream_handle{s});
      if (!owner && owner.error().kind != gpumem::failure_kind::invalid_value)
        gpumem::throw_cuda_error(owner.error(), "gpumem_record_stream: the stream's device");
      if (!owner)
        throw gpumem::invalid_argument("stream " + hex(s) + " is not a stream the platform "
                                       "knows (" + owner.error().describe() +
                                       "); nothing was recorded");
      if (owner.value() != body->device)
        throw gpumem::invalid_argument(
            "stream " + hex(s) + " belongs to device " + std::to_string(owner.value()) +
            ", this pool to device " + std::to_string(body->device) +
            " (record it with that device's pool); nothing was recorded");
      const gpumem::event_handle ev = wait_event_of(*body, "gpumem_record_stream: event");
      if (auto st = body->platform->event_record(ev, gpumem::stream_handle{s}); !st) {
        if (st.kind == gpumem::failure_kind::invalid_value)
          throw gpumem::invalid_argument("stream " + hex(s) + " is not a stream of device " +
                                         std::to_string(body->device) + " (" + st.describe() +
                                         "); nothing was recorded");
        gpumem::throw_cuda_error(st, "gpumem_record_stream: record on the stream");
      }
    }
    if (it == body->recorded.end()) it = body->recorded.try_emplace(addr).first;
    it->second.push_back(s);
    body->any_recorded.store(true, std::memory_order_release);
  });
}

gpumem_status gpumem_pool_stats(gpumem_pool* pool, gpumem_stats* out) {
  pool_body* body = live_body(pool, "gpumem_pool_stats");
  if (body == nullptr) return last_error_status;
  if (out == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_pool_stats: null output pointer");
  return guarded("gpumem_pool_stats", [&] {
    const gpumem::resource_stats s = body->front().stats();
    gpumem_stats r{};
    r.live_bytes = s.live_bytes;
    r.peak_live_bytes = s.peak_live_bytes;
    r.live_allocations = s.live_allocations;
    r.reserved_bytes = s.reserved_bytes;
    r.peak_reserved_bytes = s.peak_reserved_bytes;
    r.cached_bytes = s.cached_bytes;
    r.allocations = s.allocations;
    r.deallocations = s.deallocations;
    r.alloc_retries = s.alloc_retries;
    r.oom_count = s.oom_count;
    r.cross_stream_waits = body->cross_stream_waits.load(std::memory_order_relaxed);
    r.fragmentation = s.fragmentation();
    *out = r;
  });
}

gpumem_status gpumem_pool_counter(gpumem_pool* pool, const char* name, uint64_t* out) {
  pool_body* body = live_body(pool, "gpumem_pool_counter");
  if (body == nullptr) return last_error_status;
  if (name == nullptr || out == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_pool_counter: null name or output");
  return guarded("gpumem_pool_counter", [&] {
    const std::string_view n(name);
    if (n == "driver_ns") {
      *out = body->timed->measured_ns();
      return;
    }
    // "<call>" counts the calls, "<call>.ns" sums their time.
    const bool ns = n.size() > 3 && n.substr(n.size() - 3) == ".ns";
    const std::string_view call = ns ? n.substr(0, n.size() - 3) : n;
    for (std::size_t i = 0; i < gpumem::platform_op_count; ++i) {
      const auto op = static_cast<gpumem::platform_op>(i);
      if (gpumem::platform_op_name(op) == call) {
        *out = ns ? body->timed->measured_ns(op) : body->platform->calls_made(op);
        return;
      }
    }
    if (ns) throw gpumem::invalid_argument("gpumem_pool_counter: unknown CUDA call '" + std::string(call) + "'");
    for (const gpumem::pool_counter& c : body->pool->counters().named)
      if (c.name == n) {
        *out = c.value;
        return;
      }
    if (body->planner != nullptr) {
      const gpumem::step_planner_counts c = body->planner->counts();
      const std::pair<std::string_view, std::uint64_t> counters[] = {
          {"plan_marks", c.steps},
          {"plans_built", c.plans_built},
          {"planned_steps", c.planned_steps},
          {"steps_left_plan", c.steps_left_plan},
          {"steps_rejoined", c.steps_rejoined},
          {"planned_allocations", c.planned_allocations},
          {"plan_region_failures", c.region_failures},
          {"plan_region_takes", c.region_takes},
          {"plan_regions_handed_over", c.regions_handed_over},
          {"plan_region_bytes", c.region_bytes},
          {"plan_lower_bound", c.plan_lower_bound},
          {"planned_per_step", c.planned_count}};
      for (const auto& [key, value] : counters)
        if (key == n) {
          *out = value;
          return;
        }
    }
    throw gpumem::invalid_argument("unknown counter '" + std::string(n) + "' for the '" +
                                   body->allocator + "' pool");
  });
}

gpumem_status gpumem_pool_mark_step(gpumem_pool* pool) {
  pool_body* body = live_body(pool, "gpumem_pool_mark_step");
  if (body == nullptr) return last_error_status;
  if (body->planner == nullptr) return GPUMEM_SUCCESS;  // step_plan:off: a hint ignored
  return guarded("gpumem_pool_mark_step", [&] { body->planner->mark_step(); });
}

gpumem_status gpumem_pool_trim(gpumem_pool* pool, uint64_t* released) {
  pool_body* body = live_body(pool, "gpumem_pool_trim");
  if (body == nullptr) return last_error_status;
  return guarded("gpumem_pool_trim", [&] {
    const std::size_t bytes = body->pool->trim();
    if (released != nullptr) *released = bytes;
  });
}

// The four accessors below answer "" (or -1) for NULL without an error, as documented;
// for a destroyed pool they answer the same and set the error.

const char* gpumem_pool_allocator(gpumem_pool* pool) {
  if (pool == nullptr) return "";
  const pool_body* body = live_body(pool, "gpumem_pool_allocator");
  return body == nullptr ? "" : body->allocator.c_str();
}

const char* gpumem_pool_platform(gpumem_pool* pool) {
  if (pool == nullptr) return "";
  const pool_body* body = live_body(pool, "gpumem_pool_platform");
  // kind() returns a literal ("cuda" / "sim"), so its data is NUL-terminated.
  return body == nullptr ? "" : body->platform->kind().data();
}

int gpumem_pool_device(gpumem_pool* pool) {
  if (pool == nullptr) return -1;
  const pool_body* body = live_body(pool, "gpumem_pool_device");
  return body == nullptr ? -1 : body->device;
}

const char* gpumem_pool_config(gpumem_pool* pool) {
  if (pool == nullptr) return "";
  const pool_body* body = live_body(pool, "gpumem_pool_config");
  return body == nullptr ? "" : body->config.c_str();
}

// Writes text to buf (truncated, NUL-terminated when capacity > 0); returns its full length.
static size_t copy_text(const std::string& text, char* buf, size_t capacity) {
  if (buf != nullptr && capacity > 0) {
    const std::size_t n = std::min(text.size(), capacity - 1);
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

size_t gpumem_pool_report(gpumem_pool* pool, size_t size, char* buf, size_t capacity) {
  std::string report;
  pool_body* body = live_body(pool, "gpumem_pool_report");
  if (body == nullptr) return 0;
  if (guarded("gpumem_pool_report", [&] { report = body->pool->memory_report(size); }) !=
      GPUMEM_SUCCESS)
    return 0;
  return copy_text(report, buf, capacity);
}

size_t gpumem_pool_explain(gpumem_pool* pool, char* buf, size_t capacity) {
  std::string text;
  pool_body* body = live_body(pool, "gpumem_pool_explain");
  if (body == nullptr) return 0;
  if (guarded("gpumem_pool_explain", [&] { text = gpumem::explain_overhead(*body->pool).to_string(); }) !=
      GPUMEM_SUCCESS)
    return 0;
  return copy_text(text, buf, capacity);
}

gpumem_status gpumem_stream_create(gpumem_pool* pool, void** out) {
  if (out == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_stream_create: null output pointer");
  *out = nullptr;
  pool_body* body = live_body(pool, "gpumem_stream_create");
  if (body == nullptr) return last_error_status;
  return guarded("gpumem_stream_create", [&] {
    std::lock_guard lock(body->streams_mutex);
    body->made_streams.reserve(body->made_streams.size() + 1);  // no failure after the create
    auto s = body->platform->stream_create(body->device);
    if (!s)
      gpumem::throw_cuda_error(s.error(), "gpumem_stream_create");
    body->made_streams.push_back(s.value().value);
    *out = reinterpret_cast<void*>(s.value().value);
  });
}

gpumem_status gpumem_stream_destroy(gpumem_pool* pool, void* stream) {
  pool_body* body = live_body(pool, "gpumem_stream_destroy");
  if (body == nullptr) return last_error_status;
  if (stream == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT,
                "gpumem_stream_destroy: the default stream cannot be destroyed");
  return guarded("gpumem_stream_destroy", [&] {
    const auto s = reinterpret_cast<std::uintptr_t>(stream);
    body->front().release_stream(to_stream(stream));
    // Allocations recorded on the stream: its work is waited for now (no later free can
    // wait for a destroyed stream), then their records of it are dropped.
    std::unique_lock lock(body->recorded_mutex, std::defer_lock);
    bool recorded_here = false;
    if (body->any_recorded.load(std::memory_order_acquire)) {
      lock.lock();
      for (const auto& [addr, streams] : body->recorded)
        recorded_here = recorded_here || std::find(streams.begin(), streams.end(), s) != streams.end();
      if (recorded_here)
        if (auto st = body->platform->stream_synchronize(to_stream(stream)); !st)
          gpumem::throw_cuda_error(st, "gpumem_stream_destroy: wait for the stream's work");
    }
    if (auto st = body->platform->stream_destroy(to_stream(stream)); !st)
      gpumem::throw_cuda_error(st, "gpumem_stream_destroy");
    {
      std::lock_guard streams_lock(body->streams_mutex);
      std::erase(body->made_streams, s);
    }
    if (recorded_here)
      for (auto it = body->recorded.begin(); it != body->recorded.end();) {
        std::erase(it->second, s);
        it = it->second.empty() ? body->recorded.erase(it) : std::next(it);
      }
  });
}

gpumem_status gpumem_stream_device(gpumem_pool* pool, void* stream, int* device) {
  if (device == nullptr)
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_stream_device: null output pointer");
  *device = -1;
  pool_body* body = live_body(pool, "gpumem_stream_device");
  if (body == nullptr) return last_error_status;
  return guarded("gpumem_stream_device", [&] {
    auto owner = body->platform->stream_device(to_stream(stream));
    if (!owner && owner.error().kind == gpumem::failure_kind::invalid_value)
      throw gpumem::invalid_argument("stream " + hex(reinterpret_cast<std::uintptr_t>(stream)) +
                                     " is not a stream the platform knows (" +
                                     owner.error().describe() + ")");
    if (!owner) gpumem::throw_cuda_error(owner.error(), "gpumem_stream_device");
    *device = owner.value();
  });
}

gpumem_status gpumem_stream_synchronize(gpumem_pool* pool, void* stream) {
  pool_body* body = live_body(pool, "gpumem_stream_synchronize");
  if (body == nullptr) return last_error_status;
  return guarded("gpumem_stream_synchronize", [&] {
    if (auto st = body->platform->stream_synchronize(to_stream(stream)); !st)
      gpumem::throw_cuda_error(st, "gpumem_stream_synchronize");
  });
}

gpumem_status gpumem_snapshot(gpumem_pool* pool, const char* path) {
  pool_body* body = live_body(pool, "gpumem_snapshot");
  if (body == nullptr) return last_error_status;
  if (path == nullptr || *path == '\0')
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_snapshot: empty path");
#ifdef GPUMEM_C_API_HAS_SNAPSHOT
  // No event recorder is attached to C API pools: segments and blocks, no device trace.
  return guarded("gpumem_snapshot",
                 [&] { gpumem::write_memory_snapshot(*body->pool, nullptr, std::string(path), body->planner.get()); });
#else
  return fail(GPUMEM_ERROR_NOT_SUPPORTED,
              "gpumem_snapshot: this build has no PyTorch snapshot exporter "
              "(gpumem/telemetry/snapshot.hpp is not part of it)");
#endif
}

}  // extern "C"

// For the C API's other files (c_api_internal.hpp).
namespace gpumem::detail {

gpumem_status c_api_fail(gpumem_status status, const char* text) noexcept {
  return fail(status, text);
}

c_api_pool_parts c_api_pool(gpumem_pool* pool, const char* where) noexcept {
  pool_body* body = live_body(pool, where);
  if (body == nullptr) return {};
  return {body->pool.get(), body->platform, body->device, &body->front(), &body->vmm,
          &body->vmm_mutex};
}

}  // namespace gpumem::detail
