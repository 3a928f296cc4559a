#include "json_reader.hpp"

#include <cstdlib>
#include <string>

#include "gpumem/errors.hpp"

namespace gpumem::cli {

const json_value* json_value::find(std::string_view name) const {
  if (k != kind::object) return nullptr;
  auto it = members.find(std::string(name));
  return it == members.end() ? nullptr : &it->second;
}

namespace {

class parser {
 public:
  parser(std::string_view text, const std::string& source) : s_(text), source_(source) {}

  json_value document() {
    json_value v = value(0);
    space();
    if (at_ != s_.size()) fail("text after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  const std::string& source_;
  std::size_t at_ = 0;

  [[noreturn]] void fail(const std::string& why) const {
    throw invalid_argument(source_ + ": not valid JSON at byte " + std::to_string(at_) + ": " + why);
  }
  void space() {
    while (at_ < s_.size() && (s_[at_] == ' ' || s_[at_] == '\t' || s_[at_] == '\n' || s_[at_] == '\r'))
      ++at_;
  }
  bool take(char c) {
    space();
    if (at_ < s_.size() && s_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!take(c)) fail(std::string("expected '") + c + "'");
  }
  void word(std::string_view w) {
    if (s_.substr(at_, w.size()) != w) fail("unknown literal");
    at_ += w.size();
  }

  json_value value(std::size_t depth) {
    if (depth >= json_max_depth) fail("nested deeper than " + std::to_string(json_max_depth));
    space();
    if (at_ >= s_.size()) fail("unexpected end");
    json_value v;
    const char c = s_[at_];
    if (c == '{') {
      ++at_;
      v.k = json_value::kind::object;
      if (take('}')) return v;
      do {
        space();
        if (at_ >= s_.size() || s_[at_] != '"') fail("expected a string key");
        std::string key = string();
        expect(':');
        v.members[std::move(key)] = value(depth + 1);
      } while (take(','));
      expect('}');
    } else if (c == '[') {
      ++at_;
      v.k = json_value::kind::array;
      if (take(']')) return v;
      do v.items.push_back(value(depth + 1));
      while (take(','));
      expect(']');
    } else if (c == '"') {
      v.k = json_value::kind::string;
      v.text = string();
    } else if (c == 't' || c == 'f') {
      v.k = json_value::kind::boolean;
      v.b = c == 't';
      word(v.b ? "true" : "false");
    } else if (c == 'n') {
      word("null");
    } else {
      v.k = json_value::kind::number;
      v.number = number();
    }
    return v;
  }

  double number() {
    const std::size_t start = at_;
    if (at_ < s_.size() && s_[at_] == '-') ++at_;
    auto digits = [&] {
      const std::size_t from = at_;
      while (at_ < s_.size() && s_[at_] >= '0' && s_[at_] <= '9') ++at_;
      return at_ > from;
    };
    if (!digits()) fail("expected a value");
    if (at_ < s_.size() && s_[at_] == '.' && (++at_, !digits())) fail("digits expected after '.'");
    if (at_ < s_.size() && (s_[at_] == 'e' || s_[at_] == 'E')) {
      ++at_;
      if (at_ < s_.size() && (s_[at_] == '+' || s_[at_] == '-')) ++at_;
      if (!digits()) fail("digits expected in the exponent");
    }
    return std::strtod(std::string(s_.substr(start, at_ - start)).c_str(), nullptr);
  }

  unsigned hex4() {
    if (at_ + 4 > s_.size()) fail("short \\u escape");
    unsigned u = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = s_[at_++];
      u <<= 4;
      if (h >= '0' && h <= '9') u |= static_cast<unsigned>(h - '0');
      else if (h >= 'a' && h <= 'f') u |= static_cast<unsigned>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') u |= static_cast<unsigned>(h - 'A' + 10);
      else fail("bad \\u escape");
    }
    return u;
  }

  static void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++at_;  // the opening quote
    std::string out;
    while (true) {
      if (at_ >= s_.size()) fail("unterminated string");
      const char c = s_[at_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (at_ >= s_.size()) fail("unterminated escape");
      switch (const char e = s_[at_++]) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.substr(at_, 2) == "\\u") {
            const std::size_t back = at_;
            at_ += 2;
            const unsigned lo = hex4();
            if (lo >= 0xDC00 && lo < 0xE000)
              cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            else
              at_ = back;
          }
          utf8(out, cp >= 0xD800 && cp < 0xE000 ? 0xFFFD : cp);
          break;
        }
        default: fail("unknown escape");
      }
    }
  }
};

}  // namespace

json_value parse_json(std::string_view text, const std::string& source) {
  return parser(text, source).document();
}

}  // namespace gpumem::cli
