// The memory_resource contract (include/gpumem/backend/memory_resource.hpp), checked for
// every resource in resource_factories.hpp, on a fresh sim device per test and, when a
// CUDA device is present, on the real GPU.
//
// On sim every test ends by destroying its resources and requiring that the device holds
// no range, handle, mapping or allocation any more and passes its own self-check.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "contract/resource_factories.hpp"
#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"

namespace {

using gpumem::memory_resource;
using gpumem::platform;
using gpumem::resource_stats;
using gpumem::sim_options;
using gpumem::sim_platform;
using gpumem_test::resource_factory;

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

// The sizes every resource must serve: tiny, around 256, around a host page, around and
// past the 2 MiB VMM granularity, and a large odd one.
const std::vector<std::size_t> contract_sizes = {1, 255, 256, 4097, 1 * MiB, 2 * MiB + 1,
                                                 33 * MiB};

enum class platform_kind { sim, cuda };

struct contract_param {
  platform_kind on;
  resource_factory factory;
};

// The real GPU, probed once per process. Never destroyed: resources on it may be
// destroyed at exit after the CUDA runtime has begun shutting down.
struct cuda_device {
  std::unique_ptr<platform> device;
  std::string why;
};
const cuda_device& cuda_once() {
  static const cuda_device* probed = [] {
    auto* d = new cuda_device;
    d->device = gpumem::make_cuda_platform(&d->why);
    return d;
  }();
  return *probed;
}

std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::vector<unsigned char> out(bytes);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : out) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<unsigned char>(x >> 24);
  }
  return out;
}

void expect_same_stats(const resource_stats& a, const resource_stats& b) {
  EXPECT_EQ(a.live_bytes, b.live_bytes);
  EXPECT_EQ(a.peak_live_bytes, b.peak_live_bytes);
  EXPECT_EQ(a.live_allocations, b.live_allocations);
  EXPECT_EQ(a.reserved_bytes, b.reserved_bytes);
  EXPECT_EQ(a.peak_reserved_bytes, b.peak_reserved_bytes);
  EXPECT_EQ(a.allocations, b.allocations);
  EXPECT_EQ(a.deallocations, b.deallocations);
}

class resource_contract : public ::testing::TestWithParam<contract_param> {
 protected:
  void SetUp() override {
    if (GetParam().on == platform_kind::cuda) {
      const auto& cuda = cuda_once();
      if (!cuda.device) GTEST_SKIP() << "no CUDA device: " << cuda.why;
      platform_ = cuda.device.get();
    } else {
      sim_ = std::make_unique<sim_platform>(sim_options{.capacity = 1 * GiB,
                                                        .granularity = 2 * MiB});
      platform_ = sim_.get();
    }
    resource_ = GetParam().factory.make(*platform_);
    ASSERT_NE(resource_, nullptr);
    ASSERT_TRUE(resource_->is_valid()) << resource_->validate();
  }

  void TearDown() override {
    other_.reset();
    resource_.reset();
    if (sim_) {
      EXPECT_TRUE(sim_->live_objects().none())
          << "leaked on sim: " << sim_->live_objects().describe();
      EXPECT_TRUE(sim_->is_valid()) << sim_->validate();
    }
  }

  bool on_sim() const { return sim_ != nullptr; }

  // A resource of a different kind on the same platform, for wrong-owner frees.
  memory_resource& other_resource() {
    if (!other_) {
      if (resource_->name() == "vmm")
        other_ = std::make_unique<gpumem::runtime_resource>(*platform_);
      else
        other_ = std::make_unique<gpumem::vmm_resource>(*platform_);
    }
    return *other_;
  }

