// vmm_page_pool: device memory on demand from one large virtual range, backed by physical
// chunks (handles of one VMM page, 2 MiB on an H200, or of several pages for huge growths)
// mapped only where blocks need them. A growth maps kept, reclaimed (a gather: pages of
// cached free blocks whose last use is complete, unmapped there) or new chunks side by side
// into one fresh virtual run with one access grant. How it places, gathers, retires old
// mappings, lends pages and guards allocations: docs/PAGE_POOL.md. Code by concept in
// src/pool/vmm/: vmm_page_pool.cpp (chunks, release, reports), vmm_growth.cpp,
// vmm_reclaim.cpp, vmm_remap_budget.cpp, vmm_retiring.cpp (map worker), vmm_lending.cpp,
// vmm_guard.cpp.
//
// Invariants (validate()):
//  - allocations are refused (pool_base::asleep_now()) exactly while asleep();
//  - reserved_bytes == sum of live chunk sizes == (mapped + spare + lent chunk pages) * page_size,
//    less the pages of chunks asleep (sleep(): handle released, pages kept in the table);
//  - a mapped chunk's pages all name it in the page table, and are covered by arena blocks;
//  - each live chunk is mapped once, in the spare list, or lent out — exactly one of these;
//  - a retiring run's pages are marked retiring in the page table, and each chunk's
//    retiring and waiting counts equal the runs that name it.
// REQUIRES: a borrower of lent pages unmaps them before returning them or destroying the pool.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpumem/pool/core/pool_base.hpp"

namespace gpumem {

namespace detail {
class vmm_worker;
struct vmm_sleep_state;
}

// What sleep does with the bytes of the pages it releases.
enum class sleep_mode : std::uint8_t {
  offload,  // copied to pinned host memory first, restored by wake
  discard,  // dropped: after wake the memory holds unspecified bytes
};

struct vmm_page_counts {
  std::size_t page_size = 0;
  std::size_t mapped_pages = 0;
  std::size_t spare_pages = 0;        // unmapped physical pages kept for reuse
  std::size_t handles = 0;            // live physical handles
  std::size_t handle_entries = 0;     // the handle table's length: the most handles held at once
  std::uint64_t pages_created = 0;
  std::uint64_t pages_reclaimed = 0;  // unmapped from free blocks to be remapped elsewhere
  std::uint64_t pages_released = 0;   // given back to the driver
  std::size_t lent_pages = 0;         // one-page handles lent out (lend_pages)
  std::size_t pages_stranded = 0;     // left mapped by an undo whose unmap failed too
  // Unmaps of remapped pages' old mappings that failed (on the map worker or the caller's
  // thread): each run stays mapped, out of use, and is retried by the pool's next call.
  std::uint64_t unmap_failures = 0;
  // The remap budget (pool_options::remap_budget): time spent in growths that gathered
  // pages, on the pool's clock, and the growth slack in force (growth_slack, or more once
  // raised for the budget) with the number of raises.
  std::uint64_t remap_ns = 0;
  double growth_slack = 0.0;
  std::uint32_t slack_raises = 0;
  // Lifetime hints (pool_options::lifetime_hints): allocations guessed long-lived, placed
  // side by side in the long arena's runs.
  std::uint64_t long_lived_allocations = 0;
  // Pages gathered out of the long arena's free blocks for other blocks (the hints' move
  // budget, src/pool/core/lifetime_hints.hpp), and whether the hints still guess (false when
  // off, or stopped by that budget).
  std::uint64_t long_lived_pages_moved = 0;
  bool lifetime_hints_active = false;
  // Once the hints stopped: bytes of the long-lived runs' free blocks handed to the large
  // arena (no driver call: the pages stay mapped where they are).
  std::uint64_t long_lived_bytes_handed_over = 0;
};

class vmm_page_pool final : public pool_base {
 public:
  explicit vmm_page_pool(platform& platform, int device = 0, pool_options options = {});
  ~vmm_page_pool() override;
  std::string_view name() const noexcept override { return "vmm_page_pool"; }
  // The remap budget's steps of growth slack and their bound (pool_options::remap_budget).
  static constexpr double remap_slack_step = 0.01;
  static constexpr double remap_slack_max = 0.1;
  std::size_t page_size() const noexcept { return page_; }
  vmm_page_counts page_counts() const;
  // page_counts() as pool_counters (src/pool/vmm/vmm_counters.cpp).
  pool_counters counters() const override;
  // Unmaps the old mappings that wait on `stream` (after synchronizing it), then as
  // pool_base: the stream may be destroyed afterwards.
  void release_stream(stream_handle stream) override;

