// The three ways to get device memory, each a memory_resource that calls the driver on
// every allocate and deallocate (no caching: that is pool/'s job).
//
//   runtime_resource   cudaMalloc / cudaFree
//   driver_resource    cuMemAlloc / cuMemFree with the device's primary context pushed
//   vmm_resource       cuMemCreate + cuMemAddressReserve + cuMemMap + cuMemSetAccess,
//                      sizes rounded up to the queried granularity; freeing unmaps,
//                      releases the handle and frees the range, in that order
//
// Invariants:
//  - each live allocation is in the process-wide ownership registry under exactly one
//    resource, so memory handed to the wrong resource is recognised and refused, never
//    passed to the wrong CUDA free;
//  - vmm: reserved_bytes == sum of granularity-rounded sizes of live allocations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/backend/vmm_mapping.hpp"

namespace gpumem {

namespace detail {
// Shared bookkeeping of the backends: live allocations, registry, stats.
class tracked_resource : public memory_resource {
 public:
  tracked_resource(platform& platform, int device) : memory_resource(platform, device) {}
  ~tracked_resource() override;
  resource_stats stats() const override;
  std::string validate() const override;

 protected:
  // Records a new allocation (`reserved` bytes held from the driver for it).
  void track(void* ptr, std::size_t bytes, std::size_t reserved);
  // Checks that ptr/bytes is a live allocation of this resource and removes it; throws
  // gpumem::invalid_argument otherwise. Returns the reserved bytes it held.
  std::size_t untrack(void* ptr, std::size_t bytes);
  // Puts an untracked allocation back (its driver free failed), as if never freed.
  void retrack(void* ptr, std::size_t bytes, std::size_t reserved);
  std::string holdings() const;
  // Removes every live allocation (for destructors, which then free them).
  std::vector<void*> take_all();
  // take_all(), with the bytes each held (for backends that free by size).
  std::vector<std::pair<void*, std::size_t>> take_all_reserved();

  mutable std::mutex mutex_;

 private:
  struct entry {
    std::size_t bytes;
    std::size_t reserved;
  };
  // Adds a live allocation to the map, the registry and the live/reserved counts.
  // REQUIRES: mutex_ held.
  void insert_locked(void* ptr, std::size_t bytes, std::size_t reserved);
  std::unordered_map<void*, entry> live_;
  resource_stats stats_{};
};
}  // namespace detail

class runtime_resource final : public detail::tracked_resource {
 public:
  explicit runtime_resource(platform& platform, int device = 0);
  ~runtime_resource() override;
  std::string_view name() const noexcept override { return "runtime"; }
  // cudaMalloc guarantees 256-byte alignment and no more.
  std::size_t max_alignment() const noexcept override { return 256; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;
};

class driver_resource final : public detail::tracked_resource {
 public:
  explicit driver_resource(platform& platform, int device = 0);
  ~driver_resource() override;
  std::string_view name() const noexcept override { return "driver"; }
  std::size_t max_alignment() const noexcept override { return 256; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;
};

class vmm_resource final : public detail::tracked_resource {
 public:
  // Throws gpumem::cuda_error when the device does not support VMM.
  explicit vmm_resource(platform& platform, int device = 0);
  ~vmm_resource() override;
  std::string_view name() const noexcept override { return "vmm"; }
  std::size_t max_alignment() const noexcept override { return std::size_t{1} << 30; }
  std::size_t granularity() const noexcept { return granularity_; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;

 private:
  std::size_t granularity_ = 0;
  std::unordered_map<void*, vmm_mapping> mappings_;  // guarded by mutex_
  // What failed allocations could not undo (a second driver failure): released again at
  // the next allocation and at destruction, so nothing is abandoned. Guarded by mutex_.
  std::vector<vmm_mapping> stranded_;
};

class pinned_host_resource final : public detail::tracked_resource {
 public:
  // `device`: the device whose copies the memory serves (for reports and limits).
  explicit pinned_host_resource(platform& platform, int device = 0);
  ~pinned_host_resource() override;
  std::string_view name() const noexcept override { return "pinned_host"; }
  // cudaMallocHost returns page-aligned memory.
  std::size_t max_alignment() const noexcept override { return 4096; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;
};

// Pageable host memory: page-aligned anonymous mappings, advised to use transparent huge
// pages (one fault per 2 MiB where the kernel allows). For memory the CPU copies into and
// out of, never the device's DMA: pinning costs time (cudaMallocHost and cudaFreeHost of
// 2 MiB took 0.74-2.3 ms on an H200 host, kv_bench and a probe) and locks RAM the OS can
// no longer page.
// The platform is asked for nothing but the device's total (the contract's size bound).
class host_memory_resource final : public detail::tracked_resource {
 public:
  explicit host_memory_resource(platform& platform, int device = 0);
  ~host_memory_resource() override;
  std::string_view name() const noexcept override { return "host"; }
  std::size_t max_alignment() const noexcept override { return 4096; }

 protected:
  void* do_allocate(std::size_t bytes, std::size_t alignment, stream_handle stream) override;
  void do_deallocate(void* ptr, std::size_t bytes, stream_handle stream) override;
};

}  // namespace gpumem
