// pool_base's read side: stats, the out-of-memory report, segments and overhead for
// snapshots, the diagnosis of a bad free, and validate().
#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/core/segment_lookup.hpp"

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
  bool freed = recent_frees_.contains(addr);
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
  s.peak_live_bytes = std::max(live_totals_.peak_live.load(std::memory_order_relaxed), s.live_bytes);
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
  const std::size_t peak_live = std::max(live_totals_.peak_live.load(std::memory_order_relaxed), live_bytes);
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
  if (const std::string_view advice = fixed_segments_.advice_when_free_is_split;
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

bool is_allocated_block(const std::vector<memory_segment>& segments, std::uintptr_t address) {
  auto seg = std::upper_bound(segments.begin(), segments.end(), address,
                              [](std::uintptr_t a, const memory_segment& s) { return a < s.address; });
  if (seg == segments.begin()) return false;
  --seg;
  if (address >= seg->address + seg->size) return false;
  auto b = std::lower_bound(seg->blocks.begin(), seg->blocks.end(), address,
                            [](const memory_block& x, std::uintptr_t a) { return x.address < a; });
  return b != seg->blocks.end() && b->address == address && b->st == memory_block::state::allocated;
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
                              pages.page_size, pages.kept_unmapped, segments_locked(),
                              pages.multi_page_handles);
}

void pool_base::inspect(
    const std::function<void(const std::vector<memory_segment>&)>& fn) const {
  std::lock_guard lock(mutex_);
  fn(segments_locked());
}

std::size_t pool_base::peak_allocated_block_bytes() const {
  std::lock_guard lock(mutex_);
  return std::max(live_totals_.peak_blocks.load(std::memory_order_relaxed), block_bytes_locked());
}

std::string pool_base::validate() const {
  std::lock_guard lock(mutex_);
  for (const auto& a : arenas_)
    if (auto why = a->validate(); !why.empty()) return why;
  std::size_t held = 0;
  for (const auto& a : arenas_) held += a->allocated_bytes() + a->cached_bytes() + a->free_bytes();
  if (held > stats_.reserved_bytes + asleep_bytes_locked()) return "arenas hold more than is reserved";
  if (asleep_.load(std::memory_order_relaxed) && fast_path_.load(std::memory_order_relaxed))
    return "the thread caches' fast path is on while the pool sleeps";
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
