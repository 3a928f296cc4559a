#include "gpumem/replay/trace.hpp"
#include "gpumem/replay/torch_snapshot.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/platform/sim_platform.hpp"
#include "gpumem/platform/timed_platform.hpp"
#include "gpumem/platform/status_error.hpp"
#include "gpumem/pool/plan/step_planner.hpp"

#if GPUMEM_HAVE_ZLIB
#include <zlib.h>
#endif

namespace gpumem {

namespace {

// A trace file's bytes, as they stream: through zlib (which reads a plain file unchanged)
// or, built without zlib, a plain file alone. Closed by the destructor.
class trace_file {
 public:
  explicit trace_file(std::string path) : path_(std::move(path)) {
#if GPUMEM_HAVE_ZLIB
    file_ = gzopen(path_.c_str(), "rb");
    if (file_ == nullptr) throw invalid_argument("trace: cannot open '" + path_ + "': " + std::strerror(errno));
#else
    file_ = std::fopen(path_.c_str(), "rb");
    if (file_ == nullptr) throw invalid_argument("trace: cannot open '" + path_ + "': " + std::strerror(errno));
    const int first = std::fgetc(file_);
    const int second = first == EOF ? EOF : std::fgetc(file_);
    if (first == 0x1f && second == 0x8b) {
      std::fclose(file_);
      throw invalid_argument("trace: '" + path_ +
                             "' is gzip-compressed, and this gpumem was built without zlib: "
                             "decompress it first (gunzip), or rebuild with zlib (zlib1g-dev)");
    }
    std::rewind(file_);
#endif
  }
  ~trace_file() {
#if GPUMEM_HAVE_ZLIB
    gzclose(file_);
#else
    std::fclose(file_);
#endif
  }
  trace_file(const trace_file&) = delete;
  trace_file& operator=(const trace_file&) = delete;

  // Up to `n` more bytes into `buf`; 0 at the end of the data. Throws naming the file and
  // `line` (where the data stopped) when it cannot be read, or its gzip stream is corrupt
  // or ends early.
  std::size_t read(char* buf, std::size_t n, std::size_t line) {
    std::size_t got = 0;
    if (const std::string why = read_some(buf, n, got); !why.empty())
      throw invalid_argument("trace: " + path_ + ":" + std::to_string(line) + ": " + why);
    return got;
  }

  // A gzip stream yields what it decompresses before its checksum, at its end, shows it
  // corrupt: the error the rest of a gzip'd file gives, read and dropped ("" if none).
  std::string error_in_rest() {
#if GPUMEM_HAVE_ZLIB
    if (gzdirect(file_) != 0) return "";
    std::vector<char> buf(1 << 16);
    std::size_t got = 0;
    for (;;) {
      if (std::string why = read_some(buf.data(), buf.size(), got); !why.empty()) return why;
      if (got == 0) return "";
    }
#else
    return "";
#endif
  }

 private:
  // Up to `n` bytes into `buf`, their count in `got`: "" or why reading failed. zlib
  // reports an early end (Z_BUF_ERROR) only through gzerror, with gzread returning 0 as at
  // a clean end.
  std::string read_some(char* buf, std::size_t n, std::size_t& got) {
#if GPUMEM_HAVE_ZLIB
    const int read = gzread(file_, buf, static_cast<unsigned>(n));
    got = read > 0 ? static_cast<std::size_t>(read) : 0;
    int code = Z_OK;
    std::string why = gzerror(file_, &code);  // "<path>: <what>"
    if (why.rfind(path_ + ": ", 0) == 0) why.erase(0, path_.size() + 2);
    if (read < 0 || code == Z_ERRNO) return "cannot read: " + why;
    if (read == 0 && code == Z_BUF_ERROR)
      return "the gzip data ends early (" + why + "): the file is truncated";
#else
    got = std::fread(buf, 1, n, file_);
    if (got == 0 && std::ferror(file_)) return std::string("cannot read: ") + std::strerror(errno);
#endif
    return "";
  }

  std::string path_;
#if GPUMEM_HAVE_ZLIB
  gzFile file_ = nullptr;
#else
  std::FILE* file_ = nullptr;
#endif
};

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> fields;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= line.size(); ++i) {
    if (i == line.size() || line[i] == ',') {
      std::string_view f = line.substr(start, i - start);
      while (!f.empty() && (f.front() == ' ' || f.front() == '"')) f.remove_prefix(1);
      while (!f.empty() && (f.back() == ' ' || f.back() == '"' || f.back() == '\r')) f.remove_suffix(1);
      fields.push_back(f);
      start = i + 1;
    }
  }
  return fields;
}

