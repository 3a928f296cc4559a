#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>
#include <cmath>
#include <span>
#include <sstream>

#include "gpumem/errors.hpp"
#include "backend/ownership_registry.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/vmm/sleep_state.hpp"
#include "pool/vmm/vmm_worker.hpp"

namespace gpumem {

vmm_page_pool::vmm_page_pool(platform& platform, int device, pool_options options)
    : pool_base(platform, device, options, 0) {
  auto props = platform.properties(device);
  if (!props) throw_cuda_error(props.error(), "vmm_page_pool: device properties");
  if (!props.value().vmm_supported)
    throw cuda_error("cuDeviceGetAttribute", 801, "CUDA_ERROR_NOT_SUPPORTED",
                     "device does not support virtual memory management", "vmm_page_pool");
  auto g = platform.granularity(device);
  if (!g) throw_cuda_error(g.error(), "vmm_page_pool: granularity");
  page_ = std::max(g.value().recommended, g.value().minimum);
  set_alignment_limit(page_);
  // Large blocks own whole pages unless configured otherwise (pool_options::round_large).
  if (options_.round_large == 0) options_.round_large = page_;
  counts_.page_size = page_;
  std::size_t va = options.va_reserve_bytes != 0 ? options.va_reserve_bytes
                                                 : 2 * device_total_bytes();
  va = (va + page_ - 1) / page_ * page_;
  auto range = platform.reserve_range(va, page_);
  if (!range) throw_cuda_error(range.error(), "vmm_page_pool: reserve the virtual range");
  va_base_ = range.value();
  va_pages_ = va / page_;
  page_table_.assign(va_pages_, no_chunk);
  detail::registry_add_managed(reinterpret_cast<void*>(va_base_), va, this);
  va_free_.emplace(0, va_pages_);
  // The map worker pays off where driver calls cost time: on a GPU (see vmm_worker.hpp).
  const bool worker = options_.map_worker == map_worker_mode::on ||
                      (options_.map_worker == map_worker_mode::automatic && platform.kind() == "cuda");
  if (worker && !options_.guard) worker_ = std::make_unique<detail::vmm_worker>(platform);
  // A huge growth's multi-page handles serve only requests that cover one: a smaller block
  // placed in one would pin its other pages where no gather can move them (ckpt_train_seed2
  // drifted to 1.10 over 8 passes). Smaller requests take other free memory, or a growth
  // that reclaims those handles (spare, then released and made again as one-page handles).
  if (huge_chunk_pages() > 1)
    for (std::uint32_t id : {large_arena, long_arena})
      arena(id).restrict_segment(detail::whole_chunk_segment, huge_chunk_pages() * page_);
  // Lifetime hints move pages between runs: not with a reservation (its promise: no driver
  // call within it) nor in guard mode (no arenas).
  if (options_.lifetime_hints && !options_.guard && options.reserve_bytes == 0 &&
      options.reserve_fraction <= 0)
    use_lifetime_hints();

  std::size_t reserve = options.reserve_bytes;
  if (options.reserve_fraction > 0)
    reserve = static_cast<std::size_t>(options.reserve_fraction *
                                       static_cast<double>(device_total_bytes()));
  if (reserve > 0) {
    // A constructor that throws runs no destructor: give back what was taken here, as the
    // destructor does (mappings an undo could not remove, then handles, then the range).
    // The error being thrown is the reservation's; a call failing here is tried once more
    // (a failed call changes nothing), so one more transient failure strands nothing.
    auto give_back = [&] {
      auto retried = [](auto&& call) {
        if (!call()) (void)call();
      };
      for (const chunk& c : chunks_) {
        if (!c.live) continue;
        if (c.mapped_at != no_page)
          retried([&] { return platform.unmap(page_address(c.mapped_at), c.pages * page_); });
        retried([&] { return platform.release_physical(c.handle); });
      }
      retried([&] { return platform.free_range(va_base_, va_pages_ * page_); });
      detail::registry_remove(reinterpret_cast<void*>(va_base_));
    };
    std::lock_guard lock(mutex_);
    bool made = false;
    try {
      made = create_chunks((reserve + page_ - 1) / page_, handle_sizes::reservation);
    } catch (...) {
      give_back();  // a driver failure: create_chunks kept only handles it could not release
      throw;
    }
    if (!made) {
      give_back();
      throw out_of_memory("gpumem: vmm_page_pool could not reserve " + format_bytes(reserve) +
                          " up front on device " + std::to_string(device));
    }
    // Mapped up front too, as one free run of the large arena with one access grant: the
    // reserved memory then serves requests with no driver call (mapping it on demand costs
    // ~26 us a page of access grant on the H200, one-page handle by handle). Small requests
    // take their pages from it as from any free run. (Guard mode maps per allocation.)
    if (!options_.guard) {
      bool mapped = false;
      try {
        mapped = grow(arena(large_arena), large_arena, (reserve + page_ - 1) / page_ * page_,
                      arena(large_arena).unit(), stream_handle{}, growth::any);
      } catch (...) {
        give_back();  // grow unmapped what it had mapped
        throw;
      }
      if (!mapped) {
        give_back();
        throw out_of_memory("gpumem: vmm_page_pool could not map the " + format_bytes(reserve) +
                            " reserved up front on device " + std::to_string(device));
      }
    }
  }
}

vmm_page_pool::~vmm_page_pool() {
  // Never throws: unmap every page, release every handle, free the range, ignoring a
  // driver that is already shutting down.
  platform& p = device_platform();
  stop_worker();  // its queued unmaps done; what is left is unmapped here
  forget_sleeping_chunks();  // their memory is the driver's already
  for (auto& r : retiring_) {
    (void)p.stream_synchronize(stream_handle{r.stream});
    std::size_t at = r.first_page;
    for (auto& [id, pages] : r.chunks) {
      (void)p.unmap(page_address(at), pages * page_);
      at += pages;
    }
  }
  for (auto& c : chunks_) {
    if (!c.live) continue;
    if (c.mapped_at != no_page) (void)p.unmap(page_address(c.mapped_at), c.pages * page_);
    (void)p.release_physical(c.handle);
  }
  (void)p.free_range(va_base_, va_pages_ * page_);
  detail::registry_remove(reinterpret_cast<void*>(va_base_));
}

vmm_page_counts vmm_page_pool::page_counts() const {
  std::lock_guard lock(mutex_);
  vmm_page_counts c = counts_;
  c.growth_slack = slack_now();
  c.long_lived_allocations = long_lived_allocations_locked();
  c.lifetime_hints_active = lifetime_hints_active_locked();
  c.long_lived_bytes_handed_over = long_lived_bytes_handed_over_locked();
  c.spare_pages = spare_pages();
  c.mapped_pages = 0;
  c.handles = 0;
  for (auto& ch : chunks_) {
    if (!ch.live) continue;
    c.mapped_pages += ch.mapped_at != no_page ? ch.pages : 0;
    c.handles += 1;
  }
  return c;
}

pool_base::page_holdings vmm_page_pool::page_holdings_locked() const {
  return {page_, spare_pages() * page_};
}

std::size_t vmm_page_pool::spare_pages() const {
  std::size_t n = 0;
  for (std::uint32_t id : spare_) n += chunks_[id].pages;
  return n;
}

std::size_t vmm_page_pool::spare_single_pages() const {
  return static_cast<std::size_t>(std::count_if(spare_.begin(), spare_.end(), [&](std::uint32_t id) {
    return chunks_[id].pages == 1 && chunks_[id].retiring == 0;
  }));
}

std::size_t vmm_page_pool::spare_pages_for(std::uintptr_t stream) const {
  std::size_t n = 0;
  for (std::uint32_t id : spare_) n += mappable_for(id, stream) ? chunks_[id].pages : 0;
  return n;
}

void vmm_page_pool::release_stream(stream_handle stream) {
  {
    std::lock_guard lock(mutex_);
    retire_completed(true, &stream.value);
  }
  pool_base::release_stream(stream);
}

void vmm_page_pool::retire_completed(bool wait, const std::uintptr_t* only_stream) {
  platform& p = device_platform();
  collect_worker();
  for (auto it = retiring_.begin(); it != retiring_.end();) {
    retiring_run& r = *it;
    if (r.queued || (only_stream != nullptr && r.stream != *only_stream)) {
      ++it;
      continue;
    }
    if (r.work_pending) {
      if (wait) {
        if (auto st = p.stream_synchronize(stream_handle{r.stream}); !st)
          throw_cuda_error(st, "vmm_page_pool: wait for a stream before unmapping");
      } else if (!free_known_complete(r.stream, r.epoch)) {
        ++it;
        continue;
      }
      r.work_pending = false;  // its chunks may now be mapped for any stream
      for (auto& [id, pages] : r.chunks) chunks_[id].waiting -= 1;
    }
    // A growth under way: the worker gets the run once the growth has mapped and granted.
    if (hold_unmaps_ && !wait && !r.worker_failed) {
      ++it;
      continue;
    }
    if (queue_unmap(r)) {
      ++it;
      continue;
    }
    // One call over the run where the driver allows, else one per chunk from the top (a
    // failure keeps what is still mapped in the run).
    status failed;
    bool done = false;
    if (r.chunks.size() > 1 && batched_unmap_) {
      status st = p.unmap(page_address(r.first_page), r.pages * page_);
      if (st) done = true;
      else if (st.kind == failure_kind::invalid_value || st.kind == failure_kind::not_supported)
        batched_unmap_ = false;
      else
        failed = st;
    }
    while (!done && failed.ok() && !r.chunks.empty()) {
      const std::size_t pages = r.chunks.back().second;
      if (auto st = p.unmap(page_address(r.first_page + r.pages - pages), pages * page_); !st) {
        failed = st;
        break;
      }
      drop_top_chunk(r);
    }
    if (!failed.ok()) {
      // The run stays mapped (what was unmapped is recorded above) and out of use. A caller
      // that needs it gone hears of it; an opportunistic pass leaves it for the next one.
      counts_.unmap_failures += 1;
      if (wait) throw_cuda_error(failed, "vmm_page_pool: unmap the old mapping of remapped pages");
      ++it;
      continue;
    }
    if (done) {
      for (std::size_t q = r.first_page; q < r.first_page + r.pages; ++q) page_table_[q] = no_chunk;
      va_insert(r.first_page, r.pages);
      for (auto& [id, pages] : r.chunks) chunks_[id].retiring -= 1;
    }
    it = retiring_.erase(it);
  }
  if (wait && worker_ != nullptr) {
    worker_->drain();
    collect_worker();
    // What the worker failed is the caller's now: one more pass unmaps it here.
    if (std::any_of(retiring_.begin(), retiring_.end(), [&](const retiring_run& r) {
          return r.worker_failed && (only_stream == nullptr || r.stream == *only_stream);
        }))
      retire_completed(true, only_stream);
  }
}

void vmm_page_pool::drop_top_chunk(retiring_run& r) {
  const auto [id, pages] = r.chunks.back();
  const std::size_t at = r.first_page + r.pages - pages;
  for (std::size_t q = at; q < at + pages; ++q) page_table_[q] = no_chunk;
  va_insert(at, pages);
  chunks_[id].retiring -= 1;
  r.chunks.pop_back();
  r.pages -= pages;
}

bool vmm_page_pool::queue_unmap(retiring_run& r) {
  if (worker_ == nullptr || r.worker_failed) return false;
  r.token = ++next_token_;
  r.queued = true;
  std::vector<std::size_t> pieces;  // one unmap per mapping (vmm_worker.hpp)
  pieces.reserve(r.chunks.size());
  for (const auto& [id, pages] : r.chunks) pieces.push_back(pages * page_);
  worker_->unmap(page_address(r.first_page), std::move(pieces), r.token);
  return true;
}

void vmm_page_pool::queue_held_unmaps() {
  for (retiring_run& r : retiring_)
    if (!r.queued && !r.work_pending && !r.worker_failed) (void)queue_unmap(r);
}

void vmm_page_pool::collect_worker() {
  if (worker_ == nullptr) return;
  std::vector<detail::vmm_worker::finished_unmap> finished;
  worker_->collect(finished);
  for (auto& f : finished) {
    auto it = std::find_if(retiring_.begin(), retiring_.end(),
                           [&](const retiring_run& r) { return r.queued && r.token == f.token; });
    if (it == retiring_.end()) continue;
    retiring_run& r = *it;
    if (!f.result) {
      // The top mappings the worker did unmap give their address space back; the rest is
      // still mapped: retire_completed unmaps it again, on the caller's thread. Not thrown
      // here: this call (an allocation, say) may well succeed without that address space.
      while (!r.chunks.empty() && r.pages * page_ > f.mapped_bytes) drop_top_chunk(r);
      r.queued = false;
      r.worker_failed = true;
      counts_.unmap_failures += 1;
      continue;
    }
    for (std::size_t q = r.first_page; q < r.first_page + r.pages; ++q) page_table_[q] = no_chunk;
    va_insert(r.first_page, r.pages);
    for (auto& [id, pages] : r.chunks) chunks_[id].retiring -= 1;
    retiring_.erase(it);
  }
}

void vmm_page_pool::stop_worker() noexcept {
  if (worker_ == nullptr) return;
  worker_->drain();
  try {
    collect_worker();
  } catch (...) {
    // A failed unmap's run is kept (not queued): the caller's thread unmaps it from now on.
  }
  worker_.reset();
}

std::vector<physical_handle> vmm_page_pool::lend_pages(std::size_t pages) {
  std::unique_lock lock(mutex_);
  std::vector<physical_handle> out;
  if (pages == 0) return out;
  out.reserve(pages);
  lent_.reserve(lent_.size() + pages);
  retire_completed(false);
  std::size_t have = spare_single_pages();
  if (have < pages) {
    drain_thread_caches();  // freed blocks held by threads may cover whole pages
    reclaim(pages - have, false);
    if (worker_ != nullptr) {  // reclaimed pages are lent only once their old mapping is gone
      worker_->drain();
      collect_worker();
    }
    have = spare_single_pages();
  }
  if (have < pages && !create_chunks(pages - have, handle_sizes::one_page)) {
    // Memory pressure: what other streams freed may be reclaimed once they finish.
    reclaim(pages - have, true);
    retire_completed(true);
    have = spare_single_pages();
    if (have < pages && !create_chunks(pages - have, handle_sizes::one_page)) {
      lock.unlock();
      throw out_of_memory(memory_report(pages * page_));
    }
  }
  for (auto it = spare_.begin(); it != spare_.end() && out.size() < pages;) {
    chunk& c = chunks_[*it];
    if (c.pages != 1 || c.retiring != 0) {
      ++it;
      continue;
    }
    c.lent = true;
    lent_.emplace(c.handle.value, *it);
    out.push_back(c.handle);
    it = spare_.erase(it);
  }
  counts_.lent_pages += out.size();
  return out;
}

void vmm_page_pool::return_pages(std::span<const physical_handle> handles) {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < handles.size(); ++i) {
    if (!lent_.contains(handles[i].value))
      throw invalid_argument("vmm_page_pool::return_pages: physical handle " +
                             std::to_string(handles[i].value) + " is not lent by this pool");
    for (std::size_t j = 0; j < i; ++j)
      if (handles[j] == handles[i])
        throw invalid_argument("vmm_page_pool::return_pages: physical handle " +
                               std::to_string(handles[i].value) + " returned twice");
  }
  spare_.reserve(spare_.size() + handles.size());
  for (physical_handle h : handles) {
    auto it = lent_.find(h.value);
    chunks_[it->second].lent = false;
    spare_.push_back(it->second);
    lent_.erase(it);
  }
  counts_.lent_pages -= handles.size();
}

