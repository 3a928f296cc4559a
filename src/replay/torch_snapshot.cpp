// A plain-data unpickler and the conversion of a PyTorch memory snapshot's device trace
// to trace CSV (gpumem/replay/torch_snapshot.hpp).
//
// Invariants: the reader never reads past the end of the input (every read checks the
// bytes left); no length, count or index read from the input is used before it is checked
// against the bytes left or the memory budget; every value lives in the unpickler's arena
// and refers to others by plain pointers, so no destruction or walk recurses however the
// values nest (cycles included); the value stack never pops below a mark; a value nests at
// most snapshot_max_depth deep as it is built.
#include "gpumem/replay/torch_snapshot.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"

namespace gpumem {

namespace {

struct value {
  enum class type : std::uint8_t { none, boolean, integer, real, text, bytes, list, tuple, dict, mark };
  type t = type::none;
  std::uint32_t depth = 1;  // 1 + the deepest value put into it, as built
  std::int64_t i = 0;
  double d = 0;
  std::string s;                            // text and bytes
  std::vector<value*> items;                // list and tuple
  std::vector<std::pair<value*, value*>> kv;  // dict, in insertion order

  // The value of text key `key`; the last one set wins, as in Python.
  const value* get(std::string_view key) const {
    for (auto it = kv.rbegin(); it != kv.rend(); ++it)
      if (it->first->t == type::text && it->first->s == key) return it->second;
    return nullptr;
  }
};

class unpickler {
 public:
  unpickler(const std::string& bytes, const std::string& source, std::uint64_t max_memory)
      : data_(bytes), source_(source), max_memory_(max_memory) {}

