#include "args.hpp"

#include <algorithm>
#include <charconv>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <utility>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"
#include "gpumem/pool/pool_options.hpp"

namespace gpumem::cli {

namespace {

std::string join(const std::vector<std::string>& items, std::string_view separator) {
  std::string out;
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (i != 0) out += separator;
    out += items[i];
  }
  return out;
}

// Edit distance, for "did you mean --json?".
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

bool looks_like_number(std::string_view arg) {
  return arg.size() >= 2 && arg[0] == '-' &&
         ((arg[1] >= '0' && arg[1] <= '9') || arg[1] == '.');
}

}  // namespace

// --- parsed_args ---------------------------------------------------------------------------

bool parsed_args::has(std::string_view name) const { return given_.find(name) != given_.end(); }

std::optional<std::string> parsed_args::value(std::string_view name) const {
  if (auto it = given_.find(name); it != given_.end() && !it->second.empty())
    return it->second.back();
  if (auto it = defaults_.find(name); it != defaults_.end()) return it->second;
  return std::nullopt;
}

std::string parsed_args::value_or(std::string_view name, std::string fallback) const {
  auto v = value(name);
  return v ? *v : std::move(fallback);
}

std::vector<std::string> parsed_args::values(std::string_view name) const {
  if (auto it = given_.find(name); it != given_.end()) return it->second;
  return {};
}

std::optional<std::int64_t> parsed_args::integer(std::string_view name, std::int64_t min,
                                                 std::int64_t max) const {
  auto text = value(name);
  if (!text) return std::nullopt;
  std::int64_t parsed = 0;
  const char* first = text->data();
  const char* last = first + text->size();
  if (first != last && *first == '+') ++first;
  auto [end, ec] = std::from_chars(first, last, parsed);
  const std::string prefix = "invalid value '" + *text + "' for --" + std::string(name) + ": ";
  if (first == last || ec == std::errc::invalid_argument || end != last)
    throw usage_error(prefix + "expected a whole number", usage_);
  const bool has_min = min != std::numeric_limits<std::int64_t>::min();
  const bool has_max = max != std::numeric_limits<std::int64_t>::max();
  if (ec == std::errc::result_out_of_range || parsed < min || parsed > max) {
    if (has_min && has_max)
      throw usage_error(prefix + "must be between " + std::to_string(min) + " and " +
                            std::to_string(max),
                        usage_);
    if (has_min) throw usage_error(prefix + "must be at least " + std::to_string(min), usage_);
    if (has_max) throw usage_error(prefix + "must be at most " + std::to_string(max), usage_);
    throw usage_error(prefix + "out of range", usage_);
  }
  return parsed;
}

std::optional<double> parsed_args::number(std::string_view name, double min, double max,
                                          bool min_exclusive) const {
  auto text = value(name);
  if (!text) return std::nullopt;
  const std::string prefix = "invalid value '" + *text + "' for --" + std::string(name) + ": ";
  auto shown = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  // strtod gives +-HUGE_VAL for a value too large for a double (and infinity for "inf"),
  // which the bounds below then name; it skips leading spaces, which are refused here.
  char* end = nullptr;
  const double parsed = text->empty() || std::isspace(static_cast<unsigned char>(text->front()))
                            ? std::nan("")
                            : std::strtod(text->c_str(), &end);
  if (std::isnan(parsed) || end != text->c_str() + text->size())
    throw usage_error(prefix + "expected a number", usage_);
  if (parsed > max) throw usage_error(prefix + "must be at most " + shown(max), usage_);
  if (min_exclusive ? parsed <= min : parsed < min)
    throw usage_error(prefix + (min_exclusive ? "must be above " : "must be at least ") + shown(min),
                      usage_);
  return parsed;
}

std::optional<std::size_t> parsed_args::bytes(std::string_view name, std::size_t min,
                                              std::string_view why_min) const {
  auto text = value(name);
  if (!text) return std::nullopt;
  const std::string prefix = "invalid value '" + *text + "' for --" + std::string(name) + ": ";
  std::size_t parsed = 0;
  try {
    parsed = parse_bytes(*text);
  } catch (const gpumem::invalid_argument&) {
    throw usage_error(prefix + "expected a size in bytes below 16 EiB: a number with an optional "
                               "K, M, G or T suffix, such as 512, 64K, 2M or 1.5G", usage_);
  }
  if (parsed < min)
    throw usage_error(prefix + "must be at least " + format_bytes(min) +
                          (why_min.empty() ? "" : " (" + std::string(why_min) + ")"),
                      usage_);
  return parsed;
}

// --- arg_parser ----------------------------------------------------------------------------

