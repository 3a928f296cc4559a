// The one table of pool options: each key of a GPUMEM_CONF / --config string with its default,
// what it trades and an example. pool_options::parse() takes its list of valid keys from it,
// `gpumem options` prints it, and docs/OPTIONS.md is generated from it (a test compares them).
//
// Invariant: every key pool_options::parse() accepts has exactly one row, in the order the
// parser's "unknown key" message lists them.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace gpumem {

struct pool_option_info {
  std::string_view name;
  std::string_view default_text;
  std::string_view description;  // what it does and what it trades
  std::string_view example;      // a GPUMEM_CONF item, "key:value"
};

// All rows, in the parser's order.
std::span<const pool_option_info> pool_option_table() noexcept;

// The row of `name`, or nullptr.
const pool_option_info* find_pool_option(std::string_view name) noexcept;

// "reserve, reserve_fraction, ..." in table order (the parser's "known:" list).
std::string pool_option_names();

// The table as Markdown: docs/OPTIONS.md is exactly this text.
std::string pool_options_markdown();

// The table as plain text for a terminal.
std::string pool_options_text();

}  // namespace gpumem
