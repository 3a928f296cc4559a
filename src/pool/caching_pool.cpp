#include "gpumem/pool/caching_pool.hpp"

#include <algorithm>
#include <sstream>

#include "gpumem/errors.hpp"
#include "backend/ownership_registry.hpp"
#include "pool/core/block_arena.hpp"

namespace gpumem {

namespace {
constexpr std::size_t small_segment = std::size_t{2} << 20;
constexpr std::size_t large_rounding = std::size_t{2} << 20;
}  // namespace

caching_pool::caching_pool(memory_resource& upstream, pool_options options,
                           std::size_t min_segment_bytes)
    : pool_base(upstream.device_platform(), upstream.device(), options, upstream.max_alignment()),
      upstream_(upstream),
      min_segment_((min_segment_bytes + large_rounding - 1) / large_rounding * large_rounding) {
  if (options.guard)
    throw invalid_argument("caching_pool: guard mode is an option of the vmm_page_pool only");
  if (options.peer_access != 0 || options.peer_access_all)
    throw invalid_argument("caching_pool: peer_access is an option of the vmm_page_pool only "
                           "(a caching_pool's segments are its backend's allocations: peers "
                           "reach them through cudaDeviceEnablePeerAccess)");
  fixed_segments_policy policy;
  // Segments are not movable: small requests use large free space (an up-front
  // reservation lives in the large arena) rather than ask upstream for more, a small miss
  // moving 2 MiB of a large free block into the small arena (a small segment's worth, as a
  // new one would be), where the small requests after it are served.
  policy.small_may_use_large_arena = true;
  policy.small_piece_bytes = std::size_t{2} << 20;
  policy.advice_when_free_is_split =
      "a caching_pool cannot join free pieces that live blocks or segment ends keep apart; "
      "the vmm_page_pool (config allocator:vmm_page_pool) maps free pages into one run instead";
  set_fixed_segments_policy(policy);
  std::size_t reserve = options.reserve_bytes;
  if (options.reserve_fraction > 0)
    reserve = static_cast<std::size_t>(options.reserve_fraction *
                                       static_cast<double>(device_total_bytes()));
  if (reserve > 0) {
    std::lock_guard lock(mutex_);
    reserve = (reserve + large_rounding - 1) / large_rounding * large_rounding;
    if (!add_segment(arena(large_arena), large_arena, reserve, {}, default_alignment))
      throw out_of_memory("gpumem: caching_pool could not reserve " + format_bytes(reserve) +
                          " up front on device " + std::to_string(device()));
  }
}

caching_pool::~caching_pool() {
  // Everything goes back upstream, live blocks too (their owner is gone).
  for (auto& [base, seg] : segments_) {
    try {
      upstream_.deallocate(reinterpret_cast<void*>(base), seg.size);
    } catch (...) {
      // Destructors never throw; a failing driver at shutdown leaks nothing we can reach.
    }
  }
}

std::size_t caching_pool::segment_count() const {
  std::lock_guard lock(mutex_);
  return segments_.size();
}

bool caching_pool::add_segment(detail::block_arena& arena, std::uint32_t arena_id,
                               std::size_t size, stream_handle stream, std::size_t alignment) {
  if (options_.limit_bytes != 0 && reserved_locked() + size > options_.limit_bytes)
    return false;
  void* p = nullptr;
  try {
    p = upstream_.allocate(size, std::max(alignment, default_alignment));
  } catch (const out_of_memory&) {
    return false;
  }
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  // The segment is the pool's now: a pointer into it freed elsewhere names the pool.
  detail::registry_add_managed(p, size, this);
  segments_.emplace(base, segment{size, arena_id});
  arena.add_region(base, size, next_segment_id_++, stream.value);
  add_reserved(size);
  notify(pool_event_kind::segment_alloc, base, size);
  return true;
}

bool caching_pool::grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                        std::size_t alignment, stream_handle stream, growth kind) {
  if (kind == growth::held_pages_only) return false;  // every growth is a new upstream segment
  // Upstream aligns the segment itself, so an aligned request fits at its start.
  const std::size_t need = arena_id == small_arena && size <= small_segment
                               ? small_segment
                               : (std::max(size, min_segment_) + large_rounding - 1) /
                                     large_rounding * large_rounding;
  // release_idle: a new peak is not set while whole segments sit idle (pool_options.hpp).
  if (options().release_idle && reserved_locked() + need > peak_reserved_locked()) {
    // Idle segments may sit in either arena's quick lists (cheap when they are empty).
    arena.flush();
    this->arena(arena_id == small_arena ? large_arena : small_arena).flush();
    release_idle_segments(reserved_locked() + need - peak_reserved_locked());
  }
  return add_segment(arena, arena_id, need, stream, alignment);
}

