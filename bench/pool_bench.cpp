// pool_bench: allocation speed of gpumem's pools against cudaMalloc and cudaMallocAsync,
// measured side by side in one process on one device (cuda when present, else sim, whose
// figures are host-only and say nothing about a GPU).
//
//   same_size   allocate + free of one cached 1 MiB block, repeated
//   mixed_64    64 live blocks of random sizes 512 B - 8 MiB (log-uniform); each step frees
//               one at random and allocates a new random size (the shape the
//               H200 cudaMallocAsync baseline was measured with)
//               Each pool runs over a timed_platform: the table's last column is the
//               time a mixed pair spent inside the pool's driver calls (growths, remaps,
//               releases), part of its ns a pair.
//   block_arena the pools' shared best-fit arena alone, over a 1 TiB address range it only
//               bookkeeps (no memory, no lock, no pointer map, no stats): the floor under
//               both pools' locked paths, since best fit with splitting and merging on every
//               call is what their fragmentation rests on
//   grow_512    a vmm_page_pool serves one 1 GiB request: 512 pages mapped and given
//               access, reported per page with the driver time of each call kind: on fresh
//               pools (handles created: the defaults' 64 MiB handles for a huge growth,
//               one-page handles, and 128 and 256 MiB ones through big_chunk) and on a pool
//               holding 1 GiB of one-page handles reserved up front (mapped by its
//               constructor, whose time is reported too)
//   threads     1, 2, 4, 8 threads (up to the cores) sharing one pool, same-size pairs, each
//               thread a size of its own: the wall time per pair over all threads (lower =
//               better). Small sizes (256 KiB) with the per-thread caches (the default) and
//               without them (thread_cache:off: the pool's mutex on every call); large ones
//               (4 MiB), which take the pool's mutex either way (their blocks merge at once,
//               never held in a thread's cache: src/pool/core/thread_cache.hpp)
//
// The pools run with their defaults (small requests in size classes, four to an octave: see
// pool_options.hpp), with small_classes:0 (`/units`: 512-byte units) and with thread_cache:off (`/locked`), in the same process.
//
// Allocation speed is timed in rounds (--rounds, default 5): each round runs every allocator
// once, in turn, and each ratio to cudaMallocAsync is taken within a round; the table gives
// medians over rounds and the range of the mixed-size ratio. Hosts vary by tens of percent
// from minute to minute (docs/RESULTS.md), which runs of one allocator after another turn
// into skewed ratios.
//
// Usage: pool_bench [--device auto|cuda|sim] [--rounds N] [--json FILE]
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/pool.hpp"
#include "pool/core/block_arena.hpp"

using namespace gpumem;
using clock_type = std::chrono::steady_clock;

namespace {

struct allocator_fns {
  std::string name;
  std::function<void*(std::size_t)> alloc;
  std::function<void(void*, std::size_t)> free;
  int iterations_scale = 1;  // slow allocators run fewer steps
  const timed_platform* driver = nullptr;  // the platform under a pool, timing its calls
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ns per alloc+free pair, one timed run
double run_same_size(const allocator_fns& a, int steps) {
  const auto t0 = clock_type::now();
  for (int i = 0; i < steps; ++i) a.free(a.alloc(1 << 20), 1 << 20);
  return std::chrono::duration<double, std::nano>(clock_type::now() - t0).count() / steps;
}

double run_mixed(const allocator_fns& a, int steps, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> log_size(std::log2(512.0), std::log2(8.0 * (1 << 20)));
  std::uniform_int_distribution<int> slot(0, 63);
  auto random_size = [&] {
    return (static_cast<std::size_t>(std::exp2(log_size(rng))) + 511) / 512 * 512;
  };
  std::vector<std::size_t> sizes(64);
  std::vector<void*> ptrs(64);
  for (int i = 0; i < 64; ++i) ptrs[i] = a.alloc(sizes[i] = random_size());
  // Pre-draw the sequence so the timed loop does only allocator work.
  std::vector<std::pair<int, std::size_t>> seq(static_cast<std::size_t>(steps));
  for (auto& s : seq) s = {slot(rng), random_size()};
  const auto t0 = clock_type::now();
  for (auto [i, size] : seq) {
    a.free(ptrs[i], sizes[i]);
    ptrs[i] = a.alloc(sizes[i] = size);
  }
  const double ns = std::chrono::duration<double, std::nano>(clock_type::now() - t0).count() / steps;
  for (int i = 0; i < 64; ++i) a.free(ptrs[i], sizes[i]);
  return ns;
}

// The allocators compared: the pools (each over a timed_platform of its own, so the time
// its driver calls took inside the mixed loop is reported beside the pair's cost: growths,
// remaps, releases) with their defaults, /units and /locked; the arena alone; the driver's
// own allocators. Members are built in declaration order, each pool after its platform.
struct bench_allocators {
  explicit bench_allocators(platform& p) : p(p), raw_runtime(p, 0) {
    bare_arena.add_region(std::uintptr_t{1} << 44, std::size_t{1} << 40, 1, 0);
  }
  bench_allocators(const bench_allocators&) = delete;
  bench_allocators& operator=(const bench_allocators&) = delete;

