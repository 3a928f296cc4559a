// vmm_page_pool: growing a run: kept, reclaimed or new chunks mapped side by side in one
// virtual run with one access grant.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>
#include <span>
#include <vector>

#include "gpumem/errors.hpp"
#include "pool/core/block_arena.hpp"
#include "pool/vmm/vmm_worker.hpp"

namespace gpumem {

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
// footprint:fast extends any free block at the top of its run (it makes new pages either
// way, and the extension needs only the pages the block lacks: sim, 45 traces, 1.236
// against 1.291 geomean with the two cases alone). In footprint:tight, extending any free
// block made fragmentation worse on both shared traces (sim, 1.043-1.062 on infer). With half the request in the run, least recently freed pages
// gathered first and small runs kept at the top of the address space (place_run), tight
// pools remapped 11-71% fewer pages on sim, fragmentation within 0.001 (docs/RESULTS.md).
vmm_page_pool::extension vmm_page_pool::find_extension(const growth_request& g,
                                                      bool& retiring_after_run) const {
  extension best;
  if (g.pad != 0) return best;
  for (detail::block* b : g.arena.free_blocks()) {
    if (b->next != nullptr || b->size >= g.size || !g.arena.serves(*b, g.size)) continue;
    const bool tail = b->size < page_ && b->prev != nullptr &&
                      b->prev->st == detail::block::state::allocated;
    const bool half_run = (g.huge || g.tight) && 2 * b->size >= g.size;
    if (!tail && !half_run && !fast()) continue;
    // The tail must be this stream's: the arena hands a block only to its own stream
    // (another stream's, even if known complete, would leave the grown run unusable:
    // allocation fails, cached memory is released and the request is refused anyway).
    if (b->stream != g.stream.value) continue;
    const std::size_t end_page = (b->addr + b->size - va_base_) / page_;
    const std::size_t need = (g.size - b->size + page_ - 1) / page_;
    if (need >= g.pages) continue;  // saves nothing
    if (best.first_page != no_page && need >= best.pages) continue;
    auto run = va_free_.find(end_page);
    if (run == va_free_.end() || run->second < need) {
      // Then the worker is waited for (grow_untimed): it drains every queued unmap. Whether
      // a smaller request should rather gather is not measured (not waiting: sim maps
      // encode_varlen 3,597-4,162 against 1,987-3,233 pages a pass; no GPU run).
      retiring_after_run = retiring_after_run ||
                           (half_run && end_page < va_pages_ && page_table_[end_page] == retiring_page);
      continue;
    }
    best = {end_page, need, b->addr + b->size, b->segment};
  }
  return best;
}

// Old mappings whose work is done give their address space back first; then whether a
// free virtual run of `pages` pages exists (checked before anything else, so a failure
// leaves nothing behind), after the map worker's queued unmaps if need be.
bool vmm_page_pool::address_space_for(std::size_t pages) {
  retire_completed(false);
  va_exhausted_ = false;
  auto va_fits = [&] {
    return std::any_of(va_free_.begin(), va_free_.end(), [&](const auto& r) { return r.second >= pages; });
  };
  if (!va_fits() && worker_ != nullptr && worker_->busy()) {
    worker_->drain();  // old mappings on their way out hold address space
    collect_worker();
  }
  va_exhausted_ = !va_fits();
  return !va_exhausted_;
}

// Tight: free pages are gathered before new ones are made. footprint:fast, only where new
// pages would take the reserved bytes into the last budget_margin_share-th of the budget
// (and large requests are then not rounded); footprint:tight, wherever no growth slack is
// left. The margin: a cache that fills its budget before it gathers holds the budget, not
// the live bytes (sim, 45 traces each under a limit of 1.03x its peak live bytes:
// fragmentation geomean 1.0170 gathering past the budget, 1.0066 from the margin on, at
// 24,034 -> 32,515 warm-pass memory calls; footprint:tight 1.0073, 47,865, 2 out of memory).
bool vmm_page_pool::growth_is_tight(std::size_t size, std::size_t pages, stream_handle stream) {
  // Pages the pool holds unmapped (a reservation up front, pages kept after a gather) are
  // reserved already: only the pages still missing would raise the reserved bytes.
  const std::size_t held = spare_pages_for(stream.value);
  const std::size_t missing = pages > held ? pages - held : 0;
  const std::size_t after = reserved_locked() + missing * page_;
  const std::size_t budget = budget_locked();
  if (!fast()) {
    set_large_rounding(after <= budget);
    return split_limit(size) == static_cast<std::size_t>(-1);
  }
  const bool short_of_memory = after > budget - budget / budget_margin_share;
  set_large_rounding(!short_of_memory);
  return short_of_memory;
}

// The soft budget: within the budget, a cache that stops growing at (1 + F) x the live
// bytes' peak so far, where its free pages can be moved instead. footprint:fast's handles
// are whole growths, so only free blocks covering whole handles give pages: a gather there
// replaces a growth at about its driver time, but the next pass places its blocks anew and
// gathers too (sim, 45 traces, docs/PAGE_POOL.md "Rules measured against the goals").
bool vmm_page_pool::past_soft_budget(std::size_t size, std::size_t pages, stream_handle stream) const {
  if (!fast() || options_.soft_budget <= 0.0) return false;
  const std::size_t held = spare_pages_for(stream.value);
  const std::size_t missing = pages > held ? pages - held : 0;
  if (missing == 0) return false;
  const double after = static_cast<double>(reserved_locked() + missing * page_);
  const double live = static_cast<double>(std::max(peak_live_so_far(), live_bytes_locked() + size));
  return after > (1.0 + options_.soft_budget) * live;
}

bool vmm_page_pool::grow_untimed(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                                 std::size_t alignment, stream_handle stream, growth kind) {
  const std::size_t pad = alignment > arena.unit() ? alignment - arena.unit() : 0;
  const std::size_t pages = (size + pad + page_ - 1) / page_;
  if (!address_space_for(pages)) return false;
  const bool tight = growth_is_tight(size, pages, stream);
  const bool soft = !tight && past_soft_budget(size, pages, stream);
  const growth_request g{arena, arena_id, size, pad, pages, stream, tight,
                         options_.huge_growth_bytes != 0 && size >= options_.huge_growth_bytes};
  bool retiring_after_run = false;  // a half run's next page still retiring (map worker)
  extension ext = find_extension(g, retiring_after_run);
  if (ext.first_page == no_page && retiring_after_run && worker_ != nullptr) {
    // The address space after the run comes back once the worker has unmapped it.
    worker_->drain();
    collect_worker();
    ext = find_extension(g, retiring_after_run);
  }
  // Physical chunks: kept ones, then reclaimed ones, then new memory.
  std::size_t wanted = ext.first_page != no_page ? ext.pages : pages;
  std::size_t have = spare_pages_for(stream.value);
  const std::uint64_t first_new = made_serial_;
  // Within the growth slack: new pages rather than a gather of scattered free ones (at
  // the limit or on a full device, the gather after all).
  const bool may_create = kind == growth::any;  // held_pages_only: kept and gathered pages
  if (have < wanted && may_create && !g.tight && !soft &&
      create_chunks(wanted - have, fast() ? handle_sizes::whole_growth : handle_sizes::growth))
    have = spare_pages_for(stream.value);
  // footprint:fast within the budget gathers only past its soft budget (soft_budget), where
  // new pages cannot be had (the device is full), or for the small arena from a reservation up front (memory held so
  // that requests within it create nothing); a growth limited to held pages otherwise
  // takes kept ones alone.
  const bool reserved_up_front = options_.reserve_bytes != 0 || options_.reserve_fraction > 0;
  const bool may_gather = g.tight || soft || !fast() || kind == growth::any || reserved_up_front;
  if (have < wanted && may_gather) {
    reclaim(wanted - have, false, &stream, ext.block_end, arena_id);
    // Counted again: a reclaimed chunk may still be retiring for another stream.
    have = spare_pages_for(stream.value);
    if (ext.first_page != no_page) {  // reclaim may have cut the tail: look again
      ext = find_extension(g, retiring_after_run);
      wanted = ext.first_page != no_page ? ext.pages : pages;
    }
  }
  // Past the soft budget, what the gather left missing is one handle, as a growth within it.
  const handle_sizes rest = soft ? handle_sizes::whole_growth : handle_sizes::growth;
  if (have < wanted && (!may_create || !create_chunks(wanted - have, rest))) return false;

  std::vector<std::uint32_t> chosen;
  std::size_t covered = 0;
  if (!choose_chunks(wanted, stream.value, first_new, chosen, covered)) return false;
  bool run_extends = false;
  const std::size_t first = place_run(g, ext, covered, run_extends);
  if (first == no_page) {
    spare_.insert(spare_.end(), chosen.begin(), chosen.end());
    release_new_chunks(first_new);
    va_exhausted_ = true;
    return false;  // virtual range exhausted
  }
  if (status failed = map_chosen(chosen, first, covered); !failed.ok()) {
    release_new_chunks(first_new);
    if (failed.kind == failure_kind::out_of_memory) return false;
    throw_cuda_error(failed, "vmm_page_pool: map chunks");
  }
  // A run holding a huge growth's handles, for a request that covers one, is kept for such
  // requests (the constructor's restrict_segment); pages that extend a block join its run.
  // Not in footprint:fast, which moves pages only past its budget: there the run is part
  // of its arena's heap, so the heap stays one segment whose blocks merge across runs
  // (sim, 45 traces: the worst warm pass 23% -> 8.8% of its allocations in driver calls).
  std::uint32_t segment = 0;
  if (run_extends)
    segment = ext.segment;
  else if (arena_id != small_arena && huge_chunk_pages() > 1 && !fast() &&
           size >= huge_chunk_pages() * page_ &&
           std::any_of(chosen.begin(), chosen.end(), [&](std::uint32_t id) { return chunks_[id].pages > 1; }))
    segment = detail::whole_chunk_segment;
  arena.add_region(page_address(first), covered * page_, segment, stream.value);
  notify(pool_event_kind::segment_map, page_address(first), covered * page_);
  return true;
}

void vmm_page_pool::release_new_chunks(std::uint64_t first_new) {
  for (std::uint32_t id = 0; id < chunks_.size(); ++id) {
    chunk& c = chunks_[id];
    if (!c.live || c.made <= first_new || c.mapped_at != no_page) continue;
    if (!device_platform().release_physical(c.handle)) continue;
    sub_reserved(c.pages * page_);
    counts_.pages_created -= c.pages;
    std::erase(spare_, id);
    forget_chunk(id);
  }
}

// Choose kept chunks this stream may map, covering `wanted`: the largest that does not
// overshoot what is still missing, so a multi-page chunk is mapped only where a block
// needs all of it. Where only larger chunks are left, an idle one is released and the
// missing pages made as one-page handles: mapped whole, its extra pages would be free
// pages pinned by the block placed beside them, which no gather can move.
bool vmm_page_pool::choose_chunks(std::size_t wanted, std::uintptr_t stream, std::uint64_t first_new,
                                  std::vector<std::uint32_t>& chosen, std::size_t& covered) {
  std::sort(spare_.begin(), spare_.end(), [&](std::uint32_t a, std::uint32_t b) {
    return chunks_[a].pages < chunks_[b].pages;
  });
  auto mappable = [&](std::uint32_t id) { return mappable_for(id, stream); };
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
      sub_reserved(big.pages * page_);
      counts_.pages_released += big.pages;
      const std::uint32_t big_id = *over;
      spare_.erase(over);
      forget_chunk(big_id);
      if (create_chunks(gap, handle_sizes::one_page)) continue;  // one-page chunks, at the end of spare_
      spare_.insert(spare_.end(), chosen.begin(), chosen.end());
      release_new_chunks(first_new);
      return false;
    }
    covered += big.pages;  // not releasable now: mapped whole after all
    chosen.push_back(*over);
    spare_.erase(over);
  }
  return true;
}