bool vmm_page_pool::create_chunks(std::size_t pages, handle_sizes sizes) {
  const std::size_t bytes = pages * page_;
  if (options_.limit_bytes != 0 && reserved_locked() + bytes > options_.limit_bytes) return false;
  const std::size_t first_new = chunks_.size();
  const std::size_t spare_before = spare_.size();
  // Undo this call's chunks when a later one fails: all or nothing, but for a chunk whose
  // cuMemRelease fails too: forgetting it would leak its handle, so it stays, spare (still
  // counted reserved), for later use or release (release_cached, the destructor).
  auto undo = [&] {
    std::size_t kept = first_new;
    for (std::size_t i = first_new; i < chunks_.size(); ++i) {
      if (!device_platform().release_physical(chunks_[i].handle)) {
        chunks_[kept++] = chunks_[i];
        continue;
      }
      sub_reserved(chunks_[i].pages * page_);
      counts_.pages_created -= chunks_[i].pages;
    }
    chunks_.resize(kept);
    spare_.resize(spare_before);
    for (std::size_t i = first_new; i < kept; ++i) spare_.push_back(static_cast<std::uint32_t>(i));
  };
  // The multi-page handle size this call may use (1: none; see handle_sizes).
  std::size_t big = 1;
  if (sizes != handle_sizes::one_page && options_.big_chunk_pages > 1) {
    if (pages >= 2 * options_.big_chunk_pages) big = options_.big_chunk_pages;
  } else if (sizes == handle_sizes::growth && pages * page_ >= options_.huge_growth_bytes) {
    big = huge_chunk_pages();
  }
  for (std::size_t left = pages; left > 0;) {
    const std::size_t n = left >= big ? big : 1;
    auto h = device_platform().create_physical(device(), n * page_);
    if (!h) {
      undo();
      if (h.error().kind == failure_kind::out_of_memory) return false;
      throw_cuda_error(h.error(), "vmm_page_pool: create physical memory");
    }
    spare_.push_back(static_cast<std::uint32_t>(chunks_.size()));
    chunks_.push_back(chunk{h.value(), n, no_page, true});
    add_reserved(n * page_);
    counts_.pages_created += n;
    left -= n;
  }
  return true;
}

