// The trade-off plot of gpumem replay: the JSON reader behind --tradeoff-points (values,
// escapes, refusals naming the file and byte), the shapes of points it accepts, and the SVG
// (a point per trace and allocator, a legend entry per allocator, points without figures
// left out and counted).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "gpumem/errors.hpp"
#include "gpumem/replay/plot.hpp"
#include "../../tools/json_reader.hpp"
#include "../../tools/tradeoff_points.hpp"

namespace {

using namespace gpumem;
using namespace gpumem::cli;

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(JsonReader, ReadsValuesAndEscapes) {
  const json_value v = parse_json(
      R"( {"a": [1, -2.5e3, true, false, null], "s": "x\"\\\n\u00e9\ud83d\ude00", "o": {}} )", "t");
  ASSERT_EQ(v.k, json_value::kind::object);
  const json_value* a = v.find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items.size(), 5u);
  EXPECT_EQ(a->items[0].number, 1);
  EXPECT_EQ(a->items[1].number, -2500);
  EXPECT_TRUE(a->items[2].b);
  EXPECT_EQ(a->items[3].k, json_value::kind::boolean);
  EXPECT_EQ(a->items[4].k, json_value::kind::null);
  EXPECT_EQ(v.find("s")->text, "x\"\\\n\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_EQ(v.find("o")->k, json_value::kind::object);
  EXPECT_EQ(v.find("missing"), nullptr);
  EXPECT_EQ(a->find("a"), nullptr);  // not an object
}

TEST(JsonReader, RefusesMalformedTextNamingTheSourceAndByte) {
  for (const char* bad : {"", "{", "[1,]", "{\"a\" 1}", "{'a': 1}", "01x", "1 2", "\"abc",
                          "\"\\q\"", "\"\\u12\"", "tru", "[-]", "1.", "1e", "{\"a\":1,}",
                          "\"a\nb\""}) {
    try {
      (void)parse_json(bad, "figures.json");
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("figures.json: not valid JSON at byte"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW((void)parse_json(std::string(json_max_depth + 1, '['), "deep"), invalid_argument);
}

class TradeoffPoints : public ::testing::Test {
 protected:
  std::string path = (std::filesystem::temp_directory_path() /
                      ("gpumem_tradeoff_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
                       "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".json"))
                         .string();
  void write(const std::string& text) { std::ofstream(path) << text; }
  void TearDown() override { std::remove(path.c_str()); }
};

TEST_F(TradeoffPoints, ReadsReplayJsonOfSeveralTracesPreferringModelledTimes) {
  write(R"({"traces": [
    {"trace": "a.csv.gz", "results": [
      {"allocator": "vmm_page_pool", "fragmentation": 1.2, "ns_per_event": 100,
       "modelled_ns_per_event": 350},
      {"allocator": "caching_pool", "fragmentation": 1.5, "ns_per_event": 40, "oom": false},
      {"allocator": "runtime", "fragmentation": 1.0, "ns_per_event": 9, "oom": true}]},
    {"trace": "b.csv.gz", "error": "cannot read"}], "failed_traces": 1})");
  const auto points = read_tradeoff_points(path);
  ASSERT_EQ(points.size(), 2u);  // the out-of-memory result and the failed trace left out
  EXPECT_EQ(points[0].trace, "a.csv.gz");
  EXPECT_EQ(points[0].allocator, "vmm_page_pool");
  EXPECT_EQ(points[0].ns_per_event, 350);
  EXPECT_EQ(points[1].fragmentation, 1.5);
  EXPECT_EQ(points[1].ns_per_event, 40);
}

TEST_F(TradeoffPoints, ReadsOneTraceAndFlatArrays) {
  write(R"({"trace": "t", "results": [{"allocator": "x", "fragmentation": 1.1, "ns_per_event": 5}]})");
  EXPECT_EQ(read_tradeoff_points(path).size(), 1u);
  write(R"([{"trace": "t", "allocator": "pytorch c10", "fragmentation": 1.52, "ns_per_event": 579},
             {"trace": "t", "allocator": "gpumem caching_pool", "oom": true}])");
  const auto points = read_tradeoff_points(path);
  ASSERT_EQ(points.size(), 1u);
  EXPECT_EQ(points[0].allocator, "pytorch c10");
}

TEST_F(TradeoffPoints, RefusesOtherShapesAndMissingFieldsNamingTheFile) {
  for (const char* bad : {R"({"summary": []})", R"([{"trace": "t", "allocator": "x"}])",
                          R"([{"trace": 1, "allocator": "x", "fragmentation": 1, "ns_per_event": 1}])",
                          R"({"traces": [{"trace": "t", "results": [{"allocator": "x"}]}]})",
                          "not json"}) {
    write(bad);
    try {
      (void)read_tradeoff_points(path);
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  std::remove(path.c_str());
  EXPECT_THROW((void)read_tradeoff_points(path), invalid_argument);  // no such file
}

TEST(TradeoffPlot, DrawsAPointPerTraceAndAllocatorAndALegendPerAllocator) {
  const std::vector<tradeoff_point> points = {
      {"train<1>", "vmm_page_pool", 1.01, 1200}, {"train<1>", "caching_pool", 1.5, 60},
      {"infer", "vmm_page_pool", 1.005, 30},     {"infer", "caching_pool", 1.07, 25},
      {"bad", "caching_pool", std::nan(""), 10}, {"zero", "vmm_page_pool", 1.1, 0}};
  const std::string svg = render_tradeoff_svg(points, "a & b");
  EXPECT_EQ(count(svg, "<title>"), 4u);
  EXPECT_EQ(count(svg, "<circle"), 4u + 2u);  // four points, two legend marks
  EXPECT_NE(svg.find("train&lt;1&gt; (vmm_page_pool): 1.0100, 1200 ns/event"), std::string::npos);
  EXPECT_NE(svg.find("a &amp; b"), std::string::npos);
  EXPECT_NE(svg.find("2 point(s) without figures left out"), std::string::npos);
  EXPECT_EQ(count(svg, "<svg"), 1u);
  EXPECT_NE(render_tradeoff_svg({}, "empty").find("</svg>"), std::string::npos);
}

}  // namespace
