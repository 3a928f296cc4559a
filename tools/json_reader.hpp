// A small JSON reader for the gpumem tool's inputs (figures written by `gpumem replay
// --json` or by hand): parses one JSON text (RFC 8259) into a tree of json_value.
// Numbers are doubles; strings are kept as written but for their escapes (\uXXXX becomes
// UTF-8; a lone surrogate becomes U+FFFD).
// Throws gpumem::invalid_argument naming `source` and the byte offset for malformed text
// (nesting deeper than json_max_depth included), so a bad file is refused, never half read.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace gpumem::cli {

inline constexpr std::size_t json_max_depth = 256;

struct json_value {
  enum class kind { null, boolean, number, string, array, object };
  kind k = kind::null;
  bool b = false;
  double number = 0;
  std::string text;
  std::vector<json_value> items;              // array
  std::map<std::string, json_value> members;  // object (a repeated key: the last wins)

  // The member `name` of an object, or nullptr (also when this is not an object).
  const json_value* find(std::string_view name) const;
};

json_value parse_json(std::string_view text, const std::string& source);

}  // namespace gpumem::cli