void vmm_page_pool::va_insert(std::size_t first, std::size_t count) {
  auto next = va_free_.lower_bound(first);
  if (next != va_free_.end() && first + count == next->first) {
    count += next->second;
    next = va_free_.erase(next);
  }
  if (next != va_free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      prev->second += count;
      return;
    }
  }
  va_free_.emplace(first, count);
}

std::size_t vmm_page_pool::reclaim(std::size_t wanted, bool wait, const stream_handle* same_stream,
                                   std::uintptr_t keep_end, std::uint32_t for_arena) {
  struct candidate {
    std::uint32_t arena_id;
    detail::block* b;
    std::vector<std::uint32_t> chunks;  // wholly inside b, by ascending address
    std::size_t pages = 0;
    bool deferred = false;              // old mapping retires later (same-stream remap)
  };
  std::vector<candidate> found;
  for (std::uint32_t id : {small_arena, large_arena, long_arena}) {
    arena(id).flush();
    for (detail::block* b : arena(id).free_blocks()) {
      if (keep_end != 0 && b->addr + b->size == keep_end) continue;
      bool deferred = false;
      if (!wait && !free_known_complete(*b)) {
        if (same_stream == nullptr || b->stream != same_stream->value) continue;
        deferred = true;
      }
      const std::size_t first = (b->addr - va_base_ + page_ - 1) / page_;
      const std::size_t end = (b->addr + b->size - va_base_) / page_;
      candidate c{id, b, {}, 0, deferred};
      for (std::size_t p = first; p < end;) {
        const std::uint32_t ch = page_table_[p];
        const chunk& k = chunks_[ch];
        if (k.mapped_at >= first && k.mapped_at + k.pages <= end) {
          c.chunks.push_back(ch);
          c.pages += k.pages;
        }
        p = k.mapped_at + k.pages;
      }
      if (c.pages > 0) found.push_back(std::move(c));
    }
  }
  if (found.empty()) return 0;
  // Completed frees first (their address space comes back at once), then the least
  // recently freed: the lowest free_epoch, the stream's counter when the block reached its
  // arena (a thread cache's blocks reach it when drained; a merged block has its newest
  // part's). Memory unused the longest is the least likely to be asked for again where it
  // is. Biggest first (fewest blocks cut), with grow()'s other rules: up to 1.8x the pages
  // a pass on sim (generate_sampled), though 12% fewer on torch_train_fixed. The long
  // arena's free pages (lifetime hints) come last: the next long-lived blocks go there, and
  // taken they come back by another gather (sim, 46 traces with hints: geomean 1.0064 ->
  // 1.0059, modelled driver time 14.7 -> 14.2 s, warm-pass maps 62k -> 55k).
  // Once the hints stopped (their move budget), first instead: no long-lived block comes
  // any more, and the runs' free pages serve the others best gathered early.
  const bool long_last = lifetime_hints_active_locked();
  std::sort(found.begin(), found.end(), [long_last](const candidate& x, const candidate& y) {
    if (x.deferred != y.deferred) return !x.deferred;
    const bool x_long = x.arena_id == long_arena, y_long = y.arena_id == long_arena;
    if (x_long != y_long) return long_last ? y_long : x_long;
    return x.b->free_epoch < y.b->free_epoch;
  });
  // Work queued on any stream may still touch these pages: let it finish before unmapping.
  if (wait) synchronize_streams_with_free_blocks();
  std::size_t got = 0;
  for (auto& c : found) {
    // Take chunks from the top of the block down: they are adjacent, so [lo, hi) is one
    // run, unmapped (where the driver allows) in one call and carved out at once.
    const std::size_t n = c.chunks.size();
    std::size_t take = 0, pages = 0;
    while (take < n && got + pages < wanted) pages += chunks_[c.chunks[n - 1 - take++]].pages;
    if (c.deferred || worker_ != nullptr) {
      // Carved out now; the old mapping stays until the old work is done (retire_completed),
      // or, done already, until the map worker has unmapped it.
      const std::size_t lo = chunks_[c.chunks[n - take]].mapped_at;
      retiring_run r{lo, {}, pages, c.b->stream, c.b->free_epoch};  // before carve moves b
      r.work_pending = c.deferred;
      arena(c.arena_id).carve(c.b, page_address(lo), pages * page_);
      notify(pool_event_kind::segment_unmap, page_address(lo), pages * page_);
      for (std::size_t i = n - take; i < n; ++i) {
        chunk& k = chunks_[c.chunks[i]];
        r.chunks.emplace_back(c.chunks[i], k.pages);
        for (std::size_t q = 0; q < k.pages; ++q) page_table_[k.mapped_at + q] = retiring_page;
        k.mapped_at = no_page;
        k.retiring += 1;
        if (c.deferred) {
          k.waiting += 1;
          k.only_stream = r.stream;
        }
        spare_.push_back(c.chunks[i]);
      }
      // (Not queued when the driver wants one unmap per mapping: the next retire_completed
      // unmaps it on the caller's thread. Held while a growth maps: queue_held_unmaps.)
      if (!c.deferred && !hold_unmaps_) (void)queue_unmap(r);
      retiring_.push_back(std::move(r));
      got += pages;
      note_reclaimed(c.arena_id, for_arena, pages);
      if (got >= wanted) break;
      continue;
    }
    // On a driver failure only the top `done` chunks are unmapped: record exactly those.
    auto [done, failed] = unmap_run({c.chunks.end() - static_cast<std::ptrdiff_t>(take), c.chunks.end()});
    if (done < take) {
      pages = 0;
      for (std::size_t i = n - done; i < n; ++i) pages += chunks_[c.chunks[i]].pages;
    }
    const std::size_t lo = done == 0 ? 0 : chunks_[c.chunks[n - done]].mapped_at;
    if (done > 0) {
      arena(c.arena_id).carve(c.b, page_address(lo), pages * page_);
      notify(pool_event_kind::segment_unmap, page_address(lo), pages * page_);
    }
    for (std::size_t i = n - done; i < n; ++i) {
      chunk& k = chunks_[c.chunks[i]];
      for (std::size_t p = 0; p < k.pages; ++p) page_table_[k.mapped_at + p] = no_chunk;
      k.mapped_at = no_page;
      spare_.push_back(c.chunks[i]);
    }
    if (done > 0) {
      va_insert(lo, pages);
      got += pages;
      note_reclaimed(c.arena_id, for_arena, pages);
    }
    if (!failed.ok()) throw_cuda_error(failed, "vmm_page_pool: unmap free chunks to reuse them");
    if (got >= wanted) break;
  }
  return got;
}

