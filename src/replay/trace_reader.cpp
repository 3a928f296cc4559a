// Reading traces: a file's bytes as they stream (input_file), cut into lines by the shared
// text rule (text_lines), the CSV grammars of PyTorch and RMM logs, and a snapshot pickle
// handed to torch_snapshot (trace.hpp).
#include "gpumem/replay/trace.hpp"
#include "gpumem/replay/input_file.hpp"
#include "gpumem/replay/text_lines.hpp"
#include "gpumem/replay/torch_snapshot.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"

namespace gpumem {

namespace {

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

// A whole number of field `name` (decimal, or hexadecimal after 0x), in 0..2^64-1.
std::uint64_t parse_u64(std::string_view f, std::string_view name, const std::string& where) {
  std::string_view digits = f;
  int base = 10;
  if (digits.size() > 2 && digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X')) {
    digits.remove_prefix(2);
    base = 16;
  }
  std::uint64_t v = 0;
  auto [p, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), v, base);
  if (ec != std::errc{} || p != digits.data() + digits.size() || digits.empty())
    throw invalid_argument("trace: " + where + ": " + std::string(name) + " '" + std::string(f) +
                           "' is not a whole number in 0..18446744073709551615 (decimal, or "
                           "hexadecimal after 0x)");
  return v;
}

// The latest time an event may have, in nanoseconds (times are kept as nanoseconds in 63
// bits: 106,751 days).
constexpr std::uint64_t max_time_ns = std::uint64_t{1} << 63;

// An event's time in nanoseconds: PyTorch's time_us (an integer of microseconds); RMM's
// Time, h:m:s with a fraction after '.' or ':'. Throws naming field `name`, the value and
// the range when it is neither.
std::uint64_t parse_time_ns(std::string_view f, std::string_view name, bool rmm,
                            const std::string& where) {
  auto number = [](std::string_view d, std::uint64_t& v) {
    auto [p, ec] = std::from_chars(d.data(), d.data() + d.size(), v);
    return ec == std::errc{} && p == d.data() + d.size() && !d.empty();
  };
  const std::string_view text = f;
  auto refuse = [&](const char* range) {
    throw invalid_argument("trace: " + where + ": " + std::string(name) + " '" + std::string(text) +
                           "' is not " + range);
  };
  if (!rmm) {
    std::uint64_t us = 0;
    if (!number(f, us) || us > max_time_ns / 1000)
      refuse("a whole number of microseconds in 0..9223372036854775");
    return us * 1000;
  }
  std::uint64_t part[3] = {};
  for (int i = 0; i < 3; ++i) {
    const std::size_t sep = i < 2 ? f.find(':') : f.find_first_of(".:");
    if (!number(f.substr(0, sep), part[i]) || (i > 0 && part[i] > 59) || part[0] > 2'000'000)
      refuse("a time H:MM:SS.fraction with H in 0..2000000");
    f = sep == std::string_view::npos ? std::string_view{} : f.substr(sep + 1);
  }
  std::uint64_t frac_ns = 0, scale = 100'000'000;
  for (char c : f.substr(0, 9)) {
    if (c < '0' || c > '9') refuse("a time H:MM:SS.fraction with H in 0..2000000");
    frac_ns += static_cast<std::uint64_t>(c - '0') * scale;
    scale /= 10;
  }
  return ((part[0] * 60 + part[1]) * 60 + part[2]) * 1'000'000'000 + frac_ns;
}

// The largest allocation a trace may name (far above any device).
constexpr std::uint64_t trace_max_size = std::uint64_t{1} << 48;

// Builds a trace from its lines, given in order (the grammar in trace.hpp).
class trace_builder {
 public:
  explicit trace_builder(const std::string& source) { t_.source = source; }

  bool has_header() const noexcept { return col_action_ >= 0; }

