// kv_bench: the KV cache layer's speed, measured side by side in one process on one device
// (cuda when present, else sim, whose copy figures are host memcpy and say nothing about a
// GPU).
//
//   block_pair      kv_block_storage allocate + free of one block, capacity mapped (ns)
//   append_token    kv_cache::append of one token to each of 64 sequences, blocks filling (ns)
//   prefix_hash     prefix_block_hash over 16-token blocks (ns per token)
//   pinned_2mib     pinned_host_pool cached 2 MiB allocate + free vs cudaMallocHost +
//                   cudaFreeHost of 2 MiB (us)
//   swap            swap_out + swap_in of one 512-block sequence (1 GiB at 2 MiB blocks)
//                   against plain device->host and host->device copies of the same bytes
//                   between the same kinds of memory; every block's bytes checked after the
//                   round trip (a memset pattern per block, read back)
//
// Usage: kv_bench [--device auto|cuda|sim]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpumem/kv.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"

using namespace gpumem;
using clock_type = std::chrono::steady_clock;

namespace {

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void check(const status& s, const char* what) {
  if (!s) {
    std::fprintf(stderr, "kv_bench: %s: %s\n", what, s.describe().c_str());
    std::exit(1);
  }
}

// kv_block_storage allocate + free of one block, capacity mapped, half full.
bool bench_block_pair(vmm_page_pool& pages) {
  kv_block_storage st(pages, 16 * 1024, 1 << 16);
  if (!st.grow_to(4096)) return false;
  std::vector<kv_block_storage::block_id> held;
  for (int i = 0; i < 2048; ++i) held.push_back(*st.try_allocate());  // half full
  std::vector<double> reps;
  constexpr int n = 2'000'000;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = clock_type::now();
    for (int i = 0; i < n; ++i) st.free(*st.try_allocate());
    reps.push_back(seconds_since(t0) * 1e9 / n);
  }
  std::printf("%-14s %10.1f ns per allocate+free (target <= 30)\n", "block_pair", median(reps));
  for (auto b : held) st.free(b);
  return true;
}

// kv_cache::append of one token to each of 64 sequences, blocks filling.
void bench_append(vmm_page_pool& pages, stream_handle stream) {
  kv_cache_config c;
  c.layout = {32, 8, 128, kv_dtype::bf16, 16};
  c.max_blocks = 4096;
  c.initial_blocks = 4096;
  c.stream = stream;
  kv_cache kv(pages, c);
  std::vector<kv_cache::sequence_id> seqs;
  std::vector<token_id> prompt(100, 7);
  for (int i = 0; i < 64; ++i) seqs.push_back(kv.add_sequence(prompt).id);
  const token_id one[1] = {1};
  constexpr int steps = 512;
  const auto t0 = clock_type::now();
  for (int s = 0; s < steps; ++s)
    for (auto id : seqs) kv.append(id, one);
  std::printf("%-14s %10.1f ns per token appended (64 sequences, blocks filling)\n",
              "append_token", seconds_since(t0) * 1e9 / (steps * 64.0));
  for (auto id : seqs) kv.free(id);
}

void bench_prefix_hash() {
  std::vector<token_id> toks(16 * 4096);
  std::mt19937 rng(1);
  for (auto& t : toks) t = static_cast<token_id>(rng() % 128000);
  std::vector<double> reps;
  std::uint64_t sink = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = clock_type::now();
    std::uint64_t h = 0;
    for (int round = 0; round < 20; ++round)
      for (std::size_t b = 0; b < toks.size(); b += 16)
        h = prefix_block_hash(h, 0, std::span(toks).subspan(b, 16));
    sink ^= h;
    reps.push_back(seconds_since(t0) * 1e9 / (20.0 * static_cast<double>(toks.size())));
  }
  std::printf("%-14s %10.2f ns per token (target <= 20; checksum %llx)\n", "prefix_hash",
              median(reps), static_cast<unsigned long long>(sink & 0xfff));
}

// pinned_host_pool's cached 2 MiB pair against cudaMallocHost + cudaFreeHost.
bool bench_pinned(platform& p) {
  constexpr std::size_t two_mib = std::size_t{2} << 20;
  pinned_host_pool host(p, 0);
  host.deallocate(host.allocate(two_mib), two_mib);  // warm
  std::vector<double> reps;
  for (int rep = 0; rep < 5; ++rep) {
    constexpr int n = 200000;
    const auto t0 = clock_type::now();
    for (int i = 0; i < n; ++i) host.deallocate(host.allocate(two_mib), two_mib);
    reps.push_back(seconds_since(t0) * 1e6 / n);
  }
  const double pooled = median(reps);
  reps.clear();
  for (int rep = 0; rep < 20; ++rep) {
    const auto t0 = clock_type::now();
    auto h = p.host_alloc_pinned(two_mib);
    if (!h) return false;
    check(p.host_free_pinned(h.value()), "cudaFreeHost");
    reps.push_back(seconds_since(t0) * 1e6);
  }
  const double raw = median(reps);
  std::printf("%-14s %10.3f us cached pair vs cudaMallocHost+cudaFreeHost %.1f us: %.0fx "
              "(target <= 1 us)\n", "pinned_2mib", pooled, raw, raw / pooled);
  return true;
}

