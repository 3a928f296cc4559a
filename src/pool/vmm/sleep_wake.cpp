// vmm_page_pool::sleep / wake: release every physical page of the pool keeping its virtual
// addresses, and map new pages at the same addresses later (vmm_page_pool.hpp).
//
// A chunk goes to sleep in three steps, each recorded, so a failure at any step leaves a
// state that the next sleep() or wake() completes:
//   mapped   -> its bytes are copied to the host (offload), then it is unmapped
//   unmapped -> its handle is released (its bytes are now only on the host)
//   released -> asleep; wake() creates a handle, maps it, grants access and copies back.
// Offloaded chunks copy in slices; a slice is unmapped and released once its copies are
// done, while the next slice copies. Wake maps side-by-side released chunks as one handle
// (a run, up to a huge growth's handle size, footprint:fast, while memory is plentiful:
// plentiful_share) and queues each run's copy as soon as it is mapped, so the copies run under the next runs' driver calls; the run's
// first chunk takes the handle, the others leave the table. A chunk that is mapped is
// awake whatever its record says; wake() puts an unmapped chunk (handle still held, bytes
// intact) back with no copy.
//
// The cache (footprint:fast): chunks wholly under free blocks sleep with the rest but are
// never copied, and wake maps them after the chunks in use, where there is room; the rest
// leave the pool (drop_sleeping_cache_locked: carved out of their free blocks, their
// address space free again). footprint:tight trims before it sleeps, so it has none. A
// chunk of several pages partly under free blocks copies only its pages in use; once
// released (a released chunk has no handle, so its record may be cut anywhere) it is split
// into runs all in use or all free (split_released_chunks_locked, again at wake for what
// was freed meanwhile): its free runs are cache, so a wake needs room for the pages in use
// alone. The host copy holds the pages in use alone, in address order (host_runs maps a
// page to its place), so it is as large as the live bytes the sleep copies.
//
// Allocations: refused from the moment sleep() takes the lock for its steps until the
// pool is awake again (asleep_locked() false: a wake completed, or a sleep failed before
// any chunk slept), through pool_base::refuse_allocations_locked, which also drains the
// thread caches before the cache is told apart from the pages in use.
//
// Invariants (checked by validate_holdings through sleeping_pages_locked()):
//  - released_pages == sum of the pages of chunks in phase released;
//  - every chunk with a record is live and keeps its pages in the page table;
//  - host_runs names, for every page the current sleep copied (none of the cache, no free
//    page of a partly used chunk), where its bytes are in `host` (offload only), until a
//    wake completes and gives `host` back; every page of a chunk that sleeps released and
//    wakes with its bytes restored has a place there, its pages side by side;
//  - `staging` holds at most one segment (the block of the last offload sleep, kept for
//    the next one), so host memory stays flat across sleep / wake cycles of one size.
#include <algorithm>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/vmm/sleep_state.hpp"

namespace gpumem {

namespace {

// Offload copies go in slices of this many bytes (offload_and_retire_locked): large enough that a
// slice's copy outlasts the driver calls that retire the slice before it.
constexpr std::size_t sleep_slice_bytes = std::size_t{256} << 20;

// Two events a sleep alternates between, destroyed with it. Without events (creation
// failed) a wait synchronizes the whole stream: the same order, less overlap.
class stream_events {
 public:
  stream_events(platform& p, int device) : p_(p) {
    for (auto& e : events_) {
      auto r = p_.event_create(device);
      if (!r) {
        release();
        return;
      }
      e = r.value();
      ++made_;
    }
  }
  stream_events(const stream_events&) = delete;
  stream_events& operator=(const stream_events&) = delete;
  ~stream_events() { release(); }

  void record(std::size_t i, stream_handle stream) {
    if (made_ == 2) {
      if (auto s = p_.event_record(events_[i], stream); !s)
        gpumem::throw_cuda_error(s, "vmm_page_pool::sleep: record an event");
    }
  }
  // Returns once the work recorded by record(i) is done.
  void wait(std::size_t i, stream_handle stream) {
    status s = made_ == 2 ? p_.event_synchronize(events_[i]) : p_.stream_synchronize(stream);
    if (!s) gpumem::throw_cuda_error(s, "vmm_page_pool::sleep: wait for the copies");
  }

