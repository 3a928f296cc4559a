// libgpumem_torch.so: gpumem as PyTorch's CUDA allocator, through
// torch.cuda.memory.CUDAPluggableAllocator(lib, "gpumem_torch_malloc", "gpumem_torch_free").
//
// One pool per device, created on the first allocation for that device from GPUMEM_CONF
// (the C API's configuration string) with `allocator` defaulting to GPUMEM_ALLOCATOR, else
// vmm_page_pool, and `device` set to the device PyTorch names. Pools are never destroyed:
// PyTorch frees tensors during interpreter shutdown, after static destructors would run.
//
// Streams: PyTorch passes the current stream at allocation and, at free, the stream the
// tensor was allocated on; both go to the pool unchanged, which reuses a freed block at
// once on that stream and on another only once the free is complete (stream-ordered
// reuse, as PyTorch's own allocator). A tensor also used on another stream must be
// recorded (tensor.record_stream): PyTorch forwards that to a pluggable allocator only
// through CUDAPluggableAllocator::set_record_stream_fn, so gpumem_torch_record_stream has
// that signature; python/gpumem sets it (PyTorch 2.11 exposes the setter on the allocator
// object) or, where it cannot, routes Tensor.record_stream to gpumem_torch_record_stream_on.
// A record goes to the pool of the stream's device only. At free, the freeing stream then
// waits for the recorded streams' work (gpumem_record_stream).
//
// Failures: PyTorch does not check the pointer a pluggable allocator returns (a null one
// becomes a tensor on address 0), so gpumem_torch_malloc throws with gpumem's full text
// instead; PyTorch raises a std::runtime_error in Python as a RuntimeError (measured with
// torch 2.11 on the H200). An out-of-memory's text starts "CUDA out of memory.", as
// PyTorch's own does, for code that looks for it; built against libtorch (GPUMEM_TORCH_C10,
// src/interop/CMakeLists.txt) it is PyTorch's own c10::OutOfMemoryError, raised as
// torch.OutOfMemoryError (a RuntimeError subclass), so `except torch.OutOfMemoryError`
// catches it as it catches PyTorch's allocator's. No other entry point throws: PyTorch
// frees from destructors, so a failed free or record is printed on stderr and counted.
//
// Device: the plug-in's pools use the GPU (platform:cuda) and never fall back to the sim
// device: where CUDA cannot start, creating the pool fails and every allocation throws
// saying why. The sim device serves only when asked for by name (GPUMEM_DEVICE=sim, or
// platform:sim / a sim_* key in GPUMEM_CONF), as the tests do. GPUMEM_SIM_DEVICES=N gives
// the shared sim device N GPUs, one pool each.
//
// PyTorch's statistics (gpumem_torch_memory_counts): the plug-in counts what it hands
// PyTorch, per device: requested bytes and allocations (current, peak, allocated, freed),
// with peaks that gpumem_torch_reset_peak sets back to the current values, as
// torch.cuda.reset_peak_memory_stats() does.
//
// History (gpumem_torch_record_history, torch.cuda.memory._record_memory_history's
// counterpart): while on, every allocation, free and out-of-memory the plug-in serves goes
// into one ring of the last max_entries events (all devices), with a wall-clock time; off,
// it costs one relaxed atomic load per call. Python's gpumem.torch.snapshot() puts them in
// the snapshot's device_traces.
//
// Invariants: pools_[d] is null or a pool of device d, set once; counts_[d].requested ==
// sum of the sizes of device d's allocations handed out and not freed (a refused free
// changes nothing); every peak >= its current value.
#include <sys/types.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpumem/interop/gpumem.h"
#include "gpumem/interop/gpumem_torch.h"
#include "interop/c_api_internal.hpp"
#include "interop/torch_graph_pools.hpp"

#ifdef GPUMEM_TORCH_C10
#include <c10/util/Exception.h>
#endif