  static pool_options with_thread_cache_off() {
    pool_options o;
    o.thread_cache = false;
    return o;
  }
  static pool_options with_units() {
    pool_options o;
    o.small_classes = 0;
    return o;
  }
  timed_platform& timed_for_pool() { return *timed.emplace_back(std::make_unique<timed_platform>(p)); }

  platform& p;
  runtime_resource raw_runtime;
  std::vector<std::unique_ptr<timed_platform>> timed;
  timed_platform& t_caching = timed_for_pool();
  timed_platform& t_vmm = timed_for_pool();
  timed_platform& t_caching_units = timed_for_pool();
  timed_platform& t_vmm_units = timed_for_pool();
  timed_platform& t_caching_locked = timed_for_pool();
  timed_platform& t_vmm_locked = timed_for_pool();
  runtime_resource pool_upstream{t_caching, 0};
  caching_pool caching{pool_upstream};
  vmm_page_pool vmm_pool{t_vmm, 0};
  const pool_options locked_options = with_thread_cache_off();
  const pool_options units_options = with_units();
  runtime_resource units_upstream{t_caching_units, 0};
  caching_pool caching_units{units_upstream, units_options};
  vmm_page_pool vmm_units{t_vmm_units, 0, units_options};
  runtime_resource locked_upstream{t_caching_locked, 0};
  caching_pool caching_locked{locked_upstream, locked_options};
  vmm_page_pool vmm_locked{t_vmm_locked, 0, locked_options};
  // The arena alone (see the top): a block's record stands in for its pointer.
  detail::block_arena bare_arena{0, 512, 0};
  std::uint64_t arena_frees = 0;