  // Host -> device -> host through the platform's stream-ordered copy.
  void write_device(void* dst, const std::vector<unsigned char>& bytes) {
    auto s = platform_->memcpy_async(dst, bytes.data(), bytes.size(), {});
    ASSERT_TRUE(s.ok()) << s.describe();
    s = platform_->stream_synchronize({});
    ASSERT_TRUE(s.ok()) << s.describe();
  }
  std::vector<unsigned char> read_device(const void* src, std::size_t bytes) {
    std::vector<unsigned char> out(bytes, 0);
    auto s = platform_->memcpy_async(out.data(), src, bytes, {});
    EXPECT_TRUE(s.ok()) << s.describe();
    s = platform_->stream_synchronize({});
    EXPECT_TRUE(s.ok()) << s.describe();
    return out;
  }

  // Expects deallocate(ptr, bytes) to be refused with invalid_argument whose text contains
  // `why`, and the resource's state to be exactly as before.
  void expect_refused_free(memory_resource& r, void* ptr, std::size_t bytes,
                           const std::string& why) {
    const resource_stats before = r.stats();
    const auto live_before = on_sim() ? sim_->live_objects() : gpumem::sim_live_objects{};
    try {
      r.deallocate(ptr, bytes);
      ADD_FAILURE() << "deallocate of " << ptr << " (" << bytes << " bytes) through '"
                    << r.name() << "' was accepted; expected: " << why;
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos)
          << "what(): " << e.what() << "\nexpected it to say: " << why;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected gpumem::invalid_argument, got: " << e.what();
    }
    expect_same_stats(r.stats(), before);
    EXPECT_TRUE(r.is_valid()) << r.validate();
    if (on_sim()) {
      const auto live_after = sim_->live_objects();
      EXPECT_EQ(live_after.describe(), live_before.describe());
    }
  }

  std::unique_ptr<sim_platform> sim_;
  platform* platform_ = nullptr;
  std::unique_ptr<memory_resource> resource_;
  std::unique_ptr<memory_resource> other_;
};

std::size_t vmm_granularity(const memory_resource& r) {
  if (auto* vmm = dynamic_cast<const gpumem::vmm_resource*>(&r)) return vmm->granularity();
  return 0;
}

// --- allocation and alignment -----------------------------------------------------------

TEST_P(resource_contract, allocates_every_size_aligned_and_disjoint) {
  auto& r = *resource_;
  struct live {
    std::uintptr_t address;
    std::size_t bytes;
  };
  std::vector<live> allocations;
  std::size_t sum = 0;
  for (std::size_t bytes : contract_sizes) {
    void* p = r.allocate(bytes);
    ASSERT_NE(p, nullptr) << bytes << " bytes";
    const auto a = reinterpret_cast<std::uintptr_t>(p);
    EXPECT_EQ(a % gpumem::default_alignment, 0u) << bytes << " bytes at " << p;
    if (std::size_t g = vmm_granularity(r)) { EXPECT_EQ(a % g, 0u) << bytes << " bytes at " << p; }
    allocations.push_back({a, bytes});
    sum += bytes;
    const auto st = r.stats();
    EXPECT_EQ(st.live_bytes, sum);
    EXPECT_EQ(st.live_allocations, allocations.size());
    EXPECT_EQ(st.allocations, allocations.size());
    EXPECT_EQ(st.deallocations, 0u);
    EXPECT_GE(st.reserved_bytes, st.live_bytes);
    EXPECT_TRUE(r.is_valid()) << r.validate();
  }
  // No two live allocations overlap.
  auto sorted = allocations;
  std::sort(sorted.begin(), sorted.end(),
            [](const live& x, const live& y) { return x.address < y.address; });
  for (std::size_t i = 1; i < sorted.size(); ++i)
    EXPECT_LE(sorted[i - 1].address + sorted[i - 1].bytes, sorted[i].address)
        << "allocations of " << sorted[i - 1].bytes << " and " << sorted[i].bytes
        << " bytes overlap";
  EXPECT_EQ(r.stats().peak_live_bytes, sum);
  // vmm: reserved_bytes == sum of granularity-rounded sizes of live allocations.
  if (std::size_t g = vmm_granularity(r)) {
    std::size_t rounded = 0;
    for (auto& l : allocations) rounded += (l.bytes + g - 1) / g * g;
    EXPECT_EQ(r.stats().reserved_bytes, rounded);
  }

  // Free in an interleaved order: odd positions first, then even.
  std::size_t freed = 0;
  for (int parity : {1, 0}) {
    for (std::size_t i = 0; i < allocations.size(); ++i) {
      if (static_cast<int>(i % 2) != parity) continue;
      r.deallocate(reinterpret_cast<void*>(allocations[i].address), allocations[i].bytes);
      sum -= allocations[i].bytes;
      ++freed;
      const auto st = r.stats();
      EXPECT_EQ(st.live_bytes, sum);
      EXPECT_EQ(st.live_allocations, allocations.size() - freed);
      EXPECT_EQ(st.deallocations, freed);
      EXPECT_TRUE(r.is_valid()) << r.validate();
    }
  }
  gpumem_test::release_cached(r);  // pools cache freed memory until asked to give it back
  const auto st = r.stats();
  EXPECT_EQ(st.live_bytes, 0u);
  EXPECT_EQ(st.live_allocations, 0u);
  EXPECT_EQ(st.reserved_bytes, 0u) << "nothing is held once everything is freed (and trimmed)";
  EXPECT_EQ(st.allocations, contract_sizes.size());
  EXPECT_EQ(st.deallocations, contract_sizes.size());
}

