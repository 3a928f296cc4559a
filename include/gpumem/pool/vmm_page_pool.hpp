// vmm_page_pool: device memory on demand from one large virtual range, backed by
// physical pages (the device's VMM granularity, 2 MiB on an H200) that are mapped only
// where blocks need them.
//
//  - The virtual range is reserved once (default 2x device memory; address space is free).
//  - Growing by N pages takes, in order: unmapped physical pages kept for reuse; whole
//    free pages reclaimed from cached free blocks anywhere in the range (unmapped there
//    and remapped here: a request never fails, nor grows reserved memory, while enough
//    free whole pages exist — the GMLake "stitching" idea); and only then new physical
//    memory, created as ONE handle of exactly the missing pages. Each page is mapped with
//    its own cuMemMap (so it can later move alone) and access is granted by one
//    cuMemSetAccess over the whole grown run.
//  - Physical memory is given back (cuMemRelease) when a handle's pages are all unused:
//    under memory pressure, past the release threshold, or on trim().
//
// Invariants (validate()):
//  - reserved_bytes == sum of live handle sizes == (mapped + spare pages) * page_size;
//  - a VA page is mapped iff some arena block covers part of it;
//  - each physical page is mapped at most once, or is in the spare list, never both.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "gpumem/pool/pool_base.hpp"

namespace gpumem {

struct vmm_page_counts {
  std::size_t page_size = 0;
  std::size_t mapped_pages = 0;
  std::size_t spare_pages = 0;        // unmapped physical pages kept for reuse
  std::size_t handles = 0;            // live physical handles
  std::uint64_t pages_created = 0;
  std::uint64_t pages_reclaimed = 0;  // unmapped from free blocks to be remapped elsewhere
  std::uint64_t pages_released = 0;   // given back to the driver
};

class vmm_page_pool final : public pool_base {
 public:
  explicit vmm_page_pool(platform& platform, int device = 0, pool_options options = {});
  ~vmm_page_pool() override;
  std::string_view name() const noexcept override { return "vmm_page_pool"; }
  std::size_t page_size() const noexcept { return page_; }
  vmm_page_counts page_counts() const;

 protected:
  bool grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
            std::size_t alignment, stream_handle stream) override;
  std::size_t release_cached() override;
  std::string describe_holdings() const override;
  std::string validate_holdings() const override;

 private:
  static constexpr std::uint32_t no_chunk = 0xffffffffu;
  struct page_ref {
    std::uint32_t chunk = no_chunk;
    std::uint32_t index = 0;  // page within the chunk's handle
  };
  struct chunk {
    physical_handle handle{};
    std::size_t pages = 0;
    std::size_t mapped = 0;
    bool live = false;
  };

  std::uintptr_t page_address(std::size_t page) const noexcept { return va_base_ + page * page_; }
  bool create_chunk(std::size_t pages);  // appends its pages to spare_
  // Unmaps up to `wanted` whole free pages out of cached free blocks into spare_.
  std::size_t reclaim(std::size_t wanted);
  void va_insert(std::size_t first, std::size_t count);

  std::size_t page_ = 0;
  std::uintptr_t va_base_ = 0;
  std::size_t va_pages_ = 0;
  std::vector<page_ref> page_table_;      // per VA page
  std::vector<page_ref> spare_;
  std::vector<chunk> chunks_;
  std::map<std::size_t, std::size_t> va_free_;  // unmapped VA: first page -> page count
  vmm_page_counts counts_{};
};

}  // namespace gpumem