  std::vector<allocator_fns> list() {
    std::vector<allocator_fns> allocators;
    allocators.push_back({"vmm_page_pool", [&](std::size_t n) { return vmm_pool.allocate(n); },
                          [&](void* q, std::size_t n) { vmm_pool.deallocate(q, n); }, 1, &t_vmm});
    allocators.push_back({"caching_pool", [&](std::size_t n) { return caching.allocate(n); },
                          [&](void* q, std::size_t n) { caching.deallocate(q, n); }, 1, &t_caching});
    allocators.push_back({"vmm_page_pool/units",
                          [&](std::size_t n) { return vmm_units.allocate(n); },
                          [&](void* q, std::size_t n) { vmm_units.deallocate(q, n); }, 1, &t_vmm_units});
    allocators.push_back({"caching_pool/units",
                          [&](std::size_t n) { return caching_units.allocate(n); },
                          [&](void* q, std::size_t n) { caching_units.deallocate(q, n); }, 1,
                          &t_caching_units});
    allocators.push_back({"vmm_page_pool/locked",
                          [&](std::size_t n) { return vmm_locked.allocate(n); },
                          [&](void* q, std::size_t n) { vmm_locked.deallocate(q, n); }, 1, &t_vmm_locked});
    allocators.push_back({"caching_pool/locked",
                          [&](std::size_t n) { return caching_locked.allocate(n); },
                          [&](void* q, std::size_t n) { caching_locked.deallocate(q, n); }, 1,
                          &t_caching_locked});
    allocators.push_back({"block_arena (floor)",
                          [&](std::size_t n) -> void* {
                            detail::block* b = bare_arena.allocate(n, 512, 0, n);
                            if (b == nullptr) throw std::runtime_error("block_arena: full");
                            return b;
                          },
                          [&](void* q, std::size_t) {
                            bare_arena.release(static_cast<detail::block*>(q), 0, ++arena_frees);
                          }});
    allocators.push_back({"cudaMallocAsync",
                          [&](std::size_t n) {
                            auto r = p.async_malloc(0, n, {});
                            if (!r) throw std::runtime_error(r.error().describe());
                            return r.value();
                          },
                          [&](void* q, std::size_t) {
                            if (auto s = p.async_free(q, {}); !s) throw std::runtime_error(s.describe());
                          }});
    allocators.push_back({"cudaMalloc", [&](std::size_t n) { return raw_runtime.allocate(n); },
                          [&](void* q, std::size_t n) { raw_runtime.deallocate(q, n); }, 200});
    return allocators;
  }
};

struct row {
  std::string name;
  double same, mixed;                      // medians over rounds, ns a pair
  double vs_async_same, vs_async_mixed;    // medians of the rounds' ratios
  double mixed_ratio_low, mixed_ratio_high;
  double mixed_driver = -1;                // median ns a pair inside driver calls (pools)
};

// The pair speeds: a row per allocator, and per pool the driver time of its mixed runs by
// call kind with their pairs (all rounds).
struct pair_speeds {
  std::vector<row> rows;
  std::vector<std::array<std::uint64_t, platform_op_count>> mixed_driver_by_op;
  std::vector<std::uint64_t> mixed_pairs;
};

pair_speeds measure_pair_speeds(platform& p, const std::vector<allocator_fns>& allocators,
                                int rounds) {
  // Rounds: every allocator once per round, in turn, so a host whose speed drifts (other
  // tenants, clocks) slows all of them alike; each ratio to cudaMallocAsync is taken within
  // one round, and the figures are medians over rounds.
  const std::size_t async_index = static_cast<std::size_t>(
      std::find_if(allocators.begin(), allocators.end(),
                   [](const allocator_fns& a) { return a.name == "cudaMallocAsync"; }) -
      allocators.begin());
  for (auto& a : allocators) {
    const int steps = 200000 / a.iterations_scale;
    run_same_size(a, steps / 10);  // warm up: pools and cudaMemPool fill
    run_mixed(a, steps / 10, 7);
  }
  std::vector<std::vector<double>> same(allocators.size()), mixed(allocators.size()),
      mixed_driver(allocators.size());
  pair_speeds out;
  out.mixed_driver_by_op.resize(allocators.size());
  out.mixed_pairs.resize(allocators.size());
  auto& mixed_driver_by_op = out.mixed_driver_by_op;
  auto& mixed_pairs = out.mixed_pairs;
  for (int round = 0; round < rounds; ++round)
    for (std::size_t k = 0; k < allocators.size(); ++k) {
      const int steps = 200000 / allocators[k].iterations_scale;
      same[k].push_back(run_same_size(allocators[k], steps));
      const timed_platform* driver = allocators[k].driver;
      const std::uint64_t driver_ns = driver != nullptr ? driver->measured_ns() : 0;
      std::array<std::uint64_t, platform_op_count> by_op{};
      for (std::size_t op = 0; driver != nullptr && op < platform_op_count; ++op)
        by_op[op] = driver->measured_ns(static_cast<platform_op>(op));
      mixed[k].push_back(run_mixed(allocators[k], steps, 42));
      if (driver != nullptr) {
        mixed_driver[k].push_back(static_cast<double>(driver->measured_ns() - driver_ns) / steps);
        for (std::size_t op = 0; op < platform_op_count; ++op)
          mixed_driver_by_op[k][op] += driver->measured_ns(static_cast<platform_op>(op)) - by_op[op];
        mixed_pairs[k] += static_cast<std::uint64_t>(steps);
      }
    }
  (void)p.stream_synchronize({});
  std::vector<row>& rows = out.rows;
  for (std::size_t k = 0; k < allocators.size(); ++k) {
    std::vector<double> same_ratio, mixed_ratio;
    for (int r = 0; r < rounds; ++r) {
      same_ratio.push_back(same[async_index][r] / same[k][r]);
      mixed_ratio.push_back(mixed[async_index][r] / mixed[k][r]);
    }
    rows.push_back({allocators[k].name, median(same[k]), median(mixed[k]), median(same_ratio),
                    median(mixed_ratio), *std::min_element(mixed_ratio.begin(), mixed_ratio.end()),
                    *std::max_element(mixed_ratio.begin(), mixed_ratio.end())});
    if (!mixed_driver[k].empty()) rows.back().mixed_driver = median(mixed_driver[k]);
  }
  return out;
}

// Growth by 512 pages (one 1 GiB request): on fresh pools with the defaults (a huge
// growth: 64 MiB handles) and with huge_growth:0 (one-page handles), where the growth
// creates its handles; and on a pool that reserved 1 GiB of one-page handles up front,
// which maps them when constructed (the request then makes no driver call: its
// construction, timed too, is where that cost went). Each pool runs over a
// timed_platform, so the time inside each driver call is reported by kind.
struct growth {
  const char* what;
  std::size_t huge_growth;
  bool reserved;
  double ns_per_page = 0;
  std::uint64_t creates = 0, maps = 0, accesses = 0;
  double create_ns = 0, map_ns = 0, access_ns = 0;  // per page, driver time
  double construct_ns = 0;                          // per page: the pool's constructor
  std::size_t big_chunk = 0;                        // pool_options::big_chunk_pages
};
std::vector<growth> measure_growths(platform& p) {
  std::vector<growth> growths{{"defaults: 64 MiB handles, created", pool_options{}.huge_growth_bytes, false},
                              {"huge_growth:0: one-page handles, created", 0, false},
                              {"1 GiB of one-page handles reserved (and mapped) up front", 0, true},
                              // Bigger handles than the default's, for comparison: the
                              // access grant costs per handle (docs/RESULTS.md).
                              {.what = "big_chunk:64: 128 MiB handles, created", .huge_growth = 0,
                               .reserved = false, .big_chunk = 64},
                              {.what = "big_chunk:128: 256 MiB handles, created", .huge_growth = 0,
                               .reserved = false, .big_chunk = 128}};
  for (growth& g : growths) {
    std::vector<double> reps, creates, maps, accesses, constructs;
    for (int rep = 0; rep < 5; ++rep) {
      timed_platform timed(p);
      pool_options o;
      o.huge_growth_bytes = g.huge_growth;
      o.big_chunk_pages = g.big_chunk;
      if (g.reserved) o.reserve_bytes = std::size_t{1} << 30;
      const auto c_start = clock_type::now();
      vmm_page_pool fresh(timed, 0, o);
      constructs.push_back(std::chrono::duration<double, std::nano>(clock_type::now() - c_start).count() / 512);
      const std::size_t bytes = 512 * fresh.page_size();
      const auto c0 = timed.calls_made(platform_op::create_physical);
      const auto m0 = timed.calls_made(platform_op::map);
      const auto s0 = timed.calls_made(platform_op::set_access);
      const auto cn = timed.measured_ns(platform_op::create_physical);
      const auto mn = timed.measured_ns(platform_op::map);
      const auto sn = timed.measured_ns(platform_op::set_access);
      const auto t0 = clock_type::now();
      void* q = fresh.allocate(bytes);
      reps.push_back(std::chrono::duration<double, std::nano>(clock_type::now() - t0).count() / 512);
      creates.push_back(static_cast<double>(timed.measured_ns(platform_op::create_physical) - cn) / 512);
      maps.push_back(static_cast<double>(timed.measured_ns(platform_op::map) - mn) / 512);
      accesses.push_back(static_cast<double>(timed.measured_ns(platform_op::set_access) - sn) / 512);
      g.creates = timed.calls_made(platform_op::create_physical) - c0;
      g.maps = timed.calls_made(platform_op::map) - m0;
      g.accesses = timed.calls_made(platform_op::set_access) - s0;
      fresh.deallocate(q, bytes);
    }
    g.ns_per_page = median(reps);
    g.create_ns = median(creates);
    g.map_ns = median(maps);
    g.access_ns = median(accesses);
    g.construct_ns = median(constructs);
  }
  return growths;
}

// Contention: T threads share one vmm_page_pool, each doing same-size pairs; small sizes
// with thread caches and with every call under the pool's mutex, then large sizes.
struct threaded_row {
  const char* what;
  int threads;
  double ns;
};
struct threaded_case {
  const char* what;
  bool cached;
  std::size_t size;
};
std::vector<threaded_row> measure_threads(platform& p) {
  std::vector<threaded_row> threaded;
  for (const threaded_case k : {threaded_case{"256 KiB, thread caches", true, 256 << 10},
                                threaded_case{"256 KiB, thread_cache:off", false, 256 << 10},
                                threaded_case{"4 MiB (large: the pool's lock)", true, 4 << 20}}) {
    pool_options o;
    o.thread_cache = k.cached;
    vmm_page_pool shared(p, 0, o);
    const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned t : {1u, 2u, 4u, 8u}) {
      if (t > hw) break;
      const int steps = 200000;
      std::vector<std::thread> workers;
      const auto t0 = clock_type::now();
      for (unsigned w = 0; w < t; ++w)
        workers.emplace_back([&shared, steps, w, size = k.size] {
          const std::size_t n = size + w * 512;  // a size of its own
          for (int i = 0; i < steps; ++i) shared.deallocate(shared.allocate(n), n);
        });
      for (auto& w : workers) w.join();
      const double total_ns = std::chrono::duration<double, std::nano>(clock_type::now() - t0).count();
      threaded.push_back({k.what, static_cast<int>(t), total_ns / (static_cast<double>(steps) * t)});
    }
  }
  return threaded;
}

void print_tables(int rounds, const std::vector<allocator_fns>& allocators, const pair_speeds& speeds,
                  const std::vector<growth>& growths, const std::vector<threaded_row>& threaded) {
  const std::vector<row>& rows = speeds.rows;
  const auto& mixed_driver_by_op = speeds.mixed_driver_by_op;
  const auto& mixed_pairs = speeds.mixed_pairs;
  std::printf("\n%d rounds, each allocator once a round in turn: medians over rounds; the ratios "
              "to cudaMallocAsync are taken within each round\n", rounds);
  std::printf("(driver: of mixed_64's ns a pair, the time inside the pool's driver calls: growths, remaps, "
              "releases)\n");
  std::printf("%-22s %16s %16s %14s %14s %18s %8s\n", "allocator", "same_size ns/pair", "mixed_64 ns/pair",
              "vs async same", "vs async mixed", "mixed ratio range", "driver");
  for (auto& r : rows) {
    std::printf("%-22s %16.1f %16.1f %13.1fx %13.1fx %8.1fx - %5.1fx", r.name.c_str(), r.same,
                r.mixed, r.vs_async_same, r.vs_async_mixed, r.mixed_ratio_low, r.mixed_ratio_high);
    if (r.mixed_driver >= 0) std::printf(" %8.1f", r.mixed_driver);
    std::printf("\n");
  }
  // Which calls: with the map worker (on for cuda), unmaps run on its thread, beside the
  // allocating one; the others are the allocating thread's.
  for (std::size_t k = 0; k < allocators.size(); ++k) {
    if (mixed_pairs[k] == 0) continue;
    std::string parts;
    for (std::size_t op = 0; op < platform_op_count; ++op) {
      const double ns = static_cast<double>(mixed_driver_by_op[k][op]) / static_cast<double>(mixed_pairs[k]);
      if (ns < 0.05) continue;
      char part[96];
      std::snprintf(part, sizeof part, "%s%s %.1f", parts.empty() ? "" : ", ",
                    std::string(platform_op_name(static_cast<platform_op>(op))).c_str(), ns);
      parts += part;
    }
    if (!parts.empty())
      std::printf("  %s, mixed_64 driver ns a pair by call (mean over rounds): %s\n",
                  allocators[k].name.c_str(), parts.c_str());
  }
  for (const growth& g : growths)
    std::printf("\ngrow_512 (%s): %.0f ns per page, median of 5; driver time per page: create %.0f, "
                "map %.0f, set access %.0f ns (%llu cuMemCreate, %llu cuMemMap, %llu cuMemSetAccess "
                "per growth); the pool's construction %.0f ns per page",
                g.what, g.ns_per_page, g.create_ns, g.map_ns, g.access_ns,
                static_cast<unsigned long long>(g.creates), static_cast<unsigned long long>(g.maps),
                static_cast<unsigned long long>(g.accesses), g.construct_ns);
  std::printf("\n");
  for (const threaded_row& r : threaded)
    std::printf("%d thread(s) sharing one pool, %s: %.1f ns of wall time per alloc+free pair, "
                "all threads together\n", r.threads, r.what, r.ns);
}

void write_json(const std::string& json_path, platform& p, const std::string& device_name,
                int rounds, const std::vector<row>& rows, const std::vector<growth>& growths) {
  std::FILE* f = std::fopen(json_path.c_str(), "w");
  if (f != nullptr) {
    std::fprintf(f, "{\"platform\": \"%s\", \"device\": \"%s\", \"rounds\": %d, \"rows\": [",
                 std::string(p.kind()).c_str(), device_name.c_str(), rounds);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f, "%s{\"allocator\": \"%s\", \"same_size_ns_per_pair\": %.2f, \"mixed_64_ns_per_pair\": %.2f, "
                   "\"vs_async_same\": %.2f, \"vs_async_mixed\": %.2f",
                   i ? ", " : "", rows[i].name.c_str(), rows[i].same, rows[i].mixed,
                   rows[i].vs_async_same, rows[i].vs_async_mixed);
      if (rows[i].mixed_driver >= 0)
        std::fprintf(f, ", \"mixed_64_driver_ns_per_pair\": %.2f", rows[i].mixed_driver);
      std::fprintf(f, "}");
    }
    std::fprintf(f, "], \"grow_512_ns_per_page\": %.1f, \"grow_512_one_page_handles_ns_per_page\": %.1f, "
                 "\"grow_512_reserved_ns_per_page\": %.1f}\n",
                 growths[0].ns_per_page, growths[1].ns_per_page, growths[2].ns_per_page);
    std::fclose(f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "auto", json_path;
  int rounds = 5;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) device = argv[++i];
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json_path = argv[++i];
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc && std::atoi(argv[i + 1]) > 0)
      rounds = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "usage: pool_bench [--device auto|cuda|sim] [--rounds N] [--json FILE]\n");
      return 2;
    }
  }
  platform& p = platform_by_name(device);
  const bool sim = p.kind() == "sim";
  auto props = p.properties(0);
  const std::string device_name = props ? props.value().name : "?";
  std::printf("pool_bench on %s (%s)%s\n", device_name.c_str(), std::string(p.kind()).c_str(),
              sim ? " -- sim: host-only figures, not GPU measurements" : "");

  bench_allocators pools(p);
  const std::vector<allocator_fns> allocators = pools.list();
  const pair_speeds speeds = measure_pair_speeds(p, allocators, rounds);
  const std::vector<growth> growths = measure_growths(p);
  const std::vector<threaded_row> threaded = measure_threads(p);
  print_tables(rounds, allocators, speeds, growths, threaded);
  if (!json_path.empty()) write_json(json_path, p, device_name, rounds, speeds.rows, growths);
  return 0;
}
