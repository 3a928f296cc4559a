// Tags, sleep / wake and shared memory on a sim device: tags never share a page; sleep
// releases every page of a tag (the device's used bytes fall by them, the addresses fault)
// and wake restores the bytes at the same addresses; the refusals; a failure injected into
// each driver call sleep and wake make, at each position, leaves a valid pool and no lost
// byte, and the same call again completes; sharing's bad input (closed, foreign fd, size,
// another device) and its lifetime (the exporter frees first).
#include "gpumem/pool/vmm/tagged_pool.hpp"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <thread>
#include <cstring>
#include <memory>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/pool/caching_pool.hpp"
#include "gpumem/backend/backends.hpp"
#include "unit/pool_test_support.hpp"

namespace {

using namespace gpumem;
using gpumem_test::MiB;

unsigned char byte_at(std::size_t i, unsigned seed) {
  return static_cast<unsigned char>((i * 131u + seed * 17u + (i >> 12)) & 0xffu);
}
void write_pattern(void* p, std::size_t n, unsigned seed) {
  auto* b = static_cast<unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) b[i] = byte_at(i, seed);
}
bool has_pattern(const void* p, std::size_t n, unsigned seed) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i)
    if (b[i] != byte_at(i, seed)) return false;
  return true;
}

class SleepWake : public gpumem_test::sim_pool_test {
 protected:
  struct allocation {
    void* p;
    std::size_t bytes;
    unsigned seed;
  };
  // Allocations of tag 1 in sizes that give one-page and multi-page blocks, shared pages,
  // and free pages between them (the tag's cache).
  std::vector<allocation> fill_tag(tagged_pool& pool, std::uint32_t tag) {
    std::vector<allocation> out;
    unsigned seed = 1;
    void* freed = nullptr;
    for (std::size_t bytes : {6 * MiB, 2 * MiB + 100, 300 * std::size_t{1024}, 20 * MiB, std::size_t{512}}) {
      out.push_back({pool.allocate(bytes, 256, {}, tag), bytes, seed++});
      if (bytes == 300 * std::size_t{1024}) freed = pool.allocate(8 * MiB, 256, {}, tag);
    }
    pool.deallocate(freed, 8 * MiB);
    for (auto& a : out) write_pattern(a.p, a.bytes, a.seed);
    return out;
  }
  void expect_patterns(const std::vector<allocation>& all) {
    for (auto& a : all) EXPECT_TRUE(has_pattern(a.p, a.bytes, a.seed)) << "allocation at " << a.p;
  }
  void free_all(tagged_pool& pool, std::vector<allocation>& all) {
    for (auto& a : all) pool.deallocate(a.p, a.bytes);
    all.clear();
  }
  // Tag 1 holding 6 MiB in use (pattern `seed`) and 20 MiB of cache, asleep with offload.
  static constexpr std::size_t in_use = 6 * MiB, cached = 20 * MiB;
  void* sleep_with_cache(tagged_pool& pool, unsigned seed) {
    void* state = pool.allocate(in_use, 256, {}, 1);
    write_pattern(state, in_use, seed);
    pool.deallocate(pool.allocate(cached, 256, {}, 1), cached);
    pool.sleep(1, sleep_mode::offload);
    return state;
  }
  // After a wake that had no room for the cache: the bytes in use only, restored; the pool
  // valid, and it grows on demand again.
  void expect_woken_without_cache(tagged_pool& pool, void* state, unsigned seed) {
    EXPECT_FALSE(pool.asleep(1));
    EXPECT_TRUE(has_pattern(state, in_use, seed));
    EXPECT_EQ(pool.tag_stats(1).reserved_bytes, in_use);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
  void expect_grows_again(tagged_pool& pool) {
    void* grown = pool.allocate(cached, 256, {}, 1);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    pool.deallocate(grown, cached);
  }
};

TEST_F(SleepWake, TagsNeverSharePagesAndScopedTagRoutes) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* a = pool.allocate(1000, 256, {}, 1);
  void* b = pool.allocate(1000, 256, {}, 2);
  void* c = nullptr;
  {
    scoped_tag t(2);
    c = pool.allocate(1000);
  }
  void* d = pool.allocate(1000);  // tag 0 again
  const auto page = [](void* p) { return reinterpret_cast<std::uintptr_t>(p) / (2 * MiB); };
  EXPECT_NE(page(a), page(b));
  EXPECT_EQ(pool.tag_of(a), 1u);
  EXPECT_EQ(pool.tag_of(b), 2u);
  EXPECT_EQ(pool.tag_of(c), 2u);
  EXPECT_EQ(pool.tag_of(d), 0u);
  EXPECT_TRUE(untagged.owns(d));
  EXPECT_EQ(pool.tag_stats(2).live_allocations, 2u);
  EXPECT_EQ(pool.tag_stats(1).live_bytes, 1000u);
  EXPECT_EQ(pool.stats().live_bytes, 4000u);
  for (void* p : {a, b, c, d}) pool.deallocate(p, 1000);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(SleepWake, OffloadReleasesEveryPageAndWakeRestoresBytesAtTheSameAddresses) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  auto tagged = fill_tag(pool, 1);
  void* other = pool.allocate(4 * MiB, 256, {}, 2);
  write_pattern(other, 4 * MiB, 77);
  const std::size_t reserved = pool.tag_stats(1).reserved_bytes;
  const std::size_t used = sim.used_bytes(0);
  ASSERT_GE(reserved, 28 * MiB);

  pool.sleep(1, sleep_mode::offload);
  EXPECT_TRUE(pool.asleep(1));
  EXPECT_EQ(sim.used_bytes(0), used - reserved);
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
  EXPECT_EQ(pool.tag_stats(1).live_bytes, 6 * MiB + 2 * MiB + 100 + 300 * 1024 + 20 * MiB + 512);
  EXPECT_TRUE(has_pattern(other, 4 * MiB, 77));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  EXPECT_TRUE(sim.is_valid()) << sim.validate();

