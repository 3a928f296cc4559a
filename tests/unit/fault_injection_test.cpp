// Fault injection into the backends: every platform call that a backend's allocate or
// deallocate makes is failed in turn (out_of_memory and driver_error). The error must be
// typed and name the call, the resource must be exactly as before and keep working, a
// pointer whose free failed must still be owned, and sim must end with nothing leaked.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <utility>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"
#include "fuzz/fuzz_driver.hpp"

namespace {

using gpumem::failure_kind;
using gpumem::memory_resource;
using gpumem::platform_op;
using gpumem::resource_stats;
using gpumem::sim_fault;
using gpumem::sim_options;
using gpumem::sim_platform;

constexpr std::size_t MiB = std::size_t{1} << 20;

enum class phase { allocate, deallocate };

struct fault_case {
  std::string resource;  // runtime, driver, vmm
  platform_op op;
  phase when;
  failure_kind kind;
};

std::unique_ptr<memory_resource> make_resource(const std::string& name, sim_platform& sim) {
  if (name == "runtime") return std::make_unique<gpumem::runtime_resource>(sim);
  if (name == "driver") return std::make_unique<gpumem::driver_resource>(sim);
  return std::make_unique<gpumem::vmm_resource>(sim);
}

std::string op_name(platform_op op) { return std::string(gpumem::platform_op_name(op)); }

void expect_same_stats(const resource_stats& now, const resource_stats& before) {
  EXPECT_EQ(now.live_bytes, before.live_bytes);
  EXPECT_EQ(now.peak_live_bytes, before.peak_live_bytes);
  EXPECT_EQ(now.live_allocations, before.live_allocations);
  EXPECT_EQ(now.reserved_bytes, before.reserved_bytes);
  EXPECT_EQ(now.peak_reserved_bytes, before.peak_reserved_bytes);
  EXPECT_EQ(now.allocations, before.allocations) << "allocations counts successful allocates";
  EXPECT_EQ(now.deallocations, before.deallocations)
      << "deallocations counts successful deallocates";
}

class backend_fault_injection : public ::testing::TestWithParam<fault_case> {
 protected:
  void SetUp() override {
    sim_ = std::make_unique<sim_platform>(
        sim_options{.capacity = 256 * MiB, .granularity = 2 * MiB});
    resource_ = make_resource(GetParam().resource, *sim_);
    ASSERT_EQ(resource_->name(), GetParam().resource);
  }
  void TearDown() override {
    sim_->clear_faults();
    resource_.reset();
    EXPECT_TRUE(sim_->live_objects().none()) << "leaked: " << sim_->live_objects().describe();
    EXPECT_TRUE(sim_->is_valid()) << sim_->validate();
  }

  void fill(void* p, std::size_t bytes, unsigned char value) {
    std::vector<unsigned char> host(bytes, value);
    ASSERT_TRUE(sim_->memcpy_async(p, host.data(), bytes, {}).ok());
  }
  bool filled_with(const void* p, std::size_t bytes, unsigned char value) {
    std::vector<unsigned char> host(bytes, 0);
    if (!sim_->memcpy_async(host.data(), p, bytes, {}).ok()) return false;
    for (auto b : host)
      if (b != value) return false;
    return true;
  }

  // A round trip that shows the resource still serves memory.
  void expect_usable() {
    void* p = nullptr;
    ASSERT_NO_THROW(p = resource_->allocate(3 * MiB + 7));
    fill(p, 3 * MiB + 7, 0x3c);
    EXPECT_TRUE(filled_with(p, 3 * MiB + 7, 0x3c));
    ASSERT_NO_THROW(resource_->deallocate(p, 3 * MiB + 7));
  }

