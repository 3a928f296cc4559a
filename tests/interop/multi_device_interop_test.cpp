// The PyTorch plug-in and the C API on a sim device with two GPUs (GPUMEM_DEVICE=sim,
// GPUMEM_SIM_DEVICES=2, set before main): one pool per device, chosen by the device index
// PyTorch passes; a record_stream reaches the pool of the stream's device only; a pointer
// or stream of another device is refused with a typed error.
#include <gtest/gtest.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

#include "gpumem/interop/gpumem.h"
#include "gpumem/interop/gpumem_torch.h"

namespace {

constexpr ssize_t MiB = ssize_t{1} << 20;

// Read when the shared sim device and each device's pool are made (the first call).
const bool environment_set = [] {
  ::setenv("GPUMEM_DEVICE", "sim", 1);
  ::setenv("GPUMEM_SIM_DEVICES", "2", 1);
  ::setenv("GPUMEM_CONF", "limit:64M", 1);
  ::setenv("GPUMEM_ALLOCATOR", "vmm_page_pool", 1);
  return true;
}();

gpumem_stats stats_of(int device) {
  gpumem_stats s{};
  EXPECT_EQ(gpumem_torch_stats(device, &s), GPUMEM_SUCCESS) << gpumem_last_error();
  return s;
}

std::uint64_t counter(gpumem_pool* pool, const char* name) {
  std::uint64_t value = 0;
  EXPECT_EQ(gpumem_pool_counter(pool, name, &value), GPUMEM_SUCCESS) << gpumem_last_error();
  return value;
}

TEST(MultiDevicePlugin, EachDeviceIndexGetsAPoolOfItsOwn) {
  void* a = gpumem_torch_malloc(3 * MiB, 0, nullptr);
  void* b = gpumem_torch_malloc(5 * MiB, 1, nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  gpumem_pool* pool0 = gpumem_torch_pool(0);
  gpumem_pool* pool1 = gpumem_torch_pool(1);
  ASSERT_NE(pool0, pool1);
  EXPECT_EQ(gpumem_pool_device(pool0), 0);
  EXPECT_EQ(gpumem_pool_device(pool1), 1);
  EXPECT_EQ(stats_of(0).live_bytes, std::uint64_t(3 * MiB));
  EXPECT_EQ(stats_of(1).live_bytes, std::uint64_t(5 * MiB));
  size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0;
  ASSERT_EQ(gpumem_device_memory(pool0, &free0, &total0), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_device_memory(pool1, &free1, &total1), GPUMEM_SUCCESS);
  EXPECT_NE(free0, free1) << "each device has memory of its own";
  gpumem_torch_free(a, 3 * MiB, 0, nullptr);
  gpumem_torch_free(b, 5 * MiB, 1, nullptr);
  EXPECT_EQ(stats_of(0).live_bytes, 0u);
  EXPECT_EQ(stats_of(1).live_bytes, 0u);
  // Device 2 does not exist: its pool cannot be made.
  EXPECT_THROW((void)gpumem_torch_malloc(MiB, 2, nullptr), std::runtime_error);
}

// The record of a tensor of device 1 on a stream of device 1 goes to device 1's pool: its
// free waits for the stream, and device 0's pool is not asked (no event recorded there).
TEST(MultiDevicePlugin, RecordStreamReachesOnlyThePoolOfTheStreamsDevice) {
  gpumem_pool* pool0 = gpumem_torch_pool(0);
  gpumem_pool* pool1 = gpumem_torch_pool(1);
  void* stream1 = nullptr;
  ASSERT_EQ(gpumem_stream_create(pool1, &stream1), GPUMEM_SUCCESS) << gpumem_last_error();
  int device = -1;
  ASSERT_EQ(gpumem_stream_device(pool0, stream1, &device), GPUMEM_SUCCESS);
  EXPECT_EQ(device, 1);

  void* p = gpumem_torch_malloc(MiB, 1, nullptr);
  ASSERT_NE(p, nullptr);
  const unsigned long long failures = gpumem_torch_failures();
  const std::uint64_t records0 = counter(pool0, "cudaEventRecord");
  const std::uint64_t waits1 = stats_of(1).cross_stream_waits;
  gpumem_torch_record_stream(p, stream1);
  EXPECT_EQ(gpumem_torch_failures(), failures);
  gpumem_torch_free(p, MiB, 1, nullptr);
  EXPECT_EQ(stats_of(1).cross_stream_waits, waits1 + 1) << "device 1's free waited for the stream";
  EXPECT_EQ(counter(pool0, "cudaEventRecord"), records0) << "device 0's pool was asked";

  // A tensor of device 0 recorded on device 1's stream: device 1's pool, the only one
  // asked, does not hold it; reported (PyTorch records from destructors), never thrown.
  void* q = gpumem_torch_malloc(MiB, 0, nullptr);
  ASSERT_NE(q, nullptr);
  gpumem_torch_record_stream(q, stream1);
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
  EXPECT_NE(std::string(gpumem_last_error()).find("not a live allocation"), std::string::npos)
      << gpumem_last_error();
  // The C API names the mismatch when asked directly.
  ASSERT_EQ(gpumem_record_stream(pool0, q, stream1), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gpumem_last_error()).find("belongs to device 1, this pool to device 0"),
            std::string::npos)
      << gpumem_last_error();
  EXPECT_EQ(gpumem_torch_record_stream_on(0, q, stream1), GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_torch_free(q, MiB, 0, nullptr);
  EXPECT_EQ(stats_of(0).live_bytes, 0u);
  EXPECT_EQ(gpumem_stream_destroy(pool1, stream1), GPUMEM_SUCCESS) << gpumem_last_error();
}

TEST(MultiDevicePlugin, APointerOrStreamOfAnotherDeviceIsRefusedAndChangesNothing) {
  gpumem_pool* pool0 = gpumem_torch_pool(0);
  gpumem_pool* pool1 = gpumem_torch_pool(1);
  void* p = gpumem_malloc(pool0, MiB, nullptr);
  ASSERT_NE(p, nullptr);
  // Device 0's pointer freed on device 1's pool.
  EXPECT_EQ(gpumem_free(pool1, p, MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_stats s{};
  ASSERT_EQ(gpumem_pool_stats(pool0, &s), GPUMEM_SUCCESS);
  EXPECT_EQ(s.live_bytes, std::uint64_t(MiB)) << "the refused free changed the owner";
  // Through the plug-in: the device PyTorch names is device 1's; printed and counted.
  const unsigned long long failures = gpumem_torch_failures();
  EXPECT_NO_THROW(gpumem_torch_free(p, MiB, 1, nullptr));
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
  // A stream of device 1 on device 0's pool.
  void* stream1 = nullptr;
  ASSERT_EQ(gpumem_stream_create(pool1, &stream1), GPUMEM_SUCCESS);
  void* out = nullptr;
  EXPECT_EQ(gpumem_allocate(pool0, MiB, 256, stream1, &out), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gpumem_last_error()).find("belongs to device 1"), std::string::npos)
      << gpumem_last_error();
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(gpumem_free(pool0, p, MiB, stream1), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_free(pool0, p, MiB, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(gpumem_stream_destroy(pool1, stream1), GPUMEM_SUCCESS);
}

// C API pools with the device key on the shared sim, and a private two-GPU sim whose
// vmm_page_pool grants its pages to the peer (peer_access).
TEST(MultiDeviceCApi, PoolsPerDeviceAndPeerAccessFromTheConfiguration) {
  gpumem_pool* on1 = nullptr;
  ASSERT_EQ(gpumem_pool_create("platform:sim,device:1", &on1), GPUMEM_SUCCESS)
      << gpumem_last_error();
  EXPECT_EQ(gpumem_pool_device(on1), 1);
  gpumem_pool_destroy(on1);
  gpumem_pool* none = nullptr;
  EXPECT_EQ(gpumem_pool_create("platform:sim,device:2", &none), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gpumem_last_error()).find("does not exist"), std::string::npos)
      << gpumem_last_error();

  gpumem_pool* peer = nullptr;
  ASSERT_EQ(gpumem_pool_create("sim_devices:2,sim_capacity:256M,peer_access:1", &peer),
            GPUMEM_SUCCESS)
      << gpumem_last_error();
  EXPECT_NE(std::string(gpumem_pool_config(peer)).find("peer_access:1"), std::string::npos)
      << gpumem_pool_config(peer);
  void* p = gpumem_malloc(peer, 4 * MiB, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(gpumem_free(peer, p, 4 * MiB, nullptr), GPUMEM_SUCCESS);
  gpumem_pool_destroy(peer);

  // A pair without a peer path: refused when the pool is made, naming the devices.
  EXPECT_EQ(gpumem_pool_create("sim_devices:2,sim_no_peer:0-1,peer_access:1", &peer),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gpumem_last_error()).find("device 1 cannot reach device 0"),
            std::string::npos)
      << gpumem_last_error();
  // Per-device capacities: device 1's pool sees its own.
  gpumem_pool* small = nullptr;
  ASSERT_EQ(gpumem_pool_create("sim_capacity:256M+64M,device:1", &small), GPUMEM_SUCCESS)
      << gpumem_last_error();
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(gpumem_device_memory(small, &free_bytes, &total), GPUMEM_SUCCESS);
  EXPECT_EQ(total, std::size_t(64 * MiB));
  gpumem_pool_destroy(small);
  for (const char* bad : {"sim_devices:0", "sim_devices:65", "sim_no_peer:0-1",
                          "sim_granularity:3000", "sim_no_peer:01", "platform:cuda,sim_devices:2"})
    EXPECT_EQ(gpumem_pool_create(bad, &none), GPUMEM_ERROR_INVALID_ARGUMENT) << bad;
}

// Memory exported by device 0's pool and imported by device 1's: mapped on device 1 as a
// peer's memory (the same bytes), freed on each side independently.
TEST(MultiDeviceCApi, SharedMemoryExportedOnOneDeviceIsImportedByAPeersPool) {
  gpumem_pool* on0 = nullptr;
  gpumem_pool* on1 = nullptr;
  ASSERT_EQ(gpumem_pool_create("platform:sim,device:0", &on0), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_pool_create("platform:sim,device:1", &on1), GPUMEM_SUCCESS);
  void* p = nullptr;
  ASSERT_EQ(gpumem_allocate_tagged(on0, 2 * MiB, 256, nullptr, GPUMEM_TAG_SHARED, &p),
            GPUMEM_SUCCESS)
      << gpumem_last_error();
  static_cast<unsigned char*>(p)[4096] = 0x77;
  int fd = -1;
  ASSERT_EQ(gpumem_export(on0, p, &fd), GPUMEM_SUCCESS) << gpumem_last_error();
  void* q = nullptr;
  ASSERT_EQ(gpumem_import(on1, fd, 2 * MiB, &q), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(q)[4096], 0x77);
  EXPECT_EQ(gpumem_free(on0, p, 2 * MiB, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(static_cast<unsigned char*>(q)[4096], 0x77) << "the importer's mapping keeps it";
  EXPECT_EQ(gpumem_free(on1, q, 2 * MiB, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  ::close(fd);
  gpumem_pool_destroy(on0);
  gpumem_pool_destroy(on1);
}

}  // namespace
