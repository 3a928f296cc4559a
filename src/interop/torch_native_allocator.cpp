// libgpumem_torch_native.so: gpumem as PyTorch's own CUDA allocator, a subclass of
// c10::cuda::CUDACachingAllocator::CUDAAllocator installed in place of PyTorch's caching
// allocator (gpumem_torch_native_install), so every torch.cuda memory call answers from
// gpumem: statistics, empty_cache, the memory fraction, history and snapshots,
// out-of-memory observers, MemPool (also over another allocator) and CUDA graph pools.
//
// Built only against an installed PyTorch (cmake/gpumem_torch.cmake); it records that
// torch's version and C++ ABI (gpumem_torch_native_built_for), and python/gpumem/torch.py
// installs it only where the running torch is the same, else takes the pluggable route.
//
// It serves allocations through libgpumem_torch.so's entry points (the device pools, the
// private graph pools, PyTorch's counters and the out-of-memory text), so both routes share
// one pool per device and one set of counts.
//
// Invariants:
//  - live_ holds every pointer this allocator handed out and not yet freed, once, with the
//    size, device, stream and route (gpumem, or the custom allocator of a MemPool) it came
//    from; a free goes back to that route.
//  - pools_[id].uses == createOrIncrefPool and beginAllocateToPool calls for id less its
//    releasePool calls, as PyTorch counts a pool's uses.
//  - routes_ holds the allocate-to-pool blocks begun and not ended; a route with a custom
//    allocator serves the streams its filter accepts, the others reach libgpumem_torch.so's
//    graph pools.
//  - With a memory fraction f set for device d, an allocation that leaves the device's
//    reserved bytes above f x its total memory is given back and raised as out-of-memory
//    (after giving cached memory back once), as PyTorch's cap does.
#include <c10/core/Allocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gpumem/interop/gpumem.h"
#include "gpumem/interop/gpumem_torch.h"
#include "interop/torch_graph_pools.hpp"

#if !defined(GPUMEM_TORCH_BUILT_VERSION) || !defined(GPUMEM_TORCH_BUILT_ABI)
#error "the build defines GPUMEM_TORCH_BUILT_VERSION and GPUMEM_TORCH_BUILT_ABI (strings)"
#endif

// libgpumem_torch.so's C++-signature entry points (torch_plugin.cpp), for graph pools.
extern "C" {
void gpumem_torch_begin_allocate_to_pool(int device, gpumem_torch::mempool_id id,
                                         gpumem_torch::capture_filter filter);
void gpumem_torch_end_allocate_to_pool(int device, gpumem_torch::mempool_id id);
void gpumem_torch_release_pool(int device, gpumem_torch::mempool_id id);
int gpumem_torch_graph_pool_allocate_at(int device, gpumem_torch::mempool_id id, void* ptr,
                                        ssize_t size, void* stream);
}

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::StatType;

constexpr int max_devices = 64;

struct live_allocation {
  std::size_t size = 0;
  c10::DeviceIndex device = 0;
  cudaStream_t stream = nullptr;
  c10::MempoolId_t pool{0, 0};                // {0, 0}: the device's shared pool
  std::shared_ptr<cca::CUDAAllocator> custom;  // a MemPool's own allocator, else null
};

struct pool_record {
  int uses = 0;                                // createOrIncrefPool and begins less releases
  std::shared_ptr<cca::CUDAAllocator> custom;  // MemPool(allocator=...), else null
  bool use_on_oom = false;
};

struct route {
  c10::DeviceIndex device;
  c10::MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
  std::shared_ptr<cca::CUDAAllocator> custom;
};

struct id_hash {
  std::size_t operator()(const c10::MempoolId_t& id) const noexcept {
    return std::hash<unsigned long long>()(id.first * 0x9e3779b97f4a7c15ULL ^ id.second);
  }
};

// A checkpoint of one pool: its live allocations (address, size, stream).
struct pool_checkpoint final : cca::AllocatorState {
  c10::MempoolId_t id;
  c10::DeviceIndex device;
  std::vector<std::pair<void*, live_allocation>> live;
};

void delete_data(void* ptr);

class gpumem_cuda_allocator final : public cca::CUDAAllocator {
 public:
  gpumem_cuda_allocator() {
    for (auto& f : fraction_) f.store(1.0);
  }

