// A tiny streaming JSON writer for the gpumem tool's --json output (no third-party JSON
// library: the GPU machine has none). Writes as it goes; holds only the nesting stack.
//
//   json_writer w(std::cout);          // indent 2; json_writer(out, 0) writes one line
//   w.begin_object();
//   w.member("platform", "sim");       // key + value
//   w.key("devices").begin_array();
//   w.begin_object().member("index", 0).end_object();
//   w.end_array();
//   w.end_object();                    // complete() is now true
//
// Invariants:
//  - what has been written is always a prefix of one valid JSON text (RFC 8259); misuse
//    (a value where a key is due, a key outside an object, unbalanced end_*, a second
//    top-level value) throws std::logic_error before anything is written;
//  - strings are escaped: '"', '\\' and control characters (U+0000..U+001F as \b \f \n \r
//    \t or \u00XX); invalid UTF-8 bytes become U+FFFD, so the output is valid UTF-8;
//  - doubles are written in the shortest form that reads back to the same value; NaN and
//    infinities (which JSON cannot express) are written as null.
#pragma once

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace gpumem::cli {

class json_writer {
 public:
  explicit json_writer(std::ostream& out, int indent = 2) : out_(out), indent_(indent) {}

  json_writer& begin_object() { return open('{', frame_kind::object); }
  json_writer& end_object() { return close('}', frame_kind::object); }
  json_writer& begin_array() { return open('[', frame_kind::array); }
  json_writer& end_array() { return close(']', frame_kind::array); }

  // REQUIRES: inside an object, no key pending.
  json_writer& key(std::string_view name) {
    if (stack_.empty() || stack_.back().kind != frame_kind::object || key_pending_)
      throw std::logic_error("json_writer: key \"" + std::string(name) +
                             "\" outside an object or after another key");
    separate();
    write_string(name);
    out_ << (indent_ > 0 ? ": " : ":");
    key_pending_ = true;
    return *this;
  }

  json_writer& value(std::string_view text) {
    before_value();
    write_string(text);
    return after_value();
  }
  json_writer& value(const char* text) {
    return text == nullptr ? null() : value(std::string_view(text));
  }
  json_writer& value(const std::string& text) { return value(std::string_view(text)); }
  json_writer& value(bool flag) {
    before_value();
    out_ << (flag ? "true" : "false");
    return after_value();
  }
  json_writer& value(std::nullptr_t) { return null(); }
  template <std::integral T>
    requires(!std::same_as<T, bool> && !std::same_as<T, char>)
  json_writer& value(T number) {
    before_value();
    char buf[32];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, number);
    (void)ec;  // 32 chars hold any 64-bit integer
    out_.write(buf, end - buf);
    return after_value();
  }
  json_writer& value(double number) {
    if (!std::isfinite(number)) return null();
    before_value();
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, number);
    (void)ec;  // shortest round-trip form fits in 64 chars
    out_.write(buf, end - buf);
    return after_value();
  }
  json_writer& value(float number) { return value(static_cast<double>(number)); }
  // An optional value: null when empty.
  template <class T>
  json_writer& value(const std::optional<T>& maybe) {
    return maybe ? value(*maybe) : null();
  }
  json_writer& null() {
    before_value();
    out_ << "null";
    return after_value();
  }

  // key(name).value(v)
  template <class T>
  json_writer& member(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }
  json_writer& member(std::string_view name, const char* v) {
    key(name);
    return value(v);
  }

  // One complete top-level value has been written and closed.
  bool complete() const noexcept { return done_ && stack_.empty(); }
  std::size_t depth() const noexcept { return stack_.size(); }

  // The escaped form of `text`, quotes included.
  static std::string quote(std::string_view text) {
    std::string out;
    out.reserve(text.size() + 2);
    out += '"';
    append_escaped(out, text);
    out += '"';
    return out;
  }

 private:
  enum class frame_kind : std::uint8_t { object, array };
  struct frame {
    frame_kind kind;
    std::size_t count = 0;
  };

  json_writer& open(char bracket, frame_kind kind) {
    before_value();
    key_pending_ = false;  // the key, if any, is answered by this container
    out_ << bracket;
    stack_.push_back({kind, 0});
    return *this;
  }

  json_writer& close(char bracket, frame_kind kind) {
    if (stack_.empty() || stack_.back().kind != kind || key_pending_)
      throw std::logic_error(std::string("json_writer: unbalanced '") + bracket + "'");
    const bool had_members = stack_.back().count != 0;
    stack_.pop_back();
    if (had_members) newline();
    out_ << bracket;
    return after_value();
  }

  // Checks a value may go here; writes the separator before array elements.
  void before_value() {
    if (stack_.empty()) {
      if (done_) throw std::logic_error("json_writer: a second top-level value");
      return;
    }
    if (stack_.back().kind == frame_kind::object) {
      if (!key_pending_) throw std::logic_error("json_writer: value in an object without a key");
    } else {
      separate();
    }
  }

  json_writer& after_value() {
    key_pending_ = false;
    if (stack_.empty()) {
      done_ = true;
      if (indent_ > 0) out_ << '\n';
    }
    return *this;
  }

  // Before the n-th member or element: ",", then newline and indentation.
  void separate() {
    auto& top = stack_.back();
    if (top.count++ != 0) out_ << ',';
    newline();
  }

  void newline() {
    if (indent_ <= 0) return;
    out_ << '\n';
    for (std::size_t i = 0; i < stack_.size() * static_cast<std::size_t>(indent_); ++i)
      out_ << ' ';
  }

  void write_string(std::string_view text) {
    std::string escaped;
    escaped.reserve(text.size() + 2);
    escaped += '"';
    append_escaped(escaped, text);
    escaped += '"';
    out_ << escaped;
  }

  // Length of the valid UTF-8 sequence starting at s[i], or 0 if it is not valid.
  static std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
    const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
    const unsigned char c = byte(i);
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 3;
      if (c == 0xE0) lo = 0xA0;  // no overlong forms
      if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
    } else {
      return 0;
    }
    if (i + n > s.size()) return 0;
    if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
    for (std::size_t k = 2; k < n; ++k)
      if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
    return n;
  }

  static void append_escaped(std::string& out, std::string_view text) {
    static constexpr char hex[] = "0123456789abcdef";
    for (std::size_t i = 0; i < text.size();) {
      const auto c = static_cast<unsigned char>(text[i]);
      if (c >= 0x80) {
        const std::size_t n = utf8_sequence_length(text, i);
        if (n == 0) {
          out += "\xEF\xBF\xBD";  // U+FFFD replacement character
          ++i;
        } else {
          out.append(text.substr(i, n));
          i += n;
        }
        continue;
      }
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\b': out += "\\b"; break;
        case '\f': out += "\\f"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
          if (c < 0x20) {
            out += "\\u00";
            out += hex[c >> 4];
            out += hex[c & 0xF];
          } else {
            out += static_cast<char>(c);
          }
      }
      ++i;
    }
  }

  std::ostream& out_;
  int indent_;
  std::vector<frame> stack_;
  bool key_pending_ = false;
  bool done_ = false;
};

}  // namespace gpumem::cli