 private:
  void release() noexcept {
    for (std::size_t i = 0; i < made_; ++i) (void)p_.event_destroy(events_[i]);
    made_ = 0;
  }
  platform& p_;
  event_handle events_[2]{};
  std::size_t made_ = 0;
};

// A block of `bytes` from `staging`, which then holds that block's segment only: the
// cached one when it is large enough and free for `stream`, else a new one in its place.
void* take_staging_block(pinned_host_pool& staging, std::size_t bytes, stream_handle stream) {
  const std::size_t held = staging.stats().reserved_bytes;
  if (held < bytes) staging.trim();  // too small to reuse: give it back before the new one
  void* block = staging.allocate(bytes, stream);  // throws out_of_memory: nothing changed
  if (held >= bytes && staging.stats().reserved_bytes > held) {
    // The cached segment still waits for another stream's copies: wait for them (trim
    // does) and keep one segment.
    staging.deallocate(block, bytes, stream);
    staging.trim();
    block = staging.allocate(bytes, stream);
  }
  return block;
}

// Runs `f` when the scope ends, however it ends.
template <class F>
class at_scope_end {
 public:
  explicit at_scope_end(F f) : f_(std::move(f)) {}
  at_scope_end(const at_scope_end&) = delete;
  at_scope_end& operator=(const at_scope_end&) = delete;
  ~at_scope_end() { f_(); }

