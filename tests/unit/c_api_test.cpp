// The C API's edge cases (gpumem/interop/gpumem.h): configuration errors, every bad free,
// out of memory, the thread-local last error, record_stream waits, null handles, handles
// used after gpumem_pool_destroy, reports, counters and snapshots. Pools use a private sim
// device (sim_capacity), so nothing here depends on a GPU or on another test's state.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/interop/gpumem.h"
#include "gpumem/platform/platform.hpp"
#include "gpumem/platform/sim_platform.hpp"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

std::string last_error() { return gpumem_last_error(); }

// A pool for one test, destroyed with it.
struct pool_handle {
  explicit pool_handle(const char* config) {
    status = gpumem_pool_create(config, &pool);
  }
  ~pool_handle() { gpumem_pool_destroy(pool); }
  gpumem_stats stats() const {
    gpumem_stats s{};
    EXPECT_EQ(gpumem_pool_stats(pool, &s), GPUMEM_SUCCESS) << last_error();
    return s;
  }
  gpumem_pool* pool = nullptr;
  gpumem_status status;
};

constexpr const char* small_sim = "platform:sim,sim_capacity:256M";

TEST(c_api, version_matches_the_header) {
  char expected[32];
  std::snprintf(expected, sizeof expected, "%d.%d.%d", GPUMEM_VERSION_MAJOR,
                GPUMEM_VERSION_MINOR, GPUMEM_VERSION_PATCH);
  EXPECT_STREQ(gpumem_version(), expected);
  EXPECT_EQ(gpumem_version_number(),
            GPUMEM_VERSION_MAJOR * 10000 + GPUMEM_VERSION_MINOR * 100 + GPUMEM_VERSION_PATCH);
}

TEST(c_api, status_names_are_distinct) {
  const gpumem_status all[] = {GPUMEM_SUCCESS, GPUMEM_ERROR_INVALID_ARGUMENT,
                               GPUMEM_ERROR_OUT_OF_MEMORY, GPUMEM_ERROR_CUDA,
                               GPUMEM_ERROR_NOT_SUPPORTED, GPUMEM_ERROR_INTERNAL};
  std::vector<std::string> names;
  for (auto s : all) names.emplace_back(gpumem_status_name(s));
  for (std::size_t i = 0; i < names.size(); ++i)
    for (std::size_t j = i + 1; j < names.size(); ++j) EXPECT_NE(names[i], names[j]);
  EXPECT_STREQ(gpumem_status_name(GPUMEM_ERROR_CUDA), "GPUMEM_ERROR_CUDA");
  EXPECT_STREQ(gpumem_status_name(static_cast<gpumem_status>(42)), "GPUMEM_ERROR_UNKNOWN");
}

