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
// arrivals non-decreasing and finite, output tokens and samples >= 1, at least one prompt
// token, tokens 0..2^31-1. Requests sharing a prompt prefix share its token ids there.
#pragma once

#include <cstddef>
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

// Throws gpumem::invalid_argument naming the file (and the line) when it cannot be read,
// holds no request, or a line is not a request as described above.
std::vector<serve_request> read_serve_workload(const std::string& path);

}  // namespace gpumem::cli
