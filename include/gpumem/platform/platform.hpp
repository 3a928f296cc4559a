// The platform seam: the only interface through which gpumem touches a GPU.
//
// Two implementations: cuda_platform (the real driver and runtime, loaded at run time)
// and sim_platform (a host-memory device with the same semantics). Every layer above
// uses this interface alone, so every layer runs and is tested on sim.
//
// Invariants every implementation keeps:
//  - no call throws; each reports failure as a value (status / result<T>) carrying the
//    failed call, the CUDA error name and its message;
//  - calls_made(op) counts every call of op, failed ones included;
//  - a failed call changes nothing (no handle, range or mapping is left behind);
//  - one physical handle may be mapped at several addresses at once (sim: the same bytes).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace gpumem {

// Every operation of the seam, for call counters, fault injection and latency models.
enum class platform_op : std::uint8_t {
  device_count,
  device_properties,
  granularity,
  mem_info,
  reserve_range,
  free_range,
  create_physical,
  release_physical,
  map,
  unmap,
  set_access,
  runtime_malloc,
  runtime_free,
  driver_alloc,
  driver_free,
  host_alloc,
  host_free,
  stream_create,
  stream_destroy,
  stream_synchronize,
  stream_device,
  event_create,
  event_destroy,
  event_record,
  event_query,
  event_synchronize,
  stream_wait_event,
  memcpy_async,
  memset_async,
  async_malloc,
  async_free,
  export_handle,
  import_handle,
  can_access_peer,
  enable_peer_access,
  count_
};
inline constexpr std::size_t platform_op_count = static_cast<std::size_t>(platform_op::count_);

// The CUDA call an operation stands for ("cuMemCreate", "cudaMalloc", ...).
std::string_view platform_op_name(platform_op op) noexcept;

// What kind of failure, so layers above need no CUDA error codes.
enum class failure_kind : std::uint8_t {
  none,
  out_of_memory,    // device or host memory exhausted
  invalid_value,    // bad argument (size, alignment, handle, pointer)
  not_ready,        // event or stream work still pending
  not_supported,    // the device lacks the feature (e.g. VMM)
  no_device,        // no driver or no such device
  driver_error,     // anything else the driver reported
};

struct status {
  failure_kind kind = failure_kind::none;
  platform_op call = platform_op::count_;
  int code = 0;          // CUDA error code (CUresult / cudaError_t numbering), 0 on success
  std::string name;      // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
  std::string message;   // the driver's text, or sim's

  bool ok() const noexcept { return kind == failure_kind::none; }
  explicit operator bool() const noexcept { return ok(); }
  // "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY (out of memory)"
  std::string describe() const;

  static status success() { return {}; }
  static status failure(platform_op call, failure_kind kind, int code, std::string name,
                        std::string message) {
    return status{kind, call, code, std::move(name), std::move(message)};
  }
};

// A value or the status that explains its absence.
template <class T>
class result {
 public:
  result(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  result(status failed) : status_(std::move(failed)) {}  // NOLINT
  bool ok() const noexcept { return status_.ok(); }
  explicit operator bool() const noexcept { return ok(); }
  T& value() { return value_; }
  const T& value() const { return value_; }
  T& operator*() { return value_; }
  const status& error() const noexcept { return status_; }

 private:
  T value_{};
  status status_{};
};

// Opaque handles; 0 means "none" (for streams: the default stream).
struct physical_handle {
  std::uint64_t value = 0;
  friend bool operator==(physical_handle, physical_handle) = default;
};
struct stream_handle {
  std::uintptr_t value = 0;
  friend bool operator==(stream_handle, stream_handle) = default;
};
struct event_handle {
  std::uintptr_t value = 0;
  friend bool operator==(event_handle, event_handle) = default;
};

struct device_properties {
  int ordinal = 0;
  std::string name;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  int multiprocessor_count = 0;
  std::size_t total_memory = 0;
  int memory_bus_width_bits = 0;
  int memory_clock_khz = 0;   // 0 when the device does not report it
  std::size_t l2_cache_bytes = 0;
  std::size_t shared_memory_per_multiprocessor = 0;
  std::size_t shared_memory_per_block = 0;
  int registers_per_multiprocessor = 0;
  bool vmm_supported = false;
  bool memory_pools_supported = false;
  bool simulated = false;