 private:
  F f_;
};

}  // namespace

std::string vmm_page_pool::asleep_refusal_locked(std::string_view caller) const {
  const std::string head = "vmm_page_pool::" + std::string(caller) + ": ";
  if (sleep_ != nullptr && sleep_->complete)
    return head + "the pool is asleep (its pages are released; in a tagged pool, its tag "
                  "sleeps); wake it before allocating";
  return head + "a sleep or wake of the pool failed halfway and left part of its pages "
                "asleep (" + format_bytes(sleeping_pages_locked() * page_) +
         " released); sleep again to complete the sleep, or wake it, before allocating";
}

void vmm_page_pool::allow_allocations_if_awake_locked() noexcept {
  if (!asleep_locked()) allow_allocations_locked();
}

bool vmm_page_pool::sleeping_locked() const noexcept {
  return sleep_ != nullptr && !sleep_->chunks.empty();
}

// A completed sleep is asleep even when no chunk slept (the pool held no page): the state
// is the last call's, not what the pages happen to be.
bool vmm_page_pool::asleep_locked() const noexcept {
  return sleep_ != nullptr && (sleep_->complete || !sleep_->chunks.empty());
}

std::size_t vmm_page_pool::sleeping_pages_locked() const noexcept {
  return sleep_ != nullptr ? sleep_->released_pages : 0;
}

void vmm_page_pool::forget_sleeping_chunks() noexcept {
  if (sleep_ == nullptr) return;
  for (auto& [id, ph] : sleep_->chunks)
    if (ph == detail::vmm_sleep_state::phase::released) chunks_[id].live = false;
}

bool vmm_page_pool::asleep() const {
  std::lock_guard lock(mutex_);
  return asleep_locked();
}

std::size_t vmm_page_pool::sleeping_bytes() const {
  std::lock_guard lock(mutex_);
  return sleeping_pages_locked() * page_;
}

std::size_t vmm_page_pool::host_bytes() const {
  std::lock_guard lock(mutex_);
  return sleep_ != nullptr && sleep_->staging != nullptr ? sleep_->staging->stats().reserved_bytes
                                                         : 0;
}

std::size_t vmm_page_pool::release_host() {
  std::lock_guard lock(mutex_);
  if (sleep_ == nullptr || sleep_->staging == nullptr) return 0;
  auto& st = *sleep_;
  if (asleep_locked() && st.mode == sleep_mode::offload)
    throw invalid_argument("vmm_page_pool::release_host: the pool sleeps with offload and its " +
                           format_bytes(sleeping_pages_locked() * page_) +
                           " live in that host memory; wake it first");
  if (st.host != nullptr) {  // left by a sleep that failed before any page slept
    st.staging->deallocate(st.host, st.host_bytes, stream_handle{});
    st.clear_host_layout();
  }
  const std::size_t held = st.staging->stats().reserved_bytes;
  st.staging->trim();  // waits for the copies of the last wake
  const std::size_t released = held - st.staging->stats().reserved_bytes;
  if (st.staging->stats().reserved_bytes == 0) st.staging.reset();
  return released;
}

void vmm_page_pool::sleep(sleep_mode mode, stream_handle stream) {
  using phase = detail::vmm_sleep_state::phase;
  check_stream(stream, "vmm_page_pool::sleep");
  bool resuming = false;
  {
    std::lock_guard lock(mutex_);
    if (options_.guard || options_.scrub)
      throw invalid_argument("vmm_page_pool::sleep: not available in guard or scrub mode");
    if (counts_.lent_pages != 0)
      throw invalid_argument("vmm_page_pool::sleep: " + std::to_string(counts_.lent_pages) +
                             " pages are lent out (a KV cache maps them); return them first");
    if (sleep_ != nullptr && sleep_->complete)
      throw invalid_argument("vmm_page_pool::sleep: already asleep (wake it first)");
    resuming = sleeping_locked();
  }
  // Free memory needs no copy. footprint:tight gives it back first; footprint:fast keeps
  // it as cache: released with the rest, uncopied, and mapped again by wake where there
  // is room, so the work after the wake finds its memory where it left it.
  if (!resuming && !fast()) trim();
  const std::uint64_t frees = stats().deallocations;

  std::lock_guard lock(mutex_);
  if (counts_.lent_pages != 0)  // lent between the check above and here
    throw invalid_argument("vmm_page_pool::sleep: " + std::to_string(counts_.lent_pages) +
                           " pages are lent out (a KV cache maps them); return them first");
  // No allocation from here on (the file comment); a sleep that fails before any chunk
  // sleeps leaves the pool awake and serving.
  const at_scope_end follow([this]() noexcept { allow_allocations_if_awake_locked(); });
  refuse_allocations_locked();
  retire_completed(true);  // no old mapping of a remapped page is left
  if (fast()) release_spare_locked();  // held unmapped: nothing to keep at an address
  if (sleep_ == nullptr) sleep_ = std::make_unique<detail::vmm_sleep_state>();
  auto& st = *sleep_;
  if (!resuming) {
    st.mode = mode;  // a sleep that failed halfway completes in its own mode
    st.frees_at_sleep = frees;
  }
  std::vector<std::uint32_t> ids = chunks_to_sleep_locked();
  const std::vector<std::uint32_t> cache = take_cache_locked(ids);
  const bool offload = st.mode == sleep_mode::offload;
  // Which pages of partly used chunks are free: found once, as nothing is allocated meanwhile.
  const auto partly_free = offload && fast()
                               ? partly_free_pages_locked(ids)
                               : std::unordered_map<std::uint32_t, std::vector<bool>>{};
  if (offload) stage_host_copy_locked(ids, partly_free, resuming, stream);
  if (offload && !ids.empty()) {
    offload_and_retire_locked(ids, partly_free, stream);
  } else {
    // Nothing to copy: the work queued on the stream is done before the pages go.
    if (auto s = device_platform().stream_synchronize(stream); !s)
      throw_cuda_error(s, "vmm_page_pool::sleep: wait for the stream");
    retire_sleeping_locked(ids);
  }
  if (!cache.empty()) {
    synchronize_streams_with_free_blocks();  // work queued before their frees is done
    retire_sleeping_locked(cache);
  }
  // Chunks an earlier, failed call left unmapped are released now.
  std::vector<std::uint32_t> left;
  for (auto& [id, ph] : st.chunks)
    if (ph == phase::unmapped) left.push_back(id);
  for (std::uint32_t id : left) release_sleeping_chunk_locked(id);
  split_released_chunks_locked();
  st.complete = true;
}

// Every chunk still mapped sleeps, in address order (adjacent ones copy and unmap
// together); those an earlier, failed call unmapped are past the copy and the unmap.
std::vector<std::uint32_t> vmm_page_pool::chunks_to_sleep_locked() const {
  using phase = detail::vmm_sleep_state::phase;
  std::vector<std::uint32_t> ids;
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    if (!chunks_[id].live || chunks_[id].mapped_at == no_page) continue;
    auto it = sleep_->chunks.find(id);
    if (it == sleep_->chunks.end() || it->second == phase::mapped) ids.push_back(id);
  }
  std::sort(ids.begin(), ids.end(),
            [&](std::uint32_t a, std::uint32_t b) { return chunks_[a].mapped_at < chunks_[b].mapped_at; });
  return ids;
}