std::uint64_t parse_u64(std::string_view f, const std::string& where) {
  std::uint64_t v = 0;
  int base = 10;
  if (f.size() > 2 && f[0] == '0' && (f[1] == 'x' || f[1] == 'X')) {
    f.remove_prefix(2);
    base = 16;
  }
  auto [p, ec] = std::from_chars(f.data(), f.data() + f.size(), v, base);
  if (ec != std::errc{} || p != f.data() + f.size() || f.empty())
    throw invalid_argument("trace: " + where + ": '" + std::string(f) + "' is not a number");
  return v;
}

// An event's time in nanoseconds, or false: PyTorch's time_us (an integer of
// microseconds); RMM's Time, h:m:s with a fraction after '.' or ':'.
bool parse_time_ns(std::string_view f, bool rmm, std::uint64_t& ns) {
  auto number = [](std::string_view d, std::uint64_t& v) {
    auto [p, ec] = std::from_chars(d.data(), d.data() + d.size(), v);
    return ec == std::errc{} && p == d.data() + d.size() && !d.empty();
  };
  if (!rmm) {
    std::uint64_t us = 0;
    if (!number(f, us) || us > (std::uint64_t{1} << 63) / 1000) return false;
    ns = us * 1000;
    return true;
  }
  std::uint64_t part[3] = {};
  for (int i = 0; i < 3; ++i) {
    const std::size_t sep = i < 2 ? f.find(':') : f.find_first_of(".:");
    if (!number(f.substr(0, sep), part[i])) return false;
    f = sep == std::string_view::npos ? std::string_view{} : f.substr(sep + 1);
  }
  std::uint64_t frac_ns = 0, scale = 100'000'000;
  for (char c : f.substr(0, 9)) {
    if (c < '0' || c > '9') return false;
    frac_ns += static_cast<std::uint64_t>(c - '0') * scale;
    scale /= 10;
  }
  ns = ((part[0] * 60 + part[1]) * 60 + part[2]) * 1'000'000'000 + frac_ns;
  return true;
}

}  // namespace

trace_clock::trace_clock(platform& p, const trace& t, pool_base* pool)
    : platform_(p), trace_(t), pool_(pool) {
  const std::uint64_t n = t.events.size();
  // A timed trace's pass starts one average event after the last one ended.
  pass_ns_ = !t.timed ? n * untimed_event_ns
                      : t.duration_ns + (n > 1 ? t.duration_ns / (n - 1) : untimed_event_ns);
  if (pool_ != nullptr) pool_->set_clock(this);
}

trace_clock::~trace_clock() {
  if (pool_ != nullptr) pool_->set_clock(nullptr);
}

void trace_clock::at(int pass, std::size_t index) noexcept {
  const std::size_t n = trace_.events.size();
  const std::uint64_t at = !trace_.timed ? index * untimed_event_ns
                           : index < n   ? trace_.events[index].time_ns
                                         : trace_.duration_ns;
  event_ns_ = static_cast<std::uint64_t>(pass) * pass_ns_ + at;
}

std::uint64_t trace_clock::now_ns() const noexcept {
  std::uint64_t driver = 0;
  if (auto* timed = dynamic_cast<timed_platform*>(&platform_))
    driver = timed->measured_ns();
  else if (auto* sim = dynamic_cast<sim_platform*>(&platform_))
    driver = sim->modelled_ns();
  return event_ns_ + driver;
}

namespace {

// Builds a trace from its lines, given in order (the grammar in trace.hpp).
class trace_builder {
 public:
  explicit trace_builder(const std::string& source) { t_.source = source; }

  bool has_header() const noexcept { return col_action_ >= 0; }

  // Line `line_no` (from 1), without its '\n'.
  void add_line(std::string_view line, std::size_t line_no) {
    if (line_no == 1 && line.substr(0, 3) == "\xEF\xBB\xBF") line.remove_prefix(3);  // UTF-8 BOM
    if (line.empty() || line == "\r") return;
    const std::string where = t_.source + ":" + std::to_string(line_no);
    if (!has_header()) {
      read_header(line, where);
      return;
    }
    add_event(line, where);
  }

