// What every caching pool shares: two block arenas (small requests and large ones, so
// small blocks never pin large free runs), stream-ordered reuse, the out-of-memory
// sequence, stats and the OOM report. Subclasses supply memory (grow) and give it back
// (release_cached).
//
// Allocation, in order: an exact-size block freed earlier on the same stream; the best
// free fit on the same stream; after merging cached blocks, again; a block freed on
// another stream whose free is known complete (event) or made so (stream wait, when
// configured); grow; release cached memory and grow again; else out_of_memory.
//
// Stream-ordered reuse: a block freed on stream S is reused at once by S. Another stream
// T takes it only when an event recorded on S after the free has completed, or (policy
// wait) after T has been made to wait on that event. No block is handed out earlier.
// Before the pool grows, free blocks of other streams whose last use is known complete
// become the requesting stream's (merged with its free neighbours), and under memory
// pressure every stream holding free blocks is synchronized first: whichever stream frees,
// free memory merges, so reserved bytes stay bounded by the peak live bytes as with frees
// on the allocation's stream.
//
// A stream destroyed while the pool still holds blocks freed on it (without release_stream)
// has its work taken as finished once the platform no longer knows it: destroy a stream
// after its work is done, or release_stream it first, which waits for it.
//
// Streams: the pool checks a stream the first time it meets it (the platform names its
// device; a query legal inside a CUDA graph capture); one the platform does not know, or
// one of another device, is refused with gpumem::invalid_argument before anything changes. Per-stream state (an event, the free counter) is kept for streams that hold
// free blocks and dropped for the others as their number grows: no operation scans every
// stream ever seen.
//
// Invariants (validate()):
//  - reserved_bytes == what the subclass holds from the driver;
//  - allocated + cached + free (arenas) <= reserved;
//  - live requested bytes == sum of requested sizes of live blocks;
//  - memory_segments(): the blocks of each segment tile it (sizes sum to its size), and
//    the segments' sizes sum to the bytes the arenas hold (allocated + cached + free).
//
// Threads (pool_options::thread_cache, on by default): each thread has a cache in front of
// the pool (src/pool/core/thread_cache.hpp) holding the live allocations it made and the blocks
// of small requests it freed, by (stream, size). A small allocation that finds such a
// block, and a free of a small pointer this thread allocated, take only that cache's lock,
// never the pool's: threads do not serialize on the pool in the steady state. Everything
// else takes the pool lock, large requests always (their blocks merge at once, never held
// back); there, every cache is drained into the arenas (where its blocks merge) when an arena
// cannot serve a request, before the pool grows, trims or gives memory back (with size
// classes, a small request first grows its arena from pages the pool holds), and reports
// count cached blocks as cached. The fast path is off with guard, scrub, a release
// threshold or an observer attached (each needs every call), and while the pool sleeps.
//
// Sleep (vmm_page_pool::sleep): from the moment a sleep takes the pool lock until a wake
// completes (or while a failed sleep or wake leaves pages released), every allocation is
// refused under the pool lock with gpumem::invalid_argument (allocate, allocate_at), and
// the fast path is off with every thread cache drained into the arenas: no block whose
// pages sleep is handed out, whichever path or layer the request comes through. Frees stay
// allowed.
// validate() and the reports are exact when no call is in flight on another thread.
//
// Observation: set_observer() attaches a pool_observer (telemetry's event recorder) told
// of every alloc, free, segment map/unmap and OOM; with none attached the cost is one
// predictable branch per operation.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/core/detail/pool_state.hpp"
#include "gpumem/pool/core/overhead.hpp"
#include "gpumem/pool/core/pool_clock.hpp"
#include "gpumem/pool/core/pool_mutex.hpp"
#include "gpumem/pool/core/pool_observer.hpp"
#include "gpumem/pool/pool_options.hpp"

