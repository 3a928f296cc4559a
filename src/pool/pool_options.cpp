#include "gpumem/pool/pool_options.hpp"

#include <cmath>
#include <cstdlib>
#include <sstream>

#include "gpumem/errors.hpp"
#include "gpumem/pool/option_table.hpp"

namespace gpumem {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

double parse_number(std::string_view text, std::string_view key) {
  const std::string str(text);
  char* end = nullptr;
  const double v = std::strtod(str.c_str(), &end);
  if (str.empty() || end != str.c_str() + str.size() || !std::isfinite(v) || v < 0)
    throw invalid_argument("config: value '" + str + "' of '" + std::string(key) +
                           "' is not a non-negative number");
  return v;
}

}  // namespace

std::size_t parse_bytes(std::string_view text) {
  text = trim(text);
  double scale = 1;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K': case 'k': scale = 1024.0; break;
      case 'M': case 'm': scale = 1024.0 * 1024; break;
      case 'G': case 'g': scale = 1024.0 * 1024 * 1024; break;
      case 'T': case 't': scale = 1024.0 * 1024 * 1024 * 1024; break;
      default: break;
    }
    if (scale != 1) text.remove_suffix(1);
  }
  const double v = parse_number(text, "size") * scale;
  if (v > 1.8e19) throw invalid_argument("config: size '" + std::string(text) + "' is too large");
  return static_cast<std::size_t>(v);
}

void for_each_config_item(
    std::string_view config,
    const std::function<void(std::string_view key, std::string_view value, std::string_view item)>& fn) {
  while (!config.empty()) {
    const auto comma = config.find(',');
    const std::string_view item = trim(config.substr(0, comma));
    config = comma == std::string_view::npos ? std::string_view{} : config.substr(comma + 1);
    if (item.empty()) continue;
    const auto colon = item.find(':');
    if (colon == std::string_view::npos)
      throw invalid_argument("config: '" + std::string(item) + "' is not key:value");
    fn(trim(item.substr(0, colon)), trim(item.substr(colon + 1)), item);
  }
}

pool_options pool_options::parse(std::string_view config) {
  pool_options o;
  for_each_config_item(config, [&](std::string_view key, std::string_view value, std::string_view) {
    try {
      apply(o, key, value);
    } catch (const invalid_argument& e) {
      if (std::string(e.what()).find("'" + std::string(key) + "'") != std::string::npos) throw;
      throw invalid_argument(std::string(e.what()) + " (in '" + std::string(key) + "')");
    }
  });
  return o;
}