  trace finish() && {
    if (!has_header()) throw invalid_argument("trace: " + t_.source + " is empty");
    t_.timed = all_timed_ && !t_.events.empty();
    if (t_.timed)
      t_.duration_ns = t_.events.back().time_ns;
    else
      for (trace_event& e : t_.events) e.time_ns = 0;
    // An allocation whose address was reused while it lived is never freed either.
    t_.live_at_end = live_.size() + t_.reused_addresses;
    return std::move(t_);
  }

 private:
  void read_header(std::string_view line, const std::string& where) {
    if (line.find('\0') != std::string_view::npos)
      throw invalid_argument("trace: " + where + ": binary data, not a trace (a trace is CSV "
                             "text, plain or gzip'd)");
    const auto f = split(line);
    for (int i = 0; i < static_cast<int>(f.size()); ++i) {
      if (f[i] == "action") { col_action_ = i; t_.format = "pytorch"; }
      if (f[i] == "Action") { col_action_ = i; t_.format = "rmm"; }
      if (f[i] == "addr" || f[i] == "Pointer") col_addr_ = i;
      if (f[i] == "size" || f[i] == "Size") col_size_ = i;
      if (f[i] == "stream" || f[i] == "Stream") col_stream_ = i;
      if (f[i] == "time_us" || f[i] == "Time") col_time_ = i;
    }
    if (col_action_ < 0 || col_addr_ < 0 || col_size_ < 0) {
      col_action_ = -1;
      throw invalid_argument("trace: " + where +
                             ": unknown header; expected 'action,addr,size,stream,time_us' "
                             "(PyTorch) or 'Thread,Time,Action,Pointer,Size,Stream' (RMM)");
    }
  }

  void add_event(std::string_view line, const std::string& where) {
    const auto f = split(line);
    const int needed = std::max({col_action_, col_addr_, col_size_, col_stream_});
    if (static_cast<int>(f.size()) <= needed)
      throw invalid_argument("trace: " + where + ": expected at least " +
                             std::to_string(needed + 1) + " fields");
    const std::string_view action = f[static_cast<std::size_t>(col_action_)];
    const bool is_alloc = action == "alloc" || action == "allocate";
    const bool is_free = action == "free_completed" || action == "free";
    if (!is_alloc && !is_free) {
      if (action == "segment_alloc" || action == "segment_free" || action == "free_requested" ||
          action == "segment_map" || action == "segment_unmap" || action == "snapshot" ||
          action == "oom" || action == "allocate failure")
        return;
      throw invalid_argument("trace: " + where + ": unknown action '" + std::string(action) + "'");
    }
    const std::uint64_t addr = parse_u64(f[static_cast<std::size_t>(col_addr_)], where);
    const std::uint64_t size = parse_u64(f[static_cast<std::size_t>(col_size_)], where);
    const std::uint64_t stream =
        col_stream_ >= 0 && !f[static_cast<std::size_t>(col_stream_)].empty()
            ? parse_u64(f[static_cast<std::size_t>(col_stream_)], where)
            : 0;
    // Times never go back (a multi-threaded RMM log may interleave them): each is at
    // least the one before.
    std::uint64_t time_ns = 0;
    if (all_timed_) {
      std::uint64_t ns = 0;
      if (col_time_ >= 0 && static_cast<std::size_t>(col_time_) < f.size() &&
          parse_time_ns(f[static_cast<std::size_t>(col_time_)], t_.format == "rmm", ns)) {
        if (!have_first_) {
          first_ns_ = ns;
          have_first_ = true;
        }
        last_ns_ = std::max(last_ns_, ns > first_ns_ ? ns - first_ns_ : 0);
        time_ns = last_ns_;
      } else {
        all_timed_ = false;
      }
    }
    auto [sit, fresh] = stream_index_.emplace(stream, static_cast<std::uint32_t>(t_.streams.size()));
    if (fresh) t_.streams.push_back(stream);
    if (is_alloc) {
      if (size == 0) return;  // nothing to replay
      const auto id = static_cast<std::uint32_t>(t_.allocs++);
      auto [it, inserted] = live_.try_emplace(addr, id, size);
      if (!inserted) {
        ++t_.reused_addresses;
        it->second = {id, size};
      }
      freed_.erase(addr);
      t_.events.push_back({trace_event::kind::alloc, id, size, sit->second, time_ns});
      live_bytes_ += size;
      t_.peak_live_bytes = std::max(t_.peak_live_bytes, live_bytes_);
      t_.max_size = std::max(t_.max_size, size);
      return;
    }
    auto it = live_.find(addr);
    if (it == live_.end()) {
      ++(freed_.count(addr) != 0 ? t_.double_frees : t_.unmatched_frees);
      return;
    }
    if (size != it->second.second) ++t_.mismatched_free_sizes;
    t_.events.push_back({trace_event::kind::free, it->second.first, it->second.second, sit->second,
                         time_ns});
    live_bytes_ -= it->second.second;
    ++t_.frees;
    live_.erase(it);
    freed_.insert(addr);
  }