// The fastest of three plain device->host and host->device copies of `bytes` at `device`
// through a pinned block of `host` (seconds).
std::pair<double, double> plain_copy_seconds(platform& p, pinned_host_pool& host, void* device,
                                             std::size_t bytes, stream_handle stream) {
  void* staging = host.allocate(bytes, stream);
  double d2h = 1e30, h2d = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = clock_type::now();
    check(p.memcpy_async(staging, device, bytes,
                         stream), "d2h");
    check(p.stream_synchronize(stream), "sync");
    d2h = std::min(d2h, seconds_since(t0));
    t0 = clock_type::now();
    check(p.memcpy_async(device, staging, bytes,
                         stream), "h2d");
    check(p.stream_synchronize(stream), "sync");
    h2d = std::min(h2d, seconds_since(t0));
  }
  host.deallocate(staging, bytes, stream);
  return {d2h, h2d};
}

// swap_out + swap_in of one 512-block sequence against plain copies of the same bytes;
// false when a block's bytes did not survive the round trip.
bool bench_swap(platform& p, vmm_page_pool& pages, stream_handle stream) {
  kv_cache_config c;
  c.layout = {32, 8, 128, kv_dtype::bf16, 16};  // 2 MiB blocks
  c.max_blocks = 1024;
  c.initial_blocks = 1024;
  c.stream = stream;
  c.prefix_caching = false;
  pinned_host_pool host(p, 0);
  kv_cache kv(pages, c, &host);
  constexpr std::size_t blocks = 512;
  const std::size_t bs = c.layout.block_stride();
  const std::size_t bytes = blocks * bs;
  std::vector<token_id> prompt(blocks * 16, 3);
  auto seq = kv.add_sequence(prompt).id;
  auto fill = [&](const std::vector<kv_cache::block_id>& table) {
    for (std::size_t i = 0; i < table.size(); ++i)
      check(p.memset_async(kv.block_address(table[i]), static_cast<int>(i % 251), bs,
                           stream), "memset");
  };
  fill(kv.block_table(seq));
  check(p.stream_synchronize(stream), "sync");
  // Plain copies of the same bytes between the same kinds of memory, for reference.
  const auto [d2h, h2d] = plain_copy_seconds(p, host, kv.block_address(kv.block_table(seq)[0]),
                                             bytes, stream);
  fill(kv.block_table(seq));  // the reference copies overwrote nothing, but be exact
  check(p.stream_synchronize(stream), "sync");
  // Another sequence takes the freed blocks between swap out and in and overwrites them.
  double out_s = 1e30, in_s = 1e30;
  std::size_t bad_blocks = 0;
  for (int rep = 0; rep < 3; ++rep) {
    auto t0 = clock_type::now();
    kv.swap_out(seq);
    check(p.stream_synchronize(stream), "sync");
    out_s = std::min(out_s, seconds_since(t0));
    auto other = kv.add_sequence(prompt).id;
    for (auto b : kv.block_table(other))
      check(p.memset_async(kv.block_address(b), 0xEE, bs, stream), "memset");
    kv.free(other);
    check(p.stream_synchronize(stream), "sync");
    t0 = clock_type::now();
    kv.swap_in(seq);
    check(p.stream_synchronize(stream), "sync");
    in_s = std::min(in_s, seconds_since(t0));
    // Read every block back and check its pattern.
    auto table = kv.block_table(seq);
    std::vector<unsigned char> buf(bs);
    for (std::size_t i = 0; i < table.size(); ++i) {
      void* h = host.allocate(bs, stream);
      check(p.memcpy_async(h, kv.block_address(table[i]), bs, stream), "readback");
      check(p.stream_synchronize(stream), "sync");
      std::memcpy(buf.data(), h, bs);
      host.deallocate(h, bs, stream);
      const auto want = static_cast<unsigned char>(i % 251);
      if (std::any_of(buf.begin(), buf.end(), [&](unsigned char x) { return x != want; }))
        ++bad_blocks;
    }
  }
  const double gbps = 1e-9 * static_cast<double>(bytes);
  std::printf("%-14s out %.1f GB/s (plain D2H %.1f: %.0f%%), in %.1f GB/s (plain H2D %.1f: "
              "%.0f%%), %zu MiB, bytes checked: %zu of %zu blocks wrong (target >= 80%%)\n",
              "swap", gbps / out_s, gbps / d2h, 100 * d2h / out_s, gbps / in_s, gbps / h2d,
              100 * h2d / in_s, bytes >> 20, bad_blocks, 3 * blocks);
  kv.free(seq);
  return bad_blocks == 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "auto";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--device") && i + 1 < argc) {
      device = argv[++i];
    } else {
      std::fprintf(stderr, "usage: kv_bench [--device auto|cuda|sim]\n");
      return 2;
    }
  }
  platform& p = platform_by_name(device);
  auto props = p.properties(0);
  std::printf("kv_bench on %s (%s)\n", std::string(p.kind()).c_str(),
              props ? props.value().name.c_str() : "?");
  vmm_page_pool pages(p, 0);
  auto stream = p.stream_create(0);
  check(stream.ok() ? status::success() : stream.error(), "stream");
  if (!bench_block_pair(pages)) return 1;
  bench_append(pages, stream.value());
  bench_prefix_hash();
  if (!bench_pinned(p)) return 1;
  if (!bench_swap(p, pages, stream.value())) return 1;
  check(p.stream_destroy(stream.value()), "stream destroy");
  return 0;
}
