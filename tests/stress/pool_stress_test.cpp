// Stress on sim: many threads x several streams x mixed sizes, for a fixed number of
// operations per thread (deterministic counts, no timing), on every thread-safe pool:
// caching_pool over runtime and over vmm, vmm_page_pool (default, big_chunk, lifetime hints
// on sizes that repeat, 512-byte units), both with a small small_cache, and pinned_host_pool. Each thread allocates on its own two streams and the default stream,
// frees on the block's stream or another, releases and replaces its streams now and then,
// and trims; every block carries a pattern of its own (fuzz_driver.hpp's) checked in full
// before its free, so a block handed to two threads at once, or reused while live, shows.
// Afterwards nothing is live, validate() holds and sim holds nothing. TSan-clean (CI).
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fuzz/fuzz_driver.hpp"

namespace {

using namespace gpumem;
using gpumem_fuzz::KiB;
using gpumem_fuzz::MiB;

constexpr int threads = 8;
constexpr int ops_per_thread = 1500;

struct stress_result {
  std::uint64_t allocations = 0, frees = 0, corrupted = 0, failures = 0, out_of_memory = 0;
  std::uint64_t stream_releases = 0, trims = 0;
};

// alloc / dealloc / trim / release_stream of the pool under test.
struct pool_ops {
  std::function<void*(std::size_t, stream_handle)> allocate;
  std::function<void(void*, std::size_t, stream_handle)> deallocate;
  std::function<void()> trim;
  std::function<void(stream_handle)> release_stream;
};

std::size_t mixed_size(std::mt19937_64& rng) {
  switch (rng() % 10) {
    case 0: case 1: case 2: return 1 + rng() % 256;
    case 3: case 4: case 5: return 1 + rng() % (16 * KiB);
    case 6: case 7: return 1 + rng() % MiB;
    case 8: return MiB + rng() % (3 * MiB);
    default: return 2 * MiB + rng() % (6 * MiB);
  }
}

// Few large sizes, in a cycle a thread sometimes breaks: the history of large requests
// repeats, and blocks of a kind pile up while threads hold them (lifetime hints guess
// them long-lived and move them to the long arena).
std::size_t repeating_size(std::mt19937_64& rng) {
  static constexpr std::size_t large[] = {3 * MiB + 4 * KiB, 5718016, 2 * MiB + 512 * KiB};
  switch (rng() % 4) {
    case 0: return 1 + rng() % (64 * KiB);
    default: return large[rng() % 8 == 0 ? rng() % 3 : 0] + (rng() % 2) * 512;
  }
}

stress_result run_stress(sim_platform& sim, const pool_ops& pool,
                         std::size_t (*size_of)(std::mt19937_64&) = mixed_size) {
  std::atomic<std::uint64_t> allocations{0}, frees{0}, corrupted{0}, failures{0}, ooms{0},
      releases{0}, trims{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(7000 + static_cast<std::uint64_t>(t));
      stream_handle streams[3] = {{}, sim.stream_create(0).value(), sim.stream_create(0).value()};
      struct held {
        void* p;
        std::size_t n;
        int slot;
        std::uint64_t serial;
      };
      std::vector<held> mine;
      std::uint64_t serial = static_cast<std::uint64_t>(t) << 40, checked = 0;
      auto free_one = [&](std::size_t k, int slot) {
        if (!gpumem_fuzz::detail::pattern_holds(mine[k].p, mine[k].n, mine[k].serial, true, checked))
          corrupted.fetch_add(1);
        try {
          pool.deallocate(mine[k].p, mine[k].n, streams[slot]);
          frees.fetch_add(1);
        } catch (const std::exception&) {
          failures.fetch_add(1);
        }
        mine[k] = mine.back();
        mine.pop_back();
      };
      for (int i = 0; i < ops_per_thread; ++i) {
        const auto r = rng() % 100;
        if (r < 2) {
          pool.trim();
          trims.fetch_add(1);
        } else if (r < 4) {
          // This thread is about to destroy one of its streams: the pool forgets it.
          const int slot = 1 + static_cast<int>(rng() % 2);
          pool.release_stream(streams[slot]);
          (void)sim.stream_destroy(streams[slot]);
          streams[slot] = sim.stream_create(0).value();
          for (auto& h : mine)
            if (h.slot == slot) h.slot = 0;
          releases.fetch_add(1);
        } else if (mine.size() < 24 && (mine.empty() || r < 52)) {
          const std::size_t n = size_of(rng);
          const int slot = static_cast<int>(rng() % 3);
          try {
            void* p = pool.allocate(n, streams[slot]);
            gpumem_fuzz::detail::write_pattern(p, n, ++serial);
            mine.push_back({p, n, slot, serial});
            allocations.fetch_add(1);
          } catch (const gpumem::out_of_memory& e) {
            if (ooms.fetch_add(1) == 0) std::printf("[stress] first out_of_memory:\n%s", e.what());
          } catch (const std::exception&) {
            failures.fetch_add(1);
          }
        } else {
          const std::size_t k = rng() % mine.size();
          free_one(k, rng() % 4 == 0 ? static_cast<int>(rng() % 3) : mine[k].slot);
        }
      }
      while (!mine.empty()) free_one(mine.size() - 1, mine.back().slot);
      for (int s = 1; s < 3; ++s) {
        pool.release_stream(streams[s]);
        (void)sim.stream_destroy(streams[s]);
      }
    });
  }
  for (auto& w : workers) w.join();
  return {allocations.load(), frees.load(), corrupted.load(), failures.load(), ooms.load(),
          releases.load(), trims.load()};
}