  pool.wake(1);
  EXPECT_FALSE(pool.asleep(1));
  EXPECT_EQ(sim.used_bytes(0), used);
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, reserved);
  expect_patterns(tagged);
  // Usable as before: new allocations in the tag, and a second cycle.
  void* more = pool.allocate(3 * MiB, 256, {}, 1);
  pool.sleep(1, sleep_mode::offload);
  pool.wake(1);
  expect_patterns(tagged);
  pool.deallocate(more, 3 * MiB);
  free_all(pool, tagged);
  pool.deallocate(other, 4 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// Wake maps side-by-side released pages as one handle each up to a huge growth's handle
// size (32 pages here) in footprint:fast: 40 one-page chunks wake with 2 handles, one map
// and one access grant each, bytes intact at the same addresses; the merged handles go
// back whole once their pages are free. footprint:tight wakes one handle per chunk.
TEST_F(SleepWake, WakeMapsAdjacentPagesAsFewHandlesInFastMode) {
  for (footprint_mode mode : {footprint_mode::fast, footprint_mode::tight}) {
    SCOPED_TRACE(mode == footprint_mode::fast ? "fast" : "tight");
    pool_options o;
    o.footprint = mode;
    vmm_page_pool untagged(sim, 0, o);
    tagged_pool pool(untagged, o);
    std::vector<allocation> tagged;
    for (unsigned i = 0; i < 40; ++i) tagged.push_back({pool.allocate(2 * MiB, 256, {}, 1), 2 * MiB, i});
    for (auto& a : tagged) write_pattern(a.p, a.bytes, a.seed);
    const std::size_t reserved = pool.tag_stats(1).reserved_bytes;
    ASSERT_EQ(reserved, 80 * MiB);
    const std::size_t used = sim.used_bytes(0);

    for (sleep_mode sm : {sleep_mode::offload, sleep_mode::offload, sleep_mode::discard}) {
      pool.sleep(1, sm);
      const auto creates = calls(platform_op::create_physical);
      const auto maps = calls(platform_op::map);
      const auto grants = calls(platform_op::set_access);
      pool.wake(1);
      const std::uint64_t handles = mode == footprint_mode::fast ? 2 : 40;
      EXPECT_EQ(calls(platform_op::create_physical) - creates, handles);
      EXPECT_EQ(calls(platform_op::map) - maps, handles);
      EXPECT_EQ(calls(platform_op::set_access) - grants, handles);
      EXPECT_EQ(sim.used_bytes(0), used);
      EXPECT_EQ(pool.tag_stats(1).reserved_bytes, reserved);
      if (sm == sleep_mode::offload) expect_patterns(tagged);
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
    }
    // Half the blocks freed: a merged handle keeps its pages while any is in use; all
    // freed, every page goes back.
    for (std::size_t i = 0; i < tagged.size(); i += 2) pool.deallocate(tagged[i].p, tagged[i].bytes);
    pool.trim();
    EXPECT_EQ(pool.tag_stats(1).reserved_bytes, mode == footprint_mode::fast ? reserved : reserved / 2);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    for (std::size_t i = 1; i < tagged.size(); i += 2) pool.deallocate(tagged[i].p, tagged[i].bytes);
    tagged.clear();
    pool.trim();
    EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
}

// Where memory is short (less than an eighth of the device free after the wake), each page
// wakes as its own handle: a merged handle's pages move and go back only together, so the
// pages a training step frees after the wake would stay pinned where an out-of-memory retry
// needs them. With plenty of room the pages merge (the test above).
TEST_F(SleepWake, WakeMapsOneHandlePerPageWhereMemoryIsShort) {
  pool_options o;
  o.footprint = footprint_mode::fast;
  vmm_page_pool untagged(sim, 0, o);
  tagged_pool pool(untagged, o);
  std::vector<allocation> tagged;
  for (unsigned i = 0; i < 40; ++i) tagged.push_back({pool.allocate(2 * MiB, 256, {}, 1), 2 * MiB, i});
  for (auto& a : tagged) write_pattern(a.p, a.bytes, a.seed);
  const std::size_t reserved = pool.tag_stats(1).reserved_bytes;
  pool.sleep(1, sleep_mode::offload);
  // Another user of the device leaves the wake its 80 MiB and a sixteenth of the device.
  const std::size_t free_now = sim.mem_info(0).value().free;
  const physical_handle other =
      sim.create_physical(0, free_now - 80 * MiB - gpumem_test::GiB / 16).value();
  const auto creates = calls(platform_op::create_physical);
  const auto grants = calls(platform_op::set_access);
  pool.wake(1);
  EXPECT_EQ(calls(platform_op::create_physical) - creates, 40u);
  EXPECT_EQ(calls(platform_op::set_access) - grants, 40u);
  expect_patterns(tagged);
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, reserved);
  // Every other block freed: their pages go back, none pinned by a neighbour in use.
  for (std::size_t i = 0; i < tagged.size(); i += 2) pool.deallocate(tagged[i].p, tagged[i].bytes);
  pool.trim();
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, reserved / 2);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (std::size_t i = 1; i < tagged.size(); i += 2) pool.deallocate(tagged[i].p, tagged[i].bytes);
  pool.trim();
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
  ASSERT_TRUE(sim.release_physical(other).ok());
}

// A wake whose merged handle cannot be had (the device is out of memory for it) wakes the
// pages one by one where they fit, and otherwise fails as before: bytes kept on the host.
TEST_F(SleepWake, WakeFallsBackToOneHandlePerChunkWhenTheMergedOneFails) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  std::vector<allocation> tagged;
  for (unsigned i = 0; i < 8; ++i) tagged.push_back({pool.allocate(2 * MiB, 256, {}, 1), 2 * MiB, i});
  for (auto& a : tagged) write_pattern(a.p, a.bytes, a.seed);
  pool.sleep(1, sleep_mode::offload);
  const auto creates = calls(platform_op::create_physical);
  sim.inject_fault(platform_op::create_physical, sim_fault{1, false, 0.0, failure_kind::out_of_memory});
  pool.wake(1);
  sim.clear_faults();
  EXPECT_EQ(calls(platform_op::create_physical) - creates, 1u + 8u);
  EXPECT_FALSE(pool.asleep(1));
  expect_patterns(tagged);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  free_all(pool, tagged);
}

TEST_F(SleepWake, SleepingMemoryFaultsLikeAnIllegalAddress) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  auto* p = static_cast<volatile unsigned char*>(pool.allocate(4 * MiB, 256, {}, 1));
  p[0] = 1;
  pool.sleep(1, sleep_mode::discard);
  EXPECT_DEATH((void)p[0], "");
  pool.wake(1);
  p[0] = 2;  // mapped again
  EXPECT_EQ(p[0], 2);
  pool.deallocate(const_cast<unsigned char*>(p), 4 * MiB);
}

TEST_F(SleepWake, RefusalsChangeNothing) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  auto tagged = fill_tag(pool, 1);
  EXPECT_THROW(pool.wake(1), invalid_argument);  // wake without sleep
  pool.sleep(1, sleep_mode::offload);
  EXPECT_THROW(pool.allocate(MiB, 256, {}, 1), invalid_argument);
  {
    scoped_tag t(1);
    EXPECT_THROW(pool.allocate(MiB), invalid_argument);
  }
  EXPECT_THROW(pool.sleep(1, sleep_mode::offload), invalid_argument);  // double sleep
  EXPECT_THROW(pool.sleep(tagged_pool::shared_tag, sleep_mode::offload), invalid_argument);
  EXPECT_TRUE(pool.asleep(1));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.wake(1);
  expect_patterns(tagged);
  free_all(pool, tagged);
}

