// A tiny command-line parser for the gpumem tool's subcommands (no third-party CLI
// library: the GPU machine has none).
//
//   flags       --json                     present or not; "--json=x" is an error
//   options     --device sim, --device=sim  one value each; repeated -> every value kept,
//                                           value() returns the last
//   positionals anything else; "--" ends options, "-" alone is a positional
//   -h, --help  always accepted; parse() records it and the command prints help()
//
// Invariants:
//  - parse() either returns parsed_args in which every option named was declared, every
//    option value was supplied and is one of its choices (when choices are declared), and
//    the positional count lies within the declared bounds; or it throws usage_error, whose
//    message names the offending argument. (With --help present, the other checks are
//    skipped so that "--help" works alongside a half-typed command line.)
//  - help() lists every declared flag, option and positional, in declaration order.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace gpumem::cli {

// Bad command line. The top level prints it with the command's usage and exits 2.
class usage_error : public std::runtime_error {
 public:
  explicit usage_error(const std::string& message, std::string usage = {})
      : std::runtime_error(message), usage_(std::move(usage)) {}
  // The command's usage line(s) ("usage: gpumem info [--json] ..."), or "" if unknown.
  const std::string& usage() const noexcept { return usage_; }

 private:
  std::string usage_;
};

class parsed_args {
 public:
  // Was the flag or option given at least once?
  bool has(std::string_view name) const;
  // The last value given for an option, or its declared default, or nullopt.
  std::optional<std::string> value(std::string_view name) const;
  // value(name), or `fallback` when absent.
  std::string value_or(std::string_view name, std::string fallback) const;
  // Every value given for an option, in command-line order.
  std::vector<std::string> values(std::string_view name) const;
  // The option's value as an integer in [min, max]; nullopt when absent (and no default).
  // Throws usage_error for text that is not a whole decimal integer in range.
  std::optional<std::int64_t> integer(
      std::string_view name, std::int64_t min = std::numeric_limits<std::int64_t>::min(),
      std::int64_t max = std::numeric_limits<std::int64_t>::max()) const;

  // The option's value as a finite number in [min, max] (above `min` alone when
  // `min_exclusive`); nullopt when absent (and no default). Throws usage_error naming the
  // option and the bound passed, or "expected a number".
  std::optional<double> number(std::string_view name, double min, double max,
                               bool min_exclusive = false) const;
  // The option's value as a byte count in gpumem's size grammar (512, 64K, 2M, 1.5G, 1T) of
  // at least `min`; nullopt when absent (and no default). Throws usage_error naming the
  // option, and `why_min` (what the least is) when below it.
  std::optional<std::size_t> bytes(std::string_view name, std::size_t min = 0,
                                   std::string_view why_min = {}) const;

  const std::vector<std::string>& positionals() const noexcept { return positionals_; }
  bool help_requested() const noexcept { return help_; }

 private:
  friend class arg_parser;
  std::string command_;
  std::string usage_;
  std::map<std::string, std::vector<std::string>, std::less<>> given_;  // flags: empty list
  std::map<std::string, std::string, std::less<>> defaults_;
  std::vector<std::string> positionals_;
  bool help_ = false;
};

class arg_parser {
 public:
  // `command` is how the user types it ("gpumem info"); `summary` one line for help().
  arg_parser(std::string command, std::string summary);

  // Declarations; names are given without dashes ("json"). `short_name` 0 = none.
  arg_parser& flag(std::string name, std::string help, char short_name = 0);
  arg_parser& option(std::string name, std::string value_name, std::string help,
                     std::optional<std::string> default_value = std::nullopt,
                     std::vector<std::string> choices = {}, char short_name = 0);
  // Positionals in order; `max_count` > 1 (or -1 for unbounded) makes it variadic (last only).
  arg_parser& positional(std::string name, std::string help, bool required = true,
                         int max_count = 1);
  // Free text appended to help() (examples, environment variables).
  arg_parser& epilog(std::string text);

  // argv[0] is the command's own name and is skipped.
  parsed_args parse(int argc, const char* const* argv) const;
  parsed_args parse(const std::vector<std::string>& args) const;  // without argv[0]

  std::string usage() const;  // "usage: gpumem info [--json] [--device auto|sim|cuda] ..."
  std::string help() const;   // usage, summary, and a table of arguments
  const std::string& command() const noexcept { return command_; }

 private:
  struct option_spec {
    std::string name;
    char short_name = 0;
    bool takes_value = false;
    std::string value_name;
    std::string help;
    std::optional<std::string> default_value;
    std::vector<std::string> choices;
  };
  struct positional_spec {
    std::string name;
    std::string help;
    bool required = true;
    int max_count = 1;
  };

  parsed_args parse_checked(const std::vector<std::string>& args) const;
  // parse_checked's steps: one option as spelled at args[i] (moving i past its value when
  // it takes the next argument), and the count of positionals against the declared ones.
  static void record_option(parsed_args& out, const option_spec& spec, std::string_view spelled,
                            std::optional<std::string> inline_value,
                            const std::vector<std::string>& args, std::size_t& i);
  void check_positional_count(const parsed_args& out) const;
  const option_spec* find_long(std::string_view name) const;
  const option_spec* find_short(char name) const;
  std::string suggestion(std::string_view unknown) const;
  void declare(option_spec spec);

  std::string command_;
  std::string summary_;
  std::string epilog_;
  std::vector<option_spec> options_;
  std::vector<positional_spec> positionals_;
};

}  // namespace gpumem::cli