namespace {

constexpr int max_devices = 64;

std::array<std::atomic<gpumem_pool*>, max_devices> pools_{};
std::mutex init_mutex_;
// Why device d's pool could not be created ("" if it was not tried or succeeded); guarded
// by init_mutex_. Printed once, thrown by every malloc for d.
std::array<std::string, max_devices> init_error_{};
std::array<gpumem_status, max_devices> init_status_{};  // the failed creation's status
std::atomic<std::uint64_t> failures_{0};

// On stderr, the one place a failure PyTorch cannot see is said.
void print(const char* what) noexcept { std::fprintf(stderr, "gpumem_torch: %s\n", what); }

// A failed free or record: printed and counted (gpumem_torch_failures).
void report(const char* what) noexcept {
  failures_.fetch_add(1, std::memory_order_relaxed);
  print(what);
}

// A value that only rises: `peak` becomes at least `value`.
void raise_peak(std::atomic<std::uint64_t>& peak, std::uint64_t value) noexcept {
  std::uint64_t seen = peak.load(std::memory_order_relaxed);
  while (seen < value &&
         !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// What the plug-in handed device d's PyTorch (see the top of this file).
struct device_counts {
  std::atomic<std::uint64_t> requested{0}, requested_peak{0}, requested_allocated{0},
      requested_freed{0};
  std::atomic<std::uint64_t> allocations{0}, allocations_peak{0}, allocations_made{0},
      allocations_freed{0};
  // Since the last gpumem_torch_reset_peak (all 0 before any): the pool's reserved bytes
  // and all-time reserved peak at the reset, and the most reserved bytes seen at a new
  // requested peak since (sampled only after a reset).
  std::atomic<std::uint64_t> resets{0}, reserved_at_reset{0}, pool_peak_at_reset{0},
      reserved_sampled{0};
  // The most reserved bytes of the shared pool and the private graph pools together seen
  // when a graph pool served an allocation (capture time), since the last reset.
  std::atomic<std::uint64_t> with_graphs_sampled{0};
};
std::array<device_counts, max_devices> counts_{};

// The history ring (see the top of this file). ring_ holds the last min(recorded_,
// capacity) events; the oldest is at recorded_ % capacity once it has wrapped.
std::atomic<bool> recording_{false};
std::mutex history_mutex_;
std::vector<gpumem_torch_event> ring_;  // guarded by history_mutex_
std::size_t capacity_ = 0;              // guarded by history_mutex_
std::uint64_t recorded_ = 0;            // guarded by history_mutex_

void record(int action, int device, const void* addr, std::uint64_t size, const void* stream) noexcept {
  if (!recording_.load(std::memory_order_relaxed)) return;
  gpumem_torch_event e{};
  e.action = action;
  e.device = device;
  e.addr = reinterpret_cast<std::uintptr_t>(addr);
  e.size = size;
  e.stream = reinterpret_cast<std::uintptr_t>(stream);
  e.time_us = static_cast<std::int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
      std::chrono::system_clock::now().time_since_epoch()).count());
  std::lock_guard lock(history_mutex_);
  if (capacity_ == 0) return;
  if (ring_.size() < capacity_)
    ring_.push_back(e);  // reserved up to capacity_: does not allocate
  else
    ring_[recorded_ % capacity_] = e;
  ++recorded_;
}

// Does the configuration string name `key` (as "key:value", spaces allowed around it)?
bool names_key(std::string_view config, std::string_view key) {
  while (!config.empty()) {
    const auto comma = config.find(',');
    std::string_view item = config.substr(0, comma);
    config = comma == std::string_view::npos ? std::string_view{} : config.substr(comma + 1);
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    if (item.substr(0, key.size()) != key) continue;
    item.remove_prefix(key.size());
    while (!item.empty() && (item.front() == ' ' || item.front() == '\t')) item.remove_prefix(1);
    if (!item.empty() && item.front() == ':') return true;
  }
  return false;
}

// The configuration of device `device`'s pool: the platform GPUMEM_DEVICE names, else
// the one GPUMEM_CONF names (platform, or a sim_* key, which implies sim), else cuda;
// then the allocator from GPUMEM_ALLOCATOR, GPUMEM_CONF (a later key wins), the device.
std::string pool_config(int device) {
  std::string config;
  const char* conf = std::getenv("GPUMEM_CONF");
  const std::string_view conf_text = conf != nullptr ? conf : "";
  const char* platform = std::getenv("GPUMEM_DEVICE");
  if (platform != nullptr && *platform != '\0')
    config = std::string("platform:") + platform + ",";
  else if (!names_key(conf_text, "platform") && !names_key(conf_text, "sim_capacity") &&
           !names_key(conf_text, "sim_devices") && !names_key(conf_text, "sim_granularity") &&
           !names_key(conf_text, "sim_no_peer"))
    config = "platform:cuda,";  // GPUMEM_CONF's sim_* keys imply sim: not contradicted
  const char* allocator = std::getenv("GPUMEM_ALLOCATOR");
  // Pages exportable, so CUDA IPC (the native allocator's shareIpcHandle) works on any
  // tensor, as with PyTorch's expandable segments; GPUMEM_CONF may say shareable:off.
  config += "shareable:on,allocator:";
  config += allocator != nullptr && *allocator != '\0' ? allocator : "vmm_page_pool";
  if (!conf_text.empty()) {
    config += ',';
    config += conf_text;  // a later key wins, so GPUMEM_CONF's allocator overrides the above
  }
  config += ",device:" + std::to_string(device);
  return config;
}

// Why pool_for last returned null on this thread (set on every such return), for
// gpumem_torch_malloc's exception.
thread_local std::string pool_failure_;

// pool_for's null: this thread's gpumem error becomes pool_failure_ with `status`, so a
// caller that returns gpumem_last_status() returns a failure, never success.
gpumem_pool* no_pool(gpumem_status status) noexcept {
  (void)gpumem::detail::c_api_fail(status != GPUMEM_SUCCESS ? status : GPUMEM_ERROR_INVALID_ARGUMENT,
                                   pool_failure_.empty() ? "gpumem_torch: no pool for the device"
                                                         : pool_failure_.c_str());
  return nullptr;
}

gpumem_pool* pool_for(int device) noexcept {
  try {
    if (device < 0 || device >= max_devices) {
      pool_failure_ = "device " + std::to_string(device) + " is out of range (0.." +
                      std::to_string(max_devices - 1) + ")";
      print(pool_failure_.c_str());
      return no_pool(GPUMEM_ERROR_INVALID_ARGUMENT);
    }
    gpumem_pool* pool = pools_[device].load(std::memory_order_acquire);
    if (pool != nullptr) return pool;
    std::lock_guard lock(init_mutex_);
    pool = pools_[device].load(std::memory_order_relaxed);
    if (pool != nullptr) return pool;
    if (!init_error_[device].empty()) {  // every later call fails the same way: printed once
      pool_failure_ = init_error_[device];
      return no_pool(init_status_[device]);
    }
    const std::string config = pool_config(device);
    if (gpumem_pool_create(config.c_str(), &pool) != GPUMEM_SUCCESS) {
      init_status_[device] = gpumem_last_status();
      init_error_[device] = "cannot create the pool for device " + std::to_string(device) +
                            " from '" + config + "': " + gpumem_last_error();
      if (gpumem_last_status() == GPUMEM_ERROR_CUDA)
        init_error_[device] +=
            " (the PyTorch plug-in uses the GPU only; GPUMEM_DEVICE=sim asks for the "
            "simulated device, for tests)";
      pool_failure_ = init_error_[device];
      print(pool_failure_.c_str());
      return no_pool(init_status_[device]);
    }
    pools_[device].store(pool, std::memory_order_release);
    return pool;
  } catch (...) {
    pool_failure_.clear();  // may throw no more: clear() does not allocate
    print("pool creation failed (host memory or locking)");
    return no_pool(GPUMEM_ERROR_INTERNAL);
  }
}

// Counts an allocation handed to PyTorch. After a reset, a new requested peak also samples
// the pool's reserved bytes (a stats read, only on new peaks), for the reserved peak; a
// private graph pool's allocation (pool null) counts without the sample.
void count_allocation(int device, gpumem_pool* pool, std::uint64_t size) noexcept {
  device_counts& c = counts_[device];
  const std::uint64_t now = c.requested.fetch_add(size, std::memory_order_relaxed) + size;
  c.requested_allocated.fetch_add(size, std::memory_order_relaxed);
  raise_peak(c.allocations_peak, c.allocations.fetch_add(1, std::memory_order_relaxed) + 1);
  c.allocations_made.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t peak = c.requested_peak.load(std::memory_order_relaxed);
  if (now <= peak) return;
  raise_peak(c.requested_peak, now);
  if (pool != nullptr && c.resets.load(std::memory_order_relaxed) != 0) {
    gpumem_stats s{};
    if (gpumem_pool_stats(pool, &s) == GPUMEM_SUCCESS) raise_peak(c.reserved_sampled, s.reserved_bytes);
  }
}

// Samples the shared pool's and the device's graph pools' reserved bytes together (only
// when a graph pool serves an allocation: capture time, off the steady path).
void sample_reserved_with_graphs(int device) noexcept {
  gpumem_pool* pool = pools_[device].load(std::memory_order_acquire);
  gpumem_stats s{};
  if (pool != nullptr && gpumem_pool_stats(pool, &s) != GPUMEM_SUCCESS) return;
  raise_peak(counts_[device].with_graphs_sampled,
             s.reserved_bytes + gpumem_torch::graph_pools_totals(device).reserved_bytes);
}

void count_free(int device, std::uint64_t size) noexcept {
  device_counts& c = counts_[device];
  c.requested.fetch_sub(size, std::memory_order_relaxed);
  c.requested_freed.fetch_add(size, std::memory_order_relaxed);
  c.allocations.fetch_sub(1, std::memory_order_relaxed);
  c.allocations_freed.fetch_add(1, std::memory_order_relaxed);
}

// A free of device `device`'s shared pool; a failure is reported (PyTorch frees from
// destructors, which cannot raise).
void free_to_shared_pool(void* ptr, size_t size, int device, void* stream) noexcept {
  gpumem_pool* pool = device >= 0 && device < max_devices
                          ? pools_[device].load(std::memory_order_acquire)
                          : nullptr;
  if (pool == nullptr) {
    report("gpumem_torch_free: no pool for this device (pointer not from gpumem)");
    return;
  }
  if (gpumem_free(pool, ptr, size, stream) != GPUMEM_SUCCESS) {
    report(gpumem_last_error());
    return;
  }
  count_free(device, static_cast<std::uint64_t>(size));
  record(GPUMEM_TORCH_EVENT_FREE, device, ptr, static_cast<std::uint64_t>(size), stream);
}

}  // namespace