  // --- c10::Allocator ---------------------------------------------------------------
  c10::DataPtr allocate(std::size_t nbytes) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    void* p = nbytes == 0 ? nullptr : malloc_on(nbytes, device, stream);
    return {p, p, &delete_data, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_data; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- raw allocations ----------------------------------------------------------------
  void* raw_alloc(std::size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return malloc_on(nbytes, device, stream);
  }
  void raw_delete(void* ptr) override { free(ptr); }

  void free(void* ptr) {
    if (ptr == nullptr) return;
    live_allocation a;
    {
      std::lock_guard lock(live_mutex_);
      auto it = live_.find(ptr);
      if (it == live_.end()) {
        std::fprintf(stderr, "gpumem_torch_native: free of %p, which it did not hand out\n", ptr);
        return;
      }
      a = std::move(it->second);
      live_.erase(it);
    }
    if (a.custom) {
      a.custom->raw_delete(ptr);
    } else {
      gpumem_torch_ipc_forget(ptr);  // descriptors of a CUDA IPC share, if any
      gpumem_torch_free(ptr, static_cast<ssize_t>(a.size), a.device, a.stream);
    }
    trace(c10::cuda::CUDACachingAllocator::TraceEntry::FREE_COMPLETED, a.device, ptr, a.size,
          a.stream, a.pool);
  }

  // --- set-up ----------------------------------------------------------------------------
  void init(int device_count) override {
    device_count_ = std::min(device_count, max_devices);
    initialized_.store(true);
  }
  bool initialized() override { return initialized_.load(); }
  void enable(bool value) override { enabled_ = value; }
  bool isEnabled() const override { return enabled_; }
  std::string name() override { return "gpumem"; }

  // --- the memory fraction (a cap on reserved bytes) -----------------------------------
  double getMemoryFraction(c10::DeviceIndex device) override {
    check_device(device);
    return fraction_[device].load();
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    check_device(device);
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "invalid fraction:", fraction,
                ". Please set within [0, 1].");
    fraction_[device].store(fraction);
    // The pool's budget too: short of it, the pool gathers free pages rather than growing
    // (the cap above still refuses what would pass it).
    TORCH_CHECK(gpumem_torch_set_memory_fraction(device, fraction) == GPUMEM_SUCCESS,
                "gpumem: set_per_process_memory_fraction: ", gpumem_last_error());
  }

  // --- cache -------------------------------------------------------------------------------
  void emptyCache(c10::MempoolId_t mempool_id) override {
    // Private pools (graphs, MemPools) keep their memory while their owners live, as
    // PyTorch's allocator keeps a live pool's segments; the shared pools give theirs back.
    if (mempool_id == c10::MempoolId_t{0, 0}) (void)gpumem_torch_empty_cache();
  }
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override {
    check_device(device);
    gpumem_stats s{};
    if (gpumem_torch_stats(device, &s) == GPUMEM_SUCCESS && largest_block != nullptr)
      *largest_block = std::max<std::size_t>(*largest_block, s.cached_bytes);
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    std::lock_guard lock(live_mutex_);
    auto it = live_.find(ptr);
    TORCH_CHECK(it != live_.end(), "gpumem: getBaseAllocation of ", ptr,
                ", which is not an allocation gpumem handed out");
    if (size != nullptr) *size = it->second.size;
    return ptr;
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex) override {
    return {};
  }

