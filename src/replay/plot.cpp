#include "gpumem/replay/plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "gpumem/backend/memory_resource.hpp"

namespace gpumem {

namespace {

constexpr double width = 960, height = 480, left = 80, right = 220, top = 40, bottom = 50;
constexpr const char* colors[] = {"#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '&': out += "&amp;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace

std::string render_replay_svg(const std::vector<replay_result>& results, const std::string& title) {
  std::uint64_t max_x = 1;
  std::size_t max_y = 1;
  for (const auto& r : results) {
    for (auto [x, y] : r.live_samples) max_x = std::max(max_x, x), max_y = std::max(max_y, y);
    for (auto [x, y] : r.reserved_samples) max_y = std::max(max_y, y);
  }
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  auto px = [&](std::uint64_t x) { return left + plot_w * static_cast<double>(x) / static_cast<double>(max_x); };
  auto py = [&](std::size_t y) { return top + plot_h * (1.0 - static_cast<double>(y) / static_cast<double>(max_y)); };
  auto polyline = [&](const std::vector<std::pair<std::uint64_t, std::size_t>>& pts, const char* color,
                      double stroke, const char* dash) {
    std::ostringstream o;
    o << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"" << stroke << "\"";
    if (dash != nullptr) o << " stroke-dasharray=\"" << dash << "\"";
    o << " points=\"";
    char buf[64];
    for (auto [x, y] : pts) {
      std::snprintf(buf, sizeof buf, "%.1f,%.1f ", px(x), py(y));
      o << buf;
    }
    o << "\"/>\n";
    return o.str();
  };

  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"24\" font-size=\"15\">" << escape(title) << "</text>\n";
  // Axes with four gridlines of bytes.
  for (int i = 0; i <= 4; ++i) {
    const std::size_t y = max_y / 4 * static_cast<std::size_t>(i);
    svg << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << py(y) << "\" y2=\""
        << py(y) << "\" stroke=\"#ddd\"/>\n"
        << "<text x=\"" << left - 6 << "\" y=\"" << py(y) + 4 << "\" text-anchor=\"end\">"
        << escape(format_bytes(y)) << "</text>\n";
  }
  svg << "<line x1=\"" << left << "\" x2=\"" << left << "\" y1=\"" << top << "\" y2=\"" << top + plot_h
      << "\" stroke=\"black\"/>\n<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\""
      << top + plot_h << "\" y2=\"" << top + plot_h << "\" stroke=\"black\"/>\n"
      << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 12
      << "\" text-anchor=\"middle\">trace event (first pass; " << max_x << " events)</text>\n";

  // Live bytes are the same for every allocator: drawn once, from the longest series.
  const replay_result* longest = nullptr;
  for (const auto& r : results)
    if (longest == nullptr || r.live_samples.size() > longest->live_samples.size()) longest = &r;
  double legend_y = top + 10;
  auto legend = [&](const char* color, const std::string& text, const char* dash) {
    svg << "<line x1=\"" << width - right + 12 << "\" x2=\"" << width - right + 36 << "\" y1=\"" << legend_y
        << "\" y2=\"" << legend_y << "\" stroke=\"" << color << "\" stroke-width=\"2\""
        << (dash ? std::string(" stroke-dasharray=\"") + dash + "\"" : std::string()) << "/>\n"
        << "<text x=\"" << width - right + 42 << "\" y=\"" << legend_y + 4 << "\">" << escape(text)
        << "</text>\n";
    legend_y += 18;
  };
  std::size_t i = 0;
  for (const auto& r : results) {
    const char* color = colors[i++ % (sizeof colors / sizeof *colors)];
    svg << polyline(r.reserved_samples, color, 1.5, nullptr);
    char frag[64];
    std::snprintf(frag, sizeof frag, " %.3f%s", r.fragmentation, r.oom ? " OOM" : "");
    legend(color, r.allocator + frag, nullptr);
  }
  if (longest != nullptr) {
    svg << polyline(longest->live_samples, "black", 2.0, "5,3");
    legend("black", "live (requested)", "5,3");
  }
  svg << "<text x=\"" << width - right + 12 << "\" y=\"" << legend_y + 10
      << "\" fill=\"#555\">reserved; number = peak</text>\n<text x=\"" << width - right + 12 << "\" y=\""
      << legend_y + 24 << "\" fill=\"#555\">reserved / peak live</text>\n</svg>\n";
  return svg.str();
}

std::string render_tradeoff_svg(const std::vector<tradeoff_point>& points, const std::string& title) {
  std::vector<std::string> allocators;
  std::vector<const tradeoff_point*> drawn;
  double min_x = 0, max_x = 0, max_y = 1.1;
  for (const auto& p : points) {
    if (!(std::isfinite(p.ns_per_event) && p.ns_per_event > 0 && std::isfinite(p.fragmentation) &&
          p.fragmentation > 0))
      continue;
    drawn.push_back(&p);
    if (std::find(allocators.begin(), allocators.end(), p.allocator) == allocators.end())
      allocators.push_back(p.allocator);
    min_x = drawn.size() == 1 ? p.ns_per_event : std::min(min_x, p.ns_per_event);
    max_x = std::max(max_x, p.ns_per_event);
    max_y = std::max(max_y, p.fragmentation);
  }
  // x: decades of ns per event around the points; y: from 1 (reserved == live) up.
  const double lo = drawn.empty() ? 1 : std::floor(std::log10(min_x));
  const double hi = drawn.empty() ? 4 : std::max(lo + 1, std::ceil(std::log10(max_x)));
  const double y_top = std::ceil(max_y * 10) / 10;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  auto px = [&](double ns) { return left + plot_w * (std::log10(ns) - lo) / (hi - lo); };
  auto py = [&](double f) { return top + plot_h * (1.0 - (f - 1.0) / (y_top - 1.0)); };
  std::ostringstream svg;
  char buf[160];
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"" << left << "\" y=\"24\" font-size=\"15\">" << escape(title) << "</text>\n";
  for (double d = lo; d <= hi; d += 1) {
    std::snprintf(buf, sizeof buf, "%.0f", std::pow(10.0, d));
    svg << "<line x1=\"" << px(std::pow(10.0, d)) << "\" x2=\"" << px(std::pow(10.0, d)) << "\" y1=\""
        << top << "\" y2=\"" << top + plot_h << "\" stroke=\"#ddd\"/>\n<text x=\""
        << px(std::pow(10.0, d)) << "\" y=\"" << top + plot_h + 16 << "\" text-anchor=\"middle\">"
        << buf << "</text>\n";
  }
  const double y_step = y_top - 1.0 > 1.0 ? 0.5 : 0.1;
  for (double f = 1.0; f <= y_top + 1e-9; f += y_step) {
    std::snprintf(buf, sizeof buf, "%.2f", f);
    svg << "<line x1=\"" << left << "\" x2=\"" << left + plot_w << "\" y1=\"" << py(f) << "\" y2=\""
        << py(f) << "\" stroke=\"#ddd\"/>\n<text x=\"" << left - 6 << "\" y=\"" << py(f) + 4
        << "\" text-anchor=\"end\">" << buf << "</text>\n";
  }
  svg << "<text x=\"" << left + plot_w / 2 << "\" y=\"" << height - 12
      << "\" text-anchor=\"middle\">warm ns per event (log scale)</text>\n"
      << "<text x=\"16\" y=\"" << top + plot_h / 2 << "\" transform=\"rotate(-90 16 "
      << top + plot_h / 2 << ")\" text-anchor=\"middle\">peak reserved / peak live</text>\n";
  for (const tradeoff_point* p : drawn) {
    const auto at = std::find(allocators.begin(), allocators.end(), p->allocator) - allocators.begin();
    const char* color = colors[static_cast<std::size_t>(at) % (sizeof colors / sizeof *colors)];
    std::snprintf(buf, sizeof buf, ": %.4f, %.0f ns/event", p->fragmentation, p->ns_per_event);
    svg << "<circle cx=\"" << px(p->ns_per_event) << "\" cy=\"" << py(p->fragmentation)
        << "\" r=\"4\" fill=\"" << color << "\" fill-opacity=\"0.7\"><title>"
        << escape(p->trace + " (" + p->allocator + ")" + buf) << "</title></circle>\n";
  }
  double legend_y = top + 10;
  for (std::size_t i = 0; i < allocators.size(); ++i) {
    svg << "<circle cx=\"" << width - right + 24 << "\" cy=\"" << legend_y << "\" r=\"5\" fill=\""
        << colors[i % (sizeof colors / sizeof *colors)] << "\"/>\n<text x=\"" << width - right + 36
        << "\" y=\"" << legend_y + 4 << "\">" << escape(allocators[i]) << "</text>\n";
    legend_y += 18;
  }
  if (drawn.size() != points.size())
    svg << "<text x=\"" << width - right + 12 << "\" y=\"" << legend_y + 10 << "\" fill=\"#555\">"
        << points.size() - drawn.size() << " point(s) without figures left out</text>\n";
  svg << "</svg>\n";
  return svg.str();
}

}  // namespace gpumem
