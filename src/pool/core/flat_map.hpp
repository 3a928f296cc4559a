// flat_map: an open-addressing hash map for the allocator's hot path (pointer -> block,
// (stream, size) -> quick list). Linear probing over a power-of-two table, backward-shift
// deletion (no tombstones), no allocation except when the table grows.
//
// Load at most 1/MaxLoadInverse: a look-up, insert or erase then nearly always ends at its
// first slot. Probe runs of varying length are branches the CPU mispredicts, so a sparse
// table is faster than a dense one. The cost is host memory: up to 2 * MaxLoadInverse
// slots per key, right after the table doubled.
//  - 1/4 (the default), the arena's quick lists: keyed by (stream, size), many keys where
//    sizes vary, each looked up once a call; a sparser table there costs more in cache
//    misses than it saves in probes.
//  - 1/8, a thread cache's live records (thread_cache.hpp): 64 live records sit in 512 slots,
//    not 256, so the slot after a key's home holds another key about half as often.
//
// Invariants: size() < capacity / max_load_inverse; every key sits at or after its home slot with no
// empty slot between (the linear-probing invariant backward-shift deletion keeps);
// Key{} (all zero) is reserved as "empty" and is never stored.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace gpumem::detail {

template <class Key, class Value, class Hash, std::size_t MaxLoadInverse = 4>
class flat_map {
 public:
  flat_map() { slots_.resize(16); }
  // The table doubles before it is more than 1/max_load_inverse full.
  static constexpr std::size_t max_load_inverse = MaxLoadInverse;

  // The value for key, or nullptr.
  Value* find(const Key& key) noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      if (slots_[i].first == key) return &slots_[i].second;
      if (slots_[i].first == Key{}) return nullptr;
    }
  }
  const Value* find(const Key& key) const noexcept {
    return const_cast<flat_map*>(this)->find(key);
  }

  // The value for key, inserted as Value{} when absent. REQUIRES: key != Key{}.
  Value& operator[](const Key& key) {
    if ((size_ + 1) * max_load_inverse > slots_.size()) rehash(slots_.size() * 2);
    std::size_t i = home(key);
    for (; slots_[i].first != Key{}; i = (i + 1) & mask())
      if (slots_[i].first == key) return slots_[i].second;
    slots_[i].first = key;
    slots_[i].second = Value{};
    ++size_;
    return slots_[i].second;
  }

  // Inserts key, which is absent, with value. REQUIRES: key != Key{}, find(key) == nullptr.
  void insert_new(const Key& key, const Value& value) {
    if ((size_ + 1) * max_load_inverse > slots_.size()) rehash(slots_.size() * 2);
    std::size_t i = home(key);
    while (slots_[i].first != Key{}) i = (i + 1) & mask();
    slots_[i] = {key, value};
    ++size_;
  }

  bool erase(const Key& key) noexcept {
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask()) {
      if (slots_[i].first == Key{}) return false;
      if (slots_[i].first == key) break;
    }
    erase_slot(i);
    return true;
  }

  // One probe for a look-up that may end in an erase: the slot of key (its value stays
  // valid until the next insert or erase), or npos.
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);
  std::size_t slot_of(const Key& key) const noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      if (slots_[i].first == Key{}) return npos;
      if (slots_[i].first == key) return i;
    }
  }
  Value& value_at(std::size_t slot) noexcept { return slots_[slot].second; }
  // REQUIRES: slot came from slot_of, with no insert or erase since.
  void erase_slot(std::size_t i) noexcept {
    // Backward shift: move later entries of the probe run into the hole when their home
    // slot does not lie strictly between the hole and them.
    for (std::size_t j = (i + 1) & mask();; j = (j + 1) & mask()) {
      if (slots_[j].first == Key{}) break;
      const std::size_t h = home(slots_[j].first);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = slots_[j];
      i = j;
    }
    slots_[i] = {};
    --size_;
  }

  std::size_t size() const noexcept { return size_; }
  void clear() {
    for (auto& s : slots_) s = {};
    size_ = 0;
  }
  template <class F>
  void for_each_mutable(F&& f) {
    for (auto& s : slots_)
      if (s.first != Key{}) f(s.first, s.second);
  }
  template <class F>
  void for_each(F&& f) const {
    for (const auto& s : slots_)
      if (s.first != Key{}) f(s.first, s.second);
  }

 private:
  std::size_t mask() const noexcept { return mask_; }
  std::size_t home(const Key& key) const noexcept { return Hash{}(key) & mask(); }
  void rehash(std::size_t capacity) {
    std::vector<std::pair<Key, Value>> old(capacity);
    old.swap(slots_);
    mask_ = capacity - 1;
    size_ = 0;
    for (auto& s : old)
      if (s.first != Key{}) (*this)[s.first] = s.second;
  }

  std::vector<std::pair<Key, Value>> slots_;
  std::size_t mask_ = 15;  // slots_.size() - 1 (a power of two less one)
  std::size_t size_ = 0;
};

// Fibonacci hashing, with the product's high bits folded down: the table takes the low
// bits, and the product's low bits carry nothing of an address's zero low bits (a 2 MiB
// page-aligned address times any odd constant has 21 zero low bits too: all such keys
// would share a few home slots).
struct mix_hash {
  static std::size_t fold(std::uint64_t h) noexcept { return static_cast<std::size_t>(h ^ (h >> 29) ^ (h >> 47)); }
  std::size_t operator()(std::uint64_t k) const noexcept { return fold(k * 0x9e3779b97f4a7c15ULL); }
  std::size_t operator()(const std::pair<std::uint64_t, std::uint64_t>& k) const noexcept {
    return fold((k.first * 0x9e3779b97f4a7c15ULL) ^ (k.second * 0xc2b2ae3d27d4eb4fULL));
  }
};

}  // namespace gpumem::detail
