#include "tradeoff_points.hpp"

#include <fstream>
#include <sstream>

#include "gpumem/errors.hpp"
#include "json_reader.hpp"

namespace gpumem::cli {

void add_tradeoff_points(const std::string& trace, const std::vector<replay_result>& results,
                         bool on_sim, std::vector<tradeoff_point>& points) {
  for (const replay_result& r : results) {
    if (r.oom) continue;  // no whole warm pass to time
    const double ns = r.ns_per_event_warm + (on_sim ? r.driver_ns_per_event_warm : 0.0);
    points.push_back({trace, r.allocator, r.fragmentation, ns});
  }
}

namespace {

const json_value& member(const json_value& v, const char* name, json_value::kind k,
                         const std::string& where) {
  const json_value* m = v.find(name);
  if (m == nullptr || m->k != k)
    throw invalid_argument(where + ": a point needs \"" + name + "\" (" +
                           (k == json_value::kind::string ? "a string" : "a number") + ")");
  return *m;
}

// A trace object of `gpumem replay --json`.
void add_trace(const json_value& t, const std::string& where, std::vector<tradeoff_point>& points) {
  if (t.find("error") != nullptr) return;
  const std::string& trace = member(t, "trace", json_value::kind::string, where).text;
  const json_value& results = member(t, "results", json_value::kind::array, where);
  for (const json_value& r : results.items) {
    const json_value* oom = r.find("oom");
    if (oom != nullptr && oom->k == json_value::kind::boolean && oom->b) continue;
    const json_value* ns = r.find("modelled_ns_per_event");
    if (ns == nullptr) ns = &member(r, "ns_per_event", json_value::kind::number, where);
    points.push_back({trace, member(r, "allocator", json_value::kind::string, where).text,
                      member(r, "fragmentation", json_value::kind::number, where).number,
                      ns->number});
  }
}

}  // namespace

std::vector<tradeoff_point> read_tradeoff_points(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw invalid_argument("tradeoff points: cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  const json_value doc = parse_json(text.str(), path);
  std::vector<tradeoff_point> points;
  if (doc.k == json_value::kind::array) {
    for (const json_value& p : doc.items) {
      if (const json_value* oom = p.find("oom"); oom != nullptr && oom->k == json_value::kind::boolean && oom->b)
        continue;  // no whole warm pass to time
      points.push_back({member(p, "trace", json_value::kind::string, path).text,
                        member(p, "allocator", json_value::kind::string, path).text,
                        member(p, "fragmentation", json_value::kind::number, path).number,
                        member(p, "ns_per_event", json_value::kind::number, path).number});
    }
  } else if (const json_value* traces = doc.find("traces");
             traces != nullptr && traces->k == json_value::kind::array) {
    for (const json_value& t : traces->items) add_trace(t, path, points);
  } else if (doc.find("results") != nullptr) {
    add_trace(doc, path, points);
  } else {
    throw invalid_argument(path + ": expected gpumem replay --json output or an array of "
                           "{trace, allocator, fragmentation, ns_per_event}");
  }
  return points;
}

}  // namespace gpumem::cli
