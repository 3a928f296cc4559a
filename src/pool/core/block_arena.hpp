// block_arena: the block bookkeeping shared by caching_pool and vmm_page_pool.
//
// Memory is handed to the arena as free regions; the arena carves them into blocks:
// best fit by (stream, size, segment, address) over segregated size bins (per stream, 16
// bins per power of two, two-level bitmaps: O(1) to find the first bin that can fit, then the
// smallest block in it, the earliest segment and then the lowest address on ties: segments
// are numbered in the order their owner made them, so no choice depends on where the host
// or driver placed one segment relative to another; with keep_top_for_last, the highest
// region's top only where no other block fits), split on allocation, merged with free address
// neighbours of the same segment and stream on flush. Freed blocks first go to exact-size
// quick lists (the hot path: no tree operations); quick lists are flushed into the merged
// free index when a request misses, so merging happens before the pool ever grows.
//
// Invariants (validate()):
//  - blocks of a segment tile their regions: b->next->addr == b->addr + b->size;
//  - no two address-adjacent blocks are both in the merged free index with the same stream;
//  - every free-index entry is state::free, every quick-list entry state::cached;
//  - allocated_bytes / requested_bytes / live_blocks sum the blocks in state::allocated
//    (the arena keeps no address index of them: their owner, the pool, finds them);
//  - free_bytes + cached_bytes + allocated_bytes == sum of region sizes held.
// Not thread-safe: the owning pool serializes calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <array>
#include <bit>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "pool/core/flat_map.hpp"

namespace gpumem::detail {

// The segment id of vmm_page_pool's runs of multi-page handles from huge growths, kept for
// requests that cover a handle (block_arena::restrict_segment); its other runs are
// segment 0, and caching_pool numbers its upstream segments from 1.
inline constexpr std::uint32_t whole_chunk_segment = 0xffffffffu;

struct block {
  enum class state : std::uint8_t { allocated, cached, free, recycled /* record unused */ };
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  block* prev = nullptr;        // address neighbour below, same segment (nullptr at an edge)
  block* next = nullptr;        // address neighbour above
  block* quick_next = nullptr;  // quick-list link
  block* bin_prev = nullptr;    // free-bin links (state::free only)
  block* bin_next = nullptr;
  std::uint32_t segment = 0;
  state st = state::free;
  std::uint8_t bin_level = 0;   // the free bin it is in (state::free only), so erasing
  std::uint8_t bin_sub = 0;     // it needs no recomputation
  std::uint8_t arena_id = 0;    // the owning arena's id, so a block held outside it (a
                                // thread cache) goes back to the right one
  std::uintptr_t stream = 0;    // stream whose order makes this block safe to reuse
  std::uint64_t free_epoch = 0; // the stream's free counter when it was freed (while
                                // allocated: lifetime_hints' stamp, or stale)
  std::size_t requested = 0;    // bytes the user asked for (allocated blocks)
};
// Ties between free blocks of one size go to the earlier segment, then the lower address
// (within a segment, the lower offset): an order that the placement of segments by the
// upstream allocator (host addresses on sim, the driver's on a GPU) does not change.
inline bool earlier(const block& a, const block& b) noexcept {
  return a.segment != b.segment ? a.segment < b.segment : a.addr < b.addr;
}

// block_arena::new_block resets a recycled record field by field: a new field needs a line there.
static_assert(sizeof(block) == 88, "a field was added to block: reset it in block_arena::new_block");

// Blocks of one stream binned by size: the index behind the arena's best fit and the thread
// caches' near fits. Level floor(log2(size / 512 B)), then 16 linear sub-bins; two bitmaps
// find the first non-empty bin above a size in O(1). Blocks are linked through bin_prev /
// bin_next and remember their bin (bin_level, bin_sub), so unlinking needs no search.
struct size_bins {
  static constexpr int levels = 64;
  static constexpr int sub_bins = 16;
  static constexpr std::size_t unit = 512;
  std::uintptr_t stream = 0;
  std::uint64_t level_mask = 0;                      // bit f: level f has a non-empty bin
  std::array<std::uint32_t, levels> bin_mask{};      // bit s: bin (f, s) non-empty
  std::array<std::array<block*, sub_bins>, levels> heads{};