void vmm_page_pool::note_reclaimed(std::uint32_t from_arena, std::uint32_t for_arena,
                                   std::size_t pages) noexcept {
  counts_.pages_reclaimed += pages;
  if (from_arena != long_arena || for_arena == long_arena || for_arena == arena_count) return;
  counts_.long_lived_pages_moved += pages;
  note_long_lived_moved(pages * page_);
}

std::pair<std::size_t, status> vmm_page_pool::unmap_run(std::span<const std::uint32_t> chunk_ids) {
  platform& p = device_platform();
  const std::size_t first = chunks_[chunk_ids.front()].mapped_at;
  const std::size_t last = chunks_[chunk_ids.back()].mapped_at + chunks_[chunk_ids.back()].pages;
  if (chunk_ids.size() > 1 && batched_unmap_) {
    status s = p.unmap(page_address(first), (last - first) * page_);
    if (s) return {chunk_ids.size(), status::success()};
    if (s.kind != failure_kind::invalid_value && s.kind != failure_kind::not_supported)
      return {0, s};
    // This driver wants one call per mapping: remember, and unmap one by one below.
    batched_unmap_ = false;
  }
  std::size_t done = 0;
  for (auto it = chunk_ids.rbegin(); it != chunk_ids.rend(); ++it, ++done) {
    const chunk& k = chunks_[*it];
    if (auto s = p.unmap(page_address(k.mapped_at), k.pages * page_); !s) return {done, s};
  }
  return {done, status::success()};
}

std::size_t vmm_page_pool::split_limit(std::size_t size) const {
  constexpr std::size_t any = static_cast<std::size_t>(-1);
  const double slack = slack_now();
  if (slack <= 0.0 || options_.guard) return any;
  const std::size_t pages = (size + page_ - 1) / page_;
  const double budget = static_cast<double>(peak_live_so_far()) * (1.0 + slack);
  if (static_cast<double>(reserved_locked() + pages * page_) > budget) return any;
  // Large: twice the request and a 32nd of what the pool holds (a large tensor's run, such
  // as a training step's logits, that its next request of that size wants whole).
  return std::max(2 * size, reserved_locked() / large_run_share);
}

