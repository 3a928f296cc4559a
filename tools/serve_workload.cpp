#include "serve_workload.hpp"

#include <charconv>
#include <cmath>
#include <limits>
#include <string_view>
#include <system_error>
#include <vector>

#include "gpumem/errors.hpp"
#include "gpumem/replay/input_file.hpp"
#include "gpumem/replay/text_lines.hpp"

namespace gpumem::cli {

namespace {

// Reads the requests of one file, line by line, naming the file and line in each refusal.
class workload_reader {
 public:
  explicit workload_reader(const std::string& path) : path_(path) {}

  void add_line(std::string_view text, std::size_t line) {
    line_ = line;
    std::vector<std::string_view> f = fields(text);
    if (f.empty() || f[0][0] == '#') return;
    serve_request r;
    r.arrival = arrival(f[0]);
    if (!out_.empty() && r.arrival < out_.back().arrival)
      bad("arrival " + std::string(f[0]) + " is before the previous request's (" +
          std::to_string(out_.back().arrival) + ")");
    if (f.size() < 2) bad("no output tokens");
    r.output = whole(f[1], "output tokens", 1, serve_max_output_tokens);
    if (f.size() < 3) bad("no samples");
    r.samples = whole(f[2], "samples", 1, serve_max_samples);
    if (f.size() < 4) bad("no prompt token");
    constexpr std::size_t most_tokens = std::numeric_limits<token_id>::max();
    for (std::size_t k = 3; k < f.size(); ++k)
      r.prompt.push_back(static_cast<token_id>(whole(f[k], "token", 0, most_tokens)));
    out_.push_back(std::move(r));
  }

  std::vector<serve_request> finish() && {
    if (out_.empty()) throw invalid_argument("serve-sim: workload " + path_ + " holds no request");
    return std::move(out_);
  }

 private:
  [[noreturn]] void bad(const std::string& why) const {
    throw invalid_argument("serve-sim: workload " + path_ + ":" + std::to_string(line_) + ": " + why);
  }

  // The fields of a line, split at spaces and tabs.
  static std::vector<std::string_view> fields(std::string_view text) {
    std::vector<std::string_view> f;
    std::size_t k = 0;
    while (k < text.size()) {
      const std::size_t start = text.find_first_not_of(" \t", k);
      if (start == std::string_view::npos) break;
      k = std::min(text.find_first_of(" \t", start), text.size());
      f.push_back(text.substr(start, k - start));
    }
    return f;
  }

  // Field `what` as a whole number in [low, high] (decimal digits only).
  std::size_t whole(std::string_view text, const char* what, std::size_t low, std::size_t high) const {
    std::uint64_t v = 0;
    const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || p != text.data() + text.size() || v < low || v > high)
      bad(std::string(what) + " '" + std::string(text) + "' is not a whole number in " +
          std::to_string(low) + ".." + std::to_string(high));
    return static_cast<std::size_t>(v);
  }

  double arrival(std::string_view text) const {
    double v = 0;
    const auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc{} || p != text.data() + text.size() || !std::isfinite(v) || v < 0 ||
        v > serve_max_arrival_seconds)
      bad("arrival '" + std::string(text) + "' is not a number of seconds in 0.." +
          std::to_string(static_cast<long long>(serve_max_arrival_seconds)));
    return v;
  }

  const std::string& path_;
  std::size_t line_ = 0;
  std::vector<serve_request> out_;
};

}  // namespace

std::vector<serve_request> read_serve_workload(const std::string& path, std::uint64_t max_bytes) {
  input_file in(path, "serve-sim: workload", max_bytes);
  text_lines lines("serve-sim: workload " + path, serve_max_line);
  workload_reader reader(path);
  auto add = [&](std::string_view line, std::size_t line_no) { reader.add_line(line, line_no); };
  std::vector<char> buf(64 * 1024);
  while (const std::size_t n = in.read(buf.data(), buf.size(), lines.lines() + 1))
    lines.feed(std::string_view(buf.data(), n), add);
  lines.finish(add);
  return std::move(reader).finish();
}

}  // namespace gpumem::cli