arg_parser::arg_parser(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

void arg_parser::declare(option_spec spec) {
  if (spec.name.empty() || spec.name == "help" || find_long(spec.name) != nullptr ||
      (spec.short_name != 0 && (spec.short_name == 'h' || find_short(spec.short_name))))
    throw std::logic_error("arg_parser: option '" + spec.name + "' declared twice or reserved");
  options_.push_back(std::move(spec));
}

arg_parser& arg_parser::flag(std::string name, std::string help, char short_name) {
  option_spec spec;
  spec.name = std::move(name);
  spec.short_name = short_name;
  spec.help = std::move(help);
  declare(std::move(spec));
  return *this;
}

arg_parser& arg_parser::option(std::string name, std::string value_name, std::string help,
                               std::optional<std::string> default_value,
                               std::vector<std::string> choices, char short_name) {
  option_spec spec;
  spec.name = std::move(name);
  spec.short_name = short_name;
  spec.takes_value = true;
  spec.value_name = value_name.empty() ? (choices.empty() ? "VALUE" : join(choices, "|"))
                                       : std::move(value_name);
  spec.help = std::move(help);
  spec.default_value = std::move(default_value);
  spec.choices = std::move(choices);
  declare(std::move(spec));
  return *this;
}

arg_parser& arg_parser::positional(std::string name, std::string help, bool required,
                                   int max_count) {
  if (!positionals_.empty() && positionals_.back().max_count != 1)
    throw std::logic_error("arg_parser: only the last positional may be variadic");
  if (required && !positionals_.empty() && !positionals_.back().required)
    throw std::logic_error("arg_parser: a required positional cannot follow an optional one");
  positionals_.push_back({std::move(name), std::move(help), required, max_count});
  return *this;
}

arg_parser& arg_parser::epilog(std::string text) {
  epilog_ = std::move(text);
  return *this;
}

const arg_parser::option_spec* arg_parser::find_long(std::string_view name) const {
  for (const auto& o : options_)
    if (o.name == name) return &o;
  return nullptr;
}

const arg_parser::option_spec* arg_parser::find_short(char name) const {
  for (const auto& o : options_)
    if (o.short_name != 0 && o.short_name == name) return &o;
  return nullptr;
}

std::string arg_parser::suggestion(std::string_view unknown) const {
  std::string best;
  std::size_t best_distance = 3;  // suggest only close misspellings
  auto consider = [&](const std::string& name) {
    std::size_t d = edit_distance(unknown, name);
    if (name.rfind(unknown, 0) == 0 && !unknown.empty()) d = std::min<std::size_t>(d, 1);
    if (d < best_distance) {
      best_distance = d;
      best = name;
    }
  };
  for (const auto& o : options_) consider(o.name);
  consider("help");
  return best.empty() ? "" : " (did you mean --" + best + "?)";
}

parsed_args arg_parser::parse(int argc, const char* const* argv) const {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  return parse(args);
}

parsed_args arg_parser::parse(const std::vector<std::string>& args) const {
  try {
    return parse_checked(args);
  } catch (const usage_error& e) {
    throw usage_error(e.what(), usage());
  }
}

parsed_args arg_parser::parse_checked(const std::vector<std::string>& args) const {
  parsed_args out;
  out.command_ = command_;
  out.usage_ = usage();
  for (const auto& o : options_)
    if (o.default_value) out.defaults_[o.name] = *o.default_value;

  // --help wins over every other problem on the line.
  for (const auto& a : args) {
    if (a == "--") break;
    if (a == "--help" || a == "-h") {
      out.help_ = true;
      return out;
    }
  }

  bool only_positionals = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (only_positionals || a == "-" || a.empty() || a[0] != '-' || looks_like_number(a)) {
      out.positionals_.push_back(a);
      continue;
    }
    if (a == "--") {
      only_positionals = true;
      continue;
    }
    if (a.rfind("--", 0) == 0) {
      const std::size_t eq = a.find('=');
      const std::string name = a.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
      std::optional<std::string> inline_value;
      if (eq != std::string::npos) inline_value = a.substr(eq + 1);
      const option_spec* spec = find_long(name);
      if (spec == nullptr)
        throw usage_error("unknown option '--" + name + "'" + suggestion(name));
      record_option(out, *spec, "--" + name, std::move(inline_value), args, i);
      continue;
    }
    // Short option: "-x" or "-x value" (one letter; no bundling).
    const option_spec* spec = a.size() == 2 ? find_short(a[1]) : nullptr;
    if (spec == nullptr) throw usage_error("unknown option '" + a + "'");
    record_option(out, *spec, a, std::nullopt, args, i);
  }

  check_positional_count(out);
  return out;
}

