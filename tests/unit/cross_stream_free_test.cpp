// Frees on a stream other than the allocation's, over both pools on a sim device: the
// reserved bytes stay within the pool's usual bound of the peak live bytes whatever stream
// frees (a freed block's stream tag must not keep its memory apart for good), a pool under
// a limit with nothing live never runs out of memory, a stream the platform refuses leaves
// the allocation live and the pool working, and many distinct streams cost per-stream work
// only.
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::GiB;
using gpumem_test::MiB;

struct runtime_caching_pool {
  runtime_resource upstream;
  caching_pool pool;
  runtime_caching_pool(platform& p, pool_options o) : upstream(p), pool(upstream, o) {}
};

// One pool of either kind over the sim device.
struct any_pool {
  std::unique_ptr<runtime_caching_pool> caching;
  std::unique_ptr<vmm_page_pool> paged;
  pool_base& get() { return caching ? static_cast<pool_base&>(caching->pool) : *paged; }
};

enum class kind { caching, paged };

any_pool make_pool(platform& p, kind k, const std::string& conf = "") {
  any_pool a;
  const pool_options o = pool_options::parse(conf);
  if (k == kind::caching)
    a.caching = std::make_unique<runtime_caching_pool>(p, o);
  else
    a.paged = std::make_unique<vmm_page_pool>(p, 0, o);
  return a;
}

class CrossStreamFree : public gpumem_test::sim_pool_test, public ::testing::WithParamInterface<kind> {};

// The loop of the defect: allocate on A, free on B, at most two allocations live, sizes
// growing from 1 KiB to 3 MiB and again. Peak reserved must be what the same loop reaches
// freeing on A, within two pages (before the fix: 3x it in the page pool, and growing).
TEST_P(CrossStreamFree, AllocatingOnOneStreamAndFreeingOnAnotherKeepsReservedBounded) {
  const stream_handle a = make_stream(), b = make_stream();
  std::size_t peak_reserved[2] = {0, 0};
  for (int cross = 0; cross < 2; ++cross) {
    any_pool holder = make_pool(sim, GetParam());
    pool_base& pool = holder.get();
    struct live {
      void* p;
      std::size_t n;
    };
    std::vector<live> held;
    for (int i = 0; i < 12000; ++i) {
      const std::size_t n = (1 + i % 3000) * 1024;
      held.push_back({pool.allocate(n, default_alignment, a), n});
      if (held.size() == 2) {
        pool.deallocate(held.front().p, held.front().n, cross ? b : a);
        held.erase(held.begin());
      }
    }
    for (auto& h : held) pool.deallocate(h.p, h.n, cross ? b : a);
    peak_reserved[cross] = pool.stats().peak_reserved_bytes;
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
  EXPECT_LE(peak_reserved[1], peak_reserved[0] + 4 * MiB)
      << "freeing on another stream than the allocation's reserved more than freeing on its own";
}

// Several threads, each on its own stream, free each other's blocks: live allocations sit
// in one shared list of at most 16; a thread that finds it full frees one (most likely
// another thread's) on its own stream before it allocates.
TEST_P(CrossStreamFree, ThreadsFreeingEachOthersBlocksKeepReservedBounded) {
  any_pool holder = make_pool(sim, GetParam());
  pool_base& pool = holder.get();
  constexpr int threads = 4;
  std::vector<stream_handle> streams;
  for (int t = 0; t < threads; ++t) streams.push_back(make_stream());
  std::mutex m;
  std::vector<std::pair<void*, std::size_t>> shared;
  std::size_t live = 0, peak = 0;  // guarded by m
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int i = 0; i < 1500; ++i) {
        std::pair<void*, std::size_t> victim{nullptr, 0};
        {
          std::lock_guard lock(m);
          if (shared.size() >= 16) {
            const std::size_t k = rng() % shared.size();
            victim = shared[k];
            shared[k] = shared.back();
            shared.pop_back();
          }
        }
        if (victim.first != nullptr) {
          pool.deallocate(victim.first, victim.second, streams[t]);
          std::lock_guard lock(m);
          live -= victim.second;
        }
        const std::size_t n = (1 + (i * 7 + t * 131) % 3000) * 1024;
        void* p = pool.allocate(n, default_alignment, streams[t]);
        std::lock_guard lock(m);
        shared.push_back({p, n});
        live += n;
        peak = std::max(peak, live);
      }
    });
  }
  for (auto& w : workers) w.join();
  for (auto& [q, n] : shared) pool.deallocate(q, n, streams[0]);
  EXPECT_LE(pool.stats().peak_reserved_bytes, 2 * peak + 64 * MiB) << "peak live " << peak << " B";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// Twelve events alternating two streams with growing sizes under a 16 MiB limit: with