  value* load() {
    for (;;) {
      const std::uint8_t op = byte();
      switch (op) {
        case 0x80: proto_ = byte(); if (proto_ < 2) fail("pickle protocol below 2"); break;  // PROTO
        case 0x95: {                                                     // FRAME: length only
          const std::uint64_t n = le(8);
          if (n > data_.size() - pos_) fail("a frame of " + std::to_string(n) + " bytes, past the end of the data");
          break;
        }
        case '.': {                                                      // STOP
          if (stack_.size() != 1 || !marks_.empty()) fail("the pickle does not end with one value");
          return stack_.back();
        }
        case '}': push(make(value::type::dict)); break;                  // EMPTY_DICT
        case ']': push(make(value::type::list)); break;                  // EMPTY_LIST
        case ')': push(make(value::type::tuple)); break;                 // EMPTY_TUPLE
        case '(': mark(); break;                                         // MARK
        case 'N': push(make(value::type::none)); break;                  // NONE
        case 0x88: push_int(value::type::boolean, 1); break;             // NEWTRUE
        case 0x89: push_int(value::type::boolean, 0); break;             // NEWFALSE
        case 'J': push_int(value::type::integer, static_cast<std::int32_t>(le(4))); break;  // BININT
        case 'K': push_int(value::type::integer, static_cast<std::int64_t>(le(1))); break;  // BININT1
        case 'M': push_int(value::type::integer, static_cast<std::int64_t>(le(2))); break;  // BININT2
        case 0x8a: push_int(value::type::integer, long_value(le(1))); break;  // LONG1
        case 0x8b: push_int(value::type::integer, long_value(le(4))); break;  // LONG4
        case 'G': {                                                      // BINFLOAT (big-endian)
          std::uint64_t bits = 0;
          for (char c : take(8)) bits = (bits << 8) | static_cast<std::uint8_t>(c);
          value* v = make(value::type::real);
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
        case 0x94: put(memo_next_); break;                               // MEMOIZE
        case 'q': put(le(1)); break;                                     // BINPUT
        case 'r': put(le(4)); break;                                     // LONG_BINPUT
        case 'h': push(memo_at(le(1))); break;                           // BINGET
        case 'j': push(memo_at(le(4))); break;                           // LONG_BINGET
        default:
          if (!build(op)) refuse_opcode(op);
      }
    }
  }

 private:
  // The opcodes that build containers from values on the stack; false for any other.
  bool build(std::uint8_t op) {
    switch (op) {
      case 'a': { value* v = pop(); append(list_of(top()), v); break; }  // APPEND
      case 'e': {                                                      // APPENDS
        const std::size_t from = pop_mark();
        value* l = list_of(top_below(from));
        for (std::size_t k = from; k < stack_.size(); ++k) append(l, stack_[k]);
        stack_.resize(from);
        break;
      }
      case 's': { value* v = pop(); value* k = pop(); set_item(dict_of(top()), k, v); break; }
      case 'u': {                                                      // SETITEMS
        const std::size_t from = pop_mark();
        if ((stack_.size() - from) % 2 != 0) fail("SETITEMS with an odd number of values");
        value* d = dict_of(top_below(from));
        for (std::size_t k = from; k < stack_.size(); k += 2) set_item(d, stack_[k], stack_[k + 1]);
        stack_.resize(from);
        break;
      }
      case 't': {                                                      // TUPLE
        const std::size_t from = pop_mark();
        value* v = make(value::type::tuple);
        for (std::size_t k = from; k < stack_.size(); ++k) append(v, stack_[k]);
        stack_.resize(from);
        push(v);
        break;
      }
      case 0x85: case 0x86: case 0x87: {                               // TUPLE1..3
        const std::size_t n = op - 0x84u;
        if (stack_.size() < n + marks_floor()) fail("an opcode with no value to act on");
        value* v = make(value::type::tuple);
        for (std::size_t k = stack_.size() - n; k < stack_.size(); ++k) append(v, stack_[k]);
        stack_.resize(stack_.size() - n);
        push(v);
        break;
      }
      default:
        return false;
    }
    return true;
  }
  [[noreturn]] void refuse_opcode(std::uint8_t op) const {
    char text[192];
    std::snprintf(text, sizeof text,
                  "pickle opcode 0x%02x at byte %zu is not plain data (refused: only "
                  "dicts, lists, strings and numbers are read)", op, pos_ - 1);
    fail(text);
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw invalid_argument("torch snapshot '" + source_ + "': " + what);
  }
  // Memory about to be held for the values: refused past the budget.
  void charge(std::uint64_t bytes) {
    if (bytes > max_memory_ - std::min(used_, max_memory_))
      fail("its values take more than " + format_bytes(static_cast<std::size_t>(max_memory_)) +
           " of memory, the limit of this reader (at byte " + std::to_string(pos_) + ")");
    used_ += bytes;
  }
  value* make(value::type t) {
    charge(sizeof(value) + 16);
    value* v = &arena_.emplace_back();
    v->t = t;
    return v;
  }
  std::uint8_t byte() {
    if (pos_ >= data_.size()) fail("truncated pickle (no STOP)");
    return static_cast<std::uint8_t>(data_[pos_++]);
  }
  std::string_view take(std::uint64_t n) {
    if (n > data_.size() - pos_)
      fail("truncated pickle (" + std::to_string(n) + " bytes asked at byte " +
           std::to_string(pos_) + ", " + std::to_string(data_.size() - pos_) + " left)");
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
  void push(value* v) {
    charge(sizeof(value*));
    stack_.push_back(v);
  }
  void push_int(value::type t, std::int64_t i) { value* v = make(t); v->i = i; push(v); }
  void push_text(std::uint64_t n, value::type t) {
    const std::string_view bytes = take(n);  // checked against the data left first
    charge(n);
    value* v = make(t);
    v->s = std::string(bytes);
    push(v);
  }
  // Nesting `child` in `parent`: one level deeper than the child, within the bound.
  void nest(value* parent, const value* child) {
    if (child->depth >= snapshot_max_depth)
      fail("values nested more than " + std::to_string(snapshot_max_depth) + " deep (at byte " +
           std::to_string(pos_) + ")");
    parent->depth = std::max(parent->depth, child->depth + 1);
  }
  void append(value* parent, value* child) {
    nest(parent, child);
    charge(sizeof(value*));
    parent->items.push_back(child);
  }
  void set_item(value* d, value* k, value* v) {
    nest(d, k);
    nest(d, v);
    charge(2 * sizeof(value*));
    d->kv.emplace_back(k, v);
  }
  void mark() {
    charge(sizeof(std::size_t));
    marks_.push_back(stack_.size());
  }
  std::size_t marks_floor() const { return marks_.empty() ? 0 : marks_.back(); }
  value* top() {
    if (stack_.size() <= marks_floor()) fail("an opcode with no value to act on");
    return stack_.back();
  }
  // The value just below stack position `from` (the one a multi-value opcode acts on).
  value* top_below(std::size_t from) {
    if (from <= marks_floor()) fail("an opcode with no value to act on");
    return stack_[from - 1];
  }
  value* pop() { value* v = top(); stack_.pop_back(); return v; }
  // The stack position of the values after the last MARK (which goes).
  std::size_t pop_mark() {
    if (marks_.empty()) fail("no MARK for a multi-value opcode");
    const std::size_t from = marks_.back();
    marks_.pop_back();
    return from;
  }
  void put(std::uint64_t index) {
    value* v = top();
    auto [it, fresh] = memo_.try_emplace(index, v);
    if (fresh) {
      charge(64);
      memo_next_ = std::max(memo_next_, index + 1);
    } else {
      it->second = v;
    }
  }
  value* memo_at(std::uint64_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) fail("a memo index never stored (" + std::to_string(index) + ")");
    return it->second;
  }
  value* list_of(value* v) { if (v->t != value::type::list) fail("APPEND to something not a list"); return v; }
  value* dict_of(value* v) { if (v->t != value::type::dict) fail("SETITEM on something not a dict"); return v; }

  const std::string& data_;
  const std::string& source_;
  const std::uint64_t max_memory_;
  std::uint64_t used_ = 0;
  std::size_t pos_ = 0;
  int proto_ = 0;
  std::deque<value> arena_;  // every value; destroyed one by one, never recursively
  std::vector<value*> stack_;
  std::vector<std::size_t> marks_;  // stack positions of the open MARKs
  std::unordered_map<std::uint64_t, value*> memo_;
  std::uint64_t memo_next_ = 0;  // MEMOIZE's index: one past the highest stored

 public:
  unpickler(const unpickler&) = delete;
  unpickler& operator=(const unpickler&) = delete;
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
                                        int device, std::uint64_t max_memory,
                                        std::uint64_t max_csv_bytes) {
  unpickler reader(bytes, source, max_memory);
  const value* root = reader.load();
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
  const value* trace = traces->items[static_cast<std::size_t>(device)];
  if (trace->t != value::type::list)
    throw invalid_argument(where + ": device_traces[" + std::to_string(device) + "] is not a list");
  std::string csv = "action,addr,size,stream,time_us\n";
  // An entry seen before (the memo lets one dict appear any number of times) gives the line
  // it gave then: each dict's keys are scanned once, so the work is linear in the input.
  std::unordered_map<const value*, std::string> lines;
  std::size_t index = 0;
  for (const value* e : trace->items) {
    auto [it, fresh] = lines.try_emplace(e);
    if (fresh) {
      const std::string at =
          where + " device " + std::to_string(device) + " entry " + std::to_string(index);
      if (e->t != value::type::dict) throw invalid_argument(at + ": not a dict");
      const value* action = e->get("action");
      if (action == nullptr || action->t != value::type::text)
        throw invalid_argument(at + ": 'action' missing");
      if (action->s == "alloc" || action->s == "free_completed") {  // what replay drives
        std::string& line = it->second;
        line = action->s;
        line += ',' + std::to_string(static_cast<std::uint64_t>(integer(e->get("addr"), "addr", at)));
        line += ',' + std::to_string(integer(e->get("size"), "size", at));
        line += ',' + std::to_string(static_cast<std::uint64_t>(integer(e->get("stream"), "stream", at)));
        const value* t = e->get("time_us");
        line += ',';
        if (t != nullptr && t->t == value::type::integer) line += std::to_string(t->i);
        line += '\n';
      }
    }
    ++index;
    if (csv.size() + it->second.size() > max_csv_bytes)
      throw invalid_argument(where + ": its trace is more than " +
                             format_bytes(static_cast<std::size_t>(max_csv_bytes)) +
                             " of trace text, the limit of this reader (at entry " +
                             std::to_string(index - 1) + ")");
    csv += it->second;
  }
  return csv;
}

}  // namespace gpumem