  std::unique_ptr<sim_platform> sim_;
  std::unique_ptr<memory_resource> resource_;
};

TEST_P(backend_fault_injection, failed_call_is_typed_and_leaves_the_resource_intact) {
  const auto& c = GetParam();
  auto& r = *resource_;
  const std::size_t keep_bytes = 1 * MiB + 3;
  void* keep = r.allocate(keep_bytes);  // state that must survive the failure
  fill(keep, keep_bytes, 0xa5);
  const std::size_t bytes = 5 * MiB + 1;

  if (c.when == phase::allocate) {
    const auto before = r.stats();
    const auto objects_before = sim_->live_objects().describe();
    const auto used_before = sim_->used_bytes(0);
    const auto calls_before = sim_->calls_made(c.op);

    sim_->inject_fault(c.op, sim_fault{.nth = 1, .kind = c.kind});
    bool threw_right_type = false;
    try {
      (void)r.allocate(bytes);
      ADD_FAILURE() << "allocate succeeded though " << op_name(c.op) << " failed";
    } catch (const gpumem::out_of_memory& e) {
      EXPECT_EQ(c.kind, failure_kind::out_of_memory)
          << "a " << op_name(c.op) << " driver error was reported as out_of_memory: "
          << e.what();
      threw_right_type = c.kind == failure_kind::out_of_memory;
      const std::string report = e.what();
      EXPECT_NE(report.find(op_name(c.op)), std::string::npos) << report;
      EXPECT_NE(report.find(std::to_string(bytes)), std::string::npos) << report;
      EXPECT_NE(report.find("total"), std::string::npos) << report;
      EXPECT_NE(report.find("holds"), std::string::npos) << report;
    } catch (const gpumem::cuda_error& e) {
      EXPECT_EQ(c.kind, failure_kind::driver_error)
          << "out of memory in " << op_name(c.op) << " was reported as cuda_error: " << e.what();
      threw_right_type = c.kind == failure_kind::driver_error;
      EXPECT_EQ(e.call(), op_name(c.op));
      EXPECT_NE(std::string(e.what()).find(op_name(c.op)), std::string::npos) << e.what();
      EXPECT_EQ(e.code_name(), "CUDA_ERROR_UNKNOWN");
      EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
      EXPECT_NE(e.where().find("allocate"), std::string::npos) << e.where();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "untyped error: " << e.what();
    }
    EXPECT_TRUE(threw_right_type);
    EXPECT_EQ(sim_->calls_made(c.op), calls_before + 1) << op_name(c.op) << " was not called";

    // Exactly as before: no allocation, no leaked range, handle, mapping or frames.
    expect_same_stats(r.stats(), before);
    EXPECT_EQ(sim_->live_objects().describe(), objects_before);
    EXPECT_EQ(sim_->used_bytes(0), used_before);
    EXPECT_TRUE(r.is_valid()) << r.validate();
    EXPECT_TRUE(sim_->is_valid()) << sim_->validate();
    EXPECT_TRUE(filled_with(keep, keep_bytes, 0xa5));

    // The rule fired once: the same request now succeeds.
    void* p = r.allocate(bytes);
    fill(p, bytes, 0x5a);
    EXPECT_TRUE(filled_with(p, bytes, 0x5a));
    r.deallocate(p, bytes);
  } else {
    void* p = r.allocate(bytes);
    fill(p, bytes, 0x77);
    const auto before = r.stats();
    const auto objects_before = sim_->live_objects().describe();

    sim_->inject_fault(c.op, sim_fault{.nth = 1, .kind = c.kind});
    try {
      r.deallocate(p, bytes);
      ADD_FAILURE() << "deallocate succeeded though " << op_name(c.op) << " failed";
    } catch (const gpumem::cuda_error& e) {
      EXPECT_EQ(e.call(), op_name(c.op));
      EXPECT_NE(std::string(e.what()).find(op_name(c.op)), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
      EXPECT_NE(e.where().find("deallocate"), std::string::npos) << e.where();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "expected gpumem::cuda_error naming " << op_name(c.op)
                    << ", got: " << e.what();
    }
    sim_->clear_faults();

    // Still owned, and nothing was lost on the device side. (The allocations and
    // deallocations counters are checked by failed_free_does_not_change_the_counters.)
    EXPECT_EQ(r.stats().live_bytes, before.live_bytes);
    EXPECT_EQ(r.stats().live_allocations, before.live_allocations);
    EXPECT_EQ(r.stats().reserved_bytes, before.reserved_bytes);
    EXPECT_EQ(r.stats().peak_live_bytes, before.peak_live_bytes);
    EXPECT_TRUE(r.is_valid()) << r.validate();
    EXPECT_TRUE(sim_->is_valid()) << sim_->validate();
    EXPECT_EQ(sim_->live_objects().ranges, 0u + (c.resource == "vmm" ? 2u : 0u));
    if (c.op == platform_op::runtime_free || c.op == platform_op::driver_free ||
        c.op == platform_op::unmap) {
      // The very first undo step failed: the memory is untouched and readable.
      EXPECT_EQ(sim_->live_objects().describe(), objects_before);
      EXPECT_TRUE(filled_with(p, bytes, 0x77));
    }
    EXPECT_TRUE(filled_with(keep, keep_bytes, 0xa5));

    // A vmm retry resumes where the failed free stopped, never repeating a done step.
    const auto unmaps_before = sim_->calls_made(platform_op::unmap);
    const auto releases_before = sim_->calls_made(platform_op::release_physical);
    ASSERT_NO_THROW(r.deallocate(p, bytes)) << "retry after clear_faults";
    if (c.op == platform_op::release_physical || c.op == platform_op::free_range) {
      EXPECT_EQ(sim_->calls_made(platform_op::unmap), unmaps_before);
    }
    if (c.op == platform_op::free_range) {
      EXPECT_EQ(sim_->calls_made(platform_op::release_physical), releases_before);
    }
    EXPECT_EQ(r.stats().live_allocations, 1u);
    EXPECT_EQ(r.stats().live_bytes, keep_bytes);
    try {
      r.deallocate(p, bytes);
      ADD_FAILURE() << "second free of a freed pointer accepted";
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("double free"), std::string::npos) << e.what();
    }
  }

  expect_usable();
  EXPECT_TRUE(filled_with(keep, keep_bytes, 0xa5));
  r.deallocate(keep, keep_bytes);
  EXPECT_EQ(r.stats().live_bytes, 0u);
  EXPECT_EQ(r.stats().reserved_bytes, 0u);
  EXPECT_TRUE(r.is_valid()) << r.validate();
}

// A failure that persists across retries: allocate keeps failing cleanly every time.
class backend_persistent_fault : public backend_fault_injection {};

TEST_P(backend_persistent_fault, allocate_fails_every_time_and_never_leaks) {
  const auto& c = GetParam();
  auto& r = *resource_;
  sim_->inject_fault(c.op, sim_fault{.nth = 1, .every_after = true, .kind = c.kind});
  for (int i = 0; i < 20; ++i) {
    EXPECT_ANY_THROW((void)r.allocate(2 * MiB * static_cast<std::size_t>(1 + i % 3)));
    ASSERT_TRUE(sim_->live_objects().none()) << "attempt " << i << " leaked "
                                             << sim_->live_objects().describe();
  }
  EXPECT_EQ(r.stats().allocations, 0u);
  EXPECT_EQ(r.stats().live_bytes, 0u);
  EXPECT_TRUE(r.is_valid()) << r.validate();
  sim_->clear_faults();
  expect_usable();
}

std::vector<fault_case> every_backend_call() {
  struct calls {
    std::string resource;
    std::vector<platform_op> on_allocate, on_deallocate;
  };
  const std::vector<calls> backends = {
      {"runtime", {platform_op::runtime_malloc}, {platform_op::runtime_free}},
      {"driver", {platform_op::driver_alloc}, {platform_op::driver_free}},
      {"vmm",
       {platform_op::reserve_range, platform_op::create_physical, platform_op::map,
        platform_op::set_access},
       {platform_op::unmap, platform_op::release_physical, platform_op::free_range}},
  };
  std::vector<fault_case> out;
  for (const auto& b : backends)
    for (auto kind : {failure_kind::out_of_memory, failure_kind::driver_error}) {
      for (auto op : b.on_allocate) out.push_back({b.resource, op, phase::allocate, kind});
      for (auto op : b.on_deallocate) out.push_back({b.resource, op, phase::deallocate, kind});
    }
  return out;
}

INSTANTIATE_TEST_SUITE_P(every_call, backend_fault_injection,
                         ::testing::ValuesIn(every_backend_call()),
                         [](const ::testing::TestParamInfo<fault_case>& info) {
                           const auto& c = info.param;
                           return c.resource + "_" +
                                  (c.when == phase::allocate ? "allocate_" : "deallocate_") +
                                  op_name(c.op) + "_" +
                                  (c.kind == failure_kind::out_of_memory ? "oom"
                                                                         : "driver_error");
                         });

std::vector<fault_case> every_backend_allocate_call() {
  std::vector<fault_case> out;
  for (auto& c : every_backend_call())
    if (c.when == phase::allocate) out.push_back(c);
  return out;
}

INSTANTIATE_TEST_SUITE_P(every_allocate_call, backend_persistent_fault,
                         ::testing::ValuesIn(every_backend_allocate_call()),
                         [](const ::testing::TestParamInfo<fault_case>& info) {
                           const auto& c = info.param;
                           return c.resource + "_" + op_name(c.op) + "_" +
                                  (c.kind == failure_kind::out_of_memory ? "oom"
                                                                         : "driver_error");
                         });

// stats().allocations counts successful allocate calls and deallocations successful
// deallocate calls; a deallocate that fails (and leaves the pointer owned) is neither.
TEST(backend_stats, failed_free_does_not_change_the_counters) {
  const std::vector<std::pair<std::string, platform_op>> frees = {
      {"runtime", platform_op::runtime_free},
      {"driver", platform_op::driver_free},
      {"vmm", platform_op::unmap},
      {"vmm", platform_op::release_physical},
      {"vmm", platform_op::free_range},
  };
  for (const auto& [name, op] : frees) {
    SCOPED_TRACE(name + " with " + op_name(op) + " failing");
    sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB});
    auto r = make_resource(name, sim);
    void* p = r->allocate(3 * MiB);
    const auto before = r->stats();
    ASSERT_EQ(before.allocations, 1u);
    ASSERT_EQ(before.deallocations, 0u);
    sim.inject_fault(op, sim_fault{.nth = 1, .kind = failure_kind::driver_error});
    EXPECT_THROW(r->deallocate(p, 3 * MiB), gpumem::cuda_error);
    expect_same_stats(r->stats(), before);
    sim.clear_faults();
    r->deallocate(p, 3 * MiB);
    EXPECT_EQ(r->stats().allocations, 1u) << "one allocate succeeded";
    EXPECT_EQ(r->stats().deallocations, 1u) << "one deallocate succeeded";
    r.reset();
    EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
  }
}

