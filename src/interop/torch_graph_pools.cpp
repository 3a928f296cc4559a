#include "interop/torch_graph_pools.hpp"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace gpumem_torch {

struct graph_pool {
  int device = 0;
  mempool_id id{};
  gpumem_pool* pool = nullptr;
  std::uint32_t tag = 0;  // the tag it sleeps and wakes with: its maker's current tag
  std::size_t uses = 0;  // begins not yet released
  std::size_t live = 0;  // allocations not yet freed
};

namespace {

struct capture {
  int device;
  mempool_id id;
  capture_filter filter;
  graph_pool* pool;
};

std::mutex mutex_;
std::vector<std::unique_ptr<graph_pool>> pools_;   // guarded by mutex_
std::vector<capture> captures_;                    // guarded by mutex_
std::unordered_map<void*, graph_pool*> owner_;     // guarded by mutex_
std::vector<deferred_free> deferred_;              // guarded by mutex_
std::unordered_map<int, std::size_t> keep_free_;   // by device (set_keep_free); guarded by mutex_
// Read without the lock on every allocation and free: while both are 0 the shared pool
// serves everything at the cost of one load each.
std::atomic<std::size_t> active_captures_{0};
std::atomic<std::size_t> private_live_{0};

// Keys that a private pool overrides whatever the shared pool's configuration says (a later
// key wins): no memory up front, none given back while the graph can replay, and
// cross-stream reuse that stays legal inside a capture.
constexpr const char* private_overrides =
    ",reserve:0,reserve_fraction:0,release_threshold:never,release_idle:off,cross_stream:wait";

graph_pool* find_locked(int device, mempool_id id) {
  for (auto& p : pools_)
    if (p->device == device && p->id == id) return p.get();
  return nullptr;
}

// Destroys `p` when nothing uses it any more. REQUIRES: mutex_ held.
void destroy_if_unused_locked(graph_pool* p) {
  if (p->uses != 0 || p->live != 0) return;
  gpumem_pool_destroy(p->pool);
  pools_.erase(std::find_if(pools_.begin(), pools_.end(),
                            [&](const std::unique_ptr<graph_pool>& q) { return q.get() == p; }));
}

}  // namespace

graph_pool* graph_pool_for(int device, void* stream) noexcept {
  if (active_captures_.load(std::memory_order_acquire) == 0) return nullptr;
  std::lock_guard lock(mutex_);
  for (auto it = captures_.rbegin(); it != captures_.rend(); ++it) {
    if (it->device != device) continue;
    try {
      if (!it->filter || it->filter(static_cast<CUstream_st*>(stream))) return it->pool;
    } catch (...) {
      // A filter that cannot answer routes nothing.
    }
  }
  return nullptr;
}

void* graph_pool_allocate(graph_pool* pool, std::size_t size, void* stream) noexcept {
  void* ptr = gpumem_malloc(pool->pool, size, stream);
  if (ptr == nullptr) return nullptr;
  try {
    std::lock_guard lock(mutex_);
    owner_.emplace(ptr, pool);
    pool->live += 1;
    private_live_.fetch_add(1, std::memory_order_release);
  } catch (...) {
    (void)gpumem_free(pool->pool, ptr, size, stream);
    return nullptr;
  }
  return ptr;
}

