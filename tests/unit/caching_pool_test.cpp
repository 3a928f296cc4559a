// caching_pool over a runtime_resource (cudaMalloc) on a sim device: reuse without driver
// calls, data integrity, stream-ordered reuse, the out-of-memory sequence, reserve and
// release policies, bad input, stats, GPUMEM_CONF parsing and thread safety.
#include "gpumem/pool/caching_pool.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gpumem/backend/backends.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/pool_options.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::fill;
using gpumem_test::GiB;
using gpumem_test::holds;
using gpumem_test::KiB;
using gpumem_test::MiB;
using gpumem_test::overlaps;

// The upstream outlives the pool (members are destroyed in reverse order).
struct runtime_caching_pool {
  runtime_resource upstream;
  caching_pool pool;
  explicit runtime_caching_pool(platform& p, pool_options o = {}) : upstream(p), pool(upstream, o) {}
};

class CachingPool : public gpumem_test::sim_pool_test {};

// With a minimum segment size, requests a little over 2 MiB share segments: 15 of them fit
// one 32 MiB segment (one upstream call), where each would otherwise take a 4 MiB one.
TEST_F(CachingPool, MinimumSegmentSizeLetsRequestsJustOverTwoMiBShareSegments) {
  const std::size_t request = 2 * MiB + 512;
  runtime_resource upstream(sim);
  caching_pool shared(upstream, {}, 32 * MiB);
  std::vector<void*> blocks;
  for (int i = 0; i < 15; ++i) blocks.push_back(shared.allocate(request));
  EXPECT_EQ(shared.segment_count(), 1u);
  EXPECT_EQ(shared.stats().reserved_bytes, 32 * MiB);
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::size_t j = i + 1; j < blocks.size(); ++j) EXPECT_FALSE(overlaps(blocks[i], request, blocks[j], request));
  blocks.push_back(shared.allocate(request));  // the 16th needs a second segment
  EXPECT_EQ(shared.segment_count(), 2u);
  for (void* b : blocks) shared.deallocate(b, request);
  EXPECT_EQ(shared.validate(), "");

  runtime_resource upstream2(sim);
  caching_pool own(upstream2);
  std::vector<void*> apart;
  for (int i = 0; i < 15; ++i) apart.push_back(own.allocate(request));
  EXPECT_EQ(own.segment_count(), 15u);
  EXPECT_EQ(own.stats().reserved_bytes, 15 * 4 * MiB);
  for (void* b : apart) own.deallocate(b, request);
}

TEST_F(CachingPool, ReusesAFreedBlockWithoutDriverCalls) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;

  void* small = pool.allocate(64 * KiB);
  void* large = pool.allocate(8 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_malloc), 2u);  // one small segment, one large
  pool.deallocate(small, 64 * KiB);
  pool.deallocate(large, 8 * MiB);

  const auto mallocs = calls(platform_op::runtime_malloc);
  const auto frees = calls(platform_op::runtime_free);
  EXPECT_EQ(pool.allocate(64 * KiB), small);
  EXPECT_EQ(pool.allocate(8 * MiB), large);
  // A smaller request is carved out of the cached segment, not from the driver.
  void* part = pool.allocate(6 * MiB);
  void* other_small = pool.allocate(100 * KiB);
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs + 1);  // only the 6 MiB one grows
  EXPECT_EQ(calls(platform_op::runtime_free), frees);
  EXPECT_FALSE(overlaps(other_small, 100 * KiB, small, 64 * KiB));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();

  pool.deallocate(part, 6 * MiB);
  pool.deallocate(other_small, 100 * KiB);
  pool.deallocate(small, 64 * KiB);
  pool.deallocate(large, 8 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(CachingPool, SmallRequestsShareOneTwoMiBSegment) {
  runtime_caching_pool env(sim);
  std::vector<void*> blocks;
  for (int i = 0; i < 32; ++i) blocks.push_back(env.pool.allocate(64 * KiB));
  EXPECT_EQ(calls(platform_op::runtime_malloc), 1u);
  EXPECT_EQ(env.pool.segment_count(), 1u);
  EXPECT_EQ(env.pool.stats().reserved_bytes, 2 * MiB);
  for (std::size_t i = 0; i < blocks.size(); ++i)
    for (std::size_t j = i + 1; j < blocks.size(); ++j)
      ASSERT_FALSE(overlaps(blocks[i], 64 * KiB, blocks[j], 64 * KiB));
  // The 33rd does not fit: a second segment.
  void* extra = env.pool.allocate(64 * KiB);
  EXPECT_EQ(calls(platform_op::runtime_malloc), 2u);
  env.pool.deallocate(extra, 64 * KiB);
  for (void* b : blocks) env.pool.deallocate(b, 64 * KiB);
  EXPECT_TRUE(env.pool.is_valid()) << env.pool.validate();
}

TEST_F(CachingPool, BytesSurviveWhileTheBlockLives) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  struct blk {
    void* p;
    std::size_t n;
    unsigned char byte;
  };
  std::vector<blk> blocks;
  const std::size_t sizes[] = {1, 511, 4 * KiB, 300 * KiB, MiB, 3 * MiB + 7, 10 * MiB};
  unsigned char next = 1;
  for (int round = 0; round < 3; ++round)
    for (std::size_t n : sizes) {
      void* p = pool.allocate(n);
      fill(p, n, next);
      blocks.push_back({p, n, next++});
    }
  // Free every other block, allocate (and scribble over) new ones, then check the rest.
  std::vector<blk> kept;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 0) {
      ASSERT_TRUE(holds(blocks[i].p, blocks[i].n, blocks[i].byte));
      pool.deallocate(blocks[i].p, blocks[i].n);
    } else {
      kept.push_back(blocks[i]);
    }
  }
  std::vector<blk> fresh;
  for (std::size_t n : sizes) {
    void* p = pool.allocate(n);
    fill(p, n, 0xEE);
    fresh.push_back({p, n, 0xEE});
  }
  // Through the platform's copy too: host -> device -> host.
  std::vector<unsigned char> src(256 * KiB, 0x5A), back(256 * KiB, 0);
  void* dev = pool.allocate(src.size());
  ASSERT_TRUE(sim.memcpy_async(dev, src.data(), src.size(), {}).ok());
  ASSERT_TRUE(sim.memcpy_async(back.data(), dev, back.size(), {}).ok());
  EXPECT_EQ(back, src);

  for (const blk& b : kept) EXPECT_TRUE(holds(b.p, b.n, b.byte)) << "block of " << b.n << " bytes";
  for (const blk& b : fresh) EXPECT_TRUE(holds(b.p, b.n, b.byte));
  for (const blk& b : kept) pool.deallocate(b.p, b.n);
  for (const blk& b : fresh) pool.deallocate(b.p, b.n);
  pool.deallocate(dev, src.size());
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// --- stream-ordered reuse ------------------------------------------------------------------