void vmm_page_pool::note_gather_time(std::uint64_t started_ns, std::size_t request) noexcept {
  const std::uint64_t now = now_ns();
  const std::uint64_t spent = now > started_ns ? now - started_ns : 0;
  counts_.remap_ns += spent;
  if (options_.remap_budget <= 0.0 || raised_slack_ >= remap_slack_max) return;
  if (window_start_ns_ == 0 || now - window_start_ns_ > remap_window_max_ns) {
    // A window opens at a gather's start: the quiet time before it says nothing about
    // what gathers cost now.
    window_start_ns_ = std::max<std::uint64_t>(started_ns, 1);
    window_remap_ns_ = 0;
    window_peak_live_ = peak_live_so_far();
    window_largest_gather_ = 0;
  }
  window_remap_ns_ += spent;
  window_largest_gather_ = std::max(window_largest_gather_, request);
  const std::uint64_t elapsed = now - window_start_ns_;
  if (elapsed < remap_window_min_ns) return;
  const std::size_t peak = peak_live_so_far();
  auto open_window = [&] {
    window_start_ns_ = now;
    window_remap_ns_ = 0;
    window_peak_live_ = peak;
    window_largest_gather_ = 0;
  };
  if (static_cast<double>(window_remap_ns_) <= options_.remap_budget * static_cast<double>(elapsed)) {
    // Within budget: judged, and a new window opens, so a slow start (a first step's
    // warm-up, quiet between gathers) does not dilute what gathers cost later.
    open_window();
    return;
  }
  if (peak > window_peak_live_ + window_peak_live_ / remap_new_peak_share) {
    // New peaks: the pool is still learning the workload's size, and the gathers hold
    // it there. Judged again once the peak holds. (Within a 64th it holds: the peak a
    // thread sees includes other threads' unpublished counts, which wobble.)
    open_window();
    return;
  }
  // One step for each budget's worth the gathers took, so a pool far over its budget gets
  // there in one judgement; and at least the share of the largest request that gathered,
  // so its run can stay whole between its uses (smaller steps only moved the gathers:
  // H200, PyTorch, docs/RESULTS.md).
  const double over = static_cast<double>(window_remap_ns_) /
                      (options_.remap_budget * static_cast<double>(elapsed));
  const double largest_share =
      peak == 0 ? 0.0 : static_cast<double>(window_largest_gather_) / static_cast<double>(peak);
  raised_slack_ = std::min(remap_slack_max, std::max(slack_now() + remap_slack_step * std::floor(over),
                                                     largest_share));
  counts_.slack_raises += 1;
  open_window();
}

bool vmm_page_pool::grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                         std::size_t alignment, stream_handle stream, growth kind) {
  // A growth that gathers pages is timed for the remap budget, however it ends.
  struct gather_timer {
    vmm_page_pool& pool;
    std::uint64_t started_ns;
    std::uint64_t reclaimed_before;
    std::size_t request;
    ~gather_timer() {
      if (pool.counts_.pages_reclaimed != reclaimed_before) pool.note_gather_time(started_ns, request);
    }
  } timer{*this, now_ns(), counts_.pages_reclaimed, size};
  // The unmaps of old mappings made ready during this growth (its gather's, and those whose
  // work turned out complete at its start) go to the worker once its maps and access grant
  // are made (hold_unmaps_), however it ends. Not thrown from here: a run left unqueued is
  // queued or unmapped by the next retire_completed.
  hold_unmaps_ = worker_ != nullptr;
  struct held_unmaps {
    vmm_page_pool& pool;
    ~held_unmaps() {
      if (!pool.hold_unmaps_) return;
      pool.hold_unmaps_ = false;
      try {
        pool.queue_held_unmaps();
      } catch (...) {
      }
    }
  } unmaps{*this};
  return grow_untimed(arena, arena_id, size, alignment, stream, kind);
}

