// tagged_pool: allocations carry a tag (a small integer), and each tag's memory can sleep
// and wake on its own, or be shared with other processes.
//
//  - Tags are placed apart by composition: tag 0 (untagged) is the pool given at
//    construction (allocations reach it through `untagged_front` when one is given: a step
//    planner in front of it); every other tag gets a vmm_page_pool of its own, made on the
//    tag's first allocation and on nothing else (a refused call, a look-up, a sleep or a
//    wake of a tag never allocated in makes nothing), with a virtual range of its own. So
//    two tags never share a page, and a tag's pool can release all its pages (sleep)
//    without touching another tag's.
//  - The pool is the registry of its tags: stats() is the sum over every tag (0 and the
//    shared tag included), trim() gives back the free pages of every tag, and an
//    allocation of any tag that runs out of memory trims every tag and tries once more
//    before it throws out_of_memory, whose report then lists what each tag holds; so does a
//    wake that finds the device full.
//  - allocate(bytes, alignment, stream, tag), or memory_resource::allocate under a
//    scoped_tag (a thread's current tag; 0 outside any). deallocate finds the tag by
//    address in a map of the tags' ranges (O(log tags)). Stats per tag: tag_stats(tag).
//  - sleep(tag, mode, stream) / wake(tag, stream): vmm_page_pool::sleep / wake on the
//    tag's pool. A tag's state is its pool's (vmm_page_pool::asleep()): a sleep of a tag
//    holding no page makes it asleep as any other, and its wake makes it awake. While a
//    tag sleeps, an allocation in it is refused with gpumem::invalid_argument
//    (allocations and sleep/wake of one tag exclude each other: a per-tag reader/writer
//    gate); frees are allowed. A tag whose pool is not a vmm_page_pool (tag 0 over a
//    caching_pool) answers gpumem::not_supported.
//  - shared_tag: allocations made with this tag each own a physical handle created
//    shareable (POSIX file descriptor), mapped in a range of their own: export_allocation
//    gives a file descriptor another process passes to import_allocation (shared_memory.hpp).
//
// Invariants (validate()): every tag's pool is valid; a tag's `asleep` mark equals its
// pool's asleep(); the range map holds exactly the ranges of the tags other than 0, each
// naming its tag; stats().live_bytes == the sum over tags.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/core/pool_base.hpp"
#include "gpumem/pool/vmm/shared_memory.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"

namespace gpumem {

// The thread's current tag, for allocations made through memory_resource::allocate (and
// so through PyTorch's allocator entry points). Nests; restores the previous tag. A thread
// that never set a tag follows the process tag (0 unless set): threads a framework starts
// for the caller, as autograd's backward thread, allocate in the tag the caller chose.
class scoped_tag {
 public:
  explicit scoped_tag(std::uint32_t tag) noexcept;
  ~scoped_tag();
  scoped_tag(const scoped_tag&) = delete;
  scoped_tag& operator=(const scoped_tag&) = delete;
  static std::uint32_t current() noexcept;
  // Sets the thread's current tag without a scope (the C API's gpumem_set_current_tag).
  static void set_current(std::uint32_t tag) noexcept;
  // Sets the process tag (gpumem_set_process_tag); returns the one it replaces.
  static std::uint32_t set_process(std::uint32_t tag) noexcept;

 private:
  std::uint32_t previous_;
  bool previous_set_;
};

// Names of tags, process-wide (a tag number means the same in every pool of the process):
// messages and reports show "train (2)" for a named tag, its number otherwise. Throws
// gpumem::invalid_argument for tag 0 or the shared tag (their names are fixed), and for a
// name that is empty, longer than max_tag_name bytes, or holds a byte outside printable
// ASCII; the tag keeps its name then. Naming a named tag again renames it.
inline constexpr std::size_t max_tag_name = 64;
void set_tag_name(std::uint32_t tag, std::string_view name);
// "shared", "0 (untagged)", "<name> (<number>)" or "<number>".
std::string tag_label(std::uint32_t tag);

class tagged_pool final : public memory_resource {
 public:
  // Allocations of this tag are shareable between processes (one handle each).
  static constexpr std::uint32_t shared_tag = 0xffffffffu;