// The calls each backend makes are the ones listed above, and only those: a change in
// what allocate/deallocate call must show up here and in the list.
TEST(backend_calls, each_backend_makes_exactly_the_listed_calls) {
  struct expectation {
    std::string resource;
    std::vector<platform_op> calls;  // each once per allocate + deallocate
  };
  const std::vector<expectation> all = {
      {"runtime", {platform_op::runtime_malloc, platform_op::runtime_free}},
      {"driver", {platform_op::driver_alloc, platform_op::driver_free}},
      {"vmm",
       {platform_op::reserve_range, platform_op::create_physical, platform_op::map,
        platform_op::set_access, platform_op::unmap, platform_op::release_physical,
        platform_op::free_range}},
  };
  for (const auto& e : all) {
    sim_platform sim(sim_options{.capacity = 64 * MiB, .granularity = 2 * MiB});
    auto r = make_resource(e.resource, sim);
    std::vector<std::uint64_t> before(gpumem::platform_op_count);
    for (std::size_t i = 0; i < before.size(); ++i)
      before[i] = sim.calls_made(static_cast<platform_op>(i));
    void* p = r->allocate(3 * MiB);
    r->deallocate(p, 3 * MiB);
    for (std::size_t i = 0; i < before.size(); ++i) {
      const auto op = static_cast<platform_op>(i);
      bool listed = false;
      for (auto l : e.calls) listed |= l == op;
      const auto made = sim.calls_made(op) - before[i];
      if (listed) {
        EXPECT_EQ(made, 1u) << e.resource << ": " << op_name(op);
      } else {
        EXPECT_EQ(made, 0u) << e.resource << " unexpectedly calls " << op_name(op);
      }
    }
    r.reset();
    EXPECT_TRUE(sim.live_objects().none()) << sim.live_objects().describe();
  }
}

}  // namespace