// Every tag state answers sleep and wake the same way: a tag never allocated in is refused
// and nothing is made for it; a tag holding no page (emptied, or tag 0 unused) sleeps,
// refuses allocations, wakes and serves again; the pool stays valid throughout.
TEST_F(SleepWake, EveryTagStateIsOneStateMachine) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  const std::uint64_t ranges = calls(platform_op::reserve_range);
  EXPECT_THROW(pool.sleep(4, sleep_mode::offload), invalid_argument);
  EXPECT_THROW(pool.wake(4), invalid_argument);
  EXPECT_FALSE(pool.asleep(4));
  EXPECT_EQ(pool.tag_stats(4).allocations, 0u);
  EXPECT_EQ(pool.tags(), std::vector<std::uint32_t>{0});
  EXPECT_EQ(calls(platform_op::reserve_range), ranges);

  pool.deallocate(pool.allocate(4096, 256, {}, 4), 4096);
  for (std::uint32_t tag : {4u, 0u}) {
    for (sleep_mode mode : {sleep_mode::offload, sleep_mode::discard}) {
      pool.sleep(tag, mode);
      EXPECT_TRUE(pool.asleep(tag));
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
      EXPECT_THROW(pool.allocate(4096, 256, {}, tag), invalid_argument);
      EXPECT_THROW(pool.sleep(tag, mode), invalid_argument);
      pool.wake(tag);
      EXPECT_FALSE(pool.asleep(tag));
      EXPECT_THROW(pool.wake(tag), invalid_argument);
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
      pool.deallocate(pool.allocate(4096, 256, {}, tag), 4096);
    }
  }
}

// The tagged pool is the registry of its tags: its stats are the sum over them, trim gives
// back every tag's cached pages, and an allocation of any tag that needs another tag's
// cached pages gets them; at last out of memory, the report lists the tags' holdings.
TEST_F(SleepWake, StatsTrimAndOutOfMemoryReachEveryTag) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  for (std::uint32_t tag = 1; tag <= 400; ++tag) pool.deallocate(pool.allocate(4096, 256, {}, tag), 4096);
  resource_stats sum;
  for (std::uint32_t tag : pool.tags()) sum.reserved_bytes += pool.tag_stats(tag).reserved_bytes;
  EXPECT_EQ(pool.stats().reserved_bytes, 400 * 2 * MiB);
  EXPECT_EQ(pool.stats().reserved_bytes, sum.reserved_bytes);
  EXPECT_EQ(pool.stats().live_bytes, 0u);
  // 800 MiB of the device's 1 GiB is cached by the tags: an untagged 512 MiB gets it.
  void* big = pool.allocate(512 * MiB, 256, {}, 0);
  EXPECT_EQ(pool.stats().live_bytes, 512 * MiB);
  pool.deallocate(big, 512 * MiB);
  for (std::uint32_t tag = 1; tag <= 400; ++tag) pool.deallocate(pool.allocate(4096, 256, {}, tag), 4096);
  // (The tags' allocations that found the device full trimmed every tag: some hold no page.)
  const std::size_t held = pool.stats().reserved_bytes;
  EXPECT_GE(held, 100 * 2 * MiB);
  EXPECT_EQ(pool.trim(), held);
  EXPECT_EQ(pool.stats().reserved_bytes, 0u);
  // A tagged allocation takes what the untagged pool caches too.
  big = pool.allocate(900 * MiB, 256, {}, 0);
  pool.deallocate(big, 900 * MiB);
  void* tagged = pool.allocate(900 * MiB, 256, {}, 9);
  try {
    pool.allocate(512 * MiB, 256, {}, 0);
    ADD_FAILURE() << "a request over the device's free memory succeeded";
  } catch (const out_of_memory& e) {
    EXPECT_NE(e.report().find("tags: the pool holds 900.00 MiB reserved, 900.00 MiB live"),
              std::string::npos) << e.report();
    EXPECT_NE(e.report().find("tag 9: 900.00 MiB reserved"), std::string::npos) << e.report();
  }
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(tagged, 900 * MiB);
}

// A free finds its tag in the map of the tags' ranges, with tags made in any order; an
// address no tag's range holds is the untagged pool's.
TEST_F(SleepWake, TagOfFindsTheRangeAmongManyTags) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  std::vector<std::pair<void*, std::uint32_t>> all;
  for (std::uint32_t tag : {7u, 3u, 250u, 1u, 90u, 42u, 0u, 5u})
    all.emplace_back(pool.allocate(512, 256, {}, tag), tag);
  for (auto& [p, tag] : all) EXPECT_EQ(pool.tag_of(p), tag);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  for (auto& [p, tag] : all) {
    pool.deallocate(p, 512);
    EXPECT_EQ(pool.tag_stats(tag).live_allocations, 0u);
  }
}

// The driver refusing the cache's pages at wake (out of memory) drops that cache, not the
// wake: the bytes in use are restored and the pool stays valid.
TEST_F(SleepWake, CacheTheDriverRefusesAtWakeLeavesThePool) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* state = sleep_with_cache(pool, 4);
  // The bytes in use wake with the first handle; every later one is refused.
  sim.inject_fault(platform_op::create_physical, sim_fault{2, true, 0.0, failure_kind::out_of_memory});
  pool.wake(1);
  sim.clear_faults();
  expect_woken_without_cache(pool, state, 4);
  expect_grows_again(pool);
  pool.deallocate(state, in_use);
}

// Frees while asleep are allowed. footprint:tight gives the freed block's pages back at
// wake; footprint:fast keeps them as cache (mapped again at wake), unless a trim while
// asleep dropped the cache, and then wake maps only the pages in use.
TEST_F(SleepWake, FreeWhileAsleepIsAllowedAndItsPagesAreCacheOrGivenBack) {
  for (footprint_mode mode : {footprint_mode::fast, footprint_mode::tight})
    for (bool trim_asleep : {false, true}) {
      SCOPED_TRACE(std::string(mode == footprint_mode::fast ? "fast" : "tight") +
                   (trim_asleep ? ", trimmed while asleep" : ""));
      pool_options o;
      o.footprint = mode;
      vmm_page_pool untagged(sim, 0, o);
      tagged_pool pool(untagged, o);
      void* keep = pool.allocate(8 * MiB, 256, {}, 1);
      void* drop = pool.allocate(8 * MiB, 256, {}, 1);
      write_pattern(keep, 8 * MiB, 3);
      pool.sleep(1, sleep_mode::offload);
      pool.deallocate(drop, 8 * MiB);
      if (trim_asleep) pool.trim();
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
      pool.wake(1);
      const bool cached = mode == footprint_mode::fast && !trim_asleep;
      EXPECT_EQ(pool.tag_stats(1).reserved_bytes, cached ? 16 * MiB : 8 * MiB);
      EXPECT_TRUE(has_pattern(keep, 8 * MiB, 3));
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
      // The address space of dropped cache serves the tag again.
      void* again = pool.allocate(8 * MiB, 256, {}, 1);
      EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 16 * MiB);
      pool.deallocate(again, 8 * MiB);
      pool.deallocate(keep, 8 * MiB);
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
    }
}

