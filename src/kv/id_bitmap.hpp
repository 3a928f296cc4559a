// A set of small integer ids in [0, size) that finds its lowest member in O(levels):
// level 0 has one bit per id, each level above one bit per non-zero word below, all in
// one flat array (the top level is one word). Used for free KV blocks so the lowest free
// block is always taken and free blocks gather at the top of the range, where shrinking
// can unmap them.
// Invariant: a bit of level k+1 is set iff the word of level k it summarises is non-zero.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gpumem::detail {

class id_bitmap {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  explicit id_bitmap(std::size_t size) : size_(size) {
    std::size_t n = size, at = 0;
    do {
      n = (n + 63) / 64;
      offset_[levels_++] = at;
      at += n;
    } while (n > 1);
    words_.assign(at, 0);
  }

  std::size_t size() const noexcept { return size_; }
  bool contains(std::size_t id) const noexcept { return (words_[id >> 6] >> (id & 63)) & 1u; }
  void insert(std::size_t id) noexcept {
    for (std::size_t k = 0; k < levels_; ++k) {
      std::uint64_t& w = words_[offset_[k] + (id >> 6)];
      const bool was_empty = w == 0;
      w |= std::uint64_t{1} << (id & 63);
      if (!was_empty) return;
      id >>= 6;
    }
  }
  void erase(std::size_t id) noexcept {
    for (std::size_t k = 0; k < levels_; ++k) {
      std::uint64_t& w = words_[offset_[k] + (id >> 6)];
      w &= ~(std::uint64_t{1} << (id & 63));
      if (w != 0) return;
      id >>= 6;
    }
  }
  // The lowest member, or npos when empty.
  std::size_t lowest() const noexcept {
    if (words_[offset_[levels_ - 1]] == 0) return npos;
    std::size_t id = 0;
    for (std::size_t k = levels_; k-- > 0;)
      id = (id << 6) | static_cast<std::size_t>(std::countr_zero(words_[offset_[k] + id]));
    return id;
  }

 private:
  std::size_t size_;
  std::size_t levels_ = 0;
  std::array<std::size_t, 12> offset_{};  // 64^11 ids is beyond any device
  std::vector<std::uint64_t> words_;
};

}  // namespace gpumem::detail