extern "C" {

// Throws on failure (see the top of this file): an out-of-memory as c10::OutOfMemoryError
// when built against libtorch, anything else (and any failure without libtorch) as
// std::runtime_error. Null only for size 0.
// The thread's current tag (gpumem_current_tag: gpumem.torch.tag) places the tensor: tag 0
// as gpumem_malloc, others in the tag's own pages.
static void* allocate_in_current_tag(gpumem_pool* pool, size_t size, void* stream) noexcept {
  const uint32_t tag = gpumem_current_tag();
  if (tag == 0) return gpumem_malloc(pool, size, stream);
  void* ptr = nullptr;
  return gpumem_allocate_tagged(pool, size, 256, stream, tag, &ptr) == GPUMEM_SUCCESS ? ptr : nullptr;
}

namespace {
// A request larger than the whole device: gpumem refuses it as an invalid argument, PyTorch's
// callers expect the out-of-memory cudaMalloc gives (torch.OutOfMemoryError).
bool larger_than_device(gpumem_pool* pool, size_t size) {
  size_t free_bytes = 0, total = 0;
  return gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT && pool != nullptr &&
         gpumem_device_memory(pool, &free_bytes, &total) == GPUMEM_SUCCESS && size > total;
}
// Whether the refusal just made (gpumem_last_status) is an out-of-memory for PyTorch.
bool refused_for_memory(gpumem_pool* pool, size_t size) {
  return gpumem_last_status() == GPUMEM_ERROR_OUT_OF_MEMORY || larger_than_device(pool, size);
}
}  // namespace

GPUMEM_API void* gpumem_torch_malloc(ssize_t size, int device, void* stream) {
  if (size == 0) return nullptr;  // PyTorch's own allocator returns null for empty tensors
  std::string why;
  bool out_of_memory = false;
  if (size < 0) {
    why = "gpumem_torch_malloc: negative size " + std::to_string(size);
  } else if (gpumem_torch::graph_pool* graph = gpumem_torch::graph_pool_for(device, stream)) {
    // A capture (or MemPool context) routes this stream's allocations to its private pool.
    if (void* ptr = gpumem_torch::graph_pool_allocate(graph, static_cast<size_t>(size), stream)) {
      count_allocation(device, nullptr, static_cast<std::uint64_t>(size));
      sample_reserved_with_graphs(device);
      record(GPUMEM_TORCH_EVENT_ALLOC, device, ptr, static_cast<std::uint64_t>(size), stream);
      return ptr;
    }
    why = gpumem_last_error();
    out_of_memory = refused_for_memory(pool_for(device), static_cast<size_t>(size));
  } else if (gpumem_pool* pool = pool_for(device); pool == nullptr) {
    why = "gpumem_torch: " + (pool_failure_.empty() ? std::string("pool creation failed")
                                                    : pool_failure_);
  } else if (void* ptr = allocate_in_current_tag(pool, static_cast<size_t>(size), stream)) {
    count_allocation(device, pool, static_cast<std::uint64_t>(size));
    record(GPUMEM_TORCH_EVENT_ALLOC, device, ptr, static_cast<std::uint64_t>(size), stream);
    return ptr;
  } else {
    why = gpumem_last_error();
    out_of_memory = refused_for_memory(pool, static_cast<size_t>(size));
  }
  // Out of memory, in a graph's pool or the device's: PyTorch's phrase first, and the
  // out-of-memory observers hear of it.
  if (out_of_memory) {
    record(GPUMEM_TORCH_EVENT_OOM, device, nullptr, static_cast<std::uint64_t>(size), stream);
    why = "CUDA out of memory. " + why;
  }
  failures_.fetch_add(1, std::memory_order_relaxed);
#ifdef GPUMEM_TORCH_C10
  if (out_of_memory)
    throw c10::OutOfMemoryError(
        c10::SourceLocation{__func__, __FILE__, static_cast<std::uint32_t>(__LINE__)}, why);
#endif
  throw std::runtime_error(why);
}

// 1 when gpumem_torch_malloc's out-of-memory is PyTorch's c10::OutOfMemoryError (built
// against libtorch), 0 when it is a std::runtime_error.
GPUMEM_API int gpumem_torch_oom_is_torch_type(void) {
#ifdef GPUMEM_TORCH_C10
  return 1;
#else
  return 0;
#endif
}

GPUMEM_API void gpumem_torch_free(void* ptr, ssize_t size, int device, void* stream) {
  if (ptr == nullptr) return;
  if (gpumem_status st = GPUMEM_SUCCESS;
      gpumem_torch::graph_pool_free(ptr, static_cast<size_t>(size), stream, &st)) {
    if (st != GPUMEM_SUCCESS) {
      report(gpumem_last_error());
      return;
    }
    if (device >= 0 && device < max_devices) {
      count_free(device, static_cast<std::uint64_t>(size));
      record(GPUMEM_TORCH_EVENT_FREE, device, ptr, static_cast<std::uint64_t>(size), stream);
    }
    return;
  }
  if (gpumem_torch::graph_pool_for(device, stream) != nullptr) {
    try {
      gpumem_torch::defer_free({ptr, static_cast<size_t>(size), device, stream});
      return;
    } catch (...) {
      // No memory to note it: freed now, as without a capture.
    }
  }
  free_to_shared_pool(ptr, static_cast<size_t>(size), device, stream);
}

// The signature of CUDAPluggableAllocator::set_record_stream_fn. The device is not given:
// the stream's device (asked of the platform the pools share) names the one pool that
// records it, as a tensor is recorded on streams of its own device. A failure (an unknown
// stream, no pool for that device, a pointer that pool did not hand out) is reported.
GPUMEM_API void gpumem_torch_record_stream(void* ptr, void* stream) {
  int device = -1;
  bool any_pool = false;
  for (auto& slot : pools_)
    if (gpumem_pool* pool = slot.load(std::memory_order_acquire)) {
      any_pool = true;
      if (gpumem_stream_device(pool, stream, &device) == GPUMEM_SUCCESS) break;
    }
  if (!any_pool) {
    report("gpumem_torch_record_stream: no pool yet (pointer not from gpumem)");
    return;
  }
  if (device < 0) {
    report(gpumem_last_error());
    return;
  }
  gpumem_pool* pool =
      device < max_devices ? pools_[device].load(std::memory_order_acquire) : nullptr;
  if (pool == nullptr) {
    char text[160];
    std::snprintf(text, sizeof text,
                  "gpumem_torch_record_stream: the stream is on device %d, which has no gpumem "
                  "pool (pointer not from gpumem)", device);
    report(text);
    return;
  }
  if (gpumem_record_stream(pool, ptr, stream) != GPUMEM_SUCCESS) report(gpumem_last_error());
}

// As above, for a caller that knows the device (python/gpumem's Tensor.record_stream).
GPUMEM_API int gpumem_torch_record_stream_on(int device, void* ptr, void* stream) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  return gpumem_record_stream(pool, ptr, stream);
}

