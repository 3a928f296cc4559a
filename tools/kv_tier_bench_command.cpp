// gpumem kv-tier-bench: throughput of the KV tiers below the GPU.
//
//  - store mode (always): batched put and get of --blocks records of --block-bytes through
//    the store (pipelined, checksummed, verified), next to redis-benchmark's SET/GET of
//    values of the same size with the same pipeline depth on one connection, in the same
//    run (when the store is Redis and redis-benchmark is installed; else it says why);
//  - device mode (--sequence BYTES): a sequence of that many KV bytes in a kv_cache on the
//    device (--device cuda on a GPU), evicted through the write-back path (device -> pinned
//    host -> store) and brought back by a prompt lookup (store -> host -> device), against
//    a plain device-to-host copy of the same bytes.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/kv.hpp"
#include "gpumem/kv/tier/host_store.hpp"
#include "gpumem/kv/tier/kv_record.hpp"
#include "gpumem/kv/tier/kv_tiers.hpp"
#include "gpumem/kv/tier/redis_store.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool/pinned_host_pool.hpp"
#include "gpumem/pool/vmm/vmm_page_pool.hpp"
#include "json_writer.hpp"

namespace gpumem::cli {

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}
double gbps(double bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }

struct figures {
  std::vector<std::pair<std::string, double>> rows;  // name, GB/s
  std::vector<std::string> notes;
};

// redis-benchmark's "SET: 56.51 requests per second" lines -> requests per second.
double benchmark_rps(const std::string& out, const std::string& test) {
  const std::string tag = test + ": ";
  double rps = 0;
  for (std::size_t pos = 0; (pos = out.find(tag, pos)) != std::string::npos; pos += tag.size()) {
    const std::size_t end = out.find(" requests per second", pos);
    if (end == std::string::npos) continue;
    const std::size_t nl = out.find_first_of("\r\n", pos);
    if (nl != std::string::npos && nl < end) continue;  // a progress line
    rps = std::atof(out.substr(pos + tag.size(), end - pos - tag.size()).c_str());
  }
  return rps;
}

extern "C" char** environ;

// Runs a program found on PATH with these arguments (no shell: nothing in them is
// interpreted) and returns its standard output and error; "" when it cannot start.
std::string run_capture(const std::vector<std::string>& argv) {
  int fds[2];
  if (::pipe(fds) != 0) return {};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 1);
  posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
  posix_spawn_file_actions_addclose(&fa, fds[0]);
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  ::close(fds[1]);
  std::string out;
  if (rc == 0) {
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
    int status = 0;
    ::waitpid(pid, &status, 0);
  }
  ::close(fds[0]);
  return out;
}

void redis_benchmark(const std::string& url, std::size_t value_bytes, std::size_t n,
                     std::size_t pipeline, figures& out) {
  const bool cluster = url.rfind("redis-cluster://", 0) == 0;
  if (!cluster && url.rfind("redis://", 0) != 0) return;
  // [[USER]:PASSWORD@]HOST:PORT[,...][/DB][?OPTIONS]: the first host. redis-benchmark takes a
  // password only on its command line, which other users of the machine can read: a
  // server that needs one gets no comparison.
  std::string rest = url.substr(url.find("://") + 3);
  std::string hostport = rest.substr(0, rest.find_first_of("/?"));
  std::string password;
  if (const auto at = hostport.rfind('@'); at != std::string::npos) {
    const std::string info = hostport.substr(0, at);
    const auto colon = info.find(':');
    password = colon == std::string::npos ? info : info.substr(colon + 1);
    hostport = hostport.substr(at + 1);
  }
  if (!password.empty()) {
    out.notes.push_back("redis-benchmark takes a password only on its command line: no comparison");
    return;
  }
  hostport = hostport.substr(0, hostport.find(','));
  const auto colon = hostport.rfind(':');
  const std::string host = hostport.substr(0, colon), port = hostport.substr(colon + 1);
  std::vector<std::string> cmd{"redis-benchmark", "-h", host, "-p", port};
  if (cluster) cmd.push_back("--cluster");
  cmd.insert(cmd.end(), {"-t", "set,get", "-d", std::to_string(value_bytes), "-n",
                         std::to_string(n), "-P", std::to_string(pipeline), "-c", "1", "-q"});
  const std::string res = run_capture(cmd);
  if (res.empty()) {
    out.notes.push_back("redis-benchmark is not installed: no comparison");
    return;
  }
  const double set = benchmark_rps(res, "SET"), get = benchmark_rps(res, "GET");
  if (set == 0 || get == 0) {
    out.notes.push_back("redis-benchmark gave no figures: " + res.substr(0, 200));
    return;
  }
  out.rows.emplace_back("redis-benchmark SET", gbps(set * static_cast<double>(value_bytes), 1));
  out.rows.emplace_back("redis-benchmark GET", gbps(get * static_cast<double>(value_bytes), 1));
  std::string shown;
  for (const auto& a : cmd) shown += (shown.empty() ? "" : " ") + a;
  out.notes.push_back("redis-benchmark: " + shown);
}