// The pinned host block the offloaded bytes of `ids` go to: their pages in use (all but
// those `partly_free` names), in address order (kept by a resumed sleep, which copies into
// the same places: no page is allocated while chunks sleep, so none it copies lacks one).
void vmm_page_pool::stage_host_copy_locked(
    std::span<const std::uint32_t> ids,
    const std::unordered_map<std::uint32_t, std::vector<bool>>& partly_free, bool resuming,
    stream_handle stream) {
  auto& st = *sleep_;
  if (st.staging == nullptr)
    st.staging = std::make_unique<pinned_host_pool>(device_platform(), device());
  if (!resuming && st.host != nullptr) {  // left by a sleep that failed before any page slept
    st.staging->deallocate(st.host, st.host_bytes, stream);
    st.clear_host_layout();
  }
  if (st.host == nullptr && !ids.empty()) {
    st.clear_host_layout();
    for (std::uint32_t id : ids) {
      const chunk& c = chunks_[id];
      const auto mask = partly_free.find(id);
      for (std::size_t k = 0; k < c.pages; ++k)
        if (mask == partly_free.end() || !mask->second[k]) st.add_host_page(c.mapped_at + k, page_);
    }
    try {
      st.host = take_staging_block(*st.staging, st.host_bytes, stream);
    } catch (...) {
      st.clear_host_layout();
      throw;
    }
  }
}

// The copies go in slices of about sleep_slice_bytes; while one slice copies, the one
// before it (its copies done, and with them the work queued before) is unmapped and
// released, so the driver calls run under the transfer instead of after it.
// REQUIRES: !ids.empty().
void vmm_page_pool::offload_and_retire_locked(
    std::span<const std::uint32_t> ids,
    const std::unordered_map<std::uint32_t, std::vector<bool>>& partly_free,
    stream_handle stream) {
  stream_events events(device_platform(), device());
  std::span<const std::uint32_t> prev;
  std::size_t slice = 0;
  for (std::size_t begin = 0; begin < ids.size(); ++slice) {
    std::size_t end = begin, bytes = 0;
    while (end < ids.size() && (end == begin || bytes < sleep_slice_bytes))
      bytes += chunks_[ids[end++]].pages * page_;
    copy_to_host_locked(ids.subspan(begin, end - begin), partly_free, stream);
    events.record(slice % 2, stream);
    if (slice > 0) {
      events.wait((slice - 1) % 2, stream);
      retire_sleeping_locked(prev);
    }
    prev = ids.subspan(begin, end - begin);
    begin = end;
  }
  events.wait((slice - 1) % 2, stream);
  retire_sleeping_locked(prev);
}

// Queues on `stream` the copies of the chunks `ids` to their places in the host block, but
// the free pages `partly_free` names (partly_free_pages_locked), which have none; copies of
// adjacent runs (adjacent in the host block too) go as one.
void vmm_page_pool::copy_to_host_locked(
    std::span<const std::uint32_t> ids,
    const std::unordered_map<std::uint32_t, std::vector<bool>>& partly_free,
    stream_handle stream) {
  const auto& st = *sleep_;
  // Runs of pages in use: (first VA page, pages, host offset), side by side ones joined.
  struct run {
    std::size_t first, pages, host;
  };
  std::vector<run> runs;
  auto add = [&](std::size_t first, std::size_t pages, std::size_t host) {
    if (!runs.empty() && runs.back().first + runs.back().pages == first &&
        runs.back().host + runs.back().pages * page_ == host)
      runs.back().pages += pages;
    else
      runs.push_back({first, pages, host});
  };
  for (std::uint32_t id : ids) {
    const chunk& c = chunks_[id];
    const auto mask = partly_free.find(id);
    for (std::size_t k = 0; k < c.pages; ++k)
      if (mask == partly_free.end() || !mask->second[k])
        add(c.mapped_at + k, 1, st.host_offset(c.mapped_at + k, 1, page_));
  }
  for (const run& r : runs)
    if (auto s = device_platform().memcpy_async(static_cast<char*>(st.host) + r.host,
                                                reinterpret_cast<void*>(page_address(r.first)),
                                                r.pages * page_, stream);
        !s)
      throw_cuda_error(s, "vmm_page_pool::sleep: copy the pages to the host");
}

// Unmaps and releases the chunks `ids` (their copies, if any, are done): runs of adjacent
// chunks unmap in one call each where the driver accepts it.
void vmm_page_pool::retire_sleeping_locked(std::span<const std::uint32_t> ids) {
  using phase = detail::vmm_sleep_state::phase;
  auto& st = *sleep_;
  for (std::uint32_t id : ids) st.chunks.try_emplace(id, phase::mapped);
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i + 1;
    while (j < ids.size() &&
           chunks_[ids[j]].mapped_at == chunks_[ids[j - 1]].mapped_at + chunks_[ids[j - 1]].pages)
      ++j;
    const std::span<const std::uint32_t> run = ids.subspan(i, j - i);
    auto [done, failed] = unmap_run(run);
    // unmap_run reports the chunks unmapped from the top of the run.
    for (std::size_t k = 0; k < done; ++k) st.chunks[run[run.size() - 1 - k]] = phase::unmapped;
    if (!failed.ok()) throw_cuda_error(failed, "vmm_page_pool::sleep: unmap the pages");
    i = j;
  }
  for (std::uint32_t id : ids) release_sleeping_chunk_locked(id);
}

