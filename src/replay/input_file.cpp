// A file's bytes as they stream, bounded (replay/input_file.hpp). The file is read in
// chunks of its own bytes and, when it starts with gzip's magic, inflated here chunk by
// chunk (zlib's inflate, not gzread: gzread may consume any number of empty gzip members
// in one call), so both the bytes read from the file and the bytes handed out are counted
// against the limit as they pass.
#include "gpumem/replay/input_file.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "gpumem/backend/memory_resource.hpp"
#include "gpumem/errors.hpp"

#if GPUMEM_HAVE_ZLIB
#include <zlib.h>
#endif

namespace gpumem {

namespace {

constexpr std::size_t raw_chunk = 64 * 1024;

// The file and, for a gzip'd one, the inflate state and the raw bytes not yet inflated.
struct source {
  std::FILE* file = nullptr;
  bool gzip = false;
  bool stream_ended = false;  // the last gzip member ended (its checksum matched)
  bool eof = false;           // the file itself is read to its end
  std::uint64_t raw_read = 0;
  std::vector<unsigned char> raw;
  std::size_t raw_pos = 0;  // a plain file's bytes in `raw` before this are handed out
#if GPUMEM_HAVE_ZLIB
  z_stream z{};
  bool z_open = false;
#endif
  ~source() {
#if GPUMEM_HAVE_ZLIB
    if (z_open) inflateEnd(&z);
#endif
    if (file != nullptr) std::fclose(file);
  }
};

}  // namespace

input_file::input_file(std::string path, std::string what, std::uint64_t max_bytes)
    : path_(std::move(path)), what_(std::move(what)), max_bytes_(max_bytes) {
  auto s = std::make_unique<source>();
  s->file = std::fopen(path_.c_str(), "rb");
  if (s->file == nullptr)
    throw invalid_argument(what_ + ": cannot open '" + path_ + "': " + std::strerror(errno));
  s->raw.resize(raw_chunk);
  // The first two bytes decide: gzip's magic, or plain bytes handed out as they are.
  const int first = std::fgetc(s->file);
  const int second = first == EOF ? EOF : std::fgetc(s->file);
  s->gzip = first == 0x1f && second == 0x8b;
  if (s->gzip) {
#if GPUMEM_HAVE_ZLIB
    if (inflateInit2(&s->z, 15 + 16) != Z_OK)
      throw invalid_argument(what_ + ": '" + path_ + "': zlib could not start");
    s->z_open = true;
    s->raw[0] = 0x1f;
    s->raw[1] = 0x8b;
    s->z.next_in = s->raw.data();
    s->z.avail_in = 2;
    s->raw_read = 2;
#else
    throw invalid_argument(what_ + ": '" + path_ +
                           "' is gzip-compressed, and this gpumem was built without zlib: "
                           "decompress it first (gunzip), or rebuild with zlib (zlib1g-dev)");
#endif
  } else {
    // Whatever was read goes back: a FIFO cannot seek, so the bytes are kept, and the
    // chunk filled behind them (the first read sees a whole chunk, as later ones do).
    std::size_t kept = 0;
    if (first != EOF) s->raw[kept++] = static_cast<unsigned char>(first);
    if (second != EOF) s->raw[kept++] = static_cast<unsigned char>(second);
    const std::size_t r = second == EOF ? 0 : std::fread(s->raw.data() + kept, 1, raw_chunk - kept, s->file);
    if (r == 0 && std::ferror(s->file))
      throw invalid_argument(what_ + ": " + path_ + ": cannot read: " + std::strerror(errno));
    if (second == EOF || std::feof(s->file)) s->eof = true;
    s->raw.resize(kept + r);
    s->raw_read = kept + r;
  }
  file_ = s.release();
}

input_file::~input_file() { delete static_cast<source*>(file_); }

std::string input_file::where(std::size_t line) const {
  return what_ + ": " + path_ + (line > 0 ? ":" + std::to_string(line) : std::string()) + ": ";
}

std::size_t input_file::read(char* buf, std::size_t n, std::size_t line) {
  std::size_t got = 0;
  if (const std::string why = read_some(buf, n, got); !why.empty())
    throw invalid_argument(where(line) + why);
  return got;
}

std::string input_file::error_in_rest() {
  auto* s = static_cast<source*>(file_);
  if (!s->gzip) return "";
  std::vector<char> buf(raw_chunk);
  for (;;) {
    std::size_t got = 0;
    if (std::string why = read_some(buf.data(), buf.size(), got); !why.empty()) return why;
    if (got == 0) return "";
  }
}

std::string input_file::read_some(char* buf, std::size_t n, std::size_t& got) {
  auto* s = static_cast<source*>(file_);
  got = 0;
  const std::string over = "more than " + format_bytes(static_cast<std::size_t>(max_bytes_)) +
                           ", this reader's limit: refused";
  // One byte past the limit is asked for, so a file of exactly the limit is read whole.
  if (handed_out_ >= max_bytes_) n = std::min<std::size_t>(n, 1);
  auto fill_raw = [&]() -> std::string {  // more raw bytes into s->raw; "" or why not
    if (s->eof) {
      s->raw.clear();
      return "";
    }
    if (s->raw_read > max_bytes_ + raw_chunk) return "its data runs to " + over;
    s->raw.resize(raw_chunk);
    const std::size_t r = std::fread(s->raw.data(), 1, raw_chunk, s->file);
    if (r == 0 && std::ferror(s->file)) return std::string("cannot read: ") + std::strerror(errno);
    if (r < raw_chunk && std::feof(s->file)) s->eof = true;
    s->raw.resize(r);
    s->raw_read += r;
    return "";
  };
  if (!s->gzip) {
    if (s->raw_pos == s->raw.size()) {
      if (std::string why = fill_raw(); !why.empty()) return why;
      s->raw_pos = 0;
    }
    got = std::min(n, s->raw.size() - s->raw_pos);
    std::memcpy(buf, s->raw.data() + s->raw_pos, got);
    s->raw_pos += got;
  } else {
#if GPUMEM_HAVE_ZLIB
    while (got == 0 && n > 0) {
      if (s->stream_ended) {
        // Another gzip member may follow (as gzip -c a b > c writes); nothing else may.
        if (s->z.avail_in == 0) {
          if (std::string why = fill_raw(); !why.empty()) return why;
          s->z.next_in = s->raw.data();
          s->z.avail_in = static_cast<uInt>(s->raw.size());
          if (s->z.avail_in == 0) return "";
        }
        inflateReset(&s->z);
        s->stream_ended = false;
      }
      if (s->z.avail_in == 0) {
        if (std::string why = fill_raw(); !why.empty()) return why;
        s->z.next_in = s->raw.data();
        s->z.avail_in = static_cast<uInt>(s->raw.size());
        if (s->z.avail_in == 0) return "the gzip data ends early: the file is truncated";
      }
      s->z.next_out = reinterpret_cast<Bytef*>(buf);
      s->z.avail_out = static_cast<uInt>(std::min<std::size_t>(n, 1u << 30));
      const int rc = inflate(&s->z, Z_NO_FLUSH);
      got = std::min<std::size_t>(n, 1u << 30) - s->z.avail_out;
      if (rc == Z_STREAM_END) {
        s->stream_ended = true;
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        return std::string("cannot read: the gzip data is corrupt (") +
               (s->z.msg != nullptr ? s->z.msg : "inflate failed") + ")";
      }
    }
#endif
  }
  handed_out_ += got;
  if (handed_out_ > max_bytes_) return "it holds " + over;
  return "";
}

std::string read_bounded(const std::string& path, const std::string& what, std::uint64_t max_bytes) {
  input_file in(path, what, max_bytes);
  std::string all;
  std::vector<char> buf(raw_chunk);
  while (const std::size_t n = in.read(buf.data(), buf.size())) all.append(buf.data(), n);
  return all;
}

}  // namespace gpumem
