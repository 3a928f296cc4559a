// The gpumem tool's argument parser (tools/args.hpp): flags, options in both spellings,
// choices, integers, positionals, --help, and the errors for bad command lines.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../tools/args.hpp"

namespace {

using gpumem::cli::arg_parser;
using gpumem::cli::parsed_args;
using gpumem::cli::usage_error;

arg_parser info_like() {
  arg_parser p("gpumem info", "Describe the device.");
  p.option("device", "", "platform", std::nullopt, {"auto", "sim", "cuda"})
      .option("index", "N", "device index")
      .option("out", "FILE", "output file", std::string("-"), {}, 'o')
      .flag("json", "print JSON", 'j')
      .flag("bandwidth", "measure bandwidth");
  return p;
}

// The message of the usage_error that parsing `args` throws ("" if none is thrown).
std::string parse_error(const arg_parser& p, const std::vector<std::string>& args) {
  try {
    p.parse(args);
  } catch (const usage_error& e) {
    EXPECT_FALSE(e.usage().empty()) << "usage_error from parse() carries the usage line";
    return e.what();
  }
  return "";
}

TEST(cli_args, empty_command_line_gives_defaults_only) {
  const parsed_args a = info_like().parse(std::vector<std::string>{});
  EXPECT_FALSE(a.has("json"));
  EXPECT_FALSE(a.has("device"));
  EXPECT_FALSE(a.value("device").has_value());
  EXPECT_EQ(a.value("out"), "-");  // declared default
  EXPECT_FALSE(a.has("out"));      // ...but not given
  EXPECT_EQ(a.value_or("device", "auto"), "auto");
  EXPECT_FALSE(a.integer("index").has_value());
  EXPECT_TRUE(a.positionals().empty());
  EXPECT_FALSE(a.help_requested());
}

TEST(cli_args, flags_and_both_option_spellings) {
  const parsed_args a = info_like().parse({"--json", "--device", "sim", "--index=3"});
  EXPECT_TRUE(a.has("json"));
  EXPECT_FALSE(a.has("bandwidth"));
  EXPECT_EQ(a.value("device"), "sim");
  EXPECT_EQ(a.value("index"), "3");
  EXPECT_EQ(a.integer("index", 0), 3);
}

TEST(cli_args, argv_form_skips_the_command_name) {
  const char* argv[] = {"info", "--device=cuda", "-j", nullptr};
  const parsed_args a = info_like().parse(3, argv);
  EXPECT_EQ(a.value("device"), "cuda");
  EXPECT_TRUE(a.has("json"));
  EXPECT_TRUE(a.positionals().empty());
}

TEST(cli_args, short_options_take_the_next_argument) {
  const parsed_args a = info_like().parse({"-o", "report.json", "-j"});
  EXPECT_EQ(a.value("out"), "report.json");
  EXPECT_TRUE(a.has("json"));
}

TEST(cli_args, repeated_option_keeps_every_value_and_the_last_wins) {
  const parsed_args a = info_like().parse({"--index", "1", "--index=2"});
  EXPECT_EQ(a.value("index"), "2");
  EXPECT_EQ(a.values("index"), (std::vector<std::string>{"1", "2"}));
}

TEST(cli_args, option_value_may_be_empty_or_contain_equals) {
  const parsed_args a = info_like().parse({"--out=a=b"});
  EXPECT_EQ(a.value("out"), "a=b");
  const parsed_args b = info_like().parse({"--out="});
  EXPECT_EQ(b.value("out"), "");
}

TEST(cli_args, unknown_options_are_refused_with_a_suggestion) {
  const auto p = info_like();
  EXPECT_EQ(parse_error(p, {"--frobnicate"}), "unknown option '--frobnicate'");
  EXPECT_EQ(parse_error(p, {"--jsn"}), "unknown option '--jsn' (did you mean --json?)");
  EXPECT_EQ(parse_error(p, {"--band"}), "unknown option '--band' (did you mean --bandwidth?)");
  EXPECT_EQ(parse_error(p, {"-x"}), "unknown option '-x'");
}

TEST(cli_args, missing_values_are_refused) {
  const auto p = info_like();
  EXPECT_EQ(parse_error(p, {"--device"}),
            "option --device needs a value (--device auto|sim|cuda)");
  EXPECT_EQ(parse_error(p, {"--index"}), "option --index needs a value (--index N)");
  // A following option is not taken as the value.
  EXPECT_EQ(parse_error(p, {"--index", "--json"}),
            "option --index needs a value (--index N), got option '--json'");
  EXPECT_EQ(parse_error(p, {"-o"}), "option -o needs a value (-o FILE)");
}

TEST(cli_args, flags_take_no_value) {
  EXPECT_EQ(parse_error(info_like(), {"--json=yes"}),
            "option --json takes no value (got '--json=yes')");
}

TEST(cli_args, choices_are_enforced) {
  const auto p = info_like();
  EXPECT_EQ(parse_error(p, {"--device", "gpu"}),
            "invalid value 'gpu' for --device: expected one of auto, sim, cuda");
  EXPECT_EQ(parse_error(p, {"--device="}),
            "invalid value '' for --device: expected one of auto, sim, cuda");
  for (const char* ok : {"auto", "sim", "cuda"})
    EXPECT_EQ(p.parse({"--device", ok}).value("device"), ok);
}

TEST(cli_args, integers_are_checked) {
  const auto p = info_like();
  EXPECT_EQ(p.parse({"--index", "0"}).integer("index", 0), 0);
  EXPECT_EQ(p.parse({"--index", "+7"}).integer("index", 0), 7);
  EXPECT_EQ(p.parse({"--index", "-5"}).integer("index"), -5);  // "-5" is a value, not an option
  EXPECT_EQ(p.parse({"--index", "9223372036854775807"}).integer("index"),
            std::numeric_limits<std::int64_t>::max());

  auto integer_error = [&](const std::string& text, std::int64_t min, std::int64_t max) {
    try {
      p.parse({"--index", text}).integer("index", min, max);
    } catch (const usage_error& e) {
      EXPECT_FALSE(e.usage().empty());
      return std::string(e.what());
    }
    return std::string();
  };
  constexpr auto lowest = std::numeric_limits<std::int64_t>::min();
  constexpr auto highest = std::numeric_limits<std::int64_t>::max();
  EXPECT_EQ(integer_error("x", 0, highest), "invalid value 'x' for --index: expected a whole number");
  EXPECT_EQ(integer_error("3x", 0, highest),
            "invalid value '3x' for --index: expected a whole number");
  EXPECT_EQ(integer_error("1.5", 0, highest),
            "invalid value '1.5' for --index: expected a whole number");
  EXPECT_EQ(integer_error("", 0, highest), "invalid value '' for --index: expected a whole number");
  EXPECT_EQ(integer_error("-1", 0, highest), "invalid value '-1' for --index: must be at least 0");
  EXPECT_EQ(integer_error("9", lowest, 8), "invalid value '9' for --index: must be at most 8");
  EXPECT_EQ(integer_error("9", 0, 8), "invalid value '9' for --index: must be between 0 and 8");
  EXPECT_EQ(integer_error("99999999999999999999", lowest, highest),
            "invalid value '99999999999999999999' for --index: out of range");
}

// The message of the usage_error that reading --index through `read` throws, or "".
template <typename Read>
std::string value_error(const std::string& text, Read read) {
  try {
    read(info_like().parse({"--index", text}));
  } catch (const usage_error& e) {
    EXPECT_FALSE(e.usage().empty());
    return e.what();
  }
  return "";
}

TEST(cli_args, numbers_are_checked_naming_the_option_and_the_bound) {
  const auto p = info_like();
  constexpr double largest = std::numeric_limits<double>::max();
  EXPECT_EQ(p.parse({"--index", "0.25"}).number("index", 0, 1), 0.25);
  EXPECT_EQ(p.parse({"--index", "+3e2"}).number("index", 0, largest), 300.0);
  // Any finite value below the bound is taken, the largest double included.
  EXPECT_EQ(p.parse({"--index", "1e308"}).number("index", 0, largest, true), 1e308);
  EXPECT_FALSE(p.parse({}).number("index", 0, 1));

  auto rate = [](const parsed_args& a) { a.number("index", 0, largest, true); };
  EXPECT_EQ(value_error("abc", rate), "invalid value 'abc' for --index: expected a number");
  EXPECT_EQ(value_error("", rate), "invalid value '' for --index: expected a number");
  EXPECT_EQ(value_error(" 1", rate), "invalid value ' 1' for --index: expected a number");
  EXPECT_EQ(value_error("2x", rate), "invalid value '2x' for --index: expected a number");
  EXPECT_EQ(value_error("nan", rate), "invalid value 'nan' for --index: expected a number");
  EXPECT_EQ(value_error("0", rate), "invalid value '0' for --index: must be above 0");
  EXPECT_EQ(value_error("-1e309", rate), "invalid value '-1e309' for --index: must be above 0");
  // Beyond a double, and infinity: the limit is named, not "not a number".
  EXPECT_EQ(value_error("1e309", rate),
            "invalid value '1e309' for --index: must be at most 1.79769e+308");
  EXPECT_EQ(value_error("inf", rate), "invalid value 'inf' for --index: must be at most 1.79769e+308");
  auto fraction = [](const parsed_args& a) { a.number("index", 0, 1); };
  EXPECT_EQ(value_error("1.5", fraction), "invalid value '1.5' for --index: must be at most 1");
  EXPECT_EQ(value_error("-0.1", fraction), "invalid value '-0.1' for --index: must be at least 0");
}

TEST(cli_args, byte_sizes_are_checked_naming_the_option_and_the_least) {
  const auto p = info_like();
  EXPECT_EQ(p.parse({"--index", "80G"}).bytes("index"), std::size_t{80} << 30);
  EXPECT_EQ(p.parse({"--index", "1.5K"}).bytes("index"), 1536u);
  EXPECT_EQ(p.parse({"--index", "2M"}).bytes("index", std::size_t{2} << 20), std::size_t{2} << 20);
  EXPECT_FALSE(p.parse({}).bytes("index"));

  auto capacity = [](const parsed_args& a) { a.bytes("index", std::size_t{2} << 20, "one page"); };
  for (const char* bad : {"abc", "12Q", "-1G", "", "1e30T"})
    EXPECT_NE(value_error(bad, capacity)
                  .find(std::string("invalid value '") + bad + "' for --index: expected a size in bytes"),
              std::string::npos)
        << bad << ": " << value_error(bad, capacity);
  EXPECT_EQ(value_error("1K", capacity),
            "invalid value '1K' for --index: must be at least 2.00 MiB (one page)");
  EXPECT_EQ(value_error("0", [](const parsed_args& a) { a.bytes("index", 1); }),
            "invalid value '0' for --index: must be at least 1 B");
}

TEST(cli_args, positionals_and_the_double_dash) {
  arg_parser p("gpumem replay", "Replay traces.");
  p.flag("json", "print JSON").positional("trace", "trace file").positional(
      "more", "more traces", false, -1);
  const parsed_args a = p.parse({"a.json", "--json", "b.json", "--", "--not-an-option", "-"});
  EXPECT_TRUE(a.has("json"));
  EXPECT_EQ(a.positionals(),
            (std::vector<std::string>{"a.json", "b.json", "--not-an-option", "-"}));
  EXPECT_EQ(parse_error(p, {"--json"}), "missing required argument <trace>");
}

TEST(cli_args, unexpected_positionals_are_refused) {
  EXPECT_EQ(parse_error(info_like(), {"extra"}),
            "unexpected argument 'extra' (gpumem info takes no positional arguments)");
  arg_parser p("gpumem one", "One argument.");
  p.positional("file", "a file");
  EXPECT_EQ(p.parse({"x"}).positionals(), std::vector<std::string>{"x"});
  EXPECT_EQ(parse_error(p, {"x", "y"}), "unexpected argument 'y'");
}

TEST(cli_args, help_wins_over_other_errors) {
  const auto p = info_like();
  EXPECT_TRUE(p.parse({"--help"}).help_requested());
  EXPECT_TRUE(p.parse({"-h"}).help_requested());
  EXPECT_TRUE(p.parse({"--bogus", "--device", "gpu", "--help"}).help_requested());
  // After "--", "--help" is a positional, so the positional check applies.
  EXPECT_EQ(parse_error(p, {"--", "--help"}),
            "unexpected argument '--help' (gpumem info takes no positional arguments)");
}

TEST(cli_args, help_text_lists_every_argument) {
  arg_parser p = info_like();
  p.positional("trace", "trace file", false).epilog("examples:\n  gpumem info --json");
  const std::string help = p.help();
  EXPECT_EQ(help.rfind("usage: gpumem info ", 0), 0u) << help;
  for (const char* expected :
       {"[--device auto|sim|cuda]", "[--index N]", "[--json]", "[--bandwidth]", "[<trace>]",
        "Describe the device.", "--device auto|sim|cuda", "-o, --out FILE", "(default: -)",
        "-j, --json", "-h, --help", "<trace>", "trace file (optional)", "examples:\n"})
    EXPECT_NE(help.find(expected), std::string::npos) << "missing '" << expected << "' in\n"
                                                      << help;
  // Options are listed in declaration order.
  EXPECT_LT(help.find("--device auto"), help.find("--index N"));
  EXPECT_LT(help.find("--index N"), help.find("--out FILE"));
  // Every line fits in 80 columns.
  std::size_t start = 0;
  while (start < help.size()) {
    std::size_t end = help.find('\n', start);
    if (end == std::string::npos) end = help.size();
    EXPECT_LE(end - start, 80u) << help.substr(start, end - start);
    start = end + 1;
  }
}

TEST(cli_args, usage_wraps_long_lines) {
  arg_parser p("gpumem long", "Many options.");
  for (int i = 0; i < 12; ++i) p.option("option-" + std::to_string(i), "VALUE", "an option");
  const std::string usage = p.usage();
  EXPECT_NE(usage.find('\n'), std::string::npos);
  // Continuation lines start in the column after "usage: gpumem long ".
  const std::string continuation = "\n" + std::string(19, ' ') + "[--option-";
  EXPECT_NE(usage.find(continuation), std::string::npos) << usage;
}

TEST(cli_args, declaring_an_option_twice_is_a_programming_error) {
  arg_parser p("gpumem x", "x");
  p.flag("json", "a");
  EXPECT_THROW(p.flag("json", "b"), std::logic_error);
  EXPECT_THROW(p.flag("help", "reserved"), std::logic_error);
  EXPECT_THROW(p.flag("other", "short h is reserved", 'h'), std::logic_error);
}

}  // namespace
