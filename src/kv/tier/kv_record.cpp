#include "gpumem/kv/tier/kv_record.hpp"

#include <cstddef>
#include <cstring>

namespace gpumem {

namespace {
constexpr std::uint64_t k0 = 0x9e3779b97f4a7c15ull, k1 = 0xc2b2ae3d27d4eb4full,
                        k2 = 0x165667b19e3779f9ull, k3 = 0xd6e8feb86659fd93ull;

inline std::uint64_t load64(const std::byte* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline std::uint64_t rotl(std::uint64_t x, int r) noexcept { return (x << r) | (x >> (64 - r)); }
// One lane step: the 16 input bytes are mixed by a 64x64->128 multiply, folded into the
// lane with a rotation so that the order of steps matters.
inline std::uint64_t step(std::uint64_t lane, std::uint64_t a, std::uint64_t b,
                          std::uint64_t k) noexcept {
  return rotl(lane, 23) + detail::mix64(a ^ k, b ^ k0);
}
}  // namespace

std::uint64_t kv_checksum(std::span<const std::byte> bytes, std::uint64_t seed) noexcept {
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  std::uint64_t l0 = seed ^ k0, l1 = seed ^ k1, l2 = seed ^ k2, l3 = seed ^ k3;
  for (; n >= 64; n -= 64, p += 64) {
    l0 = step(l0, load64(p), load64(p + 8), k1);
    l1 = step(l1, load64(p + 16), load64(p + 24), k2);
    l2 = step(l2, load64(p + 32), load64(p + 40), k3);
    l3 = step(l3, load64(p + 48), load64(p + 56), k1 ^ k2);
  }
  std::uint64_t h = detail::mix64(l0 ^ rotl(l1, 17), l2 ^ rotl(l3, 41) ^ k3);
  for (; n >= 8; n -= 8, p += 8) h = step(h, load64(p), k2, k3);
  if (n > 0) {
    std::uint64_t tail = 0;
    std::memcpy(&tail, p, n);
    h = step(h, tail, n, k1);
  }
  return detail::mix64(h ^ bytes.size(), k0 ^ seed);
}

namespace kv_record {

void write_head(std::span<std::byte> record, const kv_block_key& key, std::uint64_t parent,
                std::span<const token_id> tokens) noexcept {
  kv_record_header h;
  h.magic = magic;
  h.version = version;
  h.token_count = static_cast<std::uint32_t>(tokens.size());
  h.space = key.space;
  h.salt = key.salt;
  h.hash = key.hash;
  h.parent = parent;
  h.payload_bytes = record.size() - payload_offset(tokens.size());
  h.checksum = 0;
  std::memcpy(record.data(), &h, sizeof h);
  std::memcpy(record.data() + sizeof h, tokens.data(), tokens.size_bytes());
}

// The checksum covers the header's other fields (as the seed) and everything after it.
static std::uint64_t record_checksum(std::span<const std::byte> record) noexcept {
  const std::uint64_t seed =
      kv_checksum(record.first(offsetof(kv_record_header, checksum)), k3);
  return kv_checksum(record.subspan(sizeof(kv_record_header)), seed);
}

void seal(std::span<std::byte> record) noexcept {
  const std::uint64_t c = record_checksum(record);
  std::memcpy(record.data() + offsetof(kv_record_header, checksum), &c, sizeof c);
}

bool verify(std::span<const std::byte> record, const kv_block_key& key,
            std::size_t payload_bytes) noexcept {
  if (record.size() < sizeof(kv_record_header)) return false;
  kv_record_header h;
  std::memcpy(&h, record.data(), sizeof h);
  if (h.magic != magic || h.version != version || h.space != key.space || h.salt != key.salt ||
      h.hash != key.hash || h.payload_bytes != payload_bytes ||
      record.size() != size(h.token_count, payload_bytes))
    return false;
  return h.checksum == record_checksum(record);
}

bool verify(std::span<const std::byte> record, const kv_block_key& key) noexcept {
  if (record.size() < sizeof(kv_record_header)) return false;
  const std::size_t head = payload_offset(header(record).token_count);
  return record.size() >= head && verify(record, key, record.size() - head);
}

kv_record_header header(std::span<const std::byte> record) noexcept {
  kv_record_header h;
  std::memcpy(&h, record.data(), sizeof h);
  return h;
}

std::span<const token_id> tokens(std::span<const std::byte> record) noexcept {
  const kv_record_header h = header(record);
  return {reinterpret_cast<const token_id*>(record.data() + sizeof h), h.token_count};
}

std::span<const std::byte> payload(std::span<const std::byte> record) noexcept {
  const kv_record_header h = header(record);
  return record.subspan(payload_offset(h.token_count));
}

}  // namespace kv_record
}  // namespace gpumem
