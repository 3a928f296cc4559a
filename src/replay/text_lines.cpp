// The one rule text readers cut lines by (replay/text_lines.hpp).
#include "gpumem/replay/text_lines.hpp"

#include <cstdio>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"

namespace gpumem {

std::string_view text_lines::checked(std::string_view line) {
  const std::size_t line_no = ++line_no_;
  if (line.size() > max_line_ + 1 || (line.size() == max_line_ + 1 && line.back() != '\r'))
    refuse_long_line(line_no);
  if (line_no == 1 && line.substr(0, 3) == "\xEF\xBB\xBF") line.remove_prefix(3);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  for (std::size_t i = 0; i < line.size(); ++i) {
    const auto c = static_cast<unsigned char>(line[i]);
    if (c >= 0x20 || c == '\t') continue;
    char text[160];
    std::snprintf(text, sizeof text,
                  ":%zu: binary data, not text (byte 0x%02x at column %zu%s)", line_no, c, i + 1,
                  c == 0 ? ": a NUL" : c == '\r' ? ": a carriage return not ending the line" : "");
    throw invalid_argument(where_ + text);
  }
  return line;
}

void text_lines::refuse_long_line(std::size_t line_no) const {
  throw invalid_argument(where_ + ":" + std::to_string(line_no) + ": a line longer than " +
                         format_bytes(max_line_) + " (the longest line this reader takes)");
}

}  // namespace gpumem
