#include "gpumem/kv/tier/host_store.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/kv/tier/kv_record.hpp"

namespace gpumem {

namespace {
pool_options value_options() {
  pool_options o;
  o.thread_cache = false;  // values are freed by whichever thread drops them
  return o;
}
// A quarter of the capacity, from 2 MiB to 64 MiB: a slab of k x 2 MiB holds k - 1 records
// of a 2 MiB block and its header, so large slabs lose little (64 MiB: 1/32), and a small
// store holds at most a slab past its capacity.
std::size_t slab_bytes(std::size_t capacity) {
  return std::clamp<std::size_t>(capacity / 4, std::size_t{2} << 20, std::size_t{64} << 20);
}
std::size_t checked_capacity(std::size_t capacity) {
  if (capacity == 0) throw invalid_argument("host_store: capacity must be positive");
  return capacity;
}
}  // namespace

host_store::host_store(platform& platform, int device, std::size_t capacity_bytes)
    : capacity_(checked_capacity(capacity_bytes)),
      memory_(platform, device),
      pool_(memory_, value_options(), slab_bytes(capacity_bytes)) {}

host_store::~host_store() {
  for (const entry& e : lru_) free_entry(e);
}

void host_store::free_entry(const entry& e) noexcept {
  try {
    pool_.deallocate(e.data, e.bytes);
  } catch (...) {
    // Never thrown for a pointer this pool handed out; nothing to undo otherwise.
  }
}

void host_store::put(std::span<const kv_block_key> keys,
                     std::span<const std::span<const std::byte>> values, std::span<bool> stored,
                     const spill_fn* spill) noexcept {
  for (std::size_t i = 0; i < keys.size(); ++i) {
    stored[i] = false;
    const std::size_t bytes = values[i].size();
    std::vector<entry> dropped;
    {
      std::lock_guard lock(mutex_);
      if (auto it = index_.find(keys[i]); it != index_.end()) {
        // The same key names the same block: keep the held copy, now most recent.
        lru_.splice(lru_.begin(), lru_, it->second);
        stored[i] = true;
        continue;
      }
      if (bytes > capacity_) {
        ++counters_.put_failures;
        continue;
      }
      while (held_ + bytes > capacity_ && !lru_.empty()) {
        dropped.push_back(lru_.back());
        index_.erase(lru_.back().key);
        held_ -= lru_.back().bytes;
        lru_.pop_back();
        ++counters_.evictions;
      }
    }
    for (const entry& e : dropped) {
      if (spill != nullptr && *spill) {
        try {
          (*spill)(e.key, {e.data, e.bytes});
        } catch (...) {
          // A spill that fails loses that value only.
        }
      }
      free_entry(e);
    }
    std::byte* data = nullptr;
    try {
      data = static_cast<std::byte*>(pool_.allocate(bytes));
    } catch (...) {
      std::lock_guard lock(mutex_);
      ++counters_.put_failures;
      counters_.last_error = "host_store: host memory exhausted";
      continue;
    }
    std::memcpy(data, values[i].data(), bytes);
    std::lock_guard lock(mutex_);
    if (index_.count(keys[i]) != 0 || held_ + bytes > capacity_) {
      // Another thread stored it, or filled the room, meanwhile.
      pool_.deallocate(data, bytes);
      stored[i] = index_.count(keys[i]) != 0;
      if (!stored[i]) ++counters_.put_failures;
      continue;
    }
    lru_.push_front({keys[i], data, bytes});
    index_.emplace(keys[i], lru_.begin());
    held_ += bytes;
    ++counters_.puts;
    counters_.put_bytes += bytes;
    stored[i] = true;
  }
}

void host_store::get(std::span<const kv_block_key> keys, std::span<const std::span<std::byte>> dst,
                     std::span<kv_get_status> out) noexcept {
  for (std::size_t i = 0; i < keys.size(); ++i) {
    bool copied = false, wrong_size = false;
    {
      std::lock_guard lock(mutex_);
      ++counters_.gets;
      auto it = index_.find(keys[i]);
      if (it != index_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);
        const entry& e = *it->second;
        if (e.bytes == dst[i].size()) {
          std::memcpy(dst[i].data(), e.data, e.bytes);
          copied = true;
        } else {
          wrong_size = true;
        }
      }
    }
    kv_get_status st = kv_get_status::miss;
    if (wrong_size) st = kv_get_status::corrupt;
    else if (copied)
      st = kv_record::verify(dst[i], keys[i]) ? kv_get_status::hit : kv_get_status::corrupt;
    out[i] = st;
    std::lock_guard lock(mutex_);
    if (st == kv_get_status::hit) ++counters_.hits;
    else if (st == kv_get_status::corrupt) ++counters_.corrupt;
    else ++counters_.misses;
  }
}

void host_store::contains(std::span<const kv_block_key> keys, std::span<bool> out) noexcept {
  std::lock_guard lock(mutex_);
  for (std::size_t i = 0; i < keys.size(); ++i) out[i] = index_.count(keys[i]) != 0;
}

kv_store_stats host_store::stats() const {
  std::lock_guard lock(mutex_);
  kv_store_stats s = counters_;
  s.held_bytes = held_;
  s.entries = index_.size();
  return s;
}

std::string host_store::validate() const {
  std::lock_guard lock(mutex_);
  std::size_t sum = 0;
  for (const entry& e : lru_) {
    auto it = index_.find(e.key);
    if (it == index_.end() || &*it->second != &e) return "an LRU entry is not indexed";
    sum += e.bytes;
  }
  if (lru_.size() != index_.size()) return "the index and the LRU list disagree";
  if (sum != held_) return "held bytes disagree with the values held";
  if (held_ > capacity_) return "held bytes exceed the capacity";
  return {};
}

}  // namespace gpumem
