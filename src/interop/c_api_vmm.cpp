// The C API's tags, sleep / wake and sharing between processes (gpumem.h) over
// gpumem::tagged_pool.
//
// A pool's state (c_api_vmm_state) is made by the first call that allocates in a tag, sleeps
// tag 0, or shares (a refused call or a look-up makes none), and lives until the pool is
// destroyed (before the pool: its tag pools and shared memory go first). Tag 0 is the pool
// itself, reached through the step planner like gpumem_malloc. Once made, the state's
// tagged_pool is the registry of every tag: the pool's stats, trim, stream release, report
// and out-of-memory retry go through it (pool_body's whole-pool calls).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "gpumem/errors.hpp"
#include "gpumem/interop/gpumem.h"
#include "gpumem/pool/vmm/tagged_pool.hpp"
#include "interop/c_api_internal.hpp"

namespace gpumem::detail {

struct c_api_vmm_state {
  c_api_vmm_state(pool_base& pool, memory_resource& front) : tags(pool, pool.options(), &front) {}
  tagged_pool tags;
};

void c_api_vmm_destroy(c_api_vmm_state* state) noexcept { delete state; }

bool c_api_vmm_untagged_asleep(const c_api_vmm_state* state) noexcept {
  return state->tags.asleep(0);  // one atomic load
}

memory_resource* c_api_vmm_owner(c_api_vmm_state* state, const void* ptr) {
  return state->tags.tag_of(ptr) != 0 ? &state->tags : nullptr;
}

bool c_api_vmm_is_live(const c_api_vmm_state* state, const void* ptr) {
  return state->tags.is_live_tagged(ptr);
}

resource_stats c_api_vmm_stats(const c_api_vmm_state* state) { return state->tags.stats(); }

std::size_t c_api_vmm_trim(c_api_vmm_state* state) { return state->tags.trim(); }

void c_api_vmm_release_stream(c_api_vmm_state* state, stream_handle stream) {
  state->tags.release_stream(stream);
}

void* c_api_vmm_after_out_of_memory(c_api_vmm_state* state, const out_of_memory& first,
                                    const std::function<void*()>& attempt) {
  return state->tags.after_out_of_memory(first, attempt);
}

void* c_api_vmm_while_untagged_awake(c_api_vmm_state* state,
                                     const std::function<void*()>& attempt) {
  return state->tags.while_awake(0, attempt);
}

std::string c_api_vmm_describe_tags(const c_api_vmm_state* state) {
  return state->tags.describe_tags();
}

std::vector<std::pair<std::uint32_t, const gpumem::pool_base*>> c_api_vmm_tag_pools(
    const c_api_vmm_state* state) {
  return state->tags.tag_pools();
}

}  // namespace gpumem::detail

namespace {

using gpumem::detail::c_api_fail;
using gpumem::detail::c_api_vmm_state;
using gpumem::detail::guarded;
using gpumem::detail::to_stream;

gpumem_status fail_with(gpumem_status status, const char* where, const char* what) noexcept {
  try {
    return c_api_fail(status, (std::string(where) + ": " + what).c_str());
  } catch (...) {
    return c_api_fail(status, what);
  }
}

// The pool's state, made now if need be: only for a call that allocates, shares or sleeps
// tag 0. REQUIRES: parts.pool != nullptr.
c_api_vmm_state& state_of(const gpumem::detail::c_api_pool_parts& parts) {
  if (auto* s = parts.vmm->load(std::memory_order_acquire); s != nullptr) return *s;
  std::lock_guard lock(*parts.vmm_mutex);
  if (auto* s = parts.vmm->load(std::memory_order_acquire); s != nullptr) return *s;
  auto* made = new c_api_vmm_state(*parts.pool, *parts.front);
  parts.vmm->store(made, std::memory_order_release);
  return *made;
}

// The pool's state if a call made it; nullptr otherwise (then no tag other than 0 was ever
// allocated in, and none sleeps).
c_api_vmm_state* existing_state(const gpumem::detail::c_api_pool_parts& parts) {
  return parts.vmm->load(std::memory_order_acquire);
}

// The refusal of a sleep or wake of a tag that was never allocated in (a pool with no
// state): the same as tagged_pool's, and nothing is made.
[[noreturn]] void refuse_unknown_tag(std::uint32_t tag, const char* caller) {
  if (tag == gpumem::tagged_pool::shared_tag)
    throw gpumem::invalid_argument(std::string("the shared tag's memory is shared with other "
                                               "processes and does not ") + caller);
  throw gpumem::invalid_argument("tag " + gpumem::tag_label(tag) +
                                 " was never allocated in, so it holds no memory and " +
                                 (std::string_view(caller) == "wake" ? "is not asleep"
                                  : std::string_view(caller) == "release_host"
                                      ? "no host memory"
                                      : "has nothing to sleep") +
                                 "; nothing changed");
}

void fill_stats(const gpumem::resource_stats& s, gpumem_stats* out) {
  *out = gpumem_stats{};
  out->live_bytes = s.live_bytes;
  out->peak_live_bytes = s.peak_live_bytes;
  out->live_allocations = s.live_allocations;
  out->reserved_bytes = s.reserved_bytes;
  out->peak_reserved_bytes = s.peak_reserved_bytes;
  out->cached_bytes = s.cached_bytes;
  out->allocations = s.allocations;
  out->deallocations = s.deallocations;
  out->alloc_retries = s.alloc_retries;
  out->oom_count = s.oom_count;
  out->fragmentation = s.fragmentation();
}

}  // namespace

