// torch_replay_bench: one recorded trace replayed in ONE process through PyTorch's own
// caching allocator (c10::cuda::CUDACachingAllocator raw_alloc_with_stream / raw_delete,
// what every torch tensor allocation goes through) and through gpumem's pools on the same
// GPU: peak reserved, fragmentation (peak reserved / the trace's peak live requested bytes)
// and host time per event, cold (first pass) and warm (last pass); for gpumem's pools also
// the last pass's memory-moving driver calls (replay_result::last_pass_memory_calls).
//
// gpumem's page pool runs twice: with the defaults (footprint:fast, a cache within its
// budget) and with footprint:tight (pages gathered on every growth they can serve).
// c10 reads PYTORCH_CUDA_ALLOC_CONF when it starts: with expandable_segments:True its row is
// named "pytorch c10 expandable segments"; --c10-only replays through c10 alone (a second
// run under that setting, beside the first's rows).
//
// Built only when libtorch is found (GPUMEM_TORCH_DIR, or python3's torch package).
// Usage: torch_replay_bench TRACE [--passes N] [--json FILE] [--c10-only]
//   --json FILE: also append the rows to FILE as a JSON array of {trace, allocator,
//   fragmentation, ns_per_event (warm), ns_per_event_cold, last_pass_memory_calls}, which
//   `gpumem replay --tradeoff-points FILE --tradeoff-plot OUT.svg` draws (the array is
//   rewritten whole with each run's rows added).
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/replay/trace.hpp"