  static void index(std::size_t size, int& level, int& sub) noexcept {
    const std::uint64_t units = std::max<std::uint64_t>(size / unit, 1);
    level = 63 - std::countl_zero(units);
    // The 4 bits below the leading one (zeros shifted in under 16 units): units << 4 >>
    // level is units >> (level - 4) or units << (4 - level) without a branch on which (with
    // mixed sizes the CPU would mispredict that branch often).
    sub = static_cast<int>(((units << 4) >> level) & 15);
  }
  bool empty() const noexcept { return level_mask == 0; }
  void insert(block* b) noexcept {
    int f, sb;
    index(b->size, f, sb);
    insert_at(b, f, sb);
  }
  // insert(), its bin (index(b->size)) already known.
  void insert_at(block* b, int f, int sb) noexcept {
    b->bin_level = static_cast<std::uint8_t>(f);
    b->bin_sub = static_cast<std::uint8_t>(sb);
    block*& head = heads[f][sb];
    b->bin_prev = nullptr;
    b->bin_next = head;
    if (head != nullptr) head->bin_prev = b;
    head = b;
    bin_mask[f] |= 1u << sb;
    level_mask |= std::uint64_t{1} << f;
  }
  void erase(block* b) noexcept {
    const int f = b->bin_level, sb = b->bin_sub;
    if (b->bin_prev != nullptr)
      b->bin_prev->bin_next = b->bin_next;
    else
      heads[f][sb] = b->bin_next;
    if (b->bin_next != nullptr) b->bin_next->bin_prev = b->bin_prev;
    b->bin_prev = b->bin_next = nullptr;
    // The bin's bit goes when it is empty, the level's when its last bin went: computed,
    // not branched on (whether a bin empties is data-dependent, so a branch on it is
    // mispredicted).
    bin_mask[f] &= ~(static_cast<std::uint32_t>(heads[f][sb] == nullptr) << sb);
    level_mask &= ~(static_cast<std::uint64_t>(bin_mask[f] == 0) << f);
  }
  // The head of the first non-empty bin above bin (level, sub): every block there is larger
  // than any block of (level, sub). nullptr when none.
  block* first_above(int level, int sub) const noexcept {
    std::uint32_t above = sub == sub_bins - 1 ? 0 : bin_mask[level] & (~0u << (sub + 1));
    if (above == 0) {
      const std::uint64_t up = level == levels - 1 ? 0 : level_mask & (~std::uint64_t{0} << (level + 1));
      if (up == 0) return nullptr;
      level = std::countr_zero(up);
      above = bin_mask[level];
    }
    return heads[level][std::countr_zero(above)];
  }
  // Calls f(block*) for every block; f may reset the block's links (read first).
  template <class F>
  void for_each(F&& f) const {
    for (std::uint64_t lv = level_mask; lv != 0; lv &= lv - 1) {
      const int l = std::countr_zero(lv);
      for (std::uint32_t subs = bin_mask[l]; subs != 0; subs &= subs - 1)
        for (block* b = heads[l][std::countr_zero(subs)]; b != nullptr;) {
          block* next = b->bin_next;
          f(b);
          b = next;
        }
    }
  }
  // Empties the bins, touching only the non-empty ones (a head is set only where its
  // bin_mask bit is): not the whole 8 KiB table, which a thread cache's drain would
  // otherwise write on every small miss.
  void clear() noexcept {
    for (std::uint64_t lv = level_mask; lv != 0; lv &= lv - 1) {
      const int l = std::countr_zero(lv);
      for (std::uint32_t subs = bin_mask[l]; subs != 0; subs &= subs - 1)
        heads[l][std::countr_zero(subs)] = nullptr;
      bin_mask[l] = 0;
    }
    level_mask = 0;
  }
};

class block_arena {
 public:
  // granularity of block sizes and addresses (512 B, like PyTorch; a power of two, else
  // std::invalid_argument). Alignments asked of the arena are powers of two. max_cached_blocks:
  // the quick lists' capacity; 0: no quick lists, a released block is merged at once (for
  // owners that keep their own exact-size caches in front, such as the pools' thread caches).
  explicit block_arena(std::uint8_t id = 0, std::size_t unit = 512,
                       std::size_t max_cached_blocks = 4096);
  ~block_arena();
  block_arena(const block_arena&) = delete;
  block_arena& operator=(const block_arena&) = delete;

  std::size_t unit() const noexcept { return unit_; }
  // Masks, not divisions: the unit is a power of two (the constructor checks), and a
  // 64-bit division costs tens of cycles on every allocation.
  std::size_t round(std::size_t bytes) const noexcept { return (bytes + unit_ - 1) & ~(unit_ - 1); }

  // Adds [addr, addr+size) as free memory of `segment` for `stream`, merging with free
  // neighbours that are address-adjacent in the same segment and stream. free_epoch: as
  // release()'s (0: safe for any stream at once; memory moved from another arena keeps
  // the epoch it was freed at there).
  void add_region(std::uintptr_t addr, std::size_t size, std::uint32_t segment,
                  std::uintptr_t stream, std::uint64_t free_epoch = 0);