// An asleep pool refuses every allocation itself, under its lock, whatever layer the call
// comes through (here none: the pool's own allocate and allocate_at, as an untagged C API
// call that raced the first sleep reaches them): footprint:fast keeps a free 8 MiB block in
// the arena as cache, its pages released, and would hand it out. The refusal says why and
// changes nothing; after wake the same requests get mapped memory.
TEST_F(SleepWake, AnAsleepPoolRefusesAllocationsItsReleasedCacheWouldServe) {
  for (sleep_mode mode : {sleep_mode::discard, sleep_mode::offload}) {
    SCOPED_TRACE(mode == sleep_mode::discard ? "discard" : "offload");
    vmm_page_pool pool(sim);  // footprint:fast, the default
    void* keep = pool.allocate(8 * MiB);
    void* cache = pool.allocate(8 * MiB);
    pool.deallocate(cache, 8 * MiB);
    pool.sleep(mode);
    ASSERT_TRUE(pool.asleep());
    ASSERT_FALSE(sim.check_access(0, cache, 8 * MiB).ok()) << "the cache's pages were not released";
    const resource_stats before = pool.stats();
    try {
      (void)pool.allocate(8 * MiB);
      ADD_FAILURE() << "an allocation from the asleep pool was served";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("is asleep"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("wake it"), std::string::npos) << e.what();
    }
    EXPECT_THROW((void)pool.allocate_at(cache, 8 * MiB, {}), invalid_argument);
    EXPECT_EQ(pool.stats().live_bytes, before.live_bytes);
    EXPECT_EQ(pool.stats().allocations, before.allocations);
    EXPECT_TRUE(pool.asleep());
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    pool.wake();
    void* again = pool.allocate(8 * MiB);
    EXPECT_TRUE(sim.check_access(0, again, 8 * MiB).ok());
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    pool.deallocate(again, 8 * MiB);
    pool.deallocate(keep, 8 * MiB);
  }
}

// A small block this thread freed sits in its thread cache, where an allocation takes it
// without the pool lock: freed before the sleep (footprint:fast keeps it there) or while
// asleep (either footprint). The sleep turns that path off and drains the caches, so the
// request reaches the pool and is refused; the wake turns it on again.
TEST_F(SleepWake, AnAsleepPoolRefusesSmallRequestsItsThreadCacheHolds) {
  for (footprint_mode footprint : {footprint_mode::fast, footprint_mode::tight})
    for (bool freed_asleep : {false, true}) {
      SCOPED_TRACE(std::string(footprint == footprint_mode::fast ? "fast" : "tight") +
                   (freed_asleep ? ", freed while asleep" : ", freed before the sleep"));
      pool_options o;
      o.footprint = footprint;
      vmm_page_pool pool(sim, 0, o);
      constexpr std::size_t small = 4096;
      void* held = pool.allocate(small);
      void* freed = pool.allocate(small);
      if (!freed_asleep) pool.deallocate(freed, small);
      pool.sleep(sleep_mode::discard);
      if (freed_asleep) pool.deallocate(freed, small);
      EXPECT_THROW((void)pool.allocate(small), invalid_argument);
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
      pool.wake();
      void* again = pool.allocate(small);
      EXPECT_TRUE(sim.check_access(0, again, small).ok());
      pool.deallocate(again, small);
      pool.deallocate(held, small);
      EXPECT_TRUE(pool.is_valid()) << pool.validate();
    }
}

