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
  // cache gives back is merged at once, so best fit sees every free byte (fragmentation on
  // the shared traces: train_llama 1.0011 -> 1.0006, infer_llama 1.0139 -> 1.0120 for
  // vmm_page_pool, lower for caching_pool too, sim). Without them (thread_cache:off, guard,
  // scrub, a release threshold) the small arena's quick lists are the fast path of
  // exact-size reuse. Large blocks are never held back unmerged, in quick lists or thread
  // caches (thread_cache.hpp says why): with quick lists for them, thread_cache:off spent
  // twice the driver time on 27 recorded workloads (sim, 2 passes: 15.0 against 7.4 s).
  const std::size_t quick_blocks = fast_path_allowed_ ? 0 : 4096;
  arenas_[small_arena] = std::make_unique<detail::block_arena>(small_arena, 512, quick_blocks);
  arenas_[large_arena] = std::make_unique<detail::block_arena>(large_arena, 512, 0);
  arenas_[long_arena] = std::make_unique<detail::block_arena>(long_arena, 512, 0);
  streams_.try_emplace(0);  // the default stream: fresh and reserved memory is tagged with it
  fast_path_.store(fast_path_allowed_, std::memory_order_relaxed);
}

void pool_base::use_lifetime_hints() { hints_ = std::make_unique<detail::lifetime_hints>(); }

void pool_base::note_long_lived_moved(std::size_t bytes) noexcept {
  if (hints_ != nullptr) hints_->note_moved(bytes);
}

bool pool_base::lifetime_hints_active_locked() const noexcept {
  return hints_ != nullptr && hints_->active();
}

bool pool_base::move_free_piece(std::uint32_t from, std::uint32_t to, std::size_t bytes,
                                stream_handle stream) {
  detail::block_arena& source = *arenas_[from];
  detail::block* best = nullptr;
  for (detail::block* b : source.free_blocks()) {  // by (stream, size, address)
    if (b->stream != stream.value || b->size < bytes || !source.serves(*b, bytes)) continue;
    best = b;
    break;
  }
  if (best == nullptr) return false;
  const std::uintptr_t addr = best->addr;  // its bottom, as a split by best fit
  const std::uint32_t segment = best->segment;
  const std::uint64_t epoch = best->free_epoch;
  source.carve(best, addr, bytes);
  arenas_[to]->add_region(addr, bytes, segment, stream.value, epoch);
  return true;
}

bool pool_base::return_free_small_regions() {
  detail::block_arena& small = *arenas_[small_arena];
  bool moved = false;
  for (detail::block* b : small.free_blocks()) {
    if (b->prev != nullptr || b->next != nullptr) continue;  // part of a region in use
    const std::uintptr_t addr = b->addr;
    const std::size_t size = b->size;
    const std::uint32_t segment = b->segment;
    const std::uintptr_t stream = b->stream;
    const std::uint64_t epoch = b->free_epoch;
    small.carve(b, addr, size);
    arenas_[large_arena]->add_region(addr, size, segment, stream, epoch);
    moved = true;
  }
  return moved;
}

void pool_base::hand_over_long_lived_free() {
  // Once the hints stopped, no block is placed in the long arena any more, but its free
  // blocks stayed there: the large arena took them block by block, and a growth gathered
  // their pages into runs of its own, so the layout the budget stopped kept costing remaps
  // (sim, 46 traces, 2 passes: 13.4 s of modelled driver time; handed over: 12.7 s, and
  // last-pass maps 49.0k -> 42.9k, geomean 1.0068 -> 1.0069). Handed over, they become the
  // large arena's own, merged with its free neighbours. Only blocks whose last use is known
  // complete: a region the large arena adds is free at once, for any stream.
  detail::block_arena& from = *arenas_[long_arena];
  detail::block_arena& to = *arenas_[large_arena];
  if (from.free_bytes() == 0 && from.cached_bytes() == 0) return;  // (every large miss asks)
  from.flush();
  for (detail::block* f : from.free_blocks()) {
    if (!free_known_complete(*f)) continue;
    const std::uintptr_t addr = f->addr;
    const std::size_t bytes = f->size;
    const std::uint32_t segment = f->segment;
    const std::uintptr_t stream = f->stream;
    from.carve(f, addr, bytes);
    to.add_region(addr, bytes, segment, stream);
    long_lived_bytes_handed_over_ += bytes;
  }
}

pool_base::~pool_base() {
  for (auto& [stream, s] : streams_)
    if (s.event.value != 0) (void)device_platform().event_destroy(s.event);
  for (event_handle e : spare_events_) (void)device_platform().event_destroy(e);
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
  // Two's complement: adding a negative delta as unsigned subtracts it.
  const auto live = live_bytes_.fetch_add(static_cast<std::size_t>(requested),
                                          std::memory_order_relaxed) +
                    static_cast<std::size_t>(requested);
  const auto held = block_bytes_.fetch_add(static_cast<std::size_t>(block),
                                           std::memory_order_relaxed) +
                    static_cast<std::size_t>(block);
  if (requested > 0) raise_to(peak_live_bytes_, live + locked_counts().live);
  if (block > 0) raise_to(peak_block_bytes_, held + locked_counts().held);
}

