#include "telemetry/pickle_writer.hpp"

#include <bit>
#include <cstring>

#include "gpumem/errors.hpp"

namespace gpumem::detail {

namespace {
constexpr char PROTO = '\x80', STOP = '.', MARK = '(', EMPTY_DICT = '}', EMPTY_LIST = ']',
               SETITEMS = 'u', APPENDS = 'e', BINUNICODE = 'X', BININT1 = 'K', BININT2 = 'M',
               BININT = 'J', LONG1 = '\x8a', NEWTRUE = '\x88', NEWFALSE = '\x89', NONE = 'N',
               BINFLOAT = 'G', TUPLE2 = '\x86';

void put_le(std::string& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
}  // namespace

pickle_writer::pickle_writer(std::string& out) : out_(out) {
  out_.push_back(PROTO);
  out_.push_back('\x02');
}

void pickle_writer::value_added() {
  if (open_.empty()) return;
  open_container& c = open_.back();
  ++c.in_batch;
  // A batch ends after `batch` items (a dict: `batch` key-value pairs).
  if (c.in_batch == (c.dict ? 2 * batch : batch)) {
    out_.push_back(c.dict ? SETITEMS : APPENDS);
    out_.push_back(MARK);
    c.in_batch = 0;
  }
}

void pickle_writer::begin_dict() {
  out_.push_back(EMPTY_DICT);
  out_.push_back(MARK);
  open_.push_back({true, 0});
}

void pickle_writer::begin_list() {
  out_.push_back(EMPTY_LIST);
  out_.push_back(MARK);
  open_.push_back({false, 0});
}

void pickle_writer::close(bool dict) {
  if (open_.empty() || open_.back().dict != dict)
    throw invalid_argument(std::string("pickle_writer: end_") + (dict ? "dict" : "list") +
                           " without a matching begin");
  if (dict && open_.back().in_batch % 2 != 0)
    throw invalid_argument("pickle_writer: a dict key has no value");
  out_.push_back(dict ? SETITEMS : APPENDS);
  open_.pop_back();
  value_added();
}

void pickle_writer::end_dict() { close(true); }
void pickle_writer::end_list() { close(false); }

void pickle_writer::str(std::string_view s) {
  out_.push_back(BINUNICODE);
  put_le(out_, s.size(), 4);
  out_.append(s);
  value_added();
}

void pickle_writer::integer(std::int64_t v) {
  raw_integer(v);
  value_added();
}

void pickle_writer::raw_integer(std::int64_t v) {
  if (v >= 0 && v < 256) {
    out_.push_back(BININT1);
    put_le(out_, static_cast<std::uint64_t>(v), 1);
  } else if (v >= 0 && v < 65536) {
    out_.push_back(BININT2);
    put_le(out_, static_cast<std::uint64_t>(v), 2);
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out_.push_back(BININT);
    put_le(out_, static_cast<std::uint64_t>(v), 4);
  } else {
    // LONG1: the shortest little-endian two's complement that keeps the sign.
    const auto u = static_cast<std::uint64_t>(v);
    int n = 8;
    while (n > 1) {
      const std::uint8_t top = static_cast<std::uint8_t>(u >> (8 * (n - 1)));
      const bool next_negative = ((u >> (8 * (n - 2))) & 0x80) != 0;
      if ((top == 0x00 && !next_negative) || (top == 0xff && next_negative))
        --n;
      else
        break;
    }
    out_.push_back(LONG1);
    out_.push_back(static_cast<char>(n));
    put_le(out_, u, n);
  }
}

void pickle_writer::boolean(bool v) {
  out_.push_back(v ? NEWTRUE : NEWFALSE);
  value_added();
}

void pickle_writer::none() {
  out_.push_back(NONE);
  value_added();
}

void pickle_writer::real(double v) {
  out_.push_back(BINFLOAT);
  const auto bits = std::bit_cast<std::uint64_t>(v);
  for (int i = 7; i >= 0; --i) out_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  value_added();
}

void pickle_writer::tuple2(std::int64_t a, std::int64_t b) {
  // The two ints are the tuple's, not items of the enclosing container.
  raw_integer(a);
  raw_integer(b);
  out_.push_back(TUPLE2);
  value_added();
}

void pickle_writer::finish() {
  if (!open_.empty())
    throw invalid_argument("pickle_writer: " + std::to_string(open_.size()) +
                           " container(s) still open at finish");
  out_.push_back(STOP);
}

}  // namespace gpumem::detail
