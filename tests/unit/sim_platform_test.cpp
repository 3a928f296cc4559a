// sim fidelity: the host-memory device behaves like the driver where gpumem depends on it
// (include/gpumem/platform/sim_platform.hpp). Each scenario ends with the device's
// self-check passing and, once its objects are released, nothing left alive on it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "gpumem/platform.hpp"

namespace {

using gpumem::failure_kind;
using gpumem::physical_handle;
using gpumem::platform_op;
using gpumem::sim_fault;
using gpumem::sim_latency;
using gpumem::sim_options;
using gpumem::sim_platform;
using gpumem::status;

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

template <class T>
status as_status(const gpumem::result<T>& r) {
  return r.ok() ? status::success() : r.error();
}

void* at(std::uintptr_t va) { return reinterpret_cast<void*>(va); }

std::string text(const gpumem::sim_live_objects& o) { return o.describe(); }

// One sim device per test, with the granularity of the parameter.
class sim_fidelity : public ::testing::TestWithParam<std::size_t> {
 protected:
  void SetUp() override {
    g_ = GetParam();
    sim_ = std::make_unique<sim_platform>(
        sim_options{.capacity = 64 * g_, .granularity = g_});
  }
  void TearDown() override {
    EXPECT_TRUE(sim_->is_valid()) << sim_->validate();
    EXPECT_TRUE(sim_->live_objects().none()) << "left alive: " << text(sim_->live_objects());
  }

  std::uintptr_t reserve(std::size_t size) {
    auto r = sim_->reserve_range(size, 0);
    EXPECT_TRUE(r.ok()) << r.error().describe();
    return r.ok() ? r.value() : 0;
  }
  physical_handle create(std::size_t size) {
    auto r = sim_->create_physical(0, size);
    EXPECT_TRUE(r.ok()) << r.error().describe();
    return r.ok() ? r.value() : physical_handle{};
  }
  void map_rw(std::uintptr_t va, std::size_t size, physical_handle h) {
    auto s = sim_->map(va, size, h, 0);
    ASSERT_TRUE(s.ok()) << s.describe();
    s = sim_->set_access(0, va, size);
    ASSERT_TRUE(s.ok()) << s.describe();
  }
  void expect_ok(const status& s) { EXPECT_TRUE(s.ok()) << s.describe(); }
  void expect_invalid(const status& s, const char* what) {
    EXPECT_EQ(s.kind, failure_kind::invalid_value) << what << ": " << s.describe();
    EXPECT_EQ(s.name, "CUDA_ERROR_INVALID_VALUE") << what;
  }
  void expect_free_matches_used() {
    auto info = sim_->mem_info(0);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info.value().total, 64 * g_);
    EXPECT_EQ(info.value().free, info.value().total - sim_->used_bytes(0));
  }

  std::size_t g_ = 0;
  std::unique_ptr<sim_platform> sim_;
};

std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> out(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    out[i] = static_cast<unsigned char>((i * 131 + seed * 17 + (i >> 12)) & 0xff);
  return out;
}

bool holds(std::uintptr_t va, const std::vector<unsigned char>& bytes) {
  return std::memcmp(at(va), bytes.data(), bytes.size()) == 0;
}

TEST_P(sim_fidelity, bytes_survive_unmap_and_remap_in_another_range) {
  const std::size_t size = 2 * g_;
  const auto h = create(size);
  const auto first = reserve(4 * g_);
  map_rw(first + g_, size, h);
  const auto bytes = pattern(size, 1);
  std::memcpy(at(first + g_), bytes.data(), size);
  expect_ok(sim_->unmap(first + g_, size));

  const auto second = reserve(8 * g_);
  ASSERT_NE(second, first);
  map_rw(second + 3 * g_, size, h);
  EXPECT_TRUE(holds(second + 3 * g_, bytes)) << "remapped handle lost its bytes";
  EXPECT_TRUE(sim_->is_valid()) << sim_->validate();

  expect_ok(sim_->unmap(second + 3 * g_, size));
  expect_ok(sim_->release_physical(h));
  expect_ok(sim_->free_range(first, 4 * g_));
  expect_ok(sim_->free_range(second, 8 * g_));
}

TEST_P(sim_fidelity, one_handle_mapped_twice_shows_the_same_bytes) {
  const std::size_t size = 2 * g_;
  const auto h = create(size);
  const auto a = reserve(size);
  const auto b = reserve(size);
  map_rw(a, size, h);
  map_rw(b, size, h);
  const auto bytes = pattern(size, 2);
  std::memcpy(at(a), bytes.data(), size);
  EXPECT_TRUE(holds(b, bytes));
  // And back the other way, through the platform's copy.
  const auto more = pattern(size, 3);
  expect_ok(sim_->memcpy_async(at(b), more.data(), size, {}));
  expect_ok(sim_->stream_synchronize({}));
  EXPECT_TRUE(holds(a, more));
  // A mapping of the handle's first granule alone sees the same bytes too.
  const auto c = reserve(g_);
  map_rw(c, g_, h);
  EXPECT_EQ(std::memcmp(at(c), more.data(), g_), 0);

  for (auto va : {a, b}) expect_ok(sim_->unmap(va, size));
  expect_ok(sim_->unmap(c, g_));
  expect_ok(sim_->release_physical(h));
  for (auto va : {a, b}) expect_ok(sim_->free_range(va, size));
  expect_ok(sim_->free_range(c, g_));
}

TEST_P(sim_fidelity, capacity_is_enforced_and_mem_info_agrees) {
  const std::size_t capacity = 64 * g_;
  expect_free_matches_used();
  EXPECT_EQ(sim_->used_bytes(0), 0u);

  auto too_big = sim_->create_physical(0, capacity + g_);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.error().kind, failure_kind::out_of_memory);
  EXPECT_EQ(too_big.error().name, "CUDA_ERROR_OUT_OF_MEMORY");
  EXPECT_EQ(too_big.error().call, platform_op::create_physical);
  EXPECT_EQ(sim_->live_objects().handles, 0u);

  std::vector<physical_handle> handles;
  for (std::size_t i = 0; i < 64; ++i) {
    handles.push_back(create(g_));
    EXPECT_EQ(sim_->used_bytes(0), (i + 1) * g_);
  }
  expect_free_matches_used();
  auto full = sim_->create_physical(0, g_);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().kind, failure_kind::out_of_memory);
  EXPECT_EQ(full.error().name, "CUDA_ERROR_OUT_OF_MEMORY");
  auto full_runtime = sim_->runtime_malloc(0, 1);
  ASSERT_FALSE(full_runtime.ok());
  EXPECT_EQ(full_runtime.error().kind, failure_kind::out_of_memory);
  auto full_driver = sim_->driver_alloc(0, 1);
  ASSERT_FALSE(full_driver.ok());
  EXPECT_EQ(full_driver.error().kind, failure_kind::out_of_memory);
  EXPECT_EQ(sim_->mem_info(0).value().free, 0u);

  expect_ok(sim_->release_physical(handles.back()));
  handles.pop_back();
  EXPECT_EQ(sim_->mem_info(0).value().free, g_);
  // runtime allocations take frames too (whole host pages).
  auto small = sim_->runtime_malloc(0, 100);
  ASSERT_TRUE(small.ok()) << small.error().describe();
  EXPECT_EQ(sim_->used_bytes(0), 63 * g_ + 4 * KiB);
  expect_free_matches_used();
  expect_ok(sim_->runtime_free(0, small.value()));
  for (auto h : handles) expect_ok(sim_->release_physical(h));
  EXPECT_EQ(sim_->used_bytes(0), 0u);
  expect_free_matches_used();
  auto devices = sim_->device_count();
  ASSERT_TRUE(devices.ok());
  EXPECT_EQ(devices.value(), 1);
  auto props = sim_->properties(0);
  ASSERT_TRUE(props.ok());
  EXPECT_EQ(props.value().total_memory, capacity);
  EXPECT_TRUE(props.value().vmm_supported);
  EXPECT_TRUE(props.value().simulated);
}