namespace gpumem {

namespace detail {
class block_arena;
struct block;
struct thread_cache;
class lifetime_hints;
}

// One live allocation, for reports ("the biggest live allocations").
struct live_allocation {
  std::uintptr_t address = 0;
  std::size_t requested = 0;
  std::size_t size = 0;
  std::uintptr_t stream = 0;
};

// One block of a segment, for snapshots.
struct memory_block {
  enum class state : std::uint8_t { allocated, cached, free };
  std::uintptr_t address = 0;
  std::size_t size = 0;       // bytes the block spans (rounded)
  std::size_t requested = 0;  // bytes the user asked for; 0 unless allocated
  std::uintptr_t stream = 0;
  state st = state::free;
};

// A contiguous run of pool memory: an upstream segment (caching_pool) or a run of mapped
// pages (vmm_page_pool, expandable: it grows and shrinks page by page).
struct memory_segment {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  bool small = false;       // every block in the small-request arena
  bool expandable = false;  // mapped on demand (vmm_page_pool)
  std::vector<memory_block> blocks;  // by address; sizes sum to `size`
};

// Counters a pool keeps beyond resource_stats, read through pool_base::counters(): the
// physical pages of a pool made of pages (has_pages), and every counter by the name
// gpumem_pool_counter reads it by (the page fields among them).
struct pool_counter {
  std::string_view name;  // a literal: valid for the program's lifetime
  std::uint64_t value = 0;
  // A count (pages, calls, bytes, time): a pool made of several (tags) reports the sum of
  // its parts'. Otherwise a setting or state (page size, slack, on/off): the main part's.
  bool summed = true;
};
struct pool_counters {
  bool has_pages = false;
  std::size_t page_size = 0;
  std::size_t mapped_pages = 0;
  std::size_t spare_pages = 0;  // unmapped physical pages kept for reuse
  std::size_t handles = 0;      // live physical handles
  std::uint64_t pages_created = 0;
  std::uint64_t pages_reclaimed = 0;  // unmapped from free blocks to be remapped elsewhere
  std::uint64_t pages_released = 0;   // given back to the driver
  std::vector<pool_counter> named;
};

class pool_base : public memory_resource {
 public:
  ~pool_base() override;
  resource_stats stats() const override;
  std::string validate() const override;
  std::size_t max_alignment() const noexcept override { return alignment_limit_; }
  const pool_options& options() const noexcept { return options_; }
  // The devices granted access to the pool's mapped pages: its own first, then the peers
  // pool_options::peer_access names (each checked to reach it when the pool was made).
  std::span<const int> access_devices() const noexcept { return access_devices_; }

  // Gives cached memory back to the driver (everything not handed out, where the
  // subclass can). Returns bytes released.
  std::size_t trim();
  // Allocates `bytes` at exactly `ptr`, out of the pool's free memory there, as an
  // allocation of `bytes` on `stream` (freed as any other): what restoring a CUDA graph
  // tree's checkpoint needs, where memory freed since must be allocated again at its old
  // address. The caller knows the memory there idle on every stream. Throws
  // gpumem::invalid_argument, changing nothing, where the range is not wholly free in one
  // block (allocated, given back to the driver, or never the pool's), and
  // gpumem::not_supported in guard mode.
  void* allocate_at(void* ptr, std::size_t bytes, stream_handle stream);
  void release_stream(stream_handle stream) override;
  // Throws gpumem::invalid_argument, changing nothing, unless `stream` is one the platform
  // knows on this pool's device (the check allocate and deallocate make; `caller` names the
  // call in the message). For layers in front of the pool whose own paths reach the
  // platform with the stream before the pool sees it (step_planner's planned frees).
  void check_stream(stream_handle stream, std::string_view caller);
  // Bytes in one arena (small requests, or large ones): handed out (rounded), cached in
  // exact-size lists, and free (merged).
  struct arena_bytes {
    std::size_t allocated = 0, cached = 0, free = 0;
  };
  arena_bytes bytes_in_arena(bool small) const;
  // The largest free block (merged), bytes.
  std::size_t largest_free_block() const;
  // Live allocations, biggest first (at most `limit`).
  std::vector<live_allocation> biggest_live(std::size_t limit) const;
  // The OOM report text for a request of `bytes` (what out_of_memory carries).
  std::string memory_report(std::size_t bytes) const;
  // Every segment with all its blocks (allocated, cached and free), by address.
  std::vector<memory_segment> memory_segments() const;
  // The pool's own counters (pool_counters); none (has_pages false, no names) by default.
  virtual pool_counters counters() const { return {}; }
  // Where the reserved bytes go now, part by part (pool/core/overhead.hpp), read under the lock.
  overhead_breakdown overhead() const;
  // Calls fn(segments) with the pool's mutex held, so what fn reads from the pool's
  // observer matches the segments exactly (no operation runs in between).
  // REQUIRES: fn does not call into this pool.
  void inspect(const std::function<void(const std::vector<memory_segment>&)>& fn) const;
  // Peak of the rounded bytes handed out (block sizes, as PyTorch's allocated_bytes).
  std::size_t peak_allocated_block_bytes() const;
  // Streams the pool keeps state for now (the default stream included).
  std::size_t tracked_streams() const;

