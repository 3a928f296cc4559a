// The C API's tags under hostile use, on a private sim device: sleep / wake is one state
// machine for every tag state (never used, empty, holding pages, asleep; tag 0 included);
// refused calls and look-ups make no tag pool; the pool's stats, trim and out-of-memory
// retry reach every tag's memory; gpumem_record_stream works for tagged, shared and
// imported allocations as for untagged ones; frees find their tag among many; the host
// memory of offload sleeps stays flat and goes back on request; KV storage made under a
// tag is the tag's and sleeps with it; untagged allocations racing tag 0's first sleep get
// mapped memory or a refusal.
#include "gpumem/interop/gpumem.h"
#include "gpumem/interop/gpumem_kv.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/platform/sim_platform.hpp"
#include "interop/c_api_internal.hpp"

namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::uint32_t shared_tag = GPUMEM_TAG_SHARED;

std::string last_error() { return gpumem_last_error(); }

struct pool_handle {
  explicit pool_handle(const char* config) { status = gpumem_pool_create(config, &pool); }
  ~pool_handle() { gpumem_pool_destroy(pool); }
  gpumem_stats stats() const {
    gpumem_stats s{};
    EXPECT_EQ(gpumem_pool_stats(pool, &s), GPUMEM_SUCCESS) << last_error();
    return s;
  }
  gpumem_stats tag_stats(std::uint32_t tag) const {
    gpumem_stats s{};
    EXPECT_EQ(gpumem_tag_stats(pool, tag, &s), GPUMEM_SUCCESS) << last_error();
    return s;
  }
  std::uint64_t counter(const char* name) const {
    std::uint64_t v = 0;
    EXPECT_EQ(gpumem_pool_counter(pool, name, &v), GPUMEM_SUCCESS) << last_error();
    return v;
  }
  void* tagged(std::size_t bytes, std::uint32_t tag, void* stream = nullptr) const {
    void* p = nullptr;
    EXPECT_EQ(gpumem_allocate_tagged(pool, bytes, 256, stream, tag, &p), GPUMEM_SUCCESS)
        << last_error();
    return p;
  }
  gpumem_pool* pool = nullptr;
  gpumem_status status;
};

constexpr const char* small_sim = "platform:sim,sim_capacity:256M";