  // The block [addr, addr + size) (size rounded), allocated on `stream` with `requested`
  // recorded, out of the one free block that holds that range, whichever stream freed it
  // (the caller knows that memory idle: a CUDA graph tree's checkpoint restored); the free
  // parts on either side stay free. The quick lists are flushed first. nullptr, and nothing
  // else changed, where no free block holds the whole range or `addr` is not on the unit.
  block* take_at(std::uintptr_t addr, std::size_t size, std::uintptr_t stream,
                 std::size_t requested);

  // A block of at least `size` bytes (rounded) aligned to `alignment`, on `stream`:
  // quick list first, then best fit. nullptr when nothing fits, or when the best fit is a
  // free block larger than `max_split` (left whole). `requested` is recorded. Free blocks
  // of the restricted segment (below) are skipped for smaller requests unless `any_segment`.
  block* allocate(std::size_t size, std::size_t alignment, std::uintptr_t stream,
                  std::size_t requested, std::size_t max_split = static_cast<std::size_t>(-1),
                  bool any_segment = false);
  // Free blocks of `segment` serve only requests of at least `min_request` bytes: smaller
  // ones never split them (their owner keeps memory there that a small block would pin).
  // One restricted segment per arena; min_request 0 lifts the restriction.
  void restrict_segment(std::uint32_t segment, std::size_t min_request) noexcept {
    restricted_segment_ = segment;
    restricted_min_ = min_request;
  }
  // With `on`, best fit takes the free block that ends the highest region (the top of a
  // heap that grows upwards in place) only where no other free block fits, so the top's
  // size, which says only how far the heap has grown yet, decides nothing. The tops of
  // lower regions (below unmapped holes) are fitted as any block.
  void keep_top_for_last(bool on) noexcept { top_last_ = on; }
  // Whether free block b may serve a request needing `need` bytes under the restriction.
  bool serves(const block& b, std::size_t need) const noexcept {
    return b.segment != restricted_segment_ || need >= restricted_min_;
  }
  // Best fit among free blocks of another stream that `usable` accepts (each other stream's
  // best fit is asked; work per stream with free blocks, not per block); the block is
  // re-tagged to `stream`. nullptr when none.
  block* allocate_from_other_streams(std::size_t size, std::size_t alignment,
                                     std::uintptr_t stream, std::size_t requested,
                                     const std::function<bool(const block&)>& usable);

  // Returns an allocated block; it is reusable in `stream`'s order. b's record is the
  // arena's from here on: it may be merged into a neighbour's and reused.
  void release(block* b, std::uintptr_t stream, std::uint64_t free_epoch);
  // Splits allocated block b at `at` (inside it, a multiple of the unit past its start):
  // b keeps [b->addr, at) and its requested bytes; the block returned, allocated too, holds
  // the rest, with none requested (set_requested gives it some).
  block* split_allocated(block* b, std::uintptr_t at);
  // Sets the bytes an allocated block's user asked for.
  void set_requested(block* b, std::size_t requested) noexcept;

  // Moves every quick-list block into the merged free index (merging neighbours).
  void flush();
  // Re-tags every cached and free block of stream `from` freed at an epoch up to
  // `up_to_epoch` as free on `to` at free epoch `new_epoch` (0: safe for any stream at
  // once), merging as it goes. Visits `from`'s blocks only. Returns the bytes re-tagged.
  // REQUIRES: the uses of those blocks on `from` have completed, or `to` waits for them.
  std::size_t retag_free(std::uintptr_t from, std::uintptr_t to,
                         std::uint64_t up_to_epoch = static_cast<std::uint64_t>(-1),
                         std::uint64_t new_epoch = 0);
  // The streams that free (merged) blocks are tagged with. Quick-list blocks are not
  // counted: flush() first.
  std::vector<std::uintptr_t> free_streams() const;
  // Whether any free or cached block is tagged with `stream`.
  bool holds_stream(std::uintptr_t stream);
  // Forgets the size bins of streams with no free block (a per-stream index is 8 KiB):
  // the arena's per-stream state stays proportional to the streams holding free memory.
  void drop_empty_bins();
  // Every free (merged) block, for reclaim and trim. Valid until the next mutation.
  std::vector<block*> free_blocks() const;
  // Removes [from, from+len) from free block b; the rest stays free. The removed memory is
  // no longer the arena's. Returns the free piece left below `from` (nullptr if none).
  block* carve(block* b, std::uintptr_t from, std::size_t len);

