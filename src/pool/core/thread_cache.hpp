// thread_cache: one thread's front end to a pool, the fast path that takes no pool lock.
//
// It holds
//  - the live allocations this thread made, address -> (block, requested bytes), so a free
//    on the same thread finds its block without the pool's lock; and
//  - blocks of small requests (up to pool_options::small_threshold) this thread freed, per
//    stream and arena: in one list per size class with classes on (below), else binned by
//    size (a size_bins, the index behind the arena's best fit). A block freed on stream S
//    is handed out again only for S, at once (stream order makes that safe), never for
//    another stream. Without classes, a request takes the smallest kept block that fits
//    within `max_size` (exact sizes first): a near fit saves the pool's locked path when
//    sizes vary, and the caller bounds the waste.
//
// Large requests' blocks are never kept: freed, they go to their arena at once and merge
// with their free neighbours. Held back unmerged, they split the free runs that later
// large requests need whole, and vmm_page_pool then remaps pages to gather runs: more
// driver time, more page maps and more memory held, even when a thread keeps only one.
//
// With size classes for small requests (pool_options::small_classes, the default), the
// small blocks a cache keeps are bounded by bytes (small_bytes_limit) and stay through a
// miss of the small arena that pages the pool holds serve (pool_base::allocate_slow).
// Every block a small request gets is then of a class size, and a block serves only its
// own class (neighbouring classes are more than 1/near_fit_share apart), so the cache keeps
// one LIFO list per class instead of size bins: a push or a pop is a few loads and stores,
// where the bins recompute a bin, keep back links and two bitmaps. A block of another size (made while the classes were off,
// an observer attached) is not kept: it goes to its arena.
//
// Blocks kept here stay `allocated` in their arena: the arena does not see them, and
// nothing here writes a block field the arena reads for an allocated block (only the bin
// links and bin index, which the arena uses for its own free blocks alone). A small
// request's block may come from the large arena (caching_pool lets small requests use its
// free space): it is kept all the same and goes back to the arena it came from. The pool
// drains the freed blocks back into the arenas, with the pool lock held, before it merges,
// grows, trims or gives memory back.
//
// Locking: `mutex` guards everything here. The owner thread takes it on each operation
// (uncontended in the steady state: this is what makes threads scale); the pool takes it,
// with the pool mutex held, to drain, search or inspect. So the owner, while it holds the
// pool mutex, needs no cache lock: every other thread reaches a cache only through the
// pool mutex (the locked paths use this: one lock per call, not two). Lock order: pool
// mutex, then a cache's mutex; no one takes the pool mutex while holding a cache's.
// keeping() and the request window are the owner's alone (read and written by it only).
#pragma once

#include <array>
#include <atomic>
#include <bit>
#include <memory>
#include <vector>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <utility>

#include "pool/core/block_arena.hpp"
#include "pool/core/flat_map.hpp"