// A sleep that failed halfway leaves part of the pages released: allocations are refused,
// saying how to finish; the same sleep again, then a wake, serves them again. A sleep that
// failed before any page slept leaves the pool awake and serving.
TEST_F(SleepWake, AHalfAsleepPoolRefusesAllocationsAndAPoolNeverAsleepServes) {
  vmm_page_pool pool(sim);
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(pool.allocate(4 * MiB));
  sim.inject_fault(platform_op::release_physical, sim_fault{2, false, 0.0, failure_kind::driver_error});
  EXPECT_THROW(pool.sleep(sleep_mode::discard), cuda_error);
  sim.clear_faults();
  ASSERT_TRUE(pool.asleep());
  try {
    (void)pool.allocate(MiB);
    ADD_FAILURE() << "an allocation from the half-asleep pool was served";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("failed halfway"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("sleep again"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.sleep(sleep_mode::discard);
  EXPECT_THROW((void)pool.allocate(MiB), invalid_argument);
  pool.wake();
  void* served = pool.allocate(MiB);
  EXPECT_TRUE(sim.check_access(0, served, MiB).ok());
  pool.deallocate(served, MiB);

  sim.inject_fault(platform_op::stream_synchronize, sim_fault{1, false, 0.0, failure_kind::driver_error});
  EXPECT_THROW(pool.sleep(sleep_mode::discard), cuda_error);
  sim.clear_faults();
  EXPECT_FALSE(pool.asleep());
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  served = pool.allocate(MiB);
  pool.deallocate(served, MiB);
  for (void* b : blocks) pool.deallocate(b, 4 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// footprint:fast keeps free memory across a sleep as cache: released uncopied (the host
// block holds the bytes in use only), mapped again by wake in few handles, so the same
// work after the wake makes no driver call; tight gives it back before the sleep.
TEST_F(SleepWake, FastSleepKeepsTheCacheAndTheWorkAfterWakeMakesNoDriverCall) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* state = pool.allocate(6 * MiB, 256, {}, 1);
  write_pattern(state, 6 * MiB, 5);
  auto step = [&] {  // transient blocks: 20 MiB, freed at the step's end
    void* a = pool.allocate(12 * MiB, 256, {}, 1);
    void* b = pool.allocate(8 * MiB, 256, {}, 1);
    pool.deallocate(b, 8 * MiB);
    pool.deallocate(a, 12 * MiB);
  };
  step();
  const std::size_t reserved = pool.tag_stats(1).reserved_bytes;
  ASSERT_GE(reserved, 26 * MiB);
  const std::size_t used = sim.used_bytes(0);
  pool.sleep(1, sleep_mode::offload);
  EXPECT_EQ(sim.used_bytes(0), used - reserved);
  EXPECT_EQ(pool.host_bytes(1), 6 * MiB);  // the bytes in use only
  pool.wake(1);
  EXPECT_EQ(sim.used_bytes(0), used);
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, reserved);
  EXPECT_TRUE(has_pattern(state, 6 * MiB, 5));
  const auto creates = calls(platform_op::create_physical), maps = calls(platform_op::map);
  step();
  EXPECT_EQ(calls(platform_op::create_physical), creates);
  EXPECT_EQ(calls(platform_op::map), maps);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(state, 6 * MiB);
}

// The cache wakes only where there is room: with the device nearly full, wake restores
// the bytes in use and the cache that does not fit leaves the pool (no out-of-memory
// error); the device keeps a 32nd of its memory free for allocations outside the pool
// (none of the cache fits here, with 16 MiB left of 1 GiB); the pool grows again on demand
// afterwards.
TEST_F(SleepWake, CacheWithoutRoomAtWakeLeavesThePool) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* state = sleep_with_cache(pool, 9);
  const std::size_t squat = device_options().capacity - sim.used_bytes(0) - 16 * MiB;
  void* squatter = pool.allocate(squat, 256, {}, 0);
  pool.wake(1);
  expect_woken_without_cache(pool, state, 9);
  pool.deallocate(squatter, squat);
  untagged.trim();
  expect_grows_again(pool);
  pool.deallocate(state, in_use);
}

// A growth's one handle (footprint:fast) partly in use when the tag sleeps: its pages in use
// are restored and its free pages are cache, so a wake needs room for the pages in use
// alone, and with room the cache comes back too (the next request makes no driver call).
TEST_F(SleepWake, AHandlePartlyInUseAtSleepNeedsRoomAtWakeForItsPagesInUseOnly) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  // 24 MiB: one handle on this 1 GiB device (a growth's handle is at most a 32nd of the room).
  const auto partly_in_use = [&](unsigned seed) {
    const auto creates = calls(platform_op::create_physical);
    pool.deallocate(pool.allocate(24 * MiB, 256, {}, 1), 24 * MiB);
    EXPECT_EQ(calls(platform_op::create_physical), creates + 1) << "one growth, one handle";
    void* state = pool.allocate(in_use, 256, {}, 1);
    write_pattern(state, in_use, seed);
    EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 24 * MiB);
    return state;
  };
  // No room for the handle, room for the pages in use: the wake restores them alone.
  void* state = partly_in_use(5);
  pool.sleep(1, sleep_mode::offload);
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
  // The host copy holds the pages in use alone, not the handle's free pages.
  EXPECT_GE(pool.host_bytes(1), in_use);
  EXPECT_LT(pool.host_bytes(1), in_use + 2 * MiB);
  const std::size_t squat = device_options().capacity - sim.used_bytes(0) - 16 * MiB;
  void* squatter = pool.allocate(squat, 256, {}, 0);
  pool.wake(1);
  expect_woken_without_cache(pool, state, 5);
  pool.deallocate(squatter, squat);
  untagged.trim();
  pool.deallocate(state, in_use);
  pool.trim();
  ASSERT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
  // With room: the pages in use restored, the free ones mapped again as cache, and a request
  // they cover served without a driver call.
  state = partly_in_use(6);
  pool.sleep(1, sleep_mode::offload);
  pool.wake(1);
  EXPECT_TRUE(has_pattern(state, in_use, 6));
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 24 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  const auto creates = calls(platform_op::create_physical), maps = calls(platform_op::map);
  void* more = pool.allocate(12 * MiB, 256, {}, 1);
  write_pattern(more, 12 * MiB, 8);
  EXPECT_EQ(calls(platform_op::create_physical), creates);
  EXPECT_EQ(calls(platform_op::map), maps);
  EXPECT_TRUE(has_pattern(state, in_use, 6));
  // Discard: the same, with nothing to restore.
  pool.sleep(1, sleep_mode::discard);
  const std::size_t squat_more = device_options().capacity - sim.used_bytes(0) - 20 * MiB;
  squatter = pool.allocate(squat_more, 256, {}, 0);
  pool.wake(1);
  EXPECT_FALSE(pool.asleep(1));
  EXPECT_GE(pool.tag_stats(1).reserved_bytes, in_use + 12 * MiB);
  EXPECT_LT(pool.tag_stats(1).reserved_bytes, 24 * MiB);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(squatter, squat_more);
  pool.deallocate(more, 12 * MiB);
  pool.deallocate(state, in_use);
}

// Pages in use on both sides of free ones in one handle: the host copy packs them, and the
// wake puts each back at its own address, also where one of them was freed while asleep
// (its pages then wake as cache, uncopied).
TEST_F(SleepWake, PagesInUseAroundAFreeHoleComeBackAtTheirAddressesFromAPackedHostCopy) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  const auto creates = calls(platform_op::create_physical);
  pool.deallocate(pool.allocate(24 * MiB, 256, {}, 1), 24 * MiB);
  ASSERT_EQ(calls(platform_op::create_physical), creates + 1) << "one growth, one handle";
  void* low = pool.allocate(4 * MiB, 256, {}, 1);
  void* hole = pool.allocate(8 * MiB, 256, {}, 1);
  void* mid = pool.allocate(4 * MiB, 256, {}, 1);
  void* high = pool.allocate(4 * MiB, 256, {}, 1);
  write_pattern(low, 4 * MiB, 11);
  write_pattern(mid, 4 * MiB, 12);
  write_pattern(high, 4 * MiB, 13);
  pool.deallocate(hole, 8 * MiB);
  for (int round = 0; round < 2; ++round) {
    pool.sleep(1, sleep_mode::offload);
    EXPECT_EQ(pool.host_bytes(1), 12 * MiB) << "round " << round << ": three 4 MiB blocks";
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    if (round == 1) pool.deallocate(mid, 4 * MiB);  // freed asleep: cache at the wake
    pool.wake(1);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    EXPECT_TRUE(has_pattern(low, 4 * MiB, 11)) << "round " << round;
    if (round == 0) EXPECT_TRUE(has_pattern(mid, 4 * MiB, 12)) << "round " << round;
    EXPECT_TRUE(has_pattern(high, 4 * MiB, 13)) << "round " << round;
  }
  // Discard after offload: nothing restored, the host block kept for the next offload.
  pool.sleep(1, sleep_mode::discard);
  pool.wake(1);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(low, 4 * MiB);
  pool.deallocate(high, 4 * MiB);
  EXPECT_EQ(pool.release_host(1), 12 * MiB);
}