// On a GPU physical memory is pages, not one contiguous run: cuMemCreate and cudaMalloc
// succeed whenever enough memory is free, however it is scattered. A sim that refuses
// them reports out_of_memory while mem_info says the memory is free.
TEST_P(sim_fidelity, scattered_free_memory_is_usable_as_one_handle) {
  std::vector<physical_handle> handles;
  for (int i = 0; i < 64; ++i) handles.push_back(create(g_));
  for (std::size_t i = 0; i < handles.size(); i += 2) expect_ok(sim_->release_physical(handles[i]));
  ASSERT_EQ(sim_->mem_info(0).value().free, 32 * g_);

  auto two = sim_->create_physical(0, 2 * g_);
  EXPECT_TRUE(two.ok()) << "32 granules free, yet a 2-granule handle was refused: "
                        << two.error().describe();
  auto runtime = sim_->runtime_malloc(0, 2 * g_);
  EXPECT_TRUE(runtime.ok()) << "32 granules free, yet cudaMalloc of 2 granules was refused: "
                            << runtime.error().describe();

  if (two.ok()) expect_ok(sim_->release_physical(two.value()));
  if (runtime.ok()) expect_ok(sim_->runtime_free(0, runtime.value()));
  for (std::size_t i = 1; i < handles.size(); i += 2) expect_ok(sim_->release_physical(handles[i]));
}

TEST_P(sim_fidelity, granularity_is_enforced) {
  auto g = sim_->granularity(0);
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(g.value().minimum, g_);
  EXPECT_EQ(g.value().recommended, g_);

  expect_invalid(as_status(sim_->reserve_range(g_ + 4 * KiB, 0)), "reserve of a partial granule");
  expect_invalid(as_status(sim_->reserve_range(0, 0)), "reserve of 0 bytes");
  expect_invalid(as_status(sim_->reserve_range(g_, g_ / 2)), "alignment below the granularity");
  expect_invalid(as_status(sim_->reserve_range(g_, 3 * g_)), "alignment not a power of two");
  expect_invalid(as_status(sim_->create_physical(0, g_ / 2)), "handle of half a granule");
  expect_invalid(as_status(sim_->create_physical(0, 0)), "handle of 0 bytes");
  expect_invalid(as_status(sim_->create_physical(1, g_)), "handle on a device that is not there");
  EXPECT_EQ(sim_->live_objects().ranges, 0u);
  EXPECT_EQ(sim_->live_objects().handles, 0u);

  // Big alignments are honoured.
  auto aligned = sim_->reserve_range(g_, 64 * g_);
  ASSERT_TRUE(aligned.ok());
  EXPECT_EQ(aligned.value() % (64 * g_), 0u);
  expect_ok(sim_->free_range(aligned.value(), g_));

  const auto range = reserve(4 * g_);
  EXPECT_EQ(range % g_, 0u);
  const auto h = create(2 * g_);
  expect_invalid(sim_->map(range + 4 * KiB, g_, h, 0), "map at an unaligned address");
  expect_invalid(sim_->map(range, g_ + 4 * KiB, h, 0), "map of a partial granule");
  expect_invalid(sim_->map(range, 3 * g_, h, 0), "map past the handle's end");
  // As the CUDA 13 driver: a mapping starts at offset 0 of its handle.
  for (std::size_t offset : {4 * KiB, g_}) {
    const status s = sim_->map(range, g_, h, offset);
    EXPECT_EQ(s.kind, failure_kind::not_supported) << "offset " << offset << ": " << s.describe();
    EXPECT_EQ(s.name, "CUDA_ERROR_NOT_SUPPORTED");
  }
  expect_invalid(sim_->map(range + 3 * g_, 2 * g_, h, 0), "map past the range's end");
  expect_invalid(sim_->map(range, g_, physical_handle{999999}, 0), "map of an unknown handle");
  EXPECT_EQ(sim_->live_objects().mappings, 0u) << "a refused map left a mapping";

  expect_ok(sim_->map(range, 2 * g_, h, 0));
  expect_invalid(sim_->map(range + g_, g_, h, 0), "map over a mapping");
  expect_invalid(sim_->unmap(range, g_), "unmap of half a mapping");
  expect_invalid(sim_->unmap(range + g_, g_), "unmap from inside a mapping");
  expect_invalid(sim_->set_access(0, range, 3 * g_), "set_access past the mapping");
  expect_invalid(sim_->free_range(range, 2 * g_), "free of part of a range");
  EXPECT_EQ(sim_->live_objects().mappings, 1u);
  EXPECT_TRUE(sim_->is_valid()) << sim_->validate();

  expect_ok(sim_->set_access(0, range, 2 * g_));
  expect_ok(sim_->unmap(range, 2 * g_));
  expect_ok(sim_->release_physical(h));
  expect_invalid(sim_->release_physical(h), "second release of a handle");
  expect_ok(sim_->free_range(range, 4 * g_));
  expect_invalid(sim_->free_range(range, 4 * g_), "second free of a range");
}

TEST_P(sim_fidelity, released_handle_lives_until_unmapped) {
  const std::size_t size = 2 * g_;
  const auto h = create(size);
  const auto va = reserve(size);
  map_rw(va, size, h);
  const auto bytes = pattern(size, 4);
  std::memcpy(at(va), bytes.data(), size);
  ASSERT_EQ(sim_->used_bytes(0), size);

  expect_ok(sim_->release_physical(h));
  EXPECT_EQ(sim_->used_bytes(0), size) << "released while mapped: memory must stay";
  EXPECT_EQ(sim_->live_objects().handles, 1u);
  EXPECT_TRUE(holds(va, bytes));
  EXPECT_TRUE(sim_->is_valid()) << sim_->validate();
  expect_invalid(sim_->map(va, size, h, 0), "map of a released handle");

  expect_ok(sim_->unmap(va, size));
  EXPECT_EQ(sim_->used_bytes(0), 0u);
  EXPECT_EQ(sim_->live_objects().handles, 0u);
  expect_free_matches_used();
  expect_ok(sim_->free_range(va, size));
}