  // Line `line_no` (from 1), as text_lines gives it.
  void add_line(std::string_view line, std::size_t line_no) {
    if (line.empty()) return;
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
    const auto f = split(line);
    names_.assign(f.begin(), f.end());
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
    auto number = [&](int col) {
      return parse_u64(f[static_cast<std::size_t>(col)], names_[static_cast<std::size_t>(col)], where);
    };
    const std::uint64_t addr = number(col_addr_);
    const std::uint64_t size = number(col_size_);
    if (size > trace_max_size)
      throw invalid_argument("trace: " + where + ": " + names_[static_cast<std::size_t>(col_size_)] +
                             " '" + std::string(f[static_cast<std::size_t>(col_size_)]) +
                             "' is not a size in 0.." + std::to_string(trace_max_size) +
                             " (256 TiB)");
    const std::uint64_t stream =
        col_stream_ >= 0 && !f[static_cast<std::size_t>(col_stream_)].empty() ? number(col_stream_) : 0;
    // Times never go back (a multi-threaded RMM log may interleave them): each is at
    // least the one before.
    std::uint64_t time_ns = 0;
    if (all_timed_) {
      // A time missing or empty leaves the trace untimed; one present is checked.
      if (col_time_ >= 0 && static_cast<std::size_t>(col_time_) < f.size() &&
          !f[static_cast<std::size_t>(col_time_)].empty()) {
        const std::uint64_t ns =
            parse_time_ns(f[static_cast<std::size_t>(col_time_)],
                          names_[static_cast<std::size_t>(col_time_)], t_.format == "rmm", where);
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
      if (live_bytes_ > std::numeric_limits<std::size_t>::max() - size)
        throw invalid_argument("trace: " + where + ": the live bytes exceed 2^64");
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
  std::vector<std::string> names_;  // the header's fields
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
  text_lines lines("trace: " + source, trace_max_line);
  auto add = [&](std::string_view line, std::size_t line_no) { b.add_line(line, line_no); };
  lines.feed(text, add);
  lines.finish(add);
  return std::move(b).finish();
}

trace load_trace(const std::string& path, const trace_read_limits& limits) {
  input_file in(path, "trace", limits.max_bytes);
  trace_builder b(path);
  text_lines lines("trace: " + path, trace_max_line);
  std::vector<char> buf(trace_header_window);
  // What the text is refused for, and whether the gzip stream it came from is corrupt.
  auto refuse = [&](const std::string& message) {
    if (const std::string corrupt = in.error_in_rest(); !corrupt.empty())
      throw invalid_argument(message + " (the gzip data is corrupt: " + corrupt + ")");
    throw invalid_argument(message);
  };
  auto add = [&](std::string_view line, std::size_t line_no) { b.add_line(line, line_no); };
  while (const std::size_t n = in.read(buf.data(), buf.size(), lines.lines() + 1)) {
    if (in.bytes_read() == n && looks_like_pickle(std::string(buf.data(), std::min<std::size_t>(n, 3)))) {
      // A PyTorch memory snapshot (torch.cuda.memory._dump_snapshot): its device trace.
      std::string all(buf.data(), n);
      while (const std::size_t more = in.read(buf.data(), buf.size())) all.append(buf.data(), more);
      return parse_trace(torch_snapshot_to_trace_csv(all, path, -1, limits.max_snapshot_memory,
                                                     limits.max_bytes),
                         path);
    }
    try {
      lines.feed(std::string_view(buf.data(), n), add);
    } catch (const invalid_argument& e) {
      refuse(e.what());
    }
    if (!b.has_header() && in.bytes_read() >= trace_header_window)
      refuse("trace: " + path + " is not a trace: no header line in its first " +
             format_bytes(trace_header_window) +
             " (expected 'action,addr,size,stream,time_us' (PyTorch) or "
             "'Thread,Time,Action,Pointer,Size,Stream' (RMM))");
  }
  try {
    lines.finish(add);
  } catch (const invalid_argument& e) {
    refuse(e.what());
  }
  return std::move(b).finish();
}

}  // namespace gpumem
