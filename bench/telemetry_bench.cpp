// telemetry_bench: what telemetry costs a pool, measured side by side in one process on the
// sim device (host-only figures: the pool's own bookkeeping, not a GPU's).
//
//   same_size   allocate + free of one cached 1 MiB block, repeated
//   mixed_64    64 live blocks of random sizes 512 B - 8 MiB (log-uniform); each step frees
//               one at random and allocates a new random size
// each on vmm_page_pool and caching_pool, with: no recorder (the pool's one branch), a
// recorder without context, with the thread's context tag, and with backtraces.
// Then: memory_stats collection, and snapshot export (pickle bytes, with and without
// symbolizing 100,000 backtraces).
//
// Usage: telemetry_bench [--quick]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/telemetry.hpp"

using namespace gpumem;
using clock_type = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double elapsed_ns(clock_type::time_point t0) {
  return std::chrono::duration<double, std::nano>(clock_type::now() - t0).count();
}

// ns per alloc+free pair, median of 7 repetitions.
double same_size(pool_base& pool, int steps) {
  std::vector<double> reps;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = clock_type::now();
    for (int i = 0; i < steps; ++i) pool.deallocate(pool.allocate(1 << 20), 1 << 20);
    reps.push_back(elapsed_ns(t0) / steps);
  }
  return median(reps);
}

double mixed(pool_base& pool, int steps) {
  std::vector<double> reps;
  for (int rep = 0; rep < 7; ++rep) {
    std::mt19937_64 rng(42);
    std::uniform_real_distribution<double> log_size(std::log(512.0), std::log(8.0 * (1 << 20)));
    auto size = [&] { return static_cast<std::size_t>(std::exp(log_size(rng))); };
    std::vector<std::pair<void*, std::size_t>> live;
    for (int i = 0; i < 64; ++i) {
      const std::size_t s = size();
      live.emplace_back(pool.allocate(s), s);
    }
    const auto t0 = clock_type::now();
    for (int i = 0; i < steps; ++i) {
      auto& slot = live[rng() % live.size()];
      pool.deallocate(slot.first, slot.second);
      slot.second = size();
      slot.first = pool.allocate(slot.second);
    }
    reps.push_back(elapsed_ns(t0) / steps);
    for (auto& [p, s] : live) pool.deallocate(p, s);
  }
  return median(reps);
}

struct mode {
  const char* name;
  bool recorder;
  record_context context;
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const int steps = quick ? 20000 : 200000;
  sim_options so;
  so.capacity = std::size_t{80} << 30;
  sim_platform sim(so);

  const mode modes[] = {{"off (no recorder)", false, record_context::none},
                        {"recorder, no context", true, record_context::none},
                        {"recorder + tag", true, record_context::tag},
                        {"recorder + backtrace", true, record_context::backtrace}};
  std::printf("telemetry_bench on sim (development machine, no GPU): ns per alloc+free pair, "
              "median of 7 x %d\n\n", steps);
  std::printf("%-14s %-24s %12s %12s\n", "pool", "telemetry", "same_size", "mixed_64");
  for (const char* pool_name : {"vmm_page_pool", "caching_pool"}) {
    runtime_resource upstream(sim);
    std::unique_ptr<pool_base> pool;
    if (std::string(pool_name) == "vmm_page_pool")
      pool = std::make_unique<vmm_page_pool>(sim);
    else
      pool = std::make_unique<caching_pool>(upstream);
    // Warm the pool so every mode measures the cached path, not growth.
    (void)mixed(*pool, 1000);
    for (const mode& m : modes) {
      recorder_options ro;
      ro.capacity = 1 << 16;
      ro.context = m.context;
      event_recorder rec(ro);
      scoped_context_tag tag("bench");
      if (m.recorder) rec.attach(*pool);
      const double a = same_size(*pool, m.context == record_context::backtrace ? steps / 10 : steps);
      const double b = mixed(*pool, m.context == record_context::backtrace ? steps / 10 : steps);
      rec.detach();
      std::printf("%-14s %-24s %12.1f %12.1f\n", pool_name, m.name, a, b);
    }
  }

  // Export costs on a pool with many blocks and a full 100,000-event trace.
  std::printf("\nexport (vmm_page_pool, 64 live blocks, trace of 100,000 events):\n");
  for (record_context ctx : {record_context::none, record_context::backtrace}) {
    vmm_page_pool pool(sim);
    recorder_options ro;
    ro.context = ctx;
    event_recorder rec(ro);
    rec.attach(pool);
    std::mt19937_64 rng(7);
    std::vector<std::pair<void*, std::size_t>> live;
    for (int i = 0; i < 64; ++i) live.emplace_back(pool.allocate(1 << 20), 1 << 20);
    for (int i = 0; i < 50000; ++i) {
      auto& slot = live[rng() % live.size()];
      pool.deallocate(slot.first, slot.second);
      slot.second = 512 + rng() % (4 << 20);
      slot.first = pool.allocate(slot.second);
    }
    auto t0 = clock_type::now();
    const memory_stats st = collect_memory_stats(pool);
    const double stats_us = elapsed_ns(t0) / 1e3;
    t0 = clock_type::now();
    const std::string bytes = memory_snapshot_pickle(pool, &rec);
    const double snap_ms = elapsed_ns(t0) / 1e6;
    std::printf("  %-22s memory_stats %8.1f us; snapshot %8.1f ms, %zu bytes, %zu segments\n",
                ctx == record_context::none ? "no context" : "backtraces (symbolized)", stats_us,
                snap_ms, bytes.size(), st.segments);
    rec.detach();
    for (auto& [p, s] : live) pool.deallocate(p, s);
  }
  return 0;
}