TEST_P(sim_fidelity, free_range_with_mappings_is_refused) {
  const auto h = create(g_);
  const auto va = reserve(2 * g_);
  map_rw(va + g_, g_, h);
  auto s = sim_->free_range(va, 2 * g_);
  EXPECT_EQ(s.kind, failure_kind::invalid_value) << s.describe();
  EXPECT_EQ(sim_->live_objects().ranges, 1u);
  EXPECT_EQ(sim_->live_objects().mappings, 1u);
  // The mapping still works after the refusal.
  std::memset(at(va + g_), 0x5a, g_);
  EXPECT_EQ(static_cast<unsigned char*>(at(va + g_))[g_ - 1], 0x5a);
  expect_ok(sim_->unmap(va + g_, g_));
  expect_ok(sim_->free_range(va, 2 * g_));
  expect_ok(sim_->release_physical(h));
}

TEST_P(sim_fidelity, unmap_of_two_adjacent_mappings_in_one_call) {
  const auto h1 = create(g_);
  const auto h2 = create(2 * g_);
  const auto va = reserve(3 * g_);
  map_rw(va, g_, h1);
  map_rw(va + g_, 2 * g_, h2);
  std::memset(at(va), 1, 3 * g_);
  expect_ok(sim_->set_access(0, va, 3 * g_));  // one call over both
  expect_ok(sim_->unmap(va, 3 * g_));
  EXPECT_EQ(sim_->live_objects().mappings, 0u);
  expect_ok(sim_->release_physical(h1));
  expect_ok(sim_->release_physical(h2));
  expect_ok(sim_->free_range(va, 3 * g_));
}

TEST_P(sim_fidelity, calls_are_counted_failed_ones_too) {
  for (std::size_t i = 0; i < gpumem::platform_op_count; ++i)
    EXPECT_EQ(sim_->calls_made(static_cast<platform_op>(i)), 0u);
  const auto va = reserve(g_);
  (void)sim_->reserve_range(3, 0);            // fails: counted
  (void)sim_->free_range(va + g_, g_);         // fails: counted
  expect_ok(sim_->free_range(va, g_));
  for (int i = 0; i < 5; ++i) (void)sim_->device_count();
  (void)sim_->properties(7);                   // fails: counted
  auto p = sim_->runtime_malloc(0, 10);
  (void)sim_->runtime_free(0, p.value());
  (void)sim_->runtime_free(0, p.value());      // fails: counted
  EXPECT_EQ(sim_->calls_made(platform_op::reserve_range), 2u);
  EXPECT_EQ(sim_->calls_made(platform_op::free_range), 2u);
  EXPECT_EQ(sim_->calls_made(platform_op::device_count), 5u);
  EXPECT_EQ(sim_->calls_made(platform_op::device_properties), 1u);
  EXPECT_EQ(sim_->calls_made(platform_op::runtime_malloc), 1u);
  EXPECT_EQ(sim_->calls_made(platform_op::runtime_free), 2u);
  EXPECT_EQ(sim_->calls().count(platform_op::map), 0u);
}

TEST_P(sim_fidelity, held_events_stay_incomplete_until_released) {
  auto stream = sim_->stream_create(0);
  ASSERT_TRUE(stream.ok());
  auto event = sim_->event_create(0);
  ASSERT_TRUE(event.ok());
  EXPECT_NE(stream.value().value, 0u);
  EXPECT_NE(event.value().value, stream.value().value);

  expect_ok(sim_->event_record(event.value(), stream.value()));
  auto done = sim_->event_query(event.value());
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(done.value()) << "sim completes work at once unless events are held";

  sim_->hold_events(true);
  expect_ok(sim_->event_record(event.value(), stream.value()));
  done = sim_->event_query(event.value());
  ASSERT_TRUE(done.ok()) << done.error().describe();
  EXPECT_FALSE(done.value());
  auto sync = sim_->event_synchronize(event.value());
  EXPECT_EQ(sync.kind, failure_kind::not_ready) << sync.describe();
  EXPECT_EQ(sync.name, "CUDA_ERROR_NOT_READY");
  expect_ok(sim_->stream_wait_event(stream.value(), event.value()));

  sim_->complete_events();
  done = sim_->event_query(event.value());
  ASSERT_TRUE(done.ok());
  EXPECT_TRUE(done.value());
  expect_ok(sim_->event_synchronize(event.value()));

  // Still held: a new record is incomplete again; un-holding makes records complete.
  expect_ok(sim_->event_record(event.value(), {}));
  EXPECT_FALSE(sim_->event_query(event.value()).value());
  sim_->complete_events();
  sim_->hold_events(false);
  expect_ok(sim_->event_record(event.value(), stream.value()));
  EXPECT_TRUE(sim_->event_query(event.value()).value());

  expect_ok(sim_->event_destroy(event.value()));
  expect_invalid(as_status(sim_->event_query(event.value())), "query of a destroyed event");
  expect_ok(sim_->stream_destroy(stream.value()));
  expect_invalid(sim_->stream_synchronize(stream.value()), "sync of a destroyed stream");
}

TEST(sim_platform, thousands_of_handles_use_no_file_descriptors) {
  auto count_fds = [] {
    std::size_t n = 0;
    for ([[maybe_unused]] auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
    return n;
  };
  constexpr std::size_t page = 64 * KiB;
  constexpr std::size_t n = 5000;
  sim_platform big(sim_options{.capacity = 512 * MiB, .granularity = page});
  const std::size_t fds_before = count_fds();

  std::vector<physical_handle> handles;
  for (std::size_t i = 0; i < n; ++i) {
    auto h = big.create_physical(0, page);
    ASSERT_TRUE(h.ok()) << i << ": " << h.error().describe();
    handles.push_back(h.value());
  }
  auto range = big.reserve_range(n * page, 0);
  ASSERT_TRUE(range.ok());
  // Map in reverse order so neighbouring pages come from different handles.
  for (std::size_t i = 0; i < n; ++i) {
    auto s = big.map(range.value() + i * page, page, handles[n - 1 - i], 0);
    ASSERT_TRUE(s.ok()) << i << ": " << s.describe();
  }
  ASSERT_TRUE(big.set_access(0, range.value(), n * page).ok());
  for (std::size_t i = 0; i < n; ++i)
    static_cast<unsigned char*>(at(range.value()))[i * page] = static_cast<unsigned char>(i);
  for (std::size_t i = 0; i < n; ++i)
    ASSERT_EQ(static_cast<unsigned char*>(at(range.value()))[i * page],
              static_cast<unsigned char>(i));
  EXPECT_EQ(count_fds(), fds_before) << "sim opened file descriptors per handle or mapping";
  EXPECT_EQ(big.live_objects().handles, n);
  EXPECT_EQ(big.live_objects().mappings, n);
  EXPECT_EQ(big.used_bytes(0), n * page);
  EXPECT_TRUE(big.is_valid()) << big.validate();

  ASSERT_TRUE(big.unmap(range.value(), n * page).ok());
  for (auto h : handles) ASSERT_TRUE(big.release_physical(h).ok());
  ASSERT_TRUE(big.free_range(range.value(), n * page).ok());
  EXPECT_EQ(big.used_bytes(0), 0u);
  EXPECT_EQ(count_fds(), fds_before);
  EXPECT_TRUE(big.live_objects().none()) << text(big.live_objects());
  EXPECT_TRUE(big.is_valid()) << big.validate();
}

// Host-side helpers for the mapping-limit test; near the limit the heap may be unable to
// grow, so neither allocates.
// Whether [va] is covered by a host mapping of sim's memfd, read from /proc/self/maps.
bool host_maps_sim_memory_at(std::uintptr_t va) {
  const int fd = ::open("/proc/self/maps", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  static char chunk[4096];
  static char line[1024];
  std::size_t used = 0;
  bool found = false;
  auto check_line = [&] {
    line[used < sizeof line ? used : sizeof line - 1] = '\0';
    std::uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line, "%lx-%lx", &lo, &hi) == 2 && lo <= va && va < hi &&
        std::strstr(line, "gpumem-sim-device") != nullptr)
      found = true;
    used = 0;
  };
  ssize_t got = 0;
  while ((got = ::read(fd, chunk, sizeof chunk)) > 0) {
    for (ssize_t i = 0; i < got; ++i) {
      if (chunk[i] == '\n') {
        check_line();
      } else if (used < sizeof line - 1) {
        line[used++] = chunk[i];
      }
    }
  }
  ::close(fd);
  return found;
}

