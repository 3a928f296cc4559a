// The one table of pool options: each key of a GPUMEM_CONF / --config string with its default,
// what it trades and an example. pool_options::parse() takes its list of valid keys from it,
// `gpumem options` prints it, and docs/OPTIONS.md is generated from it (a test compares them).
//
// Invariant: every key pool_options::parse() accepts has exactly one row of scope pool, in
// the order the parser's "unknown key" message lists them; every key gpumem_pool_create
// takes besides them has one row of scope pool_create.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace gpumem {

// Who reads a key: every pool (pool_options::parse), or gpumem_pool_create, which makes the
// pool (the C API, and so Python and the PyTorch plug-in): which pool, device and platform.
enum class option_scope { pool, pool_create };

struct pool_option_info {
  std::string_view name;
  std::string_view default_text;
  std::string_view description;  // what it does and what it trades
  std::string_view example;      // a GPUMEM_CONF item, "key:value"
  option_scope scope = option_scope::pool;
};

// All rows: the pool's keys in the parser's order, then gpumem_pool_create's.
std::span<const pool_option_info> pool_option_table() noexcept;

// The row of `name`, or nullptr.
const pool_option_info* find_pool_option(std::string_view name) noexcept;

// "reserve, reserve_fraction, ..." in table order (the parser's "known:" list): the keys of
// `scope`.
std::string pool_option_names(option_scope scope = option_scope::pool);

// The table as Markdown: docs/OPTIONS.md is exactly this text.
std::string pool_options_markdown();

// The table as plain text for a terminal.
std::string pool_options_text();

}  // namespace gpumem