  // Lends `pages` one-page physical handles (all or nothing). Throws gpumem::out_of_memory
  // (with the pool's report) when neither kept, reclaimable nor new pages suffice, and
  // gpumem::invalid_argument while the pool is asleep (lending nothing).
  // REQUIRES: the borrower unmaps them before returning them or destroying the pool.
  std::vector<physical_handle> lend_pages(std::size_t pages);
  // Takes lent handles back as spare pages. Throws gpumem::invalid_argument, taking none
  // back, when one is not a handle lent by this pool.
  void return_pages(std::span<const physical_handle> handles);

  // Sleep and wake (src/pool/vmm/sleep_wake.cpp). sleep() unmaps every page still mapped
  // and releases its physical memory to the driver, after copying the bytes of pages in
  // use to pinned host memory (offload), keeping every virtual address reserved:
  // reserved_bytes drops to 0. wake() creates new physical pages, maps them at the same
  // addresses, grants access and copies the offloaded bytes back on `stream`, ordered
  // before any work queued on `stream` after it. Pointers (and CUDA graphs that captured
  // them) stay valid across the pair. Free memory: footprint:tight gives it back before it
  // sleeps; footprint:fast keeps it as cache, released uncopied and mapped again by wake
  // after the pages in use, where the budget and the device have room (the rest leaves the
  // pool), so the work after a wake does not grow the pool again.
  // From the moment sleep() takes the pool lock until a wake() completes, and while a
  // failed sleep or wake leaves pages asleep, every allocation is refused with
  // gpumem::invalid_argument (allocate, allocate_at, lend_pages; pool_base's file comment:
  // the thread caches are drained and bypassed meanwhile), so no block whose pages sleep is
  // handed out, whatever layer the request comes through (tagged_pool and the C API refuse
  // earlier too, with the tag's name). An allocation that took the lock before the sleep is
  // one the sleep sees in use. REQUIRES: before sleep(), work using the memory is queued
  // on `stream` or complete.
  // Frees while asleep are allowed: their pages are cache (fast) or given back (tight).
  // trim() while asleep drops the sleeping cache (footprint:fast), so wake maps only the
  // pages in use.
  // Throws gpumem::invalid_argument, changing nothing, for a double sleep, a wake without
  // sleep, guard or scrub mode, or pages lent out; gpumem::out_of_memory from wake() when
  // the device (or the limit) lacks room; gpumem::cuda_error when a driver call fails.
  // After a failure, part of the pages may sleep and the rest be awake: the pool is valid,
  // no byte is lost (offloaded bytes stay on the host), and the same call again completes.
  void sleep(sleep_mode mode, stream_handle stream = {});
  void wake(stream_handle stream = {});
  // Whether the pool is asleep: a sleep() completed (even one that found no page to
  // release) or left pages asleep, and no wake() has completed since. Exactly then wake()
  // is accepted and sleep() is a resumption or a double sleep.
  bool asleep() const;
  // Bytes of pages released by sleep and not yet woken.
  std::size_t sleeping_bytes() const;
  // The budget (footprint:fast): the reserved bytes near which a growth gathers free pages
  // rather than taking new ones: from the budget less a budget_margin_share-th on. The
  // budget is the smallest of the limit (pool_options::limit), the device's memory less a
  // budget_headroom_share-th, and the bytes given here (0: none, the default). A budget
  // below the reserved bytes gives the cached free pages back at once (trim), and later
  // growths gather until the reserved bytes fit it again.
  void set_budget(std::size_t bytes);
  std::size_t budget() const;
  // Device memory (the driver's free bytes) every new physical handle leaves free
  // (pool_options::keep_free; 0: none): a creation that would pass it fails as out of
  // memory, so a growth gathers or throws out_of_memory, a wake leaves the pool asleep with
  // its bytes on the host, and lend_pages throws. Costs a free-memory query per new handle.
  void set_keep_free(std::size_t bytes);
  std::size_t keep_free() const;
  static constexpr std::size_t budget_headroom_share = 32;
  static constexpr std::size_t budget_margin_share = 32;
  // A wake maps side-by-side pages as one handle only while, after it, at least a
  // plentiful_share-th of the device stays free: a merged handle's pages move and go back
  // only together, so where memory is short each page wakes as its own handle, which a
  // later gather can move and a trim or an out-of-memory retry can give back.
  static constexpr std::size_t plentiful_share = 8;
  // Pinned host memory that offload sleeps hold: the copy of the sleeping pages, and
  // between sleeps the same block kept for the next one (pinned memory is slow to get).
  // Repeated sleeps of up to the same size reuse that block, so it does not grow; a larger
  // sleep replaces it. release_host() gives it back to the driver and returns its bytes
  // (0 when none is held); the next offload sleep gets a new block. Throws
  // gpumem::invalid_argument, changing nothing, while offloaded bytes live there (an
  // offload sleep, whole or partial, not yet woken); a discard sleep holds none.
  std::size_t host_bytes() const;
  std::size_t release_host();
  // Whether `ptr` lies in this pool's virtual range.
  bool owns(const void* ptr) const noexcept {
    const auto a = reinterpret_cast<std::uintptr_t>(ptr);
    return a >= va_base_ && a < va_base_ + va_pages_ * page_;
  }
  // The physical pages under [ptr, ptr + bytes), which lies in one live allocation, for
  // another process (src/pool/vmm/vmm_export.cpp): a new close-on-exec file descriptor per
  // handle, in address order (the handles are mapped side by side), and `offset`, where
  // ptr lies from the first handle's start. The importer maps the handles in that order
  // (shared_memory::import_pieces). The handles stay the pool's: the exporter keeps the
  // allocation live while another process may still use them. Throws
  // gpumem::invalid_argument, exporting nothing, for a range that is not in one live
  // allocation, or that sleeps; gpumem::not_supported for a pool without
  // pool_options::shareable; gpumem::cuda_error when the driver refuses.
  struct page_export {
    std::vector<int> fds;
    std::vector<std::size_t> bytes;  // each handle's size, a multiple of page_size()
    std::size_t offset = 0;
  };
  page_export export_pages(const void* ptr, std::size_t bytes);
  // The pool's virtual range, reserved at construction and fixed for its lifetime.
  std::uintptr_t range_base() const noexcept { return va_base_; }
  std::size_t range_bytes() const noexcept { return va_pages_ * page_; }