TEST_F(CachingPool, AnotherStreamWaitsForTheFreeingStreamsEvent) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  sim.hold_events(true);

  void* p = pool.allocate(4 * MiB, default_alignment, s1);
  pool.deallocate(p, 4 * MiB, s1);
  void* again = pool.allocate(4 * MiB, default_alignment, s1);
  EXPECT_EQ(again, p) << "the freeing stream reuses its block at once";
  pool.deallocate(again, 4 * MiB, s1);

  void* other = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_NE(other, p);
  EXPECT_FALSE(overlaps(other, 4 * MiB, p, 4 * MiB))
      << "s2 got memory whose last use on s1 is not known complete";
  EXPECT_GE(calls(platform_op::event_record), 1u);

  sim.complete_events();
  void* later = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_EQ(later, p) << "once the event completed, s2 reuses the block instead of growing";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(other, 4 * MiB, s2);
  pool.deallocate(later, 4 * MiB, s2);
  sim.hold_events(false);
}

// A piece a small miss moves into the small arena (pool_base::move_free_piece) keeps the
// stream and the free epoch of the large block it came from: its stream reuses it at once,
// another stream only once that block's last use is known complete.
TEST_F(CachingPool, APieceKeepsTheFreeingStreamsOrder) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  sim.hold_events(true);
  void* big = pool.allocate(8 * MiB, default_alignment, s1);
  pool.deallocate(big, 8 * MiB, s1);
  void* mine = pool.allocate(64 * KiB, default_alignment, s1);
  EXPECT_TRUE(overlaps(mine, 64 * KiB, big, 8 * MiB)) << "s1 reuses its own free memory at once";
  void* theirs = pool.allocate(64 * KiB, default_alignment, s2);
  EXPECT_FALSE(overlaps(theirs, 64 * KiB, big, 8 * MiB))
      << "s2 got memory whose last use on s1 is not known complete";
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(theirs, 64 * KiB, s2);
  pool.deallocate(mine, 64 * KiB, s1);
  sim.hold_events(false);
}

// With no room to grow, another stream's request waits for the stream holding the free
// block (it is synchronized, as the out-of-memory retry does) and then gets that block,
// instead of running out of memory with free memory in the pool.
TEST_F(CachingPool, WithNoRoomToGrowAnotherStreamWaitsForTheHeldBlock) {
  pool_options o;
  o.limit_bytes = 8 * MiB;  // one 8 MiB segment, and no more
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  void* whole = pool.allocate(8 * MiB, default_alignment, s1);
  pool.deallocate(whole, 8 * MiB, s1);
  void* a = pool.allocate(4 * MiB, default_alignment, s1);
  void* b = pool.allocate(4 * MiB, default_alignment, s1);  // the segment is full
  EXPECT_EQ(pool.segment_count(), 1u);
  EXPECT_TRUE(overlaps(a, 4 * MiB, whole, 8 * MiB));
  EXPECT_TRUE(overlaps(b, 4 * MiB, whole, 8 * MiB));

  sim.hold_events(true);
  pool.deallocate(a, 4 * MiB, s1);
  const auto syncs = calls(platform_op::stream_synchronize);
  void* other = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_EQ(other, a) << "s2 waited for s1's work and reused its free block";
  EXPECT_GT(calls(platform_op::stream_synchronize), syncs) << "the block was handed over only after s1 was synchronized";
  EXPECT_EQ(pool.stats().oom_count, 0u);
  EXPECT_EQ(pool.stats().alloc_retries, 1u);
  EXPECT_EQ(pool.segment_count(), 1u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(other, 4 * MiB, s2);
  pool.deallocate(b, 4 * MiB, s1);
  sim.hold_events(false);
}

TEST_F(CachingPool, WaitPolicyReusesAnotherStreamsBlockAtOnce) {
  pool_options o;
  o.cross_stream = cross_stream_policy::wait;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  sim.hold_events(true);
  void* p = pool.allocate(4 * MiB, default_alignment, s1);
  pool.deallocate(p, 4 * MiB, s1);
  const auto waits = calls(platform_op::stream_wait_event);
  const auto mallocs = calls(platform_op::runtime_malloc);
  void* q = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_EQ(q, p);
  EXPECT_GT(calls(platform_op::stream_wait_event), waits) << "s2 must be made to wait on s1";
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs);
  pool.deallocate(q, 4 * MiB, s2);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  sim.hold_events(false);
}