void pool_base::publish_locked(std::int64_t requested, std::int64_t block) noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  const std::int64_t live = locked_live_.load(relaxed) + requested;
  const std::int64_t held = locked_blocks_.load(relaxed) + block;
  locked_live_.store(live, relaxed);
  locked_blocks_.store(held, relaxed);
  if (requested > 0)
    raise_to(peak_live_bytes_, live_bytes_.load(relaxed) + static_cast<std::size_t>(live));
  if (block > 0)
    raise_to(peak_block_bytes_, block_bytes_.load(relaxed) + static_cast<std::size_t>(held));
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
    const live_and_held l = locked_counts();
    raise_to(peak_live_bytes_, live_bytes_.load(relaxed) + l.live + static_cast<std::size_t>(live));
    raise_to(peak_block_bytes_, block_bytes_.load(relaxed) + l.held + static_cast<std::size_t>(held));
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
  return with_pending(live_bytes_, caches_, &detail::thread_cache::pending_live) + locked_counts().live;
}

std::size_t pool_base::block_bytes_locked() const {
  return with_pending(block_bytes_, caches_, &detail::thread_cache::pending_blocks) + locked_counts().held;
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

inline pool_base::live_and_held pool_base::totals(const detail::thread_cache* mine) const noexcept {
  constexpr auto relaxed = std::memory_order_relaxed;
  const live_and_held l = locked_counts();
  live_and_held t{live_bytes_.load(relaxed) + l.live, block_bytes_.load(relaxed) + l.held};
  if (mine != nullptr) {
    t.live += static_cast<std::size_t>(mine->pending_live.load(relaxed));
    t.held += static_cast<std::size_t>(mine->pending_blocks.load(relaxed));
  }
  return t;
}

inline std::size_t pool_base::block_size_for(std::size_t bytes,
                                      const detail::thread_cache* mine) const noexcept {
  constexpr std::size_t unit = 512;
  const std::size_t units = (bytes + unit - 1) / unit;
  if (bytes <= options_.small_threshold) {
    if (const std::size_t n = options_.small_classes; units > n && small_classes_on()) {
      // Its class: the octave (2^(b-1), 2^b] of units cut in n equal steps. Always (no
      // allowance): a freed block then serves every later request of its class.
      // n is a power of two (the constructor checks), and units > n puts the octave at
      // log2(n) or above: the step is a power of two, rounded to with a mask (two
      // divisions before).
      const int octave = std::bit_width(units - 1) - 1;
      const std::size_t step = std::size_t{1} << (octave - std::countr_zero(n));
      return ((units + step - 1) & ~(step - 1)) * unit;
    }
  } else if (const std::size_t g = options_.round_large; g > unit) {
    // Up to whole units of g only when that loses less than half of one. The loss is
    // certain while the block lives; a tail left sharing its unit with the next block costs
    // nothing while both live, and no more than the loss would when the next one dies
    // first. So a request just over a multiple (a flat buffer and a few KiB more) keeps
    // its 512-byte units instead of taking most of a page it will never use.
    if (const std::size_t tail = bytes & (g - 1); tail > g / 2) {  // g: a power of two
      const std::size_t r = bytes - tail + g;
      const live_and_held t = totals(mine);
      const std::size_t live = t.live + bytes;
      if (t.held + r <= live + live / round_waste_share) return r;
    }
  }
  return units * unit;
}

inline std::size_t pool_base::near_fit_limit(std::size_t bytes, std::size_t size,
                                      const detail::thread_cache& mine) const noexcept {
  const live_and_held t = totals(&mine);
  const std::size_t live = t.live + bytes, held = t.held + size;
  const std::size_t allowed = live + live / round_waste_share;
  if (held >= allowed) return size;
  return size + std::min(size / near_fit_share, allowed - held);
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
  // Its owner holding the pool mutex: no other thread can touch `mine` (thread_cache.hpp).
  mine.live.insert_new(b->addr, {b, bytes});
  mine.allocations += 1;
  count<true, true>(mine, bytes, b->size);
  notify(pool_event_kind::alloc, b->addr, bytes, stream.value);
  return reinterpret_cast<void*>(b->addr);
}

detail::block* pool_base::allocate_slow(std::uint32_t id, std::size_t size, std::size_t alignment,
                               stream_handle stream, std::size_t requested) {
  detail::block_arena& a = *arenas_[id];
  check_stream_locked(stream, "allocate");
  if (id == large_arena && hints_ != nullptr && !hints_->active()) hand_over_long_lived_free();
  const std::size_t max_split = split_limit(size);
  auto from_other_streams = [&](detail::block_arena& arena) {
    return streams_.size() > 1
               ? arena.allocate_from_other_streams(
                     size, alignment, stream.value, requested,
                     [&](const detail::block& blk) {
                       return free_is_complete(blk.stream, blk.free_epoch, &stream);
                     })
               : nullptr;
  };
  // A fit among the free blocks, merged (quick lists flushed).
  auto find_free = [&]() -> detail::block* {
    a.flush();
    if (auto* b = a.allocate(size, alignment, stream.value, requested, max_split)) return b;
    if (auto* b = from_other_streams(a)) return b;
    if (id == large_arena && hints_ != nullptr) {
      // The long arena's free space before growing: growing would move its pages here
      // anyway, at a remap each (sim, 46 traces: 18.4 s of driver time against 14.4 s).
      // Not the other way: short-lived blocks in the large arena's holes would pin them.
      detail::block_arena& long_lived = *arenas_[long_arena];
      if (auto* b = long_lived.allocate(size, alignment, stream.value, requested, max_split)) return b;
    }
    if (id == small_arena && small_may_use_large_arena()) {
      detail::block_arena& large = *arenas_[large_arena];
      large.flush();
      // A piece of the large arena's free space becomes the small arena's: the small
      // requests that follow are served there, cached in the thread caches' class lists.
      // A small block taken from the large arena itself goes back there on every small
      // miss (drain_thread_caches), a third of all requests in pool_bench's mixed loop on
      // sim, at ~330 instructions each (callgrind).
      const std::size_t fits = size + (alignment > a.unit() ? alignment - a.unit() : 0);
      if (const std::size_t piece = a.round(std::max(small_piece_bytes(), fits));
          small_piece_bytes() != 0 && move_free_piece(large_arena, small_arena, piece, stream))
        if (auto* b = a.allocate(size, alignment, stream.value, requested, max_split)) return b;
      if (auto* b = large.allocate(size, alignment, stream.value, requested)) return b;
      if (auto* b = from_other_streams(large)) return b;
    }
    return nullptr;
  };
  // Before merging: what the thread caches keep freed. With small size classes, a small
  // request leaves their small blocks there (each cache keeps at most small_cache bytes of
  // them, the classes its next requests take: emptying them on every small miss would
  // leave the caches cold) and grows first from the pages the pool holds (kept unmapped or
  // gathered from free runs). They go back before the pool makes new pages. Draining them
  // before gathering too kept two more pages of infer_llama's 2 GiB (1.0044 against 1.0063)
  // but cost 13% more instructions a mixed pair (sim) and a sixth of the speed against
  // cudaMallocAsync on the H200 (docs/RESULTS.md).
  const bool keep_small = id == small_arena && small_classes_on();
  drain_thread_caches(keep_small);
  if (auto* b = find_free()) return b;
  // Other streams' free blocks whose last use is complete become this stream's, merged
  // with its free neighbours: memory freed on another stream than it was allocated on is
  // not kept apart (it would only ever serve that stream, and the pool grew instead).
  if (reclaim_other_streams_free(stream.value, false))
    if (auto* b = find_free()) return b;
  if (keep_small) {
    if (grow(a, id, size, alignment, stream, growth::held_pages_only))
      if (auto* b = a.allocate(size, alignment, stream.value, requested)) return b;
    drain_thread_caches();
    if (auto* b = find_free()) return b;
  }
  // The small arena's wholly free pieces (small_piece_bytes) go back before a large request
  // grows the pool (the thread caches were drained above).
  if (id == large_arena && small_piece_bytes() != 0 && return_free_small_regions())
    if (auto* b = find_free()) return b;
  if (grow(a, id, size, alignment, stream, growth::any)) {
    if (auto* b = a.allocate(size, alignment, stream.value, requested))
      return b;
  }
  // A large free run kept whole above (split_limit), or one the arena keeps for larger
  // requests (block_arena::restrict_segment), is split after all, before anything is
  // given back: a request never fails while free memory fits it.
  if (auto* b = a.allocate(size, alignment, stream.value, requested,
                           static_cast<std::size_t>(-1), true))
    return b;
  // Memory pressure: wait for the streams holding free blocks and make those blocks this
  // stream's (merged: whole idle segments become whole free blocks), then give back
  // everything cached, then try once more.
  stats_.alloc_retries += 1;
  drain_thread_caches();
  if (reclaim_other_streams_free(stream.value, true))
    if (auto* b = find_free()) return b;
  release_cached();
  if (grow(a, id, size, alignment, stream, growth::any)) {
    if (auto* b = a.allocate(size, alignment, stream.value, requested))
      return b;
  }
  stats_.oom_count += 1;
  if (observer_ != nullptr) {
    // As PyTorch's trace: the OOM entry carries the device's free bytes.
    auto info = device_platform().mem_info(device());
    notify(pool_event_kind::oom, info ? info.value().free : 0, requested, stream.value);
  }
  throw out_of_memory(report_locked(requested));
}

bool pool_base::free_known_complete(const detail::block& b) {
  return free_is_complete(b.stream, b.free_epoch, nullptr);
}

bool pool_base::free_is_complete(std::uintptr_t freed_on, std::uint64_t epoch,
                                 const stream_handle* wanted_by) {
  auto& s = streams_[freed_on];
  if (s.completed_epoch >= epoch) return true;
  platform& p = device_platform();
  if (s.event.value == 0 && !spare_events_.empty()) {
    s.event = spare_events_.back();
    spare_events_.pop_back();
  } else if (s.event.value == 0) {
    auto ev = p.event_create(device());
    if (!ev) throw_cuda_error(ev.error(), "pool: event for cross-stream reuse");
    s.event = ev.value();
  }
  if (!s.event_pending || s.event_epoch < epoch) {
    // The event covers all work queued on the stream so far, which includes every use of
    // blocks freed up to now.
    if (auto st = p.event_record(s.event, stream_handle{freed_on}); !st) {
      if (st.kind != failure_kind::invalid_value)
        throw_cuda_error(st, "pool: cross-stream event record");
      s.completed_epoch = s.frees;  // destroyed: its work is taken as finished (as above)
      return true;
    }
    s.event_pending = true;
    s.event_epoch = s.frees;
  }
  if (wanted_by != nullptr && options_.cross_stream == cross_stream_policy::wait) {
    if (auto st = p.stream_wait_event(*wanted_by, s.event); !st)
      throw_cuda_error(st, "pool: cross-stream wait");
    return true;  // wanted_by's later work now runs after the freed block's last use
  }
  auto done = p.event_query(s.event);
  if (!done) throw_cuda_error(done.error(), "pool: cross-stream event query");
  if (done.value()) {
    s.completed_epoch = s.event_epoch;
    s.event_pending = false;
  }
  return s.completed_epoch >= epoch;
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
// then saves few registers (callgrind, sim: ~40 instructions a pair in prologues before).
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
    recent_frees_[recent_next_] = addr;
    recent_next_ = (recent_next_ + 1) % recent_frees_.size();
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

std::string pool_base::diagnose_locked(std::uintptr_t addr) const {
  const std::string pool = "the '" + std::string(name()) + "' pool (device " +
                           std::to_string(device()) + ")";
  if (addr == 0) return "null pointer passed to " + pool;
  // Error path: a scan of the live allocations is fine here.
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    std::string inside;
    c->live.for_each([&](std::uintptr_t at, const detail::live_record& r) {
      if (inside.empty() && addr > at && addr < at + r.b->size)
        inside = "interior pointer " + hex_address(addr) + ": it lies " +
                 std::to_string(addr - at) + " bytes inside the live allocation at " +
                 hex_address(at) + " (" + std::to_string(r.requested) + " bytes) of " + pool;
    });
    if (!inside.empty()) return inside;
  }
  bool freed = std::find(recent_frees_.begin(), recent_frees_.end(), addr) != recent_frees_.end();
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    freed = freed || std::find(c->recent_frees.begin(), c->recent_frees.end(), addr) !=
                         c->recent_frees.end();
  }
  if (freed) return "double free: pointer " + hex_address(addr) + " was already freed to " + pool;
  return detail::registry_diagnose(reinterpret_cast<const void*>(addr), this);
}