// One branch per key of the option table (option_table.cpp): over 80 lines.
void pool_options::apply(pool_options& o, std::string_view key, std::string_view value) {
  {
    if (key == "reserve") {
      o.reserve_bytes = parse_bytes(value);
    } else if (key == "reserve_fraction") {
      o.reserve_fraction = parse_number(value, key);
      if (o.reserve_fraction > 1.0)
        throw invalid_argument("config: reserve_fraction must be in [0, 1]");
    } else if (key == "limit") {
      o.limit_bytes = parse_bytes(value);
    } else if (key == "release_threshold") {
      o.release_threshold = value == "never" ? std::numeric_limits<std::size_t>::max()
                                             : parse_bytes(value);
    } else if (key == "small_threshold") {
      o.small_threshold = parse_bytes(value);
    } else if (key == "cross_stream") {
      if (value == "wait")
        o.cross_stream = cross_stream_policy::wait;
      else if (value == "event")
        o.cross_stream = cross_stream_policy::event;
      else if (value == "wait_before_growth")
        o.cross_stream = cross_stream_policy::wait_before_growth;
      else
        throw invalid_argument(
            "config: cross_stream must be 'event', 'wait' or 'wait_before_growth', not '" +
            std::string(value) + "'");
    } else if (key == "round_large") {
      o.round_large = parse_bytes(value);
      if (o.round_large != 0 && (o.round_large & (o.round_large - 1)) != 0)
        throw invalid_argument("config: round_large must be 0 or a power of two, not '" +
                               std::string(value) + "'");
    } else if (key == "small_classes") {
      const double v = parse_number(value, key);
      const auto n = v <= 64 ? static_cast<unsigned>(v) : 65u;  // no cast of a huge value
      if (v != static_cast<double>(n) || !valid_small_classes(n))
        throw invalid_argument("config: small_classes must be 0 or a power of two up to 64, not '" +
                               std::string(value) + "'");
      o.small_classes = n;
    } else if (key == "small_cache") {
      o.small_cache = parse_bytes(value);
    } else if (key == "map_worker") {
      if (value == "auto")
        o.map_worker = map_worker_mode::automatic;
      else if (value == "on" || value == "true" || value == "1")
        o.map_worker = map_worker_mode::on;
      else if (value == "off" || value == "false" || value == "0")
        o.map_worker = map_worker_mode::off;
      else
        throw invalid_argument("config: map_worker must be auto, on or off, not '" +
                               std::string(value) + "'");
    } else if (key == "footprint") {
      if (value == "fast")
        o.footprint = footprint_mode::fast;
      else if (value == "tight")
        o.footprint = footprint_mode::tight;
      else
        throw invalid_argument("config: footprint must be fast or tight, not '" +
                               std::string(value) + "'");
    } else if (key == "growth_slack") {
      o.growth_slack = parse_number(value, key);
      if (!(o.growth_slack >= 0.0 && o.growth_slack <= 1.0))
        throw invalid_argument("config: growth_slack must be a fraction in [0, 1], not '" +
                               std::string(value) + "'");
    } else if (key == "soft_budget") {
      o.soft_budget = parse_number(value, key);
      if (!(o.soft_budget >= 0.0 && o.soft_budget <= 1.0))
        throw invalid_argument("config: soft_budget must be a fraction in [0, 1], not '" +
                               std::string(value) + "'");
    } else if (key == "remap_budget") {
      o.remap_budget = parse_number(value, key);
      if (!(o.remap_budget >= 0.0 && o.remap_budget <= 1.0))
        throw invalid_argument("config: remap_budget must be a fraction in [0, 1], not '" +
                               std::string(value) + "'");
    } else if (key == "va_reserve") {
      o.va_reserve_bytes = parse_bytes(value);
    } else if (key == "keep_free") {
      o.keep_free_bytes = parse_bytes(value);
    } else if (key == "huge_growth") {
      o.huge_growth_bytes = parse_bytes(value);
    } else if (key == "big_chunk") {
      const double n = parse_number(value, key);
      if (n != static_cast<double>(static_cast<std::size_t>(n)) || n > 4096)
        throw invalid_argument("config: big_chunk must be a whole number of pages up to 4096");
      o.big_chunk_pages = static_cast<std::size_t>(n);
    } else if (key == "scrub" || key == "guard" || key == "thread_cache" || key == "release_idle" ||
               key == "lifetime_hints" || key == "shareable") {
      bool on = false;
      if (value == "on" || value == "true" || value == "1")
        on = true;
      else if (!(value == "off" || value == "false" || value == "0"))
        throw invalid_argument("config: " + std::string(key) + " must be on or off, not '" +
                               std::string(value) + "'");
      (key == "scrub"          ? o.scrub
       : key == "guard"        ? o.guard
       : key == "shareable"    ? o.shareable
       : key == "thread_cache" ? o.thread_cache
       : key == "release_idle" ? o.release_idle
                               : o.lifetime_hints) = on;
    } else if (key == "peer_access") {
      o.peer_access = 0;
      o.peer_access_all = value == "all";
      if (o.peer_access_all || value == "none") return;
      // Devices joined by '+' (a comma would end the item).
      std::string_view rest = value;
      while (true) {
        const auto plus = rest.find('+');
        const std::string_view one = trim(rest.substr(0, plus));
        unsigned device = 0;
        bool digits = !one.empty() && one.size() <= 2;
        for (char c : one) digits = digits && c >= '0' && c <= '9';
        if (digits) for (char c : one) device = device * 10 + static_cast<unsigned>(c - '0');
        if (!digits || device >= 64)
          throw invalid_argument("config: peer_access must be none, all or device numbers "
                                 "(0 to 63) joined by '+', like 1+2, not '" +
                                 std::string(value) + "'");
        o.peer_access |= std::uint64_t{1} << device;
        if (plus == std::string_view::npos) break;
        rest = rest.substr(plus + 1);
      }
    } else if (const pool_option_info* row = find_pool_option(key);
               row != nullptr && row->scope == option_scope::pool_create) {
      throw invalid_argument("config: '" + std::string(key) +
                             "' is a key of gpumem_pool_create (the C API, Python and the "
                             "PyTorch plug-in), not a pool option");
    } else {
      throw invalid_argument("config: unknown key '" + std::string(key) + "' (known: " +
                             pool_option_names() + ")");
    }
  }
}

pool_options pool_options::from_environment() {
  const char* env = std::getenv("GPUMEM_CONF");
  return env == nullptr ? pool_options{} : parse(env);
}

std::string pool_options::to_string() const {
  std::ostringstream out;
  out << "reserve:" << reserve_bytes << ",reserve_fraction:" << reserve_fraction
      << ",limit:" << limit_bytes << ",release_threshold:";
  if (release_threshold == std::numeric_limits<std::size_t>::max())
    out << "never";
  else
    out << release_threshold;
  out << ",small_threshold:" << small_threshold
      << ",cross_stream:"
      << (cross_stream == cross_stream_policy::wait                 ? "wait"
          : cross_stream == cross_stream_policy::wait_before_growth ? "wait_before_growth"
                                                                    : "event")
      << ",va_reserve:" << va_reserve_bytes << ",keep_free:" << keep_free_bytes
      << ",big_chunk:" << big_chunk_pages
      << ",huge_growth:" << huge_growth_bytes
      << ",scrub:" << (scrub ? "on" : "off") << ",guard:" << (guard ? "on" : "off")
      << ",shareable:" << (shareable ? "on" : "off")
      << ",thread_cache:" << (thread_cache ? "on" : "off") << ",round_large:" << round_large
      << ",small_classes:" << small_classes << ",small_cache:" << small_cache
      << ",map_worker:"
      << (map_worker == map_worker_mode::on    ? "on"
          : map_worker == map_worker_mode::off ? "off"
                                               : "auto")
      << ",footprint:" << (footprint == footprint_mode::tight ? "tight" : "fast")
      << ",growth_slack:" << growth_slack << ",remap_budget:" << remap_budget
      << ",soft_budget:" << soft_budget
      << ",release_idle:" << (release_idle ? "on" : "off")
      << ",lifetime_hints:" << (lifetime_hints ? "on" : "off") << ",peer_access:";
  if (peer_access_all) {
    out << "all";
  } else if (peer_access == 0) {
    out << "none";
  } else {
    const char* join = "";
    for (int d = 0; d < 64; ++d)
      if ((peer_access >> d & 1) != 0) {
        out << join << d;
        join = "+";
      }
  }
  return out.str();
}

}  // namespace gpumem
