// Shared by the telemetry tests: a reader for the pickle subset gpumem writes (so tests
// check what was written, not how), and helpers over the decoded objects.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

namespace gpumem_test {

struct py_object;
using py_list = std::vector<py_object>;
using py_dict = std::map<std::string, py_object>;  // string keys only (all gpumem writes)
struct py_tuple {
  std::vector<py_object> items;
};

struct py_object {
  std::variant<std::monostate, bool, std::int64_t, double, std::string,
               std::shared_ptr<py_list>, std::shared_ptr<py_dict>, std::shared_ptr<py_tuple>>
      v;
  bool is_none() const { return std::holds_alternative<std::monostate>(v); }
  std::int64_t integer() const { return std::get<std::int64_t>(v); }
  bool boolean() const { return std::get<bool>(v); }
  double real() const { return std::get<double>(v); }
  const std::string& str() const { return std::get<std::string>(v); }
  const py_list& list() const { return *std::get<std::shared_ptr<py_list>>(v); }
  const py_dict& dict() const { return *std::get<std::shared_ptr<py_dict>>(v); }
  const py_tuple& tuple() const { return *std::get<std::shared_ptr<py_tuple>>(v); }
  const py_object& operator[](const std::string& key) const {
    auto it = dict().find(key);
    if (it == dict().end()) throw std::out_of_range("no key '" + key + "'");
    return it->second;
  }
  bool has(const std::string& key) const { return dict().count(key) != 0; }
};

// Decodes protocol-2 pickles built from the opcodes pickle_writer emits; throws
// std::runtime_error on anything else (so a stray opcode fails the test).
inline py_object read_pickle(const std::string& data) {
  std::size_t at = 0;
  auto need = [&](std::size_t n) {
    if (at + n > data.size()) throw std::runtime_error("pickle truncated");
  };
  auto byte = [&]() -> std::uint8_t {
    need(1);
    return static_cast<std::uint8_t>(data[at++]);
  };
  auto le = [&](int n) -> std::uint64_t {
    need(static_cast<std::size_t>(n));
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= std::uint64_t{static_cast<std::uint8_t>(data[at + i])} << (8 * i);
    at += static_cast<std::size_t>(n);
    return v;
  };
  std::vector<py_object> stack;
  std::vector<std::size_t> marks;
  auto pop_mark = [&]() {
    if (marks.empty()) throw std::runtime_error("no mark");
    const std::size_t m = marks.back();
    marks.pop_back();
    return m;
  };
  if (byte() != 0x80 || byte() != 2) throw std::runtime_error("not protocol 2");
  while (true) {
    const std::uint8_t op = byte();
    py_object o;
    switch (op) {
      case '}': o.v = std::make_shared<py_dict>(); stack.push_back(o); break;
      case ']': o.v = std::make_shared<py_list>(); stack.push_back(o); break;
      case '(': marks.push_back(stack.size()); break;
      case 'u': {
        const std::size_t m = pop_mark();
        if (m == 0 || (stack.size() - m) % 2 != 0) throw std::runtime_error("bad SETITEMS");
        auto& d = *std::get<std::shared_ptr<py_dict>>(stack[m - 1].v);
        for (std::size_t i = m; i < stack.size(); i += 2) d[stack[i].str()] = stack[i + 1];
        stack.resize(m);
        break;
      }
      case 'e': {
        const std::size_t m = pop_mark();
        auto& l = *std::get<std::shared_ptr<py_list>>(stack[m - 1].v);
        l.insert(l.end(), stack.begin() + static_cast<std::ptrdiff_t>(m), stack.end());
        stack.resize(m);
        break;
      }
      case 'X': {
        const auto n = static_cast<std::size_t>(le(4));
        need(n);
        o.v = data.substr(at, n);
        at += n;
        stack.push_back(o);
        break;
      }
      case 'K': o.v = static_cast<std::int64_t>(le(1)); stack.push_back(o); break;
      case 'M': o.v = static_cast<std::int64_t>(le(2)); stack.push_back(o); break;
      case 'J': o.v = static_cast<std::int64_t>(static_cast<std::int32_t>(le(4))); stack.push_back(o); break;
      case 0x8a: {
        const int n = byte();
        if (n < 1 || n > 8) throw std::runtime_error("LONG1 too long for the test reader");
        std::uint64_t u = le(n);
        if (n < 8 && (u >> (8 * n - 1)) != 0) u |= ~std::uint64_t{0} << (8 * n);  // sign-extend
        o.v = static_cast<std::int64_t>(u);
        stack.push_back(o);
        break;
      }
      case 0x88: o.v = true; stack.push_back(o); break;
      case 0x89: o.v = false; stack.push_back(o); break;
      case 'N': stack.push_back(o); break;
      case 'G': {
        need(8);
        std::uint64_t bits = 0;
        for (int i = 0; i < 8; ++i) bits = bits << 8 | static_cast<std::uint8_t>(data[at++]);
        double d;
        std::memcpy(&d, &bits, sizeof d);
        o.v = d;
        stack.push_back(o);
        break;
      }
      case 0x86: {
        if (stack.size() < 2) throw std::runtime_error("TUPLE2 on a short stack");
        auto t = std::make_shared<py_tuple>();
        t->items.assign(stack.end() - 2, stack.end());
        stack.resize(stack.size() - 2);
        o.v = t;
        stack.push_back(o);
        break;
      }
      case '.':
        if (stack.size() != 1 || !marks.empty()) throw std::runtime_error("STOP with a stack of " + std::to_string(stack.size()));
        if (at != data.size()) throw std::runtime_error("bytes after STOP");
        return stack.back();
      default:
        throw std::runtime_error("unexpected opcode " + std::to_string(op));
    }
  }
}

}  // namespace gpumem_test