// Gives the physical memory of an unmapped sleeping chunk back to the driver.
void vmm_page_pool::release_sleeping_chunk_locked(std::uint32_t id) {
  using phase = detail::vmm_sleep_state::phase;
  auto& st = *sleep_;
  auto ph = st.chunks.find(id);
  if (ph == st.chunks.end() || ph->second != phase::unmapped) return;
  chunk& c = chunks_[id];
  if (auto s = device_platform().release_physical(c.handle); !s)
    throw_cuda_error(s, "vmm_page_pool::sleep: release the physical memory");
  c.handle = physical_handle{};
  ph->second = phase::released;
  st.released_pages += c.pages;
  sub_reserved(c.pages * page_);
  counts_.pages_released += c.pages;
}

void vmm_page_pool::wake(stream_handle stream) {
  check_stream(stream, "vmm_page_pool::wake");
  const std::uint64_t frees = stats().deallocations;
  bool freed_while_asleep = false;
  {
    std::lock_guard lock(mutex_);
    if (!asleep_locked()) throw invalid_argument("vmm_page_pool::wake: not asleep");
    // Allocations are served again once every chunk is awake; a failed wake leaves the
    // pool partly asleep, still refusing them.
    const at_scope_end follow([this]() noexcept { allow_allocations_if_awake_locked(); });
    auto& st = *sleep_;
    split_released_chunks_locked();  // pages freed while asleep are cache too
    // Address order, so that side-by-side chunks wake as one handle (wake_runs_locked).
    std::vector<std::uint32_t> ids;
    for (auto& [id, ph] : st.chunks) ids.push_back(id);
    std::sort(ids.begin(), ids.end(),
              [&](std::uint32_t a, std::uint32_t b) { return chunks_[a].mapped_at < chunks_[b].mapped_at; });
    // The cache (free when the sleep began, or freed since) wakes after the rest and only
    // where there is room.
    const std::vector<std::uint32_t> cache = take_cache_locked(ids);
    st.complete = false;  // from here the pool is partly awake until this call ends
    wake_runs_locked(ids, stream, true);
    wake_runs_locked(cache, stream, false);
    freed_while_asleep = !fast() && frees != st.frees_at_sleep;
    // Every chunk is awake: the host copy is free once the copies on `stream` are done.
    if (st.host != nullptr) {
      st.staging->deallocate(st.host, st.host_bytes, stream);
      st.clear_host_layout();
    }
  }
  // footprint:tight: blocks freed while asleep were restored with the rest: give their
  // pages back, once the copies into them are done.
  if (freed_while_asleep) {
    if (auto s = device_platform().stream_synchronize(stream); !s)
      throw_cuda_error(s, "vmm_page_pool::wake: wait for the stream");
    trim();
  }
}

// Chunk ids (indexing chunks_) wholly under free blocks of the arenas, whatever their
// streams' work: a sleep releases them uncopied, a wake maps them back as cache.
std::vector<bool> vmm_page_pool::free_chunks_locked() {
  std::vector<bool> free(chunks_.size(), false);
  for (const reclaim_candidate& c : reclaim_candidates(true, nullptr, 0))
    for (std::uint32_t id : c.chunks) free[id] = true;
  return free;
}

std::unordered_map<std::uint32_t, std::vector<bool>> vmm_page_pool::partly_free_pages_locked(
    std::span<const std::uint32_t> ids) {
  std::unordered_map<std::uint32_t, std::vector<bool>> free;
  for (std::uint32_t id : ids)
    if (chunks_[id].pages > 1) free.emplace(id, std::vector<bool>(chunks_[id].pages, false));
  if (free.empty()) return free;
  for (std::uint32_t a : {small_arena, large_arena, long_arena}) {
    arena(a).flush();
    for (const detail::block* b : arena(a).free_blocks()) {
      const std::size_t first = (b->addr - va_base_ + page_ - 1) / page_;
      const std::size_t end = (b->addr + b->size - va_base_) / page_;
      for (std::size_t p = first; p < end; ++p) {
        const std::uint32_t id = page_table_[p];
        if (id == no_chunk || id == retiring_page) continue;
        if (auto it = free.find(id); it != free.end()) it->second[p - chunks_[id].mapped_at] = true;
      }
    }
  }
  std::erase_if(free, [](const auto& entry) {
    const auto& mask = entry.second;
    return std::all_of(mask.begin(), mask.end(), [](bool f) { return f; }) ||
           std::none_of(mask.begin(), mask.end(), [](bool f) { return f; });
  });
  return free;
}