// Virtual pages: right after the packed tail, else first fit, lowest address first, so
// runs land next to earlier ones and merge with them. Without packing the run must hold
// the whole request.
std::size_t vmm_page_pool::place_run(const growth_request& g, const extension& ext,
                                     std::size_t covered, bool& run_extends) {
  auto run = va_free_.end();
  if (ext.first_page != no_page) {
    run = va_free_.find(ext.first_page);
    if (run != va_free_.end() && run->second < covered) run = va_free_.end();
  }
  run_extends = run != va_free_.end();  // mapped right after the extended block
  if (run == va_free_.end() && covered >= g.pages) {
    // Not right above a free run of half a huge request or more, where possible: that
    // address space is how the run grows in place (find_extension) when it is asked for again.
    std::vector<std::size_t> kept_for_runs;
    if (options_.huge_growth_bytes != 0)
      for (std::uint32_t id : {small_arena, large_arena})
        for (detail::block* b : arena(id).free_blocks())
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
  if (run == va_free_.end()) return no_page;
  // A fresh run of the small arena, in a tight pool or footprint:fast: at the top of the
  // highest address space that fits, away from the large runs (which grow in place
  // upwards). At the lowest address it took the page right above a large free run (often
  // the page just reclaimed from that run's top) and left the run nowhere to grow. In
  // footprint:fast each arena's runs so stay one contiguous heap (the small arena's
  // growing downwards from the top), whose blocks merge across the runs.
  const bool at_top = (g.tight || fast()) && g.arena_id == small_arena && ext.first_page == no_page;
  if (at_top)
    for (auto it = std::next(run); it != va_free_.end(); ++it)
      if (it->second >= covered) run = it;
  std::size_t first = run->first;
  if (g.arena_id == long_arena && ext.first_page == no_page) {
    // A fresh run of the long arena: the lowest address space from the middle of the range
    // up, away from the other arenas' runs (which take the lowest addresses first), so the
    // next long-lived block extends it in place (packing) and shares its last page.
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
  return first;
}

status vmm_page_pool::map_chosen(std::span<const std::uint32_t> chosen, std::size_t first,
                                 std::size_t covered) {
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
  if (failed.ok()) failed = grant_access(page_address(first), covered * page_);
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
    return failed;
  }
  at = first;
  for (std::uint32_t id : chosen) {
    chunk& k = chunks_[id];
    k.mapped_at = at;
    for (std::size_t p = 0; p < k.pages; ++p) page_table_[at + p] = id;
    at += k.pages;
  }
  return status::success();
}

}  // namespace gpumem