 protected:
  bool grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
            std::size_t alignment, stream_handle stream, growth kind) override;
  // grow() without the remap budget's timing.
  bool grow_untimed(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                    std::size_t alignment, stream_handle stream, growth kind);
  std::size_t release_cached() override;
  std::string describe_holdings() const override;
  page_holdings page_holdings_locked() const override;
  // growth_slack: while reserved + the request stays within (1 + F) x peak live, free runs
  // over max(2 x the block, reserved / large_run_share) are not split (see pool_options).
  std::size_t split_limit(std::size_t size) const override;
  static constexpr std::size_t large_run_share = 32;
  // The remap budget's controller: each growth that gathered pages adds its time to a
  // judgement window, opened at a gather (restarted after remap_window_max_ns). Once the
  // window is remap_window_min_ns long it is judged and a new one opens (so a slow start
  // does not dilute later gathers): where its gathers took more than remap_budget of it,
  // the slack is raised by remap_slack_step for each budget's worth they took, and to at
  // least the largest gathering request's share of the peak live bytes (up to
  // remap_slack_max); unless the peak live bytes rose in it by more than a
  // remap_new_peak_share-th: then the pool is still learning the workload's size.
  static constexpr std::uint64_t remap_window_min_ns = 250'000'000;
  static constexpr std::uint64_t remap_window_max_ns = 10'000'000'000;
  static constexpr std::size_t remap_new_peak_share = 64;
  // A growth for a request of `request` bytes that gathered pages took from started_ns
  // to now.
  void note_gather_time(std::uint64_t started_ns, std::size_t request) noexcept;
  double slack_now() const noexcept { return std::max(options_.growth_slack, raised_slack_); }
  std::string validate_holdings() const override;
  std::size_t asleep_bytes_locked() const override { return sleeping_pages_locked() * page_; }
  // Why an allocation is refused while asleep: a completed sleep, or one (or a wake) that
  // failed halfway and what completes it.
  std::string asleep_refusal_locked(std::string_view caller) const override;
  void* allocate_guarded(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  bool free_guarded(std::uintptr_t addr, std::size_t bytes, stream_handle stream) override;

 private:
  static constexpr std::uint32_t no_chunk = 0xffffffffu;
  static constexpr std::size_t no_page = static_cast<std::size_t>(-1);
  // Handle sizes: one page per handle by default, so any free page can move alone (16-page
  // handles for every growth measured 1.061 fragmentation on train_llama, sim). With
  // pool_options::big_chunk_pages = N, a growth of at least 2N pages (one big allocation's
  // interior) takes handles of N pages, the rest one page: N times fewer cuMemCreate,
  // cuMemMap and cuMemUnmap calls when huge blocks come and go, at some fragmentation
  // (train_llama, sim: 1.025 with N = 16). Without it, a growth creating at least
  // huge_growth_bytes takes handles of a 16th of that (64 MiB by default): the driver's
  // access grant costs ~26-29 us per handle in the range (H200), so 512 one-page handles
  // cost 36-44 us a page to grow, 64 MiB ones 1.4-1.9 us (pool_bench). Smaller thresholds pinned free pages
  // in partly used big handles (torch_train_fixed, sim: 1.0139 from 128 MiB, 1.0104 from
  // 512 MiB, 1.0004 from 1 GiB, as with one-page handles only). A reservation up front stays
  // in one-page handles, as do lent pages and guarded allocations.
  // footprint:fast (whole_growth) makes a growth's new pages one handle, as c10 makes a
  // segment one cudaMalloc: the cold pass then pays one cuMemCreate, one cuMemMap and one
  // cuMemSetAccess per growth instead of one each (the grant ~32 us) per page (sim, 47
  // traces: 17.8x -> 1.27x c10's modelled cold driver time, geomean; fragmentation and the
  // warm pass as before: footprint:fast moves pages only near its budget). Not under a
  // limit or set_budget, nor with huge_growth:0 or big_chunk: a coarse handle gives its
  // pages back only once all of them are free, so near a budget the gather finds fewer
  // pages to move (sim, each trace under limit 1.03x its peak: 31 of 47 out of memory with
  // coarse handles, none with one-page ones). Handles stay within a growth_room_share-th of
  // the budget's room left (create_chunks), so they shrink as a device without a limit fills,
  // and are one page where less than a plentiful_share-th of the device would stay free.
  enum class handle_sizes { one_page, growth, whole_growth, reservation };
  static constexpr std::size_t growth_room_share = 32;
  bool whole_growth_handles() const noexcept {
    return fast() && options_.huge_growth_bytes != 0 && options_.big_chunk_pages == 0 &&
           options_.limit_bytes == 0 && budget_set_ == 0;
  }
  struct chunk {
    physical_handle handle{};
    std::size_t pages = 0;
    std::size_t mapped_at = no_page;  // first VA page, or no_page when spare
    bool live = false;
    bool lent = false;                // handed out by lend_pages
    std::uint32_t retiring = 0;       // old mappings not yet unmapped (retiring_ runs)
    std::uint32_t waiting = 0;        // of those, ones whose last use may still be running
    std::uintptr_t only_stream = 0;   // while waiting != 0: the one stream that may map it
    std::uint64_t made = 0;           // made_serial_ when created: which growth made it
  };
  // An old mapping of remapped chunks, unmapped once work on `stream` up to free `epoch`
  // is complete (work_pending false), by the map worker where there is one (queued).
  struct retiring_run {
    std::size_t first_page = 0;
    std::vector<std::pair<std::uint32_t, std::size_t>> chunks;  // chunk id, pages, in order
    std::size_t pages = 0;
    std::uintptr_t stream = 0;
    std::uint64_t epoch = 0;
    bool work_pending = true;  // its chunks count it in `waiting`
    bool queued = false;       // with the map worker, as `token`
    bool worker_failed = false;  // its unmap failed on the worker: retried by the caller
    std::uint64_t token = 0;
  };
  static constexpr std::uint32_t retiring_page = 0xfffffffeu;  // page_table_: a retiring page

  std::uintptr_t page_address(std::size_t page) const noexcept { return va_base_ + page * page_; }
  // The constructor's reservation (pool_options::reserve): created in one-page chunks and
  // mapped as one free run of the large arena; on failure what it took is given back,
  // with the range, and the error thrown.
  void reserve_up_front(std::size_t reserve);
  // Creates chunks for `pages` pages (sized as above) into spare_; false (and
  // nothing kept of this call, but a chunk the undo could not release: it stays spare)
  // when the device or the limit has no room. Throws gpumem::cuda_error likewise.
  bool create_chunks(std::size_t pages, handle_sizes sizes);
  // Pages in each handle of a huge growth (huge_growth bytes / 16); 1 where there are none
  // (huge_growth:0, or big_chunk set: then every growth has its own handle size).
  std::size_t huge_chunk_pages() const noexcept {
    if (options_.big_chunk_pages != 0 || options_.huge_growth_bytes == 0) return 1;
    return std::max<std::size_t>(1, options_.huge_growth_bytes / 16 / page_);
  }
  std::size_t spare_pages() const;
  std::size_t spare_single_pages() const;
  // Unmaps chunks lying wholly inside cached free blocks into spare_, until `wanted`
  // pages are reclaimed. Returns the pages reclaimed. A block's memory is unmapped only
  // once its last use is complete: without `wait`, blocks whose free is not yet known
  // complete (event query) are skipped; with `wait`, every stream is synchronized first.
  // With `same_stream`, blocks freed on that stream whose last use is not yet known
  // complete are taken too, their old mapping left to retire (docs/PAGE_POOL.md). The free block
  // ending at `keep_end` (the run a growth extends in place) is left whole. `for_arena`:
  // the arena a growth gathers for (pages it takes from another arena's runs are moved
  // pages), or arena_count for none (a loan, a release).
  std::size_t reclaim(std::size_t wanted, bool wait, const stream_handle* same_stream = nullptr,
                      std::uintptr_t keep_end = 0, std::uint32_t for_arena = arena_count);
  // A cached free block whose chunks lie wholly inside it: what reclaim may take.
  struct reclaim_candidate {
    std::uint32_t arena_id;
    detail::block* b;
    std::vector<std::uint32_t> chunks;  // wholly inside b, by ascending address
    std::size_t pages = 0;
    bool deferred = false;              // old mapping retires later (same-stream remap)
  };
  std::vector<reclaim_candidate> reclaim_candidates(bool wait, const stream_handle* same_stream,
                                                    std::uintptr_t keep_end);
  // Carves c's top `take` chunks (`pages` pages) out of its block now, as a retiring run
  // whose old mapping is unmapped later (retire_completed, or the map worker).
  void carve_retiring(reclaim_candidate& c, std::size_t take, std::size_t pages);
  // Unmaps c's top `take` chunks (`pages` pages) and carves them out: the pages reclaimed
  // (on a driver failure, those of the top chunks that were unmapped) and the failure.
  std::pair<std::size_t, status> unmap_and_carve(reclaim_candidate& c, std::size_t take,
                                                 std::size_t pages);
  // Counts pages reclaimed from `from_arena`'s free blocks for `for_arena` (as reclaim).
  void note_reclaimed(std::uint32_t from_arena, std::uint32_t for_arena, std::size_t pages) noexcept;
  // Unmaps the retiring runs whose work is complete (with `wait`: after synchronizing their
  // streams, all of them, the worker's failures retried here). A failed unmap keeps its run
  // mapped and is counted (unmap_failures); with `wait` it also throws gpumem::cuda_error,
  // without, the next call retries it. only_stream: just that stream's runs.
  void retire_completed(bool wait, const std::uintptr_t* only_stream = nullptr);
  // Spare chunks a growth for `stream` may map (chunks whose old mapping's work may still
  // run are excluded for other streams; an old mapping merely not yet unmapped is no bar:
  // a handle may be mapped twice).
  bool mappable_for(std::uint32_t chunk, std::uintptr_t stream) const {
    return chunks_[chunk].waiting == 0 || chunks_[chunk].only_stream == stream;
  }
  // Map worker: queues the unmap of a run whose work is complete, one call per mapping
  // (false: no worker, or the worker failed it before, so the caller unmaps it itself);
  // collects finished unmaps (their address space comes back; a failed one is counted and
  // left to the caller's thread, never thrown: the call collecting it may not need it);
  // stops using the worker (after it finished its queue).
  bool queue_unmap(retiring_run& r);
  // Queues the runs a growth's gather held back (hold_unmaps_): every run ready for the
  // worker and not queued yet.
  void queue_held_unmaps();
  // A retiring run's top chunk, now unmapped: its address space comes back.
  void drop_top_chunk(retiring_run& r);
  void collect_worker();
  void stop_worker() noexcept;
  std::size_t spare_pages_for(std::uintptr_t stream) const;
  // Unmaps the adjacent mapped chunks `chunk_ids` (ascending addresses): one cuMemUnmap
  // over the run when the driver accepts it, else one per chunk from the top down.
  // Returns how many chunks, counted from the top, are unmapped, and the failure if any.
  std::pair<std::size_t, status> unmap_run(std::span<const std::uint32_t> chunk_ids);
  void va_insert(std::size_t first, std::size_t count);

  // A growth's request (grow_untimed) and the steps it is made of (vmm_growth.cpp).
  struct growth_request {
    detail::block_arena& arena;
    std::uint32_t arena_id;
    std::size_t size, pad, pages;  // the request, the alignment's padding, the pages both need
    stream_handle stream;
    bool tight;  // no growth slack left (split_limit): take free pages before new ones
    bool huge;   // huge_growth bytes or more
  };
  // A free block at the top of its mapped run that the growth extends in place.
  struct extension {
    std::size_t first_page = no_page;  // the unmapped page right after it
    std::size_t pages = 0;             // the pages it lacks
    std::uintptr_t block_end = 0;      // the extended block's end (reclaim leaves it whole)
    std::uint32_t segment = 0;         // the extended block's: the new pages join it
  };
  // The extension needing the fewest pages, or none (first_page == no_page). Sets
  // `retiring_after_run` when a half run's next page is still retiring on the map worker.
  extension find_extension(const growth_request& g, bool& retiring_after_run) const;
  // Moves spare chunks this stream may map, covering `wanted` pages, into `chosen`; false
  // (chosen handed back, this growth's new chunks released) when that fails.
  bool choose_chunks(std::size_t wanted, std::uintptr_t stream, std::uint64_t first_new,
                     std::vector<std::uint32_t>& chosen, std::size_t& covered);
  // Takes `covered` pages of free address space for the growth; its first page, or no_page.
  std::size_t place_run(const growth_request& g, const extension& ext, std::size_t covered,
                        bool& run_extends);
  // Maps `chosen` side by side from `first`, with one access grant; on failure undoes it
  // (chunks back to spare_, but stranded ones) and returns the failure.
  status map_chosen(std::span<const std::uint32_t> chosen, std::size_t first, std::size_t covered);
  // A new physical handle of `bytes`: exportable with pool_options::shareable while the
  // platform makes such handles (after it answers not_supported or invalid_value, plain
  // ones: the pool keeps working, export_pages of those pages says not_supported).
  result<physical_handle> create_handle(std::size_t bytes);
  bool shareable_refused_ = false;
  // Releases the chunks from `first_new` on that are spare (a failed growth's new ones).
  // Releases the spare chunks made after made_serial_ was `first_new`.
  void release_new_chunks(std::uint64_t first_new);
  std::uint32_t new_chunk_id();
  void forget_chunk(std::uint32_t id) noexcept;

  std::size_t budget_locked() const noexcept;
  // Whether a growth of `pages` pages for a block of `size` gathers free pages before it
  // makes new ones (vmm_growth.cpp); sets the large requests' rounding for the budget.
  bool growth_is_tight(std::size_t size, std::size_t pages, stream_handle stream);
  // footprint:fast with pool_options::soft_budget: whether a growth of `pages` pages for a
  // block of `size` would take the reserved bytes past (1 + soft_budget) x the live bytes'
  // peak so far (or the live bytes with the request, if more): then it gathers the free
  // pages of whole handles before it makes new ones (vmm_growth.cpp).
  bool past_soft_budget(std::size_t size, std::size_t pages, stream_handle stream) const;
  // Whether the virtual range has a free run of `pages` pages for a growth (vmm_growth.cpp);
  // sets va_exhausted_ when not.
  bool address_space_for(std::size_t pages);
  bool fast() const noexcept { return options_.footprint == footprint_mode::fast; }

  std::size_t page_ = 0;
  std::size_t budget_set_ = 0;  // set_budget's bytes (0: none)
  std::size_t keep_free_ = 0;   // set_keep_free's bytes, from pool_options::keep_free_bytes
  std::uintptr_t va_base_ = 0;
  std::size_t va_pages_ = 0;
  std::vector<std::uint32_t> page_table_;  // per VA page: the chunk mapped there, or no_chunk
  std::vector<std::uint32_t> spare_;       // unmapped live chunks
  // Chunk ids index chunks_; the id of a chunk that leaves the pool (forget_chunk) is
  // taken again by the next one made (new_chunk_id), so the table is as long as the most
  // chunks held at once, not every chunk ever made.
  std::vector<chunk> chunks_;
  std::vector<std::uint32_t> free_ids_;
  std::uint64_t made_serial_ = 0;
  std::vector<retiring_run> retiring_;
  struct guarded_allocation {
    std::size_t first_page = 0, pages = 0;  // mapped; first_page + pages is the guard page
    std::size_t bytes = 0;
  };
  std::unordered_map<std::uintptr_t, guarded_allocation> guarded_;
  std::map<std::size_t, std::size_t> va_free_;  // unmapped VA: first page -> page count
  // The last growth failed for want of a free virtual run (the range, va_reserve, is
  // exhausted or too cut up): the out-of-memory report says so.
  bool va_exhausted_ = false;
  vmm_page_counts counts_{};
  double raised_slack_ = 0.0;           // growth slack raised for the remap budget
  std::uint64_t window_start_ns_ = 0;   // the budget's judgement window (0: none open)
  std::uint64_t window_remap_ns_ = 0;   // gathers' time in it
  std::size_t window_peak_live_ = 0;    // peak live bytes when it opened
  std::size_t window_largest_gather_ = 0;  // the largest request that gathered in it
  std::unordered_map<std::uint64_t, std::uint32_t> lent_;  // lent handle -> chunk
  bool batched_unmap_ = true;  // cleared the first time the driver refuses a multi-mapping unmap
  std::unique_ptr<detail::vmm_worker> worker_;  // null: unmaps on the caller's thread
  std::uint64_t next_token_ = 0;
  // Set while a growth runs (map worker only): reclaim and retire_completed (without
  // `wait`) leave the old mappings' unmaps for the end of the growth (queue_held_unmaps),
  // so the worker does not unmap while this thread creates, maps and grants access: the
  // driver serializes them, and a map beside the worker's unmaps took ~21-25 us on the
  // H200, ~1 us alone (vmm_worker.hpp).
  bool hold_unmaps_ = false;
  // Sleep and wake's state (null until the first sleep): which chunks sleep, their host
  // copies. A sleeping chunk stays live with its pages in the page table, its handle
  // released (reserved bytes exclude it).
  std::unique_ptr<detail::vmm_sleep_state> sleep_;
  bool sleeping_locked() const noexcept;  // some chunk sleeps (wholly or mid-way)
  bool asleep_locked() const noexcept;    // asleep(): a sleep completed, or chunks sleep
  void forget_sleeping_chunks() noexcept;  // the destructor's: sleeping chunks are not live
  // Ends the refusal of allocations (pool_base::allow_allocations_locked) unless asleep:
  // how sleep() and wake() leave the pool, whether they complete or throw.
  void allow_allocations_if_awake_locked() noexcept;
  std::size_t sleeping_pages_locked() const noexcept;
  // sleep()'s and wake()'s steps (sleep_wake.cpp). REQUIRES: mutex_ held, sleep_ != null.
  std::vector<std::uint32_t> chunks_to_sleep_locked() const;
  void stage_host_copy_locked(std::span<const std::uint32_t> ids,
                              const std::unordered_map<std::uint32_t, std::vector<bool>>& partly_free,
                              bool resuming, stream_handle stream);
  void offload_and_retire_locked(std::span<const std::uint32_t> ids,
                                 const std::unordered_map<std::uint32_t, std::vector<bool>>& partly_free,
                                 stream_handle stream);
  void copy_to_host_locked(std::span<const std::uint32_t> ids,
                           const std::unordered_map<std::uint32_t, std::vector<bool>>& partly_free,
                           stream_handle stream);
  void retire_sleeping_locked(std::span<const std::uint32_t> ids);
  void release_sleeping_chunk_locked(std::uint32_t id);
  std::vector<bool> free_chunks_locked();
  // For each chunk of `ids` of more than one page that is partly under free blocks: which
  // of its pages lie wholly under them (true) and which hold live bytes. Chunks wholly
  // free or wholly in use are left out.
  std::unordered_map<std::uint32_t, std::vector<bool>> partly_free_pages_locked(
      std::span<const std::uint32_t> ids);
  void split_released_chunks_locked();
  std::uint32_t split_released_chunk_locked(std::uint32_t id, std::size_t at);
  std::vector<std::uint32_t> take_cache_locked(std::vector<std::uint32_t>& ids);
  enum class spare_kind : std::uint8_t { all, coarse };  // coarse: of more than one page
  std::size_t release_spare_locked(spare_kind which = spare_kind::all);
  void wake_runs_locked(std::span<const std::uint32_t> order, stream_handle stream, bool live);
  std::size_t drop_sleeping_cache_locked(std::span<const std::uint32_t> ids);
  void wake_chunk_locked(std::uint32_t id, stream_handle stream, bool restore);
  std::size_t wake_run_length_locked(std::span<const std::uint32_t> order, std::size_t i,
                                     bool restore) const;
  bool wake_run_locked(std::span<const std::uint32_t> run, stream_handle stream, bool restore);
};

}  // namespace gpumem