// The fixture's TearDown checks that the device holds nothing afterwards: no handle,
// mapping, range or pinned host block.
TEST_F(SleepWake, DestroyingASleepingOrHalfAsleepPoolLeaksNothing) {
  {
    vmm_page_pool untagged(sim);
    tagged_pool pool(untagged, {});
    (void)fill_tag(pool, 1);
    (void)fill_tag(pool, 2);
    pool.sleep(1, sleep_mode::offload);
    sim.inject_fault(platform_op::release_physical, sim_fault{2, false, 0.0, failure_kind::driver_error});
    EXPECT_THROW(pool.sleep(2, sleep_mode::offload), cuda_error);
    sim.clear_faults();
    EXPECT_TRUE(pool.asleep(2));
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
}

// Allocations racing sleep and wake: each fails with invalid_argument (the tag sleeps) or
// succeeds; frees of the tag go on throughout. Afterwards (awake) every allocation still
// held is mapped (written: a pointer into a sleeping page would fault) and the pool valid.
// (Touching the memory while it sleeps is the caller's error, so the worker does not.)
TEST_F(SleepWake, AllocationsRacingSleepAndWakeGetMemoryOrARefusal) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* resident = pool.allocate(8 * MiB, 256, {}, 1);
  write_pattern(resident, 8 * MiB, 2);
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> served{0}, refused{0};
  std::vector<std::pair<void*, std::size_t>> held;
  std::thread worker([&] {
    for (std::size_t i = 0; !stop.load(); ++i) {
      const std::size_t bytes = (i % 7 + 1) * 300 * 1024;
      try {
        held.emplace_back(pool.allocate(bytes, 256, {}, 1), bytes);
        served.fetch_add(1);
      } catch (const invalid_argument&) {
        refused.fetch_add(1);
      }
      if (held.size() > 8) {
        pool.deallocate(held.front().first, held.front().second);  // allowed asleep too
        held.erase(held.begin());
      }
    }
  });
  for (int cycle = 0; cycle < 20; ++cycle) {
    pool.sleep(1, sleep_mode::offload);
    std::this_thread::yield();
    pool.wake(1);
    std::this_thread::yield();
  }
  stop.store(true);
  worker.join();
  EXPECT_GT(served.load(), 0u);
  for (auto& [p, n] : held) std::memset(p, 0x3c, n);
  for (auto& [p, n] : held) pool.deallocate(p, n);
  EXPECT_TRUE(has_pattern(resident, 8 * MiB, 2));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(resident, 8 * MiB);
}

TEST_F(SleepWake, CachingPoolSaysNotSupported) {
  runtime_resource upstream(sim);
  caching_pool untagged(upstream);
  tagged_pool pool(untagged, {});
  EXPECT_THROW(pool.sleep(0, sleep_mode::offload), not_supported);
  EXPECT_THROW(pool.wake(0), not_supported);
  // Other tags are vmm_page_pools and sleep.
  void* p = pool.allocate(MiB, 256, {}, 5);
  pool.sleep(5, sleep_mode::discard);
  pool.wake(5);
  pool.deallocate(p, MiB);
}

TEST_F(SleepWake, WakeOutOfMemoryKeepsTheBytesAndARetrySucceeds) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* slept = pool.allocate(600 * MiB, 256, {}, 1);
  write_pattern(slept, 600 * MiB, 9);
  pool.sleep(1, sleep_mode::offload);
  void* squatter = pool.allocate(600 * MiB, 256, {}, 0);
  EXPECT_THROW(pool.wake(1), out_of_memory);
  EXPECT_TRUE(pool.asleep(1));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
  pool.deallocate(squatter, 600 * MiB);
  untagged.trim();
  pool.wake(1);
  EXPECT_TRUE(has_pattern(slept, 600 * MiB, 9));
  pool.deallocate(slept, 600 * MiB);
}

// A tag left partly asleep by a wake without room, its pages in use freed meanwhile, then
// trimmed (as another tag's out-of-memory trims every tag): it stays asleep until the wake
// is called again, which completes it, and it serves allocations after.
TEST_F(SleepWake, APartlyAwakeTagTrimmedOfAllItsPagesStillCompletesItsWake) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  void* slept = pool.allocate(8 * MiB, 256, {}, 1);
  pool.sleep(1, sleep_mode::offload);
  const std::size_t free = sim.mem_info(0).value().free;
  auto squatter = sim.create_physical(0, free - free % (2 * MiB));
  ASSERT_TRUE(squatter);
  EXPECT_THROW(pool.wake(1), out_of_memory);
  ASSERT_TRUE(pool.asleep(1));
  pool.deallocate(slept, 8 * MiB);  // allowed asleep: its pages are cache now
  (void)pool.trim();
  EXPECT_TRUE(pool.asleep(1)) << "the wake has not completed";
  EXPECT_THROW((void)pool.allocate(MiB, 256, {}, 1), invalid_argument);
  pool.wake(1);  // the cache has no room: it leaves the pool
  EXPECT_FALSE(pool.asleep(1));
  ASSERT_TRUE(sim.release_physical(squatter.value()));
  void* fresh = pool.allocate(8 * MiB, 256, {}, 1);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.deallocate(fresh, 8 * MiB);
}

// An offload larger than one copy slice retires the slices one by one while the next
// copies; a failure waiting for the second slice's copies leaves the first slice released
// (the tag partly asleep, refusing allocations), and the retry completes; every byte
// survives the round trip.
TEST_F(SleepWake, OffloadInSlicesSurvivesAFailureBetweenSlices) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  std::vector<allocation> big;
  for (unsigned i = 0; i < 5; ++i) {
    const std::size_t bytes = 150 * MiB + i * 4096;
    big.push_back({pool.allocate(bytes, 256, {}, 1), bytes, 40 + i});
    write_pattern(big.back().p, bytes, 40 + i);
  }
  const std::size_t reserved = pool.tag_stats(1).reserved_bytes;
  sim.inject_fault(platform_op::event_synchronize,
                   sim_fault{2, false, 0.0, failure_kind::driver_error});
  EXPECT_THROW(pool.sleep(1, sleep_mode::offload), cuda_error);
  sim.clear_faults();
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  EXPECT_TRUE(pool.asleep(1));
  const std::size_t partly = pool.tag_stats(1).reserved_bytes;
  EXPECT_LT(partly, reserved) << "the first slice was not released before the failure";
  EXPECT_GT(partly, 0u);
  EXPECT_THROW(pool.allocate(MiB, 256, {}, 1), invalid_argument);
  pool.sleep(1, sleep_mode::offload);
  EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
  pool.wake(1);
  expect_patterns(big);
  free_all(pool, big);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A failure injected into the n-th call of each operation sleep or wake makes: afterwards
// the pool and the device are valid, the tag refuses allocations while any page sleeps,
// and the same call again completes; the bytes survive.
struct fault_case {
  platform_op op;
  bool in_wake;
};

class SleepWakeFaults : public SleepWake, public ::testing::WithParamInterface<fault_case> {};

