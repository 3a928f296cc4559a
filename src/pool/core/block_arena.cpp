#include "pool/core/block_arena.hpp"

#include <algorithm>
#include <bit>
#include <stdexcept>
#include <unordered_set>

namespace gpumem::detail {

// The private helpers of allocate() and release() (new_block, take, cut_before, rebin,
// best_fit, insert_free...) are defined `inline`: used in this file only, so the compiler
// folds them into their callers instead of paying a call for each of the many small steps
// of a split or merge.

block_arena::block_arena(std::uint8_t id, std::size_t unit, std::size_t max_cached_blocks)
    : id_(id), unit_(unit), max_cached_blocks_(max_cached_blocks) {
  if (!std::has_single_bit(unit)) throw std::invalid_argument("block_arena: the unit must be a power of two");
}

namespace {
// addr rounded up to a multiple of alignment, a power of two (no division: see round()).
inline std::uintptr_t align_up(std::uintptr_t addr, std::size_t alignment) noexcept {
  return (addr + alignment - 1) & ~(std::uintptr_t{alignment} - 1);
}
}  // namespace

block_arena::~block_arena() {
  for (block* b : all_records_) delete b;
}

[[gnu::always_inline]] inline block* block_arena::new_block() {
  if (!spare_blocks_.empty()) {
    block* b = spare_blocks_.back();
    spare_blocks_.pop_back();
    // Field by field, not `*b = block{}`: GCC makes that a `rep stos` of 11 words, whose
    // start-up costs more than the stores (and is one more branch to predict).
    b->addr = 0;
    b->size = 0;
    b->prev = b->next = b->quick_next = b->bin_prev = b->bin_next = nullptr;
    b->segment = 0;
    b->st = block::state::free;
    b->bin_level = b->bin_sub = 0;
    b->stream = 0;
    b->free_epoch = 0;
    b->requested = 0;
    b->arena_id = id_;
    return b;
  }
  block* b = new block{};
  b->arena_id = id_;
  all_records_.push_back(b);
  return b;
}

inline void block_arena::delete_block(block* b) {
  b->st = block::state::recycled;
  spare_blocks_.push_back(b);
}

size_bins* block_arena::find_bins(std::uintptr_t stream, bool create) {
  // Bins are dropped only by drop_empty_bins, which resets the cached pointer.
  if (auto it = bins_.find(stream); it != bins_.end()) return last_bins_ = it->second.get();
  if (!create) return nullptr;
  std::unique_ptr<size_bins> fresh;
  if (!spare_bins_.empty()) {
    fresh = std::move(spare_bins_.back());
    spare_bins_.pop_back();
  } else {
    fresh = std::make_unique<size_bins>();
  }
  fresh->stream = stream;
  return last_bins_ = (bins_[stream] = std::move(fresh)).get();
}

void block_arena::drop_empty_bins() {
  constexpr std::size_t spare_limit = 8;
  for (auto it = bins_.begin(); it != bins_.end();) {
    if (!it->second->empty()) {
      ++it;
      continue;
    }
    if (last_bins_ == it->second.get()) last_bins_ = nullptr;
    if (spare_bins_.size() < spare_limit) spare_bins_.push_back(std::move(it->second));
    it = bins_.erase(it);
  }
}

std::vector<std::uintptr_t> block_arena::free_streams() const {
  std::vector<std::uintptr_t> out;
  for (const auto& [stream, bins] : bins_)
    if (!bins->empty()) out.push_back(stream);
  return out;
}

bool block_arena::holds_stream(std::uintptr_t stream) {
  if (cached_blocks_ != 0) flush();
  const size_bins* bins = bins_for(stream, false);
  return bins != nullptr && !bins->empty();
}

inline void block_arena::insert_free(block* b) {
  b->st = block::state::free;
  bins_for(b->stream, true)->insert(b);
  free_bytes_ += b->size;
  ++free_blocks_;
}

inline void block_arena::erase_free(block* b) {
  bins_for(b->stream, false)->erase(b);
  free_bytes_ -= b->size;
  --free_blocks_;
}

inline block* block_arena::best_fit(const size_bins& bins, std::size_t need, bool any_segment) const {
  int f, sb;
  size_bins::index(need, f, sb);
  const bool all_serve = any_segment || restricted_min_ == 0 || need >= restricted_min_;
  auto better = [&](const block* b, const block* than) {
    return than == nullptr || b->size < than->size || (b->size == than->size && earlier(*b, *than));
  };
  block* top = nullptr;  // the highest region's top, where it fits (top_last_)
  std::uintptr_t highest = 0;  // the highest region end, found at the first top met
  auto highest_end = [&] {
    if (highest == 0)
      region_end_.for_each([&](std::uintptr_t end, block*) { highest = std::max(highest, end); });
    return highest;
  };
  auto smallest = [&](block* head, bool check_fit) {
    block* best = nullptr;
    for (block* b = head; b != nullptr; b = b->bin_next) {
      if (check_fit && b->size < need) continue;
      if (!all_serve && b->segment == restricted_segment_) continue;
      if (top_last_ && b->next == nullptr && b->addr + b->size == highest_end()) {
        top = b;
        continue;
      }
      if (better(b, best)) best = b;
    }
    return best;
  };
  // Blocks in need's own bin may be smaller than need; every block above it fits, and
  // the first non-empty bin above holds the smallest of those (where a bin holds only
  // restricted blocks, or the top kept for last, the next one up).
  if (block* b = smallest(bins.heads[f][sb], true)) return b;
  for (block* head = bins.first_above(f, sb); head != nullptr;
       head = bins.first_above(head->bin_level, head->bin_sub))
    if (block* b = smallest(head, false)) return b;
  return top;
}

template <class F>
void block_arena::for_each_free(F&& fn) const {
  for (const auto& [stream, bins] : bins_) bins->for_each(fn);
}

void block_arena::add_region(std::uintptr_t addr, std::size_t size, std::uint32_t segment,
                             std::uintptr_t stream, std::uint64_t free_epoch) {
  // 0 is the region maps' empty key (flat_map); no device memory starts or ends there.
  if (addr == 0 || size == 0 || addr + size < addr)
    throw std::invalid_argument("block_arena: a region must be non-empty, away from address 0");
  block* b = new_block();
  b->addr = addr;
  b->size = size;
  b->segment = segment;
  b->stream = stream;
  b->free_epoch = free_epoch;
  b->st = block::state::free;
  // Link with the regions that end where this one starts and start where it ends.
  if (block** left = region_end_.find(addr); left != nullptr && (*left)->segment == segment) {
    b->prev = *left;
    b->prev->next = b;
    region_end_.erase(addr);
  } else {
    region_start_[addr] = b;
  }
  if (block** right = region_start_.find(addr + size);
      right != nullptr && (*right)->segment == segment) {
    b->next = *right;
    b->next->prev = b;
    region_start_.erase(addr + size);
  } else {
    region_end_[addr + size] = b;
  }
  insert_merged(b);
}

[[gnu::always_inline]] inline void block_arena::rebin(block* b) {
  int f, sb;
  size_bins::index(b->size, f, sb);
  if (f == b->bin_level && sb == b->bin_sub) return;
  size_bins* bins = bins_for(b->stream, false);
  bins->erase(b);
  bins->insert_at(b, f, sb);
}

[[gnu::always_inline]] inline void block_arena::insert_merged(block* b) {
  block* p = b->prev;
  block* n = b->next;
  const bool merge_prev = p != nullptr && p->st == block::state::free && p->stream == b->stream;
  const bool merge_next = n != nullptr && n->st == block::state::free && n->stream == b->stream;
  if (!merge_prev && !merge_next) {
    insert_free(b);
    return;
  }
  // The survivor is an indexed neighbour, grown in place: the index moves only when its
  // size leaves its bin. Merged memory is safe for another stream only once its latest
  // free is, hence the largest epoch.
  block* keep = merge_prev ? p : n;
  keep->free_epoch = std::max(keep->free_epoch, b->free_epoch);
  free_bytes_ += b->size;
  if (merge_prev) {
    p->size += b->size;
    p->next = n;
    if (n != nullptr)
      n->prev = p;
    else
      region_end_[p->addr + p->size] = p;
    if (merge_next) {
      erase_free(n);
      p->free_epoch = std::max(p->free_epoch, n->free_epoch);
      free_bytes_ += n->size;
      p->size += n->size;
      p->next = n->next;
      if (p->next != nullptr)
        p->next->prev = p;
      else
        region_end_[p->addr + p->size] = p;
      delete_block(n);
    }
  } else {
    n->addr = b->addr;
    n->size += b->size;
    n->prev = p;
    if (p != nullptr)
      p->next = n;
    else
      region_start_[n->addr] = n;
  }
  delete_block(b);
  rebin(keep);
}

[[gnu::always_inline]] inline block* block_arena::hand_out(block* b, std::uintptr_t stream,
                                                          std::size_t requested) noexcept {
  b->st = block::state::allocated;
  b->stream = stream;
  b->requested = requested;
  ++allocated_blocks_;
  allocated_bytes_ += b->size;
  requested_bytes_ += requested;
  return b;
}

[[gnu::always_inline]] inline block* block_arena::take(block* b, std::size_t size, std::size_t alignment,
                         std::uintptr_t stream, std::size_t requested) {
  const std::uintptr_t aligned = align_up(b->addr, alignment);
  if (aligned > b->addr) {
    // Front padding stays free, as its own block.
    erase_free(b);
    block* front = cut_before(b, aligned - b->addr);
    front->stream = b->stream;
    front->free_epoch = b->free_epoch;  // still unsafe for other streams until then
    insert_free(front);
    if (b->size - size >= unit_) insert_free(cut_after(b, b->addr + size));
  } else if (b->size - size >= unit_) {
    // The hot path: the front becomes a new allocated record and b stays indexed as the
    // free rest, moved in the index only when its size leaves its bin.
    block* front = cut_before(b, size);
    free_bytes_ -= size;
    rebin(b);
    b = front;
  } else {
    erase_free(b);
  }
  return hand_out(b, stream, requested);
}

block* block_arena::allocate(std::size_t size, std::size_t alignment, std::uintptr_t stream,
                             std::size_t requested, std::size_t max_split, bool any_segment) {
  size = round(size);
  if (alignment <= unit_) {
    // Hot path: an exact-size block freed earlier on this stream (none without quick lists).
    block** head = max_cached_blocks_ != 0 ? quick_.find({stream, size}) : nullptr;
    if (head != nullptr && *head != nullptr) {
      block* b = *head;
      *head = b->quick_next;
      b->quick_next = nullptr;
      --cached_blocks_;
      cached_bytes_ -= b->size;
      b->st = block::state::allocated;
      b->requested = requested;
      ++allocated_blocks_;
      allocated_bytes_ += b->size;
      requested_bytes_ += requested;
      return b;
    }
    alignment = unit_;
  }
  // Best fit; with a larger alignment, ask for enough room to align inside the block.
  const std::size_t need = size + (alignment > unit_ ? alignment - unit_ : 0);
  const size_bins* bins = bins_for(stream, false);
  block* b = bins != nullptr ? best_fit(*bins, need, any_segment) : nullptr;
  if (b == nullptr && alignment > unit_ && bins != nullptr) {
    // `need` assumed the worst padding; an already aligned block may fit with less.
    bins->for_each([&](block* c) {
      if (!any_segment && !serves(*c, size)) return;
      const std::uintptr_t start = align_up(c->addr, alignment);
      if (start + size > c->addr + c->size) return;
      if (b == nullptr || c->size < b->size || (c->size == b->size && earlier(*c, *b))) b = c;
    });
  }
  // Best fit is the smallest that fits: when it is over the limit, so is every other.
  if (b == nullptr || b->size > max_split) return nullptr;
  return take(b, size, alignment, stream, requested);
}

block* block_arena::take_at(std::uintptr_t addr, std::size_t size, std::uintptr_t stream,
                            std::size_t requested) {
  size = round(size);
  if (size == 0 || addr + size < addr || (addr & (unit_ - 1)) != 0) return nullptr;
  flush();
  block* b = nullptr;
  for_each_free([&](block* c) {
    if (b == nullptr && c->addr <= addr && addr + size <= c->addr + c->size) b = c;
  });
  if (b == nullptr) return nullptr;
  erase_free(b);
  if (addr > b->addr) {
    block* front = cut_before(b, addr - b->addr);
    front->stream = b->stream;
    front->free_epoch = b->free_epoch;
    insert_free(front);
  }
  if (b->size > size) insert_free(cut_after(b, b->addr + size));
  return hand_out(b, stream, requested);
}

block* block_arena::allocate_from_other_streams(std::size_t size, std::size_t alignment,
                                                std::uintptr_t stream, std::size_t requested,
                                                const std::function<bool(const block&)>& usable) {
  size = round(size);
  if (alignment < unit_) alignment = unit_;
  const std::size_t need = size + (alignment > unit_ ? alignment - unit_ : 0);
  block* best = nullptr;
  for (const auto& [other, bins] : bins_) {
    if (other == stream || bins->empty()) continue;
    block* b = best_fit(*bins, need, false);
    if (b == nullptr) continue;
    if (best != nullptr && (b->size > best->size || (b->size == best->size && !earlier(*b, *best))))
      continue;
    if (usable(*b)) best = b;
  }
  if (best == nullptr) return nullptr;
  return take(best, size, alignment, stream, requested);
}

inline block* block_arena::cut_before(block* b, std::size_t len) {
  block* front = new_block();
  front->addr = b->addr;
  front->size = len;
  front->segment = b->segment;
  front->prev = b->prev;
  front->next = b;
  if (front->prev != nullptr)
    front->prev->next = front;
  else
    region_start_[front->addr] = front;
  b->prev = front;
  b->addr += len;
  b->size -= len;
  return front;
}

block* block_arena::cut_after(block* b, std::uintptr_t at) {
  block* rest = new_block();
  rest->addr = at;
  rest->size = b->addr + b->size - at;
  rest->segment = b->segment;
  rest->stream = b->stream;
  rest->free_epoch = b->free_epoch;  // as unsafe for other streams as b
  rest->prev = b;
  rest->next = b->next;
  if (rest->next != nullptr)
    rest->next->prev = rest;
  else
    region_end_[rest->addr + rest->size] = rest;
  b->next = rest;
  b->size = at - b->addr;
  return rest;
}

block* block_arena::split_allocated(block* b, std::uintptr_t at) {
  block* rest = cut_after(b, at);
  rest->st = block::state::allocated;
  ++allocated_blocks_;
  return rest;
}

void block_arena::set_requested(block* b, std::size_t requested) noexcept {
  requested_bytes_ += requested;
  requested_bytes_ -= b->requested;
  b->requested = requested;
}

void block_arena::release(block* b, std::uintptr_t stream, std::uint64_t free_epoch) {
  --allocated_blocks_;
  allocated_bytes_ -= b->size;
  requested_bytes_ -= b->requested;
  b->requested = 0;
  b->stream = stream;
  b->free_epoch = free_epoch;
  if (max_cached_blocks_ == 0) {  // no quick lists: merged at once
    b->st = block::state::free;
    insert_merged(b);
    return;
  }
  if (cached_blocks_ >= max_cached_blocks_) flush();
  b->st = block::state::cached;
  auto& head = quick_[{stream, b->size}];
  b->quick_next = head;
  head = b;
  ++cached_blocks_;
  cached_bytes_ += b->size;
}

void block_arena::flush() {
  if (cached_blocks_ == 0) return;  // (always so without quick lists): no table walk
  quick_.for_each_mutable([&](const auto&, block*& head) {
    while (head != nullptr) {
      block* b = head;
      head = b->quick_next;
      b->quick_next = nullptr;
      cached_bytes_ -= b->size;
      b->st = block::state::free;  // so neighbours being merged see it as free
      insert_merged(b);
    }
  });
  quick_.clear();
  cached_blocks_ = 0;
}

std::size_t block_arena::retag_free(std::uintptr_t from, std::uintptr_t to, std::uint64_t up_to_epoch,
                                    std::uint64_t new_epoch) {
  flush();
  size_bins* bins = bins_for(from, false);
  if (bins == nullptr || from == to) return 0;
  std::vector<block*> moving;
  bins->for_each([&](block* b) {
    if (b->free_epoch <= up_to_epoch) moving.push_back(b);
  });
  std::size_t moved = 0;
  for (block* b : moving) {
    // Blocks of `from` merge only with `to`'s, never with each other here: each is still
    // indexed under `from` when its turn comes.
    erase_free(b);
    b->stream = to;
    b->free_epoch = new_epoch;
    moved += b->size;
    insert_merged(b);
  }
  return moved;
}

std::vector<block*> block_arena::free_blocks() const {
  std::vector<block*> all;
  all.reserve(free_blocks_);
  for_each_free([&](block* b) { all.push_back(b); });
  // Ascending (stream, size, segment, address): deterministic order for callers that scan.
  std::sort(all.begin(), all.end(), [](const block* a, const block* b) {
    if (a->stream != b->stream) return a->stream < b->stream;
    if (a->size != b->size) return a->size < b->size;
    return earlier(*a, *b);
  });
  return all;
}

block* block_arena::carve(block* b, std::uintptr_t from, std::size_t len) {
  erase_free(b);
  const std::uintptr_t end = b->addr + b->size;
  block* left = nullptr;
  block* right = nullptr;
  if (from > b->addr) {
    left = new_block();
    *left = *b;
    left->size = from - b->addr;
    left->next = nullptr;
    if (left->prev != nullptr)
      left->prev->next = left;
    else
      region_start_[left->addr] = left;
  } else if (b->prev != nullptr) {
    b->prev->next = nullptr;
  } else {
    region_start_.erase(b->addr);
  }
  if (from + len < end) {
    right = new_block();
    *right = *b;
    right->addr = from + len;
    right->size = end - (from + len);
    right->prev = nullptr;
    if (right->next != nullptr)
      right->next->prev = right;
    else
      region_end_[end] = right;
  } else if (b->next != nullptr) {
    b->next->prev = nullptr;
  } else {
    region_end_.erase(end);
  }
  // The gap opens new region edges on both sides.
  if (left != nullptr)
    region_end_[from] = left;
  else if (b->prev != nullptr)
    region_end_[from] = b->prev;
  if (right != nullptr)
    region_start_[from + len] = right;
  else if (b->next != nullptr)
    region_start_[from + len] = b->next;
  if (left != nullptr) insert_free(left);
  if (right != nullptr) insert_free(right);
  delete_block(b);
  return left;
}

std::size_t block_arena::largest_free_block() const {
  std::size_t largest = 0;
  for_each_free([&](const block* b) { largest = std::max(largest, b->size); });
  return largest;
}

std::string block_arena::validate() const {
  std::size_t free_sum = 0, cached_sum = 0, live_sum = 0, requested_sum = 0;
  std::string why;
  std::size_t free_count = 0;
  for_each_free([&](const block* b) {
    ++free_count;
    if (b->st != block::state::free) why = "free index holds a non-free block";
    free_sum += b->size;
    for (const block* n : {b->prev, b->next})
      if (n != nullptr && n->st == block::state::free && n->stream == b->stream)
        why = "two adjacent free blocks of one stream were not merged";
  });
  if (!why.empty()) return why;
  if (free_count != free_blocks_) return "free block count wrong";
  std::size_t cached_count = 0;
  quick_.for_each([&](const std::pair<std::uint64_t, std::uint64_t>& key, const block* head) {
    for (const block* b = head; b != nullptr; b = b->quick_next) {
      if (b->st != block::state::cached) why = "quick list holds a non-cached block";
      if (b->size != key.second || b->stream != key.first) why = "quick list key mismatch";
      cached_sum += b->size;
      ++cached_count;
    }
  });
  if (!why.empty()) return why;
  const std::unordered_set<const block*> spare(spare_blocks_.begin(), spare_blocks_.end());
  std::size_t live_count = 0;
  for (const block* b : all_records_) {
    if (spare.contains(b)) continue;
    if (b->st == block::state::allocated) {
      ++live_count;
      live_sum += b->size;
      requested_sum += b->requested;
    }
    if (b->next != nullptr && (b->next->prev != b || b->next->addr != b->addr + b->size))
      return "neighbour links broken";
  }
  if (free_sum != free_bytes_) return "free_bytes wrong";
  if (cached_sum != cached_bytes_ || cached_count != cached_blocks_) return "cached count wrong";
  if (live_sum != allocated_bytes_ || live_count != allocated_blocks_) return "allocated_bytes wrong";
  if (requested_sum != requested_bytes_) return "requested_bytes wrong";
  return {};
}

}  // namespace gpumem::detail
