#include "gpumem/backend/backends.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>

#include "backend/ownership_registry.hpp"
#include "gpumem/errors.hpp"

namespace gpumem {

namespace detail {

tracked_resource::~tracked_resource() {
  // Derived destructors take what is live first; this only guards the registry.
  for (auto& [ptr, e] : live_) registry_remove(ptr);
}

void tracked_resource::insert_locked(void* ptr, std::size_t bytes, std::size_t reserved) {
  live_.emplace(ptr, entry{bytes, reserved});
  registry_add(ptr, bytes, this);
  stats_.live_bytes += bytes;
  stats_.live_allocations += 1;
  stats_.reserved_bytes += reserved;
}

void tracked_resource::track(void* ptr, std::size_t bytes, std::size_t reserved) {
  std::lock_guard lock(mutex_);
  insert_locked(ptr, bytes, reserved);
  stats_.allocations += 1;
  if (stats_.live_bytes > stats_.peak_live_bytes) stats_.peak_live_bytes = stats_.live_bytes;
  if (stats_.reserved_bytes > stats_.peak_reserved_bytes)
    stats_.peak_reserved_bytes = stats_.reserved_bytes;
}

void tracked_resource::retrack(void* ptr, std::size_t bytes, std::size_t reserved) {
  std::lock_guard lock(mutex_);
  insert_locked(ptr, bytes, reserved);
  stats_.deallocations -= 1;  // the failed free does not count
}

std::size_t tracked_resource::untrack(void* ptr, std::size_t bytes) {
  std::lock_guard lock(mutex_);
  auto it = live_.find(ptr);
  if (it == live_.end()) throw invalid_argument("deallocate: " + registry_diagnose(ptr, this));
  if (it->second.bytes != bytes)
    throw invalid_argument("deallocate: size mismatch for pointer of the '" +
                           std::string(name()) + "' resource: allocated " +
                           std::to_string(it->second.bytes) + " bytes, freed as " +
                           std::to_string(bytes));
  const std::size_t reserved = it->second.reserved;
  registry_remove(ptr);
  live_.erase(it);
  stats_.live_bytes -= bytes;
  stats_.live_allocations -= 1;
  stats_.reserved_bytes -= reserved;
  stats_.deallocations += 1;
  return reserved;
}

std::vector<void*> tracked_resource::take_all() {
  std::vector<void*> all;
  for (auto& [ptr, reserved] : take_all_reserved()) all.push_back(ptr);
  return all;
}

std::vector<std::pair<void*, std::size_t>> tracked_resource::take_all_reserved() {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<void*, std::size_t>> all;
  for (auto& [ptr, e] : live_) {
    registry_remove(ptr);
    all.emplace_back(ptr, e.reserved);
  }
  live_.clear();
  stats_.live_bytes = stats_.live_allocations = stats_.reserved_bytes = 0;
  return all;
}

resource_stats tracked_resource::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

std::string tracked_resource::validate() const {
  std::lock_guard lock(mutex_);
  std::size_t bytes = 0, reserved = 0;
  for (auto& [p, e] : live_) {
    bytes += e.bytes;
    reserved += e.reserved;
  }
  if (bytes != stats_.live_bytes) return "live_bytes does not match the live allocations";
  if (reserved != stats_.reserved_bytes) return "reserved_bytes does not match";
  if (live_.size() != stats_.live_allocations) return "live_allocations does not match";
  return {};
}

std::string tracked_resource::holdings() const {
  std::lock_guard lock(mutex_);
  return format_bytes(stats_.live_bytes) + " in " + std::to_string(stats_.live_allocations) +
         " live allocations (" + format_bytes(stats_.reserved_bytes) + " reserved)";
}

}  // namespace detail

// --- runtime ------------------------------------------------------------------------------

runtime_resource::runtime_resource(platform& platform, int device)
    : tracked_resource(platform, device) {}

// Destructors free what the user leaked and never throw (the driver may be shut down).
runtime_resource::~runtime_resource() {
  for (void* ptr : take_all()) (void)device_platform().runtime_free(device(), ptr);
}

void* runtime_resource::do_allocate(std::size_t bytes, std::size_t, stream_handle) {
  auto p = device_platform().runtime_malloc(device(), bytes);
  if (!p) {
    if (p.error().kind == failure_kind::out_of_memory)
      throw_out_of_memory(bytes, p.error(), holdings());
    throw_cuda_error(p.error(), "runtime_resource::allocate");
  }
  track(p.value(), bytes, bytes);
  return p.value();
}

void runtime_resource::do_deallocate(void* ptr, std::size_t bytes, stream_handle) {
  const std::size_t reserved = untrack(ptr, bytes);
  if (auto s = device_platform().runtime_free(device(), ptr); !s) {
    retrack(ptr, bytes, reserved);
    throw_cuda_error(s, "runtime_resource::deallocate");
  }
}

// --- driver -------------------------------------------------------------------------------

driver_resource::driver_resource(platform& platform, int device)
    : tracked_resource(platform, device) {}

driver_resource::~driver_resource() {
  for (void* ptr : take_all()) (void)device_platform().driver_free(device(), ptr);
}

void* driver_resource::do_allocate(std::size_t bytes, std::size_t, stream_handle) {
  auto p = device_platform().driver_alloc(device(), bytes);
  if (!p) {
    if (p.error().kind == failure_kind::out_of_memory)
      throw_out_of_memory(bytes, p.error(), holdings());
    throw_cuda_error(p.error(), "driver_resource::allocate");
  }
  track(p.value(), bytes, bytes);
  return p.value();
}

void driver_resource::do_deallocate(void* ptr, std::size_t bytes, stream_handle) {
  const std::size_t reserved = untrack(ptr, bytes);
  if (auto s = device_platform().driver_free(device(), ptr); !s) {
    retrack(ptr, bytes, reserved);
    throw_cuda_error(s, "driver_resource::deallocate");
  }
}

// --- vmm ----------------------------------------------------------------------------------

vmm_resource::vmm_resource(platform& platform, int device) : tracked_resource(platform, device) {
  auto props = platform.properties(device);
  if (!props) throw_cuda_error(props.error(), "vmm_resource: device properties");
  if (!props.value().vmm_supported)
    throw cuda_error("cuDeviceGetAttribute", 801, "CUDA_ERROR_NOT_SUPPORTED",
                     "device " + std::to_string(device) + " does not support virtual memory management",
                     "vmm_resource::vmm_resource");
  auto g = platform.granularity(device);
  if (!g) throw_cuda_error(g.error(), "vmm_resource: granularity");
  granularity_ = g.value().recommended != 0 ? g.value().recommended : g.value().minimum;
}

vmm_resource::~vmm_resource() {
  (void)take_all();
  std::lock_guard lock(mutex_);
  mappings_.clear();  // each vmm_mapping unmaps, releases and frees its range
  stranded_.clear();  // one more attempt each
}

void* vmm_resource::do_allocate(std::size_t bytes, std::size_t alignment, stream_handle) {
  const std::size_t size = (bytes + granularity_ - 1) / granularity_ * granularity_;
  const std::size_t align = alignment > granularity_ ? alignment : granularity_;
  {
    std::lock_guard lock(mutex_);
    std::erase_if(stranded_, [](vmm_mapping& left) { return static_cast<bool>(left.release()); });
  }
  vmm_mapping leftover;
  auto m = vmm_mapping::create(device_platform(), device(), size, align, &leftover);
  if (!leftover.empty()) {
    std::lock_guard lock(mutex_);
    stranded_.push_back(std::move(leftover));
  }
  if (!m) {
    if (m.error().kind == failure_kind::out_of_memory)
      throw_out_of_memory(bytes, m.error(), holdings());
    throw_cuda_error(m.error(), "vmm_resource::allocate");
  }
  void* ptr = m.value().pointer();
  {
    std::lock_guard lock(mutex_);
    mappings_.emplace(ptr, std::move(m.value()));
  }
  track(ptr, bytes, size);
  return ptr;
}

void vmm_resource::do_deallocate(void* ptr, std::size_t bytes, stream_handle) {
  const std::size_t reserved = untrack(ptr, bytes);
  status released;
  {
    std::lock_guard lock(mutex_);
    auto it = mappings_.find(ptr);
    released = it->second.release();
    if (released) mappings_.erase(it);
  }
  if (!released) {
    // Partly undone; the mapping remembers where it stopped, so a retry resumes.
    retrack(ptr, bytes, reserved);
    throw_cuda_error(released, "vmm_resource::deallocate");
  }
}

// --- pinned host ---------------------------------------------------------------------------

pinned_host_resource::pinned_host_resource(platform& platform, int device)
    : tracked_resource(platform, device) {}

pinned_host_resource::~pinned_host_resource() {
  for (void* ptr : take_all()) (void)device_platform().host_free_pinned(ptr);
}

void* pinned_host_resource::do_allocate(std::size_t bytes, std::size_t, stream_handle) {
  auto p = device_platform().host_alloc_pinned(bytes);
  if (!p) {
    if (p.error().kind == failure_kind::out_of_memory)
      throw_out_of_memory(bytes, p.error(), holdings());
    throw_cuda_error(p.error(), "pinned_host_resource::allocate");
  }
  track(p.value(), bytes, bytes);
  return p.value();
}

void pinned_host_resource::do_deallocate(void* ptr, std::size_t bytes, stream_handle) {
  const std::size_t reserved = untrack(ptr, bytes);
  if (auto s = device_platform().host_free_pinned(ptr); !s) {
    retrack(ptr, bytes, reserved);
    throw_cuda_error(s, "pinned_host_resource::deallocate");
  }
}

host_memory_resource::host_memory_resource(platform& platform, int device)
    : tracked_resource(platform, device) {}

namespace {
std::size_t host_mapping_bytes(std::size_t bytes) { return (bytes + 4095) / 4096 * 4096; }
}  // namespace

host_memory_resource::~host_memory_resource() {
  for (auto& [ptr, reserved] : take_all_reserved()) (void)::munmap(ptr, reserved);
}

void* host_memory_resource::do_allocate(std::size_t bytes, std::size_t, stream_handle) {
  const std::size_t len = host_mapping_bytes(bytes);
  void* p = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw_out_of_memory(bytes,
                        status::failure(platform_op::count_, failure_kind::out_of_memory, err,
                                        "mmap", std::strerror(err)),
                        holdings());
  }
  (void)::madvise(p, len, MADV_HUGEPAGE);  // advice only: without THP, 4 KiB pages
  track(p, bytes, len);
  return p;
}

void host_memory_resource::do_deallocate(void* ptr, std::size_t bytes, stream_handle) {
  const std::size_t reserved = untrack(ptr, bytes);
  if (::munmap(ptr, reserved) != 0) {
    const int err = errno;
    retrack(ptr, bytes, reserved);
    throw invalid_argument(std::string("host_memory_resource::deallocate: munmap failed: ") +
                           std::strerror(err));
  }
}

}  // namespace gpumem
