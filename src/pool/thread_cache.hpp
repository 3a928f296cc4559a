// thread_cache: one thread's front end to a pool, the fast path that takes no pool lock.
//
// It holds
//  - the live allocations this thread made, address -> (block, requested bytes), so a free
//    on the same thread finds its block without the pool's lock; and
//  - blocks this thread freed, by exact (stream, size). A block freed on stream S is handed
//    out again only for S, at once (stream order makes that safe), never for another stream.
//
// Blocks in either part stay `allocated` in their arena: the arena does not see them, and
// nothing here writes a block field the arena reads (only `quick_next`, which the arena
// uses for its own cached blocks alone). The pool drains the freed blocks back into the
// arenas, with the pool lock held, before it merges, grows, trims or gives memory back.
//
// Locking: `mutex` guards everything here. The owner thread takes it on each operation
// (uncontended in the steady state: this is what makes threads scale); the pool takes it,
// with the pool mutex held, to drain, search or inspect. Lock order: pool mutex, then a
// cache's mutex; no one takes the pool mutex while holding a cache's.
#pragma once

#include <array>
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
  std::int64_t pending_live = 0;
  std::int64_t pending_blocks = 0;
  std::array<std::uintptr_t, 64> recent_frees{};  // to tell a double free from a stranger
  std::size_t recent_next = 0;

  // A block of exactly `size` bytes freed on `stream`, or nullptr.
  block* pop(std::uintptr_t stream, std::size_t size) noexcept {
    block** head = free_heads_.find({stream, size});
    if (head == nullptr || *head == nullptr) return nullptr;
    block* b = *head;
    if (b->quick_next != nullptr)
      *head = b->quick_next;
    else
      free_heads_.erase({stream, size});  // only keys with blocks stay: drain's scan is short
    b->quick_next = nullptr;
    free_blocks -= 1;
    free_bytes[b->arena_id] -= b->size;
    return b;
  }
  // Keeps b for reuse on `stream`; false when the cache is full (the caller gives b to
  // its arena instead).
  bool push(block* b, std::uintptr_t stream) {
    if (free_blocks >= max_free_blocks) return false;
    block*& head = free_heads_[{stream, b->size}];
    b->quick_next = head;
    head = b;
    free_blocks += 1;
    free_bytes[b->arena_id] += b->size;
    return true;
  }
  // Empties the freed blocks, calling give_back(block, stream freed on) for each.
  template <class F>
  void drain(F&& give_back) {
    if (free_blocks == 0) return;
    free_heads_.for_each_mutable([&](const std::pair<std::uint64_t, std::uint64_t>& key, block*& head) {
      while (head != nullptr) {
        block* b = head;
        head = b->quick_next;
        b->quick_next = nullptr;
        give_back(b, static_cast<std::uintptr_t>(key.first));
      }
    });
    free_heads_.clear();
    free_blocks = 0;
    free_bytes = {};
  }
  // Calls f(block, stream) for each freed block held.
  template <class F>
  void for_each_free(F&& f) const {
    free_heads_.for_each([&](const std::pair<std::uint64_t, std::uint64_t>& key, block* head) {
      for (const block* b = head; b != nullptr; b = b->quick_next)
        f(b, static_cast<std::uintptr_t>(key.first));
    });
  }
  void note_free(std::uintptr_t addr) noexcept {
    deallocations += 1;
    recent_frees[recent_next] = addr;
    recent_next = (recent_next + 1) % recent_frees.size();
  }

 private:
  // (stream, size) -> freed blocks linked through quick_next; a key is erased with its last
  // block. The stream may be 0 (the default stream) but size never is, so the key is never
  // the map's empty key.
  flat_map<std::pair<std::uint64_t, std::uint64_t>, block*, mix_hash> free_heads_;
};

}  // namespace gpumem::detail