// wait_before_growth: a block freed on s1 whose last use may still run is not taken by s2
// while s2 fits elsewhere (event semantics); where s2 would grow the pool instead, s2 is
// made to wait on s1's free and reuses the block, with no new segment.
TEST_F(CachingPool, WaitBeforeGrowthReusesAnotherStreamsBlockRatherThanGrowing) {
  pool_options o;
  o.cross_stream = cross_stream_policy::wait_before_growth;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  void* p = pool.allocate(4 * MiB, default_alignment, s1);
  void* own = pool.allocate(4 * MiB, default_alignment, s2);
  pool.deallocate(own, 4 * MiB, s2);
  sim.hold_events(true);
  pool.deallocate(p, 4 * MiB, s1);
  const auto waits = calls(platform_op::stream_wait_event);
  const auto mallocs = calls(platform_op::runtime_malloc);
  void* q = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_EQ(q, own) << "s2's own free block first";
  EXPECT_EQ(calls(platform_op::stream_wait_event), waits) << "no wait while s2 fits elsewhere";
  void* r = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_EQ(r, p) << "s1's block, instead of a new segment";
  EXPECT_GT(calls(platform_op::stream_wait_event), waits) << "s2 must be made to wait on s1";
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs);
  EXPECT_EQ(pool.segment_count(), 2u);
  pool.deallocate(q, 4 * MiB, s2);
  pool.deallocate(r, 4 * MiB, s2);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  sim.hold_events(false);

  pool_options e;  // the same under event: s2 grows the pool
  runtime_caching_pool env2(sim, e);
  const stream_handle t1 = make_stream(), t2 = make_stream();
  sim.hold_events(true);
  void* x = env2.pool.allocate(4 * MiB, default_alignment, t1);
  env2.pool.deallocate(x, 4 * MiB, t1);
  void* y = env2.pool.allocate(4 * MiB, default_alignment, t2);
  EXPECT_NE(y, x);
  EXPECT_EQ(env2.pool.segment_count(), 2u);
  env2.pool.deallocate(y, 4 * MiB, t2);
  sim.hold_events(false);
}

// Regression; the defect was: block_arena::take() gives the tail split off a freed block free_epoch 0, so the rest
// of a block freed on s1 (still in use by s1's queued work) counts as complete for s2.
TEST_F(CachingPool, TheRestOfASplitFreedBlockIsNotHandedToAnotherStreamEarly) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  sim.hold_events(true);
  void* x = pool.allocate(8 * MiB, default_alignment, s1);
  pool.deallocate(x, 8 * MiB, s1);  // s1's work on x may still be running
  void* y = pool.allocate(2 * MiB, default_alignment, s1);  // s1 reuses the front of x
  EXPECT_EQ(y, x);
  void* z = pool.allocate(4 * MiB, default_alignment, s2);
  EXPECT_FALSE(overlaps(z, 4 * MiB, x, 8 * MiB))
      << "s2 was handed part of a block freed on s1 before s1's free was known complete";
  pool.deallocate(z, 4 * MiB, s2);
  pool.deallocate(y, 2 * MiB, s1);
  sim.hold_events(false);
}

// --- out of memory, trim, reserve, release threshold -----------------------------------------

