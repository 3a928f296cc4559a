// kv_record: the bytes of one KV block as a tier stores them.
//
//   header (64 bytes) | tokens (token_count x int32) | payload (the block's device bytes)
//
// The header carries a magic, a version, the key (space, salt, hash), the parent hash,
// the token and payload sizes and a 64-bit checksum over the header (checksum field
// zeroed), the tokens and the payload. verify() accepts a record only when every size
// agrees with the record's length and the expected payload size, the key matches and the
// checksum matches: a truncated or corrupt value is refused, never used as a block.
// The parent hash and tokens let the cache confirm a tier hit as it confirms a GPU hit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "gpumem/kv/prefix_hash.hpp"
#include "gpumem/kv/tier/kv_store.hpp"

namespace gpumem {

// A fast 64-bit checksum (four independent multiply-mix lanes, 64 bytes a step) for
// detecting corruption and truncation; not cryptographic.
std::uint64_t kv_checksum(std::span<const std::byte> bytes, std::uint64_t seed = 0) noexcept;

struct kv_record_header {
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::uint32_t token_count = 0;
  std::uint64_t space = 0, salt = 0, hash = 0, parent = 0;
  std::uint64_t payload_bytes = 0;
  std::uint64_t checksum = 0;
};
static_assert(sizeof(kv_record_header) == 64);

namespace kv_record {

inline constexpr std::uint64_t magic = 0x31564b4d454d5047ull;  // "GPMEMKV1"
inline constexpr std::uint32_t version = 1;

constexpr std::size_t size(std::size_t tokens, std::size_t payload_bytes) noexcept {
  return sizeof(kv_record_header) + tokens * sizeof(token_id) + payload_bytes;
}
// Where the payload starts (64-byte aligned when the token count is a multiple of 16).
constexpr std::size_t payload_offset(std::size_t tokens) noexcept {
  return sizeof(kv_record_header) + tokens * sizeof(token_id);
}
// Writes the header and tokens into record[0, payload_offset). The payload must be in
// place (record[payload_offset, ...)) before seal().
void write_head(std::span<std::byte> record, const kv_block_key& key, std::uint64_t parent,
                std::span<const token_id> tokens) noexcept;
// Computes and stores the checksum over the whole record.
void seal(std::span<std::byte> record) noexcept;
// true when `record` is a whole, intact record of `key` with `payload_bytes` of payload.
bool verify(std::span<const std::byte> record, const kv_block_key& key,
            std::size_t payload_bytes) noexcept;
// verify() with the payload size the record's length and token count imply (a store
// checks the record; the cache checks the sizes it expects).
bool verify(std::span<const std::byte> record, const kv_block_key& key) noexcept;
// REQUIRES verify() passed.
kv_record_header header(std::span<const std::byte> record) noexcept;
std::span<const token_id> tokens(std::span<const std::byte> record) noexcept;
std::span<const std::byte> payload(std::span<const std::byte> record) noexcept;

}  // namespace kv_record
}  // namespace gpumem
