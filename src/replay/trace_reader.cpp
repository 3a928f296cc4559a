// Reading traces: a file's bytes as they stream (zlib, or plain), the CSV grammars of
// PyTorch and RMM logs, and a snapshot pickle handed to torch_snapshot (trace.hpp).
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

}  // namespace gpumem