// footprint:fast: splits every released chunk partly under free blocks into runs all in
// use or all free (the file comment).
void vmm_page_pool::split_released_chunks_locked() {
  using phase = detail::vmm_sleep_state::phase;
  if (!fast()) return;
  std::vector<std::uint32_t> released;
  for (const auto& [id, ph] : sleep_->chunks)
    if (ph == phase::released && chunks_[id].pages > 1) released.push_back(id);
  for (const auto& [id, mask] : partly_free_pages_locked(released))
    for (std::size_t k = mask.size() - 1; k > 0; --k)  // from the top: `id` keeps the bottom
      if (mask[k] != mask[k - 1]) split_released_chunk_locked(id, k);
}

// Cuts the released chunk `id` at its page `at`: it keeps the pages below, a new record
// (returned) takes the rest, asleep as released with its part of the host copy.
std::uint32_t vmm_page_pool::split_released_chunk_locked(std::uint32_t id, std::size_t at) {
  auto& st = *sleep_;
  const std::uint32_t tail = new_chunk_id();  // may grow chunks_: no reference is held over it
  chunks_[tail] = chunks_[id];
  chunk& head = chunks_[id];
  chunk& rest = chunks_[tail];
  rest.pages = head.pages - at;
  rest.mapped_at = head.mapped_at + at;
  head.pages = at;
  std::fill_n(page_table_.begin() + static_cast<std::ptrdiff_t>(rest.mapped_at), rest.pages, tail);
  st.chunks[tail] = detail::vmm_sleep_state::phase::released;
  return tail;
}

// footprint:fast: moves the chunks of `ids` wholly under free blocks (the pool's cache) out
// of `ids`, keeping both in order, and returns them; none in footprint:tight.
std::vector<std::uint32_t> vmm_page_pool::take_cache_locked(std::vector<std::uint32_t>& ids) {
  std::vector<std::uint32_t> cache;
  if (!fast()) return cache;
  const std::vector<bool> free = free_chunks_locked();
  std::erase_if(ids, [&](std::uint32_t id) {
    if (!free[id]) return false;
    cache.push_back(id);
    return true;
  });
  return cache;
}

// Wakes the sleeping chunks `order` (address order), side-by-side released ones as one
// handle (wake_run_locked). Live pages (`live`): a failure throws and leaves the rest
// asleep. Cache: what has no room leaves the pool instead (drop_sleeping_cache_locked), so
// a wake needs room for the live bytes only. Room is within the budget's margin (where
// footprint:fast starts to gather) and leaves the device a 32nd of its memory free: the
// driver, other libraries and other processes allocate outside the pool, and a cache that
// fills the device would make their next allocation fail.
void vmm_page_pool::wake_runs_locked(std::span<const std::uint32_t> order, stream_handle stream,
                                     bool live) {
  const std::size_t budget = budget_locked();
  const std::size_t room = budget - budget / budget_margin_share;
  std::size_t device_room = static_cast<std::size_t>(-1);
  std::size_t device_free = static_cast<std::size_t>(-1), plentiful = 0;
  if (auto info = device_platform().mem_info(device())) {
    device_free = info.value().free;
    plentiful = info.value().total / plentiful_share;
    const std::size_t headroom = info.value().total / budget_headroom_share;
    if (!live) device_room = device_free > headroom ? device_free - headroom : 0;
  }
  for (std::size_t i = 0; i < order.size();) {
    const std::size_t n = wake_run_length_locked(order, i, live);
    const std::span<const std::uint32_t> run = order.subspan(i, n);
    i += n;
    // (A chunk an earlier, failed sleep left unmapped keeps its handle: it maps back with
    // no new memory.)
    const bool released =
        sleep_->chunks.at(run.front()) == detail::vmm_sleep_state::phase::released;
    std::size_t bytes = 0;
    for (std::uint32_t id : run) bytes += chunks_[id].pages * page_;
    if (!live && released) {
      if (reserved_locked() + bytes > room || bytes > device_room) {
        drop_sleeping_cache_locked(run);
        continue;
      }
      device_room -= bytes;
    }
    const bool merge = n > 1 && device_free >= bytes && device_free - bytes >= plentiful &&
                       reserved_locked() + bytes <= budget - budget / plentiful_share;
    if (released) device_free = device_free > bytes ? device_free - bytes : 0;
    if (merge && wake_run_locked(run, stream, live)) continue;
    for (std::uint32_t id : run) {
      if (live) {
        wake_chunk_locked(id, stream, true);
        continue;
      }
      try {
        wake_chunk_locked(id, stream, false);
      } catch (const out_of_memory&) {
        drop_sleeping_cache_locked(std::span<const std::uint32_t>(&id, 1));
      }
    }
  }
}

