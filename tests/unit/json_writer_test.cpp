// The gpumem tool's streaming JSON writer (tools/json_writer.hpp): escaping, nesting,
// numbers, layout, and refusal of misuse.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "../../tools/json_writer.hpp"

namespace {

using gpumem::cli::json_writer;

// Writes one value with `emit` in compact form (indent 0) and returns the text.
template <class F>
std::string compact(F emit) {
  std::ostringstream out;
  json_writer w(out, 0);
  emit(w);
  EXPECT_TRUE(w.complete());
  return out.str();
}

std::string string_value(std::string_view text) {
  return compact([&](json_writer& w) { w.value(text); });
}

TEST(json_writer, escapes_quotes_and_backslashes) {
  EXPECT_EQ(string_value("plain"), "\"plain\"");
  EXPECT_EQ(string_value(""), "\"\"");
  EXPECT_EQ(string_value("say \"hi\""), "\"say \\\"hi\\\"\"");
  EXPECT_EQ(string_value("C:\\path\\to"), "\"C:\\\\path\\\\to\"");
  EXPECT_EQ(string_value("\\\""), "\"\\\\\\\"\"");
  EXPECT_EQ(string_value("a/b"), "\"a/b\"");  // '/' needs no escape
}

TEST(json_writer, escapes_control_characters) {
  EXPECT_EQ(string_value("a\nb\tc\rd\be\ff"), "\"a\\nb\\tc\\rd\\be\\ff\"");
  EXPECT_EQ(string_value(std::string_view("\0", 1)), "\"\\u0000\"");
  EXPECT_EQ(string_value("\x01\x1f"), "\"\\u0001\\u001f\"");
  EXPECT_EQ(string_value("\x1b[0m"), "\"\\u001b[0m\"");
  EXPECT_EQ(string_value("\x7f"), "\"\x7f\"");  // DEL is allowed unescaped
}

TEST(json_writer, passes_utf8_and_replaces_invalid_bytes) {
  EXPECT_EQ(string_value("H200 \xc2\xb5s \xe2\x80\x94 \xf0\x9f\x9a\x80"),
            "\"H200 \xc2\xb5s \xe2\x80\x94 \xf0\x9f\x9a\x80\"");
  const std::string replacement = "\xEF\xBF\xBD";
  EXPECT_EQ(string_value("a\xff" "b"), "\"a" + replacement + "b\"");
  EXPECT_EQ(string_value("\xc3"), "\"" + replacement + "\"");             // truncated
  EXPECT_EQ(string_value("\xc0\xaf"), "\"" + replacement + replacement + "\"");  // overlong
  EXPECT_EQ(string_value("\xed\xa0\x80"),                                 // a surrogate
            "\"" + replacement + replacement + replacement + "\"");
}

TEST(json_writer, quote_matches_the_writer) {
  EXPECT_EQ(json_writer::quote("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\"");
}

TEST(json_writer, integers) {
  EXPECT_EQ(compact([](json_writer& w) { w.value(0); }), "0");
  EXPECT_EQ(compact([](json_writer& w) { w.value(-42); }), "-42");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::uint64_t{18446744073709551615u}); }),
            "18446744073709551615");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::numeric_limits<std::int64_t>::min()); }),
            "-9223372036854775808");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::size_t{85899345920}); }), "85899345920");
}

TEST(json_writer, doubles_round_trip_and_non_finite_is_null) {
  EXPECT_EQ(compact([](json_writer& w) { w.value(4097.28); }), "4097.28");
  EXPECT_EQ(compact([](json_writer& w) { w.value(0.1); }), "0.1");
  EXPECT_EQ(compact([](json_writer& w) { w.value(-2.5); }), "-2.5");
  EXPECT_EQ(compact([](json_writer& w) { w.value(3.0); }), "3");
  EXPECT_EQ(compact([](json_writer& w) { w.value(1e300); }), "1e+300");
  const std::string third = compact([](json_writer& w) { w.value(1.0 / 3.0); });
  EXPECT_EQ(std::stod(third), 1.0 / 3.0);
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::nan("")); }), "null");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::numeric_limits<double>::infinity()); }),
            "null");
  EXPECT_EQ(compact([](json_writer& w) { w.value(-std::numeric_limits<double>::infinity()); }),
            "null");
}