  trace t_;
  int col_action_ = -1, col_addr_ = -1, col_size_ = -1, col_stream_ = -1, col_time_ = -1;
  bool all_timed_ = true, have_first_ = false;
  std::uint64_t first_ns_ = 0, last_ns_ = 0;
  std::unordered_map<std::uint64_t, std::pair<std::uint32_t, std::uint64_t>> live_;  // addr -> id, size
  std::unordered_set<std::uint64_t> freed_;  // addresses freed in the trace and not reused since
  std::unordered_map<std::uint64_t, std::uint32_t> stream_index_;
  std::size_t live_bytes_ = 0;
};

}  // namespace

trace parse_trace(const std::string& text, const std::string& source) {
  trace_builder b(source);
  std::size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    b.add_line(std::string_view(text.data() + pos, end - pos), ++line_no);
    pos = end + 1;
  }
  return std::move(b).finish();
}

trace load_trace(const std::string& path) {
  trace_file in(path);
  trace_builder b(path);
  // Whole lines go to the builder as they arrive; `pending` holds a line not yet ended.
  std::string pending;
  std::vector<char> buf(trace_header_window);
  std::size_t line_no = 0, bytes = 0;
  // What the text is refused for, and whether the gzip stream it came from is corrupt.
  auto refuse = [&](const std::string& message) {
    if (const std::string corrupt = in.error_in_rest(); !corrupt.empty())
      throw invalid_argument(message + " (the gzip data is corrupt: " + corrupt + ")");
    throw invalid_argument(message);
  };
  auto add_line = [&](std::string_view line) {
    try {
      b.add_line(line, ++line_no);
    } catch (const invalid_argument& e) {
      refuse(e.what());
    }
  };
  auto refuse_long_line = [&] {
    refuse("trace: " + path + ":" + std::to_string(line_no + 1) + ": a line longer than " +
           format_bytes(trace_max_line) + ": not a trace");
  };
  while (const std::size_t n = in.read(buf.data(), buf.size(), line_no + 1)) {
    if (bytes == 0 && looks_like_pickle(std::string(buf.data(), std::min<std::size_t>(n, 3)))) {
      // A PyTorch memory snapshot (torch.cuda.memory._dump_snapshot): its device trace.
      std::string all(buf.data(), n);
      while (const std::size_t more = in.read(buf.data(), buf.size(), 1)) all.append(buf.data(), more);
      return parse_trace(torch_snapshot_to_trace_csv(all, path), path);
    }
    bytes += n;
    pending.append(buf.data(), n);
    std::size_t start = 0;
    for (std::size_t end; (end = pending.find('\n', start)) != std::string::npos; start = end + 1) {
      if (end - start > trace_max_line) refuse_long_line();
      add_line(std::string_view(pending).substr(start, end - start));
    }
    pending.erase(0, start);
    if (!b.has_header() && bytes >= trace_header_window)
      refuse("trace: " + path + " is not a trace: no header line in its first " +
             format_bytes(trace_header_window) +
             " (expected 'action,addr,size,stream,time_us' (PyTorch) or "
             "'Thread,Time,Action,Pointer,Size,Stream' (RMM))");
    if (pending.size() > trace_max_line) refuse_long_line();
  }
  if (!pending.empty()) add_line(pending);
  return std::move(b).finish();
}