sim_options stress_device() {
  sim_options o;
  o.capacity = std::size_t{1} << 30;
  o.granularity = 2 * MiB;
  return o;
}

void expect_clean(const stress_result& r, const resource_stats& st, const std::string& valid) {
  EXPECT_EQ(r.corrupted, 0u) << "a block was handed out twice or reused while live";
  EXPECT_EQ(r.failures, 0u) << "an operation failed with something other than out_of_memory";
  EXPECT_EQ(r.allocations, r.frees);
  EXPECT_GT(r.allocations, static_cast<std::uint64_t>(threads * ops_per_thread / 3));
  // ~20 MiB live per thread on a 1 GiB device: a refusal means memory the device has was
  // refused (vmm_page_pool did so before fuzz_regression's packing fix).
  EXPECT_EQ(r.out_of_memory, 0u) << "out of memory with the device mostly free";
  EXPECT_GT(r.stream_releases, 0u);
  EXPECT_GT(r.trims, 0u);
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_EQ(st.live_allocations, 0u);
  EXPECT_EQ(st.allocations, r.allocations);
  EXPECT_EQ(st.deallocations, r.frees);
  EXPECT_EQ(valid, "");
  std::printf("[stress] %d threads x %d operations: %llu allocations, %llu out_of_memory, "
              "%llu stream releases, %llu trims, %llu corrupted\n",
              threads, ops_per_thread, static_cast<unsigned long long>(r.allocations),
              static_cast<unsigned long long>(r.out_of_memory),
              static_cast<unsigned long long>(r.stream_releases),
              static_cast<unsigned long long>(r.trims), static_cast<unsigned long long>(r.corrupted));
}

template <class Pool>
pool_ops ops_of(Pool& p) {
  return {[&p](std::size_t n, stream_handle s) { return p.allocate(n, default_alignment, s); },
          [&p](void* q, std::size_t n, stream_handle s) { p.deallocate(q, n, s); },
          [&p] { (void)p.trim(); }, [&p](stream_handle s) { p.release_stream(s); }};
}

void expect_nothing_left(sim_platform& sim) {
  const auto live = sim.live_objects();
  EXPECT_TRUE(live.none()) << "left on the sim device: " << live.describe();
  EXPECT_EQ(sim.validate(), "");
}

// A caching_pool and the upstream it takes memory from (made first, destroyed last).
template <class Upstream>
struct caching_with_upstream {
  Upstream upstream;
  caching_pool pool;
  caching_with_upstream(sim_platform& sim, const pool_options& o) : upstream(sim), pool(upstream, o) {}
};

template <class Upstream>
std::unique_ptr<caching_with_upstream<Upstream>> make_caching(sim_platform& sim, const pool_options& o) {
  return std::make_unique<caching_with_upstream<Upstream>>(sim, o);
}

vmm_page_pool& pool_of(vmm_page_pool& p) { return p; }
template <class Upstream>
caching_pool& pool_of(caching_with_upstream<Upstream>& h) { return h.pool; }