TEST(json_writer, bools_null_and_optionals) {
  EXPECT_EQ(compact([](json_writer& w) { w.value(true); }), "true");
  EXPECT_EQ(compact([](json_writer& w) { w.value(false); }), "false");
  EXPECT_EQ(compact([](json_writer& w) { w.null(); }), "null");
  EXPECT_EQ(compact([](json_writer& w) { w.value(nullptr); }), "null");
  EXPECT_EQ(compact([](json_writer& w) { w.value(static_cast<const char*>(nullptr)); }), "null");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::optional<int>()); }), "null");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::optional<int>(7)); }), "7");
  EXPECT_EQ(compact([](json_writer& w) { w.value(std::optional<std::string>("x")); }), "\"x\"");
}

TEST(json_writer, nesting_compact) {
  const std::string text = compact([](json_writer& w) {
    w.begin_object();
    w.member("name", "dev \"0\"");
    w.member("count", 2);
    w.key("list").begin_array();
    w.value(1).value(2.5).value(true).null();
    w.begin_object().member("deep", std::string("x")).end_object();
    w.begin_array().end_array();
    w.end_array();
    w.key("empty").begin_object().end_object();
    w.end_object();
  });
  EXPECT_EQ(text,
            "{\"name\":\"dev \\\"0\\\"\",\"count\":2,\"list\":[1,2.5,true,null,"
            "{\"deep\":\"x\"},[]],\"empty\":{}}");
}

TEST(json_writer, nesting_indented) {
  std::ostringstream out;
  json_writer w(out);  // indent 2
  w.begin_object();
  w.member("platform", "sim");
  w.member("reason", std::optional<std::string>());
  w.key("devices").begin_array();
  w.begin_object().member("index", 0).member("ok", true).end_object();
  w.end_array();
  w.key("none").begin_array().end_array();
  w.end_object();
  EXPECT_TRUE(w.complete());
  EXPECT_EQ(out.str(),
            "{\n"
            "  \"platform\": \"sim\",\n"
            "  \"reason\": null,\n"
            "  \"devices\": [\n"
            "    {\n"
            "      \"index\": 0,\n"
            "      \"ok\": true\n"
            "    }\n"
            "  ],\n"
            "  \"none\": []\n"
            "}\n");
}

TEST(json_writer, keys_are_escaped) {
  EXPECT_EQ(compact([](json_writer& w) { w.begin_object().member("a\"b\n", 1).end_object(); }),
            "{\"a\\\"b\\n\":1}");
}

TEST(json_writer, tracks_depth_and_completion) {
  std::ostringstream out;
  json_writer w(out, 0);
  EXPECT_FALSE(w.complete());
  w.begin_array();
  EXPECT_EQ(w.depth(), 1u);
  w.begin_object();
  EXPECT_EQ(w.depth(), 2u);
  w.end_object();
  EXPECT_FALSE(w.complete());
  w.end_array();
  EXPECT_EQ(w.depth(), 0u);
  EXPECT_TRUE(w.complete());
}

TEST(json_writer, misuse_throws_before_writing) {
  auto refuses = [](auto misuse) {
    std::ostringstream out;
    json_writer w(out, 0);
    std::string before;
    try {
      misuse(w, before, out);
    } catch (const std::logic_error&) {
      return out.str() == before;  // nothing written by the refused call
    }
    return false;
  };
  // A value in an object without a key.
  EXPECT_TRUE(refuses([](json_writer& w, std::string& before, std::ostringstream& out) {
    w.begin_object();
    before = out.str();
    w.value(1);
  }));
  // A key in an array.
  EXPECT_TRUE(refuses([](json_writer& w, std::string& before, std::ostringstream& out) {
    w.begin_array();
    before = out.str();
    w.key("k");
  }));
  // A key at top level, and two keys in a row.
  EXPECT_TRUE(refuses([](json_writer& w, std::string&, std::ostringstream&) { w.key("k"); }));
  EXPECT_TRUE(refuses([](json_writer& w, std::string& before, std::ostringstream& out) {
    w.begin_object().key("a");
    before = out.str();
    w.key("b");
  }));
  // Mismatched and unbalanced closes; closing an object with a key pending.
  EXPECT_TRUE(refuses([](json_writer& w, std::string& before, std::ostringstream& out) {
    w.begin_object();
    before = out.str();
    w.end_array();
  }));
  EXPECT_TRUE(refuses([](json_writer& w, std::string&, std::ostringstream&) { w.end_object(); }));
  EXPECT_TRUE(refuses([](json_writer& w, std::string& before, std::ostringstream& out) {
    w.begin_object().key("dangling");
    before = out.str();
    w.end_object();
  }));
  // A second top-level value.
  EXPECT_TRUE(refuses([](json_writer& w, std::string& before, std::ostringstream& out) {
    w.value(1);
    before = out.str();
    w.value(2);
  }));
}

}  // namespace
