// Several GPUs on the cuda platform: a vmm_page_pool's pages read by a peer GPU once
// peer_access grants them (one cuMemSetAccess for both devices), a stream of another device
// refused. Skips, saying why, without two GPUs that reach each other.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gpu/gpu_test_support.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool.hpp"

namespace {

using namespace gpumem;
using gpumem_test::MiB;

#define REQUIRE_TWO_PEER_GPUS()                                                       \
  REQUIRE_GPU();                                                                      \
  do {                                                                                \
    auto n = gpumem_test::cuda()->device_count();                                     \
    if (!n || n.value() < 2) GTEST_SKIP() << "needs 2 GPUs; this machine has "        \
                                          << (n ? n.value() : 0);                     \
    auto peer = gpumem_test::cuda()->can_access_peer(1, 0);                           \
    if (!peer || !peer.value()) GTEST_SKIP() << "GPU 1 cannot reach GPU 0's memory";  \
  } while (0)

TEST(gpu_multi, peer_reads_a_vmm_page_pools_pages_granted_by_peer_access) {
  REQUIRE_TWO_PEER_GPUS();
  platform& p = *gpumem_test::cuda();
  constexpr std::size_t bytes = 64 * MiB;
  vmm_page_pool pool(p, 0, pool_options::parse("peer_access:1"));
  ASSERT_EQ(pool.access_devices().size(), 2u);
  auto stream0 = p.stream_create(0).value();
  auto stream1 = p.stream_create(1).value();
  void* src = pool.allocate(bytes, 256, stream0);
  ASSERT_TRUE(p.memset_async(src, 0x5b, bytes, stream0).ok());
  ASSERT_TRUE(p.stream_synchronize(stream0).ok());
  // Device 1 copies from device 0's pages into its own memory, on its own stream.
  void* dst = p.runtime_malloc(1, bytes).value();
  const status copied = p.memcpy_async(dst, src, bytes, stream1);
  ASSERT_TRUE(copied.ok()) << copied.describe();
  ASSERT_TRUE(p.stream_synchronize(stream1).ok());
  std::vector<unsigned char> host(bytes);
  ASSERT_TRUE(p.memcpy_async(host.data(), dst, bytes, stream1).ok());
  ASSERT_TRUE(p.stream_synchronize(stream1).ok());
  EXPECT_EQ(host.front(), 0x5b);
  EXPECT_EQ(host[bytes / 2], 0x5b);
  EXPECT_EQ(host.back(), 0x5b);
  // A stream of device 1 is refused by device 0's pool, which stays as it was.
  EXPECT_THROW((void)pool.allocate(MiB, 256, stream1), invalid_argument);
  pool.deallocate(src, bytes, stream0);
  EXPECT_EQ(pool.validate(), "");
  ASSERT_TRUE(p.runtime_free(1, dst).ok());
  pool.release_stream(stream0);
  ASSERT_TRUE(p.stream_destroy(stream0).ok());
  ASSERT_TRUE(p.stream_destroy(stream1).ok());
}

TEST(gpu_multi, pools_on_two_devices_take_memory_from_their_own) {
  REQUIRE_TWO_PEER_GPUS();
  platform& p = *gpumem_test::cuda();
  vmm_page_pool on0(p, 0), on1(p, 1);
  const std::size_t free1_before = p.mem_info(1).value().free;
  void* a = on1.allocate(256 * MiB);
  EXPECT_LE(p.mem_info(1).value().free + 256 * MiB, free1_before + 2 * MiB);
  EXPECT_THROW(on0.deallocate(a, 256 * MiB), invalid_argument);  // device 1's pointer
  on1.deallocate(a, 256 * MiB);
  EXPECT_EQ(on0.validate(), "");
  EXPECT_EQ(on1.validate(), "");
}

}  // namespace
