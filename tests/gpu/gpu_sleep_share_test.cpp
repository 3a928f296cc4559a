// GPU tests of sleep / wake and sharing on the real driver: a tag's pages released (the
// driver's free memory rises by them) and restored at the same addresses with the same
// bytes; a discard wake gives usable pages; physical memory exported as a POSIX file
// descriptor and imported by a forked process that reads and writes it; bad input. Each
// test skips, saying why, when no CUDA device is present.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/pool/vmm/tagged_pool.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::cuda;
using gpumem_test::MiB;

std::vector<unsigned char> pattern(std::size_t n, unsigned seed) {
  std::vector<unsigned char> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i * 131 + seed * 17);
  return v;
}

void upload(platform& p, void* dst, const std::vector<unsigned char>& v) {
  ASSERT_TRUE(p.memcpy_async(dst, v.data(), v.size(), {}).ok());
  ASSERT_TRUE(p.stream_synchronize({}).ok());
}

std::vector<unsigned char> download(platform& p, const void* src, std::size_t n) {
  std::vector<unsigned char> v(n);
  EXPECT_TRUE(p.memcpy_async(v.data(), src, n, {}).ok());
  EXPECT_TRUE(p.stream_synchronize({}).ok());
  return v;
}

std::size_t driver_free(platform& p) { return p.mem_info(0).value().free; }

TEST(gpu_sleep_wake, offload_returns_the_pages_and_wake_restores_the_bytes_in_place) {
  REQUIRE_GPU();
  platform& p = *cuda();
  vmm_page_pool untagged(p);
  tagged_pool pool(untagged, {});
  const std::size_t sizes[] = {256 * MiB, 3 * MiB + 17, 1 << 20};
  std::vector<void*> ptrs;
  unsigned seed = 1;
  for (std::size_t n : sizes) {
    ptrs.push_back(pool.allocate(n, 256, {}, 1));
    upload(p, ptrs.back(), pattern(n, seed++));
  }
  const std::size_t reserved = pool.tag_stats(1).reserved_bytes;
  const std::size_t before = driver_free(p);
  pool.sleep(1, sleep_mode::offload);
  const std::size_t asleep = driver_free(p);
  // The driver's figure moves with other processes too: at least 95% of the tag's bytes.
  EXPECT_GE(asleep - before, reserved / 100 * 95) << "freed " << asleep - before << " of "
                                                  << reserved;
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
  EXPECT_THROW(pool.allocate(MiB, 256, {}, 1), invalid_argument);
  pool.wake(1);
  seed = 1;
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    EXPECT_EQ(download(p, ptrs[i], sizes[i]), pattern(sizes[i], seed++)) << "allocation " << i;
  for (std::size_t i = 0; i < ptrs.size(); ++i) pool.deallocate(ptrs[i], sizes[i]);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST(gpu_sleep_wake, discard_wakes_with_writable_pages_and_a_second_cycle_works) {
  REQUIRE_GPU();
  platform& p = *cuda();
  vmm_page_pool untagged(p);
  tagged_pool pool(untagged, {});
  void* kv = pool.allocate(64 * MiB, 256, {}, 2);
  pool.sleep(2, sleep_mode::discard);
  pool.wake(2);
  upload(p, kv, pattern(64 * MiB, 9));
  EXPECT_EQ(download(p, kv, 64 * MiB), pattern(64 * MiB, 9));
  pool.sleep(2, sleep_mode::offload);
  pool.wake(2);
  EXPECT_EQ(download(p, kv, 64 * MiB), pattern(64 * MiB, 9));
  pool.deallocate(kv, 64 * MiB);
}

TEST(gpu_sharing, a_forked_process_maps_the_exported_memory) {
  REQUIRE_GPU();
  platform& p = *cuda();
  shared_memory shared(p, 0);
  void* mem = nullptr;
  try {
    mem = shared.allocate(32 * MiB);
  } catch (const not_supported& e) {
    GTEST_SKIP() << "no POSIX file descriptor handles here: " << e.what();
  }
  upload(p, mem, pattern(16 * MiB, 4));
  const int fd = shared.export_fd(mem);
  ASSERT_GE(fd, 0);
  // Bad input first, in this process.
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  EXPECT_THROW(shared.import(pipe_fds[0], 32 * MiB), std::exception);
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  EXPECT_THROW(shared.export_fd(static_cast<char*>(mem) + 4096), invalid_argument);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  // The importer is this test binary again (CUDA does not start in a forked child of a
  // process that uses it): it runs gpu_sharing_child.importer on the socket it inherits.
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(sv[0]);
    ::setenv("GPUMEM_TEST_IMPORTER_SOCKET", std::to_string(sv[1]).c_str(), 1);
    ::execl("/proc/self/exe", "gpumem_gpu_tests", "--gtest_filter=gpu_sharing_child.importer",
            static_cast<char*>(nullptr));
    _exit(127);
  }
  ::close(sv[1]);
  ASSERT_TRUE(send_fd(sv[0], fd, 32 * MiB));
  ::close(fd);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ::close(sv[0]);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_EQ(download(p, static_cast<char*>(mem) + 16 * MiB, 16 * MiB),
            std::vector<unsigned char>(16 * MiB, 0xab));
  shared.release(mem, 32 * MiB);
}

// The importing process of gpu_sharing.a_forked_process_maps_the_exported_memory; skips
// when run on its own.
TEST(gpu_sharing_child, importer) {
  const char* sock = std::getenv("GPUMEM_TEST_IMPORTER_SOCKET");
  if (sock == nullptr) GTEST_SKIP() << "runs as the importer of gpu_sharing only";
  REQUIRE_GPU();
  platform& p = *cuda();
  const int s = std::atoi(sock);
  std::uint64_t size = 0;
  const int got = receive_fd(s, &size);
  ASSERT_GE(got, 0);
  shared_memory importer(p, 0);
  EXPECT_THROW(importer.import(got, size + 64 * MiB), std::exception);  // larger than exported
  void* q = importer.import(got, size);
  ::close(got);
  EXPECT_EQ(download(p, q, 16 * MiB), pattern(16 * MiB, 4));
  std::vector<unsigned char> half(16 * MiB, 0xab);
  ASSERT_TRUE(p.memcpy_async(static_cast<char*>(q) + 16 * MiB, half.data(), half.size(), {}).ok());
  ASSERT_TRUE(p.stream_synchronize({}).ok());
  importer.release(q, size);
}

}  // namespace
