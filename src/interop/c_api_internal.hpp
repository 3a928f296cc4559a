// What the C API's files share: the handle and its body, this thread's error slot, the
// mapping of exceptions to status codes, and a live pool handle's parts. Not part of the
// public API.
//
//  - c_api.cpp: the error slot, handle and body lifetime, allocation and free;
//  - c_api_streams.cpp: streams and gpumem_record_stream (the body's `recorded` map);
//  - c_api_stats.cpp: stats, counters, reports and snapshots;
//  - c_api_config.cpp: the configuration grammar; c_api_vmm.cpp: tags, sleep / wake and
//    sharing; c_api_kv.cpp: the KV cache.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/interop/gpumem.h"
#include "gpumem/platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/pool.hpp"

namespace gpumem::detail {

// Sets this thread's gpumem_last_status() / gpumem_last_error(); returns status.
gpumem_status c_api_fail(gpumem_status status, const char* text) noexcept;

// Runs f, turning every exception into a status and this thread's error text.
template <class F>
gpumem_status guarded(const char* where, F&& f) noexcept {
  auto with_where = [where](const char* what) { return std::string(where) + ": " + what; };
  try {
    f();
    return GPUMEM_SUCCESS;
  } catch (const gpumem::out_of_memory& e) {
    // The report is the message; a prefix would hide its first line's "gpumem: out of memory".
    return c_api_fail(GPUMEM_ERROR_OUT_OF_MEMORY, e.what());
  } catch (const gpumem::invalid_argument& e) {
    try { return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, with_where(e.what()).c_str()); }
    catch (...) { return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, e.what()); }
  } catch (const gpumem::not_supported& e) {
    try { return c_api_fail(GPUMEM_ERROR_NOT_SUPPORTED, with_where(e.what()).c_str()); }
    catch (...) { return c_api_fail(GPUMEM_ERROR_NOT_SUPPORTED, e.what()); }
  } catch (const gpumem::cuda_error& e) {
    try { return c_api_fail(GPUMEM_ERROR_CUDA, with_where(e.what()).c_str()); }
    catch (...) { return c_api_fail(GPUMEM_ERROR_CUDA, e.what()); }
  } catch (const std::bad_alloc&) {
    return c_api_fail(GPUMEM_ERROR_INTERNAL, "gpumem: host memory exhausted");
  } catch (const std::exception& e) {
    try { return c_api_fail(GPUMEM_ERROR_INTERNAL, with_where(e.what()).c_str()); }
    catch (...) { return c_api_fail(GPUMEM_ERROR_INTERNAL, e.what()); }
  } catch (...) {
    return c_api_fail(GPUMEM_ERROR_INTERNAL, "gpumem: unknown exception");
  }
}

inline gpumem::stream_handle to_stream(void* stream) noexcept {
  return gpumem::stream_handle{reinterpret_cast<std::uintptr_t>(stream)};
}

// Tags, sleep / wake and sharing of one pool (c_api_vmm.cpp), made on first use.
struct c_api_vmm_state;

// c_api_vmm.cpp, for the other files: destroys the state (before the pool); whether
// untagged allocations are refused (tag 0 asleep); what frees `ptr` when another tag holds
// it (a tag's block, shared or imported: the tags), else nullptr; whether `ptr` is a live
// allocation of another tag. The pool's sums over every tag, the tags' trim and
// release_stream, the retry of an untagged allocation that ran out of memory after
// trimming every tag, and the report with every tag's holdings (pool_body's whole-pool
// calls below go through these).
void c_api_vmm_destroy(c_api_vmm_state* state) noexcept;
bool c_api_vmm_untagged_asleep(const c_api_vmm_state* state) noexcept;
gpumem::memory_resource* c_api_vmm_owner(c_api_vmm_state* state, const void* ptr);
bool c_api_vmm_is_live(const c_api_vmm_state* state, const void* ptr);
gpumem::resource_stats c_api_vmm_stats(const c_api_vmm_state* state);
std::size_t c_api_vmm_trim(c_api_vmm_state* state);
void c_api_vmm_release_stream(c_api_vmm_state* state, gpumem::stream_handle stream);
void* c_api_vmm_after_out_of_memory(c_api_vmm_state* state, const gpumem::out_of_memory& first,
                                    const std::function<void*()>& attempt);
std::string c_api_vmm_describe_tags(const c_api_vmm_state* state);
void* c_api_vmm_while_untagged_awake(c_api_vmm_state* state, const std::function<void*()>& attempt);
std::vector<std::pair<std::uint32_t, const gpumem::pool_base*>> c_api_vmm_tag_pools(
    const c_api_vmm_state* state);

// How many live handles of each kind stand on one pool (pool_body::borrowers).
struct c_api_borrowers {
  std::atomic<std::uint64_t> kv_caches{0};
  std::atomic<std::uint64_t> kv_vseqs{0};
  // The streams live KV caches work on (one entry a cache): gpumem_stream_destroy refuses
  // them, as the cache would queue its copies on a destroyed stream.
  std::mutex streams_mutex;
  std::multiset<std::uintptr_t> kv_streams;
  bool stream_in_use(std::uintptr_t stream) {
    std::lock_guard lock(streams_mutex);
    return kv_streams.contains(stream);
  }
};