gpumem_status graph_pool_allocate_at(int device, mempool_id id, void* ptr, std::size_t size,
                                     void* stream, bool* found) noexcept {
  std::lock_guard lock(mutex_);
  graph_pool* p = find_locked(device, id);
  *found = p != nullptr;
  if (p == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  const gpumem_status st = gpumem_allocate_at(p->pool, ptr, size, stream);
  if (st != GPUMEM_SUCCESS) return st;
  try {
    owner_.emplace(ptr, p);
  } catch (...) {
    (void)gpumem_free(p->pool, ptr, size, stream);
    return GPUMEM_ERROR_OUT_OF_MEMORY;
  }
  p->live += 1;
  private_live_.fetch_add(1, std::memory_order_release);
  return GPUMEM_SUCCESS;
}

bool graph_pool_free(void* ptr, std::size_t size, void* stream, gpumem_status* st) noexcept {
  if (private_live_.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard lock(mutex_);
  auto it = owner_.find(ptr);
  if (it == owner_.end()) return false;
  graph_pool* p = it->second;
  *st = gpumem_free(p->pool, ptr, size, stream);
  if (*st != GPUMEM_SUCCESS) return true;  // still live, still owned
  owner_.erase(it);
  p->live -= 1;
  private_live_.fetch_sub(1, std::memory_order_release);
  destroy_if_unused_locked(p);
  return true;
}

void begin_allocate_to_pool(int device, mempool_id id, capture_filter filter, const char* config) {
  std::lock_guard lock(mutex_);
  graph_pool* p = find_locked(device, id);
  if (p == nullptr) {
    const std::string conf = std::string(config) + private_overrides;
    gpumem_pool* made = nullptr;
    if (gpumem_pool_create(conf.c_str(), &made) != GPUMEM_SUCCESS)
      throw std::runtime_error(std::string("gpumem_torch: cannot create the private pool of a "
                                           "CUDA graph or MemPool: ") + gpumem_last_error());
    auto fresh = std::make_unique<graph_pool>();
    fresh->device = device;
    fresh->id = id;
    fresh->pool = made;
    fresh->tag = gpumem_current_tag();
    if (auto k = keep_free_.find(device); k != keep_free_.end())
      (void)gpumem_pool_set_keep_free(made, k->second);  // a vmm_page_pool: accepted
    p = fresh.get();
    pools_.push_back(std::move(fresh));
  }
  p->uses += 1;
  captures_.push_back(capture{device, id, std::move(filter), p});
  active_captures_.fetch_add(1, std::memory_order_release);
}

void defer_free(const deferred_free& f) {
  std::lock_guard lock(mutex_);
  deferred_.push_back(f);
}

std::vector<deferred_free> end_allocate_to_pool(int device, mempool_id id) {
  std::lock_guard lock(mutex_);
  // The latest capture into this id ends (captures into one id may nest across threads).
  for (auto it = captures_.rbegin(); it != captures_.rend(); ++it)
    if (it->device == device && it->id == id) {
      captures_.erase(std::next(it).base());
      active_captures_.fetch_sub(1, std::memory_order_release);
      break;
    }
  std::vector<deferred_free> now;
  if (captures_.empty()) now.swap(deferred_);
  return now;
}

void release_pool(int device, mempool_id id) {
  std::lock_guard lock(mutex_);
  graph_pool* p = find_locked(device, id);
  if (p == nullptr || p->uses == 0) return;
  p->uses -= 1;
  destroy_if_unused_locked(p);
}

namespace {
// Applies `change` (a sleep or a wake of the pool's memory) to every private pool of
// (device, tag) for which `wanted(asleep)` holds, in the order they were made; stops at the
// first failure.
template <class Wanted, class Change>
gpumem_status for_tag_pools(int device, std::uint32_t tag, Wanted wanted, Change change,
                            std::size_t* done) noexcept {
  *done = 0;
  std::lock_guard lock(mutex_);
  for (auto& p : pools_) {
    if (p->device != device || p->tag != tag) continue;
    const int asleep = gpumem_tag_asleep(p->pool, 0);
    if (asleep < 0) return gpumem_last_status();
    if (!wanted(asleep == 1)) continue;
    if (const gpumem_status st = change(p->pool); st != GPUMEM_SUCCESS) return st;
    *done += 1;
  }
  return GPUMEM_SUCCESS;
}
}  // namespace

gpumem_status sleep_tag_pools(int device, std::uint32_t tag, int mode, void* stream,
                              std::size_t* slept) noexcept {
  return for_tag_pools(
      device, tag, [](bool asleep) { return !asleep; },
      [&](gpumem_pool* pool) { return gpumem_sleep(pool, 0, mode, stream); }, slept);
}

gpumem_status wake_tag_pools(int device, std::uint32_t tag, void* stream,
                             std::size_t* woken) noexcept {
  return for_tag_pools(
      device, tag, [](bool asleep) { return asleep; },
      [&](gpumem_pool* pool) { return gpumem_wake(pool, 0, stream); }, woken);
}

gpumem_status release_tag_pools_host(int device, std::uint32_t tag,
                                     std::uint64_t* released) noexcept {
  *released = 0;
  std::size_t done = 0;
  return for_tag_pools(
      device, tag, [](bool) { return true; },
      [&](gpumem_pool* pool) {
        std::uint64_t bytes = 0;
        const gpumem_status st = gpumem_release_host(pool, 0, &bytes);
        *released += bytes;
        return st;
      },
      &done);
}

std::uint64_t tag_pools_host_bytes(int device, std::uint32_t tag) noexcept {
  std::uint64_t total = 0;
  std::lock_guard lock(mutex_);
  for (auto& p : pools_) {
    if (p->device != device || p->tag != tag) continue;
    std::uint64_t bytes = 0;
    if (gpumem_tag_host_bytes(p->pool, 0, &bytes) == GPUMEM_SUCCESS) total += bytes;
  }
  return total;
}

std::size_t tag_pool_count(int device, std::uint32_t tag) noexcept {
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(std::count_if(pools_.begin(), pools_.end(), [&](const auto& p) {
    return p->device == device && p->tag == tag;
  }));
}

gpumem_status set_keep_free(int device, std::size_t bytes) noexcept {
  std::lock_guard lock(mutex_);
  keep_free_[device] = bytes;
  for (auto& p : pools_)
    if (p->device == device)
      if (const gpumem_status st = gpumem_pool_set_keep_free(p->pool, bytes); st != GPUMEM_SUCCESS)
        return st;
  return GPUMEM_SUCCESS;
}

std::size_t tag_pools_asleep(int device, std::uint32_t tag) noexcept {
  std::lock_guard lock(mutex_);
  return static_cast<std::size_t>(std::count_if(pools_.begin(), pools_.end(), [&](const auto& p) {
    return p->device == device && p->tag == tag && gpumem_tag_asleep(p->pool, 0) == 1;
  }));
}

graph_pool_totals graph_pools_totals(int device) noexcept {
  graph_pool_totals t;
  std::lock_guard lock(mutex_);
  for (auto& p : pools_) {
    if (device >= 0 && p->device != device) continue;
    t.pools += 1;
    gpumem_stats s{};
    if (gpumem_pool_stats(p->pool, &s) == GPUMEM_SUCCESS) t.reserved_bytes += s.reserved_bytes;
    t.live_allocations += p->live;
  }
  return t;
}

}  // namespace gpumem_torch