std::string pool_base::hex_address(std::uintptr_t addr) {
  char where[32];
  std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(addr));
  return where;
}

void pool_base::release_stream(stream_handle stream) {
  std::lock_guard lock(mutex_);
  // Blocks freed on the stream may sit in thread caches: into the arenas first, so they
  // are re-tagged below (the stream's state is made as they go back).
  if (stream.value != 0) drain_thread_caches();
  auto it = streams_.find(stream.value);
  if (it == streams_.end() || stream.value == 0) return;
  // Its blocks become the default stream's, safe at once: the stream's work is done.
  if (auto st = device_platform().stream_synchronize(stream);
      !st && st.kind != failure_kind::invalid_value)  // invalid: already destroyed (as above)
    throw_cuda_error(st, "pool: synchronize a stream being released");
  for (auto& a : arenas_) a->retag_free(stream.value, 0);
  for (auto& a : arenas_) a->drop_empty_bins();
  if (it->second.event.value != 0) (void)device_platform().event_destroy(it->second.event);
  streams_.erase(it);
  last_stream_state_ = nullptr;
  // A later free on that handle is checked again (it may name a new stream, or none).
  for (auto& c : caches_) {
    std::uintptr_t known = stream.value;
    c->known_stream.compare_exchange_strong(known, 0, std::memory_order_relaxed);
  }
}