// The device's pool (created now if needed), for the C API and ctypes; NULL on failure.
GPUMEM_API gpumem_pool* gpumem_torch_pool(int device) { return pool_for(device); }

// set_per_process_memory_fraction: the pool's budget becomes that share of the device
// (1 or more: none), so a pool short of it gathers free pages rather than growing.
GPUMEM_API int gpumem_torch_set_memory_fraction(int device, double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) return GPUMEM_ERROR_INVALID_ARGUMENT;
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return gpumem_last_status();
  size_t free_bytes = 0, total = 0;
  if (const gpumem_status s = gpumem_device_memory(pool, &free_bytes, &total); s != GPUMEM_SUCCESS)
    return s;
  const auto bytes = fraction >= 1.0 ? uint64_t{0}
                                     : static_cast<uint64_t>(fraction * static_cast<double>(total));
  // A fraction of 0 allows nothing: the smallest budget, one byte.
  const gpumem_status s = gpumem_pool_set_budget(pool, fraction >= 1.0 ? 0 : std::max<uint64_t>(bytes, 1), nullptr);
  // Other allocators have no budget: the native allocator's cap still holds there.
  return s == GPUMEM_ERROR_INVALID_ARGUMENT && std::string_view(gpumem_pool_allocator(pool)) != "vmm_page_pool"
             ? GPUMEM_SUCCESS
             : s;
}

