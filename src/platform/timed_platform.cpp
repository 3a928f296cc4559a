#include "gpumem/platform/timed_platform.hpp"

#include <chrono>

namespace gpumem {

namespace {
// Times one forwarded call and books it under op.
template <class F>
auto timed(std::atomic<std::uint64_t>& total, F&& call) {
  const auto start = std::chrono::steady_clock::now();
  auto out = call();
  total.fetch_add(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - start).count()),
                  std::memory_order_relaxed);
  return out;
}
}  // namespace

std::uint64_t timed_platform::measured_ns() const noexcept {
  std::uint64_t sum = 0;
  for (const auto& n : ns_) sum += n.load(std::memory_order_relaxed);
  return sum;
}

result<int> timed_platform::device_count() {
  calls_.add(platform_op::device_count);
  return timed(ns_[static_cast<std::size_t>(platform_op::device_count)], [&] { return inner_.device_count(); });
}

result<device_properties> timed_platform::properties(int device) {
  calls_.add(platform_op::device_properties);
  return timed(ns_[static_cast<std::size_t>(platform_op::device_properties)], [&] { return inner_.properties(device); });
}

result<allocation_granularity> timed_platform::granularity(int device) {
  calls_.add(platform_op::granularity);
  return timed(ns_[static_cast<std::size_t>(platform_op::granularity)], [&] { return inner_.granularity(device); });
}

result<memory_info> timed_platform::mem_info(int device) {
  calls_.add(platform_op::mem_info);
  return timed(ns_[static_cast<std::size_t>(platform_op::mem_info)], [&] { return inner_.mem_info(device); });
}

result<std::uintptr_t> timed_platform::reserve_range(std::size_t size, std::size_t alignment) {
  calls_.add(platform_op::reserve_range);
  return timed(ns_[static_cast<std::size_t>(platform_op::reserve_range)], [&] { return inner_.reserve_range(size, alignment); });
}

status timed_platform::free_range(std::uintptr_t base, std::size_t size) {
  calls_.add(platform_op::free_range);
  return timed(ns_[static_cast<std::size_t>(platform_op::free_range)], [&] { return inner_.free_range(base, size); });
}

result<physical_handle> timed_platform::create_physical(int device, std::size_t size) {
  calls_.add(platform_op::create_physical);
  return timed(ns_[static_cast<std::size_t>(platform_op::create_physical)], [&] { return inner_.create_physical(device, size); });
}

status timed_platform::release_physical(physical_handle handle) {
  calls_.add(platform_op::release_physical);
  return timed(ns_[static_cast<std::size_t>(platform_op::release_physical)], [&] { return inner_.release_physical(handle); });
}

status timed_platform::map(std::uintptr_t va, std::size_t size, physical_handle handle, std::size_t offset) {
  calls_.add(platform_op::map);
  return timed(ns_[static_cast<std::size_t>(platform_op::map)], [&] { return inner_.map(va, size, handle, offset); });
}

status timed_platform::unmap(std::uintptr_t va, std::size_t size) {
  calls_.add(platform_op::unmap);
  return timed(ns_[static_cast<std::size_t>(platform_op::unmap)], [&] { return inner_.unmap(va, size); });
}

status timed_platform::set_access(int device, std::uintptr_t va, std::size_t size) {
  calls_.add(platform_op::set_access);
  return timed(ns_[static_cast<std::size_t>(platform_op::set_access)], [&] { return inner_.set_access(device, va, size); });
}

result<void*> timed_platform::runtime_malloc(int device, std::size_t size) {
  calls_.add(platform_op::runtime_malloc);
  return timed(ns_[static_cast<std::size_t>(platform_op::runtime_malloc)], [&] { return inner_.runtime_malloc(device, size); });
}

status timed_platform::runtime_free(int device, void* ptr) {
  calls_.add(platform_op::runtime_free);
  return timed(ns_[static_cast<std::size_t>(platform_op::runtime_free)], [&] { return inner_.runtime_free(device, ptr); });
}

result<void*> timed_platform::driver_alloc(int device, std::size_t size) {
  calls_.add(platform_op::driver_alloc);
  return timed(ns_[static_cast<std::size_t>(platform_op::driver_alloc)], [&] { return inner_.driver_alloc(device, size); });
}

status timed_platform::driver_free(int device, void* ptr) {
  calls_.add(platform_op::driver_free);
  return timed(ns_[static_cast<std::size_t>(platform_op::driver_free)], [&] { return inner_.driver_free(device, ptr); });
}

result<void*> timed_platform::host_alloc_pinned(std::size_t size) {
  calls_.add(platform_op::host_alloc);
  return timed(ns_[static_cast<std::size_t>(platform_op::host_alloc)], [&] { return inner_.host_alloc_pinned(size); });
}

status timed_platform::host_free_pinned(void* ptr) {
  calls_.add(platform_op::host_free);
  return timed(ns_[static_cast<std::size_t>(platform_op::host_free)], [&] { return inner_.host_free_pinned(ptr); });
}