TEST(c_api, bad_configurations_are_refused_naming_the_key) {
  struct bad {
    const char* config;
    const char* named;
  };
  const bad cases[] = {
      {"platform:sim,colour:blue", "colour"},
      {"platform:sim,allocator:bump", "bump"},
      {"platform:sim,backend:carrier_pigeon", "carrier_pigeon"},
      {"platform:quantum", "quantum"},
      {"platform:sim,device:one", "device"},
      {"platform:sim,device:-1", "device"},
      {"platform:sim,device:5", "device 5 does not exist"},
      {"platform:sim,limit:lots", "limit"},
      {"platform:sim,sim_capacity:0", "sim_capacity"},
      {"platform:cuda,sim_capacity:1G", "sim_capacity"},
      {"platform:sim,justakey", "justakey"},
      {"platform:sim,small_classes:3", "small_classes"},
  };
  for (const auto& c : cases) {
    gpumem_pool* pool = reinterpret_cast<gpumem_pool*>(0x1);  // must come back null
    EXPECT_EQ(gpumem_pool_create(c.config, &pool), GPUMEM_ERROR_INVALID_ARGUMENT) << c.config;
    EXPECT_EQ(pool, nullptr) << c.config;
    EXPECT_NE(last_error().find(c.named), std::string::npos) << c.config << ": " << last_error();
    EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);
  }
  EXPECT_EQ(gpumem_pool_create(small_sim, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
}

TEST(c_api, cuda_platform_without_a_device_is_a_cuda_error) {
  const std::string why = gpumem::cuda_unavailable_reason();
  if (why.empty()) GTEST_SKIP() << "a CUDA device is present: platform:cuda succeeds here";
  gpumem_pool* pool = nullptr;
  EXPECT_EQ(gpumem_pool_create("platform:cuda", &pool), GPUMEM_ERROR_CUDA);
  EXPECT_EQ(pool, nullptr);
  EXPECT_NE(last_error().find("gpumem_pool_create"), std::string::npos) << last_error();
}

TEST(c_api, empty_config_and_keys_choose_the_pool) {
  pool_handle vmm("platform:sim,sim_capacity:256M,limit:64M, big_chunk : 4");
  ASSERT_EQ(vmm.status, GPUMEM_SUCCESS) << last_error();
  EXPECT_STREQ(gpumem_pool_allocator(vmm.pool), "vmm_page_pool");
  EXPECT_STREQ(gpumem_pool_platform(vmm.pool), "sim");
  EXPECT_EQ(gpumem_pool_device(vmm.pool), 0);
  const std::string config = gpumem_pool_config(vmm.pool);
  EXPECT_NE(config.find("limit:67108864"), std::string::npos) << config;
  EXPECT_NE(config.find("big_chunk:4"), std::string::npos) << config;
  for (const char* backend : {"runtime", "driver", "vmm"}) {
    const std::string c = std::string(small_sim) + ",allocator:caching_pool,backend:" + backend;
    pool_handle caching(c.c_str());
    ASSERT_EQ(caching.status, GPUMEM_SUCCESS) << backend << ": " << last_error();
    EXPECT_STREQ(gpumem_pool_allocator(caching.pool), "caching_pool");
    void* p = gpumem_malloc(caching.pool, 5 * MiB, nullptr);
    ASSERT_NE(p, nullptr) << backend << ": " << last_error();
    std::memset(p, 0xab, 5 * MiB);
    EXPECT_EQ(gpumem_free(caching.pool, p, 5 * MiB, nullptr), GPUMEM_SUCCESS);
  }
}

TEST(c_api, every_bad_free_is_refused_and_the_allocation_stays_live) {
  pool_handle a(small_sim), b(small_sim);
  ASSERT_EQ(a.status, GPUMEM_SUCCESS);
  ASSERT_EQ(b.status, GPUMEM_SUCCESS);
  void* p = gpumem_malloc(a.pool, 4 * MiB, nullptr);
  void* q = gpumem_malloc(b.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr);
  ASSERT_NE(q, nullptr);
  std::memset(p, 0x3c, 4 * MiB);
  struct bad {
    void* ptr;
    std::size_t size;
    const char* reason;
  };
  int stack_object = 0;
  const bad cases[] = {
      {nullptr, 16, "null pointer"},
      {static_cast<char*>(p) + 512, 4 * MiB, "interior pointer"},
      {p, 4 * MiB - 1, "size mismatch"},
      {q, MiB, "vmm_page_pool"},  // another pool's: named as not this pool's
      {&stack_object, 4, "0x"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(gpumem_free(a.pool, c.ptr, c.size, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT)
        << c.reason;
    EXPECT_NE(last_error().find(c.reason), std::string::npos) << c.reason << ": " << last_error();
    EXPECT_NE(last_error().find("gpumem_free"), std::string::npos) << last_error();
  }
  const gpumem_stats s = a.stats();
  EXPECT_EQ(s.live_allocations, 1u);
  EXPECT_EQ(s.live_bytes, 4 * MiB);
  EXPECT_EQ(s.deallocations, 0u);
  EXPECT_EQ(static_cast<unsigned char*>(p)[4 * MiB - 1], 0x3c);
  EXPECT_EQ(gpumem_free(a.pool, p, 4 * MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(a.pool, p, 4 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("double free"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_free(b.pool, q, MiB, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, bad_sizes_and_alignments) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_malloc(h.pool, 0, nullptr), nullptr);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("0 bytes"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_malloc(h.pool, std::size_t{1} << 40, nullptr), nullptr);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);  // beyond the device
  void* out = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(gpumem_allocate(h.pool, 1024, 3, nullptr, &out), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_NE(last_error().find("alignment 3"), std::string::npos) << last_error();
  ASSERT_EQ(gpumem_allocate(h.pool, 1024, 4096, nullptr, &out), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(out) % 4096, 0u);
  EXPECT_EQ(gpumem_allocate(h.pool, 1024, 256, nullptr, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_free(h.pool, out, 1024, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().live_allocations, 0u);
}

TEST(c_api, out_of_memory_gives_its_code_the_report_and_keeps_state) {
  pool_handle h("platform:sim,sim_capacity:64M");
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* keep = gpumem_malloc(h.pool, 40 * MiB, nullptr);
  ASSERT_NE(keep, nullptr) << last_error();
  EXPECT_EQ(gpumem_malloc(h.pool, 40 * MiB, nullptr), nullptr);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_OUT_OF_MEMORY);
  const std::string report = last_error();
  EXPECT_EQ(report.rfind("gpumem: out of memory", 0), 0u) << report;
  EXPECT_NE(report.find("41943040 bytes"), std::string::npos) << report;
  // It ends with where the reserved bytes go (docs/TELEMETRY.md): here the 40 MiB live.
  const std::size_t where = report.find("where the reserved bytes go now:");
  ASSERT_NE(where, std::string::npos) << report;
  EXPECT_NE(report.find("reserved for 40.00 MiB requested", where), std::string::npos) << report;
  const gpumem_stats s = h.stats();
  EXPECT_EQ(s.oom_count, 1u);
  EXPECT_EQ(s.live_allocations, 1u);
  EXPECT_EQ(s.live_bytes, 40 * MiB);
  EXPECT_EQ(s.alloc_retries, 1u);
  // The report on demand, truncated into a small buffer: NUL-terminated, full length returned.
  char small[16];
  const std::size_t full = gpumem_pool_report(h.pool, 40 * MiB, small, sizeof small);
  EXPECT_GT(full, sizeof small);
  EXPECT_EQ(std::strlen(small), sizeof small - 1);
  EXPECT_EQ(gpumem_pool_report(h.pool, 40 * MiB, nullptr, 0), full);
  // gpumem_allocate's out-of-memory says the same.
  void* out = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(gpumem_allocate(h.pool, 40 * MiB, 256, nullptr, &out), GPUMEM_ERROR_OUT_OF_MEMORY);
  EXPECT_NE(last_error().find("where the reserved bytes go now:"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, keep, 40 * MiB, nullptr), GPUMEM_SUCCESS);
  void* again = gpumem_malloc(h.pool, 40 * MiB, nullptr);  // room again once freed
  EXPECT_NE(again, nullptr) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, again, 40 * MiB, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, small_classes_pass_through_to_the_pool) {
  pool_handle h("platform:sim,sim_capacity:256M,small_classes:4,small_cache:1M");
  ASSERT_EQ(h.status, GPUMEM_SUCCESS) << last_error();
  const std::string config = gpumem_pool_config(h.pool);
  EXPECT_NE(config.find("small_classes:4"), std::string::npos) << config;
  EXPECT_NE(config.find("small_cache:1048576"), std::string::npos) << config;
  void* p = gpumem_malloc(h.pool, 11 * 512, nullptr);  // class: 12 units of 512 B
  ASSERT_NE(p, nullptr) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, p, 11 * 512, nullptr), GPUMEM_SUCCESS);
  void* q = gpumem_malloc(h.pool, 12 * 512, nullptr);  // the same class: the same block
  EXPECT_EQ(q, p);
  EXPECT_EQ(h.stats().live_bytes, 12 * 512u);
  EXPECT_EQ(gpumem_free(h.pool, q, 12 * 512, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, stats_follow_allocations) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  gpumem_stats s = h.stats();
  EXPECT_EQ(s.allocations, 0u);
  EXPECT_EQ(s.fragmentation, 0.0);
  void* p = gpumem_malloc(h.pool, 3 * MiB, nullptr);
  void* q = gpumem_malloc(h.pool, 100, nullptr);
  s = h.stats();
  EXPECT_EQ(s.live_bytes, 3 * MiB + 100);
  EXPECT_EQ(s.live_allocations, 2u);
  EXPECT_EQ(s.allocations, 2u);
  EXPECT_GE(s.reserved_bytes, s.live_bytes);
  EXPECT_LT(s.cached_bytes, s.reserved_bytes);  // the live blocks are handed out
  gpumem_free(h.pool, p, 3 * MiB, nullptr);
  gpumem_free(h.pool, q, 100, nullptr);
  s = h.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.deallocations, 2u);
  EXPECT_EQ(s.peak_live_bytes, 3 * MiB + 100);
  EXPECT_EQ(s.cached_bytes, s.reserved_bytes);
  EXPECT_DOUBLE_EQ(s.fragmentation, static_cast<double>(s.peak_reserved_bytes) /
                                        static_cast<double>(s.peak_live_bytes));
  uint64_t released = 0;
  EXPECT_EQ(gpumem_pool_trim(h.pool, &released), GPUMEM_SUCCESS);
  EXPECT_EQ(released, s.reserved_bytes);
  EXPECT_EQ(h.stats().reserved_bytes, 0u);
  EXPECT_EQ(gpumem_pool_trim(h.pool, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, last_error_is_per_thread_and_success_keeps_it) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, nullptr, 1, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  const std::string mine = last_error();
  std::string theirs = "unset";
  gpumem_status their_status = GPUMEM_ERROR_INTERNAL;
  std::thread([&] {
    theirs = gpumem_last_error();
    their_status = gpumem_last_status();
  }).join();
  EXPECT_EQ(theirs, "");
  EXPECT_EQ(their_status, GPUMEM_SUCCESS);
  void* p = gpumem_malloc(h.pool, 4096, nullptr);  // success leaves the text as it was
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(last_error(), mine);
  EXPECT_EQ(gpumem_free(h.pool, p, 4096, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, threads_share_a_pool) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        const std::size_t size = 4096 * static_cast<std::size_t>(1 + (i + t) % 64);
        void* p = gpumem_malloc(h.pool, size, nullptr);
        if (p == nullptr) {
          ++errors;
          continue;
        }
        std::memset(p, t, size);
        if (gpumem_free(h.pool, p, size, nullptr) != GPUMEM_SUCCESS) ++errors;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors.load(), 0);
  const gpumem_stats s = h.stats();
  EXPECT_EQ(s.allocations, 800u);
  EXPECT_EQ(s.deallocations, 800u);
  EXPECT_EQ(s.live_bytes, 0u);
}

TEST(c_api, record_stream_makes_the_free_wait_for_the_recorded_streams) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* s1 = nullptr;
  void* s2 = nullptr;
  ASSERT_EQ(gpumem_stream_create(h.pool, &s1), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_stream_create(h.pool, &s2), GPUMEM_SUCCESS) << last_error();
  const std::uint64_t waits_before = 0;

  // Recorded on two other streams (one twice): the free on the default stream waits twice.
  void* p = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(gpumem_record_stream(h.pool, p, s1), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_record_stream(h.pool, p, s1), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_record_stream(h.pool, p, s2), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().cross_stream_waits, waits_before);  // nothing until the free
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().cross_stream_waits, 2u);

  // Recorded on the stream it is freed on: no wait needed.
  p = gpumem_malloc(h.pool, MiB, s1);
  EXPECT_EQ(gpumem_record_stream(h.pool, p, s1), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, s1), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().cross_stream_waits, 2u);

  // A refused free keeps the record: the corrected free still waits.
  p = gpumem_malloc(h.pool, MiB, nullptr);
  EXPECT_EQ(gpumem_record_stream(h.pool, p, s2), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, p, 2 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(h.stats().live_allocations, 1u);
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().cross_stream_waits, 4u);  // one at the refused try, one now

  // A freed pointer's record is gone: a new allocation at the same address does not wait.
  void* again = gpumem_malloc(h.pool, MiB, nullptr);
  EXPECT_EQ(gpumem_free(h.pool, again, MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(h.stats().cross_stream_waits, 4u);

  EXPECT_EQ(gpumem_record_stream(h.pool, nullptr, s1), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_stream_synchronize(h.pool, s1), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_stream_destroy(h.pool, s1), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_stream_destroy(h.pool, s2), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_stream_destroy(h.pool, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  // A stream the platform never made: the platform's refusal, as a CUDA error.
  EXPECT_EQ(gpumem_stream_synchronize(h.pool, reinterpret_cast<void*>(0xdead0)),
            GPUMEM_ERROR_CUDA);
  EXPECT_NE(last_error().find("gpumem_stream_synchronize"), std::string::npos) << last_error();
}

TEST(c_api, null_pool_handles_are_refused_everywhere) {
  gpumem_stats s{};
  void* out = reinterpret_cast<void*>(0x1);
  uint64_t value = 0;
  EXPECT_EQ(gpumem_malloc(nullptr, 16, nullptr), nullptr);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("null pool"), std::string::npos);
  EXPECT_EQ(gpumem_allocate(nullptr, 16, 256, nullptr, &out), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  EXPECT_EQ(gpumem_free(nullptr, &s, 16, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_record_stream(nullptr, &s, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_pool_stats(nullptr, &s), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_pool_trim(nullptr, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_pool_counter(nullptr, "cuMemMap", &value), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_stream_create(nullptr, &out), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_stream_destroy(nullptr, &s), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_stream_synchronize(nullptr, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_snapshot(nullptr, "x"), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_pool_report(nullptr, 1, nullptr, 0), 0u);
  EXPECT_EQ(gpumem_pool_explain(nullptr, nullptr, 0), 0u);
  EXPECT_STREQ(gpumem_pool_allocator(nullptr), "");
  EXPECT_STREQ(gpumem_pool_platform(nullptr), "");
  EXPECT_STREQ(gpumem_pool_config(nullptr), "");
  EXPECT_EQ(gpumem_pool_device(nullptr), -1);
  gpumem_pool_destroy(nullptr);
}

TEST(c_api, explain_says_where_the_reserved_bytes_go) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* base = gpumem_malloc(h.pool, 64 * MiB, nullptr);
  void* p = gpumem_malloc(h.pool, 5 * MiB + 1000, nullptr);  // a 6 MiB block: whole pages
  ASSERT_NE(p, nullptr) << last_error();
  const std::size_t full = gpumem_pool_explain(h.pool, nullptr, 0);
  ASSERT_GT(full, 0u) << last_error();
  std::string text(full + 1, '\0');
  EXPECT_EQ(gpumem_pool_explain(h.pool, text.data(), text.size()), full);
  text.resize(full);
  EXPECT_NE(text.find("vmm_page_pool: "), std::string::npos) << text;
  EXPECT_NE(text.find("1 x 5.00 MiB in 6.00 MiB blocks"), std::string::npos) << text;
  EXPECT_NE(text.find("free whole pages"), std::string::npos) << text;
  char small[16];
  EXPECT_EQ(gpumem_pool_explain(h.pool, small, sizeof small), full);
  EXPECT_EQ(std::strlen(small), sizeof small - 1);
  EXPECT_EQ(gpumem_free(h.pool, p, 5 * MiB + 1000, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_free(h.pool, base, 64 * MiB, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, counters_name_driver_calls_and_pages) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  uint64_t maps = 0, pages = 0, page_size = 0;
  void* p = gpumem_malloc(h.pool, 5 * MiB, nullptr);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(gpumem_pool_counter(h.pool, "cuMemMap", &maps), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_pool_counter(h.pool, "pages_mapped", &pages), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_pool_counter(h.pool, "page_size", &page_size), GPUMEM_SUCCESS);
  EXPECT_EQ(page_size, 2 * MiB);
  EXPECT_EQ(pages, 3u);  // 5 MiB in 2 MiB pages
  EXPECT_GE(maps, 1u);
  EXPECT_EQ(gpumem_pool_counter(h.pool, "no_such_counter", &maps), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("no_such_counter"), std::string::npos);
  EXPECT_EQ(gpumem_pool_counter(h.pool, nullptr, &maps), GPUMEM_ERROR_INVALID_ARGUMENT);
  // The remap budget's: nothing gathered, nothing raised, no slack.
  uint64_t remap_ns = 1, slack = 1, raises = 1;
  EXPECT_EQ(gpumem_pool_counter(h.pool, "remap_ns", &remap_ns), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_pool_counter(h.pool, "growth_slack_permille", &slack), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_pool_counter(h.pool, "slack_raises", &raises), GPUMEM_SUCCESS);
  EXPECT_EQ(remap_ns, 0u);
  EXPECT_EQ(slack, 0u);
  EXPECT_EQ(raises, 0u);
  // Lifetime hints (on by default, with footprint:tight): guessing, and nothing guessed
  // long-lived from one request (a key's first two requests never are) nor moved. Off with
  // the default footprint:fast.
  uint64_t long_lived = 1, moved = 1, active = 0;
  EXPECT_EQ(gpumem_pool_counter(h.pool, "lifetime_hints_active", &active), GPUMEM_SUCCESS);
  EXPECT_EQ(active, 0u);
  pool_handle tight("platform:sim,sim_capacity:256M,footprint:tight");
  ASSERT_EQ(tight.status, GPUMEM_SUCCESS) << last_error();
  void* in_tight = gpumem_malloc(tight.pool, 5 * MiB, nullptr);
  ASSERT_NE(in_tight, nullptr);
  EXPECT_EQ(gpumem_pool_counter(tight.pool, "long_lived_allocations", &long_lived), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_pool_counter(tight.pool, "long_lived_pages_moved", &moved), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_pool_counter(tight.pool, "lifetime_hints_active", &active), GPUMEM_SUCCESS);
  uint64_t handed = 1;
  EXPECT_EQ(gpumem_pool_counter(tight.pool, "long_lived_bytes_handed_over", &handed), GPUMEM_SUCCESS);
  EXPECT_EQ(handed, 0u);
  EXPECT_EQ(long_lived, 0u);
  EXPECT_EQ(moved, 0u);
  EXPECT_EQ(active, 1u);
  EXPECT_EQ(gpumem_free(tight.pool, in_tight, 5 * MiB, nullptr), GPUMEM_SUCCESS);
  pool_handle no_hints("platform:sim,sim_capacity:256M,lifetime_hints:off");
  ASSERT_EQ(no_hints.status, GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_pool_counter(no_hints.pool, "lifetime_hints_active", &active), GPUMEM_SUCCESS);
  EXPECT_EQ(active, 0u);
  EXPECT_EQ(gpumem_free(h.pool, p, 5 * MiB, nullptr), GPUMEM_SUCCESS);
  pool_handle slack_set("platform:sim,sim_capacity:256M,growth_slack:0.05");
  ASSERT_EQ(slack_set.status, GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_pool_counter(slack_set.pool, "growth_slack_permille", &slack), GPUMEM_SUCCESS);
  EXPECT_EQ(slack, 50u);

  pool_handle caching("platform:sim,sim_capacity:256M,allocator:caching_pool");
  ASSERT_EQ(caching.status, GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_pool_counter(caching.pool, "pages_mapped", &pages),
            GPUMEM_ERROR_INVALID_ARGUMENT);  // a caching pool has no pages
  uint64_t mallocs = 0;
  void* q = gpumem_malloc(caching.pool, MiB, nullptr);
  EXPECT_EQ(gpumem_pool_counter(caching.pool, "cudaMalloc", &mallocs), GPUMEM_SUCCESS);
  EXPECT_EQ(mallocs, 1u);
  EXPECT_EQ(gpumem_free(caching.pool, q, MiB, nullptr), GPUMEM_SUCCESS);
}

// Counts are the pool's own, even on a shared platform; ".ns" gives the time in those calls.
TEST(c_api, counters_count_and_time_this_pools_calls) {
  pool_handle quiet("platform:sim");  // the process-wide sim platform, shared
  pool_handle busy("platform:sim");
  ASSERT_EQ(quiet.status, GPUMEM_SUCCESS);
  ASSERT_EQ(busy.status, GPUMEM_SUCCESS);
  void* p = gpumem_malloc(busy.pool, 5 * MiB, nullptr);
  ASSERT_NE(p, nullptr);
  uint64_t maps = 0, quiet_maps = 7, map_ns = 0, access_ns = 0, all_ns = 0, unused_ns = 7;
  ASSERT_EQ(gpumem_pool_counter(busy.pool, "cuMemMap", &maps), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_pool_counter(quiet.pool, "cuMemMap", &quiet_maps), GPUMEM_SUCCESS);
  EXPECT_EQ(maps, 1u);  // footprint:fast: one handle for the 3 pages of a 5 MiB growth
  EXPECT_EQ(quiet_maps, 0u) << "another pool's calls were counted";
  ASSERT_EQ(gpumem_pool_counter(busy.pool, "cuMemMap.ns", &map_ns), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_pool_counter(busy.pool, "cuMemSetAccess.ns", &access_ns), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_pool_counter(busy.pool, "driver_ns", &all_ns), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_pool_counter(busy.pool, "cudaMalloc.ns", &unused_ns), GPUMEM_SUCCESS);
  EXPECT_GT(map_ns, 0u);
  EXPECT_GE(all_ns, map_ns + access_ns);
  EXPECT_EQ(unused_ns, 0u);
  EXPECT_EQ(gpumem_pool_counter(busy.pool, "cuNoSuchCall.ns", &all_ns), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("cuNoSuchCall"), std::string::npos);
  EXPECT_EQ(gpumem_free(busy.pool, p, 5 * MiB, nullptr), GPUMEM_SUCCESS);
}

// gpumem_pool_mark_step: a loop of equal steps is served from a step plan (counters say
// so); with step_plan:off the mark is accepted and nothing is planned.
TEST(c_api, marked_steps_are_served_from_a_plan) {
  auto run = [](gpumem_pool* pool, int steps) {
    for (int s = 0; s < steps; ++s) {
      ASSERT_EQ(gpumem_pool_mark_step(pool), GPUMEM_SUCCESS) << last_error();
      void* a = gpumem_malloc(pool, 3 * MiB, nullptr);
      void* b = gpumem_malloc(pool, 5 * MiB, nullptr);
      ASSERT_NE(a, nullptr);
      ASSERT_NE(b, nullptr);
      ASSERT_EQ(gpumem_free(pool, a, 3 * MiB, nullptr), GPUMEM_SUCCESS);
      ASSERT_EQ(gpumem_free(pool, b, 5 * MiB, nullptr), GPUMEM_SUCCESS);
    }
  };
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  EXPECT_NE(std::string(gpumem_pool_config(h.pool)).find("step_plan:on"), std::string::npos);
  run(h.pool, 6);
  uint64_t planned = 0, built = 0, region = 0;
  ASSERT_EQ(gpumem_pool_counter(h.pool, "planned_allocations", &planned), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_pool_counter(h.pool, "plans_built", &built), GPUMEM_SUCCESS);
  ASSERT_EQ(gpumem_pool_counter(h.pool, "plan_region_bytes", &region), GPUMEM_SUCCESS);
  EXPECT_EQ(built, 1u);
  EXPECT_EQ(planned, 2u * 4u);  // marks 3..6 begin planned steps
  EXPECT_EQ(region, 8 * MiB);
  const gpumem_stats s = h.stats();
  EXPECT_EQ(s.live_bytes, 0u);
  EXPECT_EQ(s.peak_live_bytes, 8 * MiB);

  pool_handle off("platform:sim,sim_capacity:256M,step_plan:off");
  ASSERT_EQ(off.status, GPUMEM_SUCCESS);
  run(off.pool, 6);
  EXPECT_EQ(gpumem_pool_counter(off.pool, "planned_allocations", &planned),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_pool_mark_step(nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);

  pool_handle bad("platform:sim,sim_capacity:256M,step_plan:maybe");
  EXPECT_EQ(bad.status, GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("step_plan"), std::string::npos);
}

TEST(c_api, snapshot_writes_a_pickle_or_says_it_cannot) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* p = gpumem_malloc(h.pool, 3 * MiB, nullptr);
  EXPECT_EQ(gpumem_snapshot(h.pool, ""), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gpumem_snapshot(h.pool, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  const std::string path = ::testing::TempDir() + "c_api_snapshot.pickle";
  const gpumem_status st = gpumem_snapshot(h.pool, path.c_str());
  if (st == GPUMEM_ERROR_NOT_SUPPORTED) {
    EXPECT_NE(last_error().find("snapshot"), std::string::npos);
  } else {
    ASSERT_EQ(st, GPUMEM_SUCCESS) << last_error();
    std::ifstream in(path, std::ios::binary);
    char head[2] = {};
    in.read(head, 2);
    EXPECT_EQ(static_cast<unsigned char>(head[0]), 0x80u);  // pickle PROTO opcode
    EXPECT_EQ(head[1], 2);                                  // protocol 2
    std::remove(path.c_str());
    EXPECT_EQ(gpumem_snapshot(h.pool, "/nonexistent-dir/x.pickle"), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(last_error().find("/nonexistent-dir/x.pickle"), std::string::npos) << last_error();
  }
  EXPECT_EQ(gpumem_free(h.pool, p, 3 * MiB, nullptr), GPUMEM_SUCCESS);
}

TEST(c_api, destroying_a_pool_with_live_allocations_frees_them) {
  gpumem_pool* pool = nullptr;
  ASSERT_EQ(gpumem_pool_create("platform:sim,sim_capacity:64M", &pool), GPUMEM_SUCCESS);
  ASSERT_NE(gpumem_malloc(pool, 40 * MiB, nullptr), nullptr);
  gpumem_pool_destroy(pool);  // the private sim device goes with it; nothing may leak (ASan)
  // Creating pools after a destroy with live memory still works.
  ASSERT_EQ(gpumem_pool_create("platform:sim,sim_capacity:64M", &pool), GPUMEM_SUCCESS);
  void* p = gpumem_malloc(pool, 40 * MiB, nullptr);
  EXPECT_NE(p, nullptr) << last_error();
  gpumem_pool_destroy(pool);
}

// Every entry point, on a handle already destroyed: refused with the typed error and a
// text naming the call and saying the pool was destroyed; nothing of the pool is read.
void expect_every_call_refused_after_destroy(const char* config) {
  SCOPED_TRACE(config);
  gpumem_pool* pool = nullptr;
  ASSERT_EQ(gpumem_pool_create(config, &pool), GPUMEM_SUCCESS) << last_error();
  void* live = gpumem_malloc(pool, 3 * MiB, nullptr);  // freed with the pool
  ASSERT_NE(live, nullptr) << last_error();
  void* stream = nullptr;
  ASSERT_EQ(gpumem_stream_create(pool, &stream), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_stream_destroy(pool, stream), GPUMEM_SUCCESS) << last_error();
  gpumem_pool_destroy(pool);

  auto refused = [&](const char* call) {
    EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT) << call;
    EXPECT_NE(last_error().find(call), std::string::npos) << last_error();
    EXPECT_NE(last_error().find("was destroyed"), std::string::npos) << last_error();
  };
  gpumem_stats s{};
  void* out = reinterpret_cast<void*>(0x1);
  uint64_t value = 7;
  char buf[16] = "untouched";

  EXPECT_EQ(gpumem_malloc(pool, 16, nullptr), nullptr);
  refused("gpumem_malloc");
  EXPECT_EQ(gpumem_allocate(pool, 16, 256, nullptr, &out), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  refused("gpumem_allocate");
  EXPECT_EQ(gpumem_free(pool, live, 3 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_free");
  EXPECT_EQ(gpumem_record_stream(pool, live, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_record_stream");
  EXPECT_EQ(gpumem_pool_stats(pool, &s), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_pool_stats");
  EXPECT_EQ(gpumem_pool_counter(pool, "cuMemMap", &value), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(value, 7u);
  refused("gpumem_pool_counter");
  EXPECT_EQ(gpumem_pool_trim(pool, &value), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_pool_trim");
  EXPECT_EQ(gpumem_pool_report(pool, 1, buf, sizeof buf), 0u);
  EXPECT_STREQ(buf, "untouched");
  refused("gpumem_pool_report");
  EXPECT_EQ(gpumem_pool_explain(pool, buf, sizeof buf), 0u);
  EXPECT_STREQ(buf, "untouched");
  refused("gpumem_pool_explain");
  out = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(gpumem_stream_create(pool, &out), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(out, nullptr);
  refused("gpumem_stream_create");
  EXPECT_EQ(gpumem_stream_destroy(pool, stream), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_stream_destroy");
  EXPECT_EQ(gpumem_stream_synchronize(pool, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_stream_synchronize");
  const std::string path = ::testing::TempDir() + "c_api_destroyed.pickle";
  EXPECT_EQ(gpumem_snapshot(pool, path.c_str()), GPUMEM_ERROR_INVALID_ARGUMENT);
  refused("gpumem_snapshot");
  EXPECT_FALSE(std::ifstream(path).good()) << "a snapshot of a destroyed pool was written";
  EXPECT_STREQ(gpumem_pool_allocator(pool), "");
  refused("gpumem_pool_allocator");
  EXPECT_STREQ(gpumem_pool_platform(pool), "");
  refused("gpumem_pool_platform");
  EXPECT_STREQ(gpumem_pool_config(pool), "");
  refused("gpumem_pool_config");
  EXPECT_EQ(gpumem_pool_device(pool), -1);
  refused("gpumem_pool_device");
  gpumem_pool_destroy(pool);
  refused("gpumem_pool_destroy");
}

TEST(c_api, every_call_on_a_destroyed_vmm_page_pool_is_refused_saying_so) {
  expect_every_call_refused_after_destroy(small_sim);
}

TEST(c_api, every_call_on_a_destroyed_caching_pool_is_refused_saying_so) {
  expect_every_call_refused_after_destroy(
      "platform:sim,sim_capacity:256M,allocator:caching_pool");
}

TEST(c_api, a_second_destroy_is_refused_and_other_pools_are_untouched) {
  pool_handle other(small_sim);
  ASSERT_EQ(other.status, GPUMEM_SUCCESS);
  void* kept = gpumem_malloc(other.pool, MiB, nullptr);
  ASSERT_NE(kept, nullptr);
  const gpumem_stats before = other.stats();

  gpumem_pool* pool = nullptr;
  ASSERT_EQ(gpumem_pool_create(small_sim, &pool), GPUMEM_SUCCESS);
  void* stale = gpumem_malloc(pool, MiB, nullptr);
  ASSERT_NE(stale, nullptr);
  gpumem_pool_destroy(pool);
  gpumem_pool_destroy(pool);
  EXPECT_EQ(gpumem_last_status(), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("gpumem_pool_destroy"), std::string::npos) << last_error();
  EXPECT_NE(last_error().find("was destroyed"), std::string::npos) << last_error();

  // The dead pool's pointer given to a live pool: refused, that pool as it was.
  EXPECT_EQ(gpumem_free(other.pool, stale, MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  const gpumem_stats after = other.stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.live_allocations, before.live_allocations);
  EXPECT_EQ(after.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(after.deallocations, before.deallocations);

  // A handle is never reused, so the dead one stays dead while new pools come and go.
  for (int i = 0; i < 8; ++i) {
    gpumem_pool* fresh = nullptr;
    ASSERT_EQ(gpumem_pool_create(small_sim, &fresh), GPUMEM_SUCCESS);
    EXPECT_NE(fresh, pool);
    gpumem_pool_destroy(fresh);
  }
  EXPECT_EQ(gpumem_malloc(pool, 16, nullptr), nullptr);
  EXPECT_NE(last_error().find("was destroyed"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_free(other.pool, kept, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
}

TEST(c_api, racing_destroys_of_one_pool_free_it_once) {
  for (int round = 0; round < 20; ++round) {
    gpumem_pool* pool = nullptr;
    ASSERT_EQ(gpumem_pool_create("platform:sim,sim_capacity:64M", &pool), GPUMEM_SUCCESS);
    ASSERT_NE(gpumem_malloc(pool, MiB, nullptr), nullptr);
    std::atomic<int> refused{0};
    std::atomic<bool> go{false};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&] {
        while (!go.load()) {
        }
        gpumem_pool_destroy(pool);  // a fresh thread's status is GPUMEM_SUCCESS
        if (gpumem_last_status() == GPUMEM_ERROR_INVALID_ARGUMENT) refused.fetch_add(1);
      });
    go.store(true);
    for (auto& t : threads) t.join();
    EXPECT_EQ(refused.load(), 3) << "exactly one destroy may win";
  }
}



// gpumem_record_stream on a pointer that is no live allocation is refused, and leaves no
// record behind for the next allocation at that address.
TEST(c_api, record_stream_refuses_pointers_that_are_not_live_allocations) {
  for (const char* config : {small_sim, "platform:sim,sim_capacity:256M,allocator:caching_pool",
                             "platform:sim,sim_capacity:256M,step_plan:off"}) {
    SCOPED_TRACE(config);
    pool_handle h(config);
    ASSERT_EQ(h.status, GPUMEM_SUCCESS) << last_error();
    void* s1 = nullptr;
    ASSERT_EQ(gpumem_stream_create(h.pool, &s1), GPUMEM_SUCCESS) << last_error();

    void* p = gpumem_malloc(h.pool, MiB, nullptr);
    ASSERT_NE(p, nullptr) << last_error();
    // Inside the allocation, and an address the pool never handed out.
    EXPECT_EQ(gpumem_record_stream(h.pool, static_cast<char*>(p) + 512, s1),
              GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(last_error().find("not a live allocation"), std::string::npos) << last_error();
    EXPECT_EQ(gpumem_record_stream(h.pool, reinterpret_cast<void*>(0x1000), s1),
              GPUMEM_ERROR_INVALID_ARGUMENT);
    ASSERT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    // Already freed: refused, and the next allocation at that address carries no record
    // (its free on the default stream waits for nothing).
    EXPECT_EQ(gpumem_record_stream(h.pool, p, s1), GPUMEM_ERROR_INVALID_ARGUMENT);
    void* again = gpumem_malloc(h.pool, MiB, nullptr);
    ASSERT_EQ(again, p) << "the pool reuses the freed block on its stream";
    EXPECT_EQ(gpumem_free(h.pool, again, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(h.stats().cross_stream_waits, 0u);
    EXPECT_EQ(gpumem_stream_destroy(h.pool, s1), GPUMEM_SUCCESS) << last_error();
  }
}

// A stream the platform does not know is refused at record time, so it cannot make the
// allocation's free fail later.
TEST(c_api, record_stream_refuses_a_stream_the_platform_refuses) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* p = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(gpumem_record_stream(h.pool, p, reinterpret_cast<void*>(0x1234)),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("0x1234"), std::string::npos) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.stats().live_allocations, 0u);
}

// A free on a stream the platform refuses, of a recorded allocation: refused, the
// allocation stays live with its record, and the free on a good stream then waits.
TEST(c_api, a_free_of_a_recorded_allocation_on_a_bad_stream_changes_nothing) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* s1 = nullptr;
  ASSERT_EQ(gpumem_stream_create(h.pool, &s1), GPUMEM_SUCCESS) << last_error();
  void* p = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(gpumem_record_stream(h.pool, p, s1), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, reinterpret_cast<void*>(0x1234)),
            GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(last_error().find("0x1234"), std::string::npos) << last_error();
  EXPECT_EQ(h.stats().live_allocations, 1u);
  EXPECT_EQ(h.stats().cross_stream_waits, 0u);
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.stats().cross_stream_waits, 1u);
  void* q = gpumem_malloc(h.pool, 4 * MiB, nullptr);
  EXPECT_NE(q, nullptr) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, q, 4 * MiB, nullptr), GPUMEM_SUCCESS) << last_error();
  uint64_t released = 0;
  EXPECT_EQ(gpumem_pool_trim(h.pool, &released), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_stream_destroy(h.pool, s1), GPUMEM_SUCCESS) << last_error();
}

// A recorded stream destroyed before the allocation's free: the free still completes.
// Through gpumem_stream_destroy the destroy waits for the stream and drops its records;
// destroyed elsewhere (here: a stream of another pool on the same sim platform, destroyed
// there, so the pool is not told), the free finds it gone and drops the record.
TEST(c_api, a_recorded_stream_destroyed_before_the_free_does_not_block_the_free) {
  pool_handle h("platform:sim");
  pool_handle other("platform:sim");
  ASSERT_EQ(h.status, GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(other.status, GPUMEM_SUCCESS) << last_error();

  void* s1 = nullptr;
  ASSERT_EQ(gpumem_stream_create(h.pool, &s1), GPUMEM_SUCCESS) << last_error();
  void* p = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  ASSERT_EQ(gpumem_record_stream(h.pool, p, s1), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_stream_destroy(h.pool, s1), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.stats().live_allocations, 0u);
  EXPECT_EQ(h.stats().cross_stream_waits, 0u);

  void* s2 = nullptr;
  void* s3 = nullptr;
  ASSERT_EQ(gpumem_stream_create(other.pool, &s2), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_stream_create(h.pool, &s3), GPUMEM_SUCCESS) << last_error();
  p = gpumem_malloc(h.pool, MiB, nullptr);
  ASSERT_NE(p, nullptr) << last_error();
  ASSERT_EQ(gpumem_record_stream(h.pool, p, s2), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_record_stream(h.pool, p, s3), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_stream_synchronize(other.pool, s2), GPUMEM_SUCCESS) << last_error();
  ASSERT_EQ(gpumem_stream_destroy(other.pool, s2), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(gpumem_free(h.pool, p, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
  EXPECT_EQ(h.stats().live_allocations, 0u);
  EXPECT_EQ(h.stats().cross_stream_waits, 1u);  // s3's, not the destroyed s2's
  EXPECT_EQ(gpumem_stream_destroy(h.pool, s3), GPUMEM_SUCCESS) << last_error();
}

// A stream made through a pool and never destroyed dies with the pool: once the handle is
// gone nothing could destroy it, and a pool destroyed with a live allocation on such a
// stream left the stream behind (a sim stream, or a CUDA stream's host and driver memory).
TEST(c_api, streams_a_pool_made_die_with_it) {
  auto* sim = dynamic_cast<gpumem::sim_platform*>(&gpumem::platform_by_name("sim"));
  ASSERT_NE(sim, nullptr);
  const std::size_t before = sim->live_objects().streams;
  for (const char* config : {"platform:sim", "platform:sim,allocator:caching_pool"}) {
    SCOPED_TRACE(config);
    for (int i = 0; i < 4; ++i) {
      gpumem_pool* pool = nullptr;
      ASSERT_EQ(gpumem_pool_create(config, &pool), GPUMEM_SUCCESS) << last_error();
      void* s = nullptr;
      void* gone = nullptr;
      ASSERT_EQ(gpumem_stream_create(pool, &s), GPUMEM_SUCCESS) << last_error();
      ASSERT_EQ(gpumem_stream_create(pool, &gone), GPUMEM_SUCCESS) << last_error();
      ASSERT_EQ(gpumem_stream_destroy(pool, gone), GPUMEM_SUCCESS) << last_error();
      EXPECT_NE(gpumem_malloc(pool, MiB, s), nullptr) << last_error();  // live at destroy
      EXPECT_NE(gpumem_malloc(pool, 1000, s), nullptr) << last_error();
      EXPECT_EQ(sim->live_objects().streams, before + 1);
      gpumem_pool_destroy(pool);
      EXPECT_EQ(sim->live_objects().streams, before);
    }
  }
  EXPECT_TRUE(sim->is_valid()) << sim->validate();
}

// A free on a stream the platform refuses is refused, changing nothing: the allocation
// stays live, a free on its own stream then succeeds, and the pool keeps allocating and
// trimming. (The pool refuses the stream; with step_plan:on the planner passes it on.)
TEST(c_api, a_free_on_a_stream_the_platform_refuses_changes_nothing) {
  for (const char* config : {small_sim, "platform:sim,sim_capacity:256M,allocator:caching_pool",
                             "platform:sim,sim_capacity:256M,step_plan:off"}) {
    SCOPED_TRACE(config);
    pool_handle h(config);
    ASSERT_EQ(h.status, GPUMEM_SUCCESS) << last_error();
    void* s = nullptr;
    ASSERT_EQ(gpumem_stream_create(h.pool, &s), GPUMEM_SUCCESS) << last_error();
    for (void* alloc_stream : {static_cast<void*>(nullptr), s}) {
      void* p = gpumem_malloc(h.pool, 3 * MiB, alloc_stream);
      ASSERT_NE(p, nullptr) << last_error();
      EXPECT_NE(gpumem_free(h.pool, p, 3 * MiB, reinterpret_cast<void*>(0x1234)), GPUMEM_SUCCESS);
      EXPECT_EQ(h.stats().live_allocations, 1u);
      EXPECT_EQ(gpumem_free(h.pool, p, 3 * MiB, alloc_stream), GPUMEM_SUCCESS) << last_error();
      for (void* any : {static_cast<void*>(nullptr), s}) {
        void* q = gpumem_malloc(h.pool, 5 * MiB, any);
        EXPECT_NE(q, nullptr) << last_error();
        EXPECT_EQ(gpumem_free(h.pool, q, 5 * MiB, any), GPUMEM_SUCCESS) << last_error();
      }
      uint64_t released = 0;
      EXPECT_EQ(gpumem_pool_trim(h.pool, &released), GPUMEM_SUCCESS) << last_error();
    }
    EXPECT_EQ(gpumem_stream_destroy(h.pool, s), GPUMEM_SUCCESS) << last_error();
  }
}

// Planned allocations (served from a step plan's region, not the pool's own blocks) are
// live allocations for record_stream too; their interior and freed addresses are not.
TEST(c_api, record_stream_accepts_planned_allocations) {
  pool_handle h(small_sim);
  ASSERT_EQ(h.status, GPUMEM_SUCCESS);
  void* s1 = nullptr;
  ASSERT_EQ(gpumem_stream_create(h.pool, &s1), GPUMEM_SUCCESS) << last_error();
  std::uint64_t waits = 0;
  for (int step = 0; step < 6; ++step) {
    ASSERT_EQ(gpumem_pool_mark_step(h.pool), GPUMEM_SUCCESS) << last_error();
    void* a = gpumem_malloc(h.pool, 3 * MiB, nullptr);
    void* b = gpumem_malloc(h.pool, 5 * MiB, nullptr);
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(gpumem_record_stream(h.pool, b, s1), GPUMEM_SUCCESS) << "step " << step << ": " << last_error();
    EXPECT_EQ(gpumem_record_stream(h.pool, static_cast<char*>(b) + MiB, s1),
              GPUMEM_ERROR_INVALID_ARGUMENT);
    ASSERT_EQ(gpumem_free(h.pool, a, 3 * MiB, nullptr), GPUMEM_SUCCESS);
    ASSERT_EQ(gpumem_free(h.pool, b, 5 * MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(gpumem_record_stream(h.pool, b, s1), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(h.stats().cross_stream_waits, ++waits);
  }
  uint64_t planned = 0;
  ASSERT_EQ(gpumem_pool_counter(h.pool, "planned_allocations", &planned), GPUMEM_SUCCESS);
  EXPECT_GT(planned, 0u) << "some steps ran on the plan";
  EXPECT_EQ(gpumem_stream_destroy(h.pool, s1), GPUMEM_SUCCESS) << last_error();
}

// The budget through the C API: the smallest of the bytes set, the limit and the device's
// memory less headroom; 0 removes it; another allocator has none.
TEST(c_api, pool_budget_is_set_and_read_back_and_only_a_page_pool_has_one) {
  gpumem_pool* pool = nullptr;
  ASSERT_EQ(gpumem_pool_create("platform:sim,sim_capacity:256M,limit:128M", &pool), GPUMEM_SUCCESS);
  uint64_t budget = 0;
  ASSERT_EQ(gpumem_pool_set_budget(pool, 64 << 20, &budget), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_EQ(budget, uint64_t{64} << 20);
  ASSERT_EQ(gpumem_pool_set_budget(pool, uint64_t{1} << 40, &budget), GPUMEM_SUCCESS);
  EXPECT_EQ(budget, uint64_t{128} << 20);  // the limit is smaller
  ASSERT_EQ(gpumem_pool_set_budget(pool, 0, &budget), GPUMEM_SUCCESS);
  EXPECT_EQ(budget, uint64_t{128} << 20);
  EXPECT_EQ(gpumem_pool_set_budget(nullptr, 1, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  gpumem_pool_destroy(pool);
  ASSERT_EQ(gpumem_pool_create("platform:sim,allocator:caching_pool", &pool), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_pool_set_budget(pool, 1 << 20, &budget), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gpumem_last_error()).find("vmm_page_pool"), std::string::npos);
  gpumem_pool_destroy(pool);
}

// gpumem_allocate_at takes back memory freed earlier at its own address (a CUDA graph
// tree's checkpoint restored), in both pools: the bytes between neighbours, a piece of a
// larger free block, a block another stream freed; refused where the range is live,
// straddles a live block, was given back to the driver, or is not the pool's.
TEST(c_api, allocate_at_takes_back_freed_memory_at_its_address) {
  for (const char* config : {"platform:sim,sim_capacity:256M,allocator:vmm_page_pool",
                             "platform:sim,sim_capacity:256M,allocator:caching_pool"}) {
    SCOPED_TRACE(config);
    pool_handle h(config);
    ASSERT_EQ(h.status, GPUMEM_SUCCESS) << last_error();
    void* a = gpumem_malloc(h.pool, 4 * MiB, nullptr);
    void* b = gpumem_malloc(h.pool, 4 * MiB, nullptr);
    void* c = gpumem_malloc(h.pool, 4 * MiB, nullptr);
    ASSERT_TRUE(a != nullptr && b != nullptr && c != nullptr) << last_error();
    ASSERT_EQ(gpumem_free(h.pool, b, 4 * MiB, nullptr), GPUMEM_SUCCESS);
    const gpumem_stats before = h.stats();

    // Refusals change nothing.
    EXPECT_EQ(gpumem_allocate_at(h.pool, a, 4 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(last_error().find("not free in one block"), std::string::npos) << last_error();
    EXPECT_EQ(gpumem_allocate_at(h.pool, b, 8 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(gpumem_allocate_at(h.pool, nullptr, MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(gpumem_allocate_at(h.pool, b, 0, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    int stack_byte = 0;
    EXPECT_EQ(gpumem_allocate_at(h.pool, &stack_byte, 4, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(gpumem_allocate_at(h.pool, b, MiB, reinterpret_cast<void*>(0x1234)),
              GPUMEM_ERROR_INVALID_ARGUMENT);  // a stream the platform does not know
    EXPECT_EQ(h.stats().live_bytes, before.live_bytes);

    // The freed block, whole, then freed again as any allocation.
    ASSERT_EQ(gpumem_allocate_at(h.pool, b, 4 * MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(h.stats().live_bytes, 12 * MiB);
    EXPECT_EQ(h.stats().live_allocations, 3u);
    EXPECT_EQ(gpumem_free(h.pool, b, 4 * MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(gpumem_free(h.pool, b, 4 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);

    // A piece in the middle of a free block, freed on a side stream first: the parts on
    // either side stay free and serve other requests.
    void* side = nullptr;
    ASSERT_EQ(gpumem_stream_create(h.pool, &side), GPUMEM_SUCCESS) << last_error();
    void* d = gpumem_malloc(h.pool, 4 * MiB, side);
    ASSERT_NE(d, nullptr) << last_error();
    ASSERT_EQ(gpumem_free(h.pool, d, 4 * MiB, side), GPUMEM_SUCCESS);
    ASSERT_EQ(gpumem_stream_synchronize(h.pool, side), GPUMEM_SUCCESS);
    void* middle = static_cast<char*>(d) + MiB;
    ASSERT_EQ(gpumem_allocate_at(h.pool, middle, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(gpumem_allocate_at(h.pool, d, 2 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    ASSERT_EQ(gpumem_allocate_at(h.pool, d, MiB, nullptr), GPUMEM_SUCCESS) << last_error();
    EXPECT_EQ(h.stats().live_bytes, 8 * MiB + 2 * MiB);
    EXPECT_EQ(gpumem_free(h.pool, middle, MiB, nullptr), GPUMEM_SUCCESS);
    EXPECT_EQ(gpumem_free(h.pool, d, MiB, nullptr), GPUMEM_SUCCESS);
    EXPECT_EQ(gpumem_stream_destroy(h.pool, side), GPUMEM_SUCCESS) << last_error();

    // Given back to the driver: no longer the pool's to hand out.
    EXPECT_EQ(gpumem_free(h.pool, c, 4 * MiB, nullptr), GPUMEM_SUCCESS);
    std::uint64_t released = 0;
    ASSERT_EQ(gpumem_pool_trim(h.pool, &released), GPUMEM_SUCCESS);
    EXPECT_GE(released, 4 * MiB);
    EXPECT_EQ(gpumem_allocate_at(h.pool, c, 4 * MiB, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
    EXPECT_EQ(gpumem_free(h.pool, a, 4 * MiB, nullptr), GPUMEM_SUCCESS);
    EXPECT_EQ(h.stats().live_bytes, 0u);
  }
  gpumem_pool* guarded = nullptr;
  ASSERT_EQ(gpumem_pool_create("platform:sim,sim_capacity:256M,guard:on", &guarded), GPUMEM_SUCCESS)
      << last_error();
  void* p = gpumem_malloc(guarded, MiB, nullptr);
  ASSERT_EQ(gpumem_free(guarded, p, MiB, nullptr), GPUMEM_SUCCESS);
  EXPECT_EQ(gpumem_allocate_at(guarded, p, MiB, nullptr), GPUMEM_ERROR_NOT_SUPPORTED);
  gpumem_pool_destroy(guarded);
}

}  // namespace