// Has the device's pool been created (by an allocation or gpumem_torch_pool)?
GPUMEM_API int gpumem_torch_pool_exists(int device) {
  return device >= 0 && device < max_devices &&
         pools_[device].load(std::memory_order_acquire) != nullptr;
}

GPUMEM_API int gpumem_torch_stats(int device, gpumem_stats* out) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  return gpumem_pool_stats(pool, out);
}

GPUMEM_API int gpumem_torch_snapshot(int device, const char* path) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  return gpumem_snapshot(pool, path);
}

// Gives cached memory of every pool back (torch.cuda.empty_cache's counterpart).
GPUMEM_API unsigned long long gpumem_torch_empty_cache(void) {
  unsigned long long total = 0;
  for (auto& slot : pools_)
    if (gpumem_pool* pool = slot.load(std::memory_order_acquire)) {
      uint64_t released = 0;
      if (gpumem_pool_trim(pool, &released) == GPUMEM_SUCCESS) total += released;
    }
  return total;
}

// The signature of CUDAPluggableAllocator::set_reset_fn, which torch.cuda.empty_cache()
// calls: gives every pool's cached memory back.
GPUMEM_API void gpumem_torch_reset(void) { (void)gpumem_torch_empty_cache(); }

// A step boundary of the training or serving loop, for every pool created so far (see
// gpumem_pool_mark_step). Returns the first failure's status, 0 when all succeeded.
GPUMEM_API int gpumem_torch_mark_step(void) {
  int first_failure = GPUMEM_SUCCESS;
  for (auto& slot : pools_)
    if (gpumem_pool* pool = slot.load(std::memory_order_acquire))
      if (const gpumem_status st = gpumem_pool_mark_step(pool); st != GPUMEM_SUCCESS) {
        report(gpumem_last_error());
        if (first_failure == GPUMEM_SUCCESS) first_failure = st;
      }
  return first_failure;
}

