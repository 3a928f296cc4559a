// A request of `gpumem serve-sim`, and workload files: the simulation serves requests it
// generates from a seed (serve_sim.hpp), or the requests of a file, so it can predict what
// a real engine sees for the very requests that engine served
// (examples/serve_llama.py --workload-out writes one).
//
// Workload file (text): lines beginning with '#' and blank lines are ignored; every other
// line is one request,
//
//   ARRIVAL_SECONDS OUTPUT_TOKENS SAMPLES TOKEN TOKEN ...
//
// arrivals non-decreasing in 0..serve_max_arrival_seconds, output tokens in
// 1..serve_max_output_tokens, samples in 1..serve_max_samples, at least one prompt token,
// tokens 0..2^31-1 (decimal digits). Requests sharing a prompt prefix share its token ids
// there. The file is read as it streams, plain or gzip'd, within a limit on its bytes
// (replay/input_file.hpp), and cut into lines by the rule every text reader shares
// (replay/text_lines.hpp: a leading UTF-8 byte-order mark skipped, CRLF read as LF, a NUL
// or other control byte refused as binary data, a line over serve_max_line refused).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpumem/kv/prefix_hash.hpp"

namespace gpumem::cli {

struct serve_request {
  double arrival = 0;  // seconds from the start
  std::vector<token_id> prompt;
  std::size_t output = 0;   // tokens generated per sample
  std::size_t samples = 1;  // sequences the request forks into
};

// The ranges of a request's fields. Arrivals span at most a day of serving (3.5 million
// steps of the simulation).
inline constexpr double serve_max_arrival_seconds = 86400;
inline constexpr std::size_t serve_max_output_tokens = std::size_t{1} << 32;
inline constexpr std::size_t serve_max_samples = 1024;
// The longest line (a prompt of some 100,000 tokens), and the most bytes a file may hold
// (decompressed; the requests read take at most about 12 x as much memory: a one-token
// request from an 8-byte line).
inline constexpr std::size_t serve_max_line = 1 << 20;
inline constexpr std::uint64_t serve_max_workload_bytes = std::uint64_t{256} << 20;

// Throws gpumem::invalid_argument naming the file (and the line, and the field with its
// value and range) when it cannot be read, holds more than `max_bytes`, holds no request,
// or a line is not a request as described above.
std::vector<serve_request> read_serve_workload(const std::string& path,
                                               std::uint64_t max_bytes = serve_max_workload_bytes);

}  // namespace gpumem::cli