bool vmm_page_pool::grow_untimed(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                                 std::size_t alignment, stream_handle stream, growth kind) {
  const std::size_t pad = alignment > arena.unit() ? alignment - arena.unit() : 0;
  const std::size_t pages = (size + pad + page_ - 1) / page_;
  // Old mappings whose work is done give their address space back first.
  retire_completed(false);
  va_exhausted_ = false;
  // Physical chunks first: kept ones, then reclaimed ones, then new memory.
  // Enough virtual address space first, so a failure leaves nothing behind.
  auto va_fits = [&] {
    return std::any_of(va_free_.begin(), va_free_.end(), [&](const auto& r) { return r.second >= pages; });
  };
  if (!va_fits() && worker_ != nullptr && worker_->busy()) {
    worker_->drain();  // old mappings on their way out hold address space
    collect_worker();
  }
  if (!va_fits()) {
    va_exhausted_ = true;
    return false;
  }
  // Growing in place: a free block at the top of its mapped run, with unmapped address
  // space after it, is extended by only the pages the request lacks. Two cases:
  //  - packing: the free tail left in the last page of a live block, so consecutive large
  //    blocks share pages instead of each rounding up on its own;
  //  - a free run holding half of the request, where the pool is tight (no growth slack
  //    left: the request would otherwise gather scattered pages, every one remapped at
  //    ~26 us of access grant on the H200) or the request is huge (huge_growth bytes or
  //    more: a step plan's region given back for an evaluation pass and taken again once
  //    a few of its pages went to the small arena; ~0.45 s for a 15.6 GB region gathered
  //    whole). Within the slack new pages are made instead, and a large free run is kept
  //    whole for its own size (split_limit): extending it there undid what the slack
  //    bought (sim, train_llama: 375 -> 1,313 maps a pass).
  // Extending any free block made fragmentation worse on both shared traces (sim,
  // 1.043-1.062 on infer). With half the request in the run, least recently freed pages
  // gathered first and small runs kept at the top of the address space (below), tight
  // pools remapped 11-71% fewer pages on sim, fragmentation within 0.001 (docs/RESULTS.md).
  const bool tight = split_limit(size) == static_cast<std::size_t>(-1);
  struct extension {
    std::size_t first_page = no_page;
    std::size_t pages = 0;
    std::uintptr_t block_end = 0;  // the extended block's end (reclaim leaves it whole)
    std::uint32_t segment = 0;     // the extended block's: the new pages join it
  };
  const bool huge = options_.huge_growth_bytes != 0 && size >= options_.huge_growth_bytes;
  bool retiring_after_run = false;  // a half run's next page still retiring (map worker)
  auto find_extension = [&]() {
    extension best;
    if (pad != 0) return best;
    for (detail::block* b : arena.free_blocks()) {
      if (b->next != nullptr || b->size >= size || !arena.serves(*b, size)) continue;
      const bool tail = b->size < page_ && b->prev != nullptr &&
                        b->prev->st == detail::block::state::allocated;
      const bool half_run = (huge || tight) && 2 * b->size >= size;
      if (!tail && !half_run) continue;
      // The tail must be this stream's: the arena hands a block only to its own stream
      // (another stream's, even if known complete, would leave the grown run unusable:
      // allocation fails, cached memory is released and the request is refused anyway).
      if (b->stream != stream.value) continue;
      const std::size_t end_page = (b->addr + b->size - va_base_) / page_;
      const std::size_t need = (size - b->size + page_ - 1) / page_;
      if (need >= pages) continue;  // saves nothing
      if (best.first_page != no_page && need >= best.pages) continue;
      auto run = va_free_.find(end_page);
      if (run == va_free_.end() || run->second < need) {
        // Then the worker is waited for (below): it drains every queued unmap. Whether a
        // smaller request should rather gather is not measured (not waiting: sim maps
        // encode_varlen 3,597-4,162 against 1,987-3,233 pages a pass; no GPU run).
        retiring_after_run = retiring_after_run ||
                             (half_run && end_page < va_pages_ && page_table_[end_page] == retiring_page);
        continue;
      }
      best = {end_page, need, b->addr + b->size, b->segment};
    }
    return best;
  };
  extension ext = find_extension();
  if (ext.first_page == no_page && retiring_after_run && worker_ != nullptr) {
    // The address space after the run comes back once the worker has unmapped it.
    worker_->drain();
    collect_worker();
    ext = find_extension();
  }
  std::size_t wanted = ext.first_page != no_page ? ext.pages : pages;
  std::size_t have = spare_pages_for(stream.value);
  const std::size_t first_new = chunks_.size();
  // Within the growth slack: new pages rather than a gather of scattered free ones (at
  // the limit or on a full device, the gather after all).
  const bool may_create = kind == growth::any;  // held_pages_only: kept and gathered pages
  if (have < wanted && may_create && split_limit(size) != static_cast<std::size_t>(-1) &&
      create_chunks(wanted - have, handle_sizes::growth))
    have = spare_pages_for(stream.value);
  if (have < wanted) {
    reclaim(wanted - have, false, &stream, ext.block_end, arena_id);
    // Counted again: a reclaimed chunk may still be retiring for another stream.
    have = spare_pages_for(stream.value);
    if (ext.first_page != no_page) {  // reclaim may have cut the tail: look again
      ext = find_extension();
      wanted = ext.first_page != no_page ? ext.pages : pages;
    }
  }
  if (have < wanted && (!may_create || !create_chunks(wanted - have, handle_sizes::growth)))
    return false;
  // Undoes this call's new chunks (all spare) when the rest fails.
  auto release_new_chunks = [&] {
    for (std::uint32_t id = static_cast<std::uint32_t>(first_new); id < chunks_.size(); ++id) {
      chunk& c = chunks_[id];
      if (!c.live || c.mapped_at != no_page) continue;
      if (!device_platform().release_physical(c.handle)) continue;
      c.live = false;
      sub_reserved(c.pages * page_);
      counts_.pages_created -= c.pages;
      std::erase(spare_, id);
    }
  };

  // Choose kept chunks this stream may map, covering `wanted`: the largest that does not
  // overshoot what is still missing, so a multi-page chunk is mapped only where a block
  // needs all of it. Where only larger chunks are left, an idle one is released and the
  // missing pages made as one-page handles: mapped whole, its extra pages would be free
  // pages pinned by the block placed beside them, which no gather can move.
  std::sort(spare_.begin(), spare_.end(), [&](std::uint32_t a, std::uint32_t b) {
    return chunks_[a].pages < chunks_[b].pages;
  });
  std::vector<std::uint32_t> chosen;
  std::size_t covered = 0;
  auto mappable = [&](std::uint32_t id) { return mappable_for(id, stream.value); };
  while (covered < wanted) {
    const std::size_t gap = wanted - covered;
    auto fit = std::find_if(spare_.rbegin(), spare_.rend(), [&](std::uint32_t id) {
      return mappable(id) && chunks_[id].pages <= gap;
    });
    if (fit != spare_.rend()) {
      covered += chunks_[*fit].pages;
      chosen.push_back(*fit);
      spare_.erase(std::next(fit).base());
      continue;
    }
    auto over = std::find_if(spare_.begin(), spare_.end(), mappable);
    chunk& big = chunks_[*over];
    if (!big.lent && big.waiting == 0 && big.retiring != 0 && worker_ != nullptr) {
      // Its old mapping is on its way out on the map worker (a handle just reclaimed):
      // waited for, it can be released instead of mapped whole and pinned.
      queue_held_unmaps();
      worker_->drain();
      collect_worker();
    }
    if (!big.lent && big.retiring == 0 && big.waiting == 0 &&
        device_platform().release_physical(big.handle)) {
      big.live = false;
      sub_reserved(big.pages * page_);
      counts_.pages_released += big.pages;
      spare_.erase(over);
      if (create_chunks(gap, handle_sizes::one_page)) continue;  // one-page chunks, at the end of spare_
      spare_.insert(spare_.end(), chosen.begin(), chosen.end());
      release_new_chunks();
      return false;
    }
    covered += big.pages;  // not releasable now: mapped whole after all
    chosen.push_back(*over);
    spare_.erase(over);
  }

  // Virtual pages: right after the packed tail, else first fit, lowest address first, so
  // runs land next to earlier ones and merge with them. Without packing the run must hold
  // the whole request.
  auto run = va_free_.end();
  if (ext.first_page != no_page) {
    run = va_free_.find(ext.first_page);
    if (run != va_free_.end() && run->second < covered) run = va_free_.end();
  }
  const bool run_extends = run != va_free_.end();  // mapped right after the extended block
  if (run == va_free_.end() && covered >= pages) {
    // Not right above a free run of half a huge request or more, where possible: that
    // address space is how the run grows in place (above) when it is asked for again.
    std::vector<std::size_t> kept_for_runs;
    if (options_.huge_growth_bytes != 0)
      for (std::uint32_t id : {small_arena, large_arena})
        for (detail::block* b : this->arena(id).free_blocks())
          if (b->next == nullptr && 2 * b->size >= options_.huge_growth_bytes)
            kept_for_runs.push_back((b->addr + b->size - va_base_) / page_);
    auto fits = [&](const auto& r) { return r.second >= covered; };
    auto fits_elsewhere = [&](const auto& r) {
      return fits(r) && std::find(kept_for_runs.begin(), kept_for_runs.end(), r.first) ==
                            kept_for_runs.end();
    };
    run = std::find_if(va_free_.begin(), va_free_.end(), fits_elsewhere);
    if (run == va_free_.end()) run = std::find_if(va_free_.begin(), va_free_.end(), fits);
  }
  if (run == va_free_.end()) {
    spare_.insert(spare_.end(), chosen.begin(), chosen.end());
    release_new_chunks();
    va_exhausted_ = true;
    return false;  // virtual range exhausted
  }
  // A fresh run of the small arena, in a tight pool: at the top of the highest address
  // space that fits, away from the large runs (which grow in place upwards). At the
  // lowest address it took the page right above a large free run (often the page just
  // reclaimed from that run's top) and left the run nowhere to grow.
  const bool at_top = tight && arena_id == small_arena && ext.first_page == no_page;
  if (at_top)
    for (auto it = std::next(run); it != va_free_.end(); ++it)
      if (it->second >= covered) run = it;
  std::size_t first = run->first;
  if (arena_id == long_arena && ext.first_page == no_page) {
    // A fresh run of the long arena: the lowest address space from the middle of the range
    // up, away from the other arenas' runs (which take the lowest addresses first), so the
    // next long-lived block extends it in place (packing, above) and shares its last page.
    // Where nothing above the middle fits, the first fit found above.
    const std::size_t mid = va_pages_ / 2;
    for (auto it = va_free_.begin(); it != va_free_.end(); ++it) {
      const std::size_t start = std::max(it->first, mid);
      if (start + covered <= it->first + it->second) {
        run = it;
        first = start;
        break;
      }
    }
  }
  const std::size_t run_first = run->first, run_end = run->first + run->second;
  if (at_top) first = run_end - covered;
  va_free_.erase(run);
  if (first > run_first) va_free_.emplace(run_first, first - run_first);
  if (first + covered < run_end) va_free_.emplace(first + covered, run_end - first - covered);

  // Map the chunks side by side; one access grant over the whole run. Undo on failure.
  std::size_t at = first, mapped = 0;
  status failed;
  for (; mapped < chosen.size(); ++mapped) {
    const chunk& k = chunks_[chosen[mapped]];
    if (auto s = device_platform().map(page_address(at), k.pages * page_, k.handle, 0); !s) {
      failed = s;
      break;
    }
    at += k.pages;
  }
  if (failed.ok()) failed = device_platform().set_access(device(), page_address(first), covered * page_);
  if (!failed.ok()) {
    // Undo. A chunk whose unmap fails too stays mapped where it is, its address space not
    // reused: stranded until the pool's end (which unmaps it), never handed out.
    at = first;
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      chunk& k = chunks_[chosen[i]];
      if (i < mapped && !device_platform().unmap(page_address(at), k.pages * page_)) {
        k.mapped_at = at;
        for (std::size_t q = 0; q < k.pages; ++q) page_table_[at + q] = chosen[i];
        counts_.pages_stranded += k.pages;
      } else {
        va_insert(at, k.pages);
        spare_.push_back(chosen[i]);
      }
      at += k.pages;
    }
    release_new_chunks();
    if (failed.kind == failure_kind::out_of_memory) return false;
    throw_cuda_error(failed, "vmm_page_pool: map chunks");
  }
  at = first;
  for (std::uint32_t id : chosen) {
    chunk& k = chunks_[id];
    k.mapped_at = at;
    for (std::size_t p = 0; p < k.pages; ++p) page_table_[at + p] = id;
    at += k.pages;
  }
  // A run holding a huge growth's handles, for a request that covers one, is kept for such
  // requests (the constructor's restrict_segment); pages that extend a block join its run.
  std::uint32_t segment = 0;
  if (run_extends)
    segment = ext.segment;
  else if (arena_id != small_arena && huge_chunk_pages() > 1 &&
           size >= huge_chunk_pages() * page_ &&
           std::any_of(chosen.begin(), chosen.end(), [&](std::uint32_t id) { return chunks_[id].pages > 1; }))
    segment = detail::whole_chunk_segment;
  arena.add_region(page_address(first), covered * page_, segment, stream.value);
  notify(pool_event_kind::segment_map, page_address(first), covered * page_);
  return true;
}