std::size_t caching_pool::release_cached() {
  arena(small_arena).flush();
  arena(large_arena).flush();
  std::size_t released = 0;
  for (auto seg = segments_.begin(); seg != segments_.end();) {
    if (!seg->second.retiring) {
      ++seg;
      continue;
    }
    try {
      upstream_.deallocate(reinterpret_cast<void*>(seg->first), seg->second.size);
    } catch (const cuda_error&) {
      ++seg;
      continue;  // still failing: keep it retired
    }
    notify(pool_event_kind::segment_free, seg->first, seg->second.size);
    sub_reserved(seg->second.size);
    released += seg->second.size;
    seg = segments_.erase(seg);
  }
  return released + release_idle_segments(static_cast<std::size_t>(-1));
}

std::size_t caching_pool::release_idle_segments(std::size_t bytes) {
  // Pieces of large segments that small misses moved to the small arena (move_free_piece)
  // go back to the large arena once wholly free, merging there with the rest of their
  // segment: a segment goes upstream only whole, from one arena.
  return_free_small_regions();
  struct idle {
    detail::block* b;
    std::uint32_t arena_id;
  };
  std::vector<idle> all;
  for (std::uint32_t id : {small_arena, large_arena})
    for (detail::block* b : arena(id).free_blocks())
      if (b->prev == nullptr && b->next == nullptr) all.push_back({b, id});
  if (all.empty()) return 0;
  // Work queued on a stream may still use a block of these segments: let it finish.
  synchronize_streams_with_free_blocks();
  std::stable_sort(all.begin(), all.end(),
                   [](const idle& x, const idle& y) { return x.b->size > y.b->size; });
  // One segment if one is enough: the smallest such (fewest bytes to make again later).
  auto enough = std::find_if(all.rbegin(), all.rend(), [&](const idle& i) { return i.b->size >= bytes; });
  if (enough != all.rend()) {
    std::swap(all.front(), *enough);
    all.resize(1);
  }
  std::size_t released = 0;
  for (const idle& i : all) {
    if (released >= bytes) break;
    detail::block* b = i.b;
    auto seg = segments_.find(b->addr);
    if (seg == segments_.end() || seg->second.size != b->size) continue;
    const std::size_t size = b->size;
    bool failed = false;
    try {
      upstream_.deallocate(reinterpret_cast<void*>(b->addr), size);
    } catch (const cuda_error&) {
      // Upstream may have torn it down partway (vmm: unmapped, not yet released), so its
      // memory must not be handed out again: retire it, still reserved, and retry later.
      failed = true;
    }
    arena(i.arena_id).carve(b, seg->first, size);
    if (failed) {
      seg->second.retiring = true;
      continue;
    }
    notify(pool_event_kind::segment_free, seg->first, size);
    segments_.erase(seg);
    sub_reserved(size);
    released += size;
  }
  return released;
}

std::string caching_pool::describe_holdings() const {
  std::ostringstream out;
  std::size_t small = 0, large = 0;
  for (auto& [b, s] : segments_) (s.arena_id == small_arena ? small : large) += 1;
  out << "  segments from the '" << upstream_.name() << "' resource: " << small << " small, "
      << large << " large\n";
  return out.str();
}

std::string caching_pool::validate_holdings() const {
  std::size_t total = 0;
  for (auto& [b, s] : segments_) total += s.size;
  return total == reserved_locked() ? "" : "segments do not add up to reserved";
}

}  // namespace gpumem
