// libgpumem_torch.so's entry points as PyTorch's CUDAPluggableAllocator calls them, on the
// sim device (GPUMEM_DEVICE=sim, GPUMEM_CONF=limit:64M, set before main). The failure path is
// tested here, in C++, because gpumem_torch_malloc reports failure by throwing: a C++
// exception cannot cross ctypes (python_package_test.py covers the rest).
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/types.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#include "gpumem/interop/gpumem.h"

#ifdef GPUMEM_TORCH_C10  // the plug-in built against libtorch (src/interop/CMakeLists.txt)
#include <c10/util/Exception.h>
#endif

#include "gpumem/interop/gpumem_torch.h"

// The CUDA-graph pool hooks PyTorch's allocator calls (src/interop/torch_graph_pools.hpp):
// C++ signatures, as set_begin_allocate_to_pool and friends expect them.
struct CUstream_st;
using mempool_id = std::pair<unsigned long long, unsigned long long>;
extern "C" {
void gpumem_torch_begin_allocate_to_pool(int device, mempool_id id,
                                         std::function<bool(CUstream_st*)> filter);
void gpumem_torch_end_allocate_to_pool(int device, mempool_id id);
void gpumem_torch_release_pool(int device, mempool_id id);
void gpumem_torch_graph_pools(unsigned long long* pools, unsigned long long* reserved_bytes,
                              unsigned long long* live_allocations);
int gpumem_torch_graph_pool_allocate_at(int device, mempool_id id, void* ptr, ssize_t size,
                                        void* stream);
}