  // --- streams -------------------------------------------------------------------------------
  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
    void* ptr = data.get();
    if (ptr == nullptr || data.get_deleter() != &delete_data) return;
    live_allocation a;
    {
      std::lock_guard lock(live_mutex_);
      auto it = live_.find(ptr);
      if (it == live_.end()) return;
      a = it->second;
    }
    if (a.custom) {
      a.custom->recordStream(data, stream);
      return;
    }
    const int st = gpumem_torch_record_stream_on(a.device, ptr, stream.stream());
    TORCH_CHECK(st == GPUMEM_SUCCESS, "gpumem: record_stream failed: ", gpumem_last_error());
  }

  // --- statistics ------------------------------------------------------------------------------
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    gpumem_torch_counts c{};
    const int st = gpumem_torch_memory_counts(device, &c);
    TORCH_CHECK(st == GPUMEM_SUCCESS, "gpumem: statistics of device ", int(device),
                " failed: ", gpumem_last_error());
    DeviceStats s;
    const auto set = [](auto& stat_array, std::int64_t current, std::int64_t peak,
                        std::int64_t allocated, std::int64_t freed) {
      for (auto type : {StatType::AGGREGATE, StatType::LARGE_POOL}) {
        auto& stat = stat_array[static_cast<std::size_t>(type)];
        stat.current = current;
        stat.peak = peak;
        stat.allocated = allocated;
        stat.freed = freed;
      }
    };
    const auto i = [](std::uint64_t v) { return static_cast<std::int64_t>(v); };
    // gpumem hands out what was asked for: allocated == requested == active bytes.
    set(s.allocation, i(c.allocations), i(c.allocations_peak), i(c.allocations_made),
        i(c.allocations_freed));
    set(s.active, i(c.allocations), i(c.allocations_peak), i(c.allocations_made),
        i(c.allocations_freed));
    set(s.allocated_bytes, i(c.requested_bytes), i(c.requested_bytes_peak),
        i(c.requested_bytes_allocated), i(c.requested_bytes_freed));
    set(s.active_bytes, i(c.requested_bytes), i(c.requested_bytes_peak),
        i(c.requested_bytes_allocated), i(c.requested_bytes_freed));
    set(s.requested_bytes, i(c.requested_bytes), i(c.requested_bytes_peak),
        i(c.requested_bytes_allocated), i(c.requested_bytes_freed));
    const std::int64_t reserved = i(c.reserved_bytes);
    const std::int64_t reserved_peak = std::max(i(c.reserved_bytes_peak), reserved);
    const std::int64_t base = reserved_base_[device].load();
    set(s.reserved_bytes, reserved, reserved_peak, std::max<std::int64_t>(reserved_peak - base, 0),
        std::max<std::int64_t>(reserved_peak - base - reserved, 0));
    set(s.segment, reserved > 0 ? 1 : 0, reserved_peak > 0 ? 1 : 0, 0, 0);
    set(s.inactive_split_bytes, std::max<std::int64_t>(reserved - i(c.requested_bytes), 0), 0,
        0, 0);
    s.num_alloc_retries = i(c.alloc_retries);
    s.num_ooms = i(c.oom_count);
    return s;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    gpumem_torch_counts c{};
    if (gpumem_torch_memory_counts(device, &c) == GPUMEM_SUCCESS)
      reserved_base_[device].store(static_cast<std::int64_t>(c.reserved_bytes));
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    const int st = gpumem_torch_reset_peak(device);
    TORCH_CHECK(st == GPUMEM_SUCCESS, "gpumem: reset_peak_memory_stats failed: ",
                gpumem_last_error());
  }

  // --- history and snapshots -------------------------------------------------------------------
  bool isHistoryEnabled() override { return recording_.load(); }
  void recordHistory(bool enabled, cca::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, cca::RecordContext when,
                     bool clear_history, const std::vector<std::string>& skip_actions) override {
    std::lock_guard lock(history_mutex_);
    context_recorder_ = enabled && when != cca::RecordContext::NEVER ? context_recorder : nullptr;
    max_entries_ = std::max<std::size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const std::string& a : skip_actions) skip_.insert(a);
    if (clear_history) history_.clear();
    while (history_.size() > max_entries_) history_.pop_front();
    recording_.store(enabled);
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard lock(history_mutex_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard lock(history_mutex_);
    trackers_.push_back(std::move(tracker));
    has_trackers_.store(true);
  }
  cca::SnapshotInfo snapshot(c10::MempoolId_t mempool_id, bool include_traces) override {
    cca::SnapshotInfo info;
    {
      // One segment per live allocation: gpumem's pages are not PyTorch's segments, and a
      // block is what memory_viz draws.
      std::lock_guard lock(live_mutex_);
      std::map<std::uintptr_t, std::pair<void*, const live_allocation*>> ordered;
      for (const auto& [p, a] : live_)
        if (mempool_id == c10::MempoolId_t{0, 0} || a.pool == mempool_id)
          ordered.emplace(reinterpret_cast<std::uintptr_t>(p), std::make_pair(p, &a));
      for (const auto& [addr, pa] : ordered) {
        const live_allocation& a = *pa.second;
        cca::SegmentInfo seg;
        seg.device = a.device;
        seg.address = addr;
        seg.total_size = a.size;
        seg.requested_size = a.size;
        seg.allocated_size = a.size;
        seg.active_size = a.size;
        seg.stream = a.stream;
        seg.is_large = true;
        seg.owner_private_pool_id = a.pool;
        cca::BlockInfo block;
        block.size = a.size;
        block.requested_size = a.size;
        block.allocated = true;
        block.active = true;
        seg.blocks.push_back(std::move(block));
        info.segments.push_back(std::move(seg));
      }
    }
    std::lock_guard lock(history_mutex_);
    info.device_traces.resize(std::max(device_count_, 1));
    if (!include_traces) return info;
    for (const cca::TraceEntry& e : history_)
      if (e.device_ >= 0 && e.device_ < static_cast<int>(info.device_traces.size()))
        info.device_traces[e.device_].push_back(e);
    return info;
  }

  // --- pools: CUDA graphs and MemPool ------------------------------------------------------
  // A pool's uses follow PyTorch's: createOrIncrefPool and beginAllocateToPool take one,
  // releasePool gives one back; libgpumem_torch.so's private pool of the id counts the same
  // calls, so it lives, with its cached memory, until the last use is given back and its
  // last allocation freed.
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t id,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    check_device(device);
    {
      std::lock_guard lock(pools_mutex_);
      pool_record& r = pools_[id];
      if (r.uses == 0 && allocator && allocator.get() != this) r.custom = std::move(allocator);
      ++r.uses;
      if (r.custom) return;
    }
    // A begin that routes nothing, ended at once: the private pool's use without a route.
    gpumem_torch_begin_allocate_to_pool(device, {id.first, id.second},
                                        [](CUstream_st*) { return false; });
    gpumem_torch_end_allocate_to_pool(device, {id.first, id.second});
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    std::lock_guard lock(pools_mutex_);
    auto it = pools_.find(id);
    return it == pools_.end() ? 0 : it->second.uses;
  }
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t id, bool use_on_oom) override {
    check_device(device);
    std::lock_guard lock(pools_mutex_);
    pools_[id].use_on_oom = use_on_oom;
  }
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t) override { check_device(device); }

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id,
                           std::function<bool(cudaStream_t)> filter) override {
    check_device(device);
    std::shared_ptr<cca::CUDAAllocator> custom;
    {
      std::lock_guard lock(pools_mutex_);
      pool_record& r = pools_[id];
      ++r.uses;
      custom = r.custom;
    }
    if (!custom)
      gpumem_torch_begin_allocate_to_pool(
          device, {id.first, id.second},
          [filter](CUstream_st* s) { return filter(reinterpret_cast<cudaStream_t>(s)); });
    std::lock_guard lock(routes_mutex_);
    routes_.push_back({device, id, std::move(filter), std::move(custom)});
    routing_.store(true);
  }
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    bool custom = false;
    {
      std::lock_guard lock(routes_mutex_);
      for (auto it = routes_.rbegin(); it != routes_.rend(); ++it)
        if (it->device == device && it->id == id) {
          custom = it->custom != nullptr;
          routes_.erase(std::next(it).base());
          break;
        }
      routing_.store(!routes_.empty());
    }
    if (!custom) gpumem_torch_end_allocate_to_pool(device, {id.first, id.second});
  }
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t id) override {
    check_device(device);
    bool custom = false;
    {
      std::lock_guard lock(pools_mutex_);
      auto it = pools_.find(id);
      if (it != pools_.end()) {
        custom = it->second.custom != nullptr;
        if (--it->second.uses <= 0) pools_.erase(it);
      }
    }
    if (!custom) gpumem_torch_release_pool(device, {id.first, id.second});
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t id,
                                const std::unordered_set<void*>& expected) override {
    check_device(device);
    std::lock_guard lock(live_mutex_);
    std::size_t n = 0;
    for (const auto& [p, a] : live_)
      if (a.pool == id && a.device == device) {
        if (expected.count(p) == 0) return false;
        ++n;
      }
    return n == expected.size();
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::MempoolId_t id) override {
    check_device(device);
    auto state = std::make_shared<pool_checkpoint>();
    state->id = id;
    state->device = device;
    std::lock_guard lock(live_mutex_);
    for (const auto& [p, a] : live_)
      if (a.pool == id && a.device == device) state->live.emplace_back(p, a);
    return state;
  }
  // PyTorch's contract: every allocation of the pool is freed (ptrs_freed), then every
  // allocation of the checkpoint is made again at its address (dataptrs_allocd, with this
  // allocator's deleter). Allocations in both stay as they are; those live now but not in
  // the checkpoint are freed; those of the checkpoint freed since are taken back at their
  // addresses in the graph's private pool, whose memory there is idle (PyTorch's graph
  // trees synchronize before restoring).
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override {
    check_device(device);
    auto* state = dynamic_cast<pool_checkpoint*>(pps.get());
    TORCH_CHECK(state != nullptr, "gpumem: setCheckpointPoolState with a state gpumem did not make");
    std::unordered_set<void*> wanted;
    for (const auto& [p, a] : state->live) wanted.insert(p);
    std::vector<void*> live_now, not_wanted;
    {
      std::lock_guard lock(live_mutex_);
      for (const auto& [p, a] : live_)
        if (a.pool == state->id && a.device == device) {
          live_now.push_back(p);
          if (wanted.count(p) == 0) not_wanted.push_back(p);
        }
    }
    for (void* p : not_wanted) free(p);
    const std::unordered_set<void*> kept(live_now.begin(), live_now.end());
    cca::CheckpointDelta delta;
    delta.ptrs_freed = live_now;
    for (const auto& [p, a] : state->live) {
      if (kept.count(p) == 0) {
        const int st = gpumem_torch_graph_pool_allocate_at(
            device, {state->id.first, state->id.second}, p, static_cast<ssize_t>(a.size), a.stream);
        TORCH_CHECK(st == GPUMEM_SUCCESS, "gpumem: restoring a CUDA graph pool to its checkpoint: ",
                    a.size, " bytes at ", p, " cannot be allocated there again (",
                    st == -1 ? std::string("the pool is gone") : std::string(gpumem_last_error()),
                    "); run with torch._inductor.config.triton.cudagraph_trees = False");
        std::lock_guard lock(live_mutex_);
        live_.emplace(p, a);
      }
      delta.dataptrs_allocd.emplace_back(p, p, &delete_data,
                                         c10::Device(c10::DeviceType::CUDA, device));
    }
    return delta;
  }

  // --- IPC -------------------------------------------------------------------------------------
  // The handle of PyTorch's expandable segments (torch_ipc.cpp): torch.multiprocessing and
  // reduce_tensor send it, and a process running gpumem or PyTorch's own allocator opens it.
  // PyTorch keeps the exporter's storage alive until every importer lets go (its reference
  // counting); the descriptors close when the allocation is freed.
  cca::ShareableHandle shareIpcHandle(void* ptr) override {
    live_allocation a;
    {
      std::lock_guard lock(live_mutex_);
      auto it = live_.find(ptr);
      TORCH_CHECK(it != live_.end(), "gpumem: CUDA IPC of ", ptr,
                  ", which is not an allocation gpumem handed out");
      a = it->second;
    }
    TORCH_CHECK(!a.custom, "gpumem: CUDA IPC of an allocation of a MemPool with its own "
                           "allocator is that allocator's to share");
    std::string handle(256, '\0');
    std::size_t length = 0, offset = 0;
    int s = gpumem_torch_ipc_share(a.device, ptr, a.size, handle.data(), handle.size(), &length,
                                   &offset);
    if (s != GPUMEM_SUCCESS && length > handle.size()) {
      handle.resize(length);
      s = gpumem_torch_ipc_share(a.device, ptr, a.size, handle.data(), handle.size(), &length,
                                 &offset);
    }
    TORCH_CHECK(s == GPUMEM_SUCCESS, "gpumem: CUDA IPC of ", ptr, ": ", gpumem_last_error());
    handle.resize(length);
    return {static_cast<std::ptrdiff_t>(offset), std::move(handle)};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    std::lock_guard lock(ipc_mutex_);
    if (auto it = opened_.find(handle); it != opened_.end())
      if (auto sp = it->second.lock()) return sp;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* base = nullptr;
    std::size_t mapped = 0;
    TORCH_CHECK(gpumem_torch_ipc_open(device, handle.data(), handle.size(), &base, &mapped) ==
                    GPUMEM_SUCCESS,
                "gpumem: opening a CUDA IPC handle: ", gpumem_last_error());
    // The mapping goes when the last tensor over it does (PyTorch's rebuilt storages hold
    // this pointer), after the device finishes the work queued on it.
    std::shared_ptr<void> sp(base, [this, handle, device, mapped](void* p) {
      {
        std::lock_guard lock(ipc_mutex_);
        auto it = opened_.find(handle);
        if (it != opened_.end() && it->second.expired()) opened_.erase(it);
      }
      c10::cuda::CUDAGuard guard(device);
      if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
      if (gpumem_free(gpumem_torch_pool(device), p, mapped, nullptr) != GPUMEM_SUCCESS)
        std::fprintf(stderr, "gpumem_torch_native: unmapping an IPC import: %s\n",
                     gpumem_last_error());
    });
    opened_[handle] = sp;
    return sp;
  }

  // --- peers ------------------------------------------------------------------------------------
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dst_device == src_device)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }

 private:
  void check_device(c10::DeviceIndex device) const {
    TORCH_CHECK(device >= 0 && device < max_devices, "gpumem: invalid device ", int(device));
  }

  void* malloc_on(std::size_t nbytes, c10::DeviceIndex device, cudaStream_t stream) {
    std::shared_ptr<cca::CUDAAllocator> custom;
    c10::MempoolId_t pool{0, 0};
    if (routing_.load(std::memory_order_acquire)) {
      std::lock_guard lock(routes_mutex_);
      for (auto it = routes_.rbegin(); it != routes_.rend(); ++it)
        if (it->device == device && it->filter(stream)) {
          custom = it->custom;
          pool = it->id;
          break;
        }
    }
    void* p = nullptr;
    if (custom) {
      p = custom->raw_alloc_with_stream(nbytes, stream);
    } else {
      try {
        p = gpumem_torch_malloc(static_cast<ssize_t>(nbytes), device, stream);
        if (pool == c10::MempoolId_t{0, 0}) p = within_fraction(p, nbytes, device, stream);
      } catch (const c10::OutOfMemoryError&) {
        notify_out_of_memory(device, nbytes, stream);
        throw;
      }
    }
    try {
      std::lock_guard lock(live_mutex_);
      live_.emplace(p, live_allocation{nbytes, device, stream, pool, std::move(custom)});
    } catch (...) {
      gpumem_torch_free(p, static_cast<ssize_t>(nbytes), device, stream);
      throw;
    }
    trace(cca::TraceEntry::ALLOC, device, p, nbytes, stream, pool);
    return p;
  }

  // The memory fraction's cap: an allocation that leaves reserved bytes above it is given
  // back, cached memory released, and tried once more; still above, out-of-memory.
  void* within_fraction(void* p, std::size_t nbytes, c10::DeviceIndex device,
                        cudaStream_t stream) {
    const double fraction = fraction_[device].load(std::memory_order_relaxed);
    if (fraction >= 1.0) return p;
    const std::uint64_t cap = cap_bytes(device, fraction);
    for (int attempt = 0;; ++attempt) {
      gpumem_torch_counts c{};
      if (gpumem_torch_memory_counts(device, &c) != GPUMEM_SUCCESS || c.reserved_bytes <= cap)
        return p;
      gpumem_torch_free(p, static_cast<ssize_t>(nbytes), device, stream);
      if (attempt == 1) {
        (void)gpumem_torch_empty_cache();  // the refused request's pages leave the cap too
        gpumem_torch_counts now{};
        (void)gpumem_torch_memory_counts(device, &now);
        notify_out_of_memory(device, nbytes, stream);
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                         nbytes, " bytes on device ", int(device), ": the allowed memory (",
                         fraction, " of the device, ", cap, " bytes) would be exceeded; gpumem ",
                         "holds ", now.reserved_bytes, " bytes, ", now.requested_bytes,
                         " of them allocated by PyTorch.");
      }
      (void)gpumem_torch_empty_cache();
      p = gpumem_torch_malloc(static_cast<ssize_t>(nbytes), device, stream);
    }
  }
  std::uint64_t cap_bytes(c10::DeviceIndex device, double fraction) {
    std::size_t free = 0, total = 0;
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return static_cast<std::uint64_t>(fraction * static_cast<double>(total));
  }

  void notify_out_of_memory(c10::DeviceIndex device, std::size_t nbytes, cudaStream_t stream) {
    std::size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) (void)cudaGetLastError();
    trace(cca::TraceEntry::OOM, device, reinterpret_cast<void*>(free), nbytes, stream, {0, 0});
    std::vector<cca::OutOfMemoryObserver> observers;
    {
      std::lock_guard lock(history_mutex_);
      observers = oom_observers_;
    }
    gpumem_torch_counts c{};
    (void)gpumem_torch_memory_counts(device, &c);
    for (const auto& o : observers) o(device, c.requested_bytes, total, free);
  }

  void trace(cca::TraceEntry::Action action, c10::DeviceIndex device, void* addr,
             std::size_t size, cudaStream_t stream, c10::MempoolId_t pool) {
    if (!recording_.load(std::memory_order_relaxed) &&
        !has_trackers_.load(std::memory_order_relaxed))
      return;
    std::lock_guard lock(history_mutex_);
    std::shared_ptr<c10::GatheredContext> context =
        context_recorder_ != nullptr && action == cca::TraceEntry::ALLOC ? context_recorder_()
                                                                          : nullptr;
    cca::TraceEntry e(action, device, reinterpret_cast<std::size_t>(addr), size, stream, pool,
                      c10::getApproximateTime(), std::move(context));
    for (const auto& t : trackers_) t(e);
    if (!recording_.load(std::memory_order_relaxed)) return;
    static const char* const names[] = {"alloc", "free_requested", "free_completed",
                                        "segment_alloc", "segment_free", "segment_map",
                                        "segment_unmap", "snapshot", "oom"};
    if (static_cast<std::size_t>(action) < std::size(names) &&
        skip_.count(names[static_cast<std::size_t>(action)]) != 0)
      return;
    history_.push_back(std::move(e));
    while (history_.size() > max_entries_) history_.pop_front();
  }

  std::atomic<bool> initialized_{false};
  bool enabled_ = true;
  int device_count_ = 0;
  std::array<std::atomic<double>, max_devices> fraction_;  // 1.0 each, set by the constructor
  std::array<std::atomic<std::int64_t>, max_devices> reserved_base_{};

  std::mutex live_mutex_;
  std::unordered_map<void*, live_allocation> live_;

  std::mutex pools_mutex_;
  std::unordered_map<c10::MempoolId_t, pool_record, id_hash> pools_;

  // CUDA IPC handles opened here, by handle: one mapping per handle while tensors use it.
  std::mutex ipc_mutex_;
  std::unordered_map<std::string, std::weak_ptr<void>> opened_;

  std::mutex routes_mutex_;
  std::vector<route> routes_;
  std::atomic<bool> routing_{false};

  std::mutex history_mutex_;
  std::atomic<bool> recording_{false};
  std::atomic<bool> has_trackers_{false};
  cca::CreateContextFn context_recorder_ = nullptr;
  std::size_t max_entries_ = 1;
  std::unordered_set<std::string> skip_;
  std::deque<cca::TraceEntry> history_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
};