// Every separately mapped run is one kernel mapping and vm.max_map_count bounds them:
// sim must refuse the map that would pass the limit with out_of_memory, not crash, and
// an unmap at the limit must either fail as a value or really unmap (afterwards the
// address faults and the frames may be reused): it must never report success while the
// host still maps the handle's memory there.
TEST(sim_platform, host_mapping_limit_fails_cleanly) {
  constexpr std::size_t page = 64 * KiB;
  constexpr std::size_t n = 40000;  // mappings with gaps: 80000 kernel mappings, more than
                                    // the usual vm.max_map_count of 65530
  sim_platform sim(sim_options{.capacity = n * page, .granularity = page});
  std::vector<physical_handle> handles;
  for (std::size_t i = 0; i < n; ++i) {
    auto h = sim.create_physical(0, page);
    ASSERT_TRUE(h.ok()) << h.error().describe();
    handles.push_back(h.value());
  }
  auto range = sim.reserve_range(2 * n * page, 0);
  ASSERT_TRUE(range.ok());
  auto va_of = [&](std::size_t i) { return range.value() + 2 * i * page; };

  // Every other page: each mapping sits between two unmapped gaps, so none can merge.
  std::size_t mapped = 0;
  status refused;
  bool map_threw = false;
  for (std::size_t i = 0; i < n; ++i) {
    try {
      status s = sim.map(va_of(i), page, handles[i], 0);
      if (!s.ok()) {
        refused = std::move(s);
        break;
      }
    } catch (const std::bad_alloc&) {
      map_threw = true;
      break;
    }
    ++mapped;
  }
  const bool reached = !refused.ok() || map_threw;

  // Exactly at the limit (fill any slack with one-page host mappings of alternating
  // protection, which cannot merge), unmap the last mapping.
  static void* filler[70000];
  std::size_t fillers = 0;
  status unmapped;
  bool still_mapped = false;
  if (reached && mapped > 0) {
    while (fillers < std::size(filler)) {
      void* p = ::mmap(nullptr, 4096, fillers % 2 ? PROT_READ : PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) break;
      filler[fillers++] = p;
    }
    unmapped = sim.unmap(va_of(mapped - 1), page);
    still_mapped = host_maps_sim_memory_at(va_of(mapped - 1));
    for (std::size_t i = 0; i < fillers; ++i) ::munmap(filler[i], 4096);
    if (unmapped.ok()) --mapped;
  }
  // Step well back from the limit before anything allocates (gtest, validate()).
  std::size_t stepped_back = 0;
  while (reached && stepped_back < 1024 && mapped > 0) {
    ASSERT_TRUE(sim.unmap(va_of(mapped - 1), page).ok());
    --mapped;
    ++stepped_back;
  }

  // Still near the limit if the host kept mappings sim believes gone: record what is
  // needed, tear everything down (free_range drops the host mappings), then assert.
  const std::size_t live_mappings = sim.live_objects().mappings;
  bool access_ok = false;
  if (mapped > 0 && sim.set_access(0, va_of(0), page).ok()) {
    static_cast<volatile unsigned char*>(at(va_of(0)))[0] = 1;
    access_ok = true;
  }
  for (std::size_t i = 0; i < mapped; ++i) ASSERT_TRUE(sim.unmap(va_of(i), page).ok()) << i;
  for (auto h : handles) ASSERT_TRUE(sim.release_physical(h).ok());
  ASSERT_TRUE(sim.free_range(range.value(), 2 * n * page).ok());

  EXPECT_FALSE(map_threw) << "sim.map threw std::bad_alloc at the host mapping limit";
  if (reached && !map_threw) {
    EXPECT_EQ(refused.kind, failure_kind::out_of_memory) << refused.describe();
    EXPECT_EQ(refused.call, platform_op::map);
    EXPECT_NE(refused.message.find("max_map_count"), std::string::npos) << refused.describe();
    EXPECT_FALSE(unmapped.ok() && still_mapped)
        << "at the limit sim.unmap reported success, yet the host still maps the handle's "
           "memory at the address (" << fillers << " filler mappings)";
    if (!unmapped.ok()) {
      EXPECT_EQ(unmapped.call, platform_op::unmap) << unmapped.describe();
    }
    EXPECT_EQ(live_mappings, mapped);
    EXPECT_TRUE(access_ok);
  }
  EXPECT_TRUE(sim.live_objects().none()) << text(sim.live_objects());
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
  if (!reached) {
    GTEST_SKIP() << "vm.max_map_count is above " << 2 * n << ": the limit was not reached";
  }
}

TEST_P(sim_fidelity, classic_allocations_hold_bytes_and_free_cleanly) {
  auto rt = sim_->runtime_malloc(0, 3 * g_ + 1);
  auto drv = sim_->driver_alloc(0, 5000);
  auto host = sim_->host_alloc_pinned(10000);
  ASSERT_TRUE(rt.ok() && drv.ok() && host.ok());
  EXPECT_EQ(sim_->live_objects().device_allocations, 2u);
  EXPECT_EQ(sim_->live_objects().host_allocations, 1u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(rt.value()) % 256, 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(drv.value()) % 256, 0u);

  const auto bytes = pattern(5000, 9);
  expect_ok(sim_->memcpy_async(host.value(), bytes.data(), 5000, {}));
  expect_ok(sim_->memcpy_async(drv.value(), host.value(), 5000, {}));
  expect_ok(sim_->memcpy_async(rt.value(), drv.value(), 5000, {}));
  expect_ok(sim_->memset_async(host.value(), 0, 5000, {}));
  expect_ok(sim_->memcpy_async(host.value(), rt.value(), 5000, {}));
  expect_ok(sim_->stream_synchronize({}));
  EXPECT_EQ(std::memcmp(host.value(), bytes.data(), 5000), 0);

  // cudaMalloc(0) gives nullptr and cudaFree(nullptr) succeeds; cuMemAlloc(0) is an error.
  auto zero = sim_->runtime_malloc(0, 0);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero.value(), nullptr);
  expect_ok(sim_->runtime_free(0, nullptr));
  expect_invalid(as_status(sim_->driver_alloc(0, 0)), "cuMemAlloc of 0 bytes");

  expect_invalid(sim_->driver_free(0, static_cast<char*>(drv.value()) + 256), "interior free");
  expect_ok(sim_->runtime_free(0, rt.value()));
  expect_ok(sim_->driver_free(0, drv.value()));
  expect_ok(sim_->host_free_pinned(host.value()));
  expect_invalid(sim_->runtime_free(0, rt.value()), "double cudaFree");
  EXPECT_EQ(sim_->used_bytes(0), 0u);
}

