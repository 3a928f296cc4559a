#include "gpumem/kv/kv_block_storage.hpp"

#include <algorithm>

#include "gpumem/errors.hpp"
#include "gpumem/platform/status_error.hpp"
#include "kv/id_bitmap.hpp"

namespace gpumem {

kv_block_storage::kv_block_storage(vmm_page_pool& pages, std::size_t block_bytes,
                                   std::size_t max_blocks, std::size_t grow_pages,
                                   stream_handle stream)
    : pool_(pages),
      platform_(pages.device_platform()),
      device_(pages.device()),
      block_bytes_(block_bytes),
      max_blocks_(max_blocks),
      grow_pages_(grow_pages),
      stream_(stream),
      page_(pages.page_size()) {
  if (block_bytes == 0 || block_bytes % 256 != 0)
    throw invalid_argument("kv_block_storage: block size " + std::to_string(block_bytes) +
                           " must be a non-zero multiple of 256 bytes");
  if (max_blocks == 0 || max_blocks > (std::size_t{1} << 31))
    throw invalid_argument("kv_block_storage: max_blocks " + std::to_string(max_blocks) +
                           " must be between 1 and 2^31");
  // Bounded by the device: address space is free, but not unlimited.
  if (max_blocks > 4 * pages.device_total_bytes() / block_bytes)
    throw invalid_argument("kv_block_storage: " + std::to_string(max_blocks) + " blocks of " +
                           format_bytes(block_bytes) + " exceed four times the device's memory");
  range_bytes_ = (max_blocks * block_bytes + page_ - 1) / page_ * page_;
  auto r = platform_.reserve_range(range_bytes_, page_);
  if (!r) throw_cuda_error(r.error(), "kv_block_storage: reserve the virtual range");
  base_ = r.value();
  free_ = std::make_unique<detail::id_bitmap>(max_blocks);
  used_.assign(max_blocks, 0);
  handles_.reserve(range_bytes_ / page_);
}

kv_block_storage::~kv_block_storage() {
  // Never throws. The stream may still read blocks: let it finish before unmapping.
  (void)platform_.stream_synchronize(stream_);
  if (!handles_.empty() && !unmap_top(0).ok()) {
    // Order no longer matters: try every page left, giving back each one that unmaps. A
    // page that stays mapped is never given back (the pool would map it again); the pool
    // releases its handle at its end.
    std::vector<physical_handle> unmapped;
    for (std::size_t i = 0; i < handles_.size(); ++i)
      if (platform_.unmap(base_ + i * page_, page_)) unmapped.push_back(handles_[i]);
    pool_.return_pages(unmapped);
  }
  (void)platform_.free_range(base_, range_bytes_);
}

bool kv_block_storage::is_used(block_id id) const noexcept {
  return id < capacity_ && used_[id] != 0;
}

std::optional<kv_block_storage::block_id> kv_block_storage::try_allocate() {
  std::size_t id = free_->lowest();
  if (id == detail::id_bitmap::npos) {
    if (!grow_to(capacity_ + 1)) return std::nullopt;
    id = free_->lowest();
  }
  free_->erase(id);
  used_[id] = 1;
  ++used_count_;
  return static_cast<block_id>(id);
}

void kv_block_storage::free(block_id id) {
  if (!is_used(id))
    throw invalid_argument("kv_block_storage: block " + std::to_string(id) +
                           (id < capacity_ ? " is not in use (double free?)"
                                           : " does not exist (capacity " +
                                                 std::to_string(capacity_) + " blocks)"));
  used_[id] = 0;
  free_->insert(id);
  --used_count_;
}

std::size_t kv_block_storage::blocks_in(std::size_t pages) const noexcept {
  return std::min(max_blocks_, pages * page_ / block_bytes_);
}

bool kv_block_storage::grow_to(std::size_t blocks) {
  if (blocks <= capacity_) return true;
  if (blocks > max_blocks_) return false;
  const std::size_t have = handles_.size();
  const std::size_t need_pages = (blocks * block_bytes_ + page_ - 1) / page_;
  const std::size_t max_pages = range_bytes_ / page_;
  // Pages an earlier undo left mapped without access count towards this growth; so
  // end > accessible_pages_ (blocks > capacity_).
  // grow_pages_ may be anything up to SIZE_MAX: bounded by the range before the sum.
  const std::size_t end = std::max(
      have, std::min(max_pages, std::max(need_pages,
                                         accessible_pages_ + std::min(grow_pages_, max_pages))));
  std::vector<physical_handle> lent;
  try {
    lent = pool_.lend_pages(end - have);
  } catch (const out_of_memory&) {
    return false;
  }
  // Map page by page (a handle maps from its start only), then one access grant over
  // every page without access.
  const std::uintptr_t first = base_ + have * page_;
  std::size_t mapped = 0;
  status failed;
  for (; mapped < lent.size(); ++mapped) {
    if (auto s = platform_.map(first + mapped * page_, page_, lent[mapped], 0); !s) {
      failed = s;
      break;
    }
  }
  if (failed.ok())
    failed = platform_.set_access(device_, base_ + accessible_pages_ * page_,
                                  (end - accessible_pages_) * page_);
  if (!failed.ok()) {
    // Undo from the top, stopping at the first unmap that fails: that page and those
    // below it stay mapped, so they stay ours (contiguous, without access) and are never
    // given back while mapped: the pool would map them again.
    std::size_t kept = mapped;
    while (kept > 0 && platform_.unmap(first + (kept - 1) * page_, page_)) --kept;
    const auto split = lent.begin() + static_cast<std::ptrdiff_t>(kept);
    handles_.insert(handles_.end(), lent.begin(), split);
    pool_.return_pages({split, lent.end()});
    if (failed.kind == failure_kind::out_of_memory) return false;
    throw_cuda_error(failed, "kv_block_storage: map pages");
  }
  handles_.insert(handles_.end(), lent.begin(), lent.end());
  accessible_pages_ = handles_.size();
  const std::size_t new_capacity = blocks_in(accessible_pages_);
  for (std::size_t id = capacity_; id < new_capacity; ++id) free_->insert(id);
  capacity_ = new_capacity;
  ++growths_;
  return true;
}

status kv_block_storage::unmap_top(std::size_t first) {
  const std::size_t count = handles_.size() - first;
  if (count == 0) return status::success();
  std::size_t unmapped = 0;  // counted from the top
  status failed;
  if (count > 1 && batched_unmap_) {
    status s = platform_.unmap(base_ + first * page_, count * page_);
    if (s) {
      unmapped = count;
    } else if (s.kind == failure_kind::invalid_value || s.kind == failure_kind::not_supported) {
      batched_unmap_ = false;  // this driver wants one call per mapping
    } else {
      failed = s;
    }
  }
  if (unmapped == 0 && failed.ok()) {
    for (std::size_t i = handles_.size(); i-- > first; ++unmapped)
      if (auto s = platform_.unmap(base_ + i * page_, page_); !s) {
        failed = s;
        break;
      }
  }
  const std::size_t keep = handles_.size() - unmapped;
  pool_.return_pages({handles_.begin() + static_cast<std::ptrdiff_t>(keep), handles_.end()});
  handles_.resize(keep);
  accessible_pages_ = std::min(accessible_pages_, keep);
  return failed;
}

std::size_t kv_block_storage::shrink(std::size_t keep_free) {
  // The highest used block bounds what must stay mapped.
  std::size_t top = capacity_;
  while (top > 0 && used_[top - 1] == 0) --top;
  // keep_free may be anything up to SIZE_MAX: compared, never added past capacity.
  const std::size_t keep_blocks = keep_free >= capacity_ - top ? capacity_ : top + keep_free;
  const std::size_t keep_pages = (keep_blocks * block_bytes_ + page_ - 1) / page_;
  if (keep_pages >= handles_.size()) return 0;
  if (auto s = platform_.stream_synchronize(stream_); !s)
    throw_cuda_error(s, "kv_block_storage: wait for the stream before unmapping");
  const std::size_t before = handles_.size();
  const status failed = unmap_top(keep_pages);
  const std::size_t new_capacity = blocks_in(accessible_pages_);
  for (std::size_t id = new_capacity; id < capacity_; ++id) free_->erase(id);
  capacity_ = new_capacity;
  ++shrinks_;
  if (!failed.ok()) throw_cuda_error(failed, "kv_block_storage: unmap pages");
  return before - handles_.size();
}

std::string kv_block_storage::validate() const {
  if (accessible_pages_ > handles_.size()) return "more pages accessible than mapped";
  if (capacity_ != blocks_in(accessible_pages_))
    return "capacity disagrees with the accessible pages";
  std::size_t used = 0;
  for (std::size_t id = 0; id < max_blocks_; ++id) {
    const bool is_free = free_->contains(id);
    if (id >= capacity_) {
      if (is_free || used_[id] != 0) return "a block above capacity is free or used";
      continue;
    }
    if (is_free == (used_[id] != 0)) return "a block is both free and used, or neither";
    used += used_[id];
  }
  if (used != used_count_) return "used block count disagrees";
  return {};
}

}  // namespace gpumem
