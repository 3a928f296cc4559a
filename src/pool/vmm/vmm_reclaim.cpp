// vmm_page_pool: reclaiming the pages of cached free blocks for a growth elsewhere (a gather).
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>
#include <span>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/vmm/vmm_worker.hpp"

namespace gpumem {

std::vector<vmm_page_pool::reclaim_candidate> vmm_page_pool::reclaim_candidates(
    bool wait, const stream_handle* same_stream, std::uintptr_t keep_end) {
  std::vector<reclaim_candidate> found;
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
      reclaim_candidate c{id, b, {}, 0, deferred};
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
  return found;
}

std::size_t vmm_page_pool::reclaim(std::size_t wanted, bool wait, const stream_handle* same_stream,
                                   std::uintptr_t keep_end, std::uint32_t for_arena) {
  std::vector<reclaim_candidate> found = reclaim_candidates(wait, same_stream, keep_end);
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
  std::sort(found.begin(), found.end(), [long_last](const reclaim_candidate& x, const reclaim_candidate& y) {
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
      carve_retiring(c, take, pages);
      got += pages;
      note_reclaimed(c.arena_id, for_arena, pages);
      if (got >= wanted) break;
      continue;
    }
    const auto [done_pages, failed] = unmap_and_carve(c, take, pages);
    got += done_pages;
    if (done_pages > 0) note_reclaimed(c.arena_id, for_arena, done_pages);
    if (!failed.ok()) throw_cuda_error(failed, "vmm_page_pool: unmap free chunks to reuse them");
    if (got >= wanted) break;
  }
  return got;
}

void vmm_page_pool::carve_retiring(reclaim_candidate& c, std::size_t take, std::size_t pages) {
  const std::size_t n = c.chunks.size();
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
}

std::pair<std::size_t, status> vmm_page_pool::unmap_and_carve(reclaim_candidate& c, std::size_t take,
                                                              std::size_t pages) {
  const std::size_t n = c.chunks.size();
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
  if (done == 0) return {0, failed};
  va_insert(lo, pages);
  return {pages, failed};
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

}  // namespace gpumem