TEST_P(resource_contract, honours_every_power_of_two_alignment_up_to_max) {
  auto& r = *resource_;
  const std::size_t max = r.max_alignment();
  ASSERT_GE(max, gpumem::default_alignment);
  ASSERT_EQ(max & (max - 1), 0u) << "max_alignment() must be a power of two";
  for (std::size_t alignment = 1; alignment <= max && alignment <= GiB; alignment <<= 1) {
    for (std::size_t bytes : {std::size_t{1}, 3 * MiB + 5}) {
      void* p = r.allocate(bytes, alignment);
      ASSERT_NE(p, nullptr);
      const auto a = reinterpret_cast<std::uintptr_t>(p);
      const std::size_t want = std::max(alignment, gpumem::default_alignment);
      EXPECT_EQ(a % want, 0u) << bytes << " bytes, alignment " << alignment << ": " << p;
      if (std::size_t g = vmm_granularity(r)) { EXPECT_EQ(a % g, 0u); }
      r.deallocate(p, bytes);
    }
  }
  EXPECT_TRUE(r.is_valid()) << r.validate();
  EXPECT_EQ(r.stats().live_allocations, 0u);
}

TEST_P(resource_contract, bytes_written_are_read_back_from_every_live_allocation) {
  auto& r = *resource_;
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t bytes : contract_sizes) live.emplace_back(r.allocate(bytes), bytes);
  // Write all first, then read all: a write into one must not show in another.
  unsigned seed = 1;
  for (auto& [p, bytes] : live) {
    write_device(p, pattern(bytes, seed++));
    if (HasFatalFailure()) return;
  }
  seed = 1;
  for (auto& [p, bytes] : live) {
    const auto expected = pattern(bytes, seed++);
    const auto got = read_device(p, bytes);
    EXPECT_TRUE(got == expected) << "bytes of the " << bytes << "-byte allocation differ";
  }
  // Freeing some leaves the others' bytes alone.
  for (std::size_t i = 0; i < live.size(); i += 2) r.deallocate(live[i].first, live[i].second);
  for (std::size_t i = 1; i < live.size(); i += 2) {
    const auto expected = pattern(live[i].second, static_cast<unsigned>(i + 1));
    EXPECT_TRUE(read_device(live[i].first, live[i].second) == expected)
        << "bytes of the " << live[i].second << "-byte allocation changed";
    r.deallocate(live[i].first, live[i].second);
  }
  EXPECT_EQ(r.stats().live_allocations, 0u);
}