namespace {

constexpr ssize_t MiB = ssize_t{1} << 20;

// Read by the plug-in when it creates a device's pool (the first call for that device).
const bool environment_set = [] {
  ::setenv("GPUMEM_DEVICE", "sim", 1);
  ::setenv("GPUMEM_CONF", "limit:64M", 1);
  ::setenv("GPUMEM_ALLOCATOR", "vmm_page_pool", 1);
  return true;
}();

gpumem_stats stats_of(int device) {
  gpumem_stats s{};
  EXPECT_EQ(gpumem_torch_stats(device, &s), GPUMEM_SUCCESS) << gpumem_last_error();
  return s;
}

// What PyTorch raises in Python: the exception's type and the message it shows.
struct failure {
  std::string type;  // "c10::OutOfMemoryError" (torch.OutOfMemoryError) or "std::runtime_error"
  std::string what;
};

failure failure_of(ssize_t size, int device) {
  try {
    void* p = gpumem_torch_malloc(size, device, nullptr);
    ADD_FAILURE() << "gpumem_torch_malloc(" << size << ") returned " << p << " instead of throwing";
    gpumem_torch_free(p, size, device, nullptr);
#ifdef GPUMEM_TORCH_C10
  } catch (const c10::OutOfMemoryError& e) {
    return {"c10::OutOfMemoryError", e.what_without_backtrace()};  // Python shows this part
#endif
  } catch (const std::runtime_error& e) {
    return {"std::runtime_error", e.what()};
  }
  return {};
}

// An out-of-memory's type: PyTorch's own when the plug-in is built against libtorch.
#ifdef GPUMEM_TORCH_C10
constexpr const char* out_of_memory_type = "c10::OutOfMemoryError";
#else
constexpr const char* out_of_memory_type = "std::runtime_error";
#endif

TEST(TorchPlugin, AnOutOfMemoryThrowsPyTorchsPhraseAndTheFullReportAndKeepsThePool) {
  void* held = gpumem_torch_malloc(40 * MiB, 0, nullptr);
  ASSERT_NE(held, nullptr);
  const unsigned long long failures = gpumem_torch_failures();
  const failure f = failure_of(40 * MiB, 0);  // 80 MiB > limit:64M
  EXPECT_EQ(f.type, out_of_memory_type);
  EXPECT_EQ(gpumem_torch_oom_is_torch_type(), f.type == "c10::OutOfMemoryError" ? 1 : 0);
  const std::string& what = f.what;
  // "CUDA out of memory." first, as PyTorch's own error (code looks for it), then gpumem's
  // report, which ends with where the reserved bytes go.
  EXPECT_EQ(what.rfind("CUDA out of memory. gpumem: out of memory on device 0", 0), 0u) << what;
  EXPECT_NE(what.find("limit: 64.00 MiB"), std::string::npos) << what;
  EXPECT_NE(what.find("where the reserved bytes go now:"), std::string::npos) << what;
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
  const gpumem_stats s = stats_of(0);
  EXPECT_EQ(s.oom_count, 1u);
  EXPECT_EQ(s.live_bytes, static_cast<std::uint64_t>(40 * MiB));  // the live tensor intact
  // The pool goes on serving what fits.
  void* more = gpumem_torch_malloc(8 * MiB, 0, nullptr);
  EXPECT_NE(more, nullptr);
  gpumem_torch_free(more, 8 * MiB, 0, nullptr);
  gpumem_torch_free(held, 40 * MiB, 0, nullptr);
  EXPECT_EQ(stats_of(0).live_bytes, 0u);
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
}

TEST(TorchPlugin, ARequestLargerThanTheDeviceIsAnOutOfMemoryAsCudaMallocGives) {
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(gpumem_device_memory(gpumem_torch_pool(0), &free_bytes, &total), GPUMEM_SUCCESS);
  const unsigned long long failures = gpumem_torch_failures();
  const failure f = failure_of(static_cast<ssize_t>(2 * total), 0);
  EXPECT_EQ(f.type, out_of_memory_type);
  EXPECT_EQ(f.what.rfind("CUDA out of memory. ", 0), 0u) << f.what;
  EXPECT_NE(f.what.find("total memory"), std::string::npos) << f.what;
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
  // The largest size a caller can pass is refused the same way.
  EXPECT_EQ(failure_of(std::numeric_limits<ssize_t>::max(), 0).type, out_of_memory_type);
  void* p = gpumem_torch_malloc(MiB, 0, nullptr);  // the pool serves on
  EXPECT_NE(p, nullptr);
  gpumem_torch_free(p, MiB, 0, nullptr);
}

// The same inside a graph capture (a request routed to the graph's private pool): the
// out-of-memory type (the native allocator's observers hear of it by that type) and
// PyTorch's phrase.
TEST(TorchPlugin, ARequestLargerThanTheDeviceInAGraphCaptureIsAnOutOfMemoryToo) {
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(gpumem_device_memory(gpumem_torch_pool(0), &free_bytes, &total), GPUMEM_SUCCESS);
  const mempool_id id{11, 0};
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  const failure f = failure_of(static_cast<ssize_t>(2 * total), 0);
  gpumem_torch_end_allocate_to_pool(0, id);
  gpumem_torch_release_pool(0, id);
  EXPECT_EQ(f.type, out_of_memory_type);
  EXPECT_EQ(f.what.rfind("CUDA out of memory. ", 0), 0u) << f.what;
}

TEST(TorchPlugin, ANegativeSizeOrADeviceWithoutAPoolThrowsWithTheReason) {
  const unsigned long long failures = gpumem_torch_failures();
  // None of these is an out-of-memory: a RuntimeError in Python, whatever the build.
  const failure negative = failure_of(-1, 0);
  EXPECT_EQ(negative.type, "std::runtime_error");
  EXPECT_NE(negative.what.find("negative size -1"), std::string::npos);
  // Sim has one device: device 3's pool cannot be created; every call says why (the
  // creation is tried once).
  const failure first = failure_of(MiB, 3);
  EXPECT_EQ(first.type, "std::runtime_error");
  EXPECT_EQ(first.what.rfind("gpumem_torch: cannot create the pool for device 3 from '", 0), 0u)
      << first.what;
  EXPECT_NE(first.what.find("does not exist"), std::string::npos) << first.what;
  EXPECT_EQ(failure_of(MiB, 3).what, first.what);
  const failure out_of_range = failure_of(MiB, 64);
  EXPECT_EQ(out_of_range.type, "std::runtime_error");
  EXPECT_NE(out_of_range.what.find("device 64 is out of range (0..63)"), std::string::npos);
  EXPECT_EQ(gpumem_torch_failures(), failures + 4);
}

TEST(TorchPlugin, SizeZeroIsNullAndABadFreeNeverThrows) {
  const unsigned long long failures = gpumem_torch_failures();
  EXPECT_EQ(gpumem_torch_malloc(0, 0, nullptr), nullptr);  // as PyTorch's own allocator
  void* p = gpumem_torch_malloc(MiB, 0, nullptr);
  ASSERT_NE(p, nullptr);
  gpumem_torch_free(p, MiB, 0, nullptr);
  // PyTorch frees from destructors: a double free is printed and counted, never thrown.
  EXPECT_NO_THROW(gpumem_torch_free(p, MiB, 0, nullptr));
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
}

// Tensor.record_stream reaches the plug-in without a device: the pool owning the pointer
// records it, and only a pointer no pool holds is reported (never thrown).
TEST(TorchPlugin, RecordStreamRecordsInTheOwnersPoolAndReportsAPointerNoPoolHolds) {
  void* p = gpumem_torch_malloc(MiB, 0, nullptr);
  ASSERT_NE(p, nullptr);
  void* stream = nullptr;
  ASSERT_EQ(gpumem_stream_create(gpumem_torch_pool(0), &stream), GPUMEM_SUCCESS)
      << gpumem_last_error();
  const unsigned long long failures = gpumem_torch_failures();
  const std::uint64_t waits = stats_of(0).cross_stream_waits;
  EXPECT_NO_THROW(gpumem_torch_record_stream(p, stream));
  EXPECT_EQ(gpumem_torch_failures(), failures);
  gpumem_torch_free(p, MiB, 0, nullptr);
  EXPECT_EQ(stats_of(0).cross_stream_waits, waits + 1);  // the free waited for the stream
  EXPECT_NO_THROW(gpumem_torch_record_stream(p, stream));  // freed: no pool holds it
  EXPECT_EQ(gpumem_torch_failures(), failures + 1);
  EXPECT_EQ(gpumem_stream_destroy(gpumem_torch_pool(0), stream), GPUMEM_SUCCESS);
}

gpumem_torch_counts counts_of(int device) {
  gpumem_torch_counts c{};
  EXPECT_EQ(gpumem_torch_memory_counts(device, &c), GPUMEM_SUCCESS) << gpumem_last_error();
  return c;
}

// torch.cuda.memory_stats()'s requested_bytes and allocation figures: current, peak,
// allocated and freed, counted as PyTorch hands them out and frees them.
TEST(TorchPlugin, CountsFollowEveryAllocationAndFreeAsPyTorchsStats) {
  const gpumem_torch_counts before = counts_of(0);
  void* a = gpumem_torch_malloc(3 * MiB, 0, nullptr);
  void* b = gpumem_torch_malloc(5 * MiB + 1, 0, nullptr);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  gpumem_torch_counts c = counts_of(0);
  EXPECT_EQ(c.requested_bytes, before.requested_bytes + 8 * MiB + 1);
  EXPECT_EQ(c.allocations, before.allocations + 2);
  EXPECT_EQ(c.requested_bytes_allocated, before.requested_bytes_allocated + 8 * MiB + 1);
  EXPECT_EQ(c.allocations_made, before.allocations_made + 2);
  EXPECT_GE(c.requested_bytes_peak, c.requested_bytes);
  EXPECT_GE(c.reserved_bytes, c.requested_bytes);
  EXPECT_GE(c.reserved_bytes_peak, c.reserved_bytes);
  gpumem_torch_free(b, 5 * MiB + 1, 0, nullptr);
  // A refused free (double free) changes no count.
  gpumem_torch_free(b, 5 * MiB + 1, 0, nullptr);
  c = counts_of(0);
  EXPECT_EQ(c.requested_bytes, before.requested_bytes + 3 * MiB);
  EXPECT_EQ(c.requested_bytes_freed, before.requested_bytes_freed + 5 * MiB + 1);
  EXPECT_EQ(c.allocations_freed, before.allocations_freed + 1);
  EXPECT_EQ(c.allocations, before.allocations + 1);
  EXPECT_GE(c.requested_bytes_peak, before.requested_bytes + 8 * MiB + 1);
  gpumem_torch_free(a, 3 * MiB, 0, nullptr);
  EXPECT_EQ(counts_of(0).requested_bytes, before.requested_bytes);
}

// torch.cuda.reset_peak_memory_stats(): peaks restart from the current values, then rise
// with new allocations; the reserved peak follows the pool's reserved bytes.
TEST(TorchPlugin, ResetPeakRestartsPeaksFromTheCurrentValues) {
  void* big = gpumem_torch_malloc(20 * MiB, 0, nullptr);
  ASSERT_NE(big, nullptr);
  gpumem_torch_free(big, 20 * MiB, 0, nullptr);
  void* small = gpumem_torch_malloc(MiB, 0, nullptr);
  ASSERT_NE(small, nullptr);
  const gpumem_torch_counts before = counts_of(0);
  ASSERT_GE(before.requested_bytes_peak, before.requested_bytes + 19 * MiB);
  ASSERT_EQ(gpumem_torch_reset_peak(0), GPUMEM_SUCCESS);
  gpumem_torch_counts c = counts_of(0);
  EXPECT_EQ(c.requested_bytes_peak, c.requested_bytes);
  EXPECT_EQ(c.allocations_peak, c.allocations);
  EXPECT_EQ(c.resets, before.resets + 1);
  // Nothing new reserved: the reserved peak since the reset is what was reserved at it.
  EXPECT_EQ(c.reserved_bytes_peak, c.reserved_bytes);
  // The totals are not peaks: a reset keeps them.
  EXPECT_EQ(c.requested_bytes_allocated, before.requested_bytes_allocated);
  void* more = gpumem_torch_malloc(2 * MiB, 0, nullptr);
  ASSERT_NE(more, nullptr);
  gpumem_torch_free(more, 2 * MiB, 0, nullptr);
  c = counts_of(0);
  EXPECT_EQ(c.requested_bytes_peak, before.requested_bytes + 2 * MiB);
  EXPECT_EQ(c.allocations_peak, before.allocations + 1);
  EXPECT_GE(c.reserved_bytes_peak, before.requested_bytes + 2 * MiB);
  EXPECT_LE(c.reserved_bytes_peak, before.reserved_bytes_peak);
  // A new all-time reserved peak after the reset is exact.
  // (the limit is 64 MiB; the all-time peak is under 50 MiB, from the first test)
  const ssize_t huge_size =
      static_cast<ssize_t>(before.reserved_bytes_peak + 4 * MiB - c.requested_bytes);
  void* huge = gpumem_torch_malloc(huge_size, 0, nullptr);
  ASSERT_NE(huge, nullptr);
  gpumem_stats s = stats_of(0);
  c = counts_of(0);
  ASSERT_GT(s.peak_reserved_bytes, before.reserved_bytes_peak);
  EXPECT_EQ(c.reserved_peak_exact, 1u);
  EXPECT_EQ(c.reserved_bytes_peak, s.peak_reserved_bytes);
  gpumem_torch_free(huge, huge_size, 0, nullptr);
  gpumem_torch_free(small, MiB, 0, nullptr);
  EXPECT_NE(gpumem_torch_reset_peak(64), GPUMEM_SUCCESS);  // out of range: refused
}

// PyTorch's reserved bytes include what its graph pools hold: so do the plug-in's, and the
// reserved peak covers them; they leave reserved when the graph's pool is released.
TEST(TorchPlugin, GraphPoolBytesCountInReservedAndItsPeak) {
  const gpumem_torch_counts before = counts_of(0);
  const mempool_id id{7, 0};
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  void* p = gpumem_torch_malloc(4 * MiB, 0, nullptr);
  gpumem_torch_end_allocate_to_pool(0, id);
  ASSERT_NE(p, nullptr);
  unsigned long long pools = 0, graph_reserved = 0, live = 0;
  gpumem_torch_graph_pools(&pools, &graph_reserved, &live);
  ASSERT_EQ(pools, 1u);
  ASSERT_GE(graph_reserved, 4u * MiB);
  gpumem_torch_counts c = counts_of(0);
  EXPECT_EQ(c.requested_bytes, before.requested_bytes + 4 * MiB);
  EXPECT_EQ(c.reserved_bytes, stats_of(0).reserved_bytes + graph_reserved);
  EXPECT_GE(c.reserved_bytes, c.requested_bytes);
  EXPECT_GE(c.reserved_bytes_peak, c.reserved_bytes);
  EXPECT_EQ(c.reserved_peak_exact, 0u);
  gpumem_torch_free(p, 4 * MiB, 0, nullptr);
  gpumem_torch_release_pool(0, id);
  gpumem_torch_graph_pools(&pools, &graph_reserved, &live);
  EXPECT_EQ(pools, 0u);
  c = counts_of(0);
  EXPECT_EQ(c.reserved_bytes, stats_of(0).reserved_bytes);
  EXPECT_EQ(c.requested_bytes, before.requested_bytes);
  // The peak keeps the bytes the graph held: sampled at its capture.
  EXPECT_GE(c.reserved_bytes_peak, before.reserved_bytes + 4 * MiB);
}

// A CUDA graph tree's checkpoint restored (the native allocator's setCheckpointPoolState):
// an allocation freed since the checkpoint is allocated again at its address in the graph's
// private pool, owned by it (freed as any of its allocations); a live range, a bad size or a
// pool that is gone is refused.
TEST(TorchPlugin, AGraphPoolTakesBackAFreedAllocationAtItsAddress) {
  const mempool_id id{8, 0};
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  void* out = gpumem_torch_malloc(4 * MiB, 0, nullptr);
  void* scratch = gpumem_torch_malloc(2 * MiB, 0, nullptr);
  gpumem_torch_end_allocate_to_pool(0, id);
  ASSERT_TRUE(out != nullptr && scratch != nullptr);
  auto live_in_graphs = [] {
    unsigned long long pools = 0, reserved = 0, live = 0;
    gpumem_torch_graph_pools(&pools, &reserved, &live);
    return live;
  };
  ASSERT_EQ(live_in_graphs(), 2u);
  gpumem_torch_free(out, 4 * MiB, 0, nullptr);  // a branch freed it
  EXPECT_EQ(live_in_graphs(), 1u);
  EXPECT_EQ(gpumem_torch_graph_pool_allocate_at(0, id, scratch, 2 * MiB, nullptr),
            GPUMEM_ERROR_INVALID_ARGUMENT);  // live
  EXPECT_EQ(gpumem_torch_graph_pool_allocate_at(0, id, out, 0, nullptr), -1);
  EXPECT_EQ(gpumem_torch_graph_pool_allocate_at(0, mempool_id{9, 0}, out, 4 * MiB, nullptr), -1);
  ASSERT_EQ(gpumem_torch_graph_pool_allocate_at(0, id, out, 4 * MiB, nullptr), GPUMEM_SUCCESS)
      << gpumem_last_error();
  EXPECT_EQ(live_in_graphs(), 2u);
  gpumem_torch_free(out, 4 * MiB, 0, nullptr);  // the graph pool's, freed there
  gpumem_torch_free(scratch, 2 * MiB, 0, nullptr);
  EXPECT_EQ(live_in_graphs(), 0u);
  gpumem_torch_release_pool(0, id);
  unsigned long long pools = 0;
  gpumem_torch_graph_pools(&pools, nullptr, nullptr);
  EXPECT_EQ(pools, 0u);
  EXPECT_EQ(gpumem_torch_graph_pool_allocate_at(0, id, out, 4 * MiB, nullptr), -1);  // gone
}

static unsigned long long graph_reserved() {
  unsigned long long pools = 0, reserved = 0, live = 0;
  gpumem_torch_graph_pools(&pools, &reserved, &live);
  return reserved;
}

// A graph captured inside a tag (the rollout's decode in `with gpumem.torch.tag(...)`) has
// its private pool sleep and wake with the tag: the device's part and the graph's memory go
// back to the driver together and come back at the same addresses. A second sleep, a wake
// of what does not sleep and an allocation in the sleeping graph pool are refused.
TEST(TorchPlugin, AGraphPoolMadeUnderATagSleepsAndWakesWithIt) {
  constexpr uint32_t tag = 41;
  const uint32_t previous = gpumem_set_current_tag(tag);
  void* cache = gpumem_torch_malloc(2 * MiB, 0, nullptr);  // the tag's own pages
  const mempool_id id{10, 0};
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  void* out = gpumem_torch_malloc(4 * MiB, 0, nullptr);
  gpumem_torch_end_allocate_to_pool(0, id);
  gpumem_set_current_tag(previous);
  ASSERT_TRUE(cache != nullptr && out != nullptr);
  ASSERT_GE(graph_reserved(), 4u * MiB);
  gpumem_pool* pool = gpumem_torch_pool(0);

  ASSERT_EQ(gpumem_torch_sleep(0, tag, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_SUCCESS)
      << gpumem_last_error();
  EXPECT_EQ(gpumem_tag_asleep(pool, tag), 1);
  EXPECT_EQ(graph_reserved(), 0u);  // the graph's pages went with the tag's
  EXPECT_EQ(gpumem_torch_sleep(0, tag, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  const failure refused = failure_of(MiB, 0);
  gpumem_torch_end_allocate_to_pool(0, id);
  gpumem_torch_release_pool(0, id);
  EXPECT_NE(refused.what.find("asleep"), std::string::npos) << refused.what;

  ASSERT_EQ(gpumem_torch_wake(0, tag, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(gpumem_tag_asleep(pool, tag), 0);
  EXPECT_GE(graph_reserved(), 4u * MiB);
  EXPECT_EQ(gpumem_torch_wake(0, tag, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  // The replay's address is the graph pool's again: taken back there after its free.
  gpumem_torch_free(out, 4 * MiB, 0, nullptr);
  ASSERT_EQ(gpumem_torch_graph_pool_allocate_at(0, id, out, 4 * MiB, nullptr), GPUMEM_SUCCESS)
      << gpumem_last_error();
  gpumem_torch_free(out, 4 * MiB, 0, nullptr);
  gpumem_torch_free(cache, 2 * MiB, 0, nullptr);
  gpumem_torch_release_pool(0, id);
  EXPECT_EQ(graph_reserved(), 0u);
}

// A graph pool belongs to the tag current when it was made, not to the tag that sleeps: an
// untagged graph keeps its memory through another tag's sleep, and a tag with only a graph
// pool (nothing of its own in the device pool) sleeps and wakes that pool alone.
TEST(TorchPlugin, AGraphPoolSleepsOnlyWithItsOwnTag) {
  const mempool_id untagged{11, 0}, tagged{12, 0};
  gpumem_torch_begin_allocate_to_pool(0, untagged, [](CUstream_st*) { return true; });
  void* a = gpumem_torch_malloc(2 * MiB, 0, nullptr);
  gpumem_torch_end_allocate_to_pool(0, untagged);
  constexpr uint32_t tag = 42;
  const uint32_t previous = gpumem_set_current_tag(tag);
  gpumem_torch_begin_allocate_to_pool(0, tagged, [](CUstream_st*) { return true; });
  void* b = gpumem_torch_malloc(2 * MiB, 0, nullptr);
  gpumem_torch_end_allocate_to_pool(0, tagged);
  gpumem_set_current_tag(previous);
  ASSERT_TRUE(a != nullptr && b != nullptr);
  const unsigned long long both = graph_reserved();
  ASSERT_GE(both, 4u * MiB);

  ASSERT_EQ(gpumem_torch_sleep(0, tag, GPUMEM_SLEEP_OFFLOAD, nullptr), GPUMEM_SUCCESS)
      << gpumem_last_error();
  const unsigned long long asleep = graph_reserved();
  EXPECT_GE(asleep, 2u * MiB);  // the untagged graph's
  EXPECT_LE(asleep, both - 2 * MiB);
  EXPECT_EQ(gpumem_tag_asleep(gpumem_torch_pool(0), tag), 0);  // nothing of its own there
  EXPECT_EQ(gpumem_torch_tag_asleep(0, tag), 1);  // its graph pool is
  EXPECT_EQ(gpumem_torch_tag_used(0, tag), 1);
  EXPECT_EQ(gpumem_torch_tag_asleep(0, 0), 0);  // the untagged graph's tag is awake
  EXPECT_EQ(gpumem_torch_release_host(0, tag, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT)
      << "the graph pool's bytes live in that host memory";
  ASSERT_EQ(gpumem_torch_wake(0, tag, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(gpumem_torch_tag_asleep(0, tag), 0);
  // The graph pool's host copy stays for the next sleep until released, and the release
  // reaches it though the tag holds nothing of its own in the device's pool.
  uint64_t held = 0, released = 0;
  ASSERT_EQ(gpumem_torch_host_bytes(0, tag, &held), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_GE(held, 2u * MiB);
  ASSERT_EQ(gpumem_torch_release_host(0, tag, &released), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(released, held);
  ASSERT_EQ(gpumem_torch_host_bytes(0, tag, &held), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(held, 0u);
  EXPECT_EQ(gpumem_torch_host_bytes(0, tag, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_torch_release_host(0, 4242, &released), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(released, 0u);
  EXPECT_EQ(gpumem_torch_tag_used(0, 4242), 0);  // never allocated in, no graph made under it
  EXPECT_EQ(gpumem_torch_tag_asleep(0, 4242), 0);
  EXPECT_EQ(graph_reserved(), both);
  EXPECT_EQ(gpumem_torch_sleep(0, tag, 7, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);  // a bad mode
  gpumem_torch_free(a, 2 * MiB, 0, nullptr);
  gpumem_torch_free(b, 2 * MiB, 0, nullptr);
  gpumem_torch_release_pool(0, untagged);
  gpumem_torch_release_pool(0, tagged);
  EXPECT_EQ(graph_reserved(), 0u);
}

// keep_free through the plug-in reaches the device's pool and the private pools of CUDA
// graphs, those made later too: every growth past it is an out-of-memory naming it.
TEST(TorchPlugin, KeepFreeReachesTheDevicesPoolAndItsGraphPools) {
  gpumem_pool* pool = gpumem_torch_pool(0);
  (void)gpumem_torch_empty_cache();  // what earlier tests freed would serve without a growth
  std::size_t free = 0, total = 0;
  ASSERT_EQ(gpumem_device_memory(pool, &free, &total), GPUMEM_SUCCESS) << gpumem_last_error();
  ASSERT_EQ(gpumem_torch_set_keep_free(0, free - 2 * MiB), GPUMEM_SUCCESS) << gpumem_last_error();
  const failure device_pool = failure_of(8 * MiB, 0);
  EXPECT_NE(device_pool.what.find("keep_free"), std::string::npos) << device_pool.what;
  const mempool_id id{13, 0};
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  const failure graph_pool = failure_of(8 * MiB, 0);
  gpumem_torch_end_allocate_to_pool(0, id);
  gpumem_torch_release_pool(0, id);  // every begin is matched by a release, as in PyTorch
  EXPECT_NE(graph_pool.what.find("keep_free"), std::string::npos) << graph_pool.what;
  ASSERT_EQ(gpumem_torch_set_keep_free(0, 0), GPUMEM_SUCCESS) << gpumem_last_error();
  gpumem_torch_begin_allocate_to_pool(0, id, [](CUstream_st*) { return true; });
  void* p = gpumem_torch_malloc(8 * MiB, 0, nullptr);
  gpumem_torch_end_allocate_to_pool(0, id);
  EXPECT_NE(p, nullptr);
  gpumem_torch_free(p, 8 * MiB, 0, nullptr);
  gpumem_torch_release_pool(0, id);
  EXPECT_EQ(gpumem_torch_set_keep_free(4096, 0), GPUMEM_ERROR_INVALID_ARGUMENT);
}

// A call that finds no pool for its device fails with a typed status even on a thread whose
// last gpumem call succeeded (its last status is GPUMEM_SUCCESS).
TEST(TorchPlugin, NoPoolForTheDeviceIsAFailureOnAFreshThread) {
  int sleep_status = 0, wake_status = 0, fraction_status = 0;
  std::thread([&] {
    sleep_status = gpumem_torch_sleep(4096, 1, GPUMEM_SLEEP_DISCARD, nullptr);
    wake_status = gpumem_torch_wake(-1, 1, nullptr);
    fraction_status = gpumem_torch_set_memory_fraction(4096, 0.5);
  }).join();
  EXPECT_EQ(sleep_status, GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(wake_status, GPUMEM_ERROR_INVALID_ARGUMENT);
  int asleep_status = 0, used_status = 0, host_status = 0, release_status = 0;
  uint64_t host = 7;
  std::thread([&] {
    asleep_status = gpumem_torch_tag_asleep(4096, 1);
    used_status = gpumem_torch_tag_used(-1, 1);
  }).join();
  std::thread([&] { host_status = gpumem_torch_host_bytes(4096, 1, &host); }).join();
  std::thread([&] { release_status = gpumem_torch_release_host(-1, 1, nullptr); }).join();
  EXPECT_EQ(asleep_status, -1);
  EXPECT_EQ(used_status, -1);
  EXPECT_EQ(host_status, GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(host, 0u);
  EXPECT_EQ(release_status, GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fraction_status, GPUMEM_ERROR_INVALID_ARGUMENT);
}

// CUDA IPC handles (the native allocator's shareIpcHandle / getIpcDevPtr): a live tensor's
// pages are shared in PyTorch's expandable-segment format and opened through pidfd_getfd.
// In one process here (a process may always take its own descriptors); across processes
// on the GPU (tests/interop/torch_native_allocator_test.py).
int open_descriptors() {
  int n = 0;
  for (int fd = 0; fd < 4096; ++fd) n += ::fcntl(fd, F_GETFD) != -1 ? 1 : 0;
  return n;
}

TEST(TorchPlugin, IpcHandleOpensTheSameBytesAndBadHandlesAreRefused) {
  const ssize_t size = 3 * MiB + 4096;
  void* p = gpumem_torch_malloc(size, 0, nullptr);
  ASSERT_NE(p, nullptr);
  auto* bytes = static_cast<unsigned char*>(p);
  for (ssize_t i = 0; i < size; ++i) bytes[i] = static_cast<unsigned char>(i * 13 + 1);
  const int fds_before = open_descriptors();
  std::string handle(8, '\0');
  std::size_t length = 0, offset = 0;
  // Too little room: the length comes back, nothing is written.
  ASSERT_EQ(gpumem_torch_ipc_share(0, p, size, handle.data(), handle.size(), &length, &offset),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  ASSERT_GT(length, handle.size());
  handle.resize(length);
  ASSERT_EQ(gpumem_torch_ipc_share(0, p, size, handle.data(), handle.size(), &length, &offset),
            GPUMEM_SUCCESS)
      << gpumem_last_error();
  EXPECT_EQ(handle[0], 2);
  EXPECT_EQ(handle[1], 'e');
  // Shared again: the same handle, no new descriptors.
  std::string again(length, '\0');
  const int fds_shared = open_descriptors();
  ASSERT_EQ(gpumem_torch_ipc_share(0, p, size, again.data(), again.size(), &length, &offset),
            GPUMEM_SUCCESS);
  EXPECT_EQ(again, handle);
  EXPECT_EQ(open_descriptors(), fds_shared);

  void* base = nullptr;
  std::size_t mapped = 0;
  ASSERT_EQ(gpumem_torch_ipc_open(0, handle.data(), handle.size(), &base, &mapped), GPUMEM_SUCCESS)
      << gpumem_last_error();
  ASSERT_GE(mapped, offset + static_cast<std::size_t>(size));
  const auto* seen = static_cast<const unsigned char*>(base) + offset;
  EXPECT_EQ(std::memcmp(seen, p, static_cast<std::size_t>(size)), 0);
  bytes[5] = 0xee;  // the same memory, not a copy
  EXPECT_EQ(seen[5], 0xee);

  // The same handle with a size per handle ('g', gpumem's format for unequal handles).
  {
    std::string sized = handle;
    sized[1] = 'g';
    std::size_t handles = 0;
    std::memcpy(&handles, handle.data() + 2 + 2 * sizeof(std::size_t), sizeof handles);
    std::size_t segment = 0;
    std::memcpy(&segment, handle.data() + 2 + sizeof(std::size_t), sizeof segment);
    for (std::size_t i = 0; i < handles; ++i) {
      const std::uint64_t v = segment;
      sized.append(reinterpret_cast<const char*>(&v), sizeof v);
    }
    void* base2 = nullptr;
    std::size_t mapped2 = 0;
    ASSERT_EQ(gpumem_torch_ipc_open(0, sized.data(), sized.size(), &base2, &mapped2), GPUMEM_SUCCESS)
        << gpumem_last_error();
    EXPECT_EQ(mapped2, mapped);
    EXPECT_EQ(static_cast<const unsigned char*>(base2)[offset + 5], 0xee);
    gpumem_pool* pool = gpumem_torch_pool(0);
    EXPECT_EQ(gpumem_free(pool, base2, mapped2, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  }

  // Bad handles: refused with the reason, nothing mapped.
  const gpumem_stats st = stats_of(0);
  auto refused = [&](std::string h, const char* why) {
    void* b = reinterpret_cast<void*>(1);
    std::size_t m = 1;
    EXPECT_EQ(gpumem_torch_ipc_open(0, h.data(), h.size(), &b, &m), GPUMEM_ERROR_INVALID_ARGUMENT)
        << why;
    EXPECT_EQ(b, nullptr) << why;
    EXPECT_EQ(m, 0u) << why;
  };
  refused("", "empty");
  refused(handle.substr(0, handle.size() - 1), "cut short");
  refused(handle + "x", "a byte too many");
  std::string h = handle;
  h[0] = 1;
  refused(h, "another version");
  h = handle;
  h[1] = 'c';
  refused(h, "a cudaMalloc handle");
  h = handle;
  const std::size_t huge = std::size_t{1} << 40;
  std::memcpy(h.data() + 2 + 2 * sizeof(std::size_t), &huge, sizeof huge);
  refused(h, "a count past the bytes");
  h = handle;
  const pid_t nobody = 0x3fffffff;  // past pid_max
  std::memcpy(h.data() + 2, &nobody, sizeof nobody);
  refused(h, "an exporter that does not exist");
  h = handle;
  const int not_open = 4000;
  std::memcpy(h.data() + 2 + sizeof(pid_t) + (sizeof(std::size_t) - sizeof(pid_t)) + 2 * sizeof(std::size_t),
              &not_open, sizeof not_open);
  refused(h, "a descriptor the exporter does not hold");
  EXPECT_EQ(stats_of(0).reserved_bytes, st.reserved_bytes);

  gpumem_pool* pool = gpumem_torch_pool(0);
  EXPECT_EQ(gpumem_free(pool, base, mapped, nullptr), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(open_descriptors(), fds_shared);  // the opener's mappings hold no descriptor
  gpumem_torch_ipc_forget(p);  // the free's duty: the exporter's descriptors close
  EXPECT_EQ(open_descriptors(), fds_before);
  gpumem_torch_free(p, size, 0, nullptr);

  // Memory that is not a live allocation of the pool is not shared.
  std::size_t len = 0, off = 0;
  char buf[256];
  int local = 0;
  EXPECT_NE(gpumem_torch_ipc_share(0, &local, 64, buf, sizeof buf, &len, &off), GPUMEM_SUCCESS);
  EXPECT_EQ(len, 0u);
}

}  // namespace