std::vector<std::size_t> find_steps(const trace& t, std::size_t min_repeats) {
  // The allocations, as (size, stream), with their event indices.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> req;
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < t.events.size(); ++i)
    if (t.events[i].op == trace_event::kind::alloc) {
      req.emplace_back(t.events[i].size, t.events[i].stream);
      at.push_back(i);
    }
  const std::size_t n = req.size();
  std::size_t period = 0;
  for (std::size_t p = 1; p <= n / 2 && period == 0; ++p)
    if (std::equal(req.end() - static_cast<std::ptrdiff_t>(p), req.end(),
                   req.end() - static_cast<std::ptrdiff_t>(2 * p)))
      period = p;
  if (period == 0) return {};
  std::size_t first = n - 2 * period;  // the repeat holds for allocations [first, n)
  while (first > 0 && req[first - 1] == req[first - 1 + period]) --first;
  if ((n - first) / period < min_repeats) return {};

  // Live bytes after each event of the last full period; the step begins at the first
  // allocation after the least.
  std::size_t live = 0, least = static_cast<std::size_t>(-1), least_at = 0;
  const std::size_t from = at[n - 2 * period], to = at[n - period];
  for (std::size_t i = 0; i < to; ++i) {
    const trace_event& e = t.events[i];
    live = e.op == trace_event::kind::alloc ? live + e.size : live - e.size;
    if (i >= from && live < least) {
      least = live;
      least_at = i;
    }
  }
  const auto next_alloc = std::upper_bound(at.begin(), at.end(), least_at);
  const std::size_t phase = static_cast<std::size_t>(next_alloc - at.begin()) % period;
  std::vector<std::size_t> starts;
  for (std::size_t k = phase; k < n; k += period)
    if (k >= first) starts.push_back(at[k]);
  return starts;
}

std::string oversized_request(const trace& t, const std::string& allocator, std::uint64_t event,
                              std::uint64_t bytes, std::size_t device_total) {
  return "out of memory replaying " + t.source + " on " + allocator + ": event " +
         std::to_string(event) + " requests " + format_bytes(bytes) +
         ", more than the device's whole memory (" + format_bytes(device_total) + ")";
}

bool moves_memory(platform_op op) noexcept {
  switch (op) {
    case platform_op::create_physical:
    case platform_op::release_physical:
    case platform_op::map:
    case platform_op::unmap:
    case platform_op::set_access:
    case platform_op::runtime_malloc:
    case platform_op::runtime_free:
    case platform_op::driver_alloc:
    case platform_op::driver_free:
      return true;
    default:
      return false;
  }
}