TEST_P(resource_contract, stats_follow_a_random_sequence) {
  auto& r = *resource_;
  std::mt19937_64 rng(42);
  std::vector<std::pair<void*, std::size_t>> live;
  std::size_t sum = 0, peak = 0;
  std::uint64_t allocations = 0, deallocations = 0;
  for (int step = 0; step < 300; ++step) {
    const bool allocate = live.empty() || (live.size() < 24 && rng() % 3 != 0);
    if (allocate) {
      const std::size_t bytes = 1 + rng() % (3 * MiB);
      live.emplace_back(r.allocate(bytes), bytes);
      sum += bytes;
      peak = std::max(peak, sum);
      ++allocations;
    } else {
      const std::size_t i = rng() % live.size();
      r.deallocate(live[i].first, live[i].second);
      sum -= live[i].second;
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      ++deallocations;
    }
    const auto st = r.stats();
    ASSERT_EQ(st.live_bytes, sum) << "step " << step;
    ASSERT_EQ(st.live_allocations, live.size()) << "step " << step;
    ASSERT_EQ(st.peak_live_bytes, peak) << "step " << step;
    ASSERT_EQ(st.allocations, allocations) << "step " << step;
    ASSERT_EQ(st.deallocations, deallocations) << "step " << step;
    ASSERT_GE(st.reserved_bytes, st.live_bytes) << "step " << step;
    ASSERT_GE(st.peak_reserved_bytes, st.reserved_bytes) << "step " << step;
    ASSERT_TRUE(r.is_valid()) << "step " << step << ": " << r.validate();
  }
  for (auto& [p, bytes] : live) r.deallocate(p, bytes);
  EXPECT_EQ(r.stats().live_bytes, 0u);
}

TEST_P(resource_contract, destructor_frees_what_is_still_live) {
  // TearDown destroys the resource and, on sim, requires that nothing is left behind.
  auto& r = *resource_;
  for (std::size_t bytes : contract_sizes) ASSERT_NE(r.allocate(bytes), nullptr);
  EXPECT_EQ(r.stats().live_allocations, contract_sizes.size());
  if (on_sim()) { EXPECT_FALSE(sim_->live_objects().none()); }
}

// --- bad input is refused, state intact ---------------------------------------------------

TEST_P(resource_contract, zero_bytes_is_invalid_argument) {
  auto& r = *resource_;
  void* keep = r.allocate(4097);
  const auto before = r.stats();
  EXPECT_THROW(r.allocate(0), gpumem::invalid_argument);
  EXPECT_THROW(r.allocate(0, 1), gpumem::invalid_argument);
  expect_same_stats(r.stats(), before);
  EXPECT_TRUE(r.is_valid()) << r.validate();
  r.deallocate(keep, 4097);
}

