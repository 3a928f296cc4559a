// pool_base: construction, the thread caches and their counts, and the allocate and
// deallocate paths (the fast path through this thread's cache, then the pool lock).
#include "gpumem/pool/core/pool_base.hpp"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <limits>
#include <sstream>
#include <unordered_map>

#include "gpumem/errors.hpp"
#include "backend/ownership_registry.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/core/lifetime_hints.hpp"
#include "pool/core/pool_sizes.hpp"
#include "pool/core/thread_cache.hpp"

namespace gpumem {

namespace {

// The thread's caches of the pools it used lately, named by pool id. A slot whose pool
// was destroyed never matches again (ids are not reused); a thread using more pools than
// slots finds the others through the pool's map, under the pool lock.
struct cache_slot {
  std::uint64_t pool = 0;
  detail::thread_cache* cache = nullptr;
};
thread_local std::array<cache_slot, 8> t_cache_slots{};
thread_local unsigned t_next_slot = 0;
std::atomic<std::uint64_t> g_next_pool_id{1};

void raise_to(std::atomic<std::size_t>& peak, std::size_t value) noexcept {
  std::size_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

}  // namespace

pool_base::pool_base(platform& platform, int device, pool_options options,
                     std::size_t alignment_limit)
    : memory_resource(platform, device),
      options_(options),
      pool_id_(g_next_pool_id.fetch_add(1, std::memory_order_relaxed)),
      fast_path_allowed_(options.thread_cache && !options.guard && !options.scrub &&
                         options.release_threshold == std::numeric_limits<std::size_t>::max()),
      alignment_limit_(alignment_limit) {
  // As pool_options::parse checks a configuration string: block_size_for steps by a
  // power-of-two share of an octave.
  if (!pool_options::valid_small_classes(options.small_classes))
    throw invalid_argument("pool: small_classes must be 0 or a power of two up to 64, not " +
                           std::to_string(options.small_classes));
  if ((options.round_large & (options.round_large - 1)) != 0)  // block_size_for masks by it
    throw invalid_argument("pool: round_large must be 0 or a power of two, not " +
                           std::to_string(options.round_large));
  // With thread caches in front, the arenas keep no quick lists of their own: a block a
  // cache gives back is merged at once, so best fit sees every free byte (less
  // fragmentation). Without them (thread_cache:off, guard, scrub, a release threshold) the
  // small arena's quick lists are the fast path of exact-size reuse. Large blocks are never
  // held back unmerged, in quick lists or thread caches (thread_cache.hpp says why): an
  // unmerged large block splits the free run it belongs to, and the pool then maps pages
  // for requests that run would hold.
  resolve_access_devices();
  const std::size_t quick_blocks = fast_path_allowed_ ? 0 : 4096;
  arenas_[small_arena] = std::make_unique<detail::block_arena>(small_arena, 512, quick_blocks);
  arenas_[large_arena] = std::make_unique<detail::block_arena>(large_arena, 512, 0);
  arenas_[long_arena] = std::make_unique<detail::block_arena>(long_arena, 512, 0);
  streams_.states.try_emplace(0);  // the default stream: fresh and reserved memory is tagged with it
  fast_path_.store(fast_path_allowed_, std::memory_order_relaxed);
}

// The pool's own device, then each peer of pool_options::peer_access: a peer named that
// cannot reach the pool's device is refused; `all` takes every device that can.
void pool_base::resolve_access_devices() {
  access_devices_.push_back(device());
  if (options_.peer_access == 0 && !options_.peer_access_all) return;
  platform& p = device_platform();
  auto count = p.device_count();
  if (!count) throw_cuda_error(count.error(), "pool: peer_access: count the devices");
  for (int d = count.value(); d < 64; ++d)
    if ((options_.peer_access >> d & 1) != 0)
      throw invalid_argument("pool: peer_access names device " + std::to_string(d) + "; the " +
                             std::string(p.kind()) + " platform has " +
                             std::to_string(count.value()) + " device(s)");
  for (int d = 0; d < count.value(); ++d) {
    if (d == device() || !(options_.peer_access_all || (options_.peer_access >> d & 1) != 0))
      continue;
    auto can = p.can_access_peer(d, device());
    if (!can) throw_cuda_error(can.error(), "pool: peer_access: cuDeviceCanAccessPeer");
    if (!can.value()) {
      if (options_.peer_access_all) continue;
      throw invalid_argument("pool: peer_access: device " + std::to_string(d) +
                             " cannot reach device " + std::to_string(device()) +
                             "'s memory (cuDeviceCanAccessPeer is 0); nothing was made");
    }
    access_devices_.push_back(d);
  }
}

void pool_base::use_lifetime_hints() { hints_ = std::make_unique<detail::lifetime_hints>(); }

void pool_base::note_long_lived_moved(std::size_t bytes) noexcept {
  if (hints_ != nullptr) hints_->note_moved(bytes);
}

bool pool_base::lifetime_hints_active_locked() const noexcept {
  return hints_ != nullptr && hints_->active();
}

pool_base::~pool_base() {
  for (auto& [stream, s] : streams_.states)
    if (s.event.value != 0) (void)device_platform().event_destroy(s.event);
  for (event_handle e : streams_.spare_events) (void)device_platform().event_destroy(e);
}

inline detail::thread_cache* pool_base::this_thread_cache() const noexcept {
  for (const cache_slot& s : t_cache_slots)
    if (s.pool == pool_id_) return s.cache;
  return nullptr;
}

detail::thread_cache& pool_base::cache_for_this_thread_locked() {
  if (detail::thread_cache* c = this_thread_cache()) return *c;
  detail::thread_cache*& c = cache_of_thread_[std::this_thread::get_id()];
  if (c == nullptr) {
    caches_.push_back(std::make_unique<detail::thread_cache>());
    c = caches_.back().get();
    if (options_.small_classes != 0)
      c->use_classes(options_.small_classes, options_.small_threshold, options_.small_cache);
  }
  t_cache_slots[t_next_slot++ % t_cache_slots.size()] = {pool_id_, c};
  return *c;
}

void pool_base::publish(std::int64_t requested, std::int64_t block) noexcept {
  detail::live_totals& t = live_totals_;
  // Two's complement: adding a negative delta as unsigned subtracts it.
  const auto live = t.live.fetch_add(static_cast<std::size_t>(requested), std::memory_order_relaxed) +
                    static_cast<std::size_t>(requested);
  const auto held = t.blocks.fetch_add(static_cast<std::size_t>(block), std::memory_order_relaxed) +
                    static_cast<std::size_t>(block);
  if (requested > 0) raise_to(t.peak_live, live + t.locked().live);
  if (block > 0) raise_to(t.peak_blocks, held + t.locked().held);
}

void pool_base::publish_locked(std::int64_t requested, std::int64_t block) noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  detail::live_totals& t = live_totals_;
  const std::int64_t live = t.locked_live.load(relaxed) + requested;
  const std::int64_t held = t.locked_blocks.load(relaxed) + block;
  t.locked_live.store(live, relaxed);
  t.locked_blocks.store(held, relaxed);
  if (requested > 0) raise_to(t.peak_live, t.live.load(relaxed) + static_cast<std::size_t>(live));
  if (block > 0) raise_to(t.peak_blocks, t.blocks.load(relaxed) + static_cast<std::size_t>(held));
}

template <bool allocated, bool locked>
inline void pool_base::count(detail::thread_cache& c, std::size_t requested,
                             std::size_t block) noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  const auto r = static_cast<std::int64_t>(requested), k = static_cast<std::int64_t>(block);
  const std::int64_t live = c.pending_live.load(relaxed) + (allocated ? r : -r);
  const std::int64_t held = c.pending_blocks.load(relaxed) + (allocated ? k : -k);
  // Each pending total was within (-stats_slack, stats_slack) before this call, and moves
  // one way: only that side's bound can be passed. `|`, not `||`: one branch.
  const bool passed = allocated ? (live >= stats_slack) | (held >= stats_slack)
                                : (live <= -stats_slack) | (held <= -stats_slack);
  if (passed) {
    c.pending_live.store(0, relaxed);
    c.pending_blocks.store(0, relaxed);
    // Holding the pool mutex: into the totals it guards, with no atomic read-modify-write.
    if constexpr (locked)
      publish_locked(live, held);
    else
      publish(live, held);
    return;
  }
  c.pending_live.store(live, relaxed);
  c.pending_blocks.store(held, relaxed);
  // The peaks see this thread's pending bytes at once: exact while one thread uses the
  // pool, and no shared write unless a peak rises.
  if constexpr (allocated) {
    detail::live_totals& t = live_totals_;
    const live_and_held l = t.locked();
    raise_to(t.peak_live, t.live.load(relaxed) + l.live + static_cast<std::size_t>(live));
    raise_to(t.peak_blocks, t.blocks.load(relaxed) + l.held + static_cast<std::size_t>(held));
  }
}

