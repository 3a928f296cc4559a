// The one interface every way of getting device memory implements: the three backends
// (runtime, driver, vmm) and the pools built on them.
//
//   allocate(bytes, alignment, stream)   -> pointer, usable in stream order on `stream`
//   deallocate(ptr, bytes, stream)       -> the memory may be reused after `stream`'s work
//
// Contract (checked by tests/contract for every resource):
//  - bytes == 0, bytes beyond the device's total memory, and an alignment that is not a
//    power of two or exceeds max_alignment() throw gpumem::invalid_argument, state intact;
//  - exhausted memory throws gpumem::out_of_memory with a report;
//  - deallocate of a pointer this resource did not hand out (unknown, interior, already
//    freed, or owned by another resource) or with a different size throws
//    gpumem::invalid_argument naming which of these it is, state intact;
//  - a failing driver call throws gpumem::cuda_error naming the call, state intact;
//  - stats().live_bytes == sum of the sizes of live allocations.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "gpumem/platform/platform.hpp"

namespace gpumem {

inline constexpr std::size_t default_alignment = 256;

struct resource_stats {
  std::size_t live_bytes = 0;         // requested bytes of live allocations
  std::size_t peak_live_bytes = 0;
  std::size_t live_allocations = 0;
  std::size_t reserved_bytes = 0;     // device memory held from the driver now
  std::size_t peak_reserved_bytes = 0;
  std::size_t cached_bytes = 0;       // reserved but not handed out (pools)
  std::uint64_t allocations = 0;      // successful allocate calls
  std::uint64_t deallocations = 0;
  std::uint64_t alloc_retries = 0;    // allocations that had to free cached memory first
  std::uint64_t oom_count = 0;        // out_of_memory thrown
  // peak reserved / peak live requested; 0 before the first allocation.
  double fragmentation() const noexcept {
    return peak_live_bytes == 0 ? 0.0
                                : static_cast<double>(peak_reserved_bytes) /
                                      static_cast<double>(peak_live_bytes);
  }
};

class memory_resource {
 public:
  memory_resource(platform& platform, int device);
  virtual ~memory_resource() = default;
  memory_resource(const memory_resource&) = delete;
  memory_resource& operator=(const memory_resource&) = delete;

  void* allocate(std::size_t bytes, std::size_t alignment = default_alignment,
                 stream_handle stream = {});
  void deallocate(void* ptr, std::size_t bytes, stream_handle stream = {});

  int device() const noexcept { return device_; }
  platform& device_platform() const noexcept { return platform_; }
  std::size_t device_total_bytes() const noexcept { return device_total_; }

  // Short telling name: "runtime", "driver", "vmm", "caching_pool", ...
  virtual std::string_view name() const noexcept = 0;
  // The largest alignment allocate() accepts: default_alignment or more (allocate() takes
  // alignments up to default_alignment without asking).
  virtual std::size_t max_alignment() const noexcept = 0;
  virtual resource_stats stats() const = 0;
  // The caller is about to destroy `stream`: forget it, so nothing later records events on
  // it or waits for it. Memory freed on it becomes reusable by every stream once its work
  // has completed (the pool synchronizes the stream). No-op for resources without caches.
  virtual void release_stream(stream_handle stream) { (void)stream; }
  // Structural self-check: "" when valid, else what is wrong.
  virtual std::string validate() const { return {}; }
  bool is_valid() const { return validate().empty(); }

 protected:
  virtual void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) = 0;
  virtual void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) = 0;

  // Throws gpumem::out_of_memory with the report every resource gives: what was asked,
  // what failed, the device's total and free memory, and what this resource holds.
  [[noreturn]] void throw_out_of_memory(std::size_t bytes, const status& cause,
                                        const std::string& holdings) const;
  // Throws gpumem::cuda_error for a failed platform call.
  [[noreturn]] void throw_cuda_error(const status& cause, const char* where) const;

 private:
  // allocate() for an alignment over default_alignment, or a request it refuses.
  [[gnu::noinline]] void* allocate_aligned(std::size_t bytes, std::size_t alignment, stream_handle stream);
  platform& platform_;
  int device_;
  std::size_t device_total_ = 0;
};

// "1.50 GiB", "512 B": for reports.
std::string format_bytes(std::size_t bytes);

}  // namespace gpumem