namespace gpumem::detail {

vmm_page_pool& c_api_current_page_pool(const c_api_pool_parts& parts, const char* what) {
  const std::uint32_t tag = scoped_tag::current();
  if (tag != 0) return state_of(parts).tags.page_pool(tag);
  auto* pages = dynamic_cast<vmm_page_pool*>(parts.pool);
  if (pages == nullptr)
    throw invalid_argument(std::string(what) +
                           " a vmm_page_pool (allocator:vmm_page_pool), not a '" +
                           std::string(parts.pool->name()) + "'");
  return *pages;
}

}  // namespace gpumem::detail

extern "C" {

uint32_t gpumem_set_current_tag(uint32_t tag) {
  const uint32_t previous = gpumem::scoped_tag::current();
  gpumem::scoped_tag::set_current(tag);
  return previous;
}

uint32_t gpumem_current_tag(void) { return gpumem::scoped_tag::current(); }

uint32_t gpumem_set_process_tag(uint32_t tag) { return gpumem::scoped_tag::set_process(tag); }

gpumem_status gpumem_name_tag(uint32_t tag, const char* name) {
  if (name == nullptr) return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_name_tag: null name");
  return guarded("gpumem_name_tag", [&] { gpumem::set_tag_name(tag, name); });
}

gpumem_status gpumem_allocate_tagged(gpumem_pool* pool, size_t size, size_t alignment,
                                     void* stream, uint32_t tag, void** out) {
  if (out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_allocate_tagged: null output pointer");
  *out = nullptr;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_allocate_tagged");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_allocate_tagged", [&] {
    // Tag 0 too: through the planner (the tags' front for tag 0), refused while it sleeps.
    *out = state_of(parts).tags.allocate(size, alignment, to_stream(stream), tag);
  });
}

gpumem_status gpumem_pool_set_keep_free(gpumem_pool* pool, uint64_t bytes) {
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_pool_set_keep_free");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_pool_set_keep_free", [&] {
    if (dynamic_cast<gpumem::vmm_page_pool*>(parts.pool) == nullptr)
      throw gpumem::invalid_argument("gpumem_pool_set_keep_free: keep_free is a vmm_page_pool's "
                                     "(allocator:vmm_page_pool)");
    if (bytes > std::numeric_limits<std::size_t>::max())
      throw gpumem::invalid_argument("gpumem_pool_set_keep_free: " + std::to_string(bytes) +
                                     " bytes do not fit this machine's size_t");
    // Through the tags, made now if need be, so tags made later get it too.
    state_of(parts).tags.set_keep_free(static_cast<std::size_t>(bytes));
  });
}

gpumem_status gpumem_sleep(gpumem_pool* pool, uint32_t tag, int mode, void* stream) {
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_sleep");
  if (parts.pool == nullptr) return gpumem_last_status();
  if (mode != GPUMEM_SLEEP_OFFLOAD && mode != GPUMEM_SLEEP_DISCARD)
    return fail_with(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_sleep",
                     "mode must be 0 (offload) or 1 (discard)");
  return guarded("gpumem_sleep", [&] {
    c_api_vmm_state* st = tag == 0 ? &state_of(parts) : existing_state(parts);
    if (st == nullptr) refuse_unknown_tag(tag, "sleep");
    st->tags.sleep(tag, mode == GPUMEM_SLEEP_OFFLOAD ? gpumem::sleep_mode::offload
                                                    : gpumem::sleep_mode::discard,
                   to_stream(stream));
  });
}

gpumem_status gpumem_wake(gpumem_pool* pool, uint32_t tag, void* stream) {
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_wake");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_wake", [&] {
    c_api_vmm_state* st = existing_state(parts);
    if (st == nullptr) {
      // Tag 0 never slept: its wake is refused as tagged_pool refuses it.
      if (tag == 0) throw gpumem::invalid_argument("tagged_pool::wake: tag 0 is not asleep");
      refuse_unknown_tag(tag, "wake");
    }
    st->tags.wake(tag, to_stream(stream));
  });
}

int gpumem_tag_asleep(gpumem_pool* pool, uint32_t tag) {
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_tag_asleep");
  if (parts.pool == nullptr) return -1;
  const auto* st = existing_state(parts);
  return st != nullptr && st->tags.asleep(tag) ? 1 : 0;
}

gpumem_status gpumem_tag_stats(gpumem_pool* pool, uint32_t tag, gpumem_stats* out) {
  if (out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_tag_stats: null output pointer");
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_tag_stats");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_tag_stats", [&] {
    if (const c_api_vmm_state* st = existing_state(parts); st != nullptr)
      fill_stats(st->tags.tag_stats(tag), out);
    else
      fill_stats(tag == 0 ? parts.front->stats() : gpumem::resource_stats{}, out);
  });
}

