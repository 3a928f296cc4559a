// vmm_page_pool: one-page physical handles lent to another mapper (the KV cache) and taken back.
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include "gpumem/errors.hpp"
#include "pool/vmm/vmm_worker.hpp"

namespace gpumem {

std::vector<physical_handle> vmm_page_pool::lend_pages(std::size_t pages) {
  std::unique_lock lock(mutex_);
  std::vector<physical_handle> out;
  if (asleep_locked())
    throw invalid_argument("vmm_page_pool::lend_pages: the pool is asleep (its tag sleeps); "
                           "wake it before lending its pages");
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
    // Memory pressure: what other streams freed may be reclaimed once they finish, and a
    // spare handle of several pages, which cannot be lent, gives its memory to one-page ones.
    reclaim(pages - have, true);
    retire_completed(true);
    have = spare_single_pages();
    if (have < pages) release_spare_locked(spare_kind::coarse);
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

}  // namespace gpumem
