// lifetime_hints: a guess, for each large request, whether its block will outlive the
// requests that follow it (a layer's activation kept for the backward pass, a prefill's KV
// block), so vmm_page_pool can place such blocks side by side, apart from short-lived ones.
//
// Why: a block's last page is shared only with its address neighbour. When a long-lived
// block's neighbours are temporaries, its partial last page stays pinned after they die:
// 32 KV blocks of 2.73 pages each hold 3 pages apiece when apart; placed in a row they need
// 88 pages, not 96.
//
// How: deep-learning programs repeat (each layer, step or token makes the same requests in
// the same order), and blocks that outlive the loop that makes them pile up. A request is
// keyed by its size and the sizes of the history_length large requests before it (a
// stand-in for its call site, which an allocator does not see). When a request of key K
// arrives:
//  - the block made two requests of K ago still live: K's blocks pile up (+1);
//  - else, the block of K's previous request already dead: K's blocks do not (-1);
//  - (only the previous one live: no evidence; a block outliving one successor is the
//    ordinary overlap of a layer's tensors with the next layer's.)
// K is guessed long-lived while its score is positive (a saturating count in [-2, 2]), so
// the first two requests of a key never are. A wrong guess costs placement, never safety.
//
// The cost: long-lived blocks get runs of their own, so in a training loop (forward fills
// them, backward empties them while other blocks grow) a memory-tight pool may move pages
// between those runs and the others every step, each move a remap. The move budget (below)
// bounds it: the hints stop for good where the moves keep coming.
//
// Liveness is read from the block records (records are never freed while the arena
// lives): a record still allocated at the same address, stamped with this request's
// serial in block::free_epoch (unused while a block is allocated; set again on free).
//
// Keys are kept exactly (a 64-bit hash of the sizes): a table that lets keys collide
// loses the evidence the guesses rest on (a trace has hundreds to thousands of keys). Past
// max_keys (a workload of endlessly new sizes), all
// evidence is forgotten and learned again. Not thread-safe: the pool's lock serializes
// calls.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "pool/core/block_arena.hpp"
#include "pool/core/flat_map.hpp"

namespace gpumem::detail {

class lifetime_hints {
 public:
  static constexpr std::size_t history_length = 3;
  static constexpr std::size_t max_keys = std::size_t{1} << 16;
  struct entry;
  struct guess {
    bool long_lived = false;
    entry* of_key = nullptr;  // the request's key; valid until the next on_request
  };

  // The move budget. Requests are judged in windows of window_reserves times the pool's
  // reserved bytes (requested, large): a window is over budget when the pages gathered out
  // of the long-lived runs' free blocks for other blocks (note_moved) exceed a move_share-th
  // of the bytes requested in it. A pool that learns moves pages in a window or two (the
  // first steps, a new peak); one whose long-lived runs fill and empty every step (a
  // training loop under memory pressure) keeps moving them. So the hints stop for good once
  // stop_windows of the last 32 windows were over budget; the long-lived blocks stay where
  // they are, and their runs' free space goes to the large arena.
  static constexpr std::size_t window_reserves = 2;
  static constexpr std::size_t move_share = 256;
  static constexpr int stop_windows = 4;
  // Sizes that do not repeat (random sizes: nothing to learn, and a key-table look-up that
  // misses the cache on every large request): the hints stop for good after a window of
  // novelty_window large requests of which over max_new_percent made new keys. Training and
  // inference loops repeat their sizes and stay well below that share.
  static constexpr std::uint32_t novelty_window = 4096;
  static constexpr std::uint32_t max_new_percent = 90;

  // Whether guesses are still made (false once the move budget was exceeded).
  bool active() const noexcept { return active_; }
  // Pages' bytes taken from the long-lived runs' free blocks to grow another run.
  void note_moved(std::size_t bytes) noexcept { window_moved_ += bytes; }

  // The guess for a large request of `bytes` in a pool that reserves `reserved` bytes;
  // the request joins the history.
  guess on_request(std::size_t bytes, std::size_t reserved) {
    if (!active_) return {};
    judge(bytes, reserved);
    if (!active_) return {};
    std::uint64_t key = bytes;
    for (std::size_t h : history_) key = key * 0x9E3779B97F4A7C15ull ^ h;
    key |= 1;  // never 0, flat_map's empty key
    for (std::size_t i = history_length - 1; i > 0; --i) history_[i] = history_[i - 1];
    history_[0] = bytes;
    if (keys_.size() >= max_keys && keys_.find(key) == nullptr) keys_.clear();
    const std::size_t keys_before = keys_.size();
    entry& e = keys_[key];
    if (!judge_novelty(keys_.size() != keys_before)) return {};
    if (e.blocks[1].record != nullptr) {
      if (live(e.blocks[1]))
        e.score = e.score < 2 ? e.score + 1 : 2;
      else if (!live(e.blocks[0]))
        e.score = e.score > -2 ? e.score - 1 : -2;
    }
    return {e.score > 0, &e};
  }

  // Records b, allocated for g's request, as the newest block of its key, and stamps it.
  // REQUIRES: no on_request since the one that made g (it may move the entries).
  void on_placed(const guess& g, block* b) noexcept {
    entry* e = g.of_key;
    if (e == nullptr) return;
    serial_ += 1;
    b->free_epoch = serial_;
    e->blocks[1] = e->blocks[0];
    e->blocks[0] = {b, b->addr, serial_};
  }

 private:
  struct placed {
    const block* record = nullptr;
    std::uintptr_t addr = 0;
    std::uint64_t serial = 0;
  };

 public:
  struct entry {
    std::array<placed, 2> blocks{};  // [0]: the newest
    int score = 0;
  };

 private:
  static bool live(const placed& p) noexcept {
    return p.record != nullptr && p.record->st == block::state::allocated &&
           p.record->addr == p.addr && p.record->free_epoch == p.serial;
  }

  void judge(std::size_t bytes, std::size_t reserved) noexcept {
    window_requested_ += bytes;
    if (window_requested_ < window_reserves * reserved) return;
    const bool over = window_moved_ > window_requested_ / move_share;
    recent_windows_ = (recent_windows_ << 1) | (over ? 1u : 0u);
    window_requested_ = window_moved_ = 0;
    if (std::popcount(recent_windows_) >= stop_windows) stop_for_good();
  }

  void stop_for_good() {
    active_ = false;
    keys_ = {};  // its memory too
  }

  // Counts a request whose key was `fresh` (new); false when that stopped the hints.
  bool judge_novelty(bool fresh) {
    novel_ += fresh ? 1 : 0;
    if (++seen_ < novelty_window) return true;
    const bool stop = novel_ * 100 > novelty_window * max_new_percent;
    seen_ = novel_ = 0;
    if (stop) stop_for_good();
    return !stop;
  }

  bool active_ = true;
  std::uint32_t seen_ = 0;   // large requests in the novelty window so far
  std::uint32_t novel_ = 0;  // of them, those that made a new key
  std::size_t window_requested_ = 0;
  std::size_t window_moved_ = 0;
  std::uint32_t recent_windows_ = 0;  // a bit a window, the newest lowest: 1 over budget
  flat_map<std::uint64_t, entry, mix_hash> keys_;
  std::array<std::size_t, history_length> history_{};
  std::uint64_t serial_ = 0;
};

}  // namespace gpumem::detail