namespace {
// A shared total plus what each thread cache has not published yet.
std::size_t with_pending(const std::atomic<std::size_t>& shared,
                         const std::vector<std::unique_ptr<detail::thread_cache>>& caches,
                         std::atomic<std::int64_t> detail::thread_cache::*pending) {
  std::size_t total = shared.load(std::memory_order_relaxed);
  for (const auto& c : caches)
    total += static_cast<std::size_t>(((*c).*pending).load(std::memory_order_relaxed));
  return total;
}
}  // namespace

std::size_t pool_base::live_bytes_locked() const {
  return with_pending(live_totals_.live, caches_, &detail::thread_cache::pending_live) +
         live_totals_.locked().live;
}

std::size_t pool_base::block_bytes_locked() const {
  return with_pending(live_totals_.blocks, caches_, &detail::thread_cache::pending_blocks) +
         live_totals_.locked().held;
}

void pool_base::release_to_arena_locked(detail::block* b, std::uintptr_t stream) {
  auto& s = stream_state_of(stream);
  arenas_[b->arena_id]->release(b, stream, ++s.frees);
}

void pool_base::drain_thread_caches(bool keep_small) {
  for (auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    auto give_back = [&](detail::block* b, std::uintptr_t stream) { release_to_arena_locked(b, stream); };
    if (keep_small)
      c->drain_large(give_back);
    else
      c->drain(give_back);
  }
}