namespace {

// A vmm_page_pool whose up-front reservation fails: the constructor throws a typed error
// and leaves nothing on the device (range, handles, mappings), also when a second fault
// strikes the undo (a release, an unmap or the range's free failing once).
struct reserve_fault {
  platform_op first;
  std::uint64_t nth;
  platform_op second;  // count_: none
};

TEST(vmm_page_pool_construction, a_failing_up_front_reserve_leaves_nothing_behind) {
  const platform_op none = platform_op::count_;
  std::vector<reserve_fault> cases;
  for (platform_op first : {platform_op::create_physical, platform_op::map, platform_op::set_access})
    for (std::uint64_t nth : {1u, 2u, 3u, 4u})
      for (platform_op second : {none, platform_op::release_physical, platform_op::unmap,
                                 platform_op::free_range})
        cases.push_back({first, nth, second});
  std::size_t refused = 0;
  for (const reserve_fault& c : cases) {
    for (failure_kind kind : {failure_kind::out_of_memory, failure_kind::driver_error}) {
      SCOPED_TRACE(op_name(c.first) + " #" + std::to_string(c.nth) + " then " +
                   (c.second == none ? std::string("nothing") : op_name(c.second)) +
                   (kind == failure_kind::out_of_memory ? " (out of memory)" : " (driver error)"));
      sim_platform sim(sim_options{.capacity = 256 * MiB, .granularity = 2 * MiB});
      sim.inject_fault(c.first, sim_fault{.nth = c.nth, .kind = kind});
      if (c.second != none)
        sim.inject_fault(c.second, sim_fault{.nth = 1, .kind = failure_kind::driver_error});
      bool threw = false;
      std::unique_ptr<gpumem::vmm_page_pool> pool;
      try {
        pool = std::make_unique<gpumem::vmm_page_pool>(
            sim, 0, gpumem::pool_options::parse("reserve:8M,big_chunk:2"));
      } catch (const gpumem::out_of_memory&) {
        threw = true;
      } catch (const gpumem::cuda_error&) {
        threw = true;
      }
      sim.clear_faults();
      pool.reset();  // a pool the faults missed: destroyed with no fault armed
      refused += threw ? 1 : 0;
      EXPECT_TRUE(sim.live_objects().none()) << "leaked: " << sim.live_objects().describe();
    }
  }
  EXPECT_GT(refused, cases.size() / 2) << "a fault within the reservation makes it fail";
}

}  // namespace