  // Frees live allocation `ptr` (allocated with `bytes`) except the ranges in `keep`, which
  // become live allocations of their own (each freed later with its own size): the rest
  // is reusable in `stream`'s order at once. A step planner's region, left while a few
  // planned tensors live in it, goes back this way. keep: by address, apart, inside the
  // allocation, each starting at a multiple of 512 bytes. Returns false, changing nothing,
  // where the pool cannot (guard or scrub mode); throws gpumem::invalid_argument, changing
  // nothing, for an unknown pointer, a wrong size or bad ranges.
  struct kept_range {
    std::uintptr_t address = 0;
    std::size_t bytes = 0;
  };
  bool free_except(void* ptr, std::size_t bytes, stream_handle stream,
                   const std::vector<kept_range>& keep);

  // Whether allocations are refused now because the pool sleeps (see the file comment):
  // one relaxed load, for layers in front of the pool that hand out its memory themselves
  // (step_planner's region). What it reads is written under the pool lock; a caller that
  // must not race a sleep rechecks with check_awake.
  bool asleep_now() const noexcept { return asleep_.load(std::memory_order_relaxed); }
  // Throws gpumem::invalid_argument, the pool's own refusal naming `caller`, while the pool
  // sleeps; returns otherwise. Takes the pool lock.
  void check_awake(std::string_view caller) const;

  // Attaches `observer` (nullptr detaches). REQUIRES: it outlives the pool or is
  // detached first. Throws gpumem::invalid_argument when another observer is attached.
  void set_observer(pool_observer* observer);
  pool_observer* observer() const;

  // The clock the pool judges its remap time against (pool_options::remap_budget);
  // nullptr: the host's steady clock (the default). REQUIRES: it outlives the pool or is
  // replaced first.
  void set_clock(const pool_clock* clock);

