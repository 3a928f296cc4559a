// The one rule by which every text reader (trace CSV, serve-sim workloads) cuts its input
// into lines, so a file means the same to each:
//  - a UTF-8 byte-order mark at the very start of the data is skipped (anywhere else it is
//    text like any other);
//  - a line ends at LF; one CR right before it (or before the end of the data) is dropped,
//    so CRLF files read as LF files;
//  - a NUL, a CR anywhere else, or any other control byte but TAB is refused as binary
//    data, naming the line and the column (a byte inside a field never cuts it silently);
//  - a line longer than `max_line` bytes is refused (while it streams: at most
//    `max_line` + one fed chunk is ever held).
// Every refusal is an invalid_argument "<where>:<line>: why".
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace gpumem {

class text_lines {
 public:
  // `where` opens every message ("trace: /path/to/file").
  text_lines(std::string where, std::size_t max_line) : where_(std::move(where)), max_line_(max_line) {}

  // Feeds the next bytes of the data; `on_line(std::string_view line, std::size_t line_no)`
  // is called for each whole line (line_no from 1), without its end.
  template <class F>
  void feed(std::string_view bytes, F&& on_line) {
    pending_.append(bytes);
    std::size_t start = 0;
    for (std::size_t end; (end = pending_.find('\n', start)) != std::string::npos; start = end + 1) {
      const std::string_view line = checked(std::string_view(pending_).substr(start, end - start));
      on_line(line, line_no_);
    }
    pending_.erase(0, start);
    if (pending_.size() > max_line_ + 1) refuse_long_line(line_no_ + 1);
  }

  // The end of the data: the last line, when it has no LF.
  template <class F>
  void finish(F&& on_line) {
    if (!pending_.empty()) {
      const std::string_view line = checked(pending_);
      on_line(line, line_no_);
    }
    pending_.clear();
  }

  std::size_t lines() const noexcept { return line_no_; }

 private:
  // The line (numbered here) as the rule above reads it, or a refusal.
  std::string_view checked(std::string_view line);
  [[noreturn]] void refuse_long_line(std::size_t line_no) const;

  std::string where_;
  std::size_t max_line_;
  std::string pending_;
  std::size_t line_no_ = 0;
};

}  // namespace gpumem
