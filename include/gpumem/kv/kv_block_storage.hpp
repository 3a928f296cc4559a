// kv_block_storage: equal-size device blocks at base + id * block_bytes in one virtual
// range of its own, backed by physical pages borrowed from a vmm_page_pool.
//
//  - The range is reserved once for max_blocks; pages are mapped at its bottom on demand
//    (one map per page, ONE set access per growth) and unmapped from the top on shrink(),
//    so capacity breathes with demand. Pages come from and go back to the vmm_page_pool
//    (lend_pages / return_pages): memory the cache does not hold is the pool's to use,
//    under the pool's one budget (its limit, the device).
//  - allocate() returns the lowest free id, so free blocks gather at the top, where
//    shrink() can give their pages back.
//
//  - A growth that fails undoes its maps from the top; when an unmap fails too, that page
//    and those below it stay mapped, so they stay here, without access, and are never
//    given back while mapped (the pool would map them again). The next growth grants them
//    access with its own pages; shrink() and the destructor unmap them.
//
// Invariants (validate()):
//  - accessible_pages <= mapped_pages; pages [0, accessible_pages) have access, pages
//    [accessible_pages, mapped_pages) are left by a failed undo and have none;
//  - capacity_blocks() == min(max_blocks, accessible_pages * page_size / block_bytes);
//  - an id below capacity is free (in the free set) or used, never both; none above is;
//  - mapped_pages == handles held (lent by the pool, mapped here in order).
// Not thread-safe: the owner (kv_cache) serializes calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

namespace detail {
class id_bitmap;
}

class kv_block_storage {
 public:
  using block_id = std::uint32_t;

  // grow_pages: pages mapped per growth at least (0: as few as one block needs).
  // Throws gpumem::invalid_argument for a zero or unaligned block size or max_blocks, and
  // gpumem::cuda_error when the range cannot be reserved.
  kv_block_storage(vmm_page_pool& pages, std::size_t block_bytes, std::size_t max_blocks,
                   std::size_t grow_pages = 0, stream_handle stream = {});
  ~kv_block_storage();
  kv_block_storage(const kv_block_storage&) = delete;
  kv_block_storage& operator=(const kv_block_storage&) = delete;

  // The lowest free block, growing by pages when none is free; std::nullopt when the
  // cap is reached or the pool has no memory. Throws gpumem::cuda_error on a driver
  // failure (nothing changed).
  std::optional<block_id> try_allocate();
  // Throws gpumem::invalid_argument for an id that is not a used block.
  void free(block_id id);
  bool is_used(block_id id) const noexcept;

  // Maps pages until at least `blocks` blocks exist (all or nothing); false when the cap
  // or the pool's memory does not allow it.
  bool grow_to(std::size_t blocks);
  // Unmaps the pages above the highest used block, keeping `keep_free` free blocks
  // mapped, and returns them to the pool. Waits for the stream first (a kernel may still
  // read a freed block). Returns pages given back.
  std::size_t shrink(std::size_t keep_free = 0);
  // Blocks that could still be mapped before the cap (the pool may have less memory).
  std::size_t growable_blocks() const noexcept { return max_blocks_ - capacity_; }

  std::uintptr_t base() const noexcept { return base_; }
  void* address(block_id id) const noexcept {
    return reinterpret_cast<void*>(base_ + static_cast<std::uintptr_t>(id) * block_bytes_);
  }
  std::size_t block_bytes() const noexcept { return block_bytes_; }
  std::size_t max_blocks() const noexcept { return max_blocks_; }
  std::size_t capacity_blocks() const noexcept { return capacity_; }
  std::size_t used_blocks() const noexcept { return used_count_; }
  std::size_t free_blocks() const noexcept { return capacity_ - used_count_; }
  std::size_t mapped_pages() const noexcept { return handles_.size(); }
  std::size_t accessible_pages() const noexcept { return accessible_pages_; }
  std::size_t mapped_bytes() const noexcept { return handles_.size() * page_; }
  std::size_t page_size() const noexcept { return page_; }
  std::uint64_t growths() const noexcept { return growths_; }
  std::uint64_t shrinks() const noexcept { return shrinks_; }
  std::string validate() const;

 private:
  // Unmaps mapped pages [first, mapped_pages()) from the top and returns them to the
  // pool, stopping at the first unmap that fails (that page and those below stay).
  status unmap_top(std::size_t first);
  std::size_t blocks_in(std::size_t pages) const noexcept;

  vmm_page_pool& pool_;
  platform& platform_;
  int device_;
  std::size_t block_bytes_;
  std::size_t max_blocks_;
  std::size_t grow_pages_;
  stream_handle stream_;
  std::size_t page_ = 0;
  std::uintptr_t base_ = 0;
  std::size_t range_bytes_ = 0;
  std::vector<physical_handle> handles_;  // page i of the range maps handles_[i]
  std::size_t accessible_pages_ = 0;      // handles_[0, accessible_pages_) have access
  std::unique_ptr<detail::id_bitmap> free_;
  std::vector<std::uint8_t> used_;
  std::size_t capacity_ = 0;
  std::size_t used_count_ = 0;
  std::uint64_t growths_ = 0, shrinks_ = 0;
  bool batched_unmap_ = true;
};

}  // namespace gpumem
