// pickle_writer: writes Python pickle protocol 2, enough for PyTorch's memory snapshot:
// dict, list, 2-tuple, str, int, bool, None, float. No memoization (nothing is shared).
//
// Opcodes used are those both Python's unpickler and PyTorch's in-browser viewer
// (MemoryViz.js) read: PROTO 2, EMPTY_DICT/EMPTY_LIST + MARK ... SETITEMS/APPENDS in
// batches of at most 1000 items (as CPython writes them; a huge single batch overflows the
// viewer's argument spread), BINUNICODE, BININT1/BININT2/BININT/LONG1, NEWTRUE/NEWFALSE,
// NONE, BINFLOAT, TUPLE2, STOP.
//
// Invariant (checked by finish()): every container opened was closed, a dict got an even
// number of items (key, value, ...). Misuse throws gpumem::invalid_argument.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gpumem::detail {

class pickle_writer {
 public:
  explicit pickle_writer(std::string& out);
  void begin_dict();
  void end_dict();
  void begin_list();
  void end_list();
  void str(std::string_view s);
  void integer(std::int64_t v);
  void boolean(bool v);
  void none();
  void real(double v);
  void tuple2(std::int64_t a, std::int64_t b);
  // key then value, inside a dict: writer.item("size", 4096)
  template <class T>
  void item(std::string_view key, const T& value) {
    str(key);
    put(value);
  }
  // Ends the pickle (STOP). REQUIRES: every container closed.
  void finish();

  static constexpr std::size_t batch = 1000;

 private:
  struct open_container {
    bool dict;
    std::size_t in_batch;  // items (dict: keys and values) since the last MARK
  };
  void put(std::string_view v) { str(v); }
  void put(const char* v) { str(v); }
  void put(const std::string& v) { str(v); }
  void put(bool v) { boolean(v); }
  void put(double v) { real(v); }
  template <class I>
  void put(I v) requires std::is_integral_v<I> { integer(static_cast<std::int64_t>(v)); }
  void raw_integer(std::int64_t v);  // the opcode alone, not counted as an item
  void value_added();  // after a complete value: batch bookkeeping
  void close(bool dict);

  std::string& out_;
  std::vector<open_container> open_;
};

}  // namespace gpumem::detail
