// Records and keys for the KV tier tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/kv_store.hpp"

namespace gpumem_test {

// A sealed record of `key` whose payload bytes are (seed + i) mod 251.
inline std::vector<std::byte> make_record(const gpumem::kv_block_key& key, std::size_t payload,
                                          std::uint64_t parent = 7, std::size_t tokens = 16,
                                          unsigned seed = 1) {
  std::vector<std::byte> r(gpumem::kv_record::size(tokens, payload));
  std::vector<gpumem::token_id> t(tokens);
  std::iota(t.begin(), t.end(), static_cast<gpumem::token_id>(seed));
  gpumem::kv_record::write_head(r, key, parent, t);
  const std::size_t off = gpumem::kv_record::payload_offset(tokens);
  for (std::size_t i = 0; i < payload; ++i)
    r[off + i] = static_cast<std::byte>((seed + i) % 251);
  gpumem::kv_record::seal(r);
  return r;
}

inline gpumem::kv_block_key key(std::uint64_t hash, std::uint64_t salt = 0,
                                std::uint64_t space = 42) {
  return {space, salt, hash};
}

}  // namespace gpumem_test
