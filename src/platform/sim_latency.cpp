// Modelled H200 call latencies for sim (sim_latency::model / spin).
// Source: median host time per call on an NVIDIA H200, driver
// 580.159, CUDA 13.0, measured 2026-11-30; per-handle costs of set access and unmap from
// gpumem's own H200 runs the same day (modelled_per_mapping_ns). Between measured sizes the latency is
// interpolated linearly in log2(size); outside them it is clamped to the nearest point.
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "gpumem/platform/sim_platform.hpp"

namespace gpumem {

namespace {

struct point {
  double bytes;
  double ns;
};

constexpr double KiB = 1024.0, MiB = 1024.0 * KiB, GiB = 1024.0 * MiB;

constexpr std::array cuda_malloc{point{512, 45400}, point{64 * KiB, 45300}, point{2 * MiB, 43600},
                                 point{32 * MiB, 49700}, point{256 * MiB, 57800},
                                 point{GiB, 195000}};
constexpr std::array cuda_free{point{512, 37100}, point{64 * KiB, 37000}, point{2 * MiB, 36000},
                               point{32 * MiB, 63600}, point{256 * MiB, 165000},
                               point{GiB, 570000}};
constexpr std::array cu_mem_alloc{point{512, 45100}, point{64 * KiB, 44600}, point{2 * MiB, 42600},
                                  point{32 * MiB, 50000}, point{256 * MiB, 57600},
                                  point{GiB, 115000}};
constexpr std::array cu_mem_free{point{512, 37100}, point{64 * KiB, 37200}, point{2 * MiB, 35800},
                                 point{32 * MiB, 62600}, point{256 * MiB, 164000},
                                 point{GiB, 560000}};
constexpr std::array cu_mem_create{point{2 * MiB, 11500}, point{32 * MiB, 12900},
                                   point{256 * MiB, 19000}, point{GiB, 107000}};
constexpr std::array cu_address_reserve{point{2 * MiB, 640}, point{32 * MiB, 3200},
                                        point{256 * MiB, 3700}, point{GiB, 4400}};
constexpr std::array cu_mem_map{point{2 * MiB, 860}, point{32 * MiB, 970}, point{256 * MiB, 1200},
                                point{GiB, 1600}};
// One call over 512 mapped pages (1 GiB) cost 138-166 us: use 152 us there.
constexpr std::array cu_set_access{point{2 * MiB, 25700}, point{32 * MiB, 53700},
                                   point{256 * MiB, 59500}, point{GiB, 152000}};
constexpr std::array cu_unmap{point{2 * MiB, 17100}, point{32 * MiB, 26000},
                              point{256 * MiB, 27300}, point{GiB, 37500}};
constexpr std::array cu_release{point{2 * MiB, 12500}, point{32 * MiB, 37900},
                                point{256 * MiB, 140000}, point{GiB, 531000}};
constexpr std::array cu_address_free{point{2 * MiB, 620}, point{32 * MiB, 3400},
                                     point{256 * MiB, 4000}, point{GiB, 5300}};
constexpr std::array host_alloc{point{2 * MiB, 857000}, point{64 * MiB, 21900000}};
constexpr std::array host_free{point{2 * MiB, 350000}, point{64 * MiB, 5500000}};

double interpolate(std::span<const point> table, std::size_t bytes) {
  const double b = bytes == 0 ? table.front().bytes : static_cast<double>(bytes);
  if (b <= table.front().bytes) return table.front().ns;
  if (b >= table.back().bytes) return table.back().ns;
  for (std::size_t i = 1; i < table.size(); ++i) {
    if (b <= table[i].bytes) {
      const double t = (std::log2(b) - std::log2(table[i - 1].bytes)) /
                       (std::log2(table[i].bytes) - std::log2(table[i - 1].bytes));
      return table[i - 1].ns + t * (table[i].ns - table[i - 1].ns);
    }
  }
  return table.back().ns;
}

}  // namespace

std::uint64_t modelled_latency_ns(platform_op op, std::size_t bytes) noexcept {
  double ns = 0;
  switch (op) {
    case platform_op::runtime_malloc: ns = interpolate(cuda_malloc, bytes); break;
    case platform_op::runtime_free: ns = interpolate(cuda_free, bytes); break;
    case platform_op::driver_alloc: ns = interpolate(cu_mem_alloc, bytes); break;
    case platform_op::driver_free: ns = interpolate(cu_mem_free, bytes); break;
    case platform_op::create_physical: ns = interpolate(cu_mem_create, bytes); break;
    case platform_op::release_physical: ns = interpolate(cu_release, bytes); break;
    case platform_op::reserve_range: ns = interpolate(cu_address_reserve, bytes); break;
    case platform_op::free_range: ns = interpolate(cu_address_free, bytes); break;
    case platform_op::map: ns = interpolate(cu_mem_map, bytes); break;
    case platform_op::unmap: ns = interpolate(cu_unmap, bytes); break;
    case platform_op::set_access: ns = interpolate(cu_set_access, bytes); break;
    case platform_op::host_alloc: ns = interpolate(host_alloc, bytes); break;
    case platform_op::host_free: ns = interpolate(host_free, bytes); break;
    // Warm cudaMemPool: 0.58 us / 0.70 us whatever the size (measured on the H200).
    case platform_op::async_malloc: ns = 580; break;
    case platform_op::async_free: ns = 700; break;
    // Stream-ordered and bookkeeping calls: sub-microsecond launches, not measured
    // separately; charged a nominal 1 us (copies: plus the bytes read and written at 4.3 TB/s).
    case platform_op::memcpy_async:
    case platform_op::memset_async:
      ns = 1000.0 + 2.0 * static_cast<double>(bytes) / 4.3e12 * 1e9;  // read + write
      break;
    default: ns = 0; break;
  }
  return static_cast<std::uint64_t>(ns);
}

std::uint64_t modelled_per_mapping_ns(platform_op op) noexcept {
  // Measured through timed_platform on an NVIDIA H200 (CUDA 13.0), 2026-11-30, dividing the
  // time in the call by the handles it covered: cuMemSetAccess 32-39 us per handle
  // (embedding example: 659 calls over ~676 handles each, 14.3 s; train_llama replay: 944
  // calls over ~12.5 handles each, 464 ms); cuMemUnmap 21-28 us per handle.
  switch (op) {
    case platform_op::set_access: return 32000;
    case platform_op::unmap: return 21000;
    default: return 0;
  }
}

}  // namespace gpumem