std::size_t pool_base::tracked_streams() const {
  std::lock_guard lock(mutex_);
  return streams_.size();
}

void pool_base::check_stream(stream_handle stream, std::string_view caller) {
  std::lock_guard lock(mutex_);
  check_stream_locked(stream, caller);
}

void pool_base::check_stream_locked(stream_handle stream, std::string_view caller) {
  if (stream.value == 0 || streams_.find(stream.value) != streams_.end()) return;
  // A query that enqueues nothing: legal while a CUDA graph is being captured on the stream.
  auto owner = device_platform().stream_device(stream);
  if (!owner) {
    if (owner.error().kind != failure_kind::invalid_value)
      throw_cuda_error(owner.error(), "pool: the device of a new stream");
    throw invalid_argument(std::string(caller) + ": stream " + hex_address(stream.value) +
                           " is not a stream the '" + std::string(name()) + "' pool (device " +
                           std::to_string(device()) + ") can use (" + owner.error().describe() +
                           "); nothing was changed");
  }
  if (owner.value() != device())
    throw invalid_argument(std::string(caller) + ": stream " + hex_address(stream.value) +
                           " belongs to device " + std::to_string(owner.value()) + ", the '" +
                           std::string(name()) + "' pool to device " + std::to_string(device()) +
                           "; nothing was changed");
  if (streams_.size() >= prune_streams_at_) prune_stream_states();
  streams_.try_emplace(stream.value);
}

