// The option table is the parser's list of keys: every row's example parses, and the keys
// the parser knows (its to_string() output and its "unknown key" message) are the table's.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "gpumem/errors.hpp"
#include "gpumem/interop/gpumem.h"
#include "gpumem/pool/option_table.hpp"
#include "gpumem/pool/pool_options.hpp"

namespace {

// A pool's keys parse as pool options; gpumem_pool_create's make a pool through the C API
// (on sim), which a pool alone refuses naming them.
TEST(option_table, every_example_parses_and_names_its_own_key) {
  for (const auto& row : gpumem::pool_option_table()) {
    SCOPED_TRACE(std::string(row.name));
    const std::string example(row.example);
    EXPECT_EQ(example.substr(0, example.find(':')), row.name);
    EXPECT_EQ(gpumem::find_pool_option(row.name), &row);
    if (row.scope == gpumem::option_scope::pool) {
      EXPECT_NO_THROW(gpumem::pool_options::parse(example));
      continue;
    }
    gpumem_pool* pool = nullptr;
    std::string config =
        row.name == "platform" || row.name.starts_with("sim_") ? example
                                                               : "platform:sim," + example;
    if (row.name == "sim_no_peer") config += ",sim_devices:2";  // a pair needs two devices
    EXPECT_EQ(gpumem_pool_create(config.c_str(), &pool), GPUMEM_SUCCESS) << gpumem_last_error();
    gpumem_pool_destroy(pool);
    try {
      gpumem::pool_options::parse(example);
      ADD_FAILURE() << "a pool took gpumem_pool_create's key " << row.name;
    } catch (const gpumem::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("gpumem_pool_create"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(gpumem::find_pool_option("no_such_key"), nullptr);
}

TEST(option_table, the_c_api_names_every_key_of_both_scopes_for_an_unknown_one) {
  gpumem_pool* pool = nullptr;
  ASSERT_EQ(gpumem_pool_create("platform:sim,bogus:1", &pool), GPUMEM_ERROR_INVALID_ARGUMENT);
  const std::string text = gpumem_last_error();
  for (const auto& row : gpumem::pool_option_table())
    EXPECT_NE(text.find(std::string(row.name)), std::string::npos) << row.name << ": " << text;
}

TEST(option_table, rows_are_the_keys_to_string_writes) {
  std::set<std::string> written;
  const std::string all = gpumem::pool_options{}.to_string();
  std::size_t start = 0;
  while (start < all.size()) {
    const auto comma = all.find(',', start);
    const std::string item = all.substr(start, comma - start);
    written.insert(item.substr(0, item.find(':')));
    start = comma == std::string::npos ? all.size() : comma + 1;
  }
  std::set<std::string> listed, all_rows;
  for (const auto& row : gpumem::pool_option_table()) {
    all_rows.insert(std::string(row.name));
    if (row.scope == gpumem::option_scope::pool) listed.insert(std::string(row.name));
  }
  EXPECT_EQ(listed, written);
  EXPECT_EQ(all_rows.size(), gpumem::pool_option_table().size());  // no duplicate rows
}

TEST(option_table, unknown_key_message_lists_the_keys_in_table_order) {
  try {
    gpumem::pool_options::parse("bogus:1");
    FAIL() << "an unknown key must throw";
  } catch (const gpumem::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()),
              "config: unknown key 'bogus' (known: reserve, reserve_fraction, limit, "
              "release_threshold, small_threshold, cross_stream, va_reserve, keep_free, big_chunk, "
              "huge_growth, scrub, shareable, guard, thread_cache, round_large, small_classes, "
              "small_cache, map_worker, footprint, growth_slack, remap_budget, soft_budget, "
              "release_idle, lifetime_hints, peer_access)");
  }
}

TEST(option_table, markdown_has_one_table_row_per_option) {
  const std::string md = gpumem::pool_options_markdown();
  for (const auto& row : gpumem::pool_option_table())
    EXPECT_NE(md.find("| `" + std::string(row.name) + "` | "), std::string::npos) << row.name;
}

}  // namespace
