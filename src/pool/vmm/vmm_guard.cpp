// vmm_page_pool: guard mode: each allocation in one-page chunks of its own, ending at an
// unmapped guard page.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>

#include "gpumem/errors.hpp"

namespace gpumem {

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
  if (failed.ok()) failed = grant_access(page_address(first), pages * page_);
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
    (void)grant_access(page_address(g.first_page), g.pages * page_);
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

}  // namespace gpumem
