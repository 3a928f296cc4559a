// gpumem info: what each device is and what gpumem can use of it — properties, free
// memory, VMM granularity, which devices reach each other's memory (the peer-access
// matrix, with several) — and, with --bandwidth, a measured device-to-device copy
// bandwidth. On the sim platform it says plainly that no GPU was found, why, and that
// every figure describes the simulated device.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/platform/platform.hpp"
#include "json_writer.hpp"

namespace gpumem::cli {

namespace {

// --- platform failures as exceptions ---------------------------------------------------------

[[noreturn]] void throw_failure(const status& failed, const std::string& where) {
  throw cuda_error(std::string(platform_op_name(failed.call)), failed.code,
                   failed.name.empty() ? "error " + std::to_string(failed.code) : failed.name,
                   failed.message, where);
}

template <class T>
T checked(result<T> r, const std::string& where) {
  if (!r) throw_failure(r.error(), where);
  return std::move(r.value());
}

void checked(const status& s, const std::string& where) {
  if (!s) throw_failure(s, where);
}

// --- measuring copy bandwidth ----------------------------------------------------------------

constexpr int bandwidth_warmup_copies = 3;
constexpr int bandwidth_copies_per_repetition = 20;
constexpr int bandwidth_repetitions = 5;

struct bandwidth_measurement {
  double gb_per_s = 0;            // median over the repetitions
  std::size_t buffer_bytes = 0;
  bool host_copy = false;         // sim: host memcpy, not a GPU figure
};

// Two device buffers and a stream; the destructor frees whatever is still held (error
// paths), while release() frees and reports failures (success path).
class copy_buffers {
 public:
  copy_buffers(platform& p, int device) : platform_(p), device_(device) {}
  // Not in the constructor: a throw there would skip the destructor and leak what the
  // earlier steps allocated.
  void acquire(std::size_t bytes, const std::string& where) {
    src_ = checked(platform_.runtime_malloc(device_, bytes),
                   where + ": source buffer of " + format_bytes(bytes));
    dst_ = checked(platform_.runtime_malloc(device_, bytes),
                   where + ": destination buffer of " + format_bytes(bytes));
    stream_ = checked(platform_.stream_create(device_), where + ": stream");
    has_stream_ = true;
  }
  ~copy_buffers() {
    if (has_stream_) (void)platform_.stream_destroy(stream_);
    if (dst_ != nullptr) (void)platform_.runtime_free(device_, dst_);
    if (src_ != nullptr) (void)platform_.runtime_free(device_, src_);
  }
  copy_buffers(const copy_buffers&) = delete;
  copy_buffers& operator=(const copy_buffers&) = delete;

  // Frees everything; throws for the first failure after attempting every release.
  void release(const std::string& where) {
    std::optional<status> first_failure;
    auto note = [&](status s) {
      if (!s && !first_failure) first_failure = std::move(s);
    };
    if (has_stream_) note(platform_.stream_destroy(stream_));
    has_stream_ = false;
    if (dst_ != nullptr) note(platform_.runtime_free(device_, dst_));
    dst_ = nullptr;
    if (src_ != nullptr) note(platform_.runtime_free(device_, src_));
    src_ = nullptr;
    if (first_failure) throw_failure(*first_failure, where + ": releasing the buffers");
  }

  void* src() const noexcept { return src_; }
  void* dst() const noexcept { return dst_; }
  stream_handle stream() const noexcept { return stream_; }