namespace {

// caching_pool over vmm_resource with several fault rules armed at once (a failure inside
// another's undo), seeded as the fuzz corpus is: every failure typed, the model kept and
// nothing left on the sim device. More rules than the corpus arms (it arms up to 3).
// GPUMEM_FAULT_SEEDS overrides the seed count per rule count (for sweeps).
TEST(caching_pool_over_vmm_faults, several_rules_at_once_leak_nothing) {
  std::uint64_t seeds = 12;
  if (const char* s = std::getenv("GPUMEM_FAULT_SEEDS")) seeds = std::strtoull(s, nullptr, 10);
  gpumem_fuzz::fuzz_counts counts;
  for (std::size_t rules : {3u, 4u, 6u})
    for (std::uint64_t seed = 0; seed < seeds; ++seed) {
      const auto bytes = gpumem_fuzz::corpus_bytes(7'000'000 + rules * 100'000 + seed, 6000);
      EXPECT_EQ(gpumem_fuzz::run_pool_fuzz(gpumem_fuzz::pool_target::caching_over_vmm,
                                           bytes.data(), bytes.size(), true, 500, counts, rules),
                "")
          << rules << " rules, seed " << seed;
    }
  EXPECT_GT(counts.faults_armed, seeds * 3 * 2);
  EXPECT_GT(counts.typed_failures, 0u);
}

}  // namespace
