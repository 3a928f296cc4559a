// The C API (gpumem/interop/gpumem.h) over the pool layer: this thread's error slot, the
// lifetime of handles and their bodies, allocation and free. Streams and
// gpumem_record_stream are in c_api_streams.cpp, stats, counters, reports and snapshots in
// c_api_stats.cpp; what the files share is c_api_internal.hpp.
//
// Every entry point is noexcept and funnels C++ exceptions through `guarded`, which maps
// each typed error to its status code and keeps the text in a thread-local buffer.
//
// A handle (gpumem_pool) is a small shell around a pool_body (c_api_internal.hpp, with the
// shell's invariant). gpumem_pool_destroy deletes the body but keeps the shell forever,
// marked destroyed and on the `tombstones` list, so any later call on the handle is refused
// with a typed error instead of reading freed memory.
#include "gpumem/interop/gpumem.h"
#include "interop/c_api_config.hpp"
#include "interop/c_api_internal.hpp"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/option_table.hpp"

using gpumem::detail::guarded;
using gpumem::detail::handle_destroyed;
using gpumem::detail::handle_live;
using gpumem::detail::live_body;
using gpumem::detail::pool_body;
using gpumem::detail::to_stream;

namespace gpumem::detail {

pool_body::~pool_body() {
  c_api_vmm_destroy(vmm.load());
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

gpumem::resource_stats pool_body::stats() const {
  const auto* v = vmm.load(std::memory_order_acquire);
  return v != nullptr ? c_api_vmm_stats(v) : front().stats();
}

std::size_t pool_body::trim() {
  auto* v = vmm.load(std::memory_order_acquire);
  return v != nullptr ? c_api_vmm_trim(v) : pool->trim();
}

void pool_body::release_stream(gpumem::stream_handle stream) {
  if (auto* v = vmm.load(std::memory_order_acquire); v != nullptr)
    c_api_vmm_release_stream(v, stream);
  else
    front().release_stream(stream);
}

std::string pool_body::memory_report(std::size_t bytes) const {
  const auto* v = vmm.load(std::memory_order_acquire);
  return pool->memory_report(bytes) + (v != nullptr ? c_api_vmm_describe_tags(v) : std::string());
}

std::vector<std::pair<std::uint32_t, const gpumem::pool_base*>> pool_body::tag_pools() const {
  const auto* v = vmm.load(std::memory_order_acquire);
  if (v == nullptr) return {};
  return c_api_vmm_tag_pools(v);
}

void* pool_body::allocate_untagged(std::size_t bytes, std::size_t alignment,
                                   gpumem::stream_handle stream) {
  auto attempt = [&] { return front().allocate(bytes, alignment, stream); };
  auto* v = vmm.load(std::memory_order_acquire);
  // No other tag holds memory, tag 0 never slept: no gate. A gpumem_sleep(0) that makes
  // the state meanwhile is safe: the pool refuses allocations from its sleep's start.
  if (v == nullptr) return attempt();
  // Tag 0's gate held shared: a gpumem_sleep(0) waits for the allocation or refuses it.
  return c_api_vmm_while_untagged_awake(v, [&]() -> void* {
    try {
      return attempt();
    } catch (const gpumem::out_of_memory& first) {
      return c_api_vmm_after_out_of_memory(v, first, attempt);
    }
  });
}

}  // namespace gpumem::detail

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

// Whether untagged allocations are refused because tag 0 sleeps (gpumem_sleep); sets the
// error then, naming the tag. One atomic load while no tag was ever used. An early answer
// only: a call past it that races a sleep is refused by the pool itself, under its lock
// (vmm_page_pool::sleep).
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

gpumem_status gpumem_pool_destroy(gpumem_pool* pool) {
  if (pool == nullptr) return GPUMEM_SUCCESS;
  // The state changes once: of two destroys (even racing ones) only one owns the body, and
  // only that one reads it.
  std::uint32_t state = handle_live;
  if (!pool->state.compare_exchange_strong(state, handle_destroyed, std::memory_order_acq_rel))
    return refuse_handle(pool, state, "gpumem_pool_destroy");
  // A pool something still stands on stays: its body is their memory. The handle goes back
  // to live (a call racing this refused destroy may have been refused as on a destroyed pool).
  const auto& b = pool->body->borrowers;
  const std::uint64_t caches = b.kv_caches.load(std::memory_order_acquire);
  const std::uint64_t vseqs = b.kv_vseqs.load(std::memory_order_acquire);
  if (caches != 0 || vseqs != 0) {
    pool->state.store(handle_live, std::memory_order_release);
    char text[320];
    std::snprintf(text, sizeof text,
                  "gpumem_pool_destroy: the pool %p still has %llu KV cache(s) and %llu "
                  "virtually contiguous sequence set(s) built on it; destroy them first "
                  "(gpumem_kv_destroy, gpumem_kv_vseqs_destroy). The pool stays live.",
                  static_cast<const void*>(pool), static_cast<unsigned long long>(caches),
                  static_cast<unsigned long long>(vseqs));
    return fail(GPUMEM_ERROR_INVALID_ARGUMENT, text);
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
  return GPUMEM_SUCCESS;
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
                 [&] { *out = body->allocate_untagged(size, alignment, to_stream(stream)); });
}

void* gpumem_malloc(gpumem_pool* pool, size_t size, void* stream) {
  void* ptr = nullptr;
  pool_body* body = live_body(pool, "gpumem_malloc");
  if (body == nullptr) return nullptr;
  if (untagged_asleep(*body, "gpumem_malloc")) return nullptr;
  guarded("gpumem_malloc", [&] {
    ptr = body->allocate_untagged(size, gpumem::default_alignment, to_stream(stream));
  });
  return ptr;
}

gpumem_status gpumem_allocate_at(gpumem_pool* pool, void* ptr, size_t size, void* stream) {
  pool_body* body = live_body(pool, "gpumem_allocate_at");
  if (body == nullptr) return last_error_status;
  if (ptr == nullptr) return fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_allocate_at: null pointer");
  // Past the step planner: its region is one allocated block of the pool, so no address
  // in it is free there; the free of this allocation is one the planner passes on.
  if (untagged_asleep(*body, "gpumem_allocate_at")) return last_error_status;
  return guarded("gpumem_allocate_at",
                 [&] { (void)body->pool->allocate_at(ptr, size, to_stream(stream)); });
}

gpumem_status gpumem_free(gpumem_pool* pool, void* ptr, size_t size, void* stream) {
  pool_body* body = live_body(pool, "gpumem_free");
  if (body == nullptr) return last_error_status;
  return guarded("gpumem_free", [&] {
    const gpumem::stream_handle s = to_stream(stream);
    // Another tag's allocation (a tag's block, shared or imported) is the tags' to free;
    // one look-up in their range map (O(log tags)).
    gpumem::memory_resource* owner = &body->front();
    if (auto* vmm = body->vmm.load(std::memory_order_acquire); vmm != nullptr)
      if (auto* tags = gpumem::detail::c_api_vmm_owner(vmm, ptr); tags != nullptr) owner = tags;
    // An allocation with recorded streams: the free waits for them (c_api_streams.cpp),
    // whichever tag holds it.
    if (body->any_recorded.load(std::memory_order_acquire) &&
        gpumem::detail::free_recorded(*body, *owner, ptr, size, s))
      return;
    owner->deallocate(ptr, size, s);
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
    const std::size_t bytes = body->trim();
    if (released != nullptr) *released = bytes;
  });
}

gpumem_status gpumem_pool_set_budget(gpumem_pool* pool, uint64_t bytes, uint64_t* budget_out) {
  pool_body* body = live_body(pool, "gpumem_pool_set_budget");
  if (body == nullptr) return last_error_status;
  return guarded("gpumem_pool_set_budget", [&] {
    auto* pages = dynamic_cast<gpumem::vmm_page_pool*>(body->pool.get());
    if (pages == nullptr)
      throw gpumem::invalid_argument("gpumem_pool_set_budget: a budget is a vmm_page_pool's "
                                     "(allocator:vmm_page_pool)");
    if (bytes > std::numeric_limits<std::size_t>::max())
      throw gpumem::invalid_argument("gpumem_pool_set_budget: " + std::to_string(bytes) +
                                     " bytes do not fit this machine's size_t");
    pages->set_budget(static_cast<std::size_t>(bytes));
    if (budget_out != nullptr) *budget_out = pages->budget();
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

}  // extern "C"

// For the C API's other files (c_api_internal.hpp).
namespace gpumem::detail {

gpumem_status c_api_fail(gpumem_status status, const char* text) noexcept {
  return fail(status, text);
}

gpumem_status c_api_refuse_handle(const gpumem_pool* pool, std::uint32_t state,
                                  const char* where) noexcept {
  return pool == nullptr ? null_pool(where) : refuse_handle(pool, state, where);
}

c_api_pool_parts c_api_pool(gpumem_pool* pool, const char* where) noexcept {
  pool_body* body = live_body(pool, where);
  if (body == nullptr) return {};
  return {body->pool.get(), body->platform, body->device, &body->front(), &body->vmm,
          &body->vmm_mutex, &body->borrowers};
}

}  // namespace gpumem::detail
