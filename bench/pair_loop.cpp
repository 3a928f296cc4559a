// pair_loop: pool_bench's mixed-size loop on the sim device, for counting what one
// allocate+free pair costs in instructions and mispredicted branches (valgrind: see
// scripts/pair-instructions.sh), not for timing. Hosts drift by tens of percent from minute
// to minute (docs/RESULTS.md); an instruction count does not, and it moves with the code.
//
// 64 live blocks of random sizes in [--lo, --hi] (log-uniform, 512-byte multiples); each
// step frees one at random and allocates a new size, through memory_resource's
// allocate/deallocate. A warm-up of 20,000 steps (seed 7), then --pairs steps (seed 42)
// inside measured_pairs(), the function the script tells valgrind to count.
//
// Usage: pair_loop [--lo BYTES] [--hi BYTES] [--pairs N] [--config K:V,...]
//                  [--pool vmm_page_pool|caching_pool]   (default vmm_page_pool; the
//                  caching pool over cudaMalloc's sim stand-in)   [--overhead]
//   --overhead: where the pool's reserved bytes are after the measured pairs
//   (pool_base::overhead()).
#include <cmath>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/backend.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/telemetry.hpp"

using namespace gpumem;

namespace {

struct loop {
  std::vector<std::pair<int, std::size_t>> steps;  // (slot, new size), drawn before the run
  std::vector<std::size_t> sizes = std::vector<std::size_t>(64);
  std::vector<void*> ptrs = std::vector<void*>(64);
};

loop draw(double lo, double hi, int count, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log2(lo), std::log2(hi));
  std::uniform_int_distribution<int> slot(0, 63);
  auto random_size = [&] {
    return (static_cast<std::size_t>(std::exp2(log_size(rng))) + 511) / 512 * 512;
  };
  loop l;
  for (auto& s : l.sizes) s = random_size();
  l.steps.resize(static_cast<std::size_t>(count));
  for (auto& s : l.steps) s = {slot(rng), random_size()};
  return l;
}

void fill(memory_resource& pool, loop& l) {
  for (int i = 0; i < 64; ++i) l.ptrs[i] = pool.allocate(l.sizes[i]);
}

void empty(memory_resource& pool, loop& l) {
  for (int i = 0; i < 64; ++i) pool.deallocate(l.ptrs[i], l.sizes[i]);
}

void pairs(memory_resource& pool, loop& l) {
  for (auto [i, size] : l.steps) {
    pool.deallocate(l.ptrs[i], l.sizes[i]);
    l.ptrs[i] = pool.allocate(l.sizes[i] = size);
  }
}

}  // namespace

// The measured steps, by name for valgrind's --toggle-collect.
[[gnu::noinline]] void measured_pairs(memory_resource& pool, loop& l) { pairs(pool, l); }

int main(int argc, char** argv) {
  double lo = 512, hi = 8.0 * (1 << 20);
  int count = 200000;
  std::string config, pool_name = "vmm_page_pool";
  bool show_overhead = false;
  for (int i = 1; i < argc; ++i) {
    const bool has_value = i + 1 < argc;
    if (!std::strcmp(argv[i], "--lo") && has_value) lo = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--hi") && has_value) hi = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--pairs") && has_value) count = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--config") && has_value) config = argv[++i];
    else if (!std::strcmp(argv[i], "--overhead")) show_overhead = true;
    else if (!std::strcmp(argv[i], "--pool") && has_value &&
             (!std::strcmp(argv[i + 1], "vmm_page_pool") || !std::strcmp(argv[i + 1], "caching_pool")))
      pool_name = argv[++i];
    else {
      std::fprintf(stderr, "usage: pair_loop [--lo BYTES] [--hi BYTES] [--pairs N] [--config K:V,...] [--pool vmm_page_pool|caching_pool] [--overhead]\n");
      return 2;
    }
  }
  if (!(lo >= 1 && hi > lo && count > 0)) {
    std::fprintf(stderr, "pair_loop: needs 1 <= lo < hi and pairs > 0\n");
    return 2;
  }
  // 8 GiB: the loop needs far less, and under valgrind the default capacity fails.
  sim_options so;
  so.capacity = std::size_t{8} << 30;
  sim_platform sim(so);
  runtime_resource upstream(sim, 0);
  std::unique_ptr<pool_base> owned;
  if (pool_name == "vmm_page_pool")
    owned = std::make_unique<vmm_page_pool>(sim, 0, pool_options::parse(config));
  else
    owned = std::make_unique<caching_pool>(upstream, pool_options::parse(config));
  pool_base& pool = *owned;
  auto* vmm = dynamic_cast<vmm_page_pool*>(&pool);
  loop warm = draw(lo, hi, 20000, 7);
  fill(pool, warm);
  pairs(pool, warm);
  empty(pool, warm);
  loop measured = draw(lo, hi, count, 42);
  fill(pool, measured);
  const memory_stats before = collect_memory_stats(pool);
  const vmm_page_counts pages_before = vmm != nullptr ? vmm->page_counts() : vmm_page_counts{};
  measured_pairs(pool, measured);
  const memory_stats after = collect_memory_stats(pool);
  const vmm_page_counts pages_after = vmm != nullptr ? vmm->page_counts() : vmm_page_counts{};
  const std::string where = show_overhead ? pool.overhead().to_string("  ") : "";
  empty(pool, measured);
  if (!where.empty()) std::printf("after the measured pairs:\n%s", where.c_str());
  std::printf("pair_loop: %d pairs of %.0f-%.0f bytes, %s%s%s\n", count, lo, hi, pool_name.c_str(),
              config.empty() ? "" : " ", config.c_str());
  // The driver calls the measured pairs made (on a GPU, each costs microseconds: a pair's
  // cost in instructions leaves them out).
  std::printf("driver calls in the measured pairs:");
  bool any = false;
  for (const auto& [name, n] : after.driver_calls) {
    const auto it = before.driver_calls.find(name);
    const std::uint64_t made = n - (it == before.driver_calls.end() ? 0 : it->second);
    if (made != 0) std::printf(" %s %llu", name.c_str(), static_cast<unsigned long long>(made));
    any = any || made != 0;
  }
  std::printf("%s\n", any ? "" : " none");
  if (vmm != nullptr)
    std::printf("pages in the measured pairs: %llu gathered (remapped), %llu created; %zu mapped at the end, "
              "peak live %.1f MiB, peak reserved %.1f MiB\n",
              static_cast<unsigned long long>(pages_after.pages_reclaimed - pages_before.pages_reclaimed),
              static_cast<unsigned long long>(pages_after.pages_created - pages_before.pages_created),
              pages_after.mapped_pages, static_cast<double>(after.requested_bytes.peak) / (1 << 20),
              static_cast<double>(after.reserved_bytes.peak) / (1 << 20));
  return 0;
}
