// host_store: a KV tier in pinned host memory (from a pinned_host_pool of its own, so a
// hit copies to the device at full PCIe speed), bounded, least recently used first out.
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
#include "gpumem/pool/pinned_host_pool.hpp"

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
  pinned_host_pool pool_;
  mutable std::mutex mutex_;
  std::list<entry> lru_;  // front: most recently used
  std::unordered_map<kv_block_key, std::list<entry>::iterator, key_hash> index_;
  std::size_t held_ = 0;
  kv_store_stats counters_{};
};

}  // namespace gpumem