void* vmm_page_pool::allocate_guarded(std::size_t bytes, std::size_t alignment,
                                      stream_handle stream) {
  retire_completed(false);
  const std::size_t pages = (bytes + page_ - 1) / page_;
  // A virtual run for the pages and the guard page after them.
  auto run = std::find_if(va_free_.begin(), va_free_.end(),
                          [&](const auto& r) { return r.second >= pages + 1; });
  va_exhausted_ = run == va_free_.end();
  if (run == va_free_.end()) return nullptr;
  auto usable = [&](std::uint32_t id) { return chunks_[id].pages == 1 && mappable_for(id, stream.value); };
  std::size_t have = static_cast<std::size_t>(std::count_if(spare_.begin(), spare_.end(), usable));
  if (have < pages && !create_chunks(pages - have, handle_sizes::one_page)) {
    release_cached();  // memory pressure: give back what is kept, then try once more
    have = static_cast<std::size_t>(std::count_if(spare_.begin(), spare_.end(), usable));
    if (have < pages && !create_chunks(pages - have, handle_sizes::one_page)) return nullptr;
    run = std::find_if(va_free_.begin(), va_free_.end(),
                       [&](const auto& r) { return r.second >= pages + 1; });
    va_exhausted_ = run == va_free_.end();
    if (run == va_free_.end()) return nullptr;
  }
  std::vector<std::uint32_t> chosen;
  for (auto it = spare_.begin(); it != spare_.end() && chosen.size() < pages;) {
    if (usable(*it)) {
      chosen.push_back(*it);
      it = spare_.erase(it);
    } else {
      ++it;
    }
  }
  const std::size_t first = run->first;
  const std::size_t remaining = run->second - pages - 1;
  va_free_.erase(run);
  if (remaining > 0) va_free_.emplace(first + pages + 1, remaining);
  platform& p = device_platform();
  std::size_t mapped = 0;
  status failed;
  for (; mapped < chosen.size(); ++mapped)
    if (auto st = p.map(page_address(first + mapped), page_, chunks_[chosen[mapped]].handle, 0); !st) {
      failed = st;
      break;
    }
  if (failed.ok()) failed = p.set_access(device(), page_address(first), pages * page_);
  if (!failed.ok()) {
    // As in grow(): a page whose unmap fails too stays mapped and stranded.
    for (std::size_t i = 0; i < chosen.size(); ++i) {
      if (i < mapped && !p.unmap(page_address(first + i), page_)) {
        chunks_[chosen[i]].mapped_at = first + i;
        page_table_[first + i] = chosen[i];
        counts_.pages_stranded += 1;
      } else {
        va_insert(first + i, 1);
        spare_.push_back(chosen[i]);
      }
    }
    va_insert(first + pages, 1);  // the guard page
    if (failed.kind == failure_kind::out_of_memory) return nullptr;
    throw_cuda_error(failed, "vmm_page_pool: map a guarded allocation");
  }
  for (std::size_t i = 0; i < pages; ++i) {
    chunks_[chosen[i]].mapped_at = first + i;
    page_table_[first + i] = chosen[i];
  }
  notify(pool_event_kind::segment_map, page_address(first), pages * page_);
  // End at the guard page, as far as the alignment allows.
  const std::uintptr_t end = page_address(first + pages);
  const std::uintptr_t addr = (end - bytes) / alignment * alignment;
  guarded_.emplace(addr, guarded_allocation{first, pages, bytes});
  return reinterpret_cast<void*>(addr);
}

