// The sim platform as several GPUs of one host: separate memory, granularity and capacity per
// device, peer paths (and pairs without one), access that must be granted before a device
// touches another's pages, and memory shared between processes across devices.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

namespace {

using namespace gpumem;

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

template <class T>
status as_status(const result<T>& r) {
  return r.ok() ? status::success() : r.error();
}

sim_options two_devices() {
  sim_options o;
  o.capacity = 64 * MiB;
  o.device_count = 2;
  return o;
}

// A VMM page of `device` mapped in a range of its own, with access for `access` devices.
struct mapped_page {
  sim_platform& sim;
  std::size_t size;
  std::uintptr_t va = 0;
  physical_handle handle{};
  mapped_page(sim_platform& s, int device, std::size_t bytes) : sim(s), size(bytes) {
    va = sim.reserve_range(size, 0).value();
    handle = sim.create_physical(device, size).value();
    EXPECT_TRUE(sim.map(va, size, handle, 0).ok());
  }
  ~mapped_page() {
    (void)sim.unmap(va, size);
    (void)sim.release_physical(handle);
    (void)sim.free_range(va, size);
  }
  void* ptr() const { return reinterpret_cast<void*>(va); }
};

TEST(multi_device_sim, device_count_comes_from_GPUMEM_SIM_DEVICES) {
  const char* saved = std::getenv("GPUMEM_SIM_DEVICES");
  const std::string old = saved != nullptr ? saved : "";
  ::setenv("GPUMEM_SIM_DEVICES", "4", 1);
  EXPECT_EQ(sim_options_from_environment().device_count, 4);
  for (const char* bad : {"0", "65", "two", "2x"}) {
    ::setenv("GPUMEM_SIM_DEVICES", bad, 1);
    try {
      (void)sim_options_from_environment();
      ADD_FAILURE() << "GPUMEM_SIM_DEVICES=" << bad << " was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("GPUMEM_SIM_DEVICES"), std::string::npos) << e.what();
    }
  }
  ::unsetenv("GPUMEM_SIM_DEVICES");
  EXPECT_EQ(sim_options_from_environment().device_count, 1);
  if (saved != nullptr) ::setenv("GPUMEM_SIM_DEVICES", old.c_str(), 1);
}

TEST(multi_device_sim, each_device_has_its_own_capacity_granularity_and_memory) {
  sim_options o = two_devices();
  o.capacities = {32 * MiB, 16 * MiB};
  o.granularities = {2 * MiB, 64 * KiB};
  sim_platform sim(o);
  EXPECT_EQ(sim.device_count().value(), 2);
  EXPECT_EQ(sim.properties(0).value().total_memory, 32 * MiB);
  EXPECT_EQ(sim.properties(1).value().total_memory, 16 * MiB);
  EXPECT_EQ(sim.granularity(0).value().minimum, 2 * MiB);
  EXPECT_EQ(sim.granularity(1).value().recommended, 64 * KiB);
  // Device 1's granularity is its own: 64 KiB handles there, not on device 0.
  auto small = sim.create_physical(1, 64 * KiB);
  ASSERT_TRUE(small.ok()) << small.error().describe();
  EXPECT_EQ(sim.create_physical(0, 64 * KiB).error().kind, failure_kind::invalid_value);
  // Filling device 0 leaves device 1's memory as it was.
  auto all0 = sim.create_physical(0, 32 * MiB);
  ASSERT_TRUE(all0.ok());
  EXPECT_EQ(sim.create_physical(0, 2 * MiB).error().kind, failure_kind::out_of_memory);
  EXPECT_EQ(sim.mem_info(0).value().free, 0u);
  EXPECT_EQ(sim.mem_info(1).value().free, 16 * MiB - 64 * KiB);
  // A 64 KiB page of device 1 maps in a range reserved in the finer granularity.
  auto va = sim.reserve_range(64 * KiB, 0);
  ASSERT_TRUE(va.ok()) << va.error().describe();
  ASSERT_TRUE(sim.map(va.value(), 64 * KiB, small.value(), 0).ok());
  ASSERT_TRUE(sim.set_access(1, va.value(), 64 * KiB).ok());
  std::memset(reinterpret_cast<void*>(va.value()), 0x5a, 64 * KiB);
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
  ASSERT_TRUE(sim.unmap(va.value(), 64 * KiB).ok());
  ASSERT_TRUE(sim.free_range(va.value(), 64 * KiB).ok());
  ASSERT_TRUE(sim.release_physical(small.value()).ok());
  ASSERT_TRUE(sim.release_physical(all0.value()).ok());
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(multi_device_sim, peer_paths_follow_no_peer_and_enable_peer_access_checks_them) {
  sim_options o = two_devices();
  o.device_count = 3;
  o.no_peer = {{0, 2}};
  sim_platform sim(o);
  EXPECT_TRUE(sim.can_access_peer(0, 1).value());
  EXPECT_TRUE(sim.can_access_peer(1, 0).value());
  EXPECT_TRUE(sim.can_access_peer(1, 1).value());
  EXPECT_FALSE(sim.can_access_peer(0, 2).value());
  EXPECT_FALSE(sim.can_access_peer(2, 0).value());  // a pair has no path either way
  EXPECT_EQ(sim.can_access_peer(0, 3).error().kind, failure_kind::invalid_value);
  EXPECT_TRUE(sim.enable_peer_access(1, 0).ok());
  EXPECT_TRUE(sim.enable_peer_access(1, 0).ok());  // twice: as CUDA, already enabled is fine
  const status no_path = sim.enable_peer_access(2, 0);
  EXPECT_EQ(no_path.kind, failure_kind::not_supported) << no_path.describe();
  EXPECT_NE(no_path.message.find("no peer path"), std::string::npos) << no_path.describe();
  EXPECT_EQ(sim.enable_peer_access(1, 1).kind, failure_kind::invalid_value);
  EXPECT_EQ(sim.calls_made(platform_op::can_access_peer), 6u);
  EXPECT_EQ(sim.calls_made(platform_op::enable_peer_access), 4u);
}

TEST(multi_device_sim, a_peer_reads_pages_only_once_access_is_granted) {
  sim_platform sim(two_devices());
  auto peer_stream = sim.stream_create(1).value();
  auto own_stream = sim.stream_create(0).value();
  {
    mapped_page page(sim, 0, 2 * MiB);
    ASSERT_TRUE(sim.set_access(0, page.va, page.size).ok());
    std::memset(page.ptr(), 0x42, page.size);
    std::vector<unsigned char> out(4096, 0);
    // Device 0 copies its own pages; device 1 may not, nor touch them.
    EXPECT_TRUE(sim.memcpy_async(out.data(), page.ptr(), out.size(), own_stream).ok());
    EXPECT_EQ(out[100], 0x42);
    out.assign(out.size(), 0);
    const status refused = sim.memcpy_async(out.data(), page.ptr(), out.size(), peer_stream);
    EXPECT_EQ(refused.kind, failure_kind::invalid_value);
    EXPECT_NE(refused.message.find("device 1 has no access"), std::string::npos)
        << refused.describe();
    EXPECT_EQ(out[100], 0) << "a refused copy wrote bytes";
    EXPECT_EQ(sim.check_access(1, page.ptr(), 64).kind, failure_kind::invalid_value);
    EXPECT_EQ(sim.memset_async(page.ptr(), 0, 64, peer_stream).kind, failure_kind::invalid_value);
    // Granted: the peer copies the same bytes.
    ASSERT_TRUE(sim.set_access(1, page.va, page.size).ok());
    EXPECT_TRUE(sim.check_access(1, page.ptr(), page.size).ok());
    EXPECT_TRUE(sim.memcpy_async(out.data(), page.ptr(), out.size(), peer_stream).ok());
    EXPECT_EQ(out[100], 0x42);
    EXPECT_TRUE(sim.check_access(0, page.ptr(), page.size).ok());  // still the owner's
    EXPECT_TRUE(sim.is_valid()) << sim.validate();
  }
  {
    // Unmapped and mapped again: access starts over, as CUDA's does.
    mapped_page page(sim, 0, 2 * MiB);
    EXPECT_EQ(sim.check_access(0, page.ptr(), 64).kind, failure_kind::invalid_value);
    const int both[] = {0, 1};
    const auto calls = sim.calls_made(platform_op::set_access);
    ASSERT_TRUE(sim.set_access_for(both, page.va, page.size).ok());
    EXPECT_EQ(sim.calls_made(platform_op::set_access), calls + 1) << "one call for both devices";
    EXPECT_TRUE(sim.check_access(0, page.ptr(), 64).ok());
    EXPECT_TRUE(sim.check_access(1, page.ptr(), 64).ok());
  }
  ASSERT_TRUE(sim.stream_destroy(peer_stream).ok());
  ASSERT_TRUE(sim.stream_destroy(own_stream).ok());
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(multi_device_sim, access_for_a_device_without_a_peer_path_is_refused_and_changes_nothing) {
  sim_options o = two_devices();
  o.no_peer = {{0, 1}};
  sim_platform sim(o);
  mapped_page page(sim, 0, 2 * MiB);
  const int both[] = {0, 1};
  const status refused = sim.set_access_for(both, page.va, page.size);
  EXPECT_EQ(refused.kind, failure_kind::invalid_value);
  EXPECT_NE(refused.message.find("cannot reach device 0"), std::string::npos) << refused.describe();
  // All or nothing: not even the owner got access.
  EXPECT_EQ(sim.check_access(0, page.ptr(), 64).kind, failure_kind::invalid_value);
  EXPECT_EQ(sim.set_access(1, page.va, page.size).kind, failure_kind::invalid_value);
  ASSERT_TRUE(sim.set_access(0, page.va, page.size).ok());
  EXPECT_TRUE(sim.check_access(0, page.ptr(), 64).ok());
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
}

TEST(multi_device_sim, classic_allocations_need_peer_access_for_kernels_not_for_copies) {
  sim_platform sim(two_devices());
  void* on0 = sim.runtime_malloc(0, 1 * MiB).value();
  void* on1 = sim.runtime_malloc(1, 1 * MiB).value();
  auto stream1 = sim.stream_create(1).value();
  std::memset(on0, 7, 1 * MiB);
  EXPECT_EQ(sim.check_access(1, on0, 64).kind, failure_kind::invalid_value);
  // The driver stages a copy between devices without peer access.
  EXPECT_TRUE(sim.memcpy_async(on1, on0, 1 * MiB, stream1).ok());
  EXPECT_EQ(static_cast<unsigned char*>(on1)[12345], 7);
  ASSERT_TRUE(sim.enable_peer_access(1, 0).ok());
  EXPECT_TRUE(sim.check_access(1, on0, 64).ok());
  EXPECT_EQ(sim.check_access(0, on1, 64).kind, failure_kind::invalid_value) << "one direction only";
  int host = 0;
  EXPECT_EQ(sim.check_access(0, &host, sizeof host).kind, failure_kind::invalid_value);
  ASSERT_TRUE(sim.stream_destroy(stream1).ok());
  ASSERT_TRUE(sim.runtime_free(0, on0).ok());
  ASSERT_TRUE(sim.runtime_free(1, on1).ok());
  // Freed on the wrong device: refused, as cudaFree with another device current.
  void* p = sim.runtime_malloc(0, 4096).value();
  EXPECT_EQ(sim.runtime_free(1, p).kind, failure_kind::invalid_value);
  ASSERT_TRUE(sim.runtime_free(0, p).ok());
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(multi_device_sim, an_event_is_recorded_on_streams_of_its_own_device_only) {
  sim_platform sim(two_devices());
  auto event0 = sim.event_create(0).value();
  auto stream0 = sim.stream_create(0).value();
  auto stream1 = sim.stream_create(1).value();
  EXPECT_TRUE(sim.event_record(event0, stream0).ok());
  EXPECT_TRUE(sim.event_record(event0, {}).ok());  // the default stream: the current device's
  const status refused = sim.event_record(event0, stream1);
  EXPECT_EQ(refused.kind, failure_kind::invalid_value);
  EXPECT_NE(refused.message.find("stream of device 1"), std::string::npos) << refused.describe();
  // Waiting on another device's event is allowed, as in CUDA.
  EXPECT_TRUE(sim.stream_wait_event(stream1, event0).ok());
  EXPECT_EQ(sim.stream_device(stream1).value(), 1);
  ASSERT_TRUE(sim.event_destroy(event0).ok());
  ASSERT_TRUE(sim.stream_destroy(stream0).ok());
  ASSERT_TRUE(sim.stream_destroy(stream1).ok());
}

TEST(multi_device_sim, memory_exported_on_one_device_is_imported_and_used_by_a_peer) {
  sim_platform exporter(two_devices());
  sim_platform importer(two_devices());  // another process's sim device
  auto h = exporter.create_shareable_physical(0, 2 * MiB).value();
  auto va = exporter.reserve_range(2 * MiB, 0).value();
  ASSERT_TRUE(exporter.map(va, 2 * MiB, h, 0).ok());
  ASSERT_TRUE(exporter.set_access(0, va, 2 * MiB).ok());
  std::memset(reinterpret_cast<void*>(va), 0x3c, 2 * MiB);
  const int fd = exporter.export_handle(h).value();

  auto imported = importer.import_handle(1, fd, 2 * MiB);
  ASSERT_TRUE(imported.ok()) << imported.error().describe();
  auto iva = importer.reserve_range(2 * MiB, 0).value();
  ASSERT_TRUE(importer.map(iva, 2 * MiB, imported.value(), 0).ok());
  // The memory lives on device 0: device 1 uses it as a peer's.
  ASSERT_TRUE(importer.set_access(1, iva, 2 * MiB).ok());
  EXPECT_TRUE(importer.check_access(1, reinterpret_cast<void*>(iva), 2 * MiB).ok());
  EXPECT_EQ(reinterpret_cast<unsigned char*>(iva)[4321], 0x3c);
  EXPECT_TRUE(importer.is_valid()) << importer.validate();
  ASSERT_TRUE(importer.unmap(iva, 2 * MiB).ok());
  ASSERT_TRUE(importer.release_physical(imported.value()).ok());
  ASSERT_TRUE(importer.free_range(iva, 2 * MiB).ok());

  // An importer whose device has no path to device 0 is refused at the import.
  sim_options isolated = two_devices();
  isolated.no_peer = {{0, 1}};
  sim_platform far(isolated);
  const auto refused = far.import_handle(1, fd, 2 * MiB);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().kind, failure_kind::invalid_value);
  EXPECT_NE(refused.error().message.find("cannot reach"), std::string::npos)
      << refused.error().describe();
  auto same_device = far.import_handle(0, fd, 2 * MiB);  // device 0 itself: allowed
  ASSERT_TRUE(same_device.ok()) << same_device.error().describe();
  ASSERT_TRUE(far.release_physical(same_device.value()).ok());
  EXPECT_TRUE(far.live_objects().none()) << far.live_objects().describe();
  ::close(fd);
  ASSERT_TRUE(exporter.unmap(va, 2 * MiB).ok());
  ASSERT_TRUE(exporter.release_physical(h).ok());
  ASSERT_TRUE(exporter.free_range(va, 2 * MiB).ok());
  EXPECT_TRUE(importer.live_objects().none()) << importer.live_objects().describe();
}

// --- per-device pools and peer access to their pages --------------------------------------

TEST(multi_device_pool, peer_access_grants_every_mapped_page_to_the_peers_growths_included) {
  sim_platform sim(two_devices());
  {
    vmm_page_pool plain(sim, 0);
    void* p = plain.allocate(1 * MiB);
    EXPECT_TRUE(sim.check_access(0, p, 1 * MiB).ok());
    EXPECT_EQ(sim.check_access(1, p, 1 * MiB).kind, failure_kind::invalid_value)
        << "without peer_access a peer has no access";
    plain.deallocate(p, 1 * MiB);
  }
  {
    vmm_page_pool pool(sim, 0, pool_options::parse("peer_access:1"));
    ASSERT_EQ(pool.access_devices().size(), 2u);
    EXPECT_EQ(pool.access_devices()[1], 1);
    const auto calls = sim.calls_made(platform_op::set_access);
    void* a = pool.allocate(3 * MiB);
    EXPECT_EQ(sim.calls_made(platform_op::set_access), calls + 1) << "one call for both devices";
    EXPECT_TRUE(sim.check_access(1, a, 3 * MiB).ok());
    void* b = pool.allocate(20 * MiB);  // a later growth inherits it
    EXPECT_TRUE(sim.check_access(1, b, 20 * MiB).ok());
    // A peer's stream copies between the pool's pages.
    auto stream1 = sim.stream_create(1).value();
    std::memset(a, 9, 3 * MiB);
    EXPECT_TRUE(sim.memcpy_async(b, a, 3 * MiB, stream1).ok());
    EXPECT_EQ(static_cast<unsigned char*>(b)[3 * MiB - 1], 9);
    ASSERT_TRUE(sim.stream_destroy(stream1).ok());
    pool.deallocate(b, 20 * MiB);
    (void)pool.trim();
    void* c = pool.allocate(8 * MiB);  // new pages after a trim
    EXPECT_TRUE(sim.check_access(1, c, 8 * MiB).ok());
    // Sleep releases the pages; wake maps new ones with the same grants.
    pool.sleep(sleep_mode::offload);
    pool.wake();
    EXPECT_TRUE(sim.check_access(1, c, 8 * MiB).ok());
    pool.deallocate(c, 8 * MiB);
    pool.deallocate(a, 3 * MiB);
    EXPECT_EQ(pool.validate(), "");
  }
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(multi_device_pool, guarded_pages_are_granted_to_the_peers_too) {
  sim_platform sim(two_devices());
  vmm_page_pool pool(sim, 1, pool_options::parse("guard:on,peer_access:0"));
  void* p = pool.allocate(100 * KiB);
  EXPECT_TRUE(sim.check_access(0, p, 100 * KiB).ok());
  pool.deallocate(p, 100 * KiB);
}

TEST(multi_device_pool, peer_access_all_takes_the_devices_that_reach_the_pool) {
  sim_options o = two_devices();
  o.device_count = 3;
  o.no_peer = {{0, 2}};
  sim_platform sim(o);
  vmm_page_pool pool(sim, 0, pool_options::parse("peer_access:all"));
  ASSERT_EQ(pool.access_devices().size(), 2u);
  EXPECT_EQ(pool.access_devices()[0], 0);
  EXPECT_EQ(pool.access_devices()[1], 1);
  void* p = pool.allocate(1 * MiB);
  EXPECT_TRUE(sim.check_access(1, p, 1 * MiB).ok());
  EXPECT_EQ(sim.check_access(2, p, 1 * MiB).kind, failure_kind::invalid_value);
  pool.deallocate(p, 1 * MiB);
  EXPECT_EQ(pool_options::parse("peer_access:all").to_string().find("peer_access:all") !=
                std::string::npos,
            true);
  EXPECT_NE(pool_options::parse("peer_access:1+3").to_string().find("peer_access:1+3"),
            std::string::npos);
}

TEST(multi_device_pool, peer_access_to_a_device_that_cannot_reach_the_pool_is_refused) {
  sim_options o = two_devices();
  o.no_peer = {{0, 1}};
  sim_platform sim(o);
  try {
    vmm_page_pool pool(sim, 0, pool_options::parse("peer_access:1"));
    ADD_FAILURE() << "peer_access to a device without a peer path was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("device 1 cannot reach device 0"), std::string::npos)
        << e.what();
  }
  try {
    vmm_page_pool pool(sim, 0, pool_options::parse("peer_access:5"));
    ADD_FAILURE() << "peer_access to a device that does not exist was accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("device 5"), std::string::npos) << e.what();
  }
  runtime_resource upstream(sim, 0);
  EXPECT_THROW(caching_pool(upstream, pool_options::parse("peer_access:1")), invalid_argument);
  for (const char* bad : {"peer_access:x", "peer_access:64", "peer_access:1+", "peer_access:"})
    EXPECT_THROW((void)pool_options::parse(bad), invalid_argument) << bad;
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

TEST(multi_device_pool, a_pointer_or_stream_of_another_device_is_refused_and_changes_nothing) {
  sim_platform sim(two_devices());
  auto stream1 = sim.stream_create(1).value();
  {
    vmm_page_pool on0(sim, 0), on1(sim, 1);
    void* p = on0.allocate(1 * MiB);
    EXPECT_THROW(on1.deallocate(p, 1 * MiB), invalid_argument);
    EXPECT_EQ(on0.stats().live_bytes, 1 * MiB);
    EXPECT_EQ(on1.stats().live_bytes, 0u);
    try {
      (void)on0.allocate(1 * MiB, 256, stream1);
      ADD_FAILURE() << "device 0's pool allocated on a stream of device 1";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("belongs to device 1"), std::string::npos) << e.what();
    }
    EXPECT_THROW(on0.deallocate(p, 1 * MiB, stream1), invalid_argument);
    EXPECT_EQ(on0.stats().live_bytes, 1 * MiB);
    on0.deallocate(p, 1 * MiB);  // the owner, on a stream of its device: fine
    void* q = on1.allocate(1 * MiB, 256, stream1);
    on1.deallocate(q, 1 * MiB, stream1);
    on1.release_stream(stream1);
    EXPECT_EQ(on0.validate(), "");
    EXPECT_EQ(on1.validate(), "");
  }
  ASSERT_TRUE(sim.stream_destroy(stream1).ok());
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
}

}  // namespace
