// pool_base's out-of-memory sequence: what a request the arenas cannot serve at once tries,
// in order, before the pool grows, gives memory back or throws out_of_memory; the moves of
// free space between arenas it makes; trim and the count of reserved bytes.
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
  // blocks stay there: left, the large arena takes them block by block and a growth
  // gathers their pages into runs of its own, so the layout the budget stopped keeps
  // costing remaps. Handed over, they become the large arena's own, merged with its free
  // neighbours. Only blocks whose last use is known complete: a region the large arena adds
  // is free at once, for any stream.
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

// One function, over 80 lines: the out-of-memory sequence reads top to bottom in the order
// pool_base.hpp states it, each step a fallback of the one before.
detail::block* pool_base::allocate_slow(std::uint32_t id, std::size_t size, std::size_t alignment,
                               stream_handle stream, std::size_t requested) {
  detail::block_arena& a = *arenas_[id];
  check_stream_locked(stream, "allocate");
  if (id == large_arena && hints_ != nullptr && !hints_->active()) hand_over_long_lived_free();
  const std::size_t max_split = split_limit(size);
  auto from_other_streams = [&](detail::block_arena& arena) {
    return streams_.states.size() > 1
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
      // anyway, at a remap each. Not the other way: short-lived blocks in the large
      // arena's holes would pin them.
      detail::block_arena& long_lived = *arenas_[long_arena];
      if (auto* b = long_lived.allocate(size, alignment, stream.value, requested, max_split)) return b;
    }
    if (id == small_arena && fixed_segments_.small_may_use_large_arena) {
      detail::block_arena& large = *arenas_[large_arena];
      large.flush();
      // A piece of the large arena's free space becomes the small arena's: the small
      // requests that follow are served there, cached in the thread caches' class lists.
      // A small block taken from the large arena itself would go back there on every small
      // miss (drain_thread_caches), each a pass under the pool lock.
      const std::size_t fits = size + (alignment > a.unit() ? alignment - a.unit() : 0);
      if (const std::size_t piece = a.round(std::max(fixed_segments_.small_piece_bytes, fits));
          fixed_segments_.small_piece_bytes != 0 && move_free_piece(large_arena, small_arena, piece, stream))
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
  // gathered from free runs). They go back before the pool makes new pages: draining them
  // before gathering too would save a page or two at the cost of every small miss.
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
  // The small arena's wholly free pieces (fixed_segments_policy) go back before a large request
  // grows the pool (the thread caches were drained above).
  if (id == large_arena && fixed_segments_.small_piece_bytes != 0 && return_free_small_regions())
    if (auto* b = find_free()) return b;
  // cross_stream:wait_before_growth: before the pool takes more memory, this stream waits on
  // the GPU for the frees of other streams whose last use may still run, and reuses their
  // blocks (FSDP's gathered parameters, freed on another stream than they were made on).
  if (options_.cross_stream == cross_stream_policy::wait_before_growth &&
      reclaim_other_streams_free(stream.value, false, true))
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

}  // namespace gpumem