void* pool_base::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  // Fast path, for a small request: a block this thread freed on this stream, of this
  // size or a little larger; no pool lock. (Large blocks are never kept: thread_cache.hpp.)
  detail::thread_cache* const c = this_thread_cache();
  if (fast_path_.load(std::memory_order_relaxed) && alignment <= arenas_[0]->unit() &&
      arena_for(bytes) == small_arena) {
    if (c != nullptr && c->keeping()) {
      std::lock_guard cache_lock(c->mutex);
      // With classes (on while the fast path is), a block serves its class alone: no near
      // fit, and the class is all the look-up needs (block_size_for's rounding, as an index).
      detail::block* b;
      if (c->classed()) {
        b = c->pop_class(stream.value, c->request_class(bytes));
      } else {
        const std::size_t size = block_size_for(bytes, c);
        b = c->pop(stream.value, size, near_fit_limit(bytes, size, *c));
      }
      c->note_request(b != nullptr);
      if (b != nullptr) {
        c->live.insert_new(b->addr, {b, bytes});
        c->allocations += 1;
        count<true>(*c, bytes, b->size);
        return reinterpret_cast<void*>(b->addr);
      }
    }
  }
  return allocate_locked(bytes, alignment, stream, c);
}

void* pool_base::allocate_locked(std::size_t bytes, std::size_t alignment, stream_handle stream,
                                 detail::thread_cache* mine_if_known) {
  std::lock_guard lock(mutex_);
  if (asleep_.load(std::memory_order_relaxed)) [[unlikely]]
    throw invalid_argument(asleep_refusal_locked("allocate"));
  if (options_.guard) {
    void* g = allocate_guarded(bytes, alignment, stream);
    if (g == nullptr) {
      stats_.oom_count += 1;
      throw out_of_memory(report_locked(bytes));
    }
    guarded_live_bytes_ += bytes;
    guarded_live_count_ += 1;
    stats_.allocations += 1;
    publish(static_cast<std::int64_t>(bytes), 0);
    notify(pool_event_kind::alloc, reinterpret_cast<std::uintptr_t>(g), bytes, stream.value);
    return g;
  }
  detail::thread_cache& mine =
      mine_if_known != nullptr ? *mine_if_known : cache_for_this_thread_locked();
  std::uint32_t id = arena_for(bytes);
  std::size_t size = block_size_for(bytes, &mine);
  detail::lifetime_hints::guess hint;
  if (hints_ != nullptr && id == large_arena) {
    hint = hints_->on_request(bytes, reserved_locked());
    if (hint.long_lived) {
      // Not rounded to whole pages: the tail shares a page with the next long-lived block.
      id = long_arena;
      long_lived_allocations_ += 1;
      size = arenas_[long_arena]->round(bytes);
    }
  }
  detail::block_arena& a = *arenas_[id];
  detail::block* b = a.allocate(size, alignment, stream.value, bytes, split_limit(size));
  if (b == nullptr) b = allocate_slow(id, size, alignment, stream, bytes);
  if (hints_ != nullptr && b->arena_id != small_arena) hints_->on_placed(hint, b);
  return hand_out_locked(mine, b, bytes, stream);
}