// A tag that held pages and freed them all holds none once asleep (sleep trims first): it
// sleeps, refuses allocations, wakes, and then behaves as before, again and again.
TEST(c_api_tags, a_tag_holding_no_page_sleeps_and_wakes_like_any_other) {
  for (int mode : {GPUMEM_SLEEP_OFFLOAD, GPUMEM_SLEEP_DISCARD}) {
    pool_handle h(small_sim);
    ASSERT_EQ(h.status, GPUMEM_SUCCESS);
    void* p = h.tagged(4 * KiB, 5);
    ASSERT_EQ(gpumem_free(h.pool, p, 4 * KiB, nullptr), GPUMEM_SUCCESS) << last_error();
    for (int round = 0; round < 3; ++round) {
      ASSERT_EQ(gpumem_sleep(h.pool, 5, mode, nullptr), GPUMEM_SUCCESS) << last_error();
      EXPECT_EQ(gpumem_tag_asleep(h.pool, 5), 1);
      void* refused = reinterpret_cast<void*>(1);
      EXPECT_EQ(gpumem_allocate_tagged(h.pool, 4 * KiB, 256, nullptr, 5, &refused),
                GPUMEM_ERROR_INVALID_ARGUMENT);
      EXPECT_EQ(refused, nullptr);
      EXPECT_NE(last_error().find("asleep"), std::string::npos) << last_error();
      EXPECT_EQ(gpumem_sleep(h.pool, 5, mode, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(last_error().find("already asleep"), std::string::npos) << last_error();
      ASSERT_EQ(gpumem_wake(h.pool, 5, nullptr), GPUMEM_SUCCESS) << last_error();
      EXPECT_EQ(gpumem_tag_asleep(h.pool, 5), 0);
      EXPECT_EQ(gpumem_wake(h.pool, 5, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
      p = h.tagged(4 * KiB, 5);
      ASSERT_NE(p, nullptr);
      ASSERT_EQ(gpumem_free(h.pool, p, 4 * KiB, nullptr), GPUMEM_SUCCESS);
    }
  }
}

// Tag 0 of a fresh pool holds nothing: its sleep makes gpumem_malloc refuse (saying why)
// until its wake, and then gpumem_malloc serves again.
TEST(c_api_tags, tag_0_holding_nothing_sleeps_refuses_untagged_allocations_and_wakes) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_wake(h.pool, 0, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);  // never slept
  ASSERT_EQ(gpumem_sleep(h.pool, 0, GPUMEM_SLEEP_OFFLOAD, nullptr), GPUMEM_SUCCESS)
      << last_error();
  EXPECT_EQ(gpumem_tag_asleep(h.pool, 0), 1);
  EXPECT_EQ(gpumem_malloc(h.pool, MiB, nullptr), nullptr);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("tag 0"), std::string::npos) << last_error();
  ASSERT_EQ(gpumem_wake(h.pool, 0, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_tag_asleep(h.pool, 0), 0);
  void* p = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS);
  // And again, through the tagged entry point for tag 0.
  ASSERT_EQ(gpumem_sleep(h.pool, 0, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_SUCCESS);
  void* refused = nullptr;
  EXPECT_EQ(gpumem_allocate_tagged(h.pool, MiB, 256, nullptr, 0, &refused),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(gpumem_wake(h.pool, 0, nullptr), GPUMEM_SUCCESS) << last_error();
}

// The first gpumem_sleep(0) of a pool makes its tag state: an untagged small block this
// thread freed (its thread cache holds it) and the cache of free pages are refused while
// tag 0 sleeps, by gpumem_malloc and gpumem_allocate_at alike, and served after the wake.
TEST(c_api_tags, the_first_sleep_of_tag_0_refuses_what_the_thread_cache_and_cache_hold) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  constexpr std::size_t small = 4 * KiB;
  void* held = gpumem_malloc(h.pool, small, nullptr);
  void* cached = gpumem_malloc(h.pool, small, nullptr);
  void* big = gpumem_malloc(h.pool, 8 * MiB, nullptr);
  ASSERT_NE(held, nullptr);
  ASSERT_NE(cached, nullptr);
  ASSERT_NE(big, nullptr);
  ASSERT_EQ(gpumem_free(h.pool, cached, small, nullptr), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_free(h.pool, big, 8 * MiB, nullptr), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_sleep(h.pool, 0, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_SUCCESS) << last_error();
  for (std::size_t bytes : {small, 8 * MiB}) {
    EXPECT_EQ(gpumem_malloc(h.pool, bytes, nullptr), nullptr);
    EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(last_error().find("asleep"), std::string::npos) << last_error();
  }
  EXPECT_EQ(gpumem_allocate_at(h.pool, big, 8 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(h.stats().live_bytes, small);
  ASSERT_EQ(gpumem_wake(h.pool, 0, nullptr), GPUMEM_SUCCESS) << last_error();
  void* again = gpumem_malloc(h.pool, small, nullptr);
  ASSERT_NE(again, nullptr) << last_error();
  EXPECT_TRUE(h.pool->body->own_sim->check_access(0, again, small).ok());
  EXPECT_EQ(gpumem_free(h.pool, again, small, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, held, small, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(h.pool->body->pool->validate(), "");
}

// Untagged allocations racing the first sleep of tag 0 (which makes the tag state while
// they may be past the look-up of it), on fresh pools: each gets memory or
// GPUMEM_ERROR_INVALID_ARGUMENT; one that began after the sleep returned and ended before
// the wake began is refused; and once awake (the cache dropped while asleep: a block handed
// out from it would be unmapped for good) every allocation held is mapped and the pool valid.
TEST(c_api_tags, untagged_allocations_racing_the_first_sleep_get_mapped_memory_or_a_refusal) {
  constexpr std::size_t small = 4 * KiB;
  for (int round = 0; round < 8; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    pool_handle h(small_sim);
    ASSERT_EQ(h.status, GPUMEM_SUCCESS);
    // A free 8 MiB block: the cache a footprint:fast sleep keeps in the arena.
    ASSERT_EQ(gpumem_free(h.pool, gpumem_malloc(h.pool, 8 * MiB, nullptr), 8 * MiB, nullptr),
              GPUMEM_SUCCESS);
    std::atomic<int> phase{0};  // 1: the sleep returned; 2: the wake begins; 3: stop
    std::atomic<std::size_t> served{0};
    std::vector<std::pair<void*, std::size_t>> held;
    std::string wrong;
    std::thread worker([&] {
      for (std::size_t i = 0; phase.load() != 3; ++i) {
        const std::size_t bytes = i % 4 == 3 ? 8 * MiB : small;
        const int began = phase.load();
        void* p = gpumem_malloc(h.pool, bytes, nullptr);
        const int ended = phase.load();
        if (p == nullptr) {
          if (gpumem_last_status() != GPUMEM_ERROR_INVALID_ARGUMENT && wrong.empty())
            wrong = std::string("refused with ") + gpumem_status_name(gpumem_last_status());
        } else {
          if (began == 1 && ended == 1 && wrong.empty()) wrong = "served while tag 0 slept";
          served.fetch_add(1);
          held.emplace_back(p, bytes);
        }
        if (held.size() > 6) {
          (void)gpumem_free(h.pool, held.front().first, held.front().second, nullptr);
          held.erase(held.begin());
        }
      }
    });
    while (served.load() < 16) std::this_thread::yield();
    ASSERT_EQ(gpumem_sleep(h.pool, 0, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_SUCCESS) << last_error();
    phase.store(1);
    EXPECT_EQ(gpumem_pool_trim(h.pool, nullptr), GPUMEM_SUCCESS);  // drops the sleeping cache
    phase.store(2);
    ASSERT_EQ(gpumem_wake(h.pool, 0, nullptr), GPUMEM_SUCCESS) << last_error();
    const std::size_t woke_at = served.load();
    while (served.load() < woke_at + 16) std::this_thread::yield();
    phase.store(3);
    worker.join();
    EXPECT_EQ(wrong, "");
    for (auto [p, n] : held) {
      EXPECT_TRUE(h.pool->body->own_sim->check_access(0, p, n).ok()) << p << " is not mapped";
      EXPECT_EQ(gpumem_free(h.pool, p, n, nullptr), GPUMEM_SUCCESS);
    }
    EXPECT_EQ(h.pool->body->pool->validate(), "");
  }
}

// A sleep, wake or look-up of a tag never allocated in is refused or answered without
// making a tag pool: no virtual range is reserved, however many such calls come.
TEST(c_api_tags, calls_on_tags_never_allocated_in_make_nothing) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  // Before any tag exists, and after one does.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      ASSERT_NE(h.tagged(4 * KiB, 1), nullptr);
    }
    const std::uint64_t ranges = h.counter("cuMemAddressReserve");
    for (std::uint32_t tag = 1000; tag < 1300; ++tag) {
      EXPECT_EQ(gpumem_sleep(h.pool, tag, GPUMEM_SLEEP_OFFLOAD, nullptr),
                GPUMEM_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(last_error().find("never allocated in"), std::string::npos) << last_error();
      EXPECT_EQ(gpumem_wake(h.pool, tag, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
      EXPECT_NE(last_error().find("not asleep"), std::string::npos) << last_error();
      EXPECT_EQ(gpumem_tag_asleep(h.pool, tag), 0);
      const gpumem_stats s = h.tag_stats(tag);
      EXPECT_EQ(s.reserved_bytes, 0u);
      EXPECT_EQ(s.allocations, 0u);
    }
    EXPECT_EQ(gpumem_sleep(h.pool, shared_tag, GPUMEM_SLEEP_OFFLOAD, nullptr),
              GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(h.counter("cuMemAddressReserve"), ranges) << "a refused call reserved a range";
  }
  // An allocation still makes its tag.
  void* p = h.tagged(4 * KiB, 1001);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(h.tag_stats(1001).live_allocations, 1u);
  EXPECT_EQ(gpumem_free(h.pool, p, 4 * KiB, nullptr), GPUMEM_SUCCESS);
}

gpumem_stats sum_of_tags(const pool_handle& h, const std::vector<std::uint32_t>& tags) {
  gpumem_stats sum{};
  for (std::uint32_t t : tags) {
    const gpumem_stats s = h.tag_stats(t);
    sum.reserved_bytes += s.reserved_bytes;
    sum.live_bytes += s.live_bytes;
    sum.live_allocations += s.live_allocations;
  }
  return sum;
}

// Tags that allocated and freed keep their pages cached: the pool's stats count them, trim
// gives them back, and an untagged allocation that needs them gets them (the tags are
// trimmed before it runs out of memory).
TEST(c_api_tags, pool_stats_trim_and_out_of_memory_reach_every_tag) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  std::vector<std::uint32_t> tags{0, shared_tag};
  auto spread = [&] {
    for (std::uint32_t t = 1; t <= 100; ++t) {
      void* p = h.tagged(4 * KiB, t);
      ASSERT_NE(p, nullptr);
      ASSERT_EQ(gpumem_free(h.pool, p, 4 * KiB, nullptr), GPUMEM_SUCCESS);
    }
  };
  spread();
  for (std::uint32_t t = 1; t <= 100; ++t) tags.push_back(t);
  void* shared = h.tagged(3 * MiB, shared_tag);
  void* untagged = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(untagged, nullptr);

  gpumem_stats all = h.stats();
  const gpumem_stats sum = sum_of_tags(h, tags);
  EXPECT_GE(all.reserved_bytes, 100 * 2 * MiB);  // one page a tag at least
  EXPECT_EQ(all.reserved_bytes, sum.reserved_bytes);
  EXPECT_EQ(all.live_bytes, sum.live_bytes);
  EXPECT_EQ(all.live_bytes, MiB + 3 * MiB);
  EXPECT_EQ(all.live_allocations, 2u);
  // The pool's page counts are every tag's; its page size is one page, not a sum.
  const std::uint64_t page = h.counter("page_size");
  EXPECT_EQ(page, 2 * MiB);
  EXPECT_EQ(h.counter("pages_mapped") * page + h.tag_stats(shared_tag).reserved_bytes,
            all.reserved_bytes);
  EXPECT_GE(h.counter("pages_created"), 100u + 1u);
  const std::uint64_t released_pages = h.counter("pages_released");

  // Trim gives back every tag's cached pages.
  std::uint64_t released = 0;
  ASSERT_EQ(gpumem_pool_trim(h.pool, &released), GPUMEM_SUCCESS) << last_error();
  EXPECT_GE(released, 100 * 2 * MiB);
  EXPECT_EQ((h.counter("pages_released") - released_pages) * page, released);
  for (std::uint32_t t = 1; t <= 100; ++t) EXPECT_EQ(h.tag_stats(t).reserved_bytes, 0u);
  EXPECT_EQ(h.stats().reserved_bytes, all.reserved_bytes - released);

  // Again, and this time an untagged request needs the tags' cached pages: 100 tags hold
  // 200 MiB of the device's 256 MiB.
  spread();
  void* big = gpumem_malloc(h.pool, 160 * MiB, nullptr);
  ASSERT_NE(big, nullptr) << last_error();
  all = h.stats();
  EXPECT_EQ(all.reserved_bytes, sum_of_tags(h, tags).reserved_bytes);
  EXPECT_EQ(all.live_bytes, MiB + 3 * MiB + 160 * MiB);

  // A tagged request that needs the untagged pool's cache gets it too.
  ASSERT_EQ(gpumem_free(h.pool, big, 160 * MiB, nullptr), GPUMEM_SUCCESS);
  void* tagged_big = h.tagged(160 * MiB, 7);
  ASSERT_NE(tagged_big, nullptr);

  // Out of memory with the device full of live tagged memory: the report names the tags'
  // holdings, and nothing changed.
  const gpumem_stats before = h.stats();
  EXPECT_EQ(gpumem_malloc(h.pool, 200 * MiB, nullptr), nullptr);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_OUT_OF_MEMORY);
  EXPECT_NE(last_error().find("tags: the pool holds"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("tag 7: 160"), std::string::npos) << last_error();
  EXPECT_EQ(h.stats().live_bytes, before.live_bytes);

  EXPECT_EQ(gpumem_free(h.pool, tagged_big, 160 * MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, untagged, MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, shared, 3 * MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().live_bytes, 0u);
}

// A wake that finds the device full of other tags' cached pages gets them: the wake trims
// every tag and tries again, and the bytes come back.
TEST(c_api_tags, a_wake_gets_the_free_memory_other_tags_cache) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  auto* kept = static_cast<unsigned char*>(h.tagged(100 * MiB, 1));
  ASSERT_NE(kept, nullptr);
  kept[0] = 0x5a;
  kept[100 * MiB - 1] = 0xa5;
  ASSERT_EQ(gpumem_sleep(h.pool, 1, GPUMEM_SLEEP_OFFLOAD, nullptr), GPUMEM_SUCCESS) << last_error();
  void* other = h.tagged(200 * MiB, 2);
  ASSERT_NE(other, nullptr);
  ASSERT_EQ(gpumem_free(h.pool, other, 200 * MiB, nullptr), GPUMEM_SUCCESS);  // cached by tag 2
  ASSERT_EQ(gpumem_wake(h.pool, 1, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(kept[0], 0x5a);
  EXPECT_EQ(kept[100 * MiB - 1], 0xa5);
  EXPECT_EQ(gpumem_free(h.pool, kept, 100 * MiB, nullptr), GPUMEM_SUCCESS);
}

// A free on the default stream of an allocation recorded on a side stream waits for it,
// whichever kind of allocation it is; pointers that are not live allocations are refused.
TEST(c_api_tags, record_stream_works_for_tagged_shared_and_imported_allocations) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* side = nullptr;
  ASSERT_EQ(gpumem_stream_create(h.pool, &side), GPUMEM_SUCCESS) << last_error();

  void* tagged = h.tagged(MiB, 3);
  void* shared = h.tagged(MiB, shared_tag);
  int fd = -1;
  ASSERT_EQ(gpumem_export(h.pool, shared, &fd), GPUMEM_SUCCESS) << last_error();
  void* imported = nullptr;
  ASSERT_EQ(gpumem_import(h.pool, fd, MiB, &imported), GPUMEM_SUCCESS) << last_error();
  close(fd);

  std::uint64_t waits = 0;
  for (void* p : {tagged, imported, shared}) {
    ASSERT_EQ(gpumem_record_stream(h.pool, p, side), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(gpumem_record_stream(h.pool, static_cast<char*>(p) + 4096, side),
              GPUMEM_ERROR_INVALID_ARGUMENT);  // interior
    EXPECT_EQ(h.stats().cross_stream_waits, waits);
    ASSERT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(h.stats().cross_stream_waits, ++waits);
    EXPECT_EQ(gpumem_record_stream(h.pool, p, side), GPUMEM_ERROR_INVALID_ARGUMENT);  // freed
  }
  // A refused free of a recorded tagged allocation keeps the record.
  tagged = h.tagged(MiB, 3);
  ASSERT_EQ(gpumem_record_stream(h.pool, tagged, side), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, tagged, 2 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(gpumem_free(h.pool, tagged, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.stats().cross_stream_waits, waits + 2);  // at the refused try, and now
  EXPECT_EQ(gpumem_stream_destroy(h.pool, side), GPUMEM_SUCCESS) << last_error();
}

// With many tags, each free goes to the tag whose range holds it: untagged pointers to the
// untagged pool, each tag's to its own, whatever the order of the tags' ranges.
TEST(c_api_tags, frees_find_their_tag_among_many) {
  pool_handle h("platform:sim,sim_capacity:1G");  // a page for each of 300 tags
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  struct live {
    void* p;
    std::uint32_t tag;
  };
  std::vector<live> all;
  for (std::uint32_t t = 300; t > 0; --t) {
    if (t % 3 == 0) {
      all.push_back({gpumem_malloc(h.pool, 512, nullptr), 0});
      ASSERT_NE(all.back().p, nullptr);
    }
    all.push_back({h.tagged(512, t), t});
  }
  for (const live& a : all) {
    const std::uint64_t before = h.tag_stats(a.tag).live_allocations;
    ASSERT_EQ(gpumem_free(h.pool, a.p, 512, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(h.tag_stats(a.tag).live_allocations, before - 1) << "tag " << a.tag;
  }
  EXPECT_EQ(h.stats().live_allocations, 0u);
  // A pointer no tag holds is refused, as before any tag existed.
  int on_stack = 0;
  EXPECT_EQ(gpumem_free(h.pool, &on_stack, 4, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
}

std::uint64_t host_bytes(const pool_handle& h, std::uint32_t tag) {
  std::uint64_t out = ~std::uint64_t{0};
  EXPECT_EQ(gpumem_tag_host_bytes(h.pool, tag, &out), GPUMEM_SUCCESS) << last_error();
  return out;
}

// 20 offload cycles hold one host block of the tag's size; gpumem_release_host gives it
// back, refused while the tag sleeps with offload (its bytes live there), for the shared
// tag and for a tag never allocated in (which it does not make).
TEST(c_api_tags, offload_host_memory_stays_flat_and_is_released_on_request) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* p = h.tagged(6 * MiB, 2);
  static_cast<unsigned char*>(p)[12345] = 0x5a;
  EXPECT_EQ(host_bytes(h, 2), 0u);
  EXPECT_EQ(host_bytes(h, 9), 0u);
  std::uint64_t held = 0;
  for (int cycle = 0; cycle < 20; ++cycle) {
    ASSERT_EQ(gpumem_sleep(h.pool, 2, GPUMEM_SLEEP_OFFLOAD, nullptr), GPUMEM_SUCCESS) << last_error();
    if (cycle == 0) held = host_bytes(h, 2);
    EXPECT_EQ(host_bytes(h, 2), held);
    ASSERT_EQ(gpumem_wake(h.pool, 2, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(host_bytes(h, 2), held) << "cycle " << cycle;
  }
  EXPECT_GE(held, 6 * MiB);
  EXPECT_EQ(static_cast<unsigned char*>(p)[12345], 0x5a);

  std::uint64_t released = 1;
  ASSERT_EQ(gpumem_sleep(h.pool, 2, GPUMEM_SLEEP_OFFLOAD, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_release_host(h.pool, 2, &released), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("wake it first"), std::string::npos) << last_error();
  EXPECT_EQ(released, 0u);
  EXPECT_EQ(host_bytes(h, 2), held);
  ASSERT_EQ(gpumem_wake(h.pool, 2, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(static_cast<unsigned char*>(p)[12345], 0x5a);
  EXPECT_EQ(gpumem_release_host(h.pool, shared_tag, &released), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_release_host(h.pool, 9, &released), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("never allocated in"), std::string::npos) << last_error();
  EXPECT_EQ(h.tag_stats(9).allocations, 0u);

  ASSERT_EQ(gpumem_release_host(h.pool, 2, &released), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(released, held);
  EXPECT_EQ(host_bytes(h, 2), 0u);
  ASSERT_EQ(gpumem_release_host(h.pool, 2, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_tag_host_bytes(h.pool, 2, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(gpumem_free(h.pool, p, 6 * MiB, nullptr), GPUMEM_SUCCESS);
}

// A sequence set (the storage of GpumemCache(attention="contiguous")) made while a tag is
// the thread's current one takes its pages from that tag: they count in the tag's stats,
// not tag 0's; the tag's sleep is refused while the set holds them; once it is destroyed the
// tag's sleep gives them back to the device; a set made in a tag asleep is refused.
TEST(c_api_tags, kv_storage_made_under_a_tag_is_the_tags_and_sleeps_with_it) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  const gpumem_kv_layout layout{2, 2, 64, 16, GPUMEM_KV_BF16, 0};  // 1 KiB a token
  const std::uint32_t previous = gpumem_set_current_tag(4);
  gpumem_kv_vseqs* vs = nullptr;
  ASSERT_EQ(gpumem_kv_vseqs_create(h.pool, &layout, 16384, nullptr, &vs), GPUMEM_SUCCESS)
      << last_error();
  gpumem_set_current_tag(previous);  // growth stays in the set's tag whatever is current
  std::uint64_t seq = 0;
  ASSERT_EQ(gpumem_kv_vseqs_add(vs, 4096, &seq), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_kv_vseqs_append(vs, seq, 4096), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.tag_stats(4).reserved_bytes, 8 * MiB);
  EXPECT_EQ(h.tag_stats(0).reserved_bytes, 0u);
  EXPECT_EQ(gpumem_sleep(h.pool, 4, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("lent out"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_tag_asleep(h.pool, 4), 0);
  gpumem_kv_vseqs_destroy(vs);
  size_t free_before = 0, free_after = 0;
  ASSERT_EQ(gpumem_device_memory(h.pool, &free_before, nullptr), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_sleep(h.pool, 4, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_device_memory(h.pool, &free_after, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(free_after - free_before, 8 * MiB);
  EXPECT_EQ(h.tag_stats(4).reserved_bytes, 0u);

  gpumem_set_current_tag(4);
  gpumem_kv_vseqs* refused = reinterpret_cast<gpumem_kv_vseqs*>(1);
  EXPECT_EQ(gpumem_kv_vseqs_create(h.pool, &layout, 16384, nullptr, &refused),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(refused, nullptr);
  EXPECT_NE(last_error().find("asleep"), std::string::npos) << last_error();
  gpumem_set_current_tag(shared_tag);
  EXPECT_EQ(gpumem_kv_vseqs_create(h.pool, &layout, 16384, nullptr, &refused),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_set_current_tag(previous);
  ASSERT_EQ(gpumem_wake(h.pool, 4, nullptr), GPUMEM_SUCCESS) << last_error();
}

// Names are process-wide: a named tag is shown by name in refusals and in the explanation;
// a bad name, or a name for tag 0 or the shared tag, is refused and changes nothing.
TEST(c_api_tags, a_named_tag_is_shown_by_name_and_bad_names_are_refused) {
  constexpr std::uint32_t tag = 4242;
  ASSERT_EQ(gpumem_name_tag(tag, "train"), GPUMEM_SUCCESS) << last_error();
  pool_handle h(small_sim);
  void* p = h.tagged(MiB, tag);
  char text[1 << 14];
  ASSERT_GT(gpumem_pool_explain(h.pool, text, sizeof text), 0u) << last_error();
  EXPECT_NE(std::string(text).find("tag train (4242):"), std::string::npos) << text;
  gpumem_free(h.pool, p, MiB, nullptr);
  ASSERT_EQ(gpumem_sleep(h.pool, tag, GPUMEM_SLEEP_DISCARD, nullptr), GPUMEM_SUCCESS) << last_error();
  void* refused = nullptr;
  EXPECT_EQ(gpumem_allocate_tagged(h.pool, MiB, 256, nullptr, tag, &refused),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("tag train (4242) is asleep"), std::string::npos) << last_error();

  const std::string too_long(65, 'x');
  for (const char* bad : {"", too_long.c_str(), "a\tb", "caf\xc3\xa9"}) {
    EXPECT_EQ(gpumem_name_tag(tag, bad), GPUMEM_ERROR_INVALID_ARGUMENT) << bad;
    EXPECT_NE(last_error().find("gpumem_name_tag"), std::string::npos) << last_error();
  }
  EXPECT_EQ(gpumem_name_tag(tag, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_name_tag(0, "untagged"), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_name_tag(shared_tag, "weights"), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_allocate_tagged(h.pool, MiB, 256, nullptr, tag, &refused),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("tag train (4242) is asleep"), std::string::npos) << last_error();
  ASSERT_EQ(gpumem_name_tag(tag, std::string(64, 'y').c_str()), GPUMEM_SUCCESS);  // renames
  ASSERT_EQ(gpumem_name_tag(tag, "policy"), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_allocate_tagged(h.pool, MiB, 256, nullptr, tag, &refused),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("tag policy (4242) is asleep"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_wake(h.pool, tag, nullptr), GPUMEM_SUCCESS) << last_error();
}

// A thread that never set a tag follows the process tag (autograd's backward thread under
// gpumem.torch.tag(..., all_threads=True)); a thread that set one, 0 included, keeps it.
TEST(c_api_tags, threads_that_never_set_a_tag_follow_the_process_tag) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  const gpumem_kv_layout layout{2, 2, 64, 16, GPUMEM_KV_BF16, 0};  // 1 KiB a token
  ASSERT_EQ(gpumem_set_process_tag(6), 0u);
  std::uint32_t fresh_tag = 0, chosen_tag = 99;
  gpumem_kv_vseqs* vs = nullptr;
  gpumem_status made = GPUMEM_ERROR_INVALID_ARGUMENT;
  std::thread fresh([&] {
    fresh_tag = gpumem_current_tag();
    made = gpumem_kv_vseqs_create(h.pool, &layout, 16384, nullptr, &vs);
  });
  fresh.join();
  std::thread chose_untagged([&] {
    gpumem_set_current_tag(0);
    chosen_tag = gpumem_current_tag();
  });
  chose_untagged.join();
  EXPECT_EQ(gpumem_set_process_tag(0), 6u);
  EXPECT_EQ(fresh_tag, 6u);
  EXPECT_EQ(chosen_tag, 0u);
  ASSERT_EQ(made, GPUMEM_SUCCESS) << last_error();
  std::uint64_t seq = 0;
  ASSERT_EQ(gpumem_kv_vseqs_add(vs, 4096, &seq), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_kv_vseqs_append(vs, seq, 4096), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.tag_stats(6).reserved_bytes, 8 * MiB);  // the storage is tag 6's
  EXPECT_EQ(h.tag_stats(0).reserved_bytes, 0u);
  gpumem_kv_vseqs_destroy(vs);
  std::thread after([&] { fresh_tag = gpumem_current_tag(); });
  after.join();
  EXPECT_EQ(fresh_tag, 0u);
}

}  // namespace
