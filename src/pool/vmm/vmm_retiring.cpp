// vmm_page_pool: old mappings of remapped pages, retired once their work is complete, on the
// map worker where there is one (vmm_worker.hpp).
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

#include <algorithm>

#include "gpumem/errors.hpp"
#include "pool/vmm/vmm_worker.hpp"

namespace gpumem {

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

}  // namespace gpumem