bool vmm_page_pool::free_guarded(std::uintptr_t addr, std::size_t bytes, stream_handle stream) {
  auto it = guarded_.find(addr);
  if (it == guarded_.end()) return false;
  const guarded_allocation g = it->second;
  if (g.bytes != bytes)
    throw invalid_argument("deallocate: size mismatch for a guarded allocation of the "
                           "'vmm_page_pool' pool: allocated " + std::to_string(g.bytes) +
                           " bytes, freed as " + std::to_string(bytes));
  platform& p = device_platform();
  // Debug mode: wait for the stream rather than track the free's completion.
  if (auto st = p.stream_synchronize(stream); !st)
    throw_cuda_error(st, "vmm_page_pool: wait for the stream before unmapping a guarded allocation");
  std::vector<std::uint32_t> ids;
  for (std::size_t i = 0; i < g.pages; ++i) ids.push_back(page_table_[g.first_page + i]);
  auto [done, failed] = unmap_run(ids);
  if (!failed.ok()) {
    // The top `done` pages are unmapped; the allocation stays live and can be freed again.
    for (std::size_t i = g.pages - done; i < g.pages; ++i) {
      (void)p.map(page_address(g.first_page + i), page_, chunks_[ids[i]].handle, 0);
    }
    (void)p.set_access(device(), page_address(g.first_page), g.pages * page_);
    throw_cuda_error(failed, "vmm_page_pool: unmap a guarded allocation");
  }
  for (std::size_t i = 0; i < g.pages; ++i) {
    chunks_[ids[i]].mapped_at = no_page;
    page_table_[g.first_page + i] = no_chunk;
    spare_.push_back(ids[i]);
  }
  notify(pool_event_kind::segment_unmap, page_address(g.first_page), g.pages * page_);
  va_insert(g.first_page, g.pages + 1);
  guarded_.erase(it);
  return true;
}

std::size_t vmm_page_pool::release_cached() {
  if (sleeping_locked()) return 0;  // sleeping pages hold nothing; wake() trims afterwards
  reclaim(va_pages_, true);
  retire_completed(true);
  std::size_t released = 0;
  std::vector<std::uint32_t> kept;
  for (std::uint32_t id : spare_) {
    chunk& c = chunks_[id];
    if (auto s = device_platform().release_physical(c.handle); !s) {
      kept.push_back(id);  // keep it; the pool stays consistent
      continue;
    }
    c.live = false;
    const std::size_t bytes = c.pages * page_;
    sub_reserved(bytes);
    released += bytes;
    counts_.pages_released += c.pages;
  }
  spare_ = std::move(kept);
  return released;
}

std::string vmm_page_pool::describe_holdings() const {
  std::size_t mapped = 0, handles = 0;
  for (auto& c : chunks_) {
    if (!c.live) continue;
    mapped += c.mapped_at != no_page ? c.pages : 0;
    handles += 1;
  }
  std::ostringstream out;
  out << "  pages of " << format_bytes(page_) << ": " << mapped << " mapped, " << spare_pages()
      << " kept unmapped for reuse, in " << handles << " physical handles; "
      << counts_.pages_reclaimed << " pages remapped so far; " << counts_.lent_pages
      << " lent (KV cache); " << retiring_.size()
      << " old mappings of remapped pages waiting for their stream\n";
  if (va_exhausted_) {
    std::size_t free_pages = 0, largest_run = 0;
    for (const auto& [first, count] : va_free_) {
      free_pages += count;
      largest_run = std::max(largest_run, count);
    }
    out << "  the pool's virtual range (va_reserve: " << format_bytes(va_pages_ * page_)
        << ") is exhausted: " << (va_pages_ - free_pages) * page_ << " of " << va_pages_ * page_
        << " bytes of addresses in use, the largest free run " << largest_run * page_
        << " bytes, too small for the request; raise va_reserve\n";
  }
  if (counts_.unmap_failures > 0)
    out << "  " << counts_.unmap_failures
        << " unmaps of old mappings failed so far; those runs stay mapped until a retry "
           "succeeds\n";
  return out.str();
}

std::string vmm_page_pool::validate_holdings() const {
  std::size_t live_pages = 0, mapped = 0;
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    const chunk& c = chunks_[id];
    if (!c.live) continue;
    live_pages += c.pages;
    if (c.mapped_at == no_page) continue;
    mapped += c.pages;
    for (std::size_t p = 0; p < c.pages; ++p)
      if (page_table_[c.mapped_at + p] != id) return "page table disagrees with a chunk's mapping";
  }
  if (live_pages * page_ != reserved_locked() + sleeping_pages_locked() * page_)
    return "chunks (but sleeping ones) do not add up to reserved";
  std::size_t table_mapped = 0, table_retiring = 0;
  for (std::uint32_t id : page_table_) {
    table_mapped += id != no_chunk && id != retiring_page ? 1 : 0;
    table_retiring += id == retiring_page ? 1 : 0;
  }
  if (table_mapped != mapped) return "page table maps pages of no live chunk";
  std::size_t retiring_pages = 0;
  std::vector<std::uint32_t> retiring_refs(chunks_.size(), 0), waiting_refs(chunks_.size(), 0);
  for (const auto& r : retiring_) {
    std::size_t sum = 0;
    for (auto& [id, pages] : r.chunks) {
      if (!chunks_[id].live || chunks_[id].pages != pages) return "a retiring run names a wrong chunk";
      retiring_refs[id] += 1;
      waiting_refs[id] += r.work_pending ? 1 : 0;
      sum += pages;
    }
    if (sum != r.pages) return "a retiring run's pages disagree with its chunks";
    for (std::size_t q = r.first_page; q < r.first_page + r.pages; ++q)
      if (page_table_[q] != retiring_page) return "a retiring run's pages are not marked retiring";
    retiring_pages += r.pages;
  }
  if (retiring_pages != table_retiring) return "retiring pages in the table disagree with the runs";
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    if (!chunks_[id].live) continue;
    if (chunks_[id].retiring != retiring_refs[id]) return "a chunk's retiring count disagrees with the runs";
    if (chunks_[id].waiting != waiting_refs[id])
      return "a chunk's count of old mappings still in use disagrees with the runs";
  }
  std::size_t lent = 0;
  for (auto& [h, id] : lent_) {
    if (!chunks_[id].live || !chunks_[id].lent || chunks_[id].pages != 1 ||
        chunks_[id].mapped_at != no_page)
      return "a lent handle is not a live, unmapped one-page chunk";
    lent += 1;
  }
  if (lent != counts_.lent_pages) return "lent page count disagrees with the lent handles";
  if (mapped + spare_pages() + lent != live_pages) return "chunk pages neither mapped, spare nor lent";
  return {};
}

}  // namespace gpumem
