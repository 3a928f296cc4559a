// timed_platform: a decorator that forwards every call to another platform and measures
// the host time each operation takes (steady clock around the call), so a run on the GPU
// can say where its driver time went — the measured counterpart of sim's modelled latency.
//
// Invariants: calls_made(op) == the inner platform's count of op made through this
// decorator; measured_ns(op) is the sum of those calls' durations.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "gpumem/platform/platform.hpp"

namespace gpumem {

class timed_platform final : public platform {
 public:
  // REQUIRES: inner outlives this object.
  explicit timed_platform(platform& inner) : inner_(inner) {}
  platform& inner() const noexcept { return inner_; }
  std::uint64_t measured_ns(platform_op op) const noexcept {
    return ns_[static_cast<std::size_t>(op)].load(std::memory_order_relaxed);
  }
  std::uint64_t measured_ns() const noexcept;

  std::string_view kind() const noexcept override { return inner_.kind(); }
  result<int> device_count() override;
  result<device_properties> properties(int device) override;
  result<allocation_granularity> granularity(int device) override;
  result<memory_info> mem_info(int device) override;
  result<std::uintptr_t> reserve_range(std::size_t size, std::size_t alignment) override;
  status free_range(std::uintptr_t base, std::size_t size) override;
  result<physical_handle> create_physical(int device, std::size_t size) override;
  status release_physical(physical_handle handle) override;
  status map(std::uintptr_t va, std::size_t size, physical_handle handle, std::size_t offset) override;
  status unmap(std::uintptr_t va, std::size_t size) override;
  status set_access(int device, std::uintptr_t va, std::size_t size) override;
  status set_access_for(std::span<const int> devices, std::uintptr_t va,
                        std::size_t size) override;
  result<void*> runtime_malloc(int device, std::size_t size) override;
  status runtime_free(int device, void* ptr) override;
  result<void*> driver_alloc(int device, std::size_t size) override;
  status driver_free(int device, void* ptr) override;
  result<void*> host_alloc_pinned(std::size_t size) override;
  status host_free_pinned(void* ptr) override;
  result<stream_handle> stream_create(int device) override;
  status stream_destroy(stream_handle stream) override;
  status stream_synchronize(stream_handle stream) override;
  result<int> stream_device(stream_handle stream) override;
  result<event_handle> event_create(int device) override;
  status event_destroy(event_handle event) override;
  status event_record(event_handle event, stream_handle stream) override;
  result<bool> event_query(event_handle event) override;
  status event_synchronize(event_handle event) override;
  status stream_wait_event(stream_handle stream, event_handle event) override;
  status memcpy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override;
  status memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) override;
  result<void*> async_malloc(int device, std::size_t size, stream_handle stream) override;
  status async_free(void* ptr, stream_handle stream) override;
  result<physical_handle> create_shareable_physical(int device, std::size_t size) override;
  result<int> export_handle(physical_handle handle) override;
  result<physical_handle> import_handle(int device, int fd, std::size_t size) override;
  result<bool> can_access_peer(int device, int peer) override;
  status enable_peer_access(int device, int peer) override;

 private:
  platform& inner_;
  std::array<std::atomic<std::uint64_t>, platform_op_count> ns_{};
};

}  // namespace gpumem