void arg_parser::record_option(parsed_args& out, const option_spec& spec, std::string_view spelled,
                               std::optional<std::string> inline_value,
                               const std::vector<std::string>& args, std::size_t& i) {
  if (!spec.takes_value) {
    if (inline_value)
      throw usage_error("option " + std::string(spelled) + " takes no value (got '" +
                        std::string(spelled) + "=" + *inline_value + "')");
    out.given_[spec.name];  // present, no values
    return;
  }
  std::string v;
  if (inline_value) {
    v = std::move(*inline_value);
  } else {
    if (i + 1 >= args.size())
      throw usage_error("option " + std::string(spelled) + " needs a value (" +
                        std::string(spelled) + " " + spec.value_name + ")");
    const std::string& next = args[i + 1];
    if (next.size() > 2 && next.rfind("--", 0) == 0)
      throw usage_error("option " + std::string(spelled) + " needs a value (" +
                        std::string(spelled) + " " + spec.value_name + "), got option '" +
                        next + "'");
    v = next;
    ++i;
  }
  if (!spec.choices.empty() &&
      std::find(spec.choices.begin(), spec.choices.end(), v) == spec.choices.end())
    throw usage_error("invalid value '" + v + "' for --" + spec.name +
                      ": expected one of " + join(spec.choices, ", "));
  out.given_[spec.name].push_back(std::move(v));
}

void arg_parser::check_positional_count(const parsed_args& out) const {
  std::size_t min_count = 0;
  std::size_t max_count = 0;
  bool unbounded = false;
  for (const auto& p : positionals_) {
    if (p.required) ++min_count;
    if (p.max_count < 0)
      unbounded = true;
    else
      max_count += static_cast<std::size_t>(p.max_count);
  }
  if (!unbounded && out.positionals_.size() > max_count) {
    const std::string& extra = out.positionals_[max_count];
    throw usage_error("unexpected argument '" + extra + "'" +
                      (max_count == 0 ? " (" + command_ + " takes no positional arguments)"
                                      : std::string{}));
  }
  if (out.positionals_.size() < min_count) {
    std::size_t required_seen = 0;
    for (const auto& p : positionals_) {
      if (!p.required) break;
      if (required_seen++ == out.positionals_.size())
        throw usage_error("missing required argument <" + p.name + ">");
    }
  }
}

std::string arg_parser::usage() const {
  std::vector<std::string> parts;
  for (const auto& o : options_)
    parts.push_back("[--" + o.name + (o.takes_value ? " " + o.value_name : "") + "]");
  for (const auto& p : positionals_) {
    std::string text = "<" + p.name + ">";
    if (p.max_count != 1) text += "...";
    parts.push_back(p.required ? text : "[" + text + "]");
  }
  // Wrap at 80 columns, continuation lines aligned after the command.
  const std::string lead = "usage: " + command_;
  std::string out = lead;
  std::size_t column = out.size();
  for (const auto& part : parts) {
    if (column + 1 + part.size() > 80 && column > lead.size()) {
      out += "\n" + std::string(lead.size(), ' ');
      column = lead.size();
    }
    out += " " + part;
    column += 1 + part.size();
  }
  return out;
}

std::string arg_parser::help() const {
  std::vector<std::pair<std::string, std::string>> option_rows;
  for (const auto& o : options_) {
    std::string left = o.short_name != 0 ? std::string("-") + o.short_name + ", " : "    ";
    left += "--" + o.name;
    if (o.takes_value) left += " " + o.value_name;
    std::string right = o.help;
    if (o.default_value) right += " (default: " + *o.default_value + ")";
    option_rows.emplace_back(std::move(left), std::move(right));
  }
  option_rows.emplace_back("-h, --help", "show this help and exit");
  std::vector<std::pair<std::string, std::string>> positional_rows;
  for (const auto& p : positionals_)
    positional_rows.emplace_back("<" + p.name + ">" + (p.max_count != 1 ? "..." : ""),
                                 p.help + (p.required ? "" : " (optional)"));

  std::size_t width = 0;
  for (const auto& r : option_rows) width = std::max(width, r.first.size());
  for (const auto& r : positional_rows) width = std::max(width, r.first.size());

  std::ostringstream out;
  out << usage() << "\n\n" << summary_ << "\n";
  auto table = [&](const char* title, const auto& rows) {
    if (rows.empty()) return;
    out << "\n" << title << ":\n";
    // Help text wrapped at 80 columns, continuation lines aligned with the text column.
    const std::size_t indent = 2 + width + 2;
    const std::size_t room = indent + 30 <= 80 ? 80 - indent : 30;
    for (const auto& [left, right] : rows) {
      out << "  " << left << std::string(width - left.size() + 2, ' ');
      std::size_t column = 0;
      std::istringstream words(right);
      std::string word;
      while (words >> word) {
        if (column != 0 && column + 1 + word.size() > room) {
          out << "\n" << std::string(indent, ' ');
          column = 0;
        } else if (column != 0) {
          out << ' ';
          ++column;
        }
        out << word;
        column += word.size();
      }
      out << "\n";
    }
  };
  table("arguments", positional_rows);
  table("options", option_rows);
  if (!epilog_.empty()) out << "\n" << epilog_ << (epilog_.back() == '\n' ? "" : "\n");
  return out.str();
}

}  // namespace gpumem::cli
