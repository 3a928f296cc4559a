#include "serve_workload.hpp"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>

#include "gpumem/errors.hpp"

namespace gpumem::cli {

namespace {

[[noreturn]] void bad_line(const std::string& path, std::size_t line, const std::string& why) {
  throw invalid_argument("serve-sim: workload " + path + " line " + std::to_string(line) +
                         ": " + why);
}

// The next whitespace-separated field as an unsigned integer in [low, high].
std::size_t field(std::istringstream& in, const char* what, std::size_t low, std::size_t high,
                  const std::string& path, std::size_t line) {
  std::string text;
  if (!(in >> text)) bad_line(path, line, std::string("no ") + what);
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 10);
  if (text[0] == '-' || *end != '\0' || errno == ERANGE || v < low || v > high)
    bad_line(path, line, std::string(what) + " '" + text + "' is not a whole number in " +
                             std::to_string(low) + ".." + std::to_string(high));
  return static_cast<std::size_t>(v);
}

}  // namespace

std::vector<serve_request> read_serve_workload(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw invalid_argument("serve-sim: cannot read workload " + path);
  std::vector<serve_request> out;
  std::string text;
  std::size_t line = 0;
  constexpr std::size_t most_tokens = std::numeric_limits<token_id>::max();
  while (std::getline(file, text)) {
    ++line;
    const auto first = text.find_first_not_of(" \t\r");
    if (first == std::string::npos || text[first] == '#') continue;
    std::istringstream in(text);
    serve_request r;
    std::string arrival;
    in >> arrival;
    char* end = nullptr;
    r.arrival = std::strtod(arrival.c_str(), &end);
    if (*end != '\0' || !std::isfinite(r.arrival) || r.arrival < 0)
      bad_line(path, line, "arrival '" + arrival + "' is not a finite number of seconds >= 0");
    if (!out.empty() && r.arrival < out.back().arrival)
      bad_line(path, line, "arrival " + arrival + " is before the previous request's");
    r.output = field(in, "output tokens", 1, std::size_t{1} << 32, path, line);
    r.samples = field(in, "samples", 1, 1024, path, line);
    std::string token;
    while (in >> token) {
      std::istringstream one(token);
      r.prompt.push_back(static_cast<token_id>(field(one, "token", 0, most_tokens, path, line)));
    }
    if (r.prompt.empty()) bad_line(path, line, "no prompt token");
    out.push_back(std::move(r));
  }
  if (file.bad()) throw invalid_argument("serve-sim: cannot read workload " + path);
  if (out.empty()) throw invalid_argument("serve-sim: workload " + path + " holds no request");
  return out;
}

}  // namespace gpumem::cli
