// The replay plot: one reserved curve per allocator, the live curve once, escaped text.
#include <gtest/gtest.h>

#include <string>

#include "gpumem/backend.hpp"
#include "gpumem/platform.hpp"
#include "gpumem/pool.hpp"
#include "gpumem/replay/plot.hpp"
#include "gpumem/replay/trace.hpp"

namespace {

using namespace gpumem;

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(ReplayPlot, DrawsEachAllocatorAndTheLiveCurve) {
  const trace t = parse_trace(
      "action,addr,size,stream,time_us\n"
      "alloc,4096,3145728,0,1\nalloc,8192,1048576,0,2\nfree_completed,4096,3145728,0,3\n"
      "alloc,12288,6291456,0,4\nfree_completed,8192,1048576,0,5\nfree_completed,12288,6291456,0,6\n",
      "inline");
  std::vector<replay_result> results;
  {
    sim_platform sim;
    runtime_resource runtime(sim, 0);
    results.push_back(replay_trace(t, runtime, {}));
  }
  {
    sim_platform sim;
    vmm_page_pool pool(sim, 0);
    results.push_back(replay_trace(t, pool, {}));
  }
  const std::string svg = render_replay_svg(results, "a <title> & more");
  EXPECT_EQ(svg.rfind("<?xml", 0), 0u);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_EQ(count(svg, "<polyline"), results.size() + 1) << "one reserved curve each, live once";
  EXPECT_NE(svg.find("a &lt;title&gt; &amp; more"), std::string::npos);
  EXPECT_EQ(svg.find("<title>"), std::string::npos) << "text must be escaped";
  EXPECT_NE(svg.find("runtime 1.000"), std::string::npos) << svg;
  EXPECT_NE(svg.find("vmm_page_pool"), std::string::npos);
  // The vmm pool reserves whole 2 MiB pages: its peak (8 MiB for 7 MiB live) labels the axis.
  EXPECT_NE(svg.find("8.00 MiB"), std::string::npos) << svg;
}

}  // namespace