 protected:
  pool_base(platform& platform, int device, pool_options options, std::size_t alignment_limit);

  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) final;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) final;

  // What a growth may use: any memory, or only physical pages the pool holds (kept
  // unmapped, or gathered from other arenas' free runs): no new ones, so the reserved bytes
  // stay (a pool whose every growth is new memory cannot grow so).
  enum class growth { any, held_pages_only };
  // Adds memory to `arena` so a block of `size` bytes aligned to `alignment` fits on
  // `stream`. Returns false when the device (or the limit) has no more, or when `kind`
  // forbids what it would take; throws gpumem::cuda_error on other driver failures, after
  // undoing partial work.
  virtual bool grow(detail::block_arena& arena, std::uint32_t arena_id, std::size_t size,
                    std::size_t alignment, stream_handle stream, growth kind) = 0;
  // Gives back what can be given; returns bytes released. REQUIRES: mutex_ held.
  virtual std::size_t release_cached() = 0;
  // Subclass-specific lines for the report (segments, pages...). REQUIRES: mutex_ held.
  virtual std::string describe_holdings() const = 0;
  // The page by which free bytes can be given back (0: by whole segment) and the bytes of
  // physical memory held unmapped, for the overhead breakdown. REQUIRES: mutex_ held.
  struct page_holdings {
    std::size_t page_size = 0;
    std::size_t kept_unmapped = 0;
    // Mapped physical handles of more than one page, as (address, bytes): each gives its
    // pages back only together, once none of them holds a live or cached block.
    std::vector<std::pair<std::uintptr_t, std::size_t>> multi_page_handles;
  };
  virtual page_holdings page_holdings_locked() const { return {}; }
  virtual std::string validate_holdings() const { return {}; }
  // Bytes of the arenas' memory whose pages sleep (vmm_page_pool::sleep): released to the
  // driver, so not reserved, while their blocks stay in the arenas. REQUIRES: mutex_ held.
  virtual std::size_t asleep_bytes_locked() const { return 0; }
  // Sleep (vmm_page_pool::sleep): refuse_allocations_locked() refuses every allocation
  // from now on, turns the thread caches' fast path off and drains them into the arenas
  // (so a sleep sees their blocks as free); it may throw what a drain throws (the pool
  // stays valid, the refusal in force). allow_allocations_locked() ends both. The refusal's
  // text is asleep_refusal_locked's. REQUIRES: mutex_ held.
  void refuse_allocations_locked();
  void allow_allocations_locked() noexcept;
  virtual std::string asleep_refusal_locked(std::string_view caller) const;
  // Guard mode (pool_options::guard; vmm_page_pool only): an allocation of its own pages
  // with an unmapped page after it. nullptr: out of memory. REQUIRES: mutex_ held.
  // Hooks rather than a policy object: guard mode places pages in the page pool's own
  // virtual ranges, page table and spare handles, under this mutex.
  virtual void* allocate_guarded(std::size_t bytes, std::size_t alignment, stream_handle stream) {
    (void)bytes, (void)alignment, (void)stream;
    throw invalid_argument("guard mode is an option of the vmm_page_pool only");
  }
  // Frees a guarded allocation; false when addr is not one (the caller then diagnoses).
  // Throws gpumem::invalid_argument for a size mismatch. REQUIRES: mutex_ held.
  virtual bool free_guarded(std::uintptr_t addr, std::size_t bytes, stream_handle stream) {
    (void)addr, (void)bytes, (void)stream;
    return false;
  }

  // REQUIRES: mutex_ held. Subclasses update it as they take and return memory.
  void add_reserved(std::size_t bytes);
  void sub_reserved(std::size_t bytes);
  std::size_t reserved_locked() const noexcept { return stats_.reserved_bytes; }
  std::size_t peak_reserved_locked() const noexcept { return stats_.peak_reserved_bytes; }
  // Waits for outstanding work on every stream that has freed blocks (before memory
  // that such blocks occupy is unmapped or freed). REQUIRES: mutex_ held.
  void synchronize_streams_with_free_blocks();
  // Is the last use of free block `b` known complete, without waiting? (An event is
  // recorded on its stream if needed and queried.) REQUIRES: mutex_ held.
  bool free_known_complete(const detail::block& b);
  // Are blocks freed on `stream` up to free number `epoch` known complete (no waiting)?
  // REQUIRES: mutex_ held.
  bool free_known_complete(std::uintptr_t stream, std::uint64_t epoch) {
    return free_is_complete(stream, epoch, nullptr);
  }
  // How the shared paths use the free space of a pool whose segments cannot be remapped
  // (caching_pool). The default, all off, suits a pool that remaps pages instead
  // (vmm_page_pool). Set by the subclass constructor, before any allocation.
  struct fixed_segments_policy {
    // Small requests may take free space of the large arena before the pool grows (so an
    // up-front reservation serves every size).
    bool small_may_use_large_arena = false;
    // Where they may: the piece of a large free block a small miss moves into the small
    // arena (move_free_piece), so the small requests after it are served there, through
    // the thread caches' class lists; 0: none moved, each small miss takes its block from
    // the large arena itself.
    std::size_t small_piece_bytes = 0;
    // For the out-of-memory report: what the user can do when the pool's free bytes would
    // hold the request but no free run does ("" when nothing).
    std::string_view advice_when_free_is_split;
  };
  void set_fixed_segments_policy(const fixed_segments_policy& policy) noexcept {
    fixed_segments_ = policy;
  }
  // Moves the first `bytes` of the smallest free block of arena `from` on `stream` that holds
  // them (and that a request of `bytes` may split: block_arena::restrict_segment) into
  // arena `to`, as a free region of the same segment, freed at the same epoch. false when
  // no such block. REQUIRES: mutex_ held.
  bool move_free_piece(std::uint32_t from, std::uint32_t to, std::size_t bytes, stream_handle stream);
  // Moves every wholly free region of the small arena (a piece moved there, or a small
  // segment) to the large arena, merged there with its free neighbours of the same
  // segment. Whether any moved. REQUIRES: mutex_ held.
  bool return_free_small_regions();
  // The largest free block a request for a block of `size` bytes may split; past it the
  // pool grows instead (vmm_page_pool's growth_slack), and splits only when growing fails.
  // REQUIRES: mutex_ held.
  virtual std::size_t split_limit(std::size_t size) const {
    (void)size;
    return static_cast<std::size_t>(-1);
  }
  // The pool's clock (set_clock), in nanoseconds. REQUIRES: mutex_ held.
  std::uint64_t now_ns() const noexcept { return clock_->now_ns(); }
  // Peak live (requested) bytes so far: exact while one thread uses the pool; each other
  // thread's cache may hold back up to stats_slack.
  std::size_t peak_live_so_far() const noexcept {
    return live_totals_.peak_live.load(std::memory_order_relaxed);
  }
  // Live (requested) bytes now: the shared totals, the locked paths' counts and every
  // thread cache's pending bytes. REQUIRES: mutex_ held.
  std::size_t live_bytes_locked() const;

  // Gives every thread cache's freed blocks back to the arenas (before reclaiming free
  // memory); keep_small: those of the large arena only. REQUIRES: mutex_ held.
  void drain_thread_caches(bool keep_small = false);

  detail::block_arena& arena(std::uint32_t id) { return *arenas_[id]; }
  const detail::block_arena& arena(std::uint32_t id) const { return *arenas_[id]; }
  static constexpr std::uint32_t small_arena = 0;
  static constexpr std::uint32_t large_arena = 1;
  // Large requests guessed long-lived (use_lifetime_hints): their blocks side by side.
  static constexpr std::uint32_t long_arena = 2;
  static constexpr std::uint32_t arena_count = 3;
  std::uint32_t arena_for(std::size_t bytes) const noexcept {
    return bytes <= options_.small_threshold ? small_arena : large_arena;
  }

  void set_alignment_limit(std::size_t limit) noexcept { alignment_limit_ = limit; }
  // Whether large requests are rounded up (pool_options::round_large; on by default). A
  // pool short of memory turns it off: the rounding costs up to 1/round_waste_share of the
  // live bytes, more than a cap a little above them leaves. REQUIRES: mutex_ held (large
  // requests read it under the lock).
  void set_large_rounding(bool on) noexcept { large_rounding_ = on; }
  // From now on, large requests guessed long-lived (src/pool/core/lifetime_hints.hpp) go to the
  // long arena, in 512-byte units (their tails share pages with the next long-lived block),
  // and the large arena may take the long arena's free blocks before it grows. The
  // subclass places the long arena's memory (vmm_page_pool: runs of their own). Call from
  // the subclass constructor.
  void use_lifetime_hints();
  // Allocations guessed long-lived so far. REQUIRES: mutex_ held.
  std::uint64_t long_lived_allocations_locked() const noexcept { return long_lived_allocations_; }
  // Pages' bytes a growth took from the long arena's free blocks (the hints' move budget),
  // and whether the hints still guess. REQUIRES: mutex_ held.
  void note_long_lived_moved(std::size_t bytes) noexcept;
  bool lifetime_hints_active_locked() const noexcept;
  // Bytes of the long arena's free blocks handed to the large arena after the hints
  // stopped (hand_over_long_lived_free). REQUIRES: mutex_ held.
  std::uint64_t long_lived_bytes_handed_over_locked() const noexcept {
    return long_lived_bytes_handed_over_;
  }

  // Tells the observer, if any. REQUIRES: mutex_ held. Segment events say stream 0: a
  // segment is not tied to a stream here (its blocks carry their own stream order).
  void notify(pool_event_kind kind, std::uintptr_t address, std::size_t size,
              std::uintptr_t stream = 0) const noexcept {
    if (observer_ != nullptr) [[unlikely]]
      observer_->on_event(pool_event{kind, address, size, stream});
  }

  mutable pool_mutex mutex_;
  pool_options options_;

  // Grants access_devices() read/write access over mapped pages [va, va+size), in one
  // platform call: the one place a pool builds its access list.
  status grant_access(std::uintptr_t va, std::size_t size) {
    return device_platform().set_access_for(access_devices_, va, size);
  }

 private:
  // Fills access_devices_ from options_ (constructor): throws for a bad peer_access.
  void resolve_access_devices();
  std::vector<int> access_devices_;
  static const steady_pool_clock steady_clock_;
  const pool_clock* clock_ = &steady_clock_;  // guarded by mutex_

  // mine_if_known: this thread's cache when the caller found it (else it is looked up, or
  // made, under the lock).
  // Records b, just allocated for `bytes` on `stream`, live in `mine`: counted, observed;
  // returns its address. REQUIRES: mutex_ held.
  void* hand_out_locked(detail::thread_cache& mine, detail::block* b, std::size_t bytes,
                        stream_handle stream);
  void* allocate_locked(std::size_t bytes, std::size_t alignment, stream_handle stream,
                        detail::thread_cache* mine_if_known);
  void deallocate_locked(std::uintptr_t addr, std::size_t bytes, stream_handle stream);
  // Makes sure `stream` is one the platform knows, of this pool's device (asked the first
  // time); throws gpumem::invalid_argument, changing nothing, when it is not.
  // REQUIRES: mutex_ held.
  void check_stream_locked(stream_handle stream, std::string_view caller);
  // Free blocks of streams other than `to` whose frees are known complete (wait: after
  // synchronizing those streams) become `to`'s, merged with its free neighbours; the
  // per-stream state of streams left with no free block is dropped. Whether any moved.
  // stream_wait (as policy cross_stream:wait always does): every free block of the other
  // streams becomes `to`'s, `to` made to wait on the GPU for their frees.
  // Throws gpumem::cuda_error when the platform fails (nothing moved for that stream).
  // REQUIRES: mutex_ held.
  bool reclaim_other_streams_free(std::uintptr_t to, bool wait, bool stream_wait = false);
  // Free blocks of streams whose frees are known complete become the default stream's,
  // safe at once; then the state of streams that hold no free block in any arena is dropped
  // (their events kept for reuse, a few). Called as the number of streams doubles, so its
  // scan is amortized. REQUIRES: mutex_ held (thread caches' blocks of dropped streams may
  // stay: they get a fresh state when they come back).
  void prune_stream_states();
  // Removes live allocation `addr` from the cache recording it (this thread's, then the
  // others') and counts it freed: its block, or nullptr when none records it. Throws
  // gpumem::invalid_argument on a size mismatch (the message begins with `caller`), or
  // cuda_error when `scrub` (zero the block on `stream` first) fails; either leaves it
  // live. REQUIRES: mutex_ held.
  detail::block* take_live_locked(std::uintptr_t addr, std::size_t bytes, stream_handle stream,
                                  bool scrub, std::string_view caller);
  detail::block* allocate_slow(std::uint32_t arena_id, std::size_t size, std::size_t alignment,
                      stream_handle stream, std::size_t requested);
  // wanted_by: the stream that would reuse the memory (policy wait, or stream_wait, makes it
  // wait); nullptr: only ask whether the free is complete.
  bool free_is_complete(std::uintptr_t freed_on, std::uint64_t epoch, const stream_handle* wanted_by,
                        bool stream_wait = false);
  std::string report_locked(std::size_t bytes) const;
  std::vector<memory_segment> segments_locked() const;
  overhead_breakdown overhead_locked() const;
  // Why addr is not a live allocation of this pool (interior, double free, another
  // owner's, unknown). REQUIRES: mutex_ held.
  std::string diagnose_locked(std::uintptr_t addr) const;
  static std::string hex_address(std::uintptr_t addr);

  // The block size serving a request: 512-byte units; a small request's size class while
  // small_classes_on(); with pool_options::round_large, a large
  // request (over small_threshold) whose tail past a multiple of it is over half of one is
  // rounded up to the next multiple (a loss under half a unit), while the bytes lost to
  // rounding stay within 1/round_waste_share of the live bytes (so a workload of requests
  // just over half a unit past a multiple cannot waste more than that share). `mine` (may be null) is the
  // calling thread's cache, whose unpublished bytes count too.
  static constexpr std::size_t round_waste_share = 32;
  bool large_rounding_ = true;  // set_large_rounding; guarded by mutex_
  std::size_t block_size_for(std::size_t bytes, const detail::thread_cache* mine) const noexcept;
  // Whether small requests are rounded to size classes: pool_options::small_classes, while
  // the thread caches are on. The classes serve the caches; with the caches off
  // (thread_cache:off, guard, scrub, an observer attached) a block merges at once when
  // freed and the rounding would only waste its excess.
  bool small_classes_on() const noexcept {
    return options_.small_classes != 0 && fast_path_.load(std::memory_order_relaxed);
  }
  // Without size classes: the largest block a thread cache may hand out for a request of
  // `bytes` served by blocks of `size`: up to 1/near_fit_share larger (no split, no pool
  // lock when sizes vary), while the bytes handed out beyond the live bytes stay within
  // 1/round_waste_share of them. (Classes are further apart than 1/near_fit_share: with
  // them a block serves its own class only.)
  static constexpr std::size_t near_fit_share = 16;
  std::size_t near_fit_limit(std::size_t bytes, std::size_t size,
                             const detail::thread_cache& mine) const noexcept;
  // This thread's cache of this pool, or nullptr when it has none yet (no lock taken).
  detail::thread_cache* this_thread_cache() const noexcept;
  // This thread's cache, made on first use. REQUIRES: mutex_ held.
  detail::thread_cache& cache_for_this_thread_locked();
  // An allocated block handed back: it is reusable in `stream`'s order. REQUIRES: mutex_.
  void release_to_arena_locked(detail::block* b, std::uintptr_t stream);
  void release_to_arena(detail::block* b, std::uintptr_t stream);  // takes the pool mutex
  // A free of a block `c` (this thread's cache) holds the record of, to the arena.
  void free_to_arena(detail::thread_cache& c, std::uintptr_t addr, std::size_t bytes, stream_handle stream);
  // The block of live allocation `addr` recorded in c, if freed with the size it was
  // allocated with: removed from c's records and counted as freed; else nullptr, c intact.
  // REQUIRES: c.mutex held, or c's owner holding mutex_.
  template <bool locked>
  detail::block* forget_live(detail::thread_cache& c, std::uintptr_t addr, std::size_t bytes) noexcept;
  // Counts an allocation (`allocated`) or a free of live bytes (requested, rounded block)
  // in c. A cache publishes to the shared totals once its unpublished bytes pass
  // stats_slack either way (no shared write per call); the peaks count the calling cache's
  // unpublished bytes at once, so they are exact while one thread uses the pool and can
  // miss up to stats_slack per other thread with more. The direction is a template
  // argument: each call site then has no branch on it (with mixed sizes a branch on the
  // sign, at a shared call, is mispredicted often). REQUIRES: c.mutex held;
  // `locked`: mutex_ held too, and a publish goes to live_totals_'s locked_* counts.
  template <bool allocated, bool locked = false>
  void count(detail::thread_cache& c, std::size_t requested, std::size_t block) noexcept;
  // Adds to the shared totals and raises the peaks.
  void publish(std::int64_t requested, std::int64_t block) noexcept;
  // publish(), into the totals mutex_ guards. REQUIRES: mutex_ held.
  void publish_locked(std::int64_t requested, std::int64_t block) noexcept;
  static constexpr std::int64_t stats_slack = std::int64_t{4} << 20;
  // Bytes of blocks allocated in all arenas (live, or freed into thread caches), and the
  // largest free block of any arena. REQUIRES: mutex_ held.
  std::size_t allocated_in_arenas_locked() const;
  std::size_t largest_free_locked() const;
  // Every live allocation of the arenas (not guarded ones), unordered. REQUIRES: mutex_.
  std::vector<live_allocation> live_list_locked() const;

  std::unique_ptr<detail::block_arena> arenas_[arena_count];
  std::unique_ptr<detail::lifetime_hints> hints_;  // null: every large request in large_arena
  std::uint64_t long_lived_allocations_ = 0;       // guarded by mutex_
  std::uint64_t long_lived_bytes_handed_over_ = 0;  // guarded by mutex_
  // After the hints stopped: the long arena's free blocks whose last use is complete
  // become the large arena's. REQUIRES: mutex_ held.
  void hand_over_long_lived_free();
  // Thread caches: made under mutex_, never destroyed before the pool (a thread that
  // exits leaves its cache, drained like the others). Threads find theirs through a
  // thread-local slot naming the pool by pool_id_, unique for the process lifetime, so a
  // slot left by a destroyed pool never matches a later one.
  const std::uint64_t pool_id_;
  const bool fast_path_allowed_;          // by the options, fixed at construction
  // Read on every call, written rarely: on a line of their own, away from the totals.
  alignas(64) std::atomic<bool> fast_path_{false};  // allowed, no observer, not asleep
  // Allocations refused (the pool sleeps); written under mutex_ (refuse_allocations_locked).
  std::atomic<bool> asleep_{false};
  // fast_path_ from its reasons: the options, the observer, the sleep. REQUIRES: mutex_ held.
  void update_fast_path_locked() noexcept {
    fast_path_.store(fast_path_allowed_ && observer_ == nullptr &&
                         !asleep_.load(std::memory_order_relaxed),
                     std::memory_order_relaxed);
  }
  std::vector<std::unique_ptr<detail::thread_cache>> caches_;
  std::unordered_map<std::thread::id, detail::thread_cache*> cache_of_thread_;
  // Shared totals of live bytes and their peaks, on a line of their own (pool_state.hpp).
  detail::live_totals live_totals_;
  using live_and_held = detail::live_and_held;
  // Live (requested) and handed-out block bytes: the shared totals, the locked paths'
  // counts and what `mine` (may be null) has not published. An estimate while other
  // threads run (their pending bytes are left out).
  live_and_held totals(const detail::thread_cache* mine) const noexcept;
  // Sums of the totals, the locked paths' counts and every cache's pending bytes.
  // REQUIRES: mutex_ held.
  std::size_t block_bytes_locked() const;
  std::size_t guarded_live_bytes_ = 0;  // requested bytes of live guarded allocations
  std::size_t guarded_live_count_ = 0;
  detail::stream_states streams_;  // guarded by mutex_
  // The state of `stream`, made when new. REQUIRES: mutex_ held.
  detail::stream_state& stream_state_of(std::uintptr_t stream) {
    if (streams_.last_state == nullptr || streams_.last != stream) {
      auto it = streams_.states.find(stream);
      if (it == streams_.states.end()) {
        if (streams_.states.size() >= streams_.prune_at) prune_stream_states();
        it = streams_.states.try_emplace(stream).first;
      }
      streams_.last_state = &it->second;
      streams_.last = stream;
    }
    return *streams_.last_state;
  }
  std::size_t alignment_limit_;
  // reserved bytes and their peak, retries, OOMs, guarded allocation counts; the rest of
  // the stats live in the atomics above and the thread caches.
  resource_stats stats_{};
  pool_observer* observer_ = nullptr;
  detail::recent_frees recent_frees_;  // guarded by mutex_
  fixed_segments_policy fixed_segments_;  // set before any allocation, then read only
};

}  // namespace gpumem