// --- modelled latency --------------------------------------------------------------------

TEST_P(sim_fidelity, modelled_latency_follows_the_baselines) {
  using gpumem::modelled_latency_ns;
  EXPECT_EQ(modelled_latency_ns(platform_op::create_physical, 2 * MiB), 11500u);
  EXPECT_EQ(modelled_latency_ns(platform_op::create_physical, 32 * MiB), 12900u);
  EXPECT_EQ(modelled_latency_ns(platform_op::create_physical, 256 * MiB), 19000u);
  EXPECT_EQ(modelled_latency_ns(platform_op::create_physical, 1 * GiB), 107000u);
  EXPECT_EQ(modelled_latency_ns(platform_op::runtime_malloc, 2 * MiB), 43600u);
  EXPECT_EQ(modelled_latency_ns(platform_op::runtime_free, 512), 37100u);
  EXPECT_EQ(modelled_latency_ns(platform_op::driver_alloc, 64 * KiB), 44600u);
  EXPECT_EQ(modelled_latency_ns(platform_op::reserve_range, 2 * MiB), 640u);
  EXPECT_EQ(modelled_latency_ns(platform_op::map, 2 * MiB), 860u);
  EXPECT_EQ(modelled_latency_ns(platform_op::set_access, 2 * MiB), 25700u);
  EXPECT_EQ(modelled_latency_ns(platform_op::unmap, 32 * MiB), 26000u);
  EXPECT_EQ(modelled_latency_ns(platform_op::release_physical, 256 * MiB), 140000u);
  EXPECT_EQ(modelled_latency_ns(platform_op::free_range, 2 * MiB), 620u);
  EXPECT_EQ(modelled_latency_ns(platform_op::host_alloc, 2 * MiB), 857000u);
  // Halfway between 2 MiB and 32 MiB in log2 size is 8 MiB: halfway in time.
  EXPECT_NEAR(static_cast<double>(modelled_latency_ns(platform_op::create_physical, 8 * MiB)),
              (11500.0 + 12900.0) / 2, 1.0);
  // Growing with size, clamped outside the measured points.
  std::uint64_t previous = 0;
  for (std::size_t bytes = 2 * MiB; bytes <= GiB; bytes *= 2) {
    const auto ns = modelled_latency_ns(platform_op::create_physical, bytes);
    EXPECT_GT(ns, previous) << bytes;
    previous = ns;
  }
  EXPECT_EQ(modelled_latency_ns(platform_op::create_physical, 4 * KiB), 11500u);
  EXPECT_EQ(modelled_latency_ns(platform_op::create_physical, 4 * GiB), 107000u);

  // A sim charges each call its modelled time: off charges nothing, model everything.
  auto unmodelled = sim_->create_physical(0, g_);
  ASSERT_TRUE(unmodelled.ok());
  expect_ok(sim_->release_physical(unmodelled.value()));
  EXPECT_EQ(sim_->modelled_ns(), 0u) << "sim_latency::off charged time";

  sim_platform modelled(sim_options{.capacity = 1 * GiB, .granularity = 2 * MiB,
                                    .latency = sim_latency::model});
  EXPECT_EQ(modelled.modelled_ns(), 0u);
  auto h = modelled.create_physical(0, 2 * MiB);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(modelled.modelled_ns(platform_op::create_physical), 11500u);
  EXPECT_EQ(modelled.modelled_ns(), 11500u);
  auto big = modelled.create_physical(0, 256 * MiB);
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(modelled.modelled_ns(platform_op::create_physical), 11500u + 19000u);
  auto rt = modelled.runtime_malloc(0, 2 * MiB);
  ASSERT_TRUE(rt.ok());
  EXPECT_EQ(modelled.modelled_ns(platform_op::runtime_malloc), 43600u);
  EXPECT_EQ(modelled.modelled_ns(), 11500u + 19000u + 43600u);
  // A whole vmm allocation of one 2 MiB page: reserve + create + map + set access.
  const auto before = modelled.modelled_ns();
  auto va = modelled.reserve_range(2 * MiB, 0);
  ASSERT_TRUE(va.ok());
  ASSERT_TRUE(modelled.map(va.value(), 2 * MiB, h.value(), 0).ok());
  ASSERT_TRUE(modelled.set_access(0, va.value(), 2 * MiB).ok());
  EXPECT_EQ(modelled.modelled_ns() - before, 640u + 860u + 25700u);
  ASSERT_TRUE(modelled.unmap(va.value(), 2 * MiB).ok());
  ASSERT_TRUE(modelled.free_range(va.value(), 2 * MiB).ok());
  // Over three one-page handles, set access and unmap pay per handle (measured on the H200).
  {
    auto run = modelled.reserve_range(6 * MiB, 0);
    ASSERT_TRUE(run.ok());
    std::vector<physical_handle> pages;
    for (int i = 0; i < 3; ++i) {
      auto p = modelled.create_physical(0, 2 * MiB);
      ASSERT_TRUE(p.ok());
      pages.push_back(p.value());
      ASSERT_TRUE(modelled.map(run.value() + i * 2 * MiB, 2 * MiB, p.value(), 0).ok());
    }
    const auto access_before = modelled.modelled_ns(platform_op::set_access);
    ASSERT_TRUE(modelled.set_access(0, run.value(), 6 * MiB).ok());
    EXPECT_EQ(modelled.modelled_ns(platform_op::set_access) - access_before,
              modelled_latency_ns(platform_op::set_access, 6 * MiB) +
                  2 * modelled_per_mapping_ns(platform_op::set_access));
    const auto unmap_before = modelled.modelled_ns(platform_op::unmap);
    ASSERT_TRUE(modelled.unmap(run.value(), 6 * MiB).ok());
    EXPECT_EQ(modelled.modelled_ns(platform_op::unmap) - unmap_before,
              modelled_latency_ns(platform_op::unmap, 6 * MiB) +
                  2 * modelled_per_mapping_ns(platform_op::unmap));
    for (auto p : pages) ASSERT_TRUE(modelled.release_physical(p).ok());
    ASSERT_TRUE(modelled.free_range(run.value(), 6 * MiB).ok());
  }
  ASSERT_TRUE(modelled.runtime_free(0, rt.value()).ok());
  ASSERT_TRUE(modelled.release_physical(h.value()).ok());
  ASSERT_TRUE(modelled.release_physical(big.value()).ok());
  EXPECT_GT(modelled.modelled_ns(platform_op::unmap), 0u);
  EXPECT_GT(modelled.modelled_ns(platform_op::runtime_free), 0u);
  EXPECT_TRUE(modelled.live_objects().none());
  EXPECT_TRUE(modelled.is_valid()) << modelled.validate();
}