// What a handle serves while it is live. It owns, in declaration order, a private sim
// device (if asked for), the timed platform over the device, the caching pool's upstream
// resource and the pool, so they are destroyed in reverse.
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

  // gpumem_record_stream bookkeeping; its invariant is c_api_streams.cpp's file comment.
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
  std::atomic<c_api_vmm_state*> vmm{nullptr};

  // Handles that borrow this pool (c_api_kv.cpp): counted up at their create, down at
  // their destroy. gpumem_pool_destroy refuses while any is left, as deleting the body
  // would leave them with unmapped pages and a dangling pool.
  c_api_borrowers borrowers;

  ~pool_body();

  // What allocations go through: the step planner, or the pool itself.
  gpumem::memory_resource& front() const {
    return planner != nullptr ? static_cast<gpumem::memory_resource&>(*planner) : *pool;
  }

  // The whole pool: every tag, once any tag other than 0 was used (c_api_vmm.cpp). These
  // are the only ways the C API reads the pool's totals, gives memory back, forgets a
  // stream or reports, so none of them can leave a tag out.
  gpumem::resource_stats stats() const;
  std::size_t trim();
  void release_stream(gpumem::stream_handle stream);
  std::string memory_report(std::size_t bytes) const;
  // The pools of the tags other than 0 (none before a tag is used), for the reports that
  // look at pools one by one: gpumem_pool_explain and gpumem_snapshot.
  std::vector<std::pair<std::uint32_t, const gpumem::pool_base*>> tag_pools() const;
  // An untagged allocation through front(); out of memory, every tag's free memory is
  // given back and it is tried once more.
  void* allocate_untagged(std::size_t bytes, std::size_t alignment, gpumem::stream_handle stream);
};

// Distinctive values, so a pointer to something else is unlikely to pass for a handle
// (best effort only: reading a pointer that was never a handle is undefined anyway).
enum : std::uint32_t {
  handle_live = 0x6c697665,       // "live"
  handle_destroyed = 0x64656164,  // "dead"
};

// Refuses a handle that is null or whose state is not handle_live: sets this thread's
// error to say whether it is null, the pool was destroyed or the pointer was never a
// handle; returns the status set (c_api.cpp).
gpumem_status c_api_refuse_handle(const gpumem_pool* pool, std::uint32_t state,
                                  const char* where) noexcept;

}  // namespace gpumem::detail

// The handle: a small shell around a pool_body, 24 bytes that outlive the pool.
// gpumem_pool_destroy deletes the body but keeps the shell forever, marked destroyed, so any
// later call on the handle is refused with a typed error instead of reading freed memory.
// Invariant: a shell's state is handle_live while its body exists and handle_destroyed
// after, and never changes back; a destroyed shell is never freed or reused (its address is
// never handed out again), and it is on the `tombstones` list (c_api.cpp), so it stays
// reachable.
struct gpumem_pool {
  std::atomic<std::uint32_t> state{gpumem::detail::handle_live};
  gpumem::detail::pool_body* body = nullptr;  // owned while live; null once destroyed
  gpumem_pool* next_tombstone = nullptr;      // the tombstones list, once destroyed
};
static_assert(sizeof(gpumem_pool) <= 24, "gpumem.h promises 24 bytes per destroyed pool");

namespace gpumem::detail {

// The body of a live handle; otherwise nullptr, with this thread's error set to say why
// (null handle, destroyed pool, not a handle). On a live handle: one atomic load.
inline pool_body* live_body(gpumem_pool* pool, const char* where) noexcept {
  if (pool == nullptr) {
    c_api_refuse_handle(pool, 0, where);
    return nullptr;
  }
  const std::uint32_t state = pool->state.load(std::memory_order_acquire);
  if (state == handle_live) [[likely]] return pool->body;
  c_api_refuse_handle(pool, state, where);
  return nullptr;
}

struct c_api_pool_parts {
  pool_base* pool = nullptr;  // null when the handle is not a live pool (error set)
  platform* device_platform = nullptr;
  int device = 0;
  memory_resource* front = nullptr;  // what untagged allocations go through (the planner)
  std::atomic<c_api_vmm_state*>* vmm = nullptr;  // the pool's slot for its vmm state
  std::mutex* vmm_mutex = nullptr;               // guards making it
  c_api_borrowers* borrowers = nullptr;          // the pool's count of handles on it
};
// The parts of a live handle; pool == nullptr, with this thread's error set naming `where`,
// for a null, destroyed or foreign handle.
c_api_pool_parts c_api_pool(gpumem_pool* pool, const char* where) noexcept;

// c_api_vmm.cpp, for the KV handles (c_api_kv.cpp): the page pool of the calling thread's
// current tag (gpumem_set_current_tag) that a KV cache lends its pages from, so its memory
// is the tag's and sleeps with it: tag 0 is the pool itself; another tag's pool is made on
// first use. Throws gpumem::invalid_argument naming `what` where tag 0 is not a
// vmm_page_pool, and as tagged_pool::page_pool (the shared tag, a tag asleep).
gpumem::vmm_page_pool& c_api_current_page_pool(const c_api_pool_parts& parts, const char* what);

// c_api_streams.cpp: throws gpumem::invalid_argument when `stream` (non-zero) is not a
// stream `p` knows, or one of another device than `device` ("<what> <hex> is not ...");
// gpumem::cuda_error when the platform fails otherwise. The null stream always passes.
void require_device_stream(platform& p, int device, std::uintptr_t stream, const char* what);

// c_api_streams.cpp, for gpumem_free: when `ptr` has recorded streams, makes `stream` wait
// for them, frees `ptr` through `owner` (what holds it: the body's front, or the tags) and
// forgets its records, and returns true; false (nothing done) when `ptr` has none. Throws
// as the free does, forgetting nothing then. REQUIRES: body.any_recorded was seen true.
bool free_recorded(pool_body& body, gpumem::memory_resource& owner, void* ptr, std::size_t size,
                   gpumem::stream_handle stream);

}  // namespace gpumem::detail