// Never destroyed: PyTorch frees tensors during interpreter shutdown.
gpumem_cuda_allocator* instance() {
  static auto* a = new gpumem_cuda_allocator();
  return a;
}

void delete_data(void* ptr) { instance()->free(ptr); }

thread_local std::string install_error_;

}  // namespace

extern "C" {

// The torch this library was built against: "<version> abi<0|1>".
__attribute__((visibility("default"))) const char* gpumem_torch_native_built_for(void) {
  return GPUMEM_TORCH_BUILT_VERSION " abi" GPUMEM_TORCH_BUILT_ABI;
}

// Makes gpumem PyTorch's CUDA allocator. 0 on success; else nonzero with the reason in
// gpumem_torch_native_error(), and PyTorch's allocator unchanged. Refused once PyTorch's
// current allocator has been initialized (CUDA started): memory it handed out could
// otherwise reach gpumem's free.
__attribute__((visibility("default"))) int gpumem_torch_native_install(void) {
  try {
    cca::CUDAAllocator* current = cca::allocator.load();
    if (current == instance()) return 0;
    if (current != nullptr && current->initialized()) {
      install_error_ = "PyTorch's CUDA allocator (" + current->name() +
                       ") is already in use; gpumem must be installed before the first CUDA "
                       "allocation";
      return 1;
    }
    cca::allocator.store(instance());
    return 0;
  } catch (const std::exception& e) {
    install_error_ = e.what();
    return 1;
  }
}

__attribute__((visibility("default"))) const char* gpumem_torch_native_error(void) {
  return install_error_.c_str();
}

// 1 when gpumem is PyTorch's current CUDA allocator.
__attribute__((visibility("default"))) int gpumem_torch_native_installed(void) {
  return cca::allocator.load() == instance() ? 1 : 0;
}

}  // extern "C"
