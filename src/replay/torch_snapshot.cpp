// A plain-data unpickler and the conversion of a PyTorch memory snapshot's device trace
// to trace CSV (gpumem/replay/torch_snapshot.hpp).
//
// Invariants: the reader never reads past the end of the input (every read checks the
// bytes left); memo indices are checked; the value stack never pops below a mark.
#include "gpumem/replay/torch_snapshot.hpp"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gpumem/errors.hpp"

namespace gpumem {

namespace {

struct value;
using value_ptr = std::shared_ptr<value>;

struct value {
  enum class type : std::uint8_t { none, boolean, integer, real, text, bytes, list, tuple, dict, mark };
  type t = type::none;
  std::int64_t i = 0;
  double d = 0;
  std::string s;                                    // text and bytes
  std::vector<value_ptr> items;                     // list and tuple
  std::vector<std::pair<value_ptr, value_ptr>> kv;  // dict, in insertion order

  const value* get(std::string_view key) const {
    for (const auto& [k, v] : kv)
      if (k->t == type::text && k->s == key) return v.get();
    return nullptr;
  }
};

value_ptr make(value::type t) {
  auto v = std::make_shared<value>();
  v->t = t;
  return v;
}

class unpickler {
 public:
  unpickler(const std::string& bytes, const std::string& source) : data_(bytes), source_(source) {}