// CUDA graph pools (torch_graph_pools.hpp): the signatures of
// CUDAPluggableAllocator::set_begin_allocate_to_pool, set_end_allocate_to_pool_fn and
// set_release_pool. A private pool that cannot be created throws: PyTorch raises it in
// Python before the capture begins.
GPUMEM_API void gpumem_torch_begin_allocate_to_pool(int device, gpumem_torch::mempool_id id,
                                                    gpumem_torch::capture_filter filter) {
  gpumem_torch::begin_allocate_to_pool(device, id, std::move(filter), pool_config(device).c_str());
}

GPUMEM_API void gpumem_torch_end_allocate_to_pool(int device, gpumem_torch::mempool_id id) {
  // PyTorch ends the stream capture before it calls this: the deferred frees are made on
  // streams no longer capturing.
  for (const gpumem_torch::deferred_free& f : gpumem_torch::end_allocate_to_pool(device, id))
    free_to_shared_pool(f.ptr, f.size, f.device, f.stream);
}

GPUMEM_API void gpumem_torch_release_pool(int device, gpumem_torch::mempool_id id) {
  gpumem_torch::release_pool(device, id);
}

namespace {
// Whether `tag` of the device's pool was ever allocated in (a sleep or wake of one never
// used is refused by gpumem_sleep).
bool tag_used(gpumem_pool* pool, uint32_t tag) {
  gpumem_stats s{};
  return gpumem_tag_stats(pool, tag, &s) == GPUMEM_SUCCESS && s.allocations != 0;
}
}  // namespace

// A tag of the device's pool and the private pools (CUDA graphs, MemPools) made under it
// sleep together (torch_graph_pools.hpp): the device's part first, then the private pools.
// Refusals and failures are gpumem_sleep's; a call that fails halfway leaves the parts
// before the failure asleep, and the same call again puts the rest to sleep. A call with
// nothing left awake is refused as gpumem_sleep refuses a second sleep.
GPUMEM_API int gpumem_torch_sleep(int device, uint32_t tag, int mode, void* stream) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return gpumem_last_status();
  const std::size_t privates = gpumem_torch::tag_pool_count(device, tag);
  if (privates == 0 || tag == GPUMEM_TAG_SHARED || (mode != GPUMEM_SLEEP_OFFLOAD && mode != GPUMEM_SLEEP_DISCARD))
    return gpumem_sleep(pool, tag, mode, stream);
  const int asleep = gpumem_tag_asleep(pool, tag);
  if (asleep < 0) return gpumem_last_status();
  bool any = false;
  if (asleep == 0 && tag_used(pool, tag)) {
    if (const gpumem_status st = gpumem_sleep(pool, tag, mode, stream); st != GPUMEM_SUCCESS)
      return st;
    any = true;
  }
  std::size_t slept = 0;
  const gpumem_status st = gpumem_torch::sleep_tag_pools(device, tag, mode, stream, &slept);
  if (st != GPUMEM_SUCCESS || any || slept != 0) return st;
  return gpumem_sleep(pool, tag, mode, stream);  // nothing was awake: its refusal
}

// Wakes what gpumem_torch_sleep put to sleep: the device's part first, then the private
// pools. Out of memory (no room) stops it with the rest still asleep and their bytes
// kept; the same call again goes on. A call with nothing asleep is refused as gpumem_wake
// refuses a wake of a tag that does not sleep.
GPUMEM_API int gpumem_torch_wake(int device, uint32_t tag, void* stream) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return gpumem_last_status();
  if (gpumem_torch::tag_pool_count(device, tag) == 0) return gpumem_wake(pool, tag, stream);
  const int asleep = gpumem_tag_asleep(pool, tag);
  if (asleep < 0) return gpumem_last_status();
  if (asleep == 1)
    if (const gpumem_status st = gpumem_wake(pool, tag, stream); st != GPUMEM_SUCCESS) return st;
  std::size_t woken = 0;
  const gpumem_status st = gpumem_torch::wake_tag_pools(device, tag, stream, &woken);
  if (st != GPUMEM_SUCCESS || asleep == 1 || woken != 0) return st;
  return gpumem_wake(pool, tag, stream);  // nothing was asleep: its refusal
}