bool pool_base::reclaim_other_streams_free(std::uintptr_t to, bool wait) {
  std::vector<std::uintptr_t> others;
  for (auto& a : arenas_) {
    a->flush();
    for (std::uintptr_t s : a->free_streams())
      if (s != to) others.push_back(s);
  }
  if (others.empty()) return false;
  std::sort(others.begin(), others.end());
  others.erase(std::unique(others.begin(), others.end()), others.end());
  platform& p = device_platform();
  bool moved = false;
  for (std::uintptr_t from : others) {
    auto it = streams_.find(from);
    if (it != streams_.end() && options_.cross_stream == cross_stream_policy::wait) {
      // Policy wait: `to` is made to wait on `from`'s frees instead (an event recorded on
      // `from` and waited on by `to`: legal inside a CUDA graph capture, where a query or a
      // synchronize is not). The blocks are then safe in `to`'s order only, so they take a
      // new free epoch of `to`: another stream reuses them once `to` has passed the wait.
      const stream_handle to_handle{to};
      (void)free_is_complete(from, it->second.frees, &to_handle);
      const std::uint64_t epoch = ++stream_state_of(to).frees;
      for (auto& a : arenas_) moved = a->retag_free(from, to, it->second.frees, epoch) != 0 || moved;
      continue;
    }
    std::uint64_t complete_up_to = 0;  // no state: only blocks safe at once (epoch 0)
    if (it != streams_.end()) {
      stream_state& s = it->second;
      if (wait) {
        // A stream the platform no longer knows (destroyed without release_stream) has
        // its work taken as finished, as in synchronize_streams_with_free_blocks.
        if (auto st = p.stream_synchronize(stream_handle{from});
            !st && st.kind != failure_kind::invalid_value)
          throw_cuda_error(st, "pool: synchronize a stream holding free blocks");
        s.completed_epoch = s.frees;
      } else if (s.completed_epoch < s.frees) {
        (void)free_is_complete(from, s.frees, nullptr);
      }
      complete_up_to = s.completed_epoch;
    }
    for (auto& a : arenas_) moved = a->retag_free(from, to, complete_up_to) != 0 || moved;
  }
  for (auto& a : arenas_) a->drop_empty_bins();
  if (streams_.size() >= prune_streams_at_) prune_stream_states();
  return moved;
}

void pool_base::prune_stream_states() {
  constexpr std::size_t spare_event_limit = 64;
  for (auto& a : arenas_) a->flush();
  for (auto& [from, s] : streams_) {
    if (from == 0) continue;
    if (s.completed_epoch < s.frees) {
      try {
        (void)free_is_complete(from, s.frees, nullptr);
      } catch (const cuda_error&) {
        continue;  // not known complete: its blocks stay its own
      }
    }
    for (auto& a : arenas_) a->retag_free(from, 0, s.completed_epoch);
  }
  for (auto it = streams_.begin(); it != streams_.end();) {
    bool holds = it->first == 0;  // the default stream's state stays
    for (auto& a : arenas_) holds = holds || a->holds_stream(it->first);
    if (holds) {
      ++it;
      continue;
    }
    // Blocks of this stream still in thread caches get a fresh state when they come back:
    // their epochs then start again, and an event recorded after that covers their use.
    if (it->second.event.value != 0) {
      if (spare_events_.size() < spare_event_limit)
        spare_events_.push_back(it->second.event);
      else
        (void)device_platform().event_destroy(it->second.event);
    }
    it = streams_.erase(it);
  }
  last_stream_state_ = nullptr;
  for (auto& a : arenas_) a->drop_empty_bins();
  prune_streams_at_ = std::max<std::size_t>(64, 2 * streams_.size());
}

