// An SVG picture of a replay: live bytes and each allocator's reserved bytes over the
// trace's events (first pass), so the gap between them — what an allocator holds and does
// not use — is seen, not only tabulated.
#pragma once

#include <string>
#include <vector>

#include "gpumem/replay/trace.hpp"

namespace gpumem {

// A self-contained SVG document. REQUIRES: results come from replays of one trace.
std::string render_replay_svg(const std::vector<replay_result>& results, const std::string& title);

}  // namespace gpumem