// The device's pool and its tags first, then the private pools (CUDA graphs, MemPools).
GPUMEM_API int gpumem_torch_set_keep_free(int device, uint64_t bytes) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return gpumem_last_status();
  if (const gpumem_status st = gpumem_pool_set_keep_free(pool, bytes); st != GPUMEM_SUCCESS)
    return st;
  return gpumem_torch::set_keep_free(device, static_cast<std::size_t>(bytes));
}

// The device's part first (when the tag was allocated in there), then the private pools.
GPUMEM_API int gpumem_torch_release_host(int device, uint32_t tag, uint64_t* released) {
  if (released != nullptr) *released = 0;
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return gpumem_last_status();
  const bool privates = gpumem_torch::tag_pool_count(device, tag) != 0;
  std::uint64_t own = 0;
  if (!privates || tag_used(pool, tag))
    if (const gpumem_status st = gpumem_release_host(pool, tag, &own); st != GPUMEM_SUCCESS)
      return st;
  std::uint64_t theirs = 0;
  const gpumem_status st = gpumem_torch::release_tag_pools_host(device, tag, &theirs);
  if (released != nullptr) *released = own + theirs;
  return st;
}

GPUMEM_API int gpumem_torch_host_bytes(int device, uint32_t tag, uint64_t* bytes) {
  if (bytes == nullptr)
    return gpumem::detail::c_api_fail(GPUMEM_ERROR_INVALID_ARGUMENT,
                                      "gpumem_torch_host_bytes: null output pointer");
  *bytes = 0;
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return gpumem_last_status();
  std::uint64_t own = 0;
  if (const gpumem_status st = gpumem_tag_host_bytes(pool, tag, &own); st != GPUMEM_SUCCESS)
    return st;
  *bytes = own + gpumem_torch::tag_pools_host_bytes(device, tag);
  return GPUMEM_SUCCESS;
}

GPUMEM_API int gpumem_torch_tag_asleep(int device, uint32_t tag) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return -1;
  if (const int own = gpumem_tag_asleep(pool, tag); own != 0) return own;
  return gpumem_torch::tag_pools_asleep(device, tag) > 0 ? 1 : 0;
}

GPUMEM_API int gpumem_torch_tag_used(int device, uint32_t tag) {
  gpumem_pool* pool = pool_for(device);
  if (pool == nullptr) return -1;
  return tag_used(pool, tag) || gpumem_torch::tag_pool_count(device, tag) > 0 ? 1 : 0;
}

// Allocates `size` at exactly `ptr` in the private pool of (device, id): the allocator's
// setCheckpointPoolState gives a CUDA graph tree's checkpointed allocations back their
// addresses. GPUMEM_SUCCESS; -1 for a size under 1 or no private pool of that id on the
// device; else the pool's status, with the reason in gpumem_last_error.
GPUMEM_API int gpumem_torch_graph_pool_allocate_at(int device, gpumem_torch::mempool_id id,
                                                   void* ptr, ssize_t size, void* stream) {
  if (size <= 0) return -1;
  bool found = false;
  const gpumem_status st = gpumem_torch::graph_pool_allocate_at(
      device, id, ptr, static_cast<size_t>(size), stream, &found);
  if (!found) return -1;
  if (st == GPUMEM_SUCCESS) {
    count_allocation(device, nullptr, static_cast<std::uint64_t>(size));
    record(GPUMEM_TORCH_EVENT_ALLOC, device, ptr, static_cast<std::uint64_t>(size), stream);
  }
  return st;
}

// Private graph pools alive now and the bytes they hold from the driver (for tests).
GPUMEM_API void gpumem_torch_graph_pools(unsigned long long* pools,
                                         unsigned long long* reserved_bytes,
                                         unsigned long long* live_allocations) {
  const gpumem_torch::graph_pool_totals t = gpumem_torch::graph_pools_totals();
  if (pools != nullptr) *pools = t.pools;
  if (reserved_bytes != nullptr) *reserved_bytes = t.reserved_bytes;
  if (live_allocations != nullptr) *live_allocations = t.live_allocations;
}

