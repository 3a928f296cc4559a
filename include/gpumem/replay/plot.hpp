// SVG pictures of replays:
//  - render_replay_svg: live bytes and each allocator's reserved bytes over the trace's
//    events (first pass), so the gap between them — what an allocator holds and does not
//    use — is seen, not only tabulated;
//  - render_tradeoff_svg: one point per trace and allocator, fragmentation (peak reserved /
//    peak live) against warm ns per event (log scale), so memory and speed are seen
//    together across many traces.
#pragma once

#include <string>
#include <vector>

#include "gpumem/replay/trace.hpp"

namespace gpumem {

// A self-contained SVG document. REQUIRES: results come from replays of one trace.
std::string render_replay_svg(const std::vector<replay_result>& results, const std::string& title);

// One trace replayed on one allocator, for the trade-off picture.
struct tradeoff_point {
  std::string trace;
  std::string allocator;
  double fragmentation = 0;  // peak reserved / peak live
  double ns_per_event = 0;   // the warm pass's (on sim: modelled)
};

// A self-contained SVG document: a colour per allocator (in order of first appearance),
// each point titled with its trace. Points whose figures are not positive and finite are
// left out, counted in a note. REQUIRES: nothing (an empty list draws empty axes).
std::string render_tradeoff_svg(const std::vector<tradeoff_point>& points, const std::string& title);

}  // namespace gpumem
