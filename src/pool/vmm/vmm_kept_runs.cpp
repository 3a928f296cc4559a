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
#include <unordered_map>
#include <vector>

#include "gpumem/errors.hpp"
#include "pool/core/block_arena.hpp"

namespace gpumem {

void vmm_page_pool::carve_kept(reclaim_candidate& c, std::size_t take, std::size_t pages) {
  const std::size_t n = c.chunks.size();
  const std::size_t lo = chunks_[c.chunks[n - take]].mapped_at;
  const std::uint32_t segment = c.b->segment;
  arena(c.arena_id).carve(c.b, page_address(lo), pages * page_);
  notify(pool_event_kind::segment_unmap, page_address(lo), pages * page_);
  kept_run r{{}, pages, ++kept_runs_made_, 0, 0};
  for (std::size_t i = n - take; i < n; ++i) {
    chunk& k = chunks_[c.chunks[i]];
    growth_homes_.push_back({c.chunks[i], k.mapped_at, c.arena_id, segment});
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

std::vector<vmm_page_pool::home_page> vmm_page_pool::move_to_kept_pages(
    std::span<const std::pair<std::uint32_t, std::size_t>> moves, std::vector<reclaim_candidate>& found,
    const free_chunks& free_at, std::uint32_t for_arena) {
  std::vector<home_page> homes;
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
    const std::uint32_t segment = b->segment;
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
        homes.push_back({ids[q], k.mapped_at, c.arena_id, segment});
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
  return homes;
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
  std::vector<home_page> homes = move_to_kept_pages(moves, found, free_at, g.arena_id);
  note_gathered(first, run.pages, std::move(homes));
  std::uint32_t segment = 0;
  if (g.arena_id != small_arena && multi_page && huge_chunk_pages() > 1 &&
      g.size >= huge_chunk_pages() * page_)
    segment = detail::whole_chunk_segment;
  g.arena.add_region(page_address(first), run.pages * page_, segment, g.stream.value);
  notify(pool_event_kind::segment_map, page_address(first), run.pages * page_);
  return true;
}

void vmm_page_pool::note_gathered(std::size_t first, std::size_t pages, std::vector<home_page> homes) {
  // Every chunk must have a home (not a spare or new one), in the run's order.
  std::size_t covered = 0;
  for (const home_page& h : homes) covered += chunks_[h.chunk].pages;
  if (covered != pages) return;
  std::sort(homes.begin(), homes.end(), [&](const home_page& a, const home_page& b) {
    return chunks_[a.chunk].mapped_at < chunks_[b.chunk].mapped_at;
  });
  for (std::size_t at = first; const home_page& h : homes) {
    if (chunks_[h.chunk].mapped_at != at) return;
    at += chunks_[h.chunk].pages;
  }
  gathered_[first] = gathered_run{pages, std::move(homes)};
}

bool vmm_page_pool::unkeep(std::span<const std::pair<std::size_t, std::uint32_t>> pages) {
  // The kept runs holding the pages, each with the chunks leaving it.
  std::map<std::size_t, std::vector<std::uint32_t>> leaving;
  for (const auto& [page, id] : pages) {
    if (page_table_[page] != kept_page) return false;
    auto it = kept_runs_.upper_bound(page);
    if (it == kept_runs_.begin()) return false;
    --it;
    std::size_t at = it->first;
    bool found = false;
    for (std::uint32_t k : it->second.chunks) {
      if (at == page) {
        found = k == id;
        break;
      }
      at += chunks_[k].pages;
    }
    if (!found) return false;
    leaving[it->first].push_back(id);
  }
  for (auto& [first, ids] : leaving) {
    auto it = kept_runs_.find(first);
    kept_run r = std::move(it->second);
    kept_runs_.erase(it);
    kept_run_pages_ -= r.pages;
    kept_run piece{{}, 0, r.made, r.stream, r.epoch};
    std::size_t at = first, piece_first = first;
    auto close = [&] {
      if (piece.pages == 0) return;
      kept_run_pages_ += piece.pages;
      kept_runs_.emplace(piece_first, std::move(piece));
      piece = kept_run{{}, 0, r.made, r.stream, r.epoch};
    };
    for (std::uint32_t k : r.chunks) {
      if (std::find(ids.begin(), ids.end(), k) != ids.end()) {
        close();
        chunks_[k].kept -= 1;
        piece_first = at + chunks_[k].pages;
      } else {
        piece.chunks.push_back(k);
        piece.pages += chunks_[k].pages;
      }
      at += chunks_[k].pages;
    }
    close();
  }
  return true;
}

void vmm_page_pool::note_large_free(std::uint32_t arena_id, std::uintptr_t addr, std::uintptr_t stream,
                                    std::uint64_t epoch) {
  if (gathered_.empty()) return;
  const std::size_t page = (addr - va_base_) / page_;
  auto it = gathered_.upper_bound(page);
  if (it == gathered_.begin()) return;
  --it;
  const std::size_t first = it->first;
  const gathered_run& run = it->second;
  if (page >= first + run.pages) return;
  // Still the run the growth mapped: its chunks where they were put.
  for (std::size_t at = first; const home_page& h : run.homes) {
    if (chunks_[h.chunk].mapped_at != at) {
      gathered_.erase(it);
      return;
    }
    at += chunks_[h.chunk].pages;
  }
  detail::block_arena& a = arena(arena_id);
  a.flush();
  detail::block* b = a.free_block_holding(page_address(first), run.pages * page_, stream);
  if (b == nullptr) return;  // not wholly free yet
  std::vector<std::pair<std::size_t, std::uint32_t>> homes;
  for (const home_page& h : run.homes) homes.emplace_back(h.page, h.chunk);
  if (!unkeep(homes)) {
    gathered_.erase(it);  // a home was unmapped: the run stays as it is
    return;
  }
  // The run becomes a kept run; each chunk is used at its home again, free there in
  // `stream`'s order from `epoch` on.
  a.carve(b, page_address(first), run.pages * page_);
  notify(pool_event_kind::segment_unmap, page_address(first), run.pages * page_);
  kept_run kept{{}, run.pages, ++kept_runs_made_, 0, 0};
  for (const home_page& h : run.homes) {
    chunk& k = chunks_[h.chunk];
    kept.chunks.push_back(h.chunk);
    for (std::size_t p = 0; p < k.pages; ++p) {
      page_table_[first + (k.mapped_at - first) + p] = kept_page;
      page_table_[h.page + p] = h.chunk;
    }
    k.mapped_at = h.page;
    k.kept += 1;
    arena(h.arena_id).add_region(page_address(h.page), k.pages * page_, h.segment, stream, epoch);
    notify(pool_event_kind::segment_map, page_address(h.page), k.pages * page_);
  }
  kept_runs_.emplace(first, std::move(kept));
  kept_run_pages_ += run.pages;
  counts_.pages_taken_back += run.pages;
  gathered_.erase(it);
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