  std::size_t free_bytes() const noexcept { return free_bytes_; }
  std::size_t cached_bytes() const noexcept { return cached_bytes_; }
  std::size_t allocated_bytes() const noexcept { return allocated_bytes_; }
  std::size_t requested_bytes() const noexcept { return requested_bytes_; }
  std::size_t live_blocks() const noexcept { return allocated_blocks_; }
  std::size_t largest_free_block() const;
  // Calls f(first) for the first block of every contiguous region, by address; the
  // region's blocks follow through `next` (allocated, cached and free alike).
  template <class F>
  void for_each_region(F&& f) const {
    std::vector<const block*> firsts;
    firsts.reserve(region_start_.size());
    region_start_.for_each([&](std::uintptr_t, const block* first) { firsts.push_back(first); });
    std::sort(firsts.begin(), firsts.end(), [](const block* a, const block* b) { return a->addr < b->addr; });
    for (const block* first : firsts) f(first);
  }
  std::string validate() const;

 private:
  block* new_block();
  void delete_block(block* b);
  void insert_free(block* b);
  void erase_free(block* b);
  // A new record for [at, end of b), linked after b, which now ends at `at`; the caller
  // sets its state.
  block* cut_after(block* b, std::uintptr_t at);
  // A new record for b's first `len` bytes, linked before b, which now starts `len` later;
  // the caller sets its state and stream (b's index entry and counts are unchanged).
  block* cut_before(block* b, std::size_t len);
  // Marks b (out of the free index already) allocated on `stream` for `requested` bytes,
  // and counts it.
  block* hand_out(block* b, std::uintptr_t stream, std::size_t requested) noexcept;
  // Splits b so it starts at `at` (front part returned to the free index).
  block* take(block* b, std::size_t size, std::size_t alignment, std::uintptr_t stream,
              std::size_t requested);
  // Indexes free block b (not indexed yet), merged with its free address neighbours of
  // the same stream.
  void insert_merged(block* b);
  // Moves indexed free block b to the bin of its (changed) size, if that is another bin.
  void rebin(block* b);
  // The bins of `stream` (made when `create`), or nullptr. Inline: the last one found is
  // asked for again by most calls.
  size_bins* bins_for(std::uintptr_t stream, bool create) {
    if (last_bins_ != nullptr && last_bins_->stream == stream) return last_bins_;
    return find_bins(stream, create);
  }
  size_bins* find_bins(std::uintptr_t stream, bool create);
  // The smallest free block of `bins` with size >= need (lowest address on ties) that
  // serves `need` (or any, with any_segment).
  block* best_fit(const size_bins& bins, std::size_t need, bool any_segment) const;
  template <class F>
  void for_each_free(F&& f) const;

  std::uint8_t id_;
  std::size_t unit_;
  std::size_t max_cached_blocks_;
  // The size bins of each stream with free blocks (and of streams that had some since the
  // last drop_empty_bins), by stream.
  std::unordered_map<std::uintptr_t, std::unique_ptr<size_bins>> bins_;
  std::vector<std::unique_ptr<size_bins>> spare_bins_;  // emptied, kept for reuse (a few)
  size_bins* last_bins_ = nullptr;  // the last one found: most calls ask for it again
  std::size_t free_blocks_ = 0;
  flat_map<std::pair<std::uint64_t, std::uint64_t>, block*, mix_hash> quick_;  // (stream, size)
  std::size_t cached_blocks_ = 0;
  std::size_t allocated_blocks_ = 0;
  // Blocks at the edges of contiguous regions, by their outer address, so a region added
  // next to an existing one is linked to it (and can merge). Hash maps: a split or merge at
  // a region's edge updates one, and a look-up by exact address needs no ordered search
  // (whose branches a predictor misses).
  flat_map<std::uintptr_t, block*, mix_hash> region_start_;  // start address -> first block
  flat_map<std::uintptr_t, block*, mix_hash> region_end_;    // end address -> last block
  std::vector<block*> spare_blocks_;  // recycled block records
  std::vector<block*> all_records_;   // every record ever made, for cleanup
  std::uint32_t restricted_segment_ = 0;
  std::size_t restricted_min_ = 0;  // 0: no restriction
  bool top_last_ = false;  // keep_top_for_last
  std::size_t free_bytes_ = 0;
  std::size_t cached_bytes_ = 0;
  std::size_t allocated_bytes_ = 0;
  std::size_t requested_bytes_ = 0;
};

}  // namespace gpumem::detail