// Its owner holding the pool mutex: no other thread can touch `mine` (thread_cache.hpp).
[[gnu::always_inline]] inline void* pool_base::hand_out_locked(detail::thread_cache& mine,
                                                             detail::block* b, std::size_t bytes,
                                                             stream_handle stream) {
  mine.live.insert_new(b->addr, {b, bytes});
  mine.allocations += 1;
  count<true, true>(mine, bytes, b->size);
  notify(pool_event_kind::alloc, b->addr, bytes, stream.value);
  return reinterpret_cast<void*>(b->addr);
}

void* pool_base::allocate_at(void* ptr, std::size_t bytes, stream_handle stream) {
  check_stream(stream, "pool_base::allocate_at");
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (bytes == 0) throw invalid_argument("pool_base::allocate_at: 0 bytes");
  std::lock_guard lock(mutex_);
  if (asleep_.load(std::memory_order_relaxed)) [[unlikely]]
    throw invalid_argument(asleep_refusal_locked("allocate_at"));
  if (options_.guard) throw not_supported("pool_base::allocate_at: not available in guard mode");
  detail::thread_cache& mine = cache_for_this_thread_locked();
  drain_thread_caches();  // a cached block there goes back to its arena, merged
  detail::block* b = nullptr;
  for (std::uint32_t id = 0; id < arena_count && b == nullptr; ++id)
    if (arenas_[id] != nullptr) b = arenas_[id]->take_at(addr, bytes, stream.value, bytes);
  if (b == nullptr)
    throw invalid_argument("pool_base::allocate_at: " + format_bytes(bytes) + " at " +
                           hex_address(addr) + " are not free in one block of the '" +
                           std::string(name()) + "' pool (allocated, given back, or never "
                           "its memory)");
  return hand_out_locked(mine, b, bytes, stream);
}

template <bool locked>
[[gnu::always_inline]] inline detail::block* pool_base::forget_live(detail::thread_cache& c, std::uintptr_t addr,
                                      std::size_t bytes) noexcept {
  const std::size_t slot = c.live.slot_of(addr);
  if (slot == c.live.npos || c.live.value_at(slot).requested != bytes) return nullptr;
  detail::block* b = c.live.value_at(slot).b;
  c.live.erase_slot(slot);
  c.note_free(addr);
  count<false, locked>(c, bytes, b->size);
  return b;
}

// do_deallocate's paths that take the pool mutex, out of line: the cache path, inlined,
// then saves few registers (its prologue and epilogue stay short).
[[gnu::noinline]] void pool_base::free_to_arena(detail::thread_cache& c, std::uintptr_t addr,
                                                std::size_t bytes, stream_handle stream) {
  // Its owner holding the pool mutex, no other thread can touch c (thread_cache.hpp): no
  // cache lock.
  std::unique_lock lock(mutex_);
  if (detail::block* b = forget_live<true>(c, addr, bytes)) {
    if (arena_for(bytes) == small_arena) c.note_passed_free();
    release_to_arena_locked(b, stream.value);
    return;
  }
  lock.unlock();
  deallocate_locked(addr, bytes, stream);
}

[[gnu::noinline]] void pool_base::release_to_arena(detail::block* b, std::uintptr_t stream) {
  std::lock_guard lock(mutex_);
  release_to_arena_locked(b, stream);
}