// nothing live, an allocation that fits the limit must succeed (the retry after giving the
// cache back gives back other streams' idle memory too).
TEST_P(CrossStreamFree, NothingLiveNeverRunsOutOfMemoryUnderALimit) {
  any_pool holder = make_pool(sim, GetParam(), "limit:16M");
  pool_base& pool = holder.get();
  const stream_handle s[2] = {make_stream(), make_stream()};
  sim.hold_events(true);  // frees are not known complete until the pool waits
  for (int i = 0; i < 24; ++i) {
    const std::size_t n = (1 + i % 12) * MiB;
    void* p = nullptr;
    ASSERT_NO_THROW(p = pool.allocate(n, default_alignment, s[i % 2])) << "event " << i << ", nothing live";
    pool.deallocate(p, n, s[(i + 1) % 2]);
  }
  sim.hold_events(false);
  EXPECT_LE(pool.stats().reserved_bytes, 16 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A stream value the platform does not know: the free is refused, the allocation stays
// live, and the pool keeps working on every stream.
TEST_P(CrossStreamFree, AFreeOnAStreamThePlatformRefusesChangesNothing) {
  any_pool holder = make_pool(sim, GetParam());
  pool_base& pool = holder.get();
  const stream_handle a = make_stream();
  void* p = pool.allocate(3 * MiB, default_alignment, a);
  void* q = pool.allocate(1000, default_alignment, a);
  EXPECT_THROW(pool.deallocate(p, 3 * MiB, stream_handle{0x1234}), invalid_argument);
  EXPECT_THROW(pool.deallocate(q, 1000, stream_handle{0x1234}), invalid_argument);
  EXPECT_EQ(pool.stats().live_bytes, 3 * MiB + 1000) << "the refused frees left both live";
  EXPECT_THROW(pool.allocate(MiB, default_alignment, stream_handle{0x1234}), invalid_argument);
  void* r = pool.allocate(5 * MiB, default_alignment, a);
  void* t = pool.allocate(5 * MiB, default_alignment, stream_handle{0});
  pool.deallocate(p, 3 * MiB, a);
  pool.deallocate(q, 1000, a);
  pool.deallocate(r, 5 * MiB, a);
  pool.deallocate(t, 5 * MiB, stream_handle{0});
  EXPECT_GT(pool.trim(), 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// Per-stream work must not scan every stream: 20,000 streams each allocating and freeing
// once, then again, finish and leave the pool valid. (Time is not asserted: the
// benchmark-free guard is that the per-stream state the pool keeps is bounded.)
TEST_P(CrossStreamFree, ManyDistinctStreamsKeepPerStreamStateBounded) {
  any_pool holder = make_pool(sim, GetParam());
  pool_base& pool = holder.get();
  constexpr int n = 20000;
  std::vector<stream_handle> streams;
  streams.reserve(n);
  for (int i = 0; i < n; ++i) streams.push_back(make_stream());
  for (int round = 0; round < 2; ++round)
    for (int i = 0; i < n; ++i) {
      void* p = pool.allocate(4096 + (i % 7) * 512, default_alignment, streams[i]);
      pool.deallocate(p, 4096 + (i % 7) * 512, streams[(i + 1) % n]);
    }
  EXPECT_LE(pool.tracked_streams(), 64u) << "per-stream state of streams with nothing pending is dropped";
  EXPECT_LE(pool.stats().reserved_bytes, 4 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A stream destroyed (its work done) while the pool holds blocks freed on it, without
// release_stream: the pool takes its work as finished. trim, release_stream and allocations
// on other streams keep working, and the blocks are reused.
TEST_P(CrossStreamFree, AStreamDestroyedWithoutReleaseDoesNotBreakThePool) {
  any_pool holder = make_pool(sim, GetParam());
  pool_base& pool = holder.get();
  const stream_handle kept = make_stream();
  auto gone = sim.stream_create(0);
  ASSERT_TRUE(gone.ok());
  void* p = pool.allocate(6 * MiB, default_alignment, kept);
  void* q = pool.allocate(4096, default_alignment, kept);
  pool.deallocate(p, 6 * MiB, gone.value());
  pool.deallocate(q, 4096, gone.value());
  ASSERT_TRUE(sim.stream_destroy(gone.value()).ok());
  const std::size_t reserved = pool.stats().reserved_bytes;
  void* r = nullptr;
  ASSERT_NO_THROW(r = pool.allocate(6 * MiB, default_alignment, kept));
  EXPECT_EQ(pool.stats().reserved_bytes, reserved) << "the destroyed stream's block was reused";
  pool.deallocate(r, 6 * MiB, kept);
  EXPECT_NO_THROW(pool.release_stream(gone.value()));
  EXPECT_NO_THROW(pool.trim());
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

INSTANTIATE_TEST_SUITE_P(BothPools, CrossStreamFree, ::testing::Values(kind::caching, kind::paged),
                         [](const auto& info) {
                           return info.param == kind::caching ? std::string("caching_pool")
                                                              : std::string("vmm_page_pool");
                         });

}  // namespace
