// Shared by the pool tests (caching_pool_test.cpp, vmm_page_pool_test.cpp): a fixture on
// a fresh sim device that checks, after each test, that everything was given back, and
// helpers to write and check byte patterns in device memory (sim memory is host memory).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/pool/pool_options.hpp"

namespace gpumem_test {

inline constexpr std::size_t KiB = 1024;
inline constexpr std::size_t MiB = 1024 * KiB;
inline constexpr std::size_t GiB = 1024 * MiB;

// Options of a vmm_page_pool that gathers free pages on every growth they can serve
// (footprint:tight), for the tests of the gather and of what tunes it (growth slack, remap
// budget, lifetime hints, the map worker).
inline gpumem::pool_options tight_footprint() {
  gpumem::pool_options o;
  o.footprint = gpumem::footprint_mode::tight;
  return o;
}

// A 1 GiB sim device with 2 MiB pages. Pools are built inside each test body, so they are
// destroyed before TearDown checks that the device holds nothing any more.
class sim_pool_test : public ::testing::Test {
 protected:
  static gpumem::sim_options device_options() {
    gpumem::sim_options o;
    o.capacity = GiB;
    o.granularity = 2 * MiB;
    return o;
  }

  gpumem::stream_handle make_stream() {
    auto s = sim.stream_create(0);
    EXPECT_TRUE(s.ok()) << s.error().describe();
    streams_.push_back(s.value());
    return s.value();
  }

  std::uint64_t calls(gpumem::platform_op op) const { return sim.calls_made(op); }

  void TearDown() override {
    for (auto s : streams_) EXPECT_TRUE(sim.stream_destroy(s).ok());
    streams_.clear();
    const auto live = sim.live_objects();
    EXPECT_TRUE(live.none()) << "left on the sim device: " << live.describe();
    EXPECT_EQ(sim.validate(), "");
  }

  gpumem::sim_platform sim{device_options()};

 private:
  std::vector<gpumem::stream_handle> streams_;
};

inline void fill(void* p, std::size_t n, unsigned char byte) { std::memset(p, byte, n); }

// A file of the source tree (such as data/train_llama.csv.gz): under GPUMEM_SOURCE_DIR,
// else found by walking up from the working directory (ctest runs in the build tree, which
// lies inside the source tree). Empty when not found.
inline std::string find_in_source_tree(const std::string& relative) {
  namespace fs = std::filesystem;
  const fs::path rel(relative);
  if (const char* dir = std::getenv("GPUMEM_SOURCE_DIR"); dir != nullptr && *dir != '\0')
    if (fs::exists(fs::path(dir) / rel)) return (fs::path(dir) / rel).string();
  std::error_code ec;
  for (fs::path at = fs::current_path(ec); !ec && !at.empty(); at = at.parent_path()) {
    if (fs::exists(at / rel)) return (at / rel).string();
    if (at == at.parent_path()) break;
  }
  return {};
}

// Why a test skips when find_in_source_tree(relative) found nothing.
inline std::string not_in_source_tree(const std::string& relative) {
  return relative + " not found: set GPUMEM_SOURCE_DIR to the source tree or run from inside it";
}

// True when all n bytes at p equal `byte` (memcmp against a pattern: fast in debug builds).
inline bool holds(const void* p, std::size_t n, unsigned char byte) {
  static thread_local std::vector<unsigned char> pattern;
  constexpr std::size_t chunk = 1 << 20;
  if (pattern.size() != chunk || pattern[0] != byte) pattern.assign(chunk, byte);
  const auto* bytes = static_cast<const unsigned char*>(p);
  for (std::size_t done = 0; done < n; done += chunk) {
    const std::size_t len = std::min(chunk, n - done);
    if (std::memcmp(bytes + done, pattern.data(), len) != 0) return false;
  }
  return true;
}

inline bool overlaps(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + bn && y < x + an;
}

// `threads` threads each do `ops` random allocations and frees on `pool`, writing a byte
// pattern of their own into every block they hold and checking it before the free: a
// block handed to two threads at once, or reused while live, breaks some thread's pattern.
// Returns the number of corrupted blocks seen (0 expected).
inline int run_pool_stress(gpumem::memory_resource& pool, int threads, int ops,
                           std::size_t max_small, std::size_t max_large,
                           bool allow_oom = false) {
  std::atomic<int> corrupted{0};
  std::atomic<int> failures{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(t));
      const auto byte = static_cast<unsigned char>(0x11 * (t + 1));
      struct held {
        void* p;
        std::size_t n;
      };
      std::vector<held> mine;
      for (int i = 0; i < ops; ++i) {
        if (mine.size() < 32 && (mine.empty() || rng() % 2 == 0)) {
          const std::size_t n = rng() % 10 == 0 ? 1 + rng() % max_large : 1 + rng() % max_small;
          try {
            void* p = pool.allocate(n);
            fill(p, n, byte);
            mine.push_back({p, n});
          } catch (const gpumem::out_of_memory&) {
            if (!allow_oom) failures.fetch_add(1);
          } catch (const std::exception&) {
            failures.fetch_add(1);
          }
        } else {
          const std::size_t k = rng() % mine.size();
          if (!holds(mine[k].p, mine[k].n, byte)) corrupted.fetch_add(1);
          pool.deallocate(mine[k].p, mine[k].n);
          mine[k] = mine.back();
          mine.pop_back();
        }
      }
      for (auto& h : mine) {
        if (!holds(h.p, h.n, byte)) corrupted.fetch_add(1);
        pool.deallocate(h.p, h.n);
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_EQ(failures.load(), 0) << "allocations failed during the stress run";
  return corrupted.load();
}

}  // namespace gpumem_test
