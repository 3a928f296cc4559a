// tagged_pool: allocations carry a tag (a small integer), and each tag's memory can sleep
// and wake on its own, or be shared with other processes.
//
//  - Tags are placed apart by composition: tag 0 (untagged) is the pool given at
//    construction; every other tag gets a vmm_page_pool of its own, made on the tag's first
//    allocation, with a virtual range of its own. So two tags never share a page, and a
//    tag's pool can release all its pages (sleep) without touching another tag's.
//  - allocate(bytes, alignment, stream, tag), or memory_resource::allocate under a
//    scoped_tag (a thread's current tag; 0 outside any). deallocate finds the tag by
//    address. Stats per tag: tag_stats(tag).
//  - sleep(tag, mode, stream) / wake(tag, stream): vmm_page_pool::sleep / wake on the
//    tag's pool. While a tag sleeps, an allocation in it is refused with
//    gpumem::invalid_argument (allocations and sleep/wake of one tag exclude each other:
//    a per-tag reader/writer gate); frees are allowed. A tag whose pool is not a
//    vmm_page_pool (tag 0 over a caching_pool) answers gpumem::not_supported.
//  - shared_tag: allocations made with this tag each own a physical handle created
//    shareable (POSIX file descriptor), mapped in a range of their own: export_allocation
//    gives a file descriptor another process passes to import_allocation (shared_memory.hpp).
//
// Invariants (validate()): every tag's pool is valid; a tag marked asleep has its pool
// asleep or mid-way (vmm_page_pool::asleep()); stats().live_bytes == the sum over tags.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/vmm/shared_memory.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

// The thread's current tag, for allocations made through memory_resource::allocate (and
// so through PyTorch's allocator entry points). Nests; restores the previous tag.
class scoped_tag {
 public:
  explicit scoped_tag(std::uint32_t tag) noexcept;
  ~scoped_tag();
  scoped_tag(const scoped_tag&) = delete;
  scoped_tag& operator=(const scoped_tag&) = delete;
  static std::uint32_t current() noexcept;
  // Sets the thread's current tag without a scope (the C API's gpumem_set_current_tag).
  static void set_current(std::uint32_t tag) noexcept;

 private:
  std::uint32_t previous_;
};

class tagged_pool final : public memory_resource {
 public:
  // Allocations of this tag are shareable between processes (one handle each).
  static constexpr std::uint32_t shared_tag = 0xffffffffu;

  // Tag 0 is `untagged` (not owned: REQUIRES it outlives this object); other tags get a
  // vmm_page_pool on untagged's platform and device with `options` (no reservation up front).
  tagged_pool(pool_base& untagged, pool_options options);
  ~tagged_pool() override;
  std::string_view name() const noexcept override { return "tagged_pool"; }
  std::size_t max_alignment() const noexcept override;
  // Summed over the tags (peaks: the sum of each tag's peak, an upper bound).
  resource_stats stats() const override;
  std::string validate() const override;
  void release_stream(stream_handle stream) override;

  // Throws as memory_resource::allocate, and gpumem::invalid_argument when `tag` sleeps.
  void* allocate(std::size_t bytes, std::size_t alignment, stream_handle stream, std::uint32_t tag);
  using memory_resource::allocate;

  // The tag's pool (made now for a new tag); nullptr for shared_tag.
  pool_base* pool_of(std::uint32_t tag);
  // Which tag `ptr` (a live allocation, or any address in a tag's range) belongs to; 0 when
  // no other tag's range holds it.
  std::uint32_t tag_of(const void* ptr) const;
  // Tags in use (0 first), shared_tag included once it holds something.
  std::vector<std::uint32_t> tags() const;
  resource_stats tag_stats(std::uint32_t tag) const;

  // Throws gpumem::invalid_argument for a double sleep, a wake without sleep, shared_tag;
  // gpumem::not_supported where the tag's pool is not a vmm_page_pool; and what
  // vmm_page_pool::sleep / wake throw (after which the same call completes the step).
  void sleep(std::uint32_t tag, sleep_mode mode, stream_handle stream = {});
  void wake(std::uint32_t tag, stream_handle stream = {});
  bool asleep(std::uint32_t tag) const;

  // Sharing between processes (shared_memory.hpp): export a live allocation of shared_tag,
  // import another process's into a range of this process; an import is freed (unmapped)
  // by deallocate.
  int export_allocation(void* ptr);
  void* import_allocation(int fd, std::size_t bytes);
  shared_memory& sharing() noexcept { return shared_; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;

 private:
  struct tag_entry {
    pool_base* pool = nullptr;              // tag 0: untagged_; else owned
    std::unique_ptr<pool_base> owned;
    vmm_page_pool* vmm = nullptr;           // pool, when it is one
    mutable std::shared_mutex gate;         // allocations shared, sleep / wake exclusive
    bool asleep = false;                    // guarded by gate
  };
  tag_entry& entry(std::uint32_t tag);      // made on first use
  tag_entry* find(std::uint32_t tag) const;
  vmm_page_pool& sleeper(std::uint32_t tag, tag_entry*& e, const char* caller);

  pool_base& untagged_;
  pool_options options_;
  shared_memory shared_;
  mutable std::mutex tags_mutex_;  // guards the map's shape; entries never move or die
  std::map<std::uint32_t, std::unique_ptr<tag_entry>> tags_;
};

}  // namespace gpumem