  // Double data rate: 2 transfers per clock across the bus width.
  double theoretical_bandwidth_bytes_per_s() const noexcept {
    return 2.0 * static_cast<double>(memory_clock_khz) * 1e3 *
           static_cast<double>(memory_bus_width_bits) / 8.0;
  }
};

struct allocation_granularity {
  std::size_t minimum = 0;
  std::size_t recommended = 0;
};

struct memory_info {
  std::size_t free = 0;
  std::size_t total = 0;
};

// Counts of calls per operation; lock-free, readable at any time.
class call_counters {
 public:
  void add(platform_op op) noexcept {
    counts_[static_cast<std::size_t>(op)].fetch_add(1, std::memory_order_relaxed);
  }
  std::uint64_t count(platform_op op) const noexcept {
    return counts_[static_cast<std::size_t>(op)].load(std::memory_order_relaxed);
  }
  void reset() noexcept {
    for (auto& c : counts_) c.store(0, std::memory_order_relaxed);
  }

 private:
  std::array<std::atomic<std::uint64_t>, platform_op_count> counts_{};
};

class platform {
 public:
  virtual ~platform() = default;
  platform() = default;
  platform(const platform&) = delete;
  platform& operator=(const platform&) = delete;

  // "cuda" or "sim".
  virtual std::string_view kind() const noexcept = 0;

  // --- devices -------------------------------------------------------------------------
  virtual result<int> device_count() = 0;
  virtual result<device_properties> properties(int device) = 0;
  // For pinned device memory on `device` (the only kind gpumem maps).
  virtual result<allocation_granularity> granularity(int device) = 0;
  virtual result<memory_info> mem_info(int device) = 0;

  // --- virtual memory management ---------------------------------------------------------
  // REQUIRES: size and alignment are multiples of the granularity (alignment 0 = granularity).
  virtual result<std::uintptr_t> reserve_range(std::size_t size, std::size_t alignment) = 0;
  // REQUIRES: [base, base+size) is exactly one reserved range with nothing mapped in it.
  virtual status free_range(std::uintptr_t base, std::size_t size) = 0;
  virtual result<physical_handle> create_physical(int device, std::size_t size) = 0;
  // Memory is freed once the handle is released AND no mapping of it remains.
  virtual status release_physical(physical_handle handle) = 0;
  // Maps [offset, offset+size) of handle at va; access is not granted until set_access.
  // The CUDA 13 driver accepts offset 0 only (sim refuses others the same way).
  virtual status map(std::uintptr_t va, std::size_t size, physical_handle handle,
                     std::size_t offset) = 0;
  // REQUIRES: [va, va+size) covers whole mappings.
  virtual status unmap(std::uintptr_t va, std::size_t size) = 0;
  // Grants read/write access from `device` over a mapped range, in one call. A device other
  // than the one the memory lives on is a peer: it must be able to reach that device
  // (can_access_peer), else invalid_value and nothing changes.
  virtual status set_access(int device, std::uintptr_t va, std::size_t size) = 0;
  // As set_access, for every device of `devices` at once (cuMemSetAccess with one access
  // descriptor per device: one call, counted as one set_access). All or nothing: a device
  // that cannot reach the memory fails the call and no access is granted (the default,
  // one set_access per device in order, keeps the grants made before a failure).
  // REQUIRES: devices is not empty and names each device once.
  virtual status set_access_for(std::span<const int> devices, std::uintptr_t va,
                                std::size_t size);

  // --- classic allocation --------------------------------------------------------------
  virtual result<void*> runtime_malloc(int device, std::size_t size) = 0;   // cudaMalloc
  virtual status runtime_free(int device, void* ptr) = 0;                  // cudaFree
  // cuMemAlloc / cuMemFree with the device's primary context pushed, then popped, so the
  // caller's current context is left as it was.
  virtual result<void*> driver_alloc(int device, std::size_t size) = 0;
  virtual status driver_free(int device, void* ptr) = 0;
  virtual result<void*> host_alloc_pinned(std::size_t size) = 0;            // cudaMallocHost
  virtual status host_free_pinned(void* ptr) = 0;