std::vector<std::unique_ptr<kv_store>> make_stores(platform& p, const parsed_args& args) {
  std::vector<std::unique_ptr<kv_store>> stores;
  const std::size_t host = *args.bytes("host-tier", 0);
  if (host != 0) stores.push_back(std::make_unique<host_store>(p, 0, host));
  const std::string url = args.value_or("kv-store", "");
  if (!url.empty()) stores.push_back(make_redis_store(url));
  if (stores.empty()) throw usage_error("give --kv-store URL and/or --host-tier BYTES");
  return stores;
}

void store_mode(platform& p, const parsed_args& args, figures& out) {
  const std::size_t block = *args.bytes("block-bytes", 4096);
  const auto blocks = static_cast<std::size_t>(*args.integer("blocks", 1, 1 << 20));
  const auto batch = static_cast<std::size_t>(*args.integer("batch", 1, 4096));
  auto stores = make_stores(p, args);
  kv_store& store = *stores.back();  // the last (outermost) tier: Redis when given
  const std::uint64_t space = static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count());
  std::mt19937_64 rng(1);
  std::vector<kv_block_key> keys(blocks);
  std::vector<std::vector<std::byte>> recs(blocks);
  std::vector<token_id> toks(16);
  std::iota(toks.begin(), toks.end(), 1);
  for (std::size_t i = 0; i < blocks; ++i) {
    keys[i] = {space, 0, i + 1};
    recs[i].resize(kv_record::size(toks.size(), block));
    kv_record::write_head(recs[i], keys[i], 0, toks);
    auto* w = reinterpret_cast<std::uint64_t*>(recs[i].data() + kv_record::payload_offset(16));
    for (std::size_t k = 0; k < block / 8; ++k) w[k] = rng();
    kv_record::seal(recs[i]);
  }
  std::size_t stored = 0, hit = 0;
  auto t0 = clock_type::now();
  for (std::size_t i = 0; i < blocks; i += batch) {
    const std::size_t n = std::min(batch, blocks - i);
    std::vector<std::span<const std::byte>> v(recs.begin() + static_cast<std::ptrdiff_t>(i),
                                              recs.begin() + static_cast<std::ptrdiff_t>(i + n));
    std::unique_ptr<bool[]> ok(new bool[n]);
    store.put({keys.data() + i, n}, v, {ok.get(), n});
    for (std::size_t k = 0; k < n; ++k) stored += ok[k];
  }
  const double put_s = seconds_since(t0);
  std::vector<std::vector<std::byte>> dst(batch, std::vector<std::byte>(recs[0].size()));
  t0 = clock_type::now();
  for (std::size_t i = 0; i < blocks; i += batch) {
    const std::size_t n = std::min(batch, blocks - i);
    std::vector<std::span<std::byte>> d(dst.begin(), dst.begin() + static_cast<std::ptrdiff_t>(n));
    std::vector<kv_get_status> st(n);
    store.get({keys.data() + i, n}, d, st);
    for (auto s : st) hit += s == kv_get_status::hit;
  }
  const double get_s = seconds_since(t0);
  const double bytes = static_cast<double>(blocks * recs[0].size());
  out.rows.emplace_back("gpumem " + store.name() + " put", gbps(bytes, put_s));
  out.rows.emplace_back("gpumem " + store.name() + " get", gbps(bytes, get_s));
  out.notes.push_back(std::to_string(blocks) + " records of " + format_bytes(recs[0].size()) +
                      " in batches of " + std::to_string(batch) + ": " + std::to_string(stored) +
                      " stored, " + std::to_string(hit) + " read back verified");
  if (!args.has("no-redis-benchmark"))
    redis_benchmark(args.value_or("kv-store", ""), block, blocks, batch, out);
}