// Freeing costs grow steeply with size on the H200 (cudaFree 36 us at 2 MiB, 570 us at
// 1 GiB; cuMemRelease 12.5 us and 531 us). A replay's modelled time must charge a free
// for the size it frees, not for the smallest measured size.
TEST(sim_latency_model, frees_are_charged_for_the_size_they_free) {
  using gpumem::modelled_latency_ns;
  sim_platform sim(sim_options{.capacity = 2 * GiB, .granularity = 2 * MiB,
                               .latency = sim_latency::model});
  auto h = sim.create_physical(0, 1 * GiB);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(sim.release_physical(h.value()).ok());
  EXPECT_EQ(sim.modelled_ns(platform_op::release_physical),
            modelled_latency_ns(platform_op::release_physical, 1 * GiB))
      << "cuMemRelease of 1 GiB charged as if it were 2 MiB";

  auto rt = sim.runtime_malloc(0, 1 * GiB);
  ASSERT_TRUE(rt.ok());
  ASSERT_TRUE(sim.runtime_free(0, rt.value()).ok());
  EXPECT_EQ(sim.modelled_ns(platform_op::runtime_free),
            modelled_latency_ns(platform_op::runtime_free, 1 * GiB))
      << "cudaFree of 1 GiB charged as if it were 512 B";

  auto drv = sim.driver_alloc(0, 1 * GiB);
  ASSERT_TRUE(drv.ok());
  ASSERT_TRUE(sim.driver_free(0, drv.value()).ok());
  EXPECT_EQ(sim.modelled_ns(platform_op::driver_free),
            modelled_latency_ns(platform_op::driver_free, 1 * GiB))
      << "cuMemFree of 1 GiB charged as if it were 512 B";

  auto host = sim.host_alloc_pinned(64 * MiB);
  ASSERT_TRUE(host.ok());
  ASSERT_TRUE(sim.host_free_pinned(host.value()).ok());
  EXPECT_EQ(sim.modelled_ns(platform_op::host_free),
            modelled_latency_ns(platform_op::host_free, 64 * MiB))
      << "cudaFreeHost of 64 MiB charged as if it were 2 MiB";
  EXPECT_TRUE(sim.live_objects().none());
}

// --- fault injection, for every operation ------------------------------------------------

// Drives one operation with everything it needs prepared, so that calling it twice in a
// row is meaningful: an injected failure must change nothing, the retry must succeed.
class op_harness {
 public:
  op_harness(sim_platform& sim, std::size_t g) : sim_(sim), g_(g) {}
  ~op_harness() { cleanup(); }

  void prepare(platform_op op) {
    switch (op) {
      case platform_op::free_range: reserve(); break;
      case platform_op::release_physical: create(); break;
      case platform_op::map: reserve(); create(); break;
      case platform_op::unmap:
      case platform_op::set_access: reserve(); create(); do_map(); break;
      case platform_op::runtime_free: rt_ = sim_.runtime_malloc(0, 4096).value(); break;
      case platform_op::driver_free: drv_ = sim_.driver_alloc(0, 4096).value(); break;
      case platform_op::host_free: host_ = sim_.host_alloc_pinned(4096).value(); break;
      case platform_op::async_free: async_ = sim_.async_malloc(0, 4096, {}).value(); break;
      case platform_op::export_handle: handle_ = sim_.create_shareable_physical(0, g_).value(); break;
      case platform_op::import_handle:
        handle_ = sim_.create_shareable_physical(0, g_).value();
        fd_ = sim_.export_handle(handle_).value();
        break;
      case platform_op::stream_destroy:
      case platform_op::stream_synchronize:
      case platform_op::stream_device: stream_ = sim_.stream_create(0).value(); break;
      case platform_op::event_destroy:
      case platform_op::event_record:
      case platform_op::event_query:
      case platform_op::event_synchronize: event_ = sim_.event_create(0).value(); break;
      case platform_op::stream_wait_event:
        stream_ = sim_.stream_create(0).value();
        event_ = sim_.event_create(0).value();
        break;
      default: break;
    }
    dst_.assign(64, 0xee);
    src_.assign(64, 0x11);
  }

  status invoke(platform_op op) {
    switch (op) {
      case platform_op::device_count: return as_status(sim_.device_count());
      case platform_op::device_properties: return as_status(sim_.properties(0));
      case platform_op::granularity: return as_status(sim_.granularity(0));
      case platform_op::mem_info: return as_status(sim_.mem_info(0));
      case platform_op::reserve_range: {
        auto r = sim_.reserve_range(g_, 0);
        if (r.ok()) range_ = r.value();
        return as_status(r);
      }
      case platform_op::free_range: {
        auto s = sim_.free_range(range_, g_);
        if (s.ok()) range_ = 0;
        return s;
      }
      case platform_op::create_physical: {
        auto r = sim_.create_physical(0, g_);
        if (r.ok()) handle_ = r.value();
        return as_status(r);
      }
      case platform_op::release_physical: {
        auto s = sim_.release_physical(handle_);
        if (s.ok()) handle_ = {};
        return s;
      }
      case platform_op::map: {
        auto s = sim_.map(range_, g_, handle_, 0);
        mapped_ = s.ok();
        return s;
      }
      case platform_op::unmap: {
        auto s = sim_.unmap(range_, g_);
        if (s.ok()) mapped_ = false;
        return s;
      }
      case platform_op::set_access: return sim_.set_access(0, range_, g_);
      case platform_op::runtime_malloc: {
        auto r = sim_.runtime_malloc(0, 4096);
        if (r.ok()) rt_ = r.value();
        return as_status(r);
      }
      case platform_op::runtime_free: {
        auto s = sim_.runtime_free(0, rt_);
        if (s.ok()) rt_ = nullptr;
        return s;
      }
      case platform_op::driver_alloc: {
        auto r = sim_.driver_alloc(0, 4096);
        if (r.ok()) drv_ = r.value();
        return as_status(r);
      }
      case platform_op::driver_free: {
        auto s = sim_.driver_free(0, drv_);
        if (s.ok()) drv_ = nullptr;
        return s;
      }
      case platform_op::host_alloc: {
        auto r = sim_.host_alloc_pinned(4096);
        if (r.ok()) host_ = r.value();
        return as_status(r);
      }
      case platform_op::host_free: {
        auto s = sim_.host_free_pinned(host_);
        if (s.ok()) host_ = nullptr;
        return s;
      }
      case platform_op::stream_create: {
        auto r = sim_.stream_create(0);
        if (r.ok()) stream_ = r.value();
        return as_status(r);
      }
      case platform_op::stream_destroy: {
        auto s = sim_.stream_destroy(stream_);
        if (s.ok()) stream_ = {};
        return s;
      }
      case platform_op::stream_synchronize: return sim_.stream_synchronize(stream_);
      case platform_op::stream_device: return as_status(sim_.stream_device(stream_));
      case platform_op::event_create: {
        auto r = sim_.event_create(0);
        if (r.ok()) event_ = r.value();
        return as_status(r);
      }
      case platform_op::event_destroy: {
        auto s = sim_.event_destroy(event_);
        if (s.ok()) event_ = {};
        return s;
      }
      case platform_op::event_record: return sim_.event_record(event_, {});
      case platform_op::event_query: {
        auto r = sim_.event_query(event_);
        if (r.ok() && !r.value()) ADD_FAILURE() << "event_query: an unheld event is pending";
        return as_status(r);
      }
      case platform_op::event_synchronize: return sim_.event_synchronize(event_);
      case platform_op::stream_wait_event: return sim_.stream_wait_event(stream_, event_);
      case platform_op::memcpy_async:
        return sim_.memcpy_async(dst_.data(), src_.data(), dst_.size(), {});
      case platform_op::memset_async: return sim_.memset_async(dst_.data(), 0x22, dst_.size(), {});
      case platform_op::async_malloc: {
        auto r = sim_.async_malloc(0, 4096, {});
        if (r.ok()) async_ = r.value();
        return as_status(r);
      }
      case platform_op::async_free: {
        auto s = sim_.async_free(async_, {});
        if (s.ok()) async_ = nullptr;
        return s;
      }
      case platform_op::export_handle: {
        auto r = sim_.export_handle(handle_);
        if (r.ok()) ::close(r.value());
        return as_status(r);
      }
      case platform_op::import_handle: {
        auto r = sim_.import_handle(0, fd_, g_);
        if (r.ok()) (void)sim_.release_physical(r.value());
        return as_status(r);
      }
      case platform_op::can_access_peer: return as_status(sim_.can_access_peer(1, 0));
      case platform_op::enable_peer_access: return sim_.enable_peer_access(1, 0);
      case platform_op::count_: break;
    }
    ADD_FAILURE() << "no way to drive platform_op " << static_cast<int>(op);
    return status::failure(op, failure_kind::invalid_value, 0, "", "not driven");
  }

