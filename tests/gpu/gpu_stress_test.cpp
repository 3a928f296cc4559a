// GPU stress: several host threads, each with its own streams, allocate from one
// vmm_page_pool and one caching_pool (over cudaMalloc) on the real device. The GPU writes
// every byte of each allocation: a kernel (device_kernels.hpp, compiled by NVRTC) fills it on
// the allocation's stream with a pattern of its own seed and each byte's offset; before the
// free another kernel on that stream counts the bytes that differ (the free queued behind
// it). A block handed out twice, reused by another stream before its last use finished, or
// shifted shows up as mismatched bytes. A fixed number of operations per thread (no timing); skips,
// saying why, when no CUDA device is present (CI has none).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

#include "gpu/device_kernels.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

using namespace gpumem;

using gpumem_test::cuda;
using gpumem_test::device_kernels;
using gpumem_test::MiB;

constexpr int gpu_threads = 6;
constexpr int gpu_ops_per_thread = 400;

struct gpu_stress_result {
  std::uint64_t allocations = 0, bytes_written = 0, corrupted = 0, failures = 0, ooms = 0;
};

gpu_stress_result run_gpu_stress(platform& p, memory_resource& pool) {
  std::string why;
  device_kernels* kernels = device_kernels::get(&why);
  if (kernels == nullptr) {
    ADD_FAILURE() << "a CUDA device but no test kernels: " << why;
    return {};
  }
  runtime_resource counters(p);  // one mismatch counter per thread, outside the pool
  std::atomic<std::uint64_t> allocations{0}, bytes{0}, corrupted{0}, failures{0}, ooms{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < gpu_threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(4242 + static_cast<std::uint64_t>(t));
      stream_handle streams[2];
      for (auto& s : streams) {
        auto made = p.stream_create(0);
        if (!made) {
          failures.fetch_add(1);
          return;
        }
        s = made.value();
      }
      auto* counter = static_cast<unsigned long long*>(counters.allocate(sizeof(unsigned long long)));
      struct held {
        void* ptr;
        std::size_t n;
        int slot;
        std::uint64_t seed;
      };
      std::vector<held> mine;
      std::uint64_t serial = 0;
      auto as_stream = [](stream_handle s) { return reinterpret_cast<void*>(s.value); };
      auto check_and_free = [&](std::size_t k) {
        held h = mine[k];
        mine[k] = mine.back();
        mine.pop_back();
        const stream_handle s = streams[h.slot];
        unsigned long long bad = 0;
        // The check is queued and the block freed behind it, in stream order: the pool
        // must not hand it to another stream before the check has read it.
        const bool queued =
            p.memset_async(counter, 0, sizeof bad, s).ok() &&
            kernels->count_mismatches(h.ptr, h.n, h.seed, counter, as_stream(s)).empty() &&
            p.memcpy_async(&bad, counter, sizeof bad, s).ok();
        try {
          pool.deallocate(h.ptr, h.n, s);
        } catch (const std::exception&) {
          failures.fetch_add(1);
        }
        if (!queued || !p.stream_synchronize(s)) {
          failures.fetch_add(1);
        } else if (bad != 0) {
          corrupted.fetch_add(1);
        }
      };
      for (int i = 0; i < gpu_ops_per_thread; ++i) {
        if (mine.size() < 16 && (mine.empty() || rng() % 2)) {
          const auto cls = rng() % 10;
          const std::size_t n = cls < 4   ? 1 + rng() % 4096
                                : cls < 8 ? 1 + rng() % MiB
                                          : MiB + rng() % (7 * MiB);
          const int slot = static_cast<int>(rng() % 2);
          const std::uint64_t seed = (static_cast<std::uint64_t>(t) << 32) | ++serial;
          void* ptr = nullptr;
          try {
            ptr = pool.allocate(n, default_alignment, streams[slot]);
          } catch (const gpumem::out_of_memory&) {
            ooms.fetch_add(1);
            continue;
          } catch (const std::exception&) {
            failures.fetch_add(1);
            continue;
          }
          // The GPU writes every byte, in stream order on the allocation's stream.
          if (!kernels->fill(ptr, n, seed, as_stream(streams[slot])).empty()) failures.fetch_add(1);
          mine.push_back({ptr, n, slot, seed});
          allocations.fetch_add(1);
          bytes.fetch_add(n);
        } else {
          check_and_free(rng() % mine.size());
        }
      }
      while (!mine.empty()) check_and_free(mine.size() - 1);
      counters.deallocate(counter, sizeof(unsigned long long));
      for (auto s : streams) {
        pool.release_stream(s);
        (void)p.stream_destroy(s);
      }
    });
  }
  for (auto& w : workers) w.join();
  return {allocations.load(), bytes.load(), corrupted.load(), failures.load(), ooms.load()};
}

void expect_clean(const char* what, const gpu_stress_result& r, const memory_resource& pool) {
  EXPECT_EQ(r.corrupted, 0u) << what << ": a block was handed out twice or reused too early";
  EXPECT_EQ(r.failures, 0u) << what;
  EXPECT_GT(r.allocations, static_cast<std::uint64_t>(gpu_threads * gpu_ops_per_thread / 3));
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_EQ(pool.validate(), "");
  std::printf("[gpu stress] %s: %d threads x %d operations, 2 streams each: %llu allocations, "
              "%.1f MiB written and checked by kernels, %llu out_of_memory, %llu corrupted\n",
              what, gpu_threads, gpu_ops_per_thread, static_cast<unsigned long long>(r.allocations),
              static_cast<double>(r.bytes_written) / static_cast<double>(MiB),
              static_cast<unsigned long long>(r.ooms), static_cast<unsigned long long>(r.corrupted));
}

TEST(gpu_stress, vmm_page_pool_threads_and_streams_never_share_a_byte) {
  REQUIRE_GPU();
  vmm_page_pool pool(*cuda());
  expect_clean("vmm_page_pool", run_gpu_stress(*cuda(), pool), pool);
}

TEST(gpu_stress, caching_pool_threads_and_streams_never_share_a_byte) {
  REQUIRE_GPU();
  runtime_resource upstream(*cuda());
  caching_pool pool(upstream);
  expect_clean("caching_pool over cudaMalloc", run_gpu_stress(*cuda(), pool), pool);
}

TEST(gpu_stress, caching_pool_cross_stream_wait_threads_never_share_a_byte) {
  REQUIRE_GPU();
  runtime_resource upstream(*cuda());
  pool_options o;
  o.cross_stream = cross_stream_policy::wait;
  caching_pool pool(upstream, o);
  expect_clean("caching_pool (cross_stream wait)", run_gpu_stress(*cuda(), pool), pool);
}

// Small requests in 512-byte units (small_classes:0; the defaults round them to size
// classes): near fits from the thread caches, and the caches' keep-or-pass rule.
TEST(gpu_stress, vmm_page_pool_units_threads_and_streams_never_share_a_byte) {
  REQUIRE_GPU();
  pool_options o;
  o.small_classes = 0;
  vmm_page_pool pool(*cuda(), 0, o);
  expect_clean("vmm_page_pool (small_classes:0)", run_gpu_stress(*cuda(), pool), pool);
}

TEST(gpu_stress, caching_pool_units_threads_and_streams_never_share_a_byte) {
  REQUIRE_GPU();
  runtime_resource upstream(*cuda());
  pool_options o;
  o.small_classes = 0;
  caching_pool pool(upstream, o);
  expect_clean("caching_pool (small_classes:0)", run_gpu_stress(*cuda(), pool), pool);
}

}  // namespace
