// The chain hash that names a full KV block for prefix caching: a block's hash covers its
// parent's hash (so it names the whole prefix up to and including the block), its tokens
// and a salt (so tenants with different salts never share blocks).
//
//   hash(block i) = H(hash(block i-1), salt, tokens of block i),   hash(block -1) = 0
//
// H is a 64-bit multiply-mix (wyhash-style folding of two tokens per step), not a
// cryptographic hash: kv_cache confirms every hit by comparing the stored parent hash,
// salt and tokens, so a collision can never hand out the wrong block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace gpumem {

using token_id = std::int32_t;

namespace detail {
__extension__ typedef unsigned __int128 uint128;  // GCC and Clang on 64-bit targets
inline std::uint64_t mix64(std::uint64_t a, std::uint64_t b) noexcept {
  const uint128 r = static_cast<uint128>(a) * b;
  return static_cast<std::uint64_t>(r) ^ static_cast<std::uint64_t>(r >> 64);
}
}  // namespace detail

inline std::uint64_t prefix_block_hash(std::uint64_t parent, std::uint64_t salt,
                                       std::span<const token_id> tokens) noexcept {
  constexpr std::uint64_t k0 = 0xa0761d6478bd642full, k1 = 0xe7037ed1a0b428dbull,
                          k2 = 0x8ebc6af09c88c6e3ull;
  std::uint64_t h = detail::mix64(parent ^ k0, salt ^ k1);
  std::size_t i = 0;
  for (; i + 2 <= tokens.size(); i += 2) {
    std::uint64_t pair;
    std::memcpy(&pair, tokens.data() + i, sizeof pair);
    h = detail::mix64(h ^ pair, k1) + k2;
  }
  if (i < tokens.size())
    h = detail::mix64(h ^ static_cast<std::uint32_t>(tokens[i]), k2) + k1;
  h = detail::mix64(h ^ tokens.size(), k0);
  return h == 0 ? k0 : h;  // 0 means "no parent"
}

}  // namespace gpumem
