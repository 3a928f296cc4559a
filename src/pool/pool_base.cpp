#include "gpumem/pool/pool_base.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <sstream>

#include "gpumem/errors.hpp"
#include "backend/ownership_registry.hpp"
#include "pool/block_arena.hpp"

namespace gpumem {

pool_base::pool_base(platform& platform, int device, pool_options options,
                     std::size_t alignment_limit)
    : memory_resource(platform, device),
      options_(options),
      alignment_limit_(alignment_limit) {
  arenas_[small_arena] = std::make_unique<detail::block_arena>();
  arenas_[large_arena] = std::make_unique<detail::block_arena>();
  streams_.try_emplace(0);  // the default stream: fresh and reserved memory is tagged with it
}

pool_base::~pool_base() {
  for (auto& [stream, s] : streams_)
    if (s.event.value != 0) (void)device_platform().event_destroy(s.event);
}

void* pool_base::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) {
  std::lock_guard lock(mutex_);
  if (options_.guard) {
    void* g = allocate_guarded(bytes, alignment, stream);
    if (g == nullptr) {
      stats_.oom_count += 1;
      throw out_of_memory(report_locked(bytes));
    }
    guarded_live_bytes_ += bytes;
    stats_.live_bytes += bytes;
    stats_.live_allocations += 1;
    stats_.allocations += 1;
    if (stats_.live_bytes > stats_.peak_live_bytes) stats_.peak_live_bytes = stats_.live_bytes;
    notify(pool_event_kind::alloc, reinterpret_cast<std::uintptr_t>(g), bytes, stream.value);
    return g;
  }
  const std::uint32_t id = bytes <= options_.small_threshold ? small_arena : large_arena;
  detail::block_arena& a = *arenas_[id];
  const std::size_t size = a.round(bytes);
  detail::block* b = a.allocate(size, alignment, stream.value, bytes);
  void* ptr = b != nullptr ? reinterpret_cast<void*>(b->addr)
                           : allocate_slow(id, size, alignment, stream, bytes);
  stats_.live_bytes += bytes;
  stats_.live_allocations += 1;
  stats_.allocations += 1;
  if (stats_.live_bytes > stats_.peak_live_bytes) stats_.peak_live_bytes = stats_.live_bytes;
  const std::size_t held = arenas_[0]->allocated_bytes() + arenas_[1]->allocated_bytes();
  if (held > peak_allocated_) peak_allocated_ = held;
  notify(pool_event_kind::alloc, reinterpret_cast<std::uintptr_t>(ptr), bytes, stream.value);
  return ptr;
}