  // What a copy or set must not have touched when it failed.
  bool destination_untouched() const {
    for (auto b : dst_)
      if (b != 0xee) return false;
    return true;
  }

  void cleanup() {
    if (mapped_) (void)sim_.unmap(range_, g_);
    mapped_ = false;
    if (handle_.value != 0) (void)sim_.release_physical(handle_);
    handle_ = {};
    if (range_ != 0) (void)sim_.free_range(range_, g_);
    range_ = 0;
    if (rt_) (void)sim_.runtime_free(0, rt_);
    rt_ = nullptr;
    if (drv_) (void)sim_.driver_free(0, drv_);
    drv_ = nullptr;
    if (host_) (void)sim_.host_free_pinned(host_);
    host_ = nullptr;
    if (async_) (void)sim_.async_free(async_, {});
    async_ = nullptr;
    if (stream_.value != 0) (void)sim_.stream_destroy(stream_);
    stream_ = {};
    if (event_.value != 0) (void)sim_.event_destroy(event_);
    event_ = {};
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  void reserve() { range_ = sim_.reserve_range(g_, 0).value(); }
  void create() { handle_ = sim_.create_physical(0, g_).value(); }
  void do_map() {
    mapped_ = sim_.map(range_, g_, handle_, 0).ok();
    EXPECT_TRUE(mapped_);
  }

  sim_platform& sim_;
  std::size_t g_;
  std::uintptr_t range_ = 0;
  physical_handle handle_{};
  int fd_ = -1;
  bool mapped_ = false;
  void* rt_ = nullptr;
  void* drv_ = nullptr;
  void* host_ = nullptr;
  void* async_ = nullptr;
  gpumem::stream_handle stream_{};
  gpumem::event_handle event_{};
  std::vector<unsigned char> dst_, src_;
};

struct fault_param {
  platform_op op;
  failure_kind kind;
};

class sim_fault_injection : public ::testing::TestWithParam<fault_param> {};

const char* cuda_name(failure_kind kind) {
  switch (kind) {
    case failure_kind::out_of_memory: return "CUDA_ERROR_OUT_OF_MEMORY";
    case failure_kind::invalid_value: return "CUDA_ERROR_INVALID_VALUE";
    case failure_kind::not_ready: return "CUDA_ERROR_NOT_READY";
    case failure_kind::not_supported: return "CUDA_ERROR_NOT_SUPPORTED";
    case failure_kind::no_device: return "CUDA_ERROR_NO_DEVICE";
    default: return "CUDA_ERROR_UNKNOWN";
  }
}

TEST_P(sim_fault_injection, nth_call_fails_as_configured_then_the_next_succeeds) {
  const auto [op, kind] = GetParam();
  // Two devices, so the peer calls have a peer.
  sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB, .device_count = 2});
  {
    op_harness harness(sim, 2 * MiB);
    harness.prepare(op);
    ASSERT_FALSE(HasFailure()) << "preparing " << gpumem::platform_op_name(op);
    const auto live_before = text(sim.live_objects());
    const auto used_before = sim.used_bytes(0);
    const auto calls_before = sim.calls_made(op);

    sim.inject_fault(op, sim_fault{.nth = 1, .kind = kind});
    const status failed = harness.invoke(op);
    ASSERT_FALSE(failed.ok()) << gpumem::platform_op_name(op) << " did not fail";
    EXPECT_EQ(failed.kind, kind);
    EXPECT_EQ(failed.call, op);
    EXPECT_EQ(failed.name, cuda_name(kind));
    EXPECT_NE(failed.message.find("injected"), std::string::npos) << failed.describe();
    EXPECT_NE(failed.describe().find(gpumem::platform_op_name(op)), std::string::npos)
        << failed.describe();
    // A failed call changes nothing.
    EXPECT_EQ(text(sim.live_objects()), live_before);
    EXPECT_EQ(sim.used_bytes(0), used_before);
    EXPECT_TRUE(harness.destination_untouched()) << "a failed copy or set wrote bytes";
    EXPECT_TRUE(sim.is_valid()) << sim.validate();

    const status retried = harness.invoke(op);
    EXPECT_TRUE(retried.ok()) << gpumem::platform_op_name(op)
                              << " failed again: " << retried.describe();
    EXPECT_EQ(sim.calls_made(op), calls_before + 2) << "both calls are counted";
    EXPECT_TRUE(sim.is_valid()) << sim.validate();
  }
  EXPECT_TRUE(sim.live_objects().none()) << text(sim.live_objects());
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
}

std::vector<fault_param> every_op_and_kind() {
  std::vector<fault_param> out;
  for (std::size_t i = 0; i < gpumem::platform_op_count; ++i)
    for (auto kind : {failure_kind::out_of_memory, failure_kind::driver_error})
      out.push_back({static_cast<platform_op>(i), kind});
  // Each other kind on one op, for the error names.
  for (auto kind : {failure_kind::invalid_value, failure_kind::not_ready,
                    failure_kind::not_supported, failure_kind::no_device})
    out.push_back({platform_op::map, kind});
  return out;
}