// Takes the released cache chunks `ids` out of the pool while it sleeps: their pages leave
// their free blocks and their address space is free again; no driver call (their physical
// memory went back when they slept). Chunks not released, or not wholly free, are left.
std::size_t vmm_page_pool::drop_sleeping_cache_locked(std::span<const std::uint32_t> ids) {
  using phase = detail::vmm_sleep_state::phase;
  auto& st = *sleep_;
  std::vector<bool> drop(chunks_.size(), false);
  for (std::uint32_t id : ids) {
    auto it = st.chunks.find(id);
    drop[id] = it != st.chunks.end() && it->second == phase::released;
  }
  std::size_t dropped = 0;
  for (reclaim_candidate& c : reclaim_candidates(true, nullptr, 0)) {
    // Top down: carve leaves the free piece below the range it takes.
    detail::block* b = c.b;
    for (auto it = c.chunks.rbegin(); it != c.chunks.rend() && b != nullptr; ++it) {
      if (!drop[*it]) continue;
      chunk& k = chunks_[*it];
      const std::size_t first = k.mapped_at, pages = k.pages;
      b = arena(c.arena_id).carve(b, page_address(first), pages * page_);
      notify(pool_event_kind::segment_unmap, page_address(first), pages * page_);
      std::fill_n(page_table_.begin() + static_cast<std::ptrdiff_t>(first), pages, no_chunk);
      va_insert(first, pages);
      st.chunks.erase(*it);
      st.released_pages -= pages;
      forget_chunk(*it);
      dropped += pages;
    }
  }
  return dropped * page_;
}

// How many chunks from order[i] on wake as one handle (wake_run_locked): released ones,
// side by side in the address space (and, restoring bytes after offload, in the host
// block), up to a huge growth's handle size. footprint:fast only: a handle gives its pages
// back only once all of them are free, and footprint:tight keeps reserved bytes low before
// it saves driver calls. Live pages and cache wake in separate calls (wake()), so a run is
// all live pages or all free ones.
std::size_t vmm_page_pool::wake_run_length_locked(std::span<const std::uint32_t> order,
                                                  std::size_t i, bool restore) const {
  using phase = detail::vmm_sleep_state::phase;
  const auto& st = *sleep_;
  const std::size_t cap = fast() ? huge_chunk_pages() : 1;
  auto released = [&](std::uint32_t id) { return st.chunks.at(id) == phase::released; };
  const bool copies = restore && st.mode == sleep_mode::offload;
  if (!released(order[i])) return 1;
  std::size_t n = 1, pages = chunks_[order[i]].pages;
  while (i + n < order.size()) {
    const chunk& prev = chunks_[order[i + n - 1]];
    const std::uint32_t id = order[i + n];
    const chunk& c = chunks_[id];
    if (!released(id) || pages + c.pages > cap || c.mapped_at != prev.mapped_at + prev.pages) break;
    if (copies && st.host_offset(c.mapped_at, c.pages, page_) !=
                      st.host_offset(prev.mapped_at, prev.pages, page_) + prev.pages * page_)
      break;
    pages += c.pages;
    ++n;
  }
  return n;
}

