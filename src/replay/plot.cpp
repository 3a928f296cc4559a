#include "gpumem/replay/plot.hpp"

#include <algorithm>
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

}  // namespace gpumem
