// thread_cache: one thread's front end to a pool, the fast path that takes no pool lock.
//
// It holds
//  - the live allocations this thread made, address -> (block, requested bytes), so a free
//    on the same thread finds its block without the pool's lock; and
//  - blocks this thread freed, per stream, binned by size (a size_bins, the index behind
//    the arena's best fit). A block freed on stream S is handed out again only for S,
//    at once (stream order makes that safe), never for another stream. A request takes
//    the smallest kept block that fits within `max_size` (exact sizes first): a near fit
//    saves the pool's locked path when sizes vary, and the caller bounds the waste.
//
// Blocks in either part stay `allocated` in their arena: the arena does not see them, and
// nothing here writes a block field the arena reads for an allocated block (only the bin
// links and bin index, which the arena uses for its own free blocks alone). The pool drains the freed blocks back into the
// arenas, with the pool lock held, before it merges, grows, trims or gives memory back.
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
#include <utility>

#include "pool/block_arena.hpp"
#include "pool/flat_map.hpp"

namespace gpumem::detail {

struct live_record {
  block* b = nullptr;
  std::size_t requested = 0;  // bytes the user asked for
};

// Cache-line aligned: two threads' caches never share a line.
struct alignas(64) thread_cache {
  // Freed blocks kept per thread; past this a free goes to the arena (its quick lists).
  static constexpr std::size_t max_free_blocks = 512;

  std::mutex mutex;
  flat_map<std::uintptr_t, live_record, mix_hash> live;
  std::size_t free_blocks = 0;
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

  // The smallest kept block freed on `stream` with size in [size, max_size], or nullptr.
  // Looks at a few blocks of size's own bin (exact sizes win), then at the first non-empty
  // bin above, whose blocks all fit.
  block* pop(std::uintptr_t stream, std::size_t size, std::size_t max_size) noexcept {
    size_bins* bins = bins_for(stream);
    if (bins == nullptr || bins->empty()) return nullptr;
    int f, sb;
    size_bins::index(size, f, sb);
    block* best = nullptr;
    int looked = 0;
    for (block* b = bins->heads[f][sb]; b != nullptr && looked < scan_limit; b = b->bin_next, ++looked) {
      if (b->size < size || b->size > max_size) continue;
      if (best == nullptr || b->size < best->size) best = b;
      if (b->size == size) break;
    }
    if (best == nullptr) {
      best = bins->first_above(f, sb);
      if (best == nullptr || best->size > max_size) return nullptr;  // its bin's others are near it
    }
    bins->erase(best);
    free_blocks -= 1;
    free_bytes[best->arena_id] -= best->size;
    return best;
  }
  // Keeps b for reuse on `stream`; false when the cache is full (the caller gives b to
  // its arena instead).
  bool push(block* b, std::uintptr_t stream) {
    if (free_blocks >= max_free_blocks) return false;
    size_bins* bins = bins_for(stream);
    if (bins == nullptr) {
      bins_.push_back(std::make_unique<size_bins>());
      bins_.back()->stream = stream;
      bins = last_ = bins_.back().get();
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
    for (auto& bins : bins_) {
      bins->for_each([&](block* b) {
        b->bin_prev = b->bin_next = nullptr;
        give_back(b, bins->stream);
      });
      bins->clear();
    }
    free_blocks = 0;
    free_bytes = {};
  }
  // Calls f(block, stream) for each freed block held.
  template <class F>
  void for_each_free(F&& f) const {
    for (const auto& bins : bins_)
      bins->for_each([&](const block* b) { f(b, bins->stream); });
  }
  // Whether frees keep blocks here. A cache whose blocks rarely serve this thread's
  // requests (sizes that vary at random: under min_hit_percent of a window of requests)
  // only adds work (held blocks are drained back before the arena can merge them) and
  // stops keeping blocks for a while.
  bool keeping() const noexcept { return pass_frees_ == 0; }
  void note_request(bool served) noexcept {
    window_hits_ += served ? 1 : 0;
    if (++window_requests_ < window) return;
    if (window_hits_ * 100 < window * min_hit_percent) pass_frees_ = pause_frees;
    window_requests_ = window_hits_ = 0;
  }
  void note_passed_free() noexcept {
    if (pass_frees_ > 0) pass_frees_ -= 1;
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
  std::uint32_t window_requests_ = 0;
  std::uint32_t window_hits_ = 0;
  std::uint32_t pass_frees_ = 0;  // frees left that go to the arena, not kept
  // Blocks of one size bin looked at before moving to the bin above.
  static constexpr int scan_limit = 4;
  // The kept blocks of `stream` (a size_bins per stream the thread freed on), or nullptr.
  size_bins* bins_for(std::uintptr_t stream) noexcept {
    if (last_ != nullptr && last_->stream == stream) return last_;
    for (auto& bins : bins_)
      if (bins->stream == stream) return last_ = bins.get();
    return nullptr;
  }
  std::vector<std::unique_ptr<size_bins>> bins_;  // a few streams: searched linearly
  size_bins* last_ = nullptr;                     // the last one used
};

}  // namespace gpumem::detail