  value_ptr load() {
    for (;;) {
      const std::uint8_t op = byte();
      switch (op) {
        case 0x80: proto_ = byte(); if (proto_ < 2) fail("pickle protocol below 2"); break;  // PROTO
        case 0x95: take(8); break;                                       // FRAME: length only
        case '.': {                                                      // STOP
          if (stack_.size() != 1) fail("the pickle does not end with one value");
          return stack_.back();
        }
        case '}': push(make(value::type::dict)); break;                  // EMPTY_DICT
        case ']': push(make(value::type::list)); break;                  // EMPTY_LIST
        case ')': push(make(value::type::tuple)); break;                 // EMPTY_TUPLE
        case '(': push(make(value::type::mark)); break;                  // MARK
        case 'N': push(make(value::type::none)); break;                  // NONE
        case 0x88: push_bool(true); break;                               // NEWTRUE
        case 0x89: push_bool(false); break;                              // NEWFALSE
        case 'J': push_int(static_cast<std::int32_t>(le(4))); break;     // BININT
        case 'K': push_int(static_cast<std::int64_t>(le(1))); break;     // BININT1
        case 'M': push_int(static_cast<std::int64_t>(le(2))); break;     // BININT2
        case 0x8a: push_int(long_value(le(1))); break;                   // LONG1
        case 0x8b: push_int(long_value(le(4))); break;                   // LONG4
        case 'G': {                                                      // BINFLOAT (big-endian)
          std::uint64_t bits = 0;
          for (char c : take(8)) bits = (bits << 8) | static_cast<std::uint8_t>(c);
          auto v = make(value::type::real);
          std::memcpy(&v->d, &bits, sizeof bits);
          push(v);
          break;
        }
        case 0x8c: push_text(le(1), value::type::text); break;          // SHORT_BINUNICODE
        case 'X': push_text(le(4), value::type::text); break;           // BINUNICODE
        case 0x8d: push_text(le(8), value::type::text); break;          // BINUNICODE8
        case 'C': push_text(le(1), value::type::bytes); break;          // SHORT_BINBYTES
        case 'B': push_text(le(4), value::type::bytes); break;          // BINBYTES
        case 0x8e: push_text(le(8), value::type::bytes); break;         // BINBYTES8
        case 'U': push_text(le(1), value::type::bytes); break;          // SHORT_BINSTRING
        case 'T': push_text(le(4), value::type::bytes); break;          // BINSTRING
        case 0x94: memo_.push_back(top()); break;                        // MEMOIZE
        case 'q': put(le(1)); break;                                     // BINPUT
        case 'r': put(le(4)); break;                                     // LONG_BINPUT
        case 'h': push(memo_at(le(1))); break;                           // BINGET
        case 'j': push(memo_at(le(4))); break;                           // LONG_BINGET
        case 'a': { auto v = pop(); list_of(top())->items.push_back(v); break; }  // APPEND
        case 'e': { auto items = pop_mark(); auto& l = list_of(top())->items;     // APPENDS
                    l.insert(l.end(), items.begin(), items.end()); break; }
        case 's': { auto v = pop(); auto k = pop(); dict_of(top())->kv.emplace_back(k, v); break; }
        case 'u': {                                                      // SETITEMS
          auto items = pop_mark();
          if (items.size() % 2 != 0) fail("SETITEMS with an odd number of values");
          auto* d = dict_of(top());
          for (std::size_t i = 0; i < items.size(); i += 2) d->kv.emplace_back(items[i], items[i + 1]);
          break;
        }
        case 't': { auto v = make(value::type::tuple); v->items = pop_mark(); push(v); break; }
        case 0x85: case 0x86: case 0x87: {                               // TUPLE1..3
          auto v = make(value::type::tuple);
          v->items.resize(op - 0x84);
          for (std::size_t i = v->items.size(); i-- > 0;) v->items[i] = pop();
          push(v);
          break;
        }
        default: {
          char text[192];
          std::snprintf(text, sizeof text,
                        "pickle opcode 0x%02x at byte %zu is not plain data (refused: only "
                        "dicts, lists, strings and numbers are read)", op, pos_ - 1);
          fail(text);
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw invalid_argument("torch snapshot '" + source_ + "': " + what);
  }
  std::uint8_t byte() {
    if (pos_ >= data_.size()) fail("truncated pickle (no STOP)");
    return static_cast<std::uint8_t>(data_[pos_++]);
  }
  std::string_view take(std::uint64_t n) {
    if (n > data_.size() - pos_) fail("truncated pickle");
    std::string_view s(data_.data() + pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  std::uint64_t le(int n) {
    std::uint64_t v = 0;
    const std::string_view s = take(static_cast<std::uint64_t>(n));
    for (int k = n - 1; k >= 0; --k) v = (v << 8) | static_cast<std::uint8_t>(s[static_cast<std::size_t>(k)]);
    return v;
  }
  // A two's-complement little-endian integer of n bytes (LONG1 / LONG4), up to 8 bytes.
  std::int64_t long_value(std::uint64_t n) {
    if (n > 8) fail("an integer wider than 64 bits");
    if (n == 0) return 0;
    const std::string_view s = take(n);
    std::uint64_t v = 0;
    for (std::size_t k = n; k-- > 0;) v = (v << 8) | static_cast<std::uint8_t>(s[k]);
    if (n < 8 && (static_cast<std::uint8_t>(s[n - 1]) & 0x80)) v |= ~std::uint64_t{0} << (8 * n);
    return static_cast<std::int64_t>(v);
  }
  void push(value_ptr v) { stack_.push_back(std::move(v)); }
  void push_bool(bool b) { auto v = make(value::type::boolean); v->i = b; push(v); }
  void push_int(std::int64_t i) { auto v = make(value::type::integer); v->i = i; push(v); }
  void push_text(std::uint64_t n, value::type t) { auto v = make(t); v->s = std::string(take(n)); push(v); }
  value_ptr& top() {
    if (stack_.empty() || stack_.back()->t == value::type::mark) fail("an opcode with no value to act on");
    return stack_.back();
  }
  value_ptr pop() { value_ptr v = top(); stack_.pop_back(); return v; }
  std::vector<value_ptr> pop_mark() {
    std::size_t k = stack_.size();
    while (k > 0 && stack_[k - 1]->t != value::type::mark) --k;
    if (k == 0) fail("no MARK for a multi-value opcode");
    std::vector<value_ptr> items(stack_.begin() + static_cast<std::ptrdiff_t>(k), stack_.end());
    stack_.resize(k - 1);
    return items;
  }
  void put(std::uint64_t index) {
    if (index > (1u << 26)) fail("a memo index out of range");
    if (memo_.size() <= index) memo_.resize(static_cast<std::size_t>(index) + 1);
    memo_[static_cast<std::size_t>(index)] = top();
  }
  value_ptr memo_at(std::uint64_t index) {
    if (index >= memo_.size() || memo_[static_cast<std::size_t>(index)] == nullptr) fail("a memo index never stored");
    return memo_[static_cast<std::size_t>(index)];
  }
  value* list_of(value_ptr& v) { if (v->t != value::type::list) fail("APPEND to something not a list"); return v.get(); }
  value* dict_of(value_ptr& v) { if (v->t != value::type::dict) fail("SETITEM on something not a dict"); return v.get(); }

  const std::string& data_;
  const std::string& source_;
  std::size_t pos_ = 0;
  int proto_ = 0;
  std::vector<value_ptr> stack_;
  std::vector<value_ptr> memo_;
};

std::int64_t integer(const value* v, const char* key, const std::string& where) {
  if (v == nullptr || (v->t != value::type::integer && v->t != value::type::boolean))
    throw invalid_argument(where + ": '" + key + "' missing or not an integer");
  return v->i;
}

}  // namespace

bool looks_like_pickle(const std::string& bytes) noexcept {
  return bytes.size() >= 3 && static_cast<std::uint8_t>(bytes[0]) == 0x80 &&
         static_cast<std::uint8_t>(bytes[1]) >= 2 && static_cast<std::uint8_t>(bytes[1]) <= 5;
}

std::string torch_snapshot_to_trace_csv(const std::string& bytes, const std::string& source,
                                        int device) {
  const value_ptr root = unpickler(bytes, source).load();
  const std::string where = "torch snapshot '" + source + "'";
  if (root->t != value::type::dict || root->get("segments") == nullptr)
    throw invalid_argument(where + ": not a PyTorch memory snapshot (no 'segments')");
  const value* traces = root->get("device_traces");
  if (traces == nullptr || traces->t != value::type::list)
    throw invalid_argument(where + ": no 'device_traces' (record the snapshot with "
                           "torch.cuda.memory._record_memory_history() on)");
  if (device >= 0 && static_cast<std::size_t>(device) >= traces->items.size())
    throw invalid_argument(where + ": no device " + std::to_string(device) + " (" +
                           std::to_string(traces->items.size()) + " device trace(s))");
  if (device < 0) {  // the device with the most entries
    std::size_t most = 0;
    for (std::size_t d = 0; d < traces->items.size(); ++d)
      if (traces->items[d]->t == value::type::list && traces->items[d]->items.size() > most) {
        most = traces->items[d]->items.size();
        device = static_cast<int>(d);
      }
    if (device < 0)
      throw invalid_argument(where + ": every device trace is empty (record the snapshot with "
                             "torch.cuda.memory._record_memory_history() on)");
  }
  const value* trace = traces->items[static_cast<std::size_t>(device)].get();
  if (trace->t != value::type::list)
    throw invalid_argument(where + ": device_traces[" + std::to_string(device) + "] is not a list");
  std::string csv = "action,addr,size,stream,time_us\n";
  std::size_t index = 0;
  for (const value_ptr& e : trace->items) {
    const std::string at = where + " device " + std::to_string(device) + " entry " + std::to_string(index++);
    if (e->t != value::type::dict) throw invalid_argument(at + ": not a dict");
    const value* action = e->get("action");
    if (action == nullptr || action->t != value::type::text)
      throw invalid_argument(at + ": 'action' missing");
    if (action->s != "alloc" && action->s != "free_completed") continue;  // what replay drives
    csv += action->s;
    csv += ',' + std::to_string(static_cast<std::uint64_t>(integer(e->get("addr"), "addr", at)));
    csv += ',' + std::to_string(integer(e->get("size"), "size", at));
    csv += ',' + std::to_string(static_cast<std::uint64_t>(integer(e->get("stream"), "stream", at)));
    const value* t = e->get("time_us");
    csv += ',';
    if (t != nullptr && t->t == value::type::integer) csv += std::to_string(t->i);
    csv += '\n';
  }
  return csv;
}

}  // namespace gpumem