void pool_base::synchronize_streams_with_free_blocks() {
  for (auto& [stream, s] : streams_) {
    // A stream the platform no longer knows was destroyed: its work is taken as finished
    // (see the header: destroy a stream after its work, or release_stream it first).
    if (auto st = device_platform().stream_synchronize(stream_handle{stream});
        !st && st.kind != failure_kind::invalid_value)
      throw_cuda_error(st, "pool: synchronize before giving memory back");
    s.completed_epoch = s.frees;
  }
}

std::size_t pool_base::trim() {
  std::lock_guard lock(mutex_);
  drain_thread_caches();
  return release_cached();
}

void pool_base::add_reserved(std::size_t bytes) {
  stats_.reserved_bytes += bytes;
  if (stats_.reserved_bytes > stats_.peak_reserved_bytes)
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

void pool_base::sub_reserved(std::size_t bytes) { stats_.reserved_bytes -= bytes; }

resource_stats pool_base::stats() const {
  std::lock_guard lock(mutex_);
  resource_stats s = stats_;  // reserved, retries, OOMs; guarded allocation counts
  s.live_allocations = guarded_live_count_;
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    s.allocations += c->allocations;
    s.deallocations += c->deallocations;
    s.live_allocations += c->live.size();
  }
  s.live_bytes = live_bytes_locked();
  s.peak_live_bytes = std::max(peak_live_bytes_.load(std::memory_order_relaxed), s.live_bytes);
  const std::size_t handed_out = block_bytes_locked();
  s.cached_bytes = s.reserved_bytes > handed_out ? s.reserved_bytes - handed_out : 0;
  return s;
}

pool_base::arena_bytes pool_base::bytes_in_arena(bool small) const {
  std::lock_guard lock(mutex_);
  const std::uint32_t id = small ? small_arena : large_arena;
  // Blocks in thread caches are allocated in the arena but cached for the user.
  std::size_t in_caches = 0;
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    in_caches += c->free_bytes[id];
  }
  arena_bytes r;
  auto add = [&](const detail::block_arena& a) {
    r.allocated += a.allocated_bytes();
    r.cached += a.cached_bytes();
    r.free += a.free_bytes();
  };
  add(*arenas_[id]);
  if (!small) add(*arenas_[long_arena]);  // long-lived large blocks are large ones too
  r.allocated -= in_caches;
  r.cached += in_caches;
  return r;
}

std::size_t pool_base::allocated_in_arenas_locked() const {
  std::size_t n = 0;
  for (const auto& a : arenas_) n += a->allocated_bytes();
  return n;
}

std::size_t pool_base::largest_free_locked() const {
  std::size_t n = 0;
  for (const auto& a : arenas_) n = std::max(n, a->largest_free_block());
  return n;
}

std::size_t pool_base::largest_free_block() const {
  std::lock_guard lock(mutex_);
  return largest_free_locked();
}

std::vector<live_allocation> pool_base::biggest_live(std::size_t limit) const {
  std::lock_guard lock(mutex_);
  std::vector<live_allocation> all = live_list_locked();
  std::sort(all.begin(), all.end(),
            [](const auto& x, const auto& y) { return x.requested > y.requested; });
  if (all.size() > limit) all.resize(limit);
  return all;
}

std::string pool_base::memory_report(std::size_t bytes) const {
  std::lock_guard lock(mutex_);
  return report_locked(bytes);
}