namespace {

struct row {
  std::string allocator;
  std::size_t peak_reserved = 0;
  double cold = 0, warm = 0;
  bool oom = false;
  std::uint64_t last_pass_calls = 0;  // gpumem's pools only (c10's calls are not counted)
  bool calls_counted = false;
};

// The trace's other streams are made by gpumem's platform, not c10's stream pool: that asks
// libtorch_cuda's hooks for a primary context, and this program links c10 alone (it
// aborted on two-stream traces). The caching allocator takes any stream of the device.
row replay_through_c10(const gpumem::trace& t, int passes, gpumem::platform& gpu) {
  namespace alloc = c10::cuda::CUDACachingAllocator;
  alloc::init(c10::cuda::device_count());  // what torch's lazy CUDA init does
  std::vector<cudaStream_t> streams(t.streams.size(), nullptr);
  streams[0] = c10::cuda::getDefaultCUDAStream(0).stream();
  std::vector<gpumem::stream_handle> made;
  struct destroy_streams {
    gpumem::platform& gpu;
    std::vector<gpumem::stream_handle>& made;
    ~destroy_streams() {
      for (auto s : made) (void)gpu.stream_destroy(s);
    }
  } at_exit{gpu, made};
  for (std::size_t i = 1; i < streams.size(); ++i) {
    auto s = gpu.stream_create(0);
    if (!s) throw std::runtime_error("a stream for the trace: " + s.error().describe());
    made.push_back(s.value());
    streams[i] = reinterpret_cast<cudaStream_t>(s.value().value);
  }
  alloc::resetPeakStats(0);
  const char* conf = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  const bool expandable = conf != nullptr && std::strstr(conf, "expandable_segments:True") != nullptr;
  row r{expandable ? "pytorch c10 expandable segments" : "pytorch c10 caching allocator"};
  std::vector<void*> ptrs(t.allocs, nullptr);
  for (int pass = 0; pass < passes && !r.oom; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& e : t.events) {
      if (e.op == gpumem::trace_event::kind::alloc) {
        try {
          ptrs[e.id] = alloc::raw_alloc_with_stream(e.size, streams[e.stream]);
        } catch (const std::exception&) {
          r.oom = true;
          break;
        }
      } else if (ptrs[e.id] != nullptr) {
        alloc::raw_delete(ptrs[e.id]);
        ptrs[e.id] = nullptr;
      }
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
                      static_cast<double>(t.events.size());
    (pass == 0 ? r.cold : r.warm) = ns;
    if (pass == 0) r.warm = ns;
    for (auto& p : ptrs)
      if (p != nullptr) {
        alloc::raw_delete(p);
        p = nullptr;
      }
  }
  // Index 0: StatType::AGGREGATE.
  r.peak_reserved = static_cast<std::size_t>(alloc::getDeviceStats(0).reserved_bytes[0].peak);
  alloc::emptyCache();
  return r;
}

row replay_through_gpumem(const gpumem::trace& t, gpumem::memory_resource& pool, int passes,
                          const std::string& label) {
  gpumem::replay_options o;
  o.passes = passes;
  const auto res = gpumem::replay_trace(t, pool, o);
  return {"gpumem " + res.allocator + label, res.peak_reserved_bytes, res.ns_per_event_cold,
          res.ns_per_event_warm, res.oom, res.last_pass_memory_calls, true};
}

// A JSON string of `text` (trace paths and allocator names: quotes and backslashes escaped,
// control characters dropped).
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

// Adds the rows to the JSON array in `path` (made when absent): the file's text up to its
// closing ']', then the new objects. Rows that ran out of memory are written with
// "oom": true and no times.
void append_json(const std::string& path, const std::string& trace_path, const gpumem::trace& t,
                 const std::vector<row>& rows) {
  std::string text;
  if (std::FILE* in = std::fopen(path.c_str(), "rb")) {
    char buf[4096];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, in)) > 0;) text.append(buf, n);
    std::fclose(in);
  }
  const auto close = text.rfind(']');
  const bool empty = close == std::string::npos || text.find('{') == std::string::npos;
  text = empty ? std::string("[") : text.substr(0, close);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const row& r = rows[i];
    char figures[256];
    if (r.oom)
      std::snprintf(figures, sizeof figures, "\"oom\": true");
    else
      std::snprintf(figures, sizeof figures,
                    "\"fragmentation\": %.6f, \"ns_per_event\": %.1f, \"ns_per_event_cold\": %.1f",
                    static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_live_bytes),
                    r.warm, r.cold);
    text += (empty && i == 0 ? "\n  " : ",\n  ");
    text += "{\"trace\": " + quoted(trace_path) + ", \"allocator\": " + quoted(r.allocator) + ", " +
            figures;
    if (r.calls_counted) text += ", \"last_pass_memory_calls\": " + std::to_string(r.last_pass_calls);
    text += "}";
  }
  text += "\n]\n";
  std::FILE* out = std::fopen(path.c_str(), "wb");
  if (out == nullptr || std::fwrite(text.data(), 1, text.size(), out) != text.size()) {
    std::fprintf(stderr, "torch_replay_bench: cannot write %s\n", path.c_str());
    if (out != nullptr) std::fclose(out);
    return;
  }
  std::fclose(out);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: torch_replay_bench TRACE [--passes N] [--json FILE] [--c10-only]\n");
    return 2;
  }
  int passes = 2;
  std::string json_path;
  bool c10_only = false;
  for (int i = 2; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--c10-only")) c10_only = true;
    if (i + 1 >= argc) continue;
    if (!std::strcmp(argv[i], "--passes")) passes = std::max(1, std::atoi(argv[i + 1]));
    if (!std::strcmp(argv[i], "--json")) json_path = argv[i + 1];
  }
  const gpumem::trace t = gpumem::load_trace(argv[1]);
  std::printf("trace %s: %zu events, peak live %.2f GiB, %zu stream(s), %d passes, one process\n",
              argv[1], t.events.size(), static_cast<double>(t.peak_live_bytes) / (1 << 30),
              t.streams.size(), passes);
  std::vector<row> rows;
  gpumem::platform& gpu = gpumem::platform_by_name("cuda");
  try {
    rows.push_back(replay_through_c10(t, passes, gpu));
  } catch (const std::exception& e) {  // c10's own refusal: say it, keep gpumem's rows
    std::printf("pytorch c10 caching allocator: failed: %s\n", e.what());
  }
  if (!c10_only) {
    {
      gpumem::vmm_page_pool pool(gpu, 0);
      rows.push_back(replay_through_gpumem(t, pool, passes, ""));
    }
    {
      gpumem::pool_options tight;
      tight.footprint = gpumem::footprint_mode::tight;
      gpumem::vmm_page_pool pool(gpu, 0, tight);
      rows.push_back(replay_through_gpumem(t, pool, passes, " footprint:tight"));
    }
    {
      gpumem::runtime_resource upstream(gpu, 0);
      gpumem::caching_pool pool(upstream);
      rows.push_back(replay_through_gpumem(t, pool, passes, ""));
    }
  }
  std::printf("%-32s %12s %9s %12s %12s %16s\n", "allocator", "peak_res_GiB", "frag",
              "ns/ev cold", "ns/ev warm", "last-pass calls");
  for (const auto& r : rows)
    std::printf("%-32s %12.2f %9.4f %12.0f %12.0f %16s%s\n", r.allocator.c_str(),
                static_cast<double>(r.peak_reserved) / (1 << 30),
                static_cast<double>(r.peak_reserved) / static_cast<double>(t.peak_live_bytes),
                r.cold, r.warm, r.calls_counted ? std::to_string(r.last_pass_calls).c_str() : "-",
                r.oom ? "  (out of memory)" : "");
  if (!json_path.empty()) append_json(json_path, argv[1], t, rows);
  return 0;
}