// A fresh sim device, a pool made on it by make(sim), the stress run, and the checks: the
// pool clean afterwards, and nothing left on the device once it is gone.
template <class Make>
void stress(Make make) {
  sim_platform sim(stress_device());
  {
    auto made = make(sim);
    auto& pool = pool_of(*made);
    const auto r = run_stress(sim, ops_of(pool));
    expect_clean(r, pool.stats(), pool.validate());
  }
  expect_nothing_left(sim);
}

pool_options small_classes_options() {
  pool_options o;
  o.small_classes = 4;
  o.small_cache = 256 * KiB;  // small: the kept blocks go back and forth often
  return o;
}

TEST(pool_stress, caching_pool_over_runtime) {
  stress([](sim_platform& sim) { return make_caching<runtime_resource>(sim, pool_options{}); });
}

TEST(pool_stress, caching_pool_over_vmm_cross_stream_wait) {
  pool_options o;
  o.cross_stream = cross_stream_policy::wait;
  stress([&](sim_platform& sim) { return make_caching<vmm_resource>(sim, o); });
}

TEST(pool_stress, vmm_page_pool) {
  stress([](sim_platform& sim) { return std::make_unique<vmm_page_pool>(sim); });
}

// Lifetime hints on, with sizes that repeat: blocks move between the large and the long
// arena (placed there, freed, their pages gathered back and forth) under all threads. The
// trims and the threads' mix make pages move out of the long-lived runs, so the move
// budget may stop the hints partway (how far they got depends on the threads' timing:
// 60-192 guesses in six runs); both the guessing and the stopped pool run under the
// threads.
TEST(pool_stress, vmm_page_pool_lifetime_hints) {
  sim_platform sim(stress_device());
  {
    pool_options o;
    o.lifetime_hints = true;
    o.footprint = footprint_mode::tight;  // the hints guess only there
    vmm_page_pool pool(sim, 0, o);
    const auto r = run_stress(sim, ops_of(pool), repeating_size);
    expect_clean(r, pool.stats(), pool.validate());
    const vmm_page_counts c = pool.page_counts();
    EXPECT_GT(c.long_lived_allocations, 0u) << "the hints were not exercised";
    std::printf("[stress] %llu allocations guessed long-lived, %llu pages moved out of their "
                "runs, hints %s at the end\n",
                static_cast<unsigned long long>(c.long_lived_allocations),
                static_cast<unsigned long long>(c.long_lived_pages_moved),
                c.lifetime_hints_active ? "still on" : "stopped by the move budget");
  }
  expect_nothing_left(sim);
}

// Small requests in 512-byte units (the defaults round them to size classes): near fits
// from the thread caches, and the caches' keep-or-pass rule, under all threads.
TEST(pool_stress, vmm_page_pool_units) {
  pool_options o;
  o.small_classes = 0;
  stress([&](sim_platform& sim) { return std::make_unique<vmm_page_pool>(sim, 0, o); });
}

TEST(pool_stress, vmm_page_pool_big_chunk) {
  pool_options o;
  o.big_chunk_pages = 2;
  stress([&](sim_platform& sim) { return std::make_unique<vmm_page_pool>(sim, 0, o); });
}

// Small requests in size classes, each thread keeping at most 256 KiB of small blocks: the
// kept blocks are taken back (drained) by other threads' misses that find no kept page and
// by trims, while their owners use them.
TEST(pool_stress, vmm_page_pool_small_classes) {
  stress([](sim_platform& sim) {
    return std::make_unique<vmm_page_pool>(sim, 0, small_classes_options());
  });
}

TEST(pool_stress, caching_pool_small_classes) {
  stress([](sim_platform& sim) {
    return make_caching<runtime_resource>(sim, small_classes_options());
  });
}

TEST(pool_stress, pinned_host_pool) {
  sim_platform sim(stress_device());
  {
    pinned_host_pool pool(sim);
    pool_ops ops{[&](std::size_t n, stream_handle s) { return pool.allocate(n, s); },
                 [&](void* q, std::size_t n, stream_handle s) { pool.deallocate(q, n, s); },
                 [&] { (void)pool.trim(); }, [&](stream_handle s) { pool.release_stream(s); }};
    const auto r = run_stress(sim, ops);
    expect_clean(r, pool.stats(), pool.validate());
  }
  expect_nothing_left(sim);
}

}  // namespace