TEST_P(resource_contract, more_than_the_device_total_is_invalid_argument) {
  auto& r = *resource_;
  ASSERT_GT(r.device_total_bytes(), 0u);
  void* keep = r.allocate(255);
  const auto before = r.stats();
  const auto live_before = on_sim() ? sim_->live_objects().describe() : std::string();
  for (std::size_t bytes : {r.device_total_bytes() + 1, r.device_total_bytes() * 2,
                            SIZE_MAX / 2, SIZE_MAX}) {
    try {
      (void)r.allocate(bytes);
      ADD_FAILURE() << bytes << " bytes were accepted";
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("total"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << bytes << " bytes: expected invalid_argument, got: " << e.what();
    }
  }
  expect_same_stats(r.stats(), before);
  if (on_sim()) { EXPECT_EQ(sim_->live_objects().describe(), live_before); }
  r.deallocate(keep, 255);
}

TEST_P(resource_contract, bad_alignment_is_invalid_argument) {
  auto& r = *resource_;
  void* keep = r.allocate(1 * MiB);
  const auto before = r.stats();
  const std::size_t max = r.max_alignment();
  for (std::size_t alignment : {std::size_t{0}, std::size_t{3}, std::size_t{384},
                                std::size_t{257}, max + 256, max * 2, max * 4}) {
    try {
      (void)r.allocate(4096, alignment);
      ADD_FAILURE() << "alignment " << alignment << " was accepted";
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("alignment"), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "alignment " << alignment << ": expected invalid_argument, got "
                    << e.what();
    }
  }
  expect_same_stats(r.stats(), before);
  EXPECT_TRUE(r.is_valid()) << r.validate();
  r.deallocate(keep, 1 * MiB);
}

TEST_P(resource_contract, unknown_pointer_is_refused) {
  auto& r = *resource_;
  void* keep = r.allocate(4097);
  int on_the_stack = 0;
  expect_refused_free(r, &on_the_stack, sizeof on_the_stack, "unknown");
  auto heap = std::make_unique<std::uint64_t[]>(64);
  expect_refused_free(r, heap.get(), 64 * sizeof(std::uint64_t), "unknown");
  expect_refused_free(r, nullptr, 16, "null");
  r.deallocate(keep, 4097);
}

TEST_P(resource_contract, interior_pointer_is_refused) {
  auto& r = *resource_;
  for (std::size_t bytes : {std::size_t{4097}, 1 * MiB, 2 * MiB + 1}) {
    auto* p = static_cast<char*>(r.allocate(bytes));
    expect_refused_free(r, p + 256, bytes - 256, "interior");
    expect_refused_free(r, p + 256, bytes, "interior");
    expect_refused_free(r, p + bytes - 1, 1, "interior");
    r.deallocate(p, bytes);  // the real allocation is still owned and frees normally
  }
  EXPECT_EQ(r.stats().live_allocations, 0u);
}

TEST_P(resource_contract, double_free_is_refused) {
  auto& r = *resource_;
  void* keep = r.allocate(256);
  for (std::size_t bytes : {std::size_t{1}, std::size_t{4097}, 2 * MiB + 1}) {
    void* p = r.allocate(bytes);
    r.deallocate(p, bytes);
    expect_refused_free(r, p, bytes, "double free");
  }
  EXPECT_EQ(r.stats().live_allocations, 1u);
  r.deallocate(keep, 256);
}

TEST_P(resource_contract, size_mismatch_is_refused) {
  auto& r = *resource_;
  const std::size_t bytes = 4097;
  void* p = r.allocate(bytes);
  write_device(p, pattern(bytes, 7));
  expect_refused_free(r, p, bytes + 1, "size mismatch");
  expect_refused_free(r, p, bytes - 1, "size mismatch");
  expect_refused_free(r, p, 1, "size mismatch");
  // Refusal changed nothing: the bytes are intact and the right size frees it.
  EXPECT_TRUE(read_device(p, bytes) == pattern(bytes, 7));
  r.deallocate(p, bytes);
  EXPECT_EQ(r.stats().live_allocations, 0u);
}

TEST_P(resource_contract, pointer_of_another_resource_is_refused_naming_its_owner) {
  auto& a = *resource_;
  auto& b = other_resource();
  const std::size_t bytes = 3 * MiB;
  void* from_a = a.allocate(bytes);
  void* from_b = b.allocate(bytes);
  write_device(from_a, pattern(bytes, 11));
  write_device(from_b, pattern(bytes, 12));

  const auto b_before = b.stats();
  expect_refused_free(b, from_a, bytes, "'" + std::string(a.name()) + "'");
  expect_refused_free(a, from_b, bytes, "'" + std::string(b.name()) + "'");
  expect_same_stats(b.stats(), b_before);

  // Both owners still hold their memory, bytes intact, and free it normally.
  EXPECT_TRUE(read_device(from_a, bytes) == pattern(bytes, 11));
  EXPECT_TRUE(read_device(from_b, bytes) == pattern(bytes, 12));
  a.deallocate(from_a, bytes);
  b.deallocate(from_b, bytes);
  EXPECT_EQ(a.stats().live_allocations, 0u);
  EXPECT_EQ(b.stats().live_allocations, 0u);
  EXPECT_TRUE(a.is_valid()) << a.validate();
  EXPECT_TRUE(b.is_valid()) << b.validate();
}

// --- exhaustion ---------------------------------------------------------------------------

TEST_P(resource_contract, exhaustion_throws_out_of_memory_with_a_report_then_recovers) {
  if (!on_sim()) GTEST_SKIP() << "never exhausts a real GPU";
  constexpr std::size_t capacity = 64 * MiB;
  constexpr std::size_t chunk = 4 * MiB;
  {
    sim_platform small(sim_options{.capacity = capacity, .granularity = 2 * MiB});
    auto r = GetParam().factory.make(small);

    auto fill = [&](std::vector<void*>& live) -> std::string {
      for (int i = 0; i < 1000; ++i) {
        try {
          live.push_back(r->allocate(chunk));
        } catch (const gpumem::out_of_memory& e) {
          return e.what();
        }
      }
      return {};
    };

    std::vector<void*> live;
    const std::string report = fill(live);
    ASSERT_FALSE(report.empty()) << "1000 allocations of 4 MiB fit in a 64 MiB device";
    EXPECT_GE(live.size() * chunk, capacity / 2)
        << "only " << live.size() << " x 4 MiB fit in 64 MiB before out_of_memory";
    EXPECT_LE(live.size() * chunk, capacity);
    EXPECT_NE(report.find(std::to_string(chunk)), std::string::npos) << report;
    EXPECT_NE(report.find("total"), std::string::npos) << report;
    EXPECT_NE(report.find("free"), std::string::npos) << report;
    EXPECT_NE(report.find("holds"), std::string::npos) << report;

    // Also a std::bad_alloc, and a failed allocate changes nothing.
    const auto before = r->stats();
    const auto objects_before = small.live_objects().describe();
    EXPECT_THROW((void)r->allocate(chunk), std::bad_alloc);
    expect_same_stats(r->stats(), before);
    EXPECT_EQ(small.live_objects().describe(), objects_before);
    EXPECT_TRUE(r->is_valid()) << r->validate();
    EXPECT_TRUE(small.is_valid()) << small.validate();
    EXPECT_EQ(before.live_allocations, live.size());

    // Freed memory is usable again, all of it.
    const std::size_t fitted = live.size();
    for (void* p : live) r->deallocate(p, chunk);
    live.clear();
    EXPECT_EQ(r->stats().live_bytes, 0u);
    EXPECT_FALSE(fill(live).empty());
    EXPECT_EQ(live.size(), fitted);
    for (void* p : live) r->deallocate(p, chunk);
    EXPECT_TRUE(r->is_valid()) << r->validate();

    r.reset();
    EXPECT_TRUE(small.live_objects().none()) << small.live_objects().describe();
    EXPECT_TRUE(small.is_valid()) << small.validate();
  }
}

// --- instantiation ------------------------------------------------------------------------

std::vector<contract_param> every_resource_on_every_platform() {
  std::vector<contract_param> out;
  for (platform_kind on : {platform_kind::sim, platform_kind::cuda})
    for (auto& f : gpumem_test::all_resource_factories()) out.push_back({on, f});
  return out;
}

INSTANTIATE_TEST_SUITE_P(all, resource_contract,
                         ::testing::ValuesIn(every_resource_on_every_platform()),
                         [](const ::testing::TestParamInfo<contract_param>& info) {
                           return std::string(info.param.on == platform_kind::sim ? "sim_"
                                                                                  : "cuda_") +
                                  info.param.factory.name;
                         });

}  // namespace