gpumem_status gpumem_tag_host_bytes(gpumem_pool* pool, uint32_t tag, uint64_t* out) {
  if (out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_tag_host_bytes: null output pointer");
  *out = 0;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_tag_host_bytes");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_tag_host_bytes", [&] {
    if (const c_api_vmm_state* st = existing_state(parts); st != nullptr)
      *out = st->tags.host_bytes(tag);
  });
}

gpumem_status gpumem_release_host(gpumem_pool* pool, uint32_t tag, uint64_t* released) {
  if (released != nullptr) *released = 0;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_release_host");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_release_host", [&] {
    c_api_vmm_state* st = existing_state(parts);
    if (st == nullptr) {
      if (tag == 0) return;  // tag 0 never slept: it holds no host memory
      refuse_unknown_tag(tag, "release_host");
    }
    const std::size_t bytes = st->tags.release_host(tag);
    if (released != nullptr) *released = bytes;
  });
}

gpumem_status gpumem_device_memory(gpumem_pool* pool, size_t* free_bytes, size_t* total_bytes) {
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_device_memory");
  if (parts.pool == nullptr) return gpumem_last_status();
  auto info = parts.device_platform->mem_info(parts.device);
  if (!info) return fail_with(GPUMEM_ERROR_CUDA, "gpumem_device_memory", info.error().describe().c_str());
  if (free_bytes != nullptr) *free_bytes = info.value().free;
  if (total_bytes != nullptr) *total_bytes = info.value().total;
  return GPUMEM_SUCCESS;
}

gpumem_status gpumem_export(gpumem_pool* pool, void* ptr, int* fd_out) {
  if (fd_out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_export: null output pointer");
  *fd_out = -1;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_export");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_export", [&] { *fd_out = state_of(parts).tags.export_allocation(ptr); });
}

gpumem_status gpumem_import(gpumem_pool* pool, int fd, size_t size, void** ptr_out) {
  if (ptr_out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_import: null output pointer");
  *ptr_out = nullptr;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_import");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_import",
                 [&] { *ptr_out = state_of(parts).tags.import_allocation(fd, size); });
}

gpumem_status gpumem_export_pages(gpumem_pool* pool, void* ptr, size_t size, int* fds_out,
                                  size_t* bytes_out, size_t capacity, size_t* count_out,
                                  size_t* offset_out) {
  if (count_out == nullptr || offset_out == nullptr || (capacity != 0 && (fds_out == nullptr || bytes_out == nullptr)))
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_export_pages: null output pointer");
  *count_out = 0;
  *offset_out = 0;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_export_pages");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_export_pages", [&] {
    auto out = state_of(parts).tags.export_pages(ptr, size);
    *count_out = out.fds.size();
    if (out.fds.size() > capacity) {
      for (const int fd : out.fds) ::close(fd);
      throw gpumem::invalid_argument("gpumem_export_pages: the range has " +
                                     std::to_string(out.fds.size()) + " handles, room for " +
                                     std::to_string(capacity));
    }
    std::copy(out.fds.begin(), out.fds.end(), fds_out);
    std::copy(out.bytes.begin(), out.bytes.end(), bytes_out);
    *offset_out = out.offset;
  });
}

gpumem_status gpumem_import_pages(gpumem_pool* pool, const int* fds, const size_t* bytes,
                                  size_t count, void** ptr_out) {
  if (ptr_out == nullptr || (count != 0 && (fds == nullptr || bytes == nullptr)))
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_import_pages: null pointer");
  *ptr_out = nullptr;
  const auto parts = gpumem::detail::c_api_pool(pool, "gpumem_import_pages");
  if (parts.pool == nullptr) return gpumem_last_status();
  return guarded("gpumem_import_pages", [&] {
    *ptr_out = state_of(parts).tags.import_pages(std::span<const int>(fds, count),
                                                 std::span<const std::size_t>(bytes, count));
  });
}

gpumem_status gpumem_send_fd(int socket, int fd, uint64_t size) {
  if (gpumem::send_fd(socket, fd, size)) return GPUMEM_SUCCESS;
  char text[128];
  std::snprintf(text, sizeof text, "gpumem_send_fd: sendmsg failed (%s)", std::strerror(errno));
  return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, text);
}

gpumem_status gpumem_receive_fd(int socket, int* fd_out, uint64_t* size_out) {
  if (fd_out == nullptr)
    return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, "gpumem_receive_fd: null output pointer");
  *fd_out = gpumem::receive_fd(socket, size_out);
  if (*fd_out >= 0) return GPUMEM_SUCCESS;
  char text[192];
  if (errno == EBADMSG)
    std::snprintf(text, sizeof text,
                  "gpumem_receive_fd: not a message of gpumem_send_fd (short, cut, or with no "
                  "or several descriptors); every descriptor it carried is closed");
  else
    std::snprintf(text, sizeof text, "gpumem_receive_fd: recvmsg failed (%s)", std::strerror(errno));
  return c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT, text);
}

}  // extern "C"