 private:
  platform& platform_;
  int device_;
  void* src_ = nullptr;
  void* dst_ = nullptr;
  stream_handle stream_{};
  bool has_stream_ = false;
};

bandwidth_measurement measure_d2d_bandwidth(platform& p, int device) {
  const bool sim = p.kind() == "sim";
  // sim copies host memory: a smaller buffer keeps the run short and the RAM use modest.
  const std::size_t bytes = sim ? std::size_t{256} << 20 : std::size_t{1} << 30;
  const std::string where = "gpumem info --bandwidth (device " + std::to_string(device) + ")";

  copy_buffers buffers(p, device);
  buffers.acquire(bytes, where);
  // Touch both buffers first so first-touch costs (page faults, lazy mapping) are not timed.
  checked(p.memset_async(buffers.src(), 0x5a, bytes, buffers.stream()), where + ": initial write");
  checked(p.memset_async(buffers.dst(), 0, bytes, buffers.stream()), where + ": initial write");
  checked(p.stream_synchronize(buffers.stream()), where + ": initial write");

  auto copy = [&](int n) {
    for (int i = 0; i < n; ++i)
      checked(p.memcpy_async(buffers.dst(), buffers.src(), bytes, buffers.stream()),
              where + ": copy");
    checked(p.stream_synchronize(buffers.stream()), where + ": copy");
  };
  copy(bandwidth_warmup_copies);

  std::vector<double> rates;
  for (int r = 0; r < bandwidth_repetitions; ++r) {
    const auto start = std::chrono::steady_clock::now();
    copy(bandwidth_copies_per_repetition);
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    // Each copy reads `bytes` and writes `bytes`.
    const double moved = 2.0 * static_cast<double>(bytes) * bandwidth_copies_per_repetition;
    rates.push_back(elapsed.count() > 0 ? moved / elapsed.count() / 1e9 : 0.0);
  }
  buffers.release(where);

  std::sort(rates.begin(), rates.end());
  return {rates[rates.size() / 2], bytes, sim};
}

// --- gathering ---------------------------------------------------------------------------

struct device_report {
  int index = 0;
  device_properties props;
  memory_info memory;
  std::optional<allocation_granularity> granularity;  // absent without VMM
  std::optional<bandwidth_measurement> bandwidth;
};

struct platform_report {
  std::string kind;                       // "cuda" or "sim"
  bool simulated = false;
  bool gpu_found = false;                 // sim only: a GPU exists but sim was requested
  std::optional<std::string> reason_no_gpu;
  int device_count = 0;                   // on the platform; devices may show only one
  std::vector<device_report> devices;
  // peers[a][b]: device a can reach memory on device b (cuDeviceCanAccessPeer); every
  // device of the platform, empty with one device.
  std::vector<std::vector<bool>> peers;
};

device_report describe_device(platform& p, int device) {
  const std::string where = "gpumem info (device " + std::to_string(device) + ")";
  device_report d;
  d.index = device;
  d.props = checked(p.properties(device), where);
  d.memory = checked(p.mem_info(device), where);
  if (d.props.vmm_supported) d.granularity = checked(p.granularity(device), where);
  return d;
}

// --- formatting --------------------------------------------------------------------------

std::string fixed(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  return buf;
}

std::optional<double> theoretical_gb_per_s(const device_properties& props) {
  if (props.memory_clock_khz <= 0 || props.memory_bus_width_bits <= 0) return std::nullopt;
  return props.theoretical_bandwidth_bytes_per_s() / 1e9;
}

// Rounded for JSON readers: GB/s to two decimals.
double round2(double value) { return static_cast<double>(std::llround(value * 100.0)) / 100.0; }

const char* const sim_bandwidth_note = "sim: host memory copy, not a GPU figure";

void write_json(const platform_report& report, std::ostream& out) {
  json_writer w(out);
  w.begin_object();
  w.member("platform", report.kind);
  w.member("simulated", report.simulated);
  w.member("reason_no_gpu", report.reason_no_gpu);
  w.member("device_count", report.device_count);
  w.key("devices").begin_array();
  for (const auto& d : report.devices) {
    const auto& p = d.props;
    w.begin_object();
    w.member("index", d.index);
    w.member("name", p.name);
    w.member("compute_capability", std::to_string(p.compute_capability_major) + "." +
                                       std::to_string(p.compute_capability_minor));
    w.member("multiprocessors", p.multiprocessor_count);
    w.member("total_memory_bytes", d.memory.total);
    w.member("free_memory_bytes", d.memory.free);
    w.member("memory_bus_width_bits", p.memory_bus_width_bits);
    // null rather than 0 when the device does not report its memory clock.
    w.member("memory_clock_khz",
             p.memory_clock_khz > 0 ? std::optional<int>(p.memory_clock_khz) : std::nullopt);
    const auto theoretical = theoretical_gb_per_s(p);
    w.member("theoretical_bandwidth_gb_per_s",
             theoretical ? std::optional<double>(round2(*theoretical)) : std::nullopt);
    w.member("l2_cache_bytes", p.l2_cache_bytes);
    w.member("shared_memory_per_multiprocessor_bytes", p.shared_memory_per_multiprocessor);
    w.member("shared_memory_per_block_bytes", p.shared_memory_per_block);
    w.member("registers_per_multiprocessor", p.registers_per_multiprocessor);
    w.member("vmm_supported", p.vmm_supported);
    w.member("granularity_minimum_bytes",
             d.granularity ? std::optional<std::size_t>(d.granularity->minimum) : std::nullopt);
    w.member("granularity_recommended_bytes",
             d.granularity ? std::optional<std::size_t>(d.granularity->recommended)
                           : std::nullopt);
    w.member("memory_pools_supported", p.memory_pools_supported);
    if (d.bandwidth) {
      w.member("measured_d2d_bandwidth_gb_per_s", round2(d.bandwidth->gb_per_s));
      w.member("measured_d2d_buffer_bytes", d.bandwidth->buffer_bytes);
      if (d.bandwidth->host_copy) w.member("measured_d2d_bandwidth_note", sim_bandwidth_note);
    }
    w.end_object();
  }
  w.end_array();
  // Row a, column b: device a can reach device b's memory (true on the diagonal).
  w.key("peer_access").begin_array();
  for (const auto& row : report.peers) {
    w.begin_array();
    for (bool can : row) w.value(can);
    w.end_array();
  }
  w.end_array();
  w.end_object();
}

std::string bytes_exact(std::size_t bytes) {
  return format_bytes(bytes) + " (" + std::to_string(bytes) + " bytes)";
}

std::vector<std::pair<std::string, std::string>> device_rows(const platform_report& report,
                                                             const device_report& d) {
  const auto& p = d.props;
  std::vector<std::pair<std::string, std::string>> rows;
  rows.emplace_back("platform", report.simulated ? report.kind + " (simulated, host memory)"
                                                 : report.kind);
  rows.emplace_back("compute capability", std::to_string(p.compute_capability_major) + "." +
                                              std::to_string(p.compute_capability_minor));
  rows.emplace_back("multiprocessors (SMs)", std::to_string(p.multiprocessor_count));
  rows.emplace_back("total memory", bytes_exact(d.memory.total));
  rows.emplace_back("free memory", bytes_exact(d.memory.free));
  rows.emplace_back("memory bus width", std::to_string(p.memory_bus_width_bits) + " bits");
  if (p.memory_clock_khz > 0)
    rows.emplace_back("memory clock", fixed(p.memory_clock_khz / 1e3, 0) + " MHz");
  else
    rows.emplace_back("memory clock", "not reported");
  if (auto gbps = theoretical_gb_per_s(p))
    rows.emplace_back("theoretical bandwidth", fixed(*gbps, 1) + " GB/s");
  else
    rows.emplace_back("theoretical bandwidth", "not reported (memory clock unknown)");
  rows.emplace_back("L2 cache", format_bytes(p.l2_cache_bytes));
  rows.emplace_back("shared memory per SM", format_bytes(p.shared_memory_per_multiprocessor));
  rows.emplace_back("shared memory per block", format_bytes(p.shared_memory_per_block));
  rows.emplace_back("registers per SM", std::to_string(p.registers_per_multiprocessor));
  rows.emplace_back("virtual memory (VMM)", p.vmm_supported ? "supported" : "not supported");
  if (d.granularity) {
    rows.emplace_back("VMM granularity minimum", format_bytes(d.granularity->minimum));
    rows.emplace_back("VMM granularity recommended", format_bytes(d.granularity->recommended));
  } else {
    rows.emplace_back("VMM granularity", "n/a (no VMM)");
  }
  rows.emplace_back("memory pools (cudaMallocAsync)",
                    p.memory_pools_supported ? "supported" : "not supported");
  if (d.bandwidth) {
    std::string text = fixed(d.bandwidth->gb_per_s, 1) + " GB/s (2 x " +
                       format_bytes(d.bandwidth->buffer_bytes) + " buffers, read + write";
    text += d.bandwidth->host_copy ? std::string("; ") + sim_bandwidth_note + ")" : ")";
    rows.emplace_back("measured D2D copy bandwidth", text);
  }
  return rows;
}

void write_text(const platform_report& report, std::ostream& out) {
  out << "platform: " << report.kind;
  if (report.simulated) out << " (simulated device, no GPU in use)";
  out << "\n";
  if (report.simulated) {
    out << (report.gpu_found ? "GPU not used: " : "no GPU found: ")
        << report.reason_no_gpu.value_or("unknown") << "\n"
        << "note: the figures below describe gpumem's simulated device (host memory shaped "
           "like an H200), not a real GPU.\n";
  }
  out << "devices: " << report.device_count;
  if (report.devices.size() == 1 && report.device_count > 1)
    out << " (showing device " << report.devices.front().index << ")";
  out << "\n";

  std::vector<std::vector<std::pair<std::string, std::string>>> tables;
  std::size_t width = 0;
  for (const auto& d : report.devices) {
    tables.push_back(device_rows(report, d));
    for (const auto& row : tables.back()) width = std::max(width, row.first.size());
  }
  for (std::size_t i = 0; i < report.devices.size(); ++i) {
    out << "\ndevice " << report.devices[i].index << ": " << report.devices[i].props.name << "\n";
    for (const auto& [label, value] : tables[i])
      out << "  " << label << std::string(width - label.size() + 2, ' ') << value << "\n";
  }
  if (!report.peers.empty()) {
    out << "\npeer access (row device reaches column device's memory; cuDeviceCanAccessPeer):\n"
        << "      ";
    for (std::size_t b = 0; b < report.peers.size(); ++b) {
      const std::string head = std::to_string(b);
      out << std::string(5 - std::min<std::size_t>(head.size(), 4), ' ') << head;
    }
    out << "\n";
    for (std::size_t a = 0; a < report.peers.size(); ++a) {
      const std::string head = std::to_string(a);
      out << "  " << head << std::string(4 - std::min<std::size_t>(head.size(), 3), ' ');
      for (std::size_t b = 0; b < report.peers.size(); ++b)
        out << (a == b ? "    -" : report.peers[a][b] ? "  yes" : "   no");
      out << "\n";
    }
  }
}

arg_parser info_parser() {
  arg_parser parser("gpumem info",
                    "Show the GPU (or, without one, gpumem's simulated device): properties,\n"
                    "free memory, virtual-memory granularity and, with --bandwidth, a measured\n"
                    "device-to-device copy bandwidth.");
  parser
      .option("device", "", "platform to use: cuda if a GPU is present else sim (auto), or "
                            "force one (default: $GPUMEM_DEVICE, else auto)",
              std::nullopt, {"auto", "sim", "cuda"})
      .option("index", "N", "describe only device N (default: every device)")
      .flag("json", "print one JSON object instead of a table")
      .flag("bandwidth",
            "also measure device-to-device copy bandwidth (2 x 1 GiB buffers; sim: 256 MiB "
            "of host memory, not a GPU figure)")
      .epilog(
          "environment:\n"
          "  GPUMEM_DEVICE   platform when --device is not given: auto, cuda or sim\n"
          "  GPUMEM_SIM_DEVICES  number of simulated GPUs (default 1)\n"
          "\n"
          "examples:\n"
          "  gpumem info\n"
          "  gpumem info --device sim --json\n"
          "  gpumem info --index 0 --bandwidth");
  return parser;
}

// The platform: --device, else $GPUMEM_DEVICE (through default_platform), else auto;
// `requested_by` says which.
platform& chosen_platform(const parsed_args& args, std::string& requested_by) {
  platform* chosen = nullptr;
  if (auto name = args.value("device")) {
    requested_by = "--device " + *name;
    chosen = &platform_by_name(*name);
  } else {
    const char* env = std::getenv("GPUMEM_DEVICE");
    requested_by = env != nullptr ? "GPUMEM_DEVICE=" + std::string(env) : "auto";
    try {
      chosen = &default_platform();
    } catch (const invalid_argument& e) {
      throw invalid_argument("GPUMEM_DEVICE: " + std::string(e.what()));
    }
  }
  return *chosen;
}

// What the platform says of itself, its devices (every one, or `only_index`) and the peer
// access between them.
platform_report describe_platform(platform& p, const std::string& requested_by,
                                  std::optional<std::int64_t> only_index) {
  platform_report report;
  report.kind = std::string(p.kind());
  report.simulated = report.kind == "sim";
  if (report.simulated) {
    std::string reason = cuda_unavailable_reason();
    report.gpu_found = reason.empty();
    if (report.gpu_found)
      reason = "the sim platform was requested (" + requested_by +
               "); a CUDA device is present but not used";
    report.reason_no_gpu = std::move(reason);
  }

  const int count = checked(p.device_count(), "gpumem info: counting devices");
  report.device_count = count;
  if (only_index && *only_index >= count)
    throw invalid_argument(
        "device index " + std::to_string(*only_index) + " does not exist: the " + report.kind +
        " platform has " +
        (count == 1 ? std::string("1 device (index 0)")
                    : std::to_string(count) + " devices" +
                          (count > 1 ? " (0.." + std::to_string(count - 1) + ")" : "")));
  for (int i = 0; i < count; ++i) {
    if (only_index && i != *only_index) continue;
    report.devices.push_back(describe_device(p, i));
  }
  if (count > 1) {
    report.peers.assign(static_cast<std::size_t>(count),
                        std::vector<bool>(static_cast<std::size_t>(count), true));
    for (int a = 0; a < count; ++a)
      for (int b = 0; b < count; ++b)
        if (a != b)
          report.peers[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)] =
              checked(p.can_access_peer(a, b), "gpumem info: peer access of device " +
                                                   std::to_string(a) + " to device " +
                                                   std::to_string(b));
  }
  return report;
}

}  // namespace

int run_info(int argc, char** argv) {
  const arg_parser parser = info_parser();
  const parsed_args args = parser.parse(argc, argv);
  if (args.help_requested()) {
    std::cout << parser.help();
    return 0;
  }
  const std::optional<std::int64_t> only_index = args.integer("index", 0);
  const bool json = args.has("json");
  const bool bandwidth = args.has("bandwidth");
  std::string requested_by;
  platform& p = chosen_platform(args, requested_by);
  platform_report report = describe_platform(p, requested_by, only_index);
  // Measure after every property query so that free memory is reported untouched.
  if (bandwidth)
    for (auto& d : report.devices) d.bandwidth = measure_d2d_bandwidth(p, d.index);

  if (json)
    write_json(report, std::cout);
  else
    write_text(report, std::cout);
  std::cout.flush();
  return std::cout ? 0 : 1;
}

}  // namespace gpumem::cli
