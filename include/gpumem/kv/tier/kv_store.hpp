// kv_store: a tier below the GPU that keeps evicted KV blocks, found again by key.
//
// A key is (space, salt, hash): `space` names the model's KV layout (two models never
// share a block), `salt` the tenant, `hash` the block's prefix chain hash
// (prefix_hash.hpp). A value is one block record (kv_record.hpp): a header with sizes
// and a checksum, the block's tokens, its bytes.
//
// Every store keeps these promises:
//  - put/get/contains take a batch and never throw: a store that fails (server away,
//    timeout, full) answers "not stored" / miss and counts the error;
//  - get verifies each value (kv_record::verify against the key and the expected size)
//    before reporting a hit: a corrupt or truncated value is `corrupt`, counted, and its
//    bytes are never handed out as a block;
//  - a store shared by several caches returns a value only under the exact key it was
//    put with, so tenants (salts) and models (spaces) stay apart.
// Implementations: host_store (pinned host memory, LRU), redis_store (one Redis server),
// redis_cluster_store (Redis Cluster). The interface leaves room for others (disk,
// Mooncake).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace gpumem {

struct kv_block_key {
  std::uint64_t space = 0;  // layout fingerprint (and namespace)
  std::uint64_t salt = 0;   // tenant
  std::uint64_t hash = 0;   // prefix chain hash of the block
  friend bool operator==(const kv_block_key&, const kv_block_key&) = default;
};

enum class kv_get_status : std::uint8_t {
  hit,      // found and verified; the value is in the caller's buffer
  miss,     // not there
  corrupt,  // there, but its size or checksum is wrong: a miss, counted
  error,    // the store could not answer (connection, timeout): a miss, counted
};

struct kv_store_stats {
  std::uint64_t puts = 0;          // values stored
  std::uint64_t put_bytes = 0;
  std::uint64_t put_failures = 0;  // values not stored (refused or the store failed)
  std::uint64_t gets = 0;          // keys asked for
  std::uint64_t hits = 0;
  std::uint64_t misses = 0;
  std::uint64_t corrupt = 0;
  std::uint64_t errors = 0;        // failed requests (connection, timeout, error replies)
  std::uint64_t evictions = 0;     // values the store dropped to make room (host LRU)
  std::uint64_t reconnects = 0;    // connections established after a failure
  std::uint64_t redirects = 0;     // Redis Cluster MOVED / ASK replies followed
  std::size_t held_bytes = 0;      // bytes held (host store)
  std::size_t entries = 0;         // values held (host store)
  std::string last_error;          // "" when none
};

class kv_store {
 public:
  // Called with a value the store drops to make room, before its bytes go (a host tier
  // spills its least recently used blocks to the next tier this way).
  using spill_fn = std::function<void(const kv_block_key&, std::span<const std::byte>)>;

  virtual ~kv_store() = default;
  // "host", "redis://127.0.0.1:6379", "redis-cluster://...".
  virtual std::string name() const = 0;
  // Local stores (host memory) answer at memory speed; remote ones cost a round trip.
  virtual bool is_local() const noexcept = 0;
  // Stores values[i] under keys[i]; stored[i] says whether it was. REQUIRES equal sizes.
  virtual void put(std::span<const kv_block_key> keys,
                   std::span<const std::span<const std::byte>> values, std::span<bool> stored,
                   const spill_fn* spill = nullptr) noexcept = 0;
  // For each key: copies the value into dst[i] when it is exactly dst[i].size() bytes and
  // verifies it; out[i] says what happened. REQUIRES equal sizes.
  virtual void get(std::span<const kv_block_key> keys, std::span<const std::span<std::byte>> dst,
                   std::span<kv_get_status> out) noexcept = 0;
  // Whether each key is held (unverified: a later get may still find it corrupt).
  virtual void contains(std::span<const kv_block_key> keys, std::span<bool> out) noexcept = 0;
  virtual kv_store_stats stats() const = 0;
};

}  // namespace gpumem