  // --- streams and events --------------------------------------------------------------
  virtual result<stream_handle> stream_create(int device) = 0;
  virtual status stream_destroy(stream_handle stream) = 0;
  virtual status stream_synchronize(stream_handle stream) = 0;
  // The device `stream` belongs to (the default stream: the current device, 0 on sim); an
  // invalid_value failure when the platform does not know the stream. Legal while a CUDA
  // graph is being captured on it (it enqueues nothing).
  virtual result<int> stream_device(stream_handle stream) = 0;
  virtual result<event_handle> event_create(int device) = 0;
  virtual status event_destroy(event_handle event) = 0;
  virtual status event_record(event_handle event, stream_handle stream) = 0;
  // true when all work captured by the last record has completed.
  virtual result<bool> event_query(event_handle event) = 0;
  virtual status event_synchronize(event_handle event) = 0;
  virtual status stream_wait_event(stream_handle stream, event_handle event) = 0;
  virtual status memcpy_async(void* dst, const void* src, std::size_t bytes,
                              stream_handle stream) = 0;
  virtual status memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) = 0;
  // cudaMallocAsync / cudaFreeAsync on the device's default memory pool: the peer gpumem
  // is measured against.
  virtual result<void*> async_malloc(int device, std::size_t size, stream_handle stream) = 0;
  virtual status async_free(void* ptr, stream_handle stream) = 0;

  // --- several devices ------------------------------------------------------------------
  // Whether `device` can reach memory that lives on `peer` (cuDeviceCanAccessPeer); true for
  // device == peer. The default (a platform that knows no peers) answers device == peer.
  virtual result<bool> can_access_peer(int device, int peer);
  // Lets `device` reach `peer`'s classic allocations (cudaMalloc, cuMemAlloc):
  // cudaDeviceEnablePeerAccess with `device` current. Enabling a pair twice succeeds.
  // not_supported when the pair has no peer path; invalid_value for device == peer or a
  // device that does not exist. VMM memory needs no such call, only set_access for the
  // peer. The default answers not_supported.
  virtual status enable_peer_access(int device, int peer);

  // --- sharing physical memory between processes -----------------------------------------
  // The physical memory behind a handle lives while any process holds a handle to it or
  // maps it: a process that exits (or is killed) drops its share, and nothing of another
  // process's is lost or leaked. Platforms without sharing answer not_supported (the
  // defaults below).
  // A physical handle that export_handle accepts: cuMemCreate with the POSIX file
  // descriptor handle type requested (counted as create_physical). Sim: its frames are a
  // memfd of their own.
  virtual result<physical_handle> create_shareable_physical(int device, std::size_t size);
  // A new close-on-exec file descriptor for `handle` (cuMemExportToShareableHandle), the
  // caller's to close or to pass to another process (SCM_RIGHTS over a Unix socket).
  // invalid_value for a handle not made by create_shareable_physical.
  virtual result<int> export_handle(physical_handle handle);
  // A handle, for use by `device`, of memory exported as `fd`
  // (cuMemImportFromShareableHandle); the fd stays the caller's. The memory stays where it
  // lives: on `device`, or on a peer that `device` can reach (the caller then maps it and
  // grants `device` access as to any peer's memory). `size` (a multiple of the granularity)
  // is what the caller will map: invalid_value when the exported memory is smaller (sim,
  // and cuda where the driver says), when `fd` is closed or not an exported handle, or when
  // the memory is on a device that `device` cannot reach. Released with release_physical,
  // mapped with map like any handle.
  virtual result<physical_handle> import_handle(int device, int fd, std::size_t size);

  // --- accounting ----------------------------------------------------------------------
  const call_counters& calls() const noexcept { return calls_; }
  std::uint64_t calls_made(platform_op op) const noexcept { return calls_.count(op); }

 protected:
  call_counters calls_;
};

// The process-wide default platform: the real GPU when a driver and device are present,
// otherwise a sim device (GPUMEM_SIM_DEVICES=N devices, default 1). `why` (if given)
// receives why cuda was not chosen.
// Never destroyed, so memory resources may outlive main().
platform& default_platform();
// Chooses explicitly: "cuda", "sim" or "auto". Throws gpumem::cuda_error when "cuda" is
// asked for and unavailable.
platform& platform_by_name(std::string_view name);
// Why the cuda platform is unavailable ("" when it is available).
std::string cuda_unavailable_reason();

}  // namespace gpumem