replay_result replay_trace(const trace& t, memory_resource& resource, const replay_options& options) {
  replay_result r;
  r.allocator = std::string(resource.name());
  r.peak_live_bytes = t.peak_live_bytes;
  platform& p = resource.device_platform();
  auto* sim = dynamic_cast<sim_platform*>(&p);
  auto* timed = dynamic_cast<timed_platform*>(&p);
  // Driver time per operation: modelled on sim, measured through a timing decorator.
  auto op_ns = [&](platform_op op) -> std::uint64_t {
    if (timed != nullptr) return timed->measured_ns(op);
    if (sim != nullptr) return sim->modelled_ns(op);
    return 0;
  };

  // The trace's first stream is the default stream; others get streams of their own,
  // released from the resource and destroyed on every way out.
  struct stream_set {
    platform& p;
    memory_resource& resource;
    std::vector<stream_handle> handles;
    ~stream_set() {
      for (std::size_t i = 1; i < handles.size(); ++i) {
        if (handles[i].value == 0) continue;
        try {
          resource.release_stream(handles[i]);
        } catch (...) {
          // Destruction must not throw; the stream is still destroyed below.
        }
        (void)p.stream_destroy(handles[i]);
      }
    }
  } owned{p, resource, std::vector<stream_handle>(t.streams.size())};
  std::vector<stream_handle>& streams = owned.handles;
  for (std::size_t i = 1; i < streams.size(); ++i) {
    auto s = p.stream_create(resource.device());
    if (!s) throw_cuda_error(s.error(), "replay_trace: stream");
    streams[i] = s.value();
  }
  std::array<std::uint64_t, platform_op_count> calls_before{};
  for (std::size_t i = 0; i < platform_op_count; ++i)
    calls_before[i] = p.calls_made(static_cast<platform_op>(i));
  std::array<std::uint64_t, platform_op_count> ns_before{};
  for (std::size_t i = 0; i < platform_op_count; ++i) ns_before[i] = op_ns(static_cast<platform_op>(i));

  // The GPU behind the CPU (sim): events stay incomplete between catch-ups, and all
  // complete again however the replay ends.
  struct lag_model {
    sim_platform* sim;
    explicit lag_model(sim_platform* s) : sim(s) {
      if (sim != nullptr) sim->hold_events(true);
    }
    ~lag_model() {
      if (sim == nullptr) return;
      sim->complete_events();
      sim->hold_events(false);
    }
  } lag{options.gpu_lag > 0 ? sim : nullptr};
  auto* planner = dynamic_cast<step_planner*>(&resource);
  // The pool runs on the trace's clock while it is replayed, and on its own again after.
  trace_clock clock(p, t, planner != nullptr ? &planner->pool() : dynamic_cast<pool_base*>(&resource));
  std::vector<void*> ptrs(t.allocs, nullptr);
  const std::size_t sample_every = std::max<std::size_t>(1, t.events.size() / 2000);
  std::size_t live = 0;
  std::array<std::uint64_t, platform_op_count> calls_at_pass{};
  for (int pass = 0; pass < options.passes && !r.oom; ++pass) {
    for (std::size_t i = 0; i < platform_op_count; ++i)
      calls_at_pass[i] = p.calls_made(static_cast<platform_op>(i));
    const std::uint64_t allocs_before = r.allocs;
    const auto start = std::chrono::steady_clock::now();
    std::uint64_t index = 0;
    auto next_step = options.step_starts.begin();
    for (const trace_event& e : t.events) {
      clock.at(pass, index);
      if (planner != nullptr && next_step != options.step_starts.end() && *next_step == index) {
        planner->mark_step();
        ++next_step;
        ++r.steps_marked;
      }
      if (e.op == trace_event::kind::alloc) {
        if (e.size > resource.device_total_bytes()) {  // the resource refuses it as a bad argument
          r.oom = true;
          r.oom_event = index;
          r.oom_message = oversized_request(t, r.allocator, index, e.size, resource.device_total_bytes());
          break;
        }
        try {
          void* ptr = resource.allocate(e.size, default_alignment, streams[e.stream]);
          ptrs[e.id] = ptr;
          if (options.touch) static_cast<volatile char*>(ptr)[0] = 1;
        } catch (const out_of_memory& oom) {
          r.oom = true;
          r.oom_event = index;
          r.oom_message = oom.what();
          break;
        }
        live += e.size;
        ++r.allocs;
      } else {
        resource.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
        live -= e.size;
        ++r.frees;
      }
      if (lag.sim != nullptr && (index + 1) % options.gpu_lag == 0) lag.sim->complete_events();
      if (pass == 0 && index % sample_every == 0) {
        r.live_samples.emplace_back(index, live);
        r.reserved_samples.emplace_back(index, resource.stats().reserved_bytes);
      }
      ++index;
    }
    const double ns = std::chrono::duration<double, std::nano>(
                          std::chrono::steady_clock::now() - start).count();
    const double per_event = index == 0 ? 0 : ns / static_cast<double>(index);
    if (pass == 0) r.ns_per_event_cold = per_event;
    r.ns_per_event_warm = per_event;
    if (options.passes > 1) r.last_pass_allocs = r.allocs - allocs_before;
    // Allocations still live at the end of a pass are freed before the next one.
    for (const trace_event& e : t.events) {
      if (e.op == trace_event::kind::alloc && ptrs[e.id] != nullptr) {
        resource.deallocate(ptrs[e.id], e.size, streams[e.stream]);
        ptrs[e.id] = nullptr;
        live -= e.size;
      }
    }
  }
  if (planner != nullptr) {
    const step_planner_counts c = planner->counts();
    r.plans_built = c.plans_built;
    r.planned_allocations = c.planned_allocations;
    r.steps_left_plan = c.steps_left_plan;
    r.steps_rejoined = c.steps_rejoined;
    r.regions_handed_over = c.regions_handed_over;
  }
  const resource_stats s = resource.stats();
  r.peak_reserved_bytes = s.peak_reserved_bytes;
  r.fragmentation = r.peak_live_bytes == 0
                        ? 0
                        : static_cast<double>(r.peak_reserved_bytes) /
                              static_cast<double>(r.peak_live_bytes);
  for (std::size_t i = 0; i < platform_op_count; ++i) {
    const auto op = static_cast<platform_op>(i);
    const std::uint64_t n = p.calls_made(op) - calls_before[i];
    if (n == 0) continue;
    const auto name = std::string(platform_op_name(op));
    if (options.passes > 1) {
      const std::uint64_t last = p.calls_made(op) - calls_at_pass[i];
      r.last_pass_driver_calls[name] = last;
      if (moves_memory(op)) r.last_pass_memory_calls += last;
    }
    r.driver_calls[name] = n;
    const double ns = static_cast<double>(op_ns(op) - ns_before[i]);
    r.driver_call_ns[name] = ns;
    r.driver_ns += ns;
  }
  return r;
}

}  // namespace gpumem
