// Embedding tables loaded and unloaded for hours: the workload where a caching allocator
// strands memory. Dozens of tables of very different sizes come and go; each allocator
// gets the same budget (pool_options::limit_bytes, default 34 GiB) on a sim device and the same
// seeded sequence, with the loaded tables never more than 32 GiB.
//
//   caching_pool   segments from cudaMalloc, split and cached (PyTorch's design): a free
//                  segment partly in use cannot be given back, so free memory strands
//   vmm_page_pool  free pages are unmapped and remapped where the next table needs them
//                  (also with big_chunk:16, 32 MiB handles for big growths)
//   cudaMalloc     no cache: never strands memory, pays the driver on every call
//
// Usage: embedding_tables [--steps N] [--seed S] [--budget-gib G] [--device sim|cuda]
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
#include "gpumem/errors.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

using namespace gpumem;

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20, GiB = std::size_t{1} << 30;

struct outcome {
  std::string allocator;
  std::uint64_t loads = 0, ooms = 0;
  std::size_t peak_reserved = 0, peak_live = 0;
  double call_ms = 0;             // host time inside allocate/deallocate
  double driver_ms = 0;           // modelled on sim, measured on the GPU
  std::string top_calls;          // calls that took >= 1 ms in all
  std::uint64_t first_oom_step = 0;
};

outcome run(const std::string& name, int steps, std::uint64_t seed, std::size_t budget,
            platform* gpu) {
  sim_options so;
  so.capacity = 80 * GiB;
  so.latency = sim_latency::model;
  std::unique_ptr<sim_platform> owned_sim;
  std::unique_ptr<timed_platform> timed;  // on the GPU: time in each CUDA call
  if (gpu == nullptr)
    owned_sim = std::make_unique<sim_platform>(so);
  else
    timed = std::make_unique<timed_platform>(*gpu);
  platform& sim = gpu != nullptr ? static_cast<platform&>(*timed) : *owned_sim;
  pool_options po;
  po.limit_bytes = budget;
  std::unique_ptr<memory_resource> upstream, resource;
  if (name == "caching_pool") {
    upstream = std::make_unique<runtime_resource>(sim, 0);
    resource = std::make_unique<caching_pool>(*upstream, po);
  } else if (name == "vmm_page_pool") {
    resource = std::make_unique<vmm_page_pool>(sim, 0, po);
  } else if (name == "vmm_page_pool_big_chunk") {
    po.big_chunk_pages = 16;
    resource = std::make_unique<vmm_page_pool>(sim, 0, po);
  } else {
    resource = std::make_unique<runtime_resource>(sim, 0);
  }
  std::mt19937_64 rng(seed);
  // 48 tables, 64 MiB to 4 GiB, log-uniform, rounded to 4 KiB rows.
  std::uniform_real_distribution<double> log_size(std::log2(64.0 * MiB), std::log2(4.0 * GiB));
  std::vector<std::size_t> size(48);
  for (auto& s : size) s = (static_cast<std::size_t>(std::exp2(log_size(rng))) + 4095) / 4096 * 4096;
  std::vector<void*> loaded(size.size(), nullptr);
  std::size_t live = 0;
  outcome o;
  o.allocator = name;
  std::uniform_int_distribution<std::size_t> pick(0, size.size() - 1);
  using clock = std::chrono::steady_clock;
  clock::duration in_calls{};
  auto unload_random = [&] {
    for (;;) {
      const std::size_t t = pick(rng);
      if (loaded[t] == nullptr) continue;
      const auto t0 = clock::now();
      resource->deallocate(loaded[t], size[t]);
      in_calls += clock::now() - t0;
      loaded[t] = nullptr;
      live -= size[t];
      return;
    }
  };
  for (int step = 0; step < steps; ++step) {
    // A table not loaded is asked for; others are evicted until it fits the 32 GiB.
    std::size_t t = pick(rng);
    while (loaded[t] != nullptr) t = pick(rng);
    while (live + size[t] > 32 * GiB) unload_random();
    for (;;) {
      const auto t0 = clock::now();
      try {
        loaded[t] = resource->allocate(size[t]);
        in_calls += clock::now() - t0;
        break;
      } catch (const out_of_memory&) {
        in_calls += clock::now() - t0;
        // The serving system's only way out: evict another table and try again.
        if (o.ooms++ == 0) o.first_oom_step = static_cast<std::uint64_t>(step);
        if (live == 0) throw;
        unload_random();
      }
    }
    live += size[t];
    ++o.loads;
    o.peak_live = std::max(o.peak_live, live);
  }
  for (std::size_t t = 0; t < size.size(); ++t)
    if (loaded[t] != nullptr) resource->deallocate(loaded[t], size[t]);
  o.peak_reserved = resource->stats().peak_reserved_bytes;
  o.call_ms = std::chrono::duration<double, std::milli>(in_calls).count();
  for (std::size_t i = 0; i < platform_op_count; ++i) {
    const auto op = static_cast<platform_op>(i);
    const double ns = static_cast<double>(owned_sim ? owned_sim->modelled_ns(op) : timed->measured_ns(op));
    o.driver_ms += ns / 1e6;
    if (ns >= 1e6)
      o.top_calls += std::string(platform_op_name(op)) + " " + std::to_string(sim.calls_made(op)) +
                     "x " + std::to_string(static_cast<long long>(ns / 1e6)) + "ms  ";
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 5000;
  std::uint64_t seed = 1;
  std::size_t budget = 34 * GiB;
  std::string device = "sim";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--seed") && i + 1 < argc) seed = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--budget-gib") && i + 1 < argc) budget = std::strtoull(argv[++i], nullptr, 10) * GiB;
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
    else {
      std::fprintf(stderr, "usage: embedding_tables [--steps N] [--seed S] [--budget-gib G] [--device sim|cuda]\n");
      return 2;
    }
  }
  platform* gpu = device == "cuda" ? &platform_by_name("cuda") : nullptr;
  std::printf("48 embedding tables of 64 MiB - 4 GiB, %d load steps, at most 32 GiB loaded, "
              "%zu GiB budget, %s\n\n", steps, budget / GiB,
              gpu ? "on the GPU (time measured)" : "sim device (driver time modelled on H200 latencies)");
  std::printf("%-24s %8s %14s %12s %14s %14s %16s\n", "allocator", "loads", "OOMs (evicted)",
              "first OOM", "peak reserved", "time in calls", gpu ? "driver (measured)" : "driver (modelled)");
  for (const char* name : {"caching_pool", "vmm_page_pool", "vmm_page_pool_big_chunk", "cudaMalloc"}) {
    const outcome o = run(name, steps, seed, budget, gpu);
    char first[32] = "-";
    if (o.ooms != 0) std::snprintf(first, sizeof first, "step %llu", static_cast<unsigned long long>(o.first_oom_step));
    std::printf("%-24s %8llu %14llu %12s %14s %11.1f ms %14.1f ms\n", o.allocator.c_str(),
                static_cast<unsigned long long>(o.loads), static_cast<unsigned long long>(o.ooms),
                first, format_bytes(o.peak_reserved).c_str(), o.call_ms, o.driver_ms);
    std::printf("    %s\n", o.top_calls.c_str());
  }
  return 0;
}