void device_mode(platform& p, const parsed_args& args, figures& out) {
  const std::size_t sequence = *args.bytes("sequence", 1);
  kv_layout l{32, 8, 128, kv_dtype::bf16, 16};  // Llama-3-8B: 2 MiB blocks
  const std::size_t bs = l.block_stride();
  const std::size_t blocks = std::max<std::size_t>(1, sequence / bs);
  kv_tiers_options to;
  to.max_pending_bytes = blocks * (bs + 4096) + (std::size_t{64} << 20);
  to.reserve_staging_bytes = to.max_pending_bytes;
  to.space = static_cast<std::uint64_t>(clock_type::now().time_since_epoch().count());
  kv_tiers tiers(p, 0, make_stores(p, args), to);
  vmm_page_pool pages(p, 0);
  kv_cache_config k;
  k.layout = l;
  k.max_blocks = blocks + 8;
  k.tiers = &tiers;
  kv_cache kv(pages, k);
  std::vector<token_id> prompt(blocks * l.block_tokens + 1);
  std::iota(prompt.begin(), prompt.end(), 7);
  auto s = kv.add_sequence(prompt);
  const double bytes = static_cast<double>(blocks * bs);
  // A plain device-to-host copy of the same bytes into pinned memory, best of two.
  {
    pinned_host_pool host(p, 0);
    void* h = host.allocate(blocks * bs);
    double best = 1e30;
    for (int rep = 0; rep < 2; ++rep) {
      const auto t0 = clock_type::now();
      if (auto st = p.memcpy_async(h, kv.block_address(kv.block_table(s.id)[0]), blocks * bs, {}); !st)
        throw std::runtime_error("copy: " + st.describe());
      (void)p.stream_synchronize({});
      best = std::min(best, seconds_since(t0));
    }
    host.deallocate(h, blocks * bs);
    out.rows.emplace_back("plain copy device->host", gbps(bytes, best));
  }
  kv.free(s.id);
  auto t0 = clock_type::now();
  kv.evict(blocks);
  tiers.flush();
  const double wb = seconds_since(t0);
  const auto ts = tiers.stats();
  out.rows.emplace_back("write-back device->host->" + tiers.store(tiers.size() - 1).name(), gbps(bytes, wb));
  double read_cold = 0, read_warm = 0;
  std::size_t cached = 0;
  for (int rep = 0; rep < 2; ++rep) {
    t0 = clock_type::now();
    auto b = kv.add_sequence(prompt);
    (void)p.stream_synchronize({});
    (rep == 0 ? read_cold : read_warm) = seconds_since(t0);
    cached = b.cached_tokens;
    kv.free(b.id);
    kv.evict(blocks);  // the tier holds them already: nothing is sent again
    tiers.flush();
  }
  out.rows.emplace_back("read-back store->host->device (cold staging)", gbps(bytes, read_cold));
  out.rows.emplace_back("read-back store->host->device", gbps(bytes, read_warm));
  out.notes.push_back("sequence: " + std::to_string(blocks) + " blocks of " + format_bytes(bs) + " (" +
                      format_bytes(blocks * bs) + "); written " +
                      std::to_string(ts.writebacks_written) + ", dropped " +
                      std::to_string(ts.writebacks_dropped) + "; read back " +
                      std::to_string(cached / l.block_tokens) + " blocks");
  if (!args.has("no-redis-benchmark"))
    redis_benchmark(args.value_or("kv-store", ""), bs, blocks, 16, out);
}

}  // namespace

int run_kv_tier_bench(int argc, char** argv) {
  arg_parser parser("gpumem kv-tier-bench",
                    "throughput of the KV tiers below the GPU (host memory, Redis)");
  parser.option("kv-store", "URL", "redis://HOST:PORT or redis-cluster://HOST:PORT,...", "")
      .option("host-tier", "BYTES", "a pinned host memory tier (0: none)", "0")
      .option("block-bytes", "BYTES", "store mode: payload of one record", "2M")
      .option("blocks", "N", "store mode: records put, then got", "128")
      .option("batch", "N", "store mode: records per batch (and redis-benchmark -P)", "16")
      .option("sequence", "BYTES", "device mode: KV bytes of one sequence written back and read (0: off)", "0")
      .option("device", "KIND", "sim, cuda, or auto", "sim", {"auto", "sim", "cuda"})
      .flag("no-redis-benchmark", "skip the redis-benchmark comparison")
      .flag("json", "machine-readable output")
      .epilog("Examples:\n  gpumem kv-tier-bench --kv-store redis://127.0.0.1:6379\n"
              "  gpumem kv-tier-bench --device cuda --sequence 1G --kv-store redis://127.0.0.1:6379\n");
  const parsed_args args = parser.parse(argc, argv);
  if (args.help_requested()) {
    std::cout << parser.help();
    return 0;
  }
  const std::string kind = args.value_or("device", "sim");
  std::unique_ptr<platform> cuda;
  std::unique_ptr<sim_platform> sim;
  if (kind != "sim") {
    std::string why;
    cuda = make_cuda_platform(&why);
    if (cuda == nullptr && kind == "cuda")
      throw cuda_error("cudaGetDeviceCount", 100, "CUDA_ERROR_NO_DEVICE", why, "gpumem kv-tier-bench");
  }
  const std::size_t sequence = *args.bytes("sequence", 0);
  if (cuda == nullptr) {
    sim_options so;
    so.capacity = 2 * sequence + (std::size_t{2} << 30);
    sim = std::make_unique<sim_platform>(so);
  }
  platform& p = cuda ? *cuda : *sim;
  figures f;
  if (sequence != 0) device_mode(p, args, f);
  else store_mode(p, args, f);
  if (args.has("json")) {
    json_writer w(std::cout);
    w.begin_object().member("device", cuda ? "cuda" : "sim");
    w.key("gb_per_s").begin_object();
    for (auto& [name, v] : f.rows) w.member(name, v);
    w.end_object();
    w.key("notes").begin_array();
    for (auto& n : f.notes) w.value(n);
    w.end_array().end_object();
    std::cout << "\n";
    return 0;
  }
  std::printf("kv-tier-bench on the %s device\n", cuda ? "cuda" : "sim");
  for (auto& [name, v] : f.rows) std::printf("  %-52s %8.3f GB/s\n", name.c_str(), v);
  for (auto& n : f.notes) std::printf("  %s\n", n.c_str());
  return 0;
}

}  // namespace gpumem::cli