std::string kind_name(failure_kind kind) {
  switch (kind) {
    case failure_kind::out_of_memory: return "out_of_memory";
    case failure_kind::invalid_value: return "invalid_value";
    case failure_kind::not_ready: return "not_ready";
    case failure_kind::not_supported: return "not_supported";
    case failure_kind::no_device: return "no_device";
    case failure_kind::driver_error: return "driver_error";
    default: return "none";
  }
}

INSTANTIATE_TEST_SUITE_P(every_op, sim_fault_injection, ::testing::ValuesIn(every_op_and_kind()),
                         [](const ::testing::TestParamInfo<fault_param>& info) {
                           return std::string(gpumem::platform_op_name(info.param.op)) + "_" +
                                  kind_name(info.param.kind);
                         });

TEST(sim_fault_rules, probability_one_always_fails_and_zero_never) {
  sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB});
  sim.inject_fault(platform_op::runtime_malloc,
                   sim_fault{.probability = 1.0, .kind = failure_kind::driver_error});
  for (int i = 0; i < 200; ++i) {
    auto r = sim.runtime_malloc(0, 4096);
    ASSERT_FALSE(r.ok()) << "call " << i;
    EXPECT_EQ(r.error().kind, failure_kind::driver_error);
  }
  EXPECT_EQ(sim.live_objects().device_allocations, 0u);
  // Other operations are unaffected.
  auto d = sim.driver_alloc(0, 4096);
  ASSERT_TRUE(d.ok());
  ASSERT_TRUE(sim.driver_free(0, d.value()).ok());

  sim.inject_fault(platform_op::runtime_malloc, sim_fault{.probability = 0.0});
  for (int i = 0; i < 200; ++i) {
    auto r = sim.runtime_malloc(0, 4096);
    ASSERT_TRUE(r.ok()) << "call " << i;
    ASSERT_TRUE(sim.runtime_free(0, r.value()).ok());
  }
  EXPECT_TRUE(sim.live_objects().none()) << text(sim.live_objects());
  EXPECT_TRUE(sim.is_valid()) << sim.validate();
}

TEST(sim_fault_rules, half_probability_fails_some_calls_not_all) {
  sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB, .seed = 7});
  sim.inject_fault(platform_op::create_physical, sim_fault{.probability = 0.5});
  int failed = 0;
  for (int i = 0; i < 400; ++i) {
    auto h = sim.create_physical(0, 2 * MiB);
    if (!h.ok()) {
      ++failed;
      EXPECT_EQ(h.error().kind, failure_kind::out_of_memory);
      continue;
    }
    ASSERT_TRUE(sim.release_physical(h.value()).ok());
  }
  EXPECT_GT(failed, 100);
  EXPECT_LT(failed, 300);
  EXPECT_TRUE(sim.live_objects().none()) << text(sim.live_objects());
}

TEST(sim_fault_rules, every_after_fails_from_nth_on_until_cleared) {
  sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB});
  sim.inject_fault(platform_op::reserve_range,
                   sim_fault{.nth = 3, .every_after = true, .kind = failure_kind::driver_error});
  std::vector<std::uintptr_t> ranges;
  for (int i = 1; i <= 6; ++i) {
    auto r = sim.reserve_range(2 * MiB, 0);
    EXPECT_EQ(r.ok(), i < 3) << "call " << i;
    if (r.ok()) ranges.push_back(r.value());
  }
  sim.clear_faults();
  auto r = sim.reserve_range(2 * MiB, 0);
  ASSERT_TRUE(r.ok());
  ranges.push_back(r.value());
  EXPECT_EQ(sim.live_objects().ranges, 3u);
  for (auto base : ranges) ASSERT_TRUE(sim.free_range(base, 2 * MiB).ok());
  EXPECT_EQ(sim.calls_made(platform_op::reserve_range), 7u);
  EXPECT_TRUE(sim.live_objects().none()) << text(sim.live_objects());
}

TEST(sim_fault_rules, nth_counts_from_when_the_rule_is_set) {
  sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB});
  for (int i = 0; i < 3; ++i) (void)sim.device_count();
  sim.inject_fault(platform_op::device_count, sim_fault{.nth = 2});
  EXPECT_TRUE(sim.device_count().ok());
  EXPECT_FALSE(sim.device_count().ok());
  EXPECT_TRUE(sim.device_count().ok());
  EXPECT_EQ(sim.calls_made(platform_op::device_count), 6u);
}

// --- faults on bad memory access ----------------------------------------------------------

class sim_platform_DeathTest : public sim_fidelity {};

TEST_P(sim_platform_DeathTest, touching_memory_without_access_faults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto h = create(g_);
  const auto va = reserve(3 * g_);
  // [va, va+g): mapped, access never granted. [va+g, va+2g): mapped with access.
  // [va+2g, va+3g): reserved, nothing mapped.
  ASSERT_TRUE(sim_->map(va, g_, h, 0).ok());
  map_rw(va + g_, g_, h);
  static_cast<volatile unsigned char*>(at(va + g_))[10] = 42;  // fine: access granted
  EXPECT_EQ(static_cast<volatile unsigned char*>(at(va + g_))[10], 42);

  EXPECT_EXIT(
      {
        volatile unsigned char c = static_cast<volatile unsigned char*>(at(va))[10];
        (void)c;
      },
      ::testing::KilledBySignal(SIGSEGV), "")
      << "read of a mapped range without set_access";
  EXPECT_EXIT({ static_cast<volatile unsigned char*>(at(va))[10] = 1; },
              ::testing::KilledBySignal(SIGSEGV), "")
      << "write to a mapped range without set_access";
  EXPECT_EXIT(
      {
        volatile unsigned char c = static_cast<volatile unsigned char*>(at(va + 2 * g_))[0];
        (void)c;
      },
      ::testing::KilledBySignal(SIGSEGV), "")
      << "read of a reserved, unmapped range";

  // Use after unmap faults too, and the bytes are still the handle's.
  ASSERT_TRUE(sim_->unmap(va + g_, g_).ok());
  EXPECT_EXIT({ static_cast<volatile unsigned char*>(at(va + g_))[10] = 1; },
              ::testing::KilledBySignal(SIGSEGV), "")
      << "write after unmap";
  ASSERT_TRUE(sim_->unmap(va, g_).ok());
  ASSERT_TRUE(sim_->release_physical(h).ok());
  ASSERT_TRUE(sim_->free_range(va, 3 * g_).ok());
}

std::string granularity_name(const ::testing::TestParamInfo<std::size_t>& info) {
  return info.param >= MiB ? std::to_string(info.param / MiB) + "MiB"
                           : std::to_string(info.param / KiB) + "KiB";
}

INSTANTIATE_TEST_SUITE_P(granularity, sim_fidelity, ::testing::Values(2 * MiB, 64 * KiB),
                         granularity_name);
INSTANTIATE_TEST_SUITE_P(granularity, sim_platform_DeathTest,
                         ::testing::Values(2 * MiB, 64 * KiB), granularity_name);

}  // namespace