void pool_base::do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  // Fast path: a pointer this thread allocated, freed with its size; no pool lock.
  // (0 is the live maps' empty key: never looked up.)
  if (fast_path_.load(std::memory_order_relaxed) && addr != 0) {
    if (detail::thread_cache* c = this_thread_cache();
        c != nullptr && c->known_stream.load(std::memory_order_relaxed) == stream.value) {
      // A large block, or a cache not keeping: the free goes to the arena anyway.
      if (arena_for(bytes) != small_arena || !c->keeping()) return free_to_arena(*c, addr, bytes, stream);
      std::unique_lock cache_lock(c->mutex);
      if (detail::block* b = forget_live<false>(*c, addr, bytes)) {
        if (c->push(b, stream.value)) return;
        c->note_passed_free();
        cache_lock.unlock();  // full: to its arena, under the pool lock
        return release_to_arena(b, stream.value);
      }
    }
  }
  deallocate_locked(addr, bytes, stream);
}

detail::block* pool_base::take_live_locked(std::uintptr_t addr, std::size_t bytes,
                                           stream_handle stream, bool scrub,
                                           std::string_view caller) {
  if (addr == 0) return nullptr;  // the live maps' empty key
  // The cache holding the record: this thread's first, then the others' (a free on another
  // thread than the allocation's).
  detail::thread_cache* mine = this_thread_cache();
  for (std::size_t i = 0; i <= caches_.size(); ++i) {
    detail::thread_cache* c = i == 0 ? mine : caches_[i - 1].get();
    if (c == nullptr || (i > 0 && c == mine)) continue;
    std::lock_guard cache_lock(c->mutex);
    const detail::live_record* r = c->live.find(addr);
    if (r == nullptr) continue;
    if (r->requested != bytes)
      throw invalid_argument(std::string(caller) + ": size mismatch for pointer " + hex_address(addr) +
                             " of the '" + std::string(name()) + "' pool: allocated " +
                             std::to_string(r->requested) + " bytes, freed as " +
                             std::to_string(bytes));
    if (scrub) {
      // Zeroed in stream order before the block is free: a later owner on this stream runs
      // after the memset, one on another stream only after an event recorded later still.
      // A failure leaves the allocation live (the caller may retry the free).
      if (auto st = device_platform().memset_async(reinterpret_cast<void*>(addr), 0,
                                                   r->b->size, stream);
          !st)
        throw_cuda_error(st, "pool: scrub a freed block");
    }
    detail::block* b = r->b;
    c->live.erase(addr);
    c->note_free(addr);
    count<false, true>(*c, bytes, b->size);
    return b;
  }
  return nullptr;
}

void pool_base::deallocate_locked(std::uintptr_t addr, std::size_t bytes, stream_handle stream) {
  std::lock_guard lock(mutex_);
  check_stream_locked(stream, "deallocate");
  if (options_.guard && free_guarded(addr, bytes, stream)) {
    recent_frees_.note(addr);
    notify(pool_event_kind::free, addr, bytes, stream.value);
    guarded_live_bytes_ -= bytes;
    guarded_live_count_ -= 1;
    stats_.deallocations += 1;
    publish(-static_cast<std::int64_t>(bytes), 0);
    return;
  }
  detail::block* b = take_live_locked(addr, bytes, stream, options_.scrub, "deallocate");
  if (b == nullptr) throw invalid_argument("deallocate: " + diagnose_locked(addr));
  bool kept = false;
  if (fast_path_.load(std::memory_order_relaxed)) {
    // This thread's next frees on this stream may take the fast path (checked above).
    cache_for_this_thread_locked().known_stream.store(stream.value, std::memory_order_relaxed);
  }
  if (fast_path_.load(std::memory_order_relaxed) && arena_for(bytes) == small_arena) {
    detail::thread_cache& c = cache_for_this_thread_locked();
    std::lock_guard cache_lock(c.mutex);
    kept = c.keeping() && c.push(b, stream.value);
    if (!kept) c.note_passed_free();
  }
  if (!kept) release_to_arena_locked(b, stream.value);
  notify(pool_event_kind::free, addr, bytes, stream.value);
  if (options_.release_threshold != std::numeric_limits<std::size_t>::max() &&
      stats_.reserved_bytes - allocated_in_arenas_locked() >
          options_.release_threshold) {
    // The free is done; giving memory back is opportunistic. A driver failure here must not
    // make the caller believe the pointer is still owned (a retry would be a double free).
    try {
      release_cached();
    } catch (const cuda_error&) {
    }
  }
}