  // Tag 0 is `untagged` (not owned: REQUIRES it outlives this object), its allocations,
  // frees and stats made through `untagged_front` when given (REQUIRES: it stands on
  // `untagged` and outlives this object); other tags get a vmm_page_pool on untagged's
  // platform and device with `options` (no reservation up front).
  tagged_pool(pool_base& untagged, pool_options options,
              memory_resource* untagged_front = nullptr);
  ~tagged_pool() override;
  std::string_view name() const noexcept override { return "tagged_pool"; }
  std::size_t max_alignment() const noexcept override;
  // Summed over every tag, 0 and the shared tag included (peaks: the sum of each tag's
  // peak, an upper bound).
  resource_stats stats() const override;
  // Gives the free memory of every tag back to the driver; returns the bytes released.
  std::size_t trim();
  // vmm_page_pool::set_keep_free for every tag's pool (the untagged one's if it is a
  // vmm_page_pool) and for the tags made later.
  void set_keep_free(std::size_t bytes);
  // One line per tag holding memory: its reserved, live and asleep state, the largest
  // first (at most `limit` lines, then a count of the rest).
  std::string describe_tags(std::size_t limit = 8) const;
  std::string validate() const override;
  void release_stream(stream_handle stream) override;

  // Throws as memory_resource::allocate, and gpumem::invalid_argument when `tag` sleeps.
  // Out of memory: every tag is trimmed and the allocation tried once more first.
  void* allocate(std::size_t bytes, std::size_t alignment, stream_handle stream, std::uint32_t tag);
  using memory_resource::allocate;
  // Runs `attempt` (an allocation); when it throws out_of_memory, continues as
  // after_out_of_memory.
  template <class F>
  void* with_memory_of_every_tag(F&& attempt) {
    try {
      return attempt();
    } catch (const out_of_memory& first) {
      return after_out_of_memory(first, attempt);
    }
  }
  // Runs `attempt`, an allocation in `tag`'s pool made past this object (the C API's
  // untagged path goes through its step planner), with the tag's gate held shared: no
  // sleep of the tag starts meanwhile. Throws gpumem::invalid_argument, running nothing,
  // while the tag sleeps; a tag never used runs it as is.
  void* while_awake(std::uint32_t tag, const std::function<void*()>& attempt);
  // `attempt` (an allocation) threw `first`: trims every tag and runs it once more when
  // that released anything; the out_of_memory thrown at last carries describe_tags() after
  // its report. For allocations made past this object too (the C API's untagged path).
  template <class F>
  void* after_out_of_memory(const out_of_memory& first, F&& attempt) {
    if (trim() == 0) throw out_of_memory(first.report() + describe_tags());
    try {
      return attempt();
    } catch (const out_of_memory& second) {
      throw out_of_memory(second.report() + describe_tags());
    }
  }

  // Which tag `ptr` (a live allocation, or any address in a tag's range) belongs to; 0 when
  // no other tag's range holds it. O(log tags).
  std::uint32_t tag_of(const void* ptr) const;
  // Whether `ptr` is the address of a live allocation of a tag other than 0: a tag's
  // block, a shared allocation or an import.
  bool is_live_tagged(const void* ptr) const;
  // Tags in use (0 first), shared_tag included once it holds something.
  std::vector<std::uint32_t> tags() const;
  resource_stats tag_stats(std::uint32_t tag) const;
  // The pools of the tags other than 0, by tag (shared_tag has none), for whole-pool
  // reports: the pointers live as long as this object.
  std::vector<std::pair<std::uint32_t, const pool_base*>> tag_pools() const;

