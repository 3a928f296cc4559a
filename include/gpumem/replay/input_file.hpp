// A file's bytes as they stream, bounded: every reader of a file given on the command line
// (traces, snapshot pickles, serve-sim workloads) reads through it, so none reads without
// a limit, whatever the file is (a FIFO, /dev/zero, a gzip bomb).
//
// Invariants: at most `max_bytes` bytes are ever handed out (decompressed), and at most
// `max_bytes` + one read buffer of the file itself is consumed (compressed); a file over
// the limit is refused, while streaming, with an invalid_argument naming the file and the
// limit. A gzip'd file is read through zlib (a plain file passes through it unchanged); a
// gzip stream that ends early or is corrupt is refused. Built without zlib, a gzip'd file
// is refused with that reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gpumem {

class input_file {
 public:
  // `what` opens every message ("trace", "serve-sim: workload"). Throws invalid_argument
  // naming the file when it cannot be opened.
  input_file(std::string path, std::string what, std::uint64_t max_bytes);
  ~input_file();
  input_file(const input_file&) = delete;
  input_file& operator=(const input_file&) = delete;

  // Up to `n` more bytes into `buf`; 0 at the end of the data. Throws naming the file and
  // `line` (where the data stopped; 0: no line) when it cannot be read, its gzip stream is
  // corrupt or ends early, or it holds more than the limit.
  std::size_t read(char* buf, std::size_t n, std::size_t line = 0);

  // A gzip stream yields what it decompresses before its checksum, at its end, shows it
  // corrupt: the error the rest of a gzip'd file gives, read (within the limit) and
  // dropped ("" if none).
  std::string error_in_rest();

  const std::string& path() const noexcept { return path_; }
  std::uint64_t max_bytes() const noexcept { return max_bytes_; }
  std::uint64_t bytes_read() const noexcept { return handed_out_; }

 private:
  std::string read_some(char* buf, std::size_t n, std::size_t& got);
  std::string where(std::size_t line) const;

  std::string path_, what_;
  std::uint64_t max_bytes_;
  std::uint64_t handed_out_ = 0;
  void* file_ = nullptr;  // gzFile, or FILE* built without zlib
};

// The whole of a file, within `max_bytes` (refused over it, naming the file and the limit).
std::string read_bounded(const std::string& path, const std::string& what, std::uint64_t max_bytes);

}  // namespace gpumem
