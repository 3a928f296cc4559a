// vmm_page_pool: kept mappings. A gather takes pages from free blocks and maps them side by
// side elsewhere; the old mappings are not unmapped but kept, out of use. A physical handle
// may be mapped at several addresses at once; the pool uses each page at one of them only
// (the page table names the chunk where it is in use, kept_page where it is kept). When a
// later growth needs a run that a kept run's pages can make, and those pages are all free
// again (spare, or in free blocks whose last use is complete or on the growth's stream),
// the pages move back into the kept run with no driver call: their free blocks are carved,
// and the places they leave are kept runs in turn. A loop whose steps make the same
// requests so settles on a set of mappings that serves every step without a driver call,
// holding no more physical memory than the gathers did. Kept runs cost address space only;
// they are unmapped when it runs short, when their pages exceed the pool's reserved pages,
// and before their memory is given back, lent or put to sleep.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>
#include <vector>

#include "gpumem/errors.hpp"
#include "pool/core/block_arena.hpp"

namespace gpumem {

void vmm_page_pool::carve_kept(reclaim_candidate& c, std::size_t take, std::size_t pages) {
  const std::size_t n = c.chunks.size();
  const std::size_t lo = chunks_[c.chunks[n - take]].mapped_at;
  arena(c.arena_id).carve(c.b, page_address(lo), pages * page_);
  notify(pool_event_kind::segment_unmap, page_address(lo), pages * page_);
  kept_run r{{}, pages, ++kept_runs_made_, 0, 0};
  for (std::size_t i = n - take; i < n; ++i) {
    chunk& k = chunks_[c.chunks[i]];
    r.chunks.push_back(c.chunks[i]);
    for (std::size_t q = 0; q < k.pages; ++q) page_table_[k.mapped_at + q] = kept_page;
    k.mapped_at = no_page;
    k.kept += 1;
    spare_.push_back(c.chunks[i]);
  }
  kept_runs_.emplace(lo, std::move(r));
  kept_run_pages_ += pages;
}

vmm_page_pool::free_chunks vmm_page_pool::find_free_chunks(const stream_handle& stream,
                                                           std::vector<reclaim_candidate>& found) {
  found = reclaim_candidates(false, &stream, 0);
  free_chunks free_at;
  for (std::size_t i = 0; i < found.size(); ++i)
    for (std::uint32_t id : found[i].chunks) free_at.emplace(id, static_cast<std::ptrdiff_t>(i));
  for (std::uint32_t id : spare_) {
    const chunk& k = chunks_[id];
    if (!k.lent && k.retiring == 0 && k.waiting == 0) free_at.emplace(id, -1);
  }
  return free_at;
}

void vmm_page_pool::move_to_kept_pages(std::span<const std::pair<std::uint32_t, std::size_t>> moves,
                                       std::vector<reclaim_candidate>& found, const free_chunks& free_at,
                                       std::uint32_t for_arena) {
  // Each source block gives up its chunks from the top down (a carve leaves the piece
  // below it as the block holding the lower chunks); adjacent chunks leave together, as
  // one kept run.
  std::unordered_map<std::ptrdiff_t, std::vector<std::uint32_t>> by_block;
  for (const auto& [id, page] : moves) {
    const std::ptrdiff_t at = free_at.at(id);
    if (at < 0)
      std::erase(spare_, id);
    else
      by_block[at].push_back(id);
  }
  for (auto& [index, ids] : by_block) {
    reclaim_candidate& c = found[static_cast<std::size_t>(index)];
    std::sort(ids.begin(), ids.end(), [&](std::uint32_t a, std::uint32_t b) {
      return chunks_[a].mapped_at > chunks_[b].mapped_at;
    });
    detail::block* b = c.b;
    const std::uintptr_t stream = c.deferred ? b->stream : 0;
    const std::uint64_t epoch = c.deferred ? b->free_epoch : 0;
    for (std::size_t i = 0; i < ids.size();) {
      const std::size_t j = i;
      std::size_t lo = chunks_[ids[i]].mapped_at, pages = chunks_[ids[i]].pages;
      for (++i; i < ids.size() && chunks_[ids[i]].mapped_at + chunks_[ids[i]].pages == lo; ++i) {
        lo = chunks_[ids[i]].mapped_at;
        pages += chunks_[ids[i]].pages;
      }
      detail::block* below = arena(c.arena_id).carve(b, page_address(lo), pages * page_);
      notify(pool_event_kind::segment_unmap, page_address(lo), pages * page_);
      kept_run left{{}, pages, ++kept_runs_made_, stream, epoch};
      for (std::size_t q = i; q-- > j;) {
        chunk& k = chunks_[ids[q]];
        left.chunks.push_back(ids[q]);
        for (std::size_t p = 0; p < k.pages; ++p) page_table_[k.mapped_at + p] = kept_page;
        k.mapped_at = no_page;
        k.kept += 1;
      }
      kept_runs_.emplace(lo, std::move(left));
      kept_run_pages_ += pages;
      if (c.arena_id == long_arena && for_arena != long_arena) {
        counts_.long_lived_pages_moved += pages;
        note_long_lived_moved(pages * page_);
      }
      b = below;
    }
  }
  for (const auto& [id, page] : moves) {
    chunk& k = chunks_[id];
    k.mapped_at = page;
    k.kept -= 1;
    for (std::size_t p = 0; p < k.pages; ++p) page_table_[page + p] = id;
    counts_.pages_taken_back += k.pages;
  }
}

bool vmm_page_pool::take_back_kept_run(const growth_request& g) {
  if (kept_runs_.empty()) return false;
  const std::size_t most = g.pages + g.pages / 4;
  std::vector<reclaim_candidate> found;
  const free_chunks free_at = find_free_chunks(g.stream, found);
  auto best = kept_runs_.end();
  for (auto it = kept_runs_.begin(); it != kept_runs_.end(); ++it) {
    const kept_run& r = it->second;
    if (r.pages < g.pages || r.pages > most) continue;
    if (best != kept_runs_.end() && r.pages >= best->second.pages) continue;
    if (std::all_of(r.chunks.begin(), r.chunks.end(), [&](std::uint32_t id) { return free_at.contains(id); }))
      best = it;
  }
  if (best == kept_runs_.end()) return false;
  const std::size_t first = best->first;
  const kept_run run = std::move(best->second);
  kept_runs_.erase(best);
  kept_run_pages_ -= run.pages;
  std::vector<std::pair<std::uint32_t, std::size_t>> moves;
  bool multi_page = false;
  for (std::size_t at = first; std::uint32_t id : run.chunks) {
    moves.emplace_back(id, at);
    at += chunks_[id].pages;
    multi_page = multi_page || chunks_[id].pages > 1;
  }
  move_to_kept_pages(moves, found, free_at, g.arena_id);
  std::uint32_t segment = 0;
  if (g.arena_id != small_arena && multi_page && huge_chunk_pages() > 1 &&
      g.size >= huge_chunk_pages() * page_)
    segment = detail::whole_chunk_segment;
  g.arena.add_region(page_address(first), run.pages * page_, segment, g.stream.value);
  notify(pool_event_kind::segment_map, page_address(first), run.pages * page_);
  return true;
}

bool vmm_page_pool::restore_window(std::uint32_t arena_id, std::uintptr_t addr, std::size_t size,
                                   const stream_handle& stream) {
  if (addr < va_base_) return false;
  const std::size_t first = (addr - va_base_) / page_;
  const std::size_t end = (addr + size - va_base_ + page_ - 1) / page_;
  if (end > va_pages_) return false;
  bool any_kept = false;
  for (std::size_t p = first; p < end; ++p) {
    const std::uint32_t t = page_table_[p];
    if (t == no_chunk || t == retiring_page) return false;
    any_kept = any_kept || t == kept_page;
  }
  if (!any_kept) return false;  // nothing to restore: the arena's blocks there decide
  // The kept runs under the window, and the chunks of theirs it covers (whole chunks only).
  auto it = kept_runs_.upper_bound(first);
  if (it != kept_runs_.begin() && std::prev(it)->first + std::prev(it)->second.pages > first) --it;
  std::vector<std::map<std::size_t, kept_run>::iterator> runs;
  std::vector<std::pair<std::uint32_t, std::size_t>> moves;
  for (; it != kept_runs_.end() && it->first < end; ++it) {
    runs.push_back(it);
    for (std::size_t at = it->first; std::uint32_t id : it->second.chunks) {
      const std::size_t pages = chunks_[id].pages;
      if (at + pages > first && at < end) {
        if (at < first || at + pages > end) return false;
        moves.emplace_back(id, at);
      }
      at += pages;
    }
  }
  // A chunk kept at two places under the window can be at one of them only.
  std::vector<std::uint32_t> ids;
  for (const auto& m : moves) ids.push_back(m.first);
  std::sort(ids.begin(), ids.end());
  if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) return false;
  std::vector<reclaim_candidate> found;
  const free_chunks free_at = find_free_chunks(stream, found);
  for (const auto& [id, page] : moves) {
    if (!free_at.contains(id)) return false;
    const std::size_t now = chunks_[id].mapped_at;  // free elsewhere, not in the window
    if (now != no_page && now + chunks_[id].pages > first && now < end) return false;
  }
  // The runs give up the window's pages; what lies outside it stays kept.
  for (auto run : runs) {
    const std::size_t run_first = run->first;
    kept_run r = std::move(run->second);
    kept_runs_.erase(run);
    kept_run_pages_ -= r.pages;
    kept_run below{{}, 0, r.made, r.stream, r.epoch}, above{{}, 0, r.made, r.stream, r.epoch};
    std::size_t at = run_first, above_first = no_page;
    for (std::uint32_t id : r.chunks) {
      const std::size_t pages = chunks_[id].pages;
      if (at + pages <= first) {
        below.chunks.push_back(id);
        below.pages += pages;
      } else if (at >= end) {
        if (above_first == no_page) above_first = at;
        above.chunks.push_back(id);
        above.pages += pages;
      }
      at += pages;
    }
    if (below.pages > 0) {
      kept_run_pages_ += below.pages;
      kept_runs_.emplace(run_first, std::move(below));
    }
    if (above.pages > 0) {
      kept_run_pages_ += above.pages;
      kept_runs_.emplace(above_first, std::move(above));
    }
  }
  move_to_kept_pages(moves, found, free_at, arena_id);
  // The pages come back as free memory of the arena, merging with its free blocks beside.
  std::sort(moves.begin(), moves.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  for (std::size_t i = 0; i < moves.size();) {
    const std::size_t lo = moves[i].second;
    std::size_t hi = lo + chunks_[moves[i].first].pages;
    for (++i; i < moves.size() && moves[i].second == hi; ++i) hi += chunks_[moves[i].first].pages;
    arena(arena_id).add_region(page_address(lo), (hi - lo) * page_, 0, stream.value);
    notify(pool_event_kind::segment_map, page_address(lo), (hi - lo) * page_);
  }
  return true;
}

static std::uint64_t context_mix(std::uint64_t h, std::uint64_t v) noexcept {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h * 0xff51afd7ed558ccdull;
}

detail::block* vmm_page_pool::allocate_placed(std::uint32_t arena_id, std::size_t size,
                                              std::size_t alignment, stream_handle stream,
                                              std::size_t requested) {
  std::uint64_t h = context_mix(size, stream.value * 4 + arena_id);
  for (std::size_t i = 0; i < context_length; ++i)
    h = context_mix(h, recent_requests_[(recent_count_ + i) % context_length]);
  pending_context_ = h;
  if (alignment > arena(arena_id).unit()) return nullptr;
  if (std::getenv("GPUMEM_X_NOREPLAY")) return nullptr;
  auto it = placed_at_.find(h);
  if (it == placed_at_.end()) return nullptr;
  detail::block_arena& a = arena(arena_id);
  a.flush();
  // The newest earlier placement whose range is free, else the newest that can be made so.
  const auto& seen = it->second;
  for (auto at = seen.rbegin(); at != seen.rend(); ++at)
    if (detail::block* b = a.allocate_at(*at, size, stream.value, requested)) return b;
  if (std::getenv("GPUMEM_X_NORESTORE")) return nullptr;
  for (auto at = seen.rbegin(); at != seen.rend(); ++at)
    if (restore_window(arena_id, *at, size, stream))
      return a.allocate_at(*at, size, stream.value, requested);
  return nullptr;
}

void vmm_page_pool::note_placed(const detail::block& b, std::size_t size, stream_handle stream) {
  if (placed_at_.size() >= max_contexts && !placed_at_.contains(pending_context_)) placed_at_.clear();
  auto& seen = placed_at_[pending_context_];
  std::erase(seen, b.addr);
  if (seen.size() >= placements_per_context) seen.erase(seen.begin());
  seen.push_back(b.addr);
  recent_requests_[recent_count_++ % context_length] = context_mix(size, stream.value);
}

status vmm_page_pool::drop_kept_run(std::map<std::size_t, kept_run>::iterator it) {
  platform& p = device_platform();
  kept_run& r = it->second;
  const std::size_t first = it->first;
  if (r.stream != 0 && !free_known_complete(r.stream, r.epoch)) {
    if (status s = p.stream_synchronize(stream_handle{r.stream}); !s) return s;
  }
  // One call over the run where the driver accepts it, else one per chunk, top down (a
  // chunk unmapped leaves the run: what is left stays kept on a failure).
  bool done = false;
  if (r.chunks.size() > 1 && batched_unmap_) {
    status s = p.unmap(page_address(first), r.pages * page_);
    if (s)
      done = true;
    else if (s.kind != failure_kind::invalid_value && s.kind != failure_kind::not_supported)
      return s;
    else
      batched_unmap_ = false;
  }
  if (!done) {
    while (!r.chunks.empty()) {
      const std::uint32_t id = r.chunks.back();
      const std::size_t pages = chunks_[id].pages;
      const std::size_t at = first + r.pages - pages;
      if (status s = p.unmap(page_address(at), pages * page_); !s) return s;
      for (std::size_t q = at; q < at + pages; ++q) page_table_[q] = no_chunk;
      chunks_[id].kept -= 1;
      va_insert(at, pages);
      r.chunks.pop_back();
      r.pages -= pages;
      kept_run_pages_ -= pages;
    }
    kept_runs_.erase(it);
    counts_.kept_runs_dropped += 1;
    return status::success();
  }
  for (std::uint32_t id : r.chunks) chunks_[id].kept -= 1;
  for (std::size_t q = first; q < first + r.pages; ++q) page_table_[q] = no_chunk;
  va_insert(first, r.pages);
  kept_run_pages_ -= r.pages;
  kept_runs_.erase(it);
  counts_.kept_runs_dropped += 1;
  return status::success();
}

void vmm_page_pool::drop_kept_runs(bool throw_on_failure, std::span<const std::uint32_t> ids) {
  for (auto it = kept_runs_.begin(); it != kept_runs_.end();) {
    const auto& chunks = it->second.chunks;
    if (!ids.empty() && std::none_of(chunks.begin(), chunks.end(), [&](std::uint32_t id) {
          return std::find(ids.begin(), ids.end(), id) != ids.end();
        })) {
      ++it;
      continue;
    }
    auto next = std::next(it);
    if (status s = drop_kept_run(it); !s) {
      counts_.unmap_failures += 1;
      if (throw_on_failure) throw_cuda_error(s, "vmm_page_pool: unmap a kept mapping");
    }
    it = next;
  }
}

void vmm_page_pool::trim_kept_runs() {
  const std::size_t cap = reserved_locked() / page_;
  while (kept_run_pages_ > cap && !kept_runs_.empty()) {
    auto oldest = std::min_element(kept_runs_.begin(), kept_runs_.end(), [](const auto& a, const auto& b) {
      return a.second.made < b.second.made;
    });
    if (!drop_kept_run(oldest)) {
      counts_.unmap_failures += 1;
      return;  // retried by the next growth
    }
  }
}

}  // namespace gpumem