void* pool_base::allocate_slow(std::uint32_t id, std::size_t size, std::size_t alignment,
                               stream_handle stream, std::size_t requested) {
  detail::block_arena& a = *arenas_[id];
  streams_.try_emplace(stream.value);
  a.flush();
  if (auto* b = a.allocate(size, alignment, stream.value, requested))
    return reinterpret_cast<void*>(b->addr);
  auto from_other_streams = [&](detail::block_arena& arena) {
    return streams_.size() > 1
               ? arena.allocate_from_other_streams(
                     size, alignment, stream.value, requested,
                     [&](const detail::block& blk) {
                       return free_is_complete(blk.stream, blk.free_epoch, &stream);
                     })
               : nullptr;
  };
  if (auto* b = from_other_streams(a)) return reinterpret_cast<void*>(b->addr);
  if (id == small_arena && small_may_use_large_arena()) {
    detail::block_arena& large = *arenas_[large_arena];
    large.flush();
    if (auto* b = large.allocate(size, alignment, stream.value, requested))
      return reinterpret_cast<void*>(b->addr);
    if (auto* b = from_other_streams(large)) return reinterpret_cast<void*>(b->addr);
  }
  if (grow(a, id, size, alignment, stream)) {
    if (auto* b = a.allocate(size, alignment, stream.value, requested))
      return reinterpret_cast<void*>(b->addr);
  }
  // Memory pressure: give back everything cached, then try once more.
  stats_.alloc_retries += 1;
  release_cached();
  if (grow(a, id, size, alignment, stream)) {
    if (auto* b = a.allocate(size, alignment, stream.value, requested))
      return reinterpret_cast<void*>(b->addr);
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
  if (s.event.value == 0) {
    auto ev = p.event_create(device());
    if (!ev) throw_cuda_error(ev.error(), "pool: event for cross-stream reuse");
    s.event = ev.value();
  }
  if (!s.event_pending || s.event_epoch < epoch) {
    // The event covers all work queued on the stream so far, which includes every use of
    // blocks freed up to now.
    if (auto st = p.event_record(s.event, stream_handle{freed_on}); !st)
      throw_cuda_error(st, "pool: cross-stream event record");
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

void pool_base::do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) {
  std::lock_guard lock(mutex_);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  if (options_.guard && free_guarded(addr, bytes, stream)) {
    recent_frees_[recent_next_] = addr;
    recent_next_ = (recent_next_ + 1) % recent_frees_.size();
    notify(pool_event_kind::free, addr, bytes, stream.value);
    guarded_live_bytes_ -= bytes;
    stats_.live_bytes -= bytes;
    stats_.live_allocations -= 1;
    stats_.deallocations += 1;
    return;
  }
  // The arena its size points to, else the other (small blocks may live in the large one).
  std::uint32_t id = bytes <= options_.small_threshold ? small_arena : large_arena;
  detail::block* b = arenas_[id]->find_live(addr);
  if (b == nullptr) {
    id = 1 - id;
    b = arenas_[id]->find_live(addr);
  }
  if (b == nullptr || b->requested != bytes) {
    if (b != nullptr)
      throw invalid_argument("deallocate: size mismatch for pointer " + hex_address(addr) +
                             " of the '" + std::string(name()) + "' pool: allocated " +
                             std::to_string(b->requested) + " bytes, freed as " +
                             std::to_string(bytes));
    throw invalid_argument("deallocate: " + diagnose_locked(addr));
  }
  if (options_.scrub) {
    // Zeroed in stream order before the block is free: a later owner on this stream runs
    // after the memset, one on another stream only after an event recorded later still.
    // A failure leaves the allocation live (the caller may retry the free).
    if (auto st = device_platform().memset_async(ptr, 0, b->size, stream); !st)
      throw_cuda_error(st, "pool: scrub a freed block");
  }
  recent_frees_[recent_next_] = addr;
  recent_next_ = (recent_next_ + 1) % recent_frees_.size();
  auto& s = stream_state_of(stream.value);
  arenas_[id]->release(b, stream.value, ++s.frees);
  notify(pool_event_kind::free, addr, bytes, stream.value);
  stats_.live_bytes -= bytes;
  stats_.live_allocations -= 1;
  stats_.deallocations += 1;
  if (options_.release_threshold != std::numeric_limits<std::size_t>::max() &&
      stats_.reserved_bytes - arenas_[0]->allocated_bytes() - arenas_[1]->allocated_bytes() >
          options_.release_threshold) {
    // The free is done; giving memory back is opportunistic. A driver failure here must not
    // make the caller believe the pointer is still owned (a retry would be a double free).
    try {
      release_cached();
    } catch (const cuda_error&) {
    }
  }
}

std::string pool_base::diagnose_locked(std::uintptr_t addr) const {
  const std::string pool = "the '" + std::string(name()) + "' pool (device " +
                           std::to_string(device()) + ")";
  if (addr == 0) return "null pointer passed to " + pool;
  // Error path: a scan of the live blocks is fine here.
  for (const auto& a : arenas_)
    for (const detail::block* b : a->live_blocks_list())
      if (addr > b->addr && addr < b->addr + b->size)
        return "interior pointer " + hex_address(addr) + ": it lies " +
               std::to_string(addr - b->addr) + " bytes inside the live allocation at " +
               hex_address(b->addr) + " (" + std::to_string(b->requested) + " bytes) of " + pool;
  if (std::find(recent_frees_.begin(), recent_frees_.end(), addr) != recent_frees_.end())
    return "double free: pointer " + hex_address(addr) + " was already freed to " + pool;
  return detail::registry_diagnose(reinterpret_cast<const void*>(addr), this);
}

std::string pool_base::hex_address(std::uintptr_t addr) {
  char where[32];
  std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(addr));
  return where;
}

void pool_base::release_stream(stream_handle stream) {
  std::lock_guard lock(mutex_);
  auto it = streams_.find(stream.value);
  if (it == streams_.end() || stream.value == 0) return;
  // Its blocks become the default stream's, safe at once: the stream's work is done.
  if (auto st = device_platform().stream_synchronize(stream); !st)
    throw_cuda_error(st, "pool: synchronize a stream being released");
  for (auto& a : arenas_) a->retag_free(stream.value, 0);
  if (it->second.event.value != 0) (void)device_platform().event_destroy(it->second.event);
  streams_.erase(it);
  last_stream_state_ = nullptr;
}

void pool_base::synchronize_streams_with_free_blocks() {
  for (auto& [stream, s] : streams_) {
    if (auto st = device_platform().stream_synchronize(stream_handle{stream}); !st)
      throw_cuda_error(st, "pool: synchronize before giving memory back");
    s.completed_epoch = s.frees;
  }
}

std::size_t pool_base::trim() {
  std::lock_guard lock(mutex_);
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
  resource_stats s = stats_;
  s.cached_bytes = s.reserved_bytes - arenas_[0]->allocated_bytes() - arenas_[1]->allocated_bytes();
  return s;
}

pool_base::arena_bytes pool_base::bytes_in_arena(bool small) const {
  std::lock_guard lock(mutex_);
  const auto& a = *arenas_[small ? small_arena : large_arena];
  return {a.allocated_bytes(), a.cached_bytes(), a.free_bytes()};
}

std::size_t pool_base::largest_free_block() const {
  std::lock_guard lock(mutex_);
  return std::max(arenas_[0]->largest_free_block(), arenas_[1]->largest_free_block());
}

std::vector<live_allocation> pool_base::biggest_live(std::size_t limit) const {
  std::lock_guard lock(mutex_);
  std::vector<live_allocation> all;
  for (const auto& a : arenas_)
    for (const detail::block* b : a->live_blocks_list())
      all.push_back({b->addr, b->requested, b->size, b->stream});
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
  const std::size_t allocated = arenas_[0]->allocated_bytes() + arenas_[1]->allocated_bytes();
  const std::uint32_t id = bytes <= options_.small_threshold ? small_arena : large_arena;
  r << "gpumem: out of memory on device " << device() << " (" << device_platform().kind()
    << "): the '" << name() << "' pool could not allocate " << format_bytes(bytes) << " ("
    << bytes << " bytes).\n";
  r << "  requested: " << bytes << " bytes, a block of " << arenas_[id]->round(bytes)
    << " bytes in the " << (id == small_arena ? "small" : "large") << "-request arena\n";
  auto info = device_platform().mem_info(device());
  if (info)
    r << "  device: " << format_bytes(info.value().total) << " total, "
      << format_bytes(info.value().free) << " free\n";
  r << "  live (requested): " << format_bytes(stats_.live_bytes) << " in "
    << stats_.live_allocations << " allocations (peak " << format_bytes(stats_.peak_live_bytes)
    << "); handed out as blocks: " << format_bytes(allocated) << "\n";
  r << "  reserved: " << format_bytes(stats_.reserved_bytes) << " (peak "
    << format_bytes(stats_.peak_reserved_bytes) << "); cached, not handed out: "
    << format_bytes(stats_.reserved_bytes - allocated) << "\n";
  r << "  largest free block: "
    << format_bytes(std::max(arenas_[0]->largest_free_block(), arenas_[1]->largest_free_block()))
    << " (the largest request that fits without growing)\n";
  if (options_.limit_bytes != 0) r << "  limit: " << format_bytes(options_.limit_bytes) << "\n";
  r << "  so far: " << stats_.allocations << " allocations, " << stats_.alloc_retries
    << " retried after releasing cached memory, " << stats_.oom_count << " out of memory\n";
  r << "  this pool holds " << format_bytes(stats_.reserved_bytes) << " from the driver:\n";
  r << describe_holdings();
  std::vector<live_allocation> all;
  for (const auto& a : arenas_)
    for (const detail::block* b : a->live_blocks_list())
      all.push_back({b->addr, b->requested, b->size, b->stream});
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
  return r.str();
}

std::vector<memory_segment> pool_base::segments_locked() const {
  struct chain {
    const detail::block* first;
    bool small;
  };
  std::vector<chain> chains;
  for (std::uint32_t id : {small_arena, large_arena})
    arenas_[id]->for_each_region(
        [&](const detail::block* first) { chains.push_back({first, id == small_arena}); });
  std::sort(chains.begin(), chains.end(),
            [](const chain& x, const chain& y) { return x.first->addr < y.first->addr; });
  // Segment id 0 marks memory mapped on demand (vmm_page_pool): one run of mapped pages
  // is one segment, even where its pages serve both arenas. Other ids are upstream
  // segments (caching_pool), which never merge.
  std::vector<memory_segment> out;
  for (const chain& c : chains) {
    const bool expandable = c.first->segment == 0;
    const bool joins = !out.empty() && expandable && out.back().expandable &&
                       out.back().address + out.back().size == c.first->addr;
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
          mb.st = memory_block::state::allocated;
          mb.requested = b->requested;
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

void pool_base::inspect(
    const std::function<void(const std::vector<memory_segment>&)>& fn) const {
  std::lock_guard lock(mutex_);
  fn(segments_locked());
}

std::size_t pool_base::peak_allocated_block_bytes() const {
  std::lock_guard lock(mutex_);
  return peak_allocated_;
}

void pool_base::set_observer(pool_observer* observer) {
  std::lock_guard lock(mutex_);
  if (observer != nullptr && observer_ != nullptr && observer != observer_)
    throw invalid_argument("set_observer: the '" + std::string(name()) +
                           "' pool already has an observer; detach it first");
  observer_ = observer;
}

pool_observer* pool_base::observer() const {
  std::lock_guard lock(mutex_);
  return observer_;
}

std::string pool_base::validate() const {
  std::lock_guard lock(mutex_);
  for (const auto& a : arenas_)
    if (auto why = a->validate(); !why.empty()) return why;
  const std::size_t held = arenas_[0]->allocated_bytes() + arenas_[0]->cached_bytes() +
                           arenas_[0]->free_bytes() + arenas_[1]->allocated_bytes() +
                           arenas_[1]->cached_bytes() + arenas_[1]->free_bytes();
  if (held > stats_.reserved_bytes) return "arenas hold more than is reserved";
  if (arenas_[0]->requested_bytes() + arenas_[1]->requested_bytes() + guarded_live_bytes_ !=
      stats_.live_bytes)
    return "live bytes do not match the live blocks";
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