result<stream_handle> timed_platform::stream_create(int device) {
  calls_.add(platform_op::stream_create);
  return timed(ns_[static_cast<std::size_t>(platform_op::stream_create)], [&] { return inner_.stream_create(device); });
}

status timed_platform::stream_destroy(stream_handle stream) {
  calls_.add(platform_op::stream_destroy);
  return timed(ns_[static_cast<std::size_t>(platform_op::stream_destroy)], [&] { return inner_.stream_destroy(stream); });
}

result<int> timed_platform::stream_device(stream_handle stream) {
  calls_.add(platform_op::stream_device);
  return inner_.stream_device(stream);
}

status timed_platform::stream_synchronize(stream_handle stream) {
  calls_.add(platform_op::stream_synchronize);
  return timed(ns_[static_cast<std::size_t>(platform_op::stream_synchronize)], [&] { return inner_.stream_synchronize(stream); });
}

result<event_handle> timed_platform::event_create(int device) {
  calls_.add(platform_op::event_create);
  return timed(ns_[static_cast<std::size_t>(platform_op::event_create)], [&] { return inner_.event_create(device); });
}

status timed_platform::event_destroy(event_handle event) {
  calls_.add(platform_op::event_destroy);
  return timed(ns_[static_cast<std::size_t>(platform_op::event_destroy)], [&] { return inner_.event_destroy(event); });
}

status timed_platform::event_record(event_handle event, stream_handle stream) {
  calls_.add(platform_op::event_record);
  return timed(ns_[static_cast<std::size_t>(platform_op::event_record)], [&] { return inner_.event_record(event, stream); });
}

result<bool> timed_platform::event_query(event_handle event) {
  calls_.add(platform_op::event_query);
  return timed(ns_[static_cast<std::size_t>(platform_op::event_query)], [&] { return inner_.event_query(event); });
}

status timed_platform::event_synchronize(event_handle event) {
  calls_.add(platform_op::event_synchronize);
  return timed(ns_[static_cast<std::size_t>(platform_op::event_synchronize)], [&] { return inner_.event_synchronize(event); });
}

status timed_platform::stream_wait_event(stream_handle stream, event_handle event) {
  calls_.add(platform_op::stream_wait_event);
  return timed(ns_[static_cast<std::size_t>(platform_op::stream_wait_event)], [&] { return inner_.stream_wait_event(stream, event); });
}

status timed_platform::memcpy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) {
  calls_.add(platform_op::memcpy_async);
  return timed(ns_[static_cast<std::size_t>(platform_op::memcpy_async)], [&] { return inner_.memcpy_async(dst, src, bytes, stream); });
}

status timed_platform::memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) {
  calls_.add(platform_op::memset_async);
  return timed(ns_[static_cast<std::size_t>(platform_op::memset_async)], [&] { return inner_.memset_async(dst, value, bytes, stream); });
}

result<void*> timed_platform::async_malloc(int device, std::size_t size, stream_handle stream) {
  calls_.add(platform_op::async_malloc);
  return timed(ns_[static_cast<std::size_t>(platform_op::async_malloc)], [&] { return inner_.async_malloc(device, size, stream); });
}

status timed_platform::async_free(void* ptr, stream_handle stream) {
  calls_.add(platform_op::async_free);
  return timed(ns_[static_cast<std::size_t>(platform_op::async_free)], [&] { return inner_.async_free(ptr, stream); });
}

result<physical_handle> timed_platform::create_shareable_physical(int device, std::size_t size) {
  calls_.add(platform_op::create_physical);
  return timed(ns_[static_cast<std::size_t>(platform_op::create_physical)],
               [&] { return inner_.create_shareable_physical(device, size); });
}

result<int> timed_platform::export_handle(physical_handle handle) {
  calls_.add(platform_op::export_handle);
  return timed(ns_[static_cast<std::size_t>(platform_op::export_handle)],
               [&] { return inner_.export_handle(handle); });
}

result<physical_handle> timed_platform::import_handle(int device, int fd, std::size_t size) {
  calls_.add(platform_op::import_handle);
  return timed(ns_[static_cast<std::size_t>(platform_op::import_handle)],
               [&] { return inner_.import_handle(device, fd, size); });
}

status timed_platform::set_access_for(std::span<const int> devices, std::uintptr_t va,
                                      std::size_t size) {
  calls_.add(platform_op::set_access);
  return timed(ns_[static_cast<std::size_t>(platform_op::set_access)],
               [&] { return inner_.set_access_for(devices, va, size); });
}

result<bool> timed_platform::can_access_peer(int device, int peer) {
  calls_.add(platform_op::can_access_peer);
  return timed(ns_[static_cast<std::size_t>(platform_op::can_access_peer)],
               [&] { return inner_.can_access_peer(device, peer); });
}

status timed_platform::enable_peer_access(int device, int peer) {
  calls_.add(platform_op::enable_peer_access);
  return timed(ns_[static_cast<std::size_t>(platform_op::enable_peer_access)],
               [&] { return inner_.enable_peer_access(device, peer); });
}

}  // namespace gpumem
