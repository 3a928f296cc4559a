// The C API's streams (gpumem_stream_*) and gpumem_record_stream over the pool layer, and
// the waits a free of a recorded allocation makes (free_recorded, for gpumem_free).
//
// Invariant: a pool body's `recorded` holds, for each live allocation passed to
// gpumem_record_stream, the streams recorded for it, each once; an entry goes away when the
// allocation is freed, and a stream's entries when it is destroyed through
// gpumem_stream_destroy. A key is always a live allocation: record_stream refuses any other
// pointer, and gpumem_free is the only way an allocation of a live pool dies.
#include "gpumem/interop/gpumem.h"
#include "interop/c_api_internal.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/core/segment_lookup.hpp"

using gpumem::detail::c_api_fail;
using gpumem::detail::guarded;
using gpumem::detail::live_body;
using gpumem::detail::pool_body;
using gpumem::detail::to_stream;

namespace {

// Whether `addr` is the address of a live allocation this pool handed out, of any tag
// (untagged through the planner when there is one: its planned allocations too; another
// tag's, shared or imported through the pool's tags). The pools have no look-up of one
// address, so this reads the segments' blocks: O(blocks), paid once per allocation
// recorded (a pointer already in `recorded` is known live). Guarded allocations
// (pool_options::guard) are in no segment: in guard mode every pointer passes.
// REQUIRES: pool.recorded_mutex held (no free of `addr` runs meanwhile).
bool is_live_allocation(const pool_body& pool, std::uintptr_t addr) {
  if (pool.pool->options().guard) return true;
  const std::vector<gpumem::memory_segment> segments =
      pool.planner != nullptr ? pool.planner->memory_segments() : pool.pool->memory_segments();
  if (gpumem::is_allocated_block(segments, addr)) return true;
  const auto* vmm = pool.vmm.load(std::memory_order_acquire);
  return vmm != nullptr &&
         gpumem::detail::c_api_vmm_is_live(vmm, reinterpret_cast<const void*>(addr));
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

namespace gpumem::detail {

void require_device_stream(platform& p, int device, std::uintptr_t stream, const char* what) {
  if (stream == 0) return;
  auto owner = p.stream_device(gpumem::stream_handle{stream});
  if (!owner && owner.error().kind != gpumem::failure_kind::invalid_value)
    gpumem::throw_cuda_error(owner.error(), "the stream's device");
  if (!owner)
    throw gpumem::invalid_argument("stream " + hex(stream) + " is not a stream the platform "
                                   "knows (" + owner.error().describe() + "); " + what);
  if (owner.value() != device)
    throw gpumem::invalid_argument("stream " + hex(stream) + " belongs to device " +
                                   std::to_string(owner.value()) + ", this pool to device " +
                                   std::to_string(device) + " (use that device's pool); " +
                                   what);
}

bool free_recorded(pool_body& body, gpumem::memory_resource& owner, void* ptr, std::size_t size,
                   gpumem::stream_handle stream) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  std::unique_lock lock(body.recorded_mutex);
  auto it = body.recorded.find(addr);
  if (it == body.recorded.end()) return false;
  // Waits first: once the pool has the block, `stream` may reuse it at once.
  wait_for_recorded_streams(body, it->second, stream);
  std::vector<std::uintptr_t> streams = std::move(it->second);
  body.recorded.erase(it);
  try {
    owner.deallocate(ptr, size, stream);
  } catch (...) {
    body.recorded.emplace(addr, std::move(streams));  // refused: nothing changed
    throw;
  }
  return true;
}

}  // namespace gpumem::detail

extern "C" {

gpumem_status gpumem_record_stream(gpumem_pool* pool, void* ptr, void* stream) {
  pool_body* body = live_body(pool, "gpumem_record_stream");
  if (body == nullptr) return gpumem_last_status();
  if (ptr == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_record_stream: null pointer");
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
      gpumem::detail::require_device_stream(*body->platform, body->device, s,
                                            "nothing was recorded");
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

gpumem_status gpumem_stream_create(gpumem_pool* pool, void** out) {
  if (out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_stream_create: null output pointer");
  *out = nullptr;
  pool_body* body = live_body(pool, "gpumem_stream_create");
  if (body == nullptr) return gpumem_last_status();
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
  if (body == nullptr) return gpumem_last_status();
  if (stream == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT,
                "gpumem_stream_destroy: the default stream cannot be destroyed");
  if (body->borrowers.stream_in_use(reinterpret_cast<std::uintptr_t>(stream)))
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT,
                      "gpumem_stream_destroy: a KV cache of this pool works on the stream; "
                      "destroy the cache first");
  return guarded("gpumem_stream_destroy", [&] {
    const auto s = reinterpret_cast<std::uintptr_t>(stream);
    body->release_stream(to_stream(stream));
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
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_stream_device: null output pointer");
  *device = -1;
  pool_body* body = live_body(pool, "gpumem_stream_device");
  if (body == nullptr) return gpumem_last_status();
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
  if (body == nullptr) return gpumem_last_status();
  return guarded("gpumem_stream_synchronize", [&] {
    if (auto st = body->platform->stream_synchronize(to_stream(stream)); !st)
      gpumem::throw_cuda_error(st, "gpumem_stream_synchronize");
  });
}

}  // extern "C"