GPUMEM_API int gpumem_torch_memory_counts(int device, gpumem_torch_counts* out) {
  if (out == nullptr) return GPUMEM_ERROR_INVALID_ARGUMENT;
  gpumem_stats s{};
  if (const int st = gpumem_torch_stats(device, &s); st != GPUMEM_SUCCESS) return st;
  const device_counts& c = counts_[device];
  gpumem_torch_counts r{};
  r.requested_bytes = c.requested.load(std::memory_order_relaxed);
  r.requested_bytes_peak = std::max(c.requested_peak.load(std::memory_order_relaxed), r.requested_bytes);
  r.requested_bytes_allocated = c.requested_allocated.load(std::memory_order_relaxed);
  r.requested_bytes_freed = c.requested_freed.load(std::memory_order_relaxed);
  r.allocations = c.allocations.load(std::memory_order_relaxed);
  r.allocations_peak = std::max(c.allocations_peak.load(std::memory_order_relaxed), r.allocations);
  r.allocations_made = c.allocations_made.load(std::memory_order_relaxed);
  r.allocations_freed = c.allocations_freed.load(std::memory_order_relaxed);
  r.reserved_bytes = s.reserved_bytes;
  r.resets = c.resets.load(std::memory_order_relaxed);
  if (r.resets == 0) {
    r.reserved_bytes_peak = s.peak_reserved_bytes;
    r.reserved_peak_exact = 1;
  } else if (s.peak_reserved_bytes > c.pool_peak_at_reset.load(std::memory_order_relaxed)) {
    // A new all-time peak came after the reset: it is the peak since the reset.
    r.reserved_bytes_peak = s.peak_reserved_bytes;
    r.reserved_peak_exact = 1;
  } else {
    r.reserved_bytes_peak = std::max({c.reserved_at_reset.load(std::memory_order_relaxed),
                                      c.reserved_sampled.load(std::memory_order_relaxed),
                                      s.reserved_bytes});
    r.reserved_peak_exact = 0;
  }
  // PyTorch's reserved bytes include its graph pools': so do these. The private pools'
  // bytes alive now count in the peak too (graph pools live as long as their graphs,
  // usually beyond the shared pool's peak); a peak taken while a since-destroyed graph held
  // memory counts as sampled at its captures, and the peak is then marked inexact.
  const std::uint64_t graphs = gpumem_torch::graph_pools_totals(device).reserved_bytes;
  const std::uint64_t sampled = c.with_graphs_sampled.load(std::memory_order_relaxed);
  r.reserved_bytes += graphs;
  if (graphs != 0 || sampled != 0) {
    r.reserved_bytes_peak = std::max(r.reserved_bytes_peak + graphs, sampled);
    r.reserved_peak_exact = 0;
  }
  r.alloc_retries = s.alloc_retries;
  r.oom_count = s.oom_count;
  *out = r;
  return GPUMEM_SUCCESS;
}

GPUMEM_API int gpumem_torch_reset_peak(int device) {
  gpumem_stats s{};
  if (const int st = gpumem_torch_stats(device, &s); st != GPUMEM_SUCCESS) return st;
  device_counts& c = counts_[device];
  c.requested_peak.store(c.requested.load(std::memory_order_relaxed), std::memory_order_relaxed);
  c.allocations_peak.store(c.allocations.load(std::memory_order_relaxed), std::memory_order_relaxed);
  c.reserved_at_reset.store(s.reserved_bytes, std::memory_order_relaxed);
  c.pool_peak_at_reset.store(s.peak_reserved_bytes, std::memory_order_relaxed);
  c.reserved_sampled.store(s.reserved_bytes, std::memory_order_relaxed);
  c.with_graphs_sampled.store(0, std::memory_order_relaxed);
  c.resets.fetch_add(1, std::memory_order_relaxed);
  return GPUMEM_SUCCESS;
}

GPUMEM_API int gpumem_torch_record_history(int enabled, size_t max_entries) {
  if (!enabled) {
    recording_.store(false, std::memory_order_relaxed);
    return GPUMEM_SUCCESS;
  }
  if (max_entries == 0 || max_entries > (size_t{1} << 26)) return GPUMEM_ERROR_INVALID_ARGUMENT;
  try {
    std::lock_guard lock(history_mutex_);
    std::vector<gpumem_torch_event> ring;
    ring.reserve(max_entries);
    ring_.swap(ring);
    capacity_ = max_entries;
    recorded_ = 0;
  } catch (...) {
    return GPUMEM_ERROR_INTERNAL;  // host memory for the ring
  }
  recording_.store(true, std::memory_order_relaxed);
  return GPUMEM_SUCCESS;
}

GPUMEM_API size_t gpumem_torch_history(gpumem_torch_event* out, size_t capacity) {
  std::lock_guard lock(history_mutex_);
  const std::size_t kept = ring_.size();
  if (out != nullptr) {
    const std::size_t first = recorded_ > kept ? recorded_ % capacity_ : 0;  // the oldest
    for (std::size_t i = 0; i < kept && i < capacity; ++i) out[i] = ring_[(first + i) % kept];
  }
  return kept;
}

GPUMEM_API int gpumem_torch_recording(void) { return recording_.load(std::memory_order_relaxed) ? 1 : 0; }

// Failures reported on stderr so far (allocation, free, record, pool creation).
GPUMEM_API unsigned long long gpumem_torch_failures(void) {
  return failures_.load(std::memory_order_relaxed);
}

}  // extern "C"