  // Throws gpumem::invalid_argument for a double sleep, a wake without sleep, shared_tag,
  // a tag never allocated in (0 excepted: it always exists); gpumem::not_supported where
  // the tag's pool is not a vmm_page_pool; and what vmm_page_pool::sleep / wake throw
  // (after which the same call completes the step). A refusal changes nothing.
  void sleep(std::uint32_t tag, sleep_mode mode, stream_handle stream = {});
  void wake(std::uint32_t tag, stream_handle stream = {});
  bool asleep(std::uint32_t tag) const;
  // Pinned host memory held for the tag's offload sleeps (vmm_page_pool::host_bytes): 0
  // for a tag never allocated in or whose pool is not a vmm_page_pool. release_host gives
  // it back and returns its bytes (vmm_page_pool::release_host). Throws as sleep for
  // shared_tag, a tag never allocated in, a pool that is not a vmm_page_pool; and
  // gpumem::invalid_argument while the tag sleeps with offload (its bytes live there).
  std::size_t host_bytes(std::uint32_t tag) const;
  std::size_t release_host(std::uint32_t tag);

  // The page pool of `tag` for a borrower that maps pages itself (a KV cache's lend_pages,
  // in the tag's own range of pages: the tag's sleep is then refused until they are
  // returned). Made on the tag's first use as by an allocation. Throws
  // gpumem::invalid_argument for shared_tag or a tag asleep; gpumem::not_supported for
  // tag 0 over a pool that is not a vmm_page_pool.
  vmm_page_pool& page_pool(std::uint32_t tag);

  // Sharing between processes (shared_memory.hpp): export a live allocation of shared_tag,
  // import another process's into a range of this process; an import is freed (unmapped)
  // by deallocate.
  int export_allocation(void* ptr);
  void* import_allocation(int fd, std::size_t bytes);
  // The physical pages under [ptr, ptr + bytes) of a live allocation of any tag, for
  // another process (vmm_page_pool::export_pages; a shared allocation is one piece); the
  // importer maps them with import_pages, freed (unmapped) by deallocate with the pieces'
  // sum. Throws as vmm_page_pool::export_pages; gpumem::invalid_argument for an import or
  // a tag that sleeps, gpumem::not_supported for a tag whose pool has no pages to export.
  vmm_page_pool::page_export export_pages(const void* ptr, std::size_t bytes);
  void* import_pages(std::span<const int> fds, std::span<const std::size_t> bytes);
  shared_memory& sharing() noexcept { return shared_; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;

 private:
  struct tag_entry {
    pool_base* pool = nullptr;              // tag 0: untagged_; else owned
    memory_resource* front = nullptr;       // what allocations, frees and stats go through
    std::unique_ptr<pool_base> owned;
    vmm_page_pool* vmm = nullptr;           // pool, when it is one
    mutable std::shared_mutex gate;         // allocations shared, sleep / wake exclusive
    // vmm->asleep(), as of the last sleep / wake (written under the exclusive gate): read
    // by allocations without the pool's lock.
    std::atomic<bool> asleep{false};
  };
  tag_entry& entry_for_allocation(std::uint32_t tag);  // made on the tag's first allocation
  tag_entry* find(std::uint32_t tag) const;            // never makes one
  vmm_page_pool& sleeper(std::uint32_t tag, tag_entry*& e, const char* caller) const;
  std::vector<std::pair<std::uint32_t, tag_entry*>> entries() const;
  template <class F>
  static void follow_pool(tag_entry& e, F&& step);  // a copy of tags_

  pool_base& untagged_;
  pool_options options_;
  shared_memory shared_;
  mutable std::mutex tags_mutex_;  // guards the maps' shape; entries never move or die
  std::map<std::uint32_t, std::unique_ptr<tag_entry>> tags_;
  tag_entry* zero_ = nullptr;  // tags_[0]: asleep(0) is one atomic load
  // The tags' virtual ranges (tags other than 0): range base -> (range end, tag).
  std::map<std::uintptr_t, std::pair<std::uintptr_t, std::uint32_t>> ranges_;
};

}  // namespace gpumem