std::string pool_base::report_locked(std::size_t bytes) const {
  std::ostringstream r;
  const std::size_t allocated = block_bytes_locked();
  const std::size_t live_bytes = live_bytes_locked();
  const std::size_t peak_live = std::max(peak_live_bytes_.load(std::memory_order_relaxed), live_bytes);
  const std::vector<live_allocation> live = live_list_locked();
  const std::uint32_t id = arena_for(bytes);
  r << "gpumem: out of memory on device " << device() << " (" << device_platform().kind()
    << "): the '" << name() << "' pool could not allocate " << format_bytes(bytes) << " ("
    << bytes << " bytes).\n";
  r << "  requested: " << bytes << " bytes, a block of " << block_size_for(bytes, nullptr)
    << " bytes in the " << (id == small_arena ? "small" : "large") << "-request arena\n";
  auto info = device_platform().mem_info(device());
  if (info)
    r << "  device: " << format_bytes(info.value().total) << " total, "
      << format_bytes(info.value().free) << " free\n";
  r << "  live (requested): " << format_bytes(live_bytes) << " in "
    << live.size() + guarded_live_count_
    << " allocations (peak " << format_bytes(peak_live)
    << "); handed out as blocks: " << format_bytes(allocated) << "\n";
  r << "  reserved: " << format_bytes(stats_.reserved_bytes) << " (peak "
    << format_bytes(stats_.peak_reserved_bytes) << "); cached, not handed out: "
    << format_bytes(stats_.reserved_bytes - allocated) << "\n";
  r << "  largest free block: "
    << format_bytes(largest_free_locked())
    << " (the largest request that fits without growing)\n";
  if (options_.limit_bytes != 0) r << "  limit: " << format_bytes(options_.limit_bytes) << "\n";
  std::uint64_t allocations = stats_.allocations;
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    allocations += c->allocations;
  }
  r << "  so far: " << allocations << " allocations, " << stats_.alloc_retries
    << " retried after releasing cached memory, " << stats_.oom_count << " out of memory\n";
  r << "  this pool holds " << format_bytes(stats_.reserved_bytes) << " from the driver:\n";
  r << describe_holdings();
  std::vector<live_allocation> all = live;
  std::sort(all.begin(), all.end(), [](const auto& x, const auto& y) {
    return x.requested != y.requested ? x.requested > y.requested : x.address < y.address;
  });
  constexpr std::size_t shown = 5;
  if (!all.empty())
    r << "  biggest live allocations (" << std::min(shown, all.size()) << " of " << all.size()
      << "):\n";
  for (std::size_t i = 0; i < all.size() && i < shown; ++i) {
    r << "    " << format_bytes(all[i].requested) << " at " << hex_address(all[i].address)
      << " (stream " << all[i].stream << ")\n";
    // Where it came from: the observer (event recorder with context) knows, if on.
    if (observer_ != nullptr) {
      std::string from;
      try {
        from = observer_->describe_allocation(all[i].address);
      } catch (...) {
        // The report must come out even if describing one allocation fails.
      }
      if (!from.empty()) r << "      allocated at: " << from << "\n";
    }
  }
  // What "reserved but not allocated" is made of (pool/core/overhead.hpp), and what to do when
  // it is free bytes in pieces, none large enough.
  const overhead_breakdown o = overhead_locked();
  r << "  where the reserved bytes go now:\n" << o.to_string("    ");
  const std::size_t free_bytes = o.cached + o.free_pinned + o.free_releasable;
  if (const std::string advice = advice_when_free_is_split();
      free_bytes >= bytes && !advice.empty())
    r << "  " << format_bytes(free_bytes) << " of it is free, enough for the request, but in "
      << "pieces: " << advice << "\n";
  return r.str();
}

std::vector<live_allocation> pool_base::live_list_locked() const {
  std::vector<live_allocation> out;
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    c->live.for_each([&](std::uintptr_t addr, const detail::live_record& r) {
      out.push_back({addr, r.requested, r.b->size, r.b->stream});
    });
  }
  return out;
}

std::vector<memory_segment> pool_base::segments_locked() const {
  // An arena's allocated block is live when a thread cache records it, else it sits freed
  // in a thread cache (cached, for the user).
  std::unordered_map<std::uintptr_t, std::size_t> requested;
  for (const live_allocation& l : live_list_locked()) requested[l.address] = l.requested;
  struct chain {
    const detail::block* first;
    bool small;
  };
  std::vector<chain> chains;
  for (std::uint32_t id : {small_arena, large_arena, long_arena})
    arenas_[id]->for_each_region(
        [&](const detail::block* first) { chains.push_back({first, id == small_arena}); });
  std::sort(chains.begin(), chains.end(),
            [](const chain& x, const chain& y) { return x.first->addr < y.first->addr; });
  // Segment ids 0 and whole_chunk_segment mark memory mapped on demand (vmm_page_pool):
  // one run of mapped pages is one segment, even where its pages serve both arenas. Other
  // ids are upstream segments (caching_pool), which never merge with each other; one whose
  // pieces serve both arenas (move_free_piece) is one segment again here.
  std::vector<memory_segment> out;
  std::uint32_t last_segment = 0;
  for (const chain& c : chains) {
    const bool expandable =
        c.first->segment == 0 || c.first->segment == detail::whole_chunk_segment;
    const bool adjacent = !out.empty() && out.back().address + out.back().size == c.first->addr;
    const bool joins = adjacent && (expandable ? out.back().expandable
                                               : !out.back().expandable && last_segment == c.first->segment);
    last_segment = c.first->segment;
    if (!joins) {
      out.push_back({});
      out.back().address = c.first->addr;
      out.back().expandable = expandable;
      out.back().small = true;
    }
    memory_segment& seg = out.back();
    seg.small = seg.small && c.small;
    for (const detail::block* b = c.first; b != nullptr; b = b->next) {
      memory_block mb;
      mb.address = b->addr;
      mb.size = b->size;
      mb.stream = b->stream;
      switch (b->st) {
        case detail::block::state::allocated:
          if (auto it = requested.find(b->addr); it != requested.end()) {
            mb.st = memory_block::state::allocated;
            mb.requested = it->second;
          } else {
            mb.st = memory_block::state::cached;
          }
          break;
        case detail::block::state::cached:
          mb.st = memory_block::state::cached;
          break;
        default:
          mb.st = memory_block::state::free;
          break;
      }
      seg.blocks.push_back(mb);
      seg.size += b->size;
    }
  }
  return out;
}