TEST_P(SleepWakeFaults, EveryPositionLeavesAValidPoolAndARetryCompletes) {
  const fault_case fc = GetParam();
  std::size_t failures = 0, left_partly_asleep = 0;
  for (std::uint64_t nth = 1; nth <= 6; ++nth) {
    SCOPED_TRACE("failing call " + std::to_string(nth) + " of " +
                 std::string(platform_op_name(fc.op)));
    vmm_page_pool untagged(sim);
    tagged_pool pool(untagged, {});
    auto tagged = fill_tag(pool, 1);
    if (fc.in_wake) pool.sleep(1, sleep_mode::offload);
    sim.inject_fault(fc.op, sim_fault{nth, false, 0.0, failure_kind::driver_error});
    bool failed = false;
    try {
      if (fc.in_wake) pool.wake(1);
      else pool.sleep(1, sleep_mode::offload);
    } catch (const cuda_error&) {
      failed = true;
    }
    sim.clear_faults();
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
    EXPECT_TRUE(sim.is_valid()) << sim.validate();
    failures += failed ? 1 : 0;
    if (failed && pool.asleep(1)) {
      ++left_partly_asleep;
      // Partly asleep: allocations stay refused until the step completes.
      EXPECT_THROW(pool.allocate(MiB, 256, {}, 1), invalid_argument);
    }
    if (fc.in_wake) {
      if (failed) pool.wake(1);  // the retry completes the wake
    } else {
      if (failed) pool.sleep(1, sleep_mode::offload);  // the retry completes the sleep
      EXPECT_TRUE(pool.asleep(1));
      EXPECT_EQ(pool.tag_stats(1).reserved_bytes, 0u);
      pool.wake(1);
    }
    EXPECT_FALSE(pool.asleep(1));
    expect_patterns(tagged);
    free_all(pool, tagged);
    EXPECT_TRUE(pool.is_valid()) << pool.validate();
  }
  EXPECT_GT(failures, 0u) << "no injected failure reached sleep or wake";
  // Failures after the first page slept leave the tag partly asleep (and refusing).
  if (fc.op == platform_op::release_physical || fc.in_wake) {
    EXPECT_GT(left_partly_asleep, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Calls, SleepWakeFaults,
    ::testing::Values(fault_case{platform_op::memcpy_async, false},
                      fault_case{platform_op::event_record, false},
                      fault_case{platform_op::event_synchronize, false},
                      fault_case{platform_op::unmap, false},
                      fault_case{platform_op::release_physical, false},
                      fault_case{platform_op::create_physical, true},
                      fault_case{platform_op::map, true},
                      fault_case{platform_op::set_access, true},
                      fault_case{platform_op::memcpy_async, true}),
    [](const auto& info) {
      return std::string(platform_op_name(info.param.op)) + (info.param.in_wake ? "_wake" : "_sleep");
    });

// --- sharing ------------------------------------------------------------------------------

// The pinned host memory of offload sleeps: one block, reused by every sleep of up to its
// size (also across streams), replaced (not added to) by a larger sleep, so the host bytes
// held stay flat over many cycles; release_host gives it back on request, is refused while
// the offloaded bytes live there, and the next sleep gets a new block.
TEST_F(SleepWake, OffloadHostMemoryStaysFlatAndIsReleasedOnRequest) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  std::vector<allocation> tagged{{pool.allocate(3 * MiB, 256, {}, 1), 3 * MiB, 1},
                                 {pool.allocate(1000, 256, {}, 1), 1000, 2}};
  for (auto& a : tagged) write_pattern(a.p, a.bytes, a.seed);
  const stream_handle other = make_stream();
  EXPECT_EQ(pool.host_bytes(1), 0u);
  pool.sleep(1, sleep_mode::offload);
  const std::size_t first = pool.host_bytes(1);
  EXPECT_GE(first, pool.tag_stats(1).live_bytes);
  pool.wake(1);
  EXPECT_EQ(pool.host_bytes(1), first);  // kept for the next sleep
  // The tag grows (optimizer states made by the first step): the larger block replaces
  // the first one.
  void* grown = pool.allocate(4 * MiB, 256, {}, 1);
  write_pattern(grown, 4 * MiB, 9);
  pool.sleep(1, sleep_mode::offload);
  const std::size_t held = pool.host_bytes(1);
  EXPECT_GE(held, first + 4 * MiB);
  pool.wake(1);
  EXPECT_EQ(sim.live_objects().host_allocations, 1u);
  for (int cycle = 0; cycle < 20; ++cycle) {
    const stream_handle s = cycle % 2 == 0 ? stream_handle{} : other;
    pool.sleep(1, sleep_mode::offload, s);
    EXPECT_EQ(pool.host_bytes(1), held) << "cycle " << cycle;
    pool.wake(1, cycle % 3 == 0 ? other : s);
    EXPECT_EQ(pool.host_bytes(1), held) << "cycle " << cycle;
    EXPECT_EQ(sim.live_objects().host_allocations, 1u) << "cycle " << cycle;
  }
  ASSERT_TRUE(sim.stream_synchronize(other).ok());
  expect_patterns(tagged);
  EXPECT_TRUE(has_pattern(grown, 4 * MiB, 9));

  // Refused while the offloaded bytes live there; nothing changes.
  pool.sleep(1, sleep_mode::offload);
  EXPECT_THROW(pool.release_host(1), invalid_argument);
  EXPECT_EQ(pool.host_bytes(1), held);
  pool.wake(1);
  expect_patterns(tagged);
  EXPECT_THROW(pool.release_host(tagged_pool::shared_tag), invalid_argument);
  EXPECT_THROW(pool.release_host(7), invalid_argument);  // never allocated in: nothing made
  EXPECT_EQ(pool.tags(), (std::vector<std::uint32_t>{0, 1}));

  EXPECT_EQ(pool.release_host(1), held);
  EXPECT_EQ(pool.host_bytes(1), 0u);
  EXPECT_EQ(sim.live_objects().host_allocations, 0u);
  EXPECT_EQ(pool.release_host(1), 0u);
  EXPECT_EQ(pool.release_host(0), 0u);  // tag 0 never slept

  // The next sleep gets a new block; a discard sleep holds no bytes there and may release it.
  pool.sleep(1, sleep_mode::offload);
  EXPECT_EQ(pool.host_bytes(1), held);
  pool.wake(1);
  expect_patterns(tagged);
  EXPECT_TRUE(has_pattern(grown, 4 * MiB, 9));
  pool.sleep(1, sleep_mode::discard);
  EXPECT_EQ(pool.release_host(1), held);
  pool.wake(1);
  EXPECT_EQ(sim.live_objects().host_allocations, 0u);
  pool.deallocate(grown, 4 * MiB);
  free_all(pool, tagged);
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

// A borrower that maps pages itself (a KV cache) takes them from a tag's own pool: they
// count in the tag's stats, the tag's sleep is refused while they are lent, and once they
// are returned the sleep gives them back; nothing is lent from a tag asleep.
TEST_F(SleepWake, PagesLentFromATagAreTheTagsAndSleepWithIt) {
  vmm_page_pool untagged(sim);
  tagged_pool pool(untagged, {});
  EXPECT_THROW(pool.page_pool(tagged_pool::shared_tag), invalid_argument);
  vmm_page_pool& pages = pool.page_pool(3);
  EXPECT_EQ(&pool.page_pool(3), &pages);
  EXPECT_NE(&pages, &untagged);
  std::vector<physical_handle> lent = pages.lend_pages(4);
  EXPECT_EQ(pool.tag_stats(3).reserved_bytes, 4 * pages.page_size());
  EXPECT_EQ(pool.tag_stats(0).reserved_bytes, 0u);
  EXPECT_THROW(pool.sleep(3, sleep_mode::discard), invalid_argument);
  EXPECT_FALSE(pool.asleep(3));
  pages.return_pages(lent);
  const std::size_t used = sim.used_bytes(0);
  pool.sleep(3, sleep_mode::discard);
  EXPECT_EQ(sim.used_bytes(0), used - 4 * pages.page_size());
  EXPECT_EQ(pool.tag_stats(3).reserved_bytes, 0u);
  EXPECT_THROW(pages.lend_pages(1), invalid_argument);
  EXPECT_THROW(pool.page_pool(3), invalid_argument);
  EXPECT_EQ(sim.used_bytes(0), used - 4 * pages.page_size());
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
  pool.wake(3);
  pages.return_pages(pages.lend_pages(1));
  EXPECT_TRUE(pool.is_valid()) << pool.validate();
}

TEST_F(SleepWake, SharedMemoryExportImportAndBadInput) {
  shared_memory shared(sim, 0);
  void* p = shared.allocate(3 * MiB);  // 4 MiB of pages
  write_pattern(p, 3 * MiB, 4);
  const int fd = shared.export_fd(p);
  ASSERT_GE(fd, 0);
  EXPECT_THROW(shared.import(fd, 7 * MiB), invalid_argument);    // size mismatch
  EXPECT_THROW(shared.export_fd(static_cast<char*>(p) + 64), invalid_argument);  // interior
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  EXPECT_THROW(shared.import(pipe_fds[0], 4 * MiB), invalid_argument);  // foreign fd
  ::close(pipe_fds[0]);
  ::close(pipe_fds[1]);
  EXPECT_THROW(shared.import(pipe_fds[0], 4 * MiB), invalid_argument);  // closed fd
  void* q = shared.import(fd, 4 * MiB);
  ::close(fd);
  EXPECT_TRUE(has_pattern(q, 3 * MiB, 4));
  EXPECT_TRUE(shared.is_import(q));
  EXPECT_EQ(shared.imported_bytes(), 4 * MiB);
  // The exporter frees first: the import still reads the bytes.
  shared.release(p, 3 * MiB);
  EXPECT_TRUE(has_pattern(q, 3 * MiB, 4));
  EXPECT_THROW(shared.release(q, MiB), invalid_argument);  // wrong size: nothing changed
  shared.release(q, 4 * MiB);
  EXPECT_EQ(shared.validate(), "");
}

// Freeing a shared allocation unmaps it at once: the freeing stream's work must be done
// first (on the H200 a 4 GiB temporary freed right after its kernel was launched faulted),
// and a wait that fails frees nothing.
TEST_F(SleepWake, SharedMemoryReleaseWaitsForTheFreeingStream) {
  shared_memory shared(sim, 0);
  auto stream = sim.stream_create(0);
  ASSERT_TRUE(stream);
  void* p = shared.allocate(3 * MiB);
  write_pattern(p, 3 * MiB, 5);
  const std::uint64_t waits = sim.calls().count(platform_op::stream_synchronize);
  sim.inject_fault(platform_op::stream_synchronize, sim_fault{1, false, 0.0, failure_kind::driver_error});
  EXPECT_THROW(shared.release(p, 3 * MiB, stream.value()), cuda_error);
  sim.clear_faults();
  EXPECT_TRUE(shared.owns(p));
  EXPECT_TRUE(has_pattern(p, 3 * MiB, 5));  // still mapped
  shared.release(p, 3 * MiB, stream.value());
  EXPECT_EQ(sim.calls().count(platform_op::stream_synchronize), waits + 2);
  EXPECT_FALSE(shared.owns(p));
  EXPECT_EQ(shared.validate(), "");
  ASSERT_TRUE(sim.stream_destroy(stream.value()));
}

// Memory exported on device 0 and imported for device 1: the importer maps it on its own
// device as a peer's memory and grants its device access; a device without a peer path to
// device 0 is refused at the import, naming device 0.
TEST(SleepWakeDevices, ImportForAPeerDeviceMapsAndGrantsAccess) {
  sim_options o;
  o.capacity = 256 * MiB;
  o.device_count = 2;
  sim_platform sim(o);
  {
    shared_memory on0(sim, 0), on1(sim, 1);
    void* p = on0.allocate(2 * MiB);
    std::memset(p, 0x6d, 2 * MiB);
    const int fd = on0.export_fd(p);
    void* q = on1.import(fd, 2 * MiB);
    ::close(fd);
    EXPECT_TRUE(sim.check_access(1, q, 2 * MiB).ok());
    EXPECT_EQ(static_cast<unsigned char*>(q)[777], 0x6d);
    static_cast<unsigned char*>(q)[778] = 0x11;  // device 1 writes, device 0 reads
    EXPECT_EQ(static_cast<unsigned char*>(p)[778], 0x11);
    on1.release(q, 2 * MiB);
    on0.release(p, 2 * MiB);
  }
  EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();

  o.no_peer = {{0, 1}};
  sim_platform isolated(o);
  {
    shared_memory on0(isolated, 0), on1(isolated, 1);
    void* p = on0.allocate(2 * MiB);
    const int fd = on0.export_fd(p);
    try {
      (void)on1.import(fd, 2 * MiB);
      ADD_FAILURE() << "import for device 1 of memory it cannot reach succeeded";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("device 0"), std::string::npos) << e.what();
    }
    ::close(fd);
    on0.release(p, 2 * MiB);
  }
  EXPECT_TRUE(isolated.live_objects().none()) << isolated.live_objects().describe();
}

TEST_F(SleepWake, PlatformWithoutSharingSaysNotSupported) {
  // The seam's defaults: a platform that does not override sharing refuses it as such.
  auto r = sim.platform::create_shareable_physical(0, 2 * MiB);  // the base class's
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(r.error().kind, failure_kind::not_supported);
}

}  // namespace
