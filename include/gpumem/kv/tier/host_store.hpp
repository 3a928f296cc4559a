// host_store: a KV tier in host memory, bounded, least recently used first out.
//
// Values live in pageable host memory (host_memory_resource) carved by a caching_pool from
// slabs of a quarter of the capacity, 2 to 64 MiB: a put copies a record in and a get
// copies it out into the caller's buffer (kv_tiers' pinned staging), so the store never
// needs memory the device can DMA, and pinning it costs 0.74-2.3 ms per 2 MiB on an H200
// host. Slabs let 2 MiB-and-a-header records share segments instead of each taking 4 MiB.
//
// Invariants (validate()): held_bytes == sum of held values' sizes <= capacity_bytes;
// every held value is in the index once and in the LRU list once.
// A put that needs room drops the least recently used values, handing each to `spill`
// first (the next tier down). Thread-safe: one mutex; spills and copies of values being
// dropped run outside it.
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "gpumem/kv/tier/kv_store.hpp"
#include "gpumem/backend/backends.hpp"
#include "gpumem/pool/caching_pool.hpp"

namespace gpumem {

class host_store final : public kv_store {
 public:
  // Throws gpumem::invalid_argument for a zero capacity.
  host_store(platform& platform, int device, std::size_t capacity_bytes);
  ~host_store() override;

  std::string name() const override { return "host"; }
  bool is_local() const noexcept override { return true; }
  void put(std::span<const kv_block_key> keys, std::span<const std::span<const std::byte>> values,
           std::span<bool> stored, const spill_fn* spill = nullptr) noexcept override;
  void get(std::span<const kv_block_key> keys, std::span<const std::span<std::byte>> dst,
           std::span<kv_get_status> out) noexcept override;
  void contains(std::span<const kv_block_key> keys, std::span<bool> out) noexcept override;
  kv_store_stats stats() const override;
  std::size_t capacity_bytes() const noexcept { return capacity_; }
  // Host memory the store holds from the OS now (its slabs): held bytes plus what the
  // slabs keep free.
  std::size_t reserved_bytes() const { return pool_.stats().reserved_bytes; }
  std::string validate() const;

 private:
  struct entry {
    kv_block_key key;
    std::byte* data = nullptr;
    std::size_t bytes = 0;
  };
  struct key_hash {
    std::size_t operator()(const kv_block_key& k) const noexcept {
      return static_cast<std::size_t>(k.hash ^ (k.salt * 0x9e3779b97f4a7c15ull) ^
                                      (k.space * 0xc2b2ae3d27d4eb4full));
    }
  };
  void free_entry(const entry& e) noexcept;

  std::size_t capacity_;
  host_memory_resource memory_;
  caching_pool pool_;
  mutable std::mutex mutex_;
  std::list<entry> lru_;  // front: most recently used
  std::unordered_map<kv_block_key, std::list<entry>::iterator, key_hash> index_;
  std::size_t held_ = 0;
  kv_store_stats counters_{};
};

}  // namespace gpumem