bool pool_base::free_except(void* ptr, std::size_t bytes, stream_handle stream,
                            const std::vector<kept_range>& keep) {
  constexpr std::size_t unit = 512;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  // The ranges are checked before anything changes.
  std::uintptr_t free_from = addr;
  for (const kept_range& k : keep) {
    if (k.bytes == 0 || k.address < free_from || (k.address - addr) % unit != 0 ||
        k.address - addr > bytes || k.bytes > addr + bytes - k.address)
      throw invalid_argument("free_except: kept range " + hex_address(k.address) + " + " +
                             std::to_string(k.bytes) + " bytes is not inside " +
                             hex_address(addr) + " + " + std::to_string(bytes) +
                             " bytes, at a multiple of 512 bytes and apart from the others");
    free_from = k.address + (k.bytes + unit - 1) / unit * unit;
  }
  std::lock_guard lock(mutex_);
  if (options_.guard || options_.scrub) return false;
  check_stream_locked(stream, "free_except");
  detail::block* rest = take_live_locked(addr, bytes, stream, false, "free_except");
  if (rest == nullptr) throw invalid_argument("free_except: " + diagnose_locked(addr));
  notify(pool_event_kind::free, addr, bytes, stream.value);
  detail::block_arena& arena = *arenas_[rest->arena_id];
  arena.set_requested(rest, 0);
  detail::thread_cache& mine = cache_for_this_thread_locked();
  // `rest` is the part not yet kept or freed: each kept range is cut from its front, and
  // what lies before the range is freed. The owner holding the pool mutex needs no lock on
  // its own cache (thread_cache.hpp).
  for (const kept_range& k : keep) {
    detail::block* kept = rest;
    if (k.address > rest->addr) {
      kept = arena.split_allocated(rest, k.address);
      release_to_arena_locked(rest, stream.value);
    }
    const std::size_t size = (k.bytes + unit - 1) / unit * unit;
    rest = kept->size > size ? arena.split_allocated(kept, kept->addr + size) : nullptr;
    arena.set_requested(kept, k.bytes);
    mine.live[kept->addr] = {kept, k.bytes};
    mine.allocations += 1;
    count<true, true>(mine, k.bytes, kept->size);
    notify(pool_event_kind::alloc, kept->addr, k.bytes, stream.value);
    if (rest == nullptr) break;  // the last range ends the block (the checks above)
  }
  if (rest != nullptr) release_to_arena_locked(rest, stream.value);
  return true;
}

void pool_base::set_observer(pool_observer* observer) {
  std::lock_guard lock(mutex_);
  if (observer != nullptr && observer_ != nullptr && observer != observer_)
    throw invalid_argument("set_observer: the '" + std::string(name()) +
                           "' pool already has an observer; detach it first");
  observer_ = observer;
  // An observer must see every call: no fast path while one is attached.
  update_fast_path_locked();
  if (observer != nullptr) drain_thread_caches();
}

void pool_base::check_awake(std::string_view caller) const {
  std::lock_guard lock(mutex_);
  if (asleep_.load(std::memory_order_relaxed)) throw invalid_argument(asleep_refusal_locked(caller));
}

// A thread on the fast path read fast_path_ before the store below and takes its cache's
// mutex after: either before the drain takes it (its allocation or free is then one the
// sleep sees, as any made before it) or after (its cache is empty, the request goes to the
// pool lock and is refused; a free kept there is of a block the sleep saw allocated, so its
// pages sleep and wake as pages in use). Taking that mutex after the drain released it, the
// thread reads fast_path_ false from then on.
void pool_base::refuse_allocations_locked() {
  asleep_.store(true, std::memory_order_relaxed);
  update_fast_path_locked();
  drain_thread_caches();
}

void pool_base::allow_allocations_locked() noexcept {
  asleep_.store(false, std::memory_order_relaxed);
  update_fast_path_locked();
}

std::string pool_base::asleep_refusal_locked(std::string_view caller) const {
  return std::string(name()) + "::" + std::string(caller) +
         ": the pool is asleep; wake it before allocating";
}

const steady_pool_clock pool_base::steady_clock_;

void pool_base::set_clock(const pool_clock* clock) {
  std::lock_guard lock(mutex_);
  clock_ = clock != nullptr ? clock : &steady_clock_;
}

pool_observer* pool_base::observer() const {
  std::lock_guard lock(mutex_);
  return observer_;
}

}  // namespace gpumem