TEST_F(CachingPool, OutOfMemorySequenceAtTheLimitThenRecoveryAndTrim) {
  pool_options o;
  o.limit_bytes = 64 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  std::vector<void*> blocks;
  std::string report;
  for (int i = 0; i < 100; ++i) {
    try {
      blocks.push_back(pool.allocate(8 * MiB));
    } catch (const out_of_memory& e) {
      report = e.what();
      break;
    }
  }
  ASSERT_EQ(blocks.size(), 8u) << "64 MiB limit / 8 MiB blocks";
  EXPECT_NE(report.find("8.00 MiB"), std::string::npos) << report;
  EXPECT_NE(report.find("8388608"), std::string::npos) << report;
  EXPECT_NE(report.find("requested"), std::string::npos) << report;
  EXPECT_NE(report.find("live"), std::string::npos) << report;
  EXPECT_NE(report.find("reserved"), std::string::npos) << report;
  EXPECT_NE(report.find("largest free block"), std::string::npos) << report;
  EXPECT_NE(report.find("total"), std::string::npos) << report;
  EXPECT_NE(report.find("free"), std::string::npos) << report;
  EXPECT_NE(report.find("limit"), std::string::npos) << report;
  EXPECT_NE(report.find("caching_pool"), std::string::npos) << report;

  resource_stats s = pool.stats();
  EXPECT_EQ(s.oom_count, 1u);
  EXPECT_EQ(s.live_bytes, 64 * MiB);
  EXPECT_EQ(s.allocations, 8u);
  EXPECT_EQ(s.reserved_bytes, 64 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();

  for (void* b : blocks) pool.deallocate(b, 8 * MiB);
  void* again = pool.allocate(8 * MiB);
  EXPECT_NE(again, nullptr);
  pool.deallocate(again, 8 * MiB);

  const std::size_t released = pool.trim();
  EXPECT_EQ(released, 64 * MiB);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(pool.segment_count(), 0u);
  EXPECT_EQ(sim.live_objects().device_allocations, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(CachingPool, DeviceExhaustionGivesCachedMemoryBackAndRetries) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  void* a = pool.allocate(600 * MiB);
  pool.deallocate(a, 600 * MiB);  // cached
  // 600 cached + 700 new > 1 GiB: the pool must give the cached segment back first.
  void* b = pool.allocate(700 * MiB);
  EXPECT_NE(b, nullptr);
  resource_stats s = pool.stats();
  EXPECT_EQ(s.alloc_retries, 1u);
  EXPECT_EQ(s.reserved_bytes, 700 * MiB);
  EXPECT_EQ(s.oom_count, 0u);
  // Nothing cached left to give: the device is out.
  EXPECT_THROW(pool.allocate(400 * MiB), out_of_memory);
  EXPECT_EQ(pool.stats().oom_count, 1u);
  EXPECT_EQ(pool.stats().live_bytes, 700 * MiB);
  pool.deallocate(b, 700 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(CachingPool, ReserveUpFrontServesTheFirstLargeAllocations) {
  pool_options o;
  o.reserve_bytes = 32 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  EXPECT_GE(pool.stats().reserved_bytes, 32 * MiB);
  const auto mallocs = calls(platform_op::runtime_malloc);
  void* a = pool.allocate(8 * MiB);
  void* b = pool.allocate(16 * MiB);
  void* c = pool.allocate(4 * MiB + 5);
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs);
  EXPECT_EQ(pool.stats().reserved_bytes, 32 * MiB);
  pool.deallocate(a, 8 * MiB);
  pool.deallocate(b, 16 * MiB);
  pool.deallocate(c, 4 * MiB + 5);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// Regression; the defect was: the reserve is a free block of the default stream, and pool_base::allocate_slow only
// looks at other streams' blocks once some stream has freed something (streams_ is empty
// until the first deallocate). So allocations on any other stream grow new segments beside
// the idle reserve — and with a limit, the reserve is given back to make room.
TEST_F(CachingPool, ReserveUpFrontServesAllocationsOnAnyStream) {
  pool_options o;
  o.reserve_bytes = 32 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream();
  const auto mallocs = calls(platform_op::runtime_malloc);
  void* a = pool.allocate(8 * MiB, default_alignment, s1);
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs)
      << "an 8 MiB request on a stream took a new cudaMalloc segment beside a free 32 MiB reserve";
  EXPECT_EQ(pool.stats().reserved_bytes, 32 * MiB);
  pool.deallocate(a, 8 * MiB, s1);
}

TEST_F(CachingPool, AFreshSegmentsFreeTailServesAnotherStream) {
  // Same cause: s1's new segment has a free tail that no work ever touched, but s2 cannot
  // use it until some stream has freed a block.
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  const stream_handle s1 = make_stream(), s2 = make_stream();
  void* a = pool.allocate(64 * KiB, default_alignment, s1);  // 2 MiB segment, mostly free
  const auto mallocs = calls(platform_op::runtime_malloc);
  void* b = pool.allocate(64 * KiB, default_alignment, s2);
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs)
      << "s2 took a second 2 MiB segment beside s1's untouched free tail";
  pool.deallocate(b, 64 * KiB, s2);
  pool.deallocate(a, 64 * KiB, s1);
}

// Regression; the defect was: the up-front reserve goes into the large-block arena only, so small
// requests (<= small_threshold, 1 MiB) grow new 2 MiB segments beside an idle reserve.
TEST_F(CachingPool, ReserveUpFrontServesSmallAllocationsToo) {
  pool_options o;
  o.reserve_bytes = 32 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  const auto mallocs = calls(platform_op::runtime_malloc);
  void* a = pool.allocate(64 * KiB);
  EXPECT_EQ(calls(platform_op::runtime_malloc), mallocs)
      << "a 64 KiB request took a new cudaMalloc segment although 32 MiB were reserved";
  EXPECT_EQ(pool.stats().reserved_bytes, 32 * MiB);
  pool.deallocate(a, 64 * KiB);
}

// A small miss moves 2 MiB of the large arena's free space into the small arena
// (pool_base::move_free_piece), and the small requests after it are served there: before,
// each small miss took its block from the large arena itself, and the thread caches gave
// those blocks back on every small miss, a third of pool_bench's mixed requests.
TEST_F(CachingPool, ASmallMissMovesAPieceOfTheLargeFreeSpaceThatServesTheNextSmallRequests) {
  pool_options o;
  o.reserve_bytes = 32 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  auto total = [](const pool_base::arena_bytes& a) { return a.allocated + a.cached + a.free; };
  std::vector<void*> small;
  small.push_back(pool.allocate(64 * KiB));
  EXPECT_EQ(total(pool.bytes_in_arena(true)), 2 * MiB);
  EXPECT_EQ(total(pool.bytes_in_arena(false)), 30 * MiB);
  for (int i = 1; i < 16; ++i) small.push_back(pool.allocate(64 * KiB));  // 1 MiB in all
  EXPECT_EQ(total(pool.bytes_in_arena(true)), 2 * MiB) << "each small request moved a piece of its own";
  EXPECT_EQ(pool.bytes_in_arena(true).allocated, 1 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_malloc), 1u);  // the reserve only
  // Still one upstream segment, in the snapshot too: its pieces serve both arenas.
  const std::vector<memory_segment> segments = pool.memory_segments();
  ASSERT_EQ(segments.size(), 1u);
  EXPECT_EQ(segments[0].size, 32 * MiB);
  std::size_t tiled = 0;
  for (const memory_block& b : segments[0].blocks) tiled += b.size;
  EXPECT_EQ(tiled, 32 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (void* p : small) pool.deallocate(p, 64 * KiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// Before a large request grows the pool, the small arena's wholly free pieces go back to
// the large arena and merge with the rest of their segment.
TEST_F(CachingPool, ALargeRequestTakesBackAFreePieceBeforeGrowing) {
  pool_options o;
  o.reserve_bytes = 8 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  void* s = pool.allocate(64 * KiB);  // moves 2 MiB of the 8 into the small arena
  pool.deallocate(s, 64 * KiB);       // kept by this thread's cache
  void* whole = pool.allocate(8 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_malloc), 1u) << "the 8 MiB request grew a segment beside a free piece";
  EXPECT_EQ(pool.stats().reserved_bytes, 8 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(whole, 8 * MiB);
}

// A segment whose piece served small requests goes upstream whole once all is free.
TEST_F(CachingPool, TrimGivesBackAReserveWhosePieceServedSmallRequests) {
  pool_options o;
  o.reserve_bytes = 32 * MiB;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  void* s = pool.allocate(64 * KiB);
  void* l = pool.allocate(4 * MiB);
  pool.deallocate(s, 64 * KiB);
  pool.deallocate(l, 4 * MiB);
  EXPECT_EQ(pool.trim(), 32 * MiB);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(sim.live_objects().device_allocations, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(CachingPool, AReserveTheDeviceCannotHoldThrowsOutOfMemoryAndLeavesNothing) {
  pool_options o;
  o.reserve_bytes = 768 * MiB;
  runtime_caching_pool first(sim, o);
  EXPECT_EQ(first.pool.stats().reserved_bytes, 768 * MiB);
  o.reserve_bytes = 512 * MiB;
  try {
    runtime_caching_pool second(sim, o);
    ADD_FAILURE() << "a 512 MiB reserve fitted beside 768 MiB on a 1 GiB device";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("512.00 MiB"), std::string::npos) << e.what();
  }
  EXPECT_EQ(sim.live_objects().device_allocations, 1u);  // only the first pool's reserve
}

TEST_F(CachingPool, ReleaseThresholdZeroGivesEverythingBackWhenFreed) {
  pool_options o;
  o.release_threshold = 0;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t n : {64 * KiB, 8 * MiB, 3 * MiB, 512 * KiB}) blocks.push_back({pool.allocate(n), n});
  EXPECT_GT(pool.stats().reserved_bytes, 0u);
  for (auto [p, n] : blocks) pool.deallocate(p, n);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 2 * MiB + 8 * MiB + 4 * MiB);
  EXPECT_EQ(sim.live_objects().device_allocations, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(CachingPool, DefaultReleaseThresholdKeepsFreedMemoryCached) {
  runtime_caching_pool env(sim);
  void* p = env.pool.allocate(8 * MiB);
  env.pool.deallocate(p, 8 * MiB);
  EXPECT_EQ(env.pool.stats().reserved_bytes, 8 * MiB);
  EXPECT_EQ(env.pool.stats().cached_bytes, 8 * MiB);
  EXPECT_EQ(sim.live_objects().device_allocations, 1u);
}

// --- bad input -------------------------------------------------------------------------------

TEST_F(CachingPool, BadInputIsRefusedAndThePoolStaysUsable) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  void* p = pool.allocate(1000);
  void* big = pool.allocate(4 * MiB);
  const resource_stats before = pool.stats();

  EXPECT_THROW(pool.allocate(0), gpumem::invalid_argument);
  EXPECT_THROW(pool.allocate(2 * GiB), gpumem::invalid_argument);          // beyond the device
  EXPECT_THROW(pool.allocate(64, 3), gpumem::invalid_argument);            // not a power of two
  EXPECT_THROW(pool.allocate(64, 4096), gpumem::invalid_argument);         // above cudaMalloc's 256
  int on_stack = 0;
  EXPECT_THROW(pool.deallocate(&on_stack, 4), gpumem::invalid_argument);   // unknown
  EXPECT_THROW(pool.deallocate(static_cast<char*>(big) + 512, 512), gpumem::invalid_argument);  // interior
  EXPECT_THROW(pool.deallocate(p, 999), gpumem::invalid_argument);         // size mismatch
  EXPECT_THROW(pool.deallocate(big, 1000), gpumem::invalid_argument);      // mismatch across arenas
  try {
    pool.deallocate(p, 2000);
    ADD_FAILURE() << "size mismatch accepted";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("size mismatch"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1000"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  const resource_stats after = pool.stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.allocations, before.allocations);
  EXPECT_EQ(after.deallocations, before.deallocations);

  pool.deallocate(p, 1000);
  try {
    pool.deallocate(p, 1000);
    ADD_FAILURE() << "double free accepted";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("double free"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  // Still usable: the freed block comes back, the big one is freed normally.
  void* q = pool.allocate(1000);
  EXPECT_EQ(q, p);
  pool.deallocate(q, 1000);
  pool.deallocate(big, 4 * MiB);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(CachingPool, AFreeOnTheWrongPoolIsRefused) {
  runtime_caching_pool a(sim), b(sim);
  void* p = a.pool.allocate(4096);
  EXPECT_THROW(b.pool.deallocate(p, 4096), gpumem::invalid_argument);
  EXPECT_THROW(a.upstream.deallocate(p, 4096), gpumem::invalid_argument);  // pool's block, not upstream's
  EXPECT_TRUE(a.pool.is_valid());
  EXPECT_TRUE(b.pool.is_valid());
  a.pool.deallocate(p, 4096);
}

// --- stats -----------------------------------------------------------------------------------

TEST_F(CachingPool, StatsAreConsistent) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  resource_stats s = pool.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.fragmentation(), 0.0);

  void* a = pool.allocate(1000);
  void* b = pool.allocate(3 * MiB);
  void* c = pool.allocate(100 * KiB);
  s = pool.stats();
  EXPECT_EQ(s.live_bytes, 1000 + 3 * MiB + 100 * KiB);
  EXPECT_EQ(s.peak_live_bytes, s.live_bytes);
  EXPECT_EQ(s.live_allocations, 3u);
  EXPECT_EQ(s.allocations, 3u);
  EXPECT_EQ(s.deallocations, 0u);
  EXPECT_EQ(s.reserved_bytes, 2 * MiB + 4 * MiB);  // one small segment, one rounded large one
  EXPECT_EQ(s.peak_reserved_bytes, s.reserved_bytes);
  // cached = reserved - handed out (rounded block sizes: 100 KiB's class is 112 KiB)
  EXPECT_EQ(s.cached_bytes, s.reserved_bytes - 1024 - 3 * MiB - 112 * KiB);
  EXPECT_DOUBLE_EQ(s.fragmentation(),
                   static_cast<double>(s.peak_reserved_bytes) / static_cast<double>(s.peak_live_bytes));
  EXPECT_GE(s.fragmentation(), 1.0);
  EXPECT_EQ(pool.largest_free_block(), 2 * MiB - 1024 - 112 * KiB);  // small segment tail
  auto biggest = pool.biggest_live(2);
  ASSERT_EQ(biggest.size(), 2u);
  EXPECT_EQ(biggest[0].address, reinterpret_cast<std::uintptr_t>(b));
  EXPECT_EQ(biggest[0].requested, 3 * MiB);
  EXPECT_EQ(biggest[1].requested, 100 * KiB);

  pool.deallocate(b, 3 * MiB);
  s = pool.stats();
  EXPECT_EQ(s.live_bytes, 1000 + 100 * KiB);
  EXPECT_EQ(s.peak_live_bytes, 1000 + 3 * MiB + 100 * KiB);
  EXPECT_EQ(s.live_allocations, 2u);
  EXPECT_EQ(s.deallocations, 1u);
  EXPECT_EQ(s.reserved_bytes, 6 * MiB);
  pool.deallocate(a, 1000);
  pool.deallocate(c, 100 * KiB);
  s = pool.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.cached_bytes, s.reserved_bytes);
  EXPECT_EQ(s.allocations, 3u);
  EXPECT_EQ(s.deallocations, 3u);
  // The upstream saw only the segments.
  EXPECT_EQ(env.upstream.stats().live_allocations, 2u);
  EXPECT_EQ(env.upstream.stats().live_bytes, 6 * MiB);
  // The report describes the pool when asked.
  const std::string report = pool.memory_report(MiB);
  EXPECT_NE(report.find("segments"), std::string::npos) << report;
}

TEST_F(CachingPool, DestroyingThePoolWithLiveBlocksGivesEverythingBack) {
  {
    runtime_caching_pool env(sim);
    (void)env.pool.allocate(4 * MiB);
    (void)env.pool.allocate(64 * KiB);
    EXPECT_EQ(sim.live_objects().device_allocations, 2u);
  }
  EXPECT_EQ(sim.live_objects().device_allocations, 0u);
}

TEST_F(CachingPool, OverTheVmmBackendHonoursLargeAlignments) {
  vmm_resource upstream(sim);
  {
    caching_pool pool(upstream);
    EXPECT_EQ(pool.max_alignment(), upstream.max_alignment());
    void* a = pool.allocate(100, 256);
    void* b = pool.allocate(3 * MiB, 4 * MiB);
    void* c = pool.allocate(4 * KiB, 64 * KiB);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b) % (4 * MiB), 0u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(c) % (64 * KiB), 0u);
    fill(b, 3 * MiB, 0x3C);
    fill(c, 4 * KiB, 0x4D);
    EXPECT_TRUE(holds(b, 3 * MiB, 0x3C));
    EXPECT_TRUE(holds(c, 4 * KiB, 0x4D));
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    pool.deallocate(a, 100);
    pool.deallocate(b, 3 * MiB);
    pool.deallocate(c, 4 * KiB);
    EXPECT_GT(pool.trim(), 0u);
    EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  }
  EXPECT_EQ(upstream.stats().live_allocations, 0u);
}

// --- threads -------------------------------------------------------------------------------

TEST_F(CachingPool, ConcurrentThreadsNeverShareABlock) {
  runtime_caching_pool env(sim);
  const int corrupted = gpumem_test::run_pool_stress(env.pool, 4, 5000, 64 * KiB, 3 * MiB);
  EXPECT_EQ(corrupted, 0);
  const resource_stats s = env.pool.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.live_allocations, 0u);
  EXPECT_EQ(s.allocations, s.deallocations);
  EXPECT_GE(s.allocations, 4u * 2000);
  EXPECT_TRUE(env.pool.is_valid()) << env.pool.validate();
}

// --- GPUMEM_CONF -----------------------------------------------------------------------------

TEST(PoolOptions, ParsesEveryKey) {
  const pool_options o =
      pool_options::parse("reserve:1G,limit:2G,release_threshold:never,cross_stream:wait");
  EXPECT_EQ(o.reserve_bytes, GiB);
  EXPECT_EQ(o.limit_bytes, 2 * GiB);
  EXPECT_EQ(o.release_threshold, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(o.cross_stream, cross_stream_policy::wait);

  const pool_options p = pool_options::parse(
      " reserve_fraction:0.25 , release_threshold:512M,small_threshold:64k,cross_stream:event,"
      "va_reserve:1T,limit:1.5G,");
  EXPECT_DOUBLE_EQ(p.reserve_fraction, 0.25);
  EXPECT_EQ(p.release_threshold, 512 * MiB);
  EXPECT_EQ(p.small_threshold, 64 * KiB);
  EXPECT_EQ(p.cross_stream, cross_stream_policy::event);
  EXPECT_EQ(p.va_reserve_bytes, 1024 * GiB);
  EXPECT_EQ(p.limit_bytes, 3 * GiB / 2);

  const pool_options d = pool_options::parse("");
  EXPECT_EQ(d.reserve_bytes, 0u);
  EXPECT_EQ(d.limit_bytes, 0u);
  EXPECT_EQ(d.release_threshold, std::numeric_limits<std::size_t>::max());
  EXPECT_EQ(d.small_threshold, MiB);
  EXPECT_EQ(d.cross_stream, cross_stream_policy::event);
}

TEST(PoolOptions, RoundTripsThroughToString) {
  pool_options o;
  o.reserve_bytes = 3 * MiB;
  o.limit_bytes = 7 * GiB;
  o.release_threshold = 12345;
  o.small_threshold = 2 * MiB;
  o.cross_stream = cross_stream_policy::wait;
  o.va_reserve_bytes = 64 * GiB;
  const pool_options r = pool_options::parse(o.to_string());
  EXPECT_EQ(r.reserve_bytes, o.reserve_bytes);
  EXPECT_EQ(r.limit_bytes, o.limit_bytes);
  EXPECT_EQ(r.release_threshold, o.release_threshold);
  EXPECT_EQ(r.small_threshold, o.small_threshold);
  EXPECT_EQ(r.cross_stream, o.cross_stream);
  EXPECT_EQ(r.va_reserve_bytes, o.va_reserve_bytes);
  EXPECT_EQ(pool_options::parse(pool_options{}.to_string()).release_threshold,
            std::numeric_limits<std::size_t>::max());
}

TEST(PoolOptions, MalformedTextIsRefusedWithTheOffendingPart) {
  struct bad {
    const char* text;
    const char* named;
  };
  for (const bad& b : {bad{"reserve", "reserve"}, bad{"bogus:1", "bogus"}, bad{"limit:abc", "abc"},
                       bad{"cross_stream:maybe", "maybe"}, bad{"limit:", "''"},
                       bad{"limit:-1G", "-1"}, bad{"reserve:1Q", "1Q"}, bad{"limit:nan", "nan"},
                       bad{"reserve_fraction:1.5", "reserve_fraction"},
                       bad{"release_threshold:sometimes", "sometimes"},
                       bad{"limit:1e30", "1e30"}}) {
    try {
      (void)pool_options::parse(b.text);
      ADD_FAILURE() << "'" << b.text << "' was accepted";
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(b.named), std::string::npos)
          << "'" << b.text << "': " << e.what();
    }
  }
}

// A malformed value should say which key it belongs to: "config: value '1X' of 'size'"
// leaves the user to guess which of reserve/limit/... in a long GPUMEM_CONF is wrong.
TEST(PoolOptions, MalformedValuesNameTheirKey) {
  for (const char* text : {"limit:abc", "reserve:1X", "release_threshold:lots", "va_reserve:-5",
                           "small_threshold:"}) {
    const std::string key = std::string(text).substr(0, std::string(text).find(':'));
    try {
      (void)pool_options::parse(std::string("reserve:1G,") + text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos)
          << "'" << text << "': " << e.what();
    }
  }
}

TEST(PoolOptions, ParseBytesSuffixes) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("2k"), 2 * KiB);
  EXPECT_EQ(parse_bytes("512M"), 512 * MiB);
  EXPECT_EQ(parse_bytes("1.5G"), 3 * GiB / 2);
  EXPECT_EQ(parse_bytes("2T"), 2048 * GiB);
  EXPECT_EQ(parse_bytes(" 8M "), 8 * MiB);
  EXPECT_THROW(parse_bytes(""), gpumem::invalid_argument);
  EXPECT_THROW(parse_bytes("M"), gpumem::invalid_argument);
  EXPECT_THROW(parse_bytes("12 MB"), gpumem::invalid_argument);
}

TEST(PoolOptions, ReadsGpumemConfFromTheEnvironment) {
  const char* old = std::getenv("GPUMEM_CONF");
  const std::string saved = old != nullptr ? old : "";
  ::setenv("GPUMEM_CONF", "limit:3G,cross_stream:wait", 1);
  const pool_options o = pool_options::from_environment();
  EXPECT_EQ(o.limit_bytes, 3 * GiB);
  EXPECT_EQ(o.cross_stream, cross_stream_policy::wait);
  ::setenv("GPUMEM_CONF", "limit:3X", 1);
  EXPECT_THROW(pool_options::from_environment(), gpumem::invalid_argument);
  ::unsetenv("GPUMEM_CONF");
  EXPECT_EQ(pool_options::from_environment().limit_bytes, 0u);
  if (old != nullptr) ::setenv("GPUMEM_CONF", saved.c_str(), 1);
}


// release_idle:on: a segment that would raise the reserved peak is made only after wholly
// idle segments are freed: the smallest that is enough, else the largest until enough.
TEST_F(CachingPool, ReleaseIdleFreesIdleSegmentsBeforeANewPeak) {
  EXPECT_TRUE(pool_options::parse("release_idle:on").release_idle);
  EXPECT_FALSE(pool_options{}.release_idle);
  EXPECT_NE(pool_options::parse("release_idle:on").to_string().find("release_idle:on"),
            std::string::npos);
  EXPECT_THROW(pool_options::parse("release_idle:sometimes"), invalid_argument);
  pool_options o;
  o.release_idle = true;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  void* a40 = pool.allocate(40 * MiB);
  void* a30 = pool.allocate(30 * MiB);
  void* a10 = pool.allocate(10 * MiB);
  void* a60 = pool.allocate(60 * MiB);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 140 * MiB);
  pool.deallocate(a40, 40 * MiB);
  pool.deallocate(a30, 30 * MiB);
  pool.deallocate(a10, 10 * MiB);
  // 46 MiB fits no idle segment; no single one covers the 46 MiB over the peak, so the
  // largest go until enough: 40 and 30; the 10 MiB one stays.
  auto frees = calls(platform_op::runtime_free);
  void* a46 = pool.allocate(46 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_free), frees + 2);
  EXPECT_EQ(pool.stats().reserved_bytes, (10 + 60 + 46) * MiB);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 140 * MiB) << "no new peak";
  EXPECT_EQ(pool.segment_count(), 3u);
  // 62 MiB over 116 reserved is 38 over the peak: the 60 MiB segment alone is enough (the
  // smallest that is), so the 10 MiB one stays again.
  pool.deallocate(a60, 60 * MiB);
  frees = calls(platform_op::runtime_free);
  void* a62 = pool.allocate(62 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_free), frees + 1);
  EXPECT_EQ(pool.stats().reserved_bytes, (10 + 46 + 62) * MiB);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 140 * MiB);
  // Under the peak, idle segments are kept: 2 MiB more is not over it.
  frees = calls(platform_op::runtime_free);
  void* a12 = pool.allocate(12 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_free), frees);
  EXPECT_EQ(pool.segment_count(), 4u);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (auto [p, n] : {std::pair{a46, 46 * MiB}, {a62, 62 * MiB}, {a12, 12 * MiB}}) pool.deallocate(p, n);
}