std::vector<memory_segment> pool_base::memory_segments() const {
  std::lock_guard lock(mutex_);
  return segments_locked();
}

overhead_breakdown pool_base::overhead() const {
  std::lock_guard lock(mutex_);
  return overhead_locked();
}

overhead_breakdown pool_base::overhead_locked() const {
  const page_holdings pages = page_holdings_locked();
  return detail::breakdown_of(std::string(name()), stats_.reserved_bytes, live_bytes_locked(),
                              pages.page_size, pages.kept_unmapped, segments_locked());
}

void pool_base::inspect(
    const std::function<void(const std::vector<memory_segment>&)>& fn) const {
  std::lock_guard lock(mutex_);
  fn(segments_locked());
}

std::size_t pool_base::peak_allocated_block_bytes() const {
  std::lock_guard lock(mutex_);
  return std::max(peak_block_bytes_.load(std::memory_order_relaxed), block_bytes_locked());
}

void pool_base::set_observer(pool_observer* observer) {
  std::lock_guard lock(mutex_);
  if (observer != nullptr && observer_ != nullptr && observer != observer_)
    throw invalid_argument("set_observer: the '" + std::string(name()) +
                           "' pool already has an observer; detach it first");
  observer_ = observer;
  // An observer must see every call: no fast path while one is attached.
  fast_path_.store(fast_path_allowed_ && observer == nullptr, std::memory_order_relaxed);
  if (observer != nullptr) drain_thread_caches();
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

std::string pool_base::validate() const {
  std::lock_guard lock(mutex_);
  for (const auto& a : arenas_)
    if (auto why = a->validate(); !why.empty()) return why;
  std::size_t held = 0;
  for (const auto& a : arenas_) held += a->allocated_bytes() + a->cached_bytes() + a->free_bytes();
  if (held > stats_.reserved_bytes) return "arenas hold more than is reserved";
  // Each allocated arena block is either live (recorded in one thread cache) or freed into
  // one thread cache, never both and never twice.
  std::size_t live_requested = 0, live_blocks = 0, cached_in_threads = 0, records = 0;
  std::unordered_map<const detail::block*, int> seen;
  for (const auto& c : caches_) {
    std::lock_guard cache_lock(c->mutex);
    c->live.for_each([&](std::uintptr_t addr, const detail::live_record& r) {
      live_requested += r.requested;
      live_blocks += r.b->size;
      records += (r.b->addr == addr && r.b->st == detail::block::state::allocated) ? 1 : 0;
      seen[r.b] += 1;
    });
    std::size_t count = 0, bytes[2] = {0, 0};
    c->for_each_free([&](const detail::block* b, std::uintptr_t) {
      count += 1;
      bytes[b->arena_id] += b->size;
      cached_in_threads += b->size;
      records += b->st == detail::block::state::allocated ? 1 : 0;
      seen[b] += 1;
    });
    if (count != c->free_blocks || bytes[0] != c->free_bytes[0] || bytes[1] != c->free_bytes[1])
      return "a thread cache's counts do not match its freed blocks";
  }
  if (records != seen.size()) return "a thread cache names a block that is not allocated";
  for (const auto& [b, n] : seen)
    if (n != 1) return "a block is in thread caches more than once";
  if (live_requested + guarded_live_bytes_ != live_bytes_locked())
    return "live bytes do not match the live allocations";
  if (live_blocks != block_bytes_locked())
    return "handed-out bytes do not match the live blocks";
  if (live_blocks + cached_in_threads != allocated_in_arenas_locked())
    return "arenas' allocated blocks are neither live nor in a thread cache";
  std::size_t in_segments = 0;
  for (const memory_segment& seg : segments_locked()) {
    std::uintptr_t at = seg.address;
    for (const memory_block& b : seg.blocks) {
      if (b.address != at) return "a segment's blocks do not lie back to back";
      at += b.size;
    }
    in_segments += seg.size;
  }
  if (in_segments != held) return "segments do not add up to what the arenas hold";
  return validate_holdings();
}

}  // namespace gpumem