namespace gpumem::detail {

// The cache's lock. Its owner takes it on every call and other threads rarely (a drain,
// a free from another thread), so it is almost never contended: then one atomic exchange
// and a store, where std::mutex costs two read-modify-writes and two calls into libc.
// A waiter yields: a drain holds it for up to max_free_blocks releases.
class cache_lock_word {
 public:
  void lock() noexcept {
    while (locked_.exchange(true, std::memory_order_acquire))
      while (locked_.load(std::memory_order_relaxed)) std::this_thread::yield();
  }
  bool try_lock() noexcept {
    return !locked_.load(std::memory_order_relaxed) &&
           !locked_.exchange(true, std::memory_order_acquire);
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

struct live_record {
  block* b = nullptr;
  std::size_t requested = 0;  // bytes the user asked for
};

// Cache-line aligned: two threads' caches never share a line.
struct alignas(64) thread_cache {
  // Freed blocks kept per thread; past this a free goes to the arena.
  static constexpr std::size_t max_free_blocks = 512;

  cache_lock_word mutex;
  flat_map<std::uintptr_t, live_record, mix_hash, 8> live;  // at most 1/8 full: flat_map.hpp
  std::size_t free_blocks = 0;
  // Called once by the pool, before first use, with size classes: `per_octave` classes an
  // octave (a power of two), for sizes up to largest_bytes; at most small_bytes of small
  // arena blocks are kept.
  void use_classes(unsigned per_octave, std::size_t largest_bytes, std::size_t small_bytes) {
    per_octave_ = per_octave;
    per_octave_log2_ = std::countr_zero(per_octave);
    class_count_ = class_above(largest_bytes) + 1;
    small_bytes_limit = small_bytes;
  }
  bool classed() const noexcept { return per_octave_ != 0; }
  std::size_t small_bytes_limit = static_cast<std::size_t>(-1);
  std::array<std::size_t, 2> free_bytes{};  // by arena id
  std::uint64_t allocations = 0;            // made or freed by this thread, for stats
  std::uint64_t deallocations = 0;
  // Live bytes (requested, and as rounded blocks) counted here but not yet added to the
  // pool's shared totals: threads do not write one shared line on every call.
  // Written only with `mutex` held (a load and a store, never contended); read without it
  // where an estimate will do.
  std::atomic<std::int64_t> pending_live{0};
  std::atomic<std::int64_t> pending_blocks{0};
  std::array<std::uintptr_t, 64> recent_frees{};  // to tell a double free from a stranger
  std::size_t recent_next = 0;
  // The stream of this thread's last free the pool checked (the default stream at first):
  // a free on it may take the fast path; a free on any other stream goes through the pool,
  // which refuses a stream the platform does not accept before anything changes. Written by
  // the owner under the pool mutex, reset by release_stream; read by the owner alone.
  std::atomic<std::uintptr_t> known_stream{0};
  // Streams a cache keeps blocks for at once; a free on yet another stream goes to the
  // arena, so the per-stream look-ups stay short whatever the number of streams.
  static constexpr std::size_t max_streams = 16;

  // Without classes: the smallest kept block freed on `stream` with size in
  // [size, max_size], or nullptr.
  // Looks at a few blocks of size's own bin (exact sizes win), then at the first non-empty
  // bin above, whose blocks all fit; in the small arena's blocks, and in the large arena's
  // when the cache holds any (a small request's block may come from there).
  block* pop(std::uintptr_t stream, std::size_t size, std::size_t max_size) noexcept {
    size_bins* bins = bins_for(stream, 0);
    block* best = bins != nullptr ? fit(*bins, size, max_size) : nullptr;
    if (free_bytes[1] != 0) [[unlikely]] {
      size_bins* large = bins_for(stream, 1);
      block* other = large != nullptr ? fit(*large, size, max_size) : nullptr;
      if (other != nullptr && (best == nullptr || other->size < best->size)) {
        best = other;
        bins = large;
      }
    }
    if (best == nullptr) return nullptr;
    bins->erase(best);
    free_blocks -= 1;
    free_bytes[best->arena_id] -= best->size;
    return best;
  }
  // With classes: the class of a small request of `bytes` (the pool rounds its block to
  // that class's size: pool_base::block_size_for, the same steps).
  int request_class(std::size_t bytes) const noexcept { return class_above(bytes); }
  // With classes: a kept block of class c (request_class) freed on `stream`, or nullptr.
  // The small arena's blocks first, then the large arena's when the cache holds any.
  block* pop_class(std::uintptr_t stream, int c) noexcept {
    class_lists* l = lists_for(stream, 0);
    block* b = l != nullptr ? l->head[c] : nullptr;
    if (b == nullptr && free_bytes[1] != 0) [[unlikely]] {
      l = lists_for(stream, 1);
      b = l != nullptr ? l->head[c] : nullptr;
    }
    if (b == nullptr) return nullptr;
    l->head[c] = b->bin_next;
    b->bin_next = nullptr;
    free_blocks -= 1;
    free_bytes[b->arena_id] -= b->size;
    return b;
  }
  // Keeps b for reuse on `stream`; false when the cache is full, or with classes when b's
  // size is not a class (the caller gives b to its arena instead).
  [[gnu::always_inline]] bool push(block* b, std::uintptr_t stream) {
    if (free_blocks >= max_free_blocks) return false;
    if (b->arena_id == 0 && free_bytes[0] + b->size > small_bytes_limit) return false;
    const int arena = b->arena_id;  // 0 or 1
    if (classed()) {
      const int c = class_of(b->size);
      if (c < 0) return false;
      class_lists* l = lists_for(stream, arena);
      if (l == nullptr) {
        if (lists_[arena].size() >= max_streams) return false;
        lists_[arena].push_back(std::make_unique<class_lists>(stream, class_count_));
        l = last_lists_[arena] = lists_[arena].back().get();
      }
      b->bin_next = l->head[c];
      l->head[c] = b;
      free_blocks += 1;
      free_bytes[arena] += b->size;
      return true;
    }
    size_bins* bins = bins_for(stream, arena);
    if (bins == nullptr) {
      if (bins_[arena].size() >= max_streams) return false;
      bins_[arena].push_back(std::make_unique<size_bins>());
      bins_[arena].back()->stream = stream;
      bins = last_[arena] = bins_[arena].back().get();
    }
    bins->insert(b);
    free_blocks += 1;
    free_bytes[b->arena_id] += b->size;
    return true;
  }
  // Empties the freed blocks, calling give_back(block, stream freed on) for each.
  template <class F>
  void drain(F&& give_back) {
    if (free_blocks == 0) return;
    for (int arena : {0, 1}) drain_arena(arena, give_back);
    free_blocks = 0;
    free_bytes = {};
  }
  // Gives back the freed blocks of the large arena (arena 1) only, as drain(). Kept apart
  // from the small arena's blocks, so this visits no other block: a small miss with size
  // classes drains them on every call (caching_pool's small requests use the large arena's
  // free space), and walking a full cache each time would dominate those misses.
  template <class F>
  void drain_large(F&& give_back) {
    if (free_bytes[1] == 0) return;
    free_blocks -= drain_arena(1, give_back);
    free_bytes[1] = 0;
  }
  // Calls f(block, stream) for each freed block held.
  template <class F>
  void for_each_free(F&& f) const {
    for (const auto& arena_bins : bins_)
      for (const auto& bins : arena_bins)
        bins->for_each([&](const block* b) { f(b, bins->stream); });
    for (const auto& arena_lists : lists_)
      for (const auto& l : arena_lists)
        for (const block* head : l->head)
          for (const block* b = head; b != nullptr; b = b->bin_next) f(b, l->stream);
  }
  // Whether frees of small requests keep their blocks here. A cache whose blocks rarely
  // serve this thread's small requests (sizes that vary at random: under min_hit_percent of
  // a window of them) only adds work (held blocks are drained back before the arena can
  // merge them) and stops keeping blocks for a while.
  bool keeping() const noexcept { return reuse_.pass_frees == 0; }
  void note_request(bool served) noexcept {
    reuse_.hits += served ? 1 : 0;
    if (++reuse_.requests < window) return;
    if (reuse_.hits * 100 < window * min_hit_percent) reuse_.pass_frees = pause_frees;
    reuse_.requests = reuse_.hits = 0;
  }
  void note_passed_free() noexcept {
    if (reuse_.pass_frees > 0) reuse_.pass_frees -= 1;
  }
  void note_free(std::uintptr_t addr) noexcept {
    deallocations += 1;
    recent_frees[recent_next] = addr;
    recent_next = (recent_next + 1) % recent_frees.size();
  }

 private:
  static constexpr std::uint32_t window = 256;
  static constexpr std::uint32_t min_hit_percent = 40;
  static constexpr std::uint32_t pause_frees = 4096;
  struct reuse_window {
    std::uint32_t requests = 0;
    std::uint32_t hits = 0;
    std::uint32_t pass_frees = 0;  // frees left that go to the arena, not kept
  };
  reuse_window reuse_{};  // over small requests
  // Blocks of one size bin looked at before moving to the bin above.
  static constexpr int scan_limit = 4;
  // The smallest block of `bins` with size in [size, max_size] (see pop), left in place.
  static block* fit(const size_bins& bins, std::size_t size, std::size_t max_size) noexcept {
    if (bins.empty()) return nullptr;
    int f, sb;
    size_bins::index(size, f, sb);
    block* best = nullptr;
    int looked = 0;
    for (block* b = bins.heads[f][sb]; b != nullptr && looked < scan_limit; b = b->bin_next, ++looked) {
      if (b->size < size || b->size > max_size) continue;
      if (best == nullptr || b->size < best->size) best = b;
      if (b->size == size) break;
    }
    if (best == nullptr) {
      best = bins.first_above(f, sb);
      if (best == nullptr || best->size > max_size) return nullptr;  // its bin's others are near it
    }
    return best;
  }
  // Gives back every kept block of `arena` (0 small, 1 large) and empties its bins and
  // lists; returns how many. The caller fixes the counts.
  template <class F>
  std::size_t drain_arena(int arena, F&& give_back) {
    std::size_t given = 0;
    for (auto& bins : bins_[arena]) {
      bins->for_each([&](block* b) {
        b->bin_prev = b->bin_next = nullptr;
        give_back(b, bins->stream);
        ++given;
      });
      bins->clear();
    }
    for (auto& l : lists_[arena])
      for (block*& head : l->head)
        while (head != nullptr) {
          block* b = head;
          head = b->bin_next;
          b->bin_next = nullptr;
          give_back(b, l->stream);
          ++given;
        }
    // All empty now: past a few streams they are forgotten, so a thread that freed on many
    // streams once does not search them all on every call.
    constexpr std::size_t streams_kept = 4;
    if (bins_[arena].size() > streams_kept) {
      bins_[arena].clear();
      last_[arena] = nullptr;
    }
    if (lists_[arena].size() > streams_kept) {
      lists_[arena].clear();
      last_lists_[arena] = nullptr;
    }
    return given;
  }
  // Class c holds the sizes (in 512-byte units) u with u <= 2n: c = u - 1 (one unit a step);
  // above, octave (2^o, 2^(o+1)] cut in n steps of 2^shift units, shift = o - log2(n):
  // c = shift * n + u / 2^shift - 1, which is the first formula with shift 0. So shift is
  // clamped at 0 (a conditional move), not branched on: with mixed sizes, a branch on
  // u <= 2n is mispredicted often.
  static constexpr std::size_t class_unit = 512;
  int class_shift(std::size_t u) const noexcept {
    return std::max(static_cast<int>(std::bit_width(u - 1)) - 1 - per_octave_log2_, 0);
  }
  // The class of `bytes`, a class size; -1 when it is not one (or past the largest).
  int class_of(std::size_t bytes) const noexcept {
    const std::size_t u = bytes / class_unit;
    if (u == 0 || bytes % class_unit != 0) return -1;
    const int shift = class_shift(u);
    if ((u & ((std::size_t{1} << shift) - 1)) != 0) return -1;
    const int c = shift * static_cast<int>(per_octave_) + static_cast<int>(u >> shift) - 1;
    return c < class_count_ ? c : -1;
  }
  // The class of the smallest class size at or above `bytes` (no bound: for sizing).
  int class_above(std::size_t bytes) const noexcept {
    const std::size_t u = std::max<std::size_t>((bytes + class_unit - 1) / class_unit, 1);
    const int shift = class_shift(u);
    const std::size_t steps = (u + (std::size_t{1} << shift) - 1) >> shift;
    return shift * static_cast<int>(per_octave_) + static_cast<int>(steps) - 1;
  }
  // The kept blocks of one stream and arena, a LIFO list per class, linked through bin_next.
  struct class_lists {
    class_lists(std::uintptr_t s, int classes) : stream(s), head(static_cast<std::size_t>(classes), nullptr) {}
    std::uintptr_t stream;
    std::vector<block*> head;
  };
  class_lists* lists_for(std::uintptr_t stream, int arena) noexcept {
    if (last_lists_[arena] != nullptr && last_lists_[arena]->stream == stream) return last_lists_[arena];
    for (auto& l : lists_[arena])
      if (l->stream == stream) return last_lists_[arena] = l.get();
    return nullptr;
  }
  unsigned per_octave_ = 0;  // 0: no classes (size bins)
  int per_octave_log2_ = 0;
  int class_count_ = 0;
  std::array<std::vector<std::unique_ptr<class_lists>>, 2> lists_;
  std::array<class_lists*, 2> last_lists_{};
  // The kept blocks of `arena` freed on `stream` (a size_bins per stream the thread freed
  // on), or nullptr.
  size_bins* bins_for(std::uintptr_t stream, int arena) noexcept {
    if (last_[arena] != nullptr && last_[arena]->stream == stream) return last_[arena];
    for (auto& bins : bins_[arena])
      if (bins->stream == stream) return last_[arena] = bins.get();
    return nullptr;
  }
  // By arena (0 small, 1 large), a few streams each: searched linearly.
  std::array<std::vector<std::unique_ptr<size_bins>>, 2> bins_;
  std::array<size_bins*, 2> last_{};  // the last one used, by arena
};

}  // namespace gpumem::detail