TEST_F(CachingPool, ReleaseIdleFreesTheSmallestIdleSegmentThatIsEnough) {
  pool_options o;
  o.release_idle = true;
  runtime_caching_pool env(sim, o);
  caching_pool& pool = env.pool;
  pool.deallocate(pool.allocate(120 * MiB), 120 * MiB);
  pool.trim();  // peak 120 MiB, nothing reserved
  void* a30 = pool.allocate(30 * MiB);
  void* a50 = pool.allocate(50 * MiB);
  pool.deallocate(a30, 30 * MiB);
  pool.deallocate(a50, 50 * MiB);
  // 52 MiB fits neither idle segment and goes 12 MiB over the peak: the 30 MiB one is
  // enough, so the 50 MiB one (which a largest-first release would take) stays.
  const auto frees = calls(platform_op::runtime_free);
  void* a52 = pool.allocate(52 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_free), frees + 1);
  EXPECT_EQ(pool.stats().reserved_bytes, (50 + 52) * MiB);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 120 * MiB);
  pool.deallocate(a52, 52 * MiB);
}

TEST_F(CachingPool, WithoutReleaseIdleIdleSegmentsStayAndThePeakRises) {
  runtime_caching_pool env(sim);
  caching_pool& pool = env.pool;
  void* a = pool.allocate(40 * MiB);
  pool.deallocate(a, 40 * MiB);
  const auto frees = calls(platform_op::runtime_free);
  void* b = pool.allocate(46 * MiB);
  EXPECT_EQ(calls(platform_op::runtime_free), frees);
  EXPECT_EQ(pool.stats().peak_reserved_bytes, 86 * MiB);
  pool.deallocate(b, 46 * MiB);
}

}  // namespace