// Wakes the released chunks `run` (wake_run_length_locked) with one new handle: one
// create, one map, one access grant and one copy (`restore`, after offload) for the run
// instead of one of each per chunk (the grant alone costs ~26-29 us per handle on the
// H200). The first chunk takes the handle and the run's pages; the others leave the
// table. False, with nothing changed, where the handle, its mapping, its access or its
// copy fails: the caller then wakes the chunks one by one, and reports their errors.
bool vmm_page_pool::wake_run_locked(std::span<const std::uint32_t> run, stream_handle stream,
                                    bool restore) {
  platform& p = device_platform();
  auto& st = *sleep_;
  chunk& head = chunks_[run.front()];
  std::size_t pages = 0;
  for (std::uint32_t id : run) pages += chunks_[id].pages;
  const std::size_t bytes = pages * page_;
  const std::uintptr_t va = page_address(head.mapped_at);
  if (options_.limit_bytes != 0 && reserved_locked() + bytes > options_.limit_bytes) return false;
  auto h = create_handle(bytes);
  if (!h) return false;
  const physical_handle fresh = h.value();
  bool mapped = false;
  auto undo = [&] {
    if (mapped) (void)p.unmap(va, bytes);
    (void)p.release_physical(fresh);
    return false;
  };
  if (!p.map(va, bytes, fresh, 0)) return undo();
  mapped = true;
  if (!grant_access(va, bytes)) return undo();
  if (restore && st.mode == sleep_mode::offload &&
      !p.memcpy_async(reinterpret_cast<void*>(va),
                      static_cast<char*>(st.host) + st.host_offset(head.mapped_at, pages, page_),
                      bytes, stream))
    return undo();
  for (std::uint32_t id : run.subspan(1)) {
    forget_chunk(id);  // its pages are the head's now
    st.chunks.erase(id);
  }
  st.chunks.erase(run.front());
  head.handle = fresh;
  head.pages = pages;
  std::fill_n(page_table_.begin() + static_cast<std::ptrdiff_t>(head.mapped_at), pages, run.front());
  st.released_pages -= pages;
  add_reserved(bytes);
  counts_.pages_created += pages;
  return true;
}

// Wakes one sleeping chunk: a fresh handle for a released one (its bytes copied back on
// `stream` after offload), the kept handle for an unmapped one; mapped and granted access
// at its address. On failure the chunk keeps its phase.
void vmm_page_pool::wake_chunk_locked(std::uint32_t id, stream_handle stream, bool restore) {
  using phase = detail::vmm_sleep_state::phase;
  platform& p = device_platform();
  auto& st = *sleep_;
  chunk& c = chunks_[id];
  const phase ph = st.chunks.at(id);
  const std::uintptr_t va = page_address(c.mapped_at);
  const std::size_t bytes = c.pages * page_;
  if (ph == phase::mapped) {  // never left
    st.chunks.erase(id);
    return;
  }
  physical_handle fresh = c.handle;
  if (ph == phase::released) {
    if (options_.limit_bytes != 0 && reserved_locked() + bytes > options_.limit_bytes)
      throw out_of_memory("gpumem: vmm_page_pool::wake: the pool's limit (" +
                          format_bytes(options_.limit_bytes) + ") leaves no room for " +
                          format_bytes(sleeping_pages_locked() * page_) +
                          " still asleep; the offloaded bytes stay on the host, wake again "
                          "once memory is free");
    auto h = create_handle(bytes);
    if (!h) {
      if (h.error().kind == failure_kind::out_of_memory)
        throw out_of_memory("gpumem: vmm_page_pool::wake: device " + std::to_string(device()) +
                            " has no room for " +
                            format_bytes(sleeping_pages_locked() * page_) +
                            " still asleep (" + h.error().describe() +
                            "); the offloaded bytes stay on the host, wake again once "
                            "memory is free");
      throw_cuda_error(h.error(), "vmm_page_pool::wake: create physical memory");
    }
    fresh = h.value();
  }
  // Map and grant access; undo this chunk's step on failure (a fresh handle is given
  // back, a kept one stays unmapped), so the chunk keeps its phase.
  if (auto s = p.map(va, bytes, fresh, 0); !s) {
    if (ph == phase::released) (void)p.release_physical(fresh);
    throw_cuda_error(s, "vmm_page_pool::wake: map the pages");
  }
  if (auto s = grant_access(va, bytes); !s) {
    (void)p.unmap(va, bytes);
    if (ph == phase::released) (void)p.release_physical(fresh);
    throw_cuda_error(s, "vmm_page_pool::wake: grant access to the pages");
  }
  if (ph == phase::released && restore && st.mode == sleep_mode::offload) {
    auto* host = static_cast<char*>(st.host) + st.host_offset(c.mapped_at, c.pages, page_);
    if (auto s = p.memcpy_async(reinterpret_cast<void*>(va), host, bytes, stream); !s) {
      (void)p.unmap(va, bytes);
      (void)p.release_physical(fresh);
      throw_cuda_error(s, "vmm_page_pool::wake: copy the pages back");
    }
  }
  if (ph == phase::released) {
    c.handle = fresh;
    st.released_pages -= c.pages;
    add_reserved(bytes);
    counts_.pages_created += c.pages;
  }
  st.chunks.erase(id);
}

}  // namespace gpumem
