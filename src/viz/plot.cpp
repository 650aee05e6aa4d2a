// Line plots with linear or log axes, drawn once against a small canvas interface and rendered as SVG or PNG.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <set>
#include <sstream>

#include "sattn/error.hpp"
#include "viz/viz.hpp"

namespace sattn::viz {
namespace {

enum class Anchor { kStart, kMiddle, kEnd };

class Canvas {
 public:
  virtual ~Canvas() = default;
  virtual void line(double x0, double y0, double x1, double y1, Rgb c, double width, bool dashed) = 0;
  virtual void rect_outline(double x, double y, double w, double h, Rgb c) = 0;
  virtual void circle(double cx, double cy, double r, Rgb c) = 0;
  // Text with its vertical centre at y; `big` for titles and axis labels; `vertical` reads bottom-to-top.
  virtual void text(double x, double y, const std::string& s, Rgb c, Anchor anchor, bool big, bool vertical) = 0;
  virtual double text_w(const std::string& s, bool big) const = 0;
  virtual double text_h(bool big) const = 0;
};

std::string hex(Rgb c) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", c.r, c.g, c.b);
  return buf;
}

class SvgCanvas final : public Canvas {
 public:
  std::ostringstream os;
  void line(double x0, double y0, double x1, double y1, Rgb c, double width, bool dashed) override {
    os << "<line x1=\"" << x0 << "\" y1=\"" << y0 << "\" x2=\"" << x1 << "\" y2=\"" << y1 << "\" stroke=\"" << hex(c)
       << "\" stroke-width=\"" << width << "\"" << (dashed ? " stroke-dasharray=\"6,4\"" : "") << "/>\n";
  }
  void rect_outline(double x, double y, double w, double h, Rgb c) override {
    os << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << h
       << "\" fill=\"none\" stroke=\"" << hex(c) << "\"/>\n";
  }
  void circle(double cx, double cy, double r, Rgb c) override {
    os << "<circle cx=\"" << cx << "\" cy=\"" << cy << "\" r=\"" << r << "\" fill=\"" << hex(c) << "\"/>\n";
  }
  void text(double x, double y, const std::string& s, Rgb c, Anchor anchor, bool big, bool vertical) override {
    const char* a = anchor == Anchor::kStart ? "start" : anchor == Anchor::kMiddle ? "middle" : "end";
    os << "<text x=\"" << x << "\" y=\"" << y << "\" font-size=\"" << (big ? 14 : 11) << "\" fill=\"" << hex(c)
       << "\" text-anchor=\"" << a << "\" dominant-baseline=\"central\"";
    if (vertical) os << " transform=\"rotate(-90 " << x << " " << y << ")\"";
    os << ">" << html_escape(s) << "</text>\n";
  }
  double text_w(const std::string& s, bool big) const override { return 0.6 * double(s.size()) * (big ? 14 : 11); }
  double text_h(bool big) const override { return big ? 14 : 11; }
};

class PngCanvas final : public Canvas {
 public:
  sr::Image img;
  PngCanvas(int w, int h) : img(canvas(h, w)) {}
  void line(double x0, double y0, double x1, double y1, Rgb c, double width, bool dashed) override {
    if (!dashed) {
      draw_line(img, x0, y0, x1, y1, c, width);
      return;
    }
    const double len = std::hypot(x1 - x0, y1 - y0);
    for (double s = 0; s < len; s += 10) {
      const double e = std::min(len, s + 6);
      draw_line(img, x0 + (x1 - x0) * s / len, y0 + (y1 - y0) * s / len, x0 + (x1 - x0) * e / len,
                y0 + (y1 - y0) * e / len, c, width);
    }
  }
  void rect_outline(double x, double y, double w, double h, Rgb c) override {
    draw_rect(img, int(std::lround(x)), int(std::lround(y)), int(std::lround(w)), int(std::lround(h)), c);
  }
  void circle(double cx, double cy, double r, Rgb c) override { fill_circle(img, cx, cy, r, c); }
  void text(double x, double y, const std::string& s, Rgb c, Anchor anchor, bool big, bool vertical) override {
    const int scale = big ? 2 : 1;
    const double w = text_width(s, scale), h = text_height(scale);
    const double shift = anchor == Anchor::kStart ? 0 : anchor == Anchor::kMiddle ? w / 2 : w;
    if (vertical) draw_text_vertical(img, int(std::lround(x - h / 2)), int(std::lround(y - w + shift)), s, c, scale);
    else draw_text(img, int(std::lround(x - shift)), int(std::lround(y - h / 2)), s, c, scale);
  }
  double text_w(const std::string& s, bool big) const override { return text_width(s, big ? 2 : 1); }
  double text_h(bool big) const override { return text_height(big ? 2 : 1); }
};

constexpr Rgb kAxis{40, 40, 40};
constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kText{20, 20, 20};

std::string format_tick(double v) {
  char buf[32];
  if (v != 0 && (std::fabs(v) >= 1e5 || std::fabs(v) < 1e-3)) std::snprintf(buf, sizeof buf, "%.0e", v);
  else std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// One axis: maps data values to [0, 1]; chooses tick values.
struct Axis {
  bool log = false;
  double lo = 0, hi = 1;  // in transformed units (log10 for a log axis)
  double tf(double v) const { return log ? std::log10(v) : v; }
  double frac(double v) const { return (tf(v) - lo) / (hi - lo); }
  std::vector<double> ticks(const std::set<double>& data_values) const {
    std::vector<double> t;
    if (log) {
      // Data values themselves when there are few (e.g. the swept L), else 1-2-5 per decade or decades.
      if (!data_values.empty() && data_values.size() <= 8) return {data_values.begin(), data_values.end()};
      const bool dense = hi - lo < 3.2;
      for (int e = int(std::floor(lo)); e <= int(std::ceil(hi)); ++e)
        for (double m : dense ? std::vector<double>{1, 2, 5} : std::vector<double>{1}) {
          const double v = m * std::pow(10.0, e);
          if (std::log10(v) >= lo - 1e-9 && std::log10(v) <= hi + 1e-9) t.push_back(v);
        }
      return t;
    }
    const double span = hi - lo;
    const double raw = span / 5;
    const double mag = std::pow(10.0, std::floor(std::log10(raw)));
    double step = mag;
    for (double m : {1.0, 2.0, 5.0, 10.0})
      if (m * mag >= raw) {
        step = m * mag;
        break;
      }
    for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step)
      t.push_back(std::fabs(v) < 1e-12 * step ? 0 : v);
    return t;
  }
};

Axis make_axis(const std::vector<double>& values, bool log) {
  Axis a;
  a.log = log;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (double v : values) {
    if (!std::isfinite(v) || (log && v <= 0)) continue;
    lo = std::min(lo, a.tf(v));
    hi = std::max(hi, a.tf(v));
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (hi - lo < 1e-12) {  // one value: open a window around it
    const double pad = log ? 0.5 : std::max(1.0, std::fabs(lo) * 0.5);
    lo -= pad, hi += pad;
  }
  const double pad = (hi - lo) * 0.06;
  if (!log && lo >= 0 && lo - pad < 0) a.lo = 0;
  else a.lo = lo - pad;
  a.hi = hi + pad;
  return a;
}

void draw_panel(Canvas& cv, const PlotSpec& spec, double ox, double oy, double w, double h) {
  const double left = 70, right = 16, top = 34, bottom = 56;
  const double px = ox + left, py = oy + top, pw = w - left - right, ph = h - top - bottom;
  std::vector<double> xs, ys;
  std::set<double> xset;
  for (const Series& s : spec.series) {
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      if ((spec.log_x && s.x[i] <= 0) || (spec.log_y && s.y[i] <= 0)) continue;
      xs.push_back(s.x[i]);
      ys.push_back(s.y[i]);
      xset.insert(s.x[i]);
    }
  }
  const Axis ax = make_axis(xs, spec.log_x), ay = make_axis(ys, spec.log_y);
  auto X = [&](double v) { return px + ax.frac(v) * pw; };
  auto Y = [&](double v) { return py + (1 - ay.frac(v)) * ph; };
  // Grid and ticks.
  for (double t : ax.ticks(xset)) {
    const double x = X(t);
    if (x < px - 0.5 || x > px + pw + 0.5) continue;
    cv.line(x, py, x, py + ph, kGrid, 1, false);
    cv.line(x, py + ph, x, py + ph + 5, kAxis, 1, false);
    cv.text(x, py + ph + 14, format_tick(t), kText, Anchor::kMiddle, false, false);
  }
  for (double t : ay.ticks({})) {
    const double y = Y(t);
    if (y < py - 0.5 || y > py + ph + 0.5) continue;
    cv.line(px, y, px + pw, y, kGrid, 1, false);
    cv.line(px - 5, y, px, y, kAxis, 1, false);
    cv.text(px - 8, y, format_tick(t), kText, Anchor::kEnd, false, false);
  }
  cv.rect_outline(px, py, pw, ph, kAxis);
  cv.text(px + pw / 2, oy + 16, spec.title, kText, Anchor::kMiddle, true, false);
  cv.text(px + pw / 2, py + ph + 38, spec.xlabel + (spec.log_x ? " (log)" : ""), kText, Anchor::kMiddle, true, false);
  cv.text(ox + 14, py + ph / 2, spec.ylabel + (spec.log_y ? " (log)" : ""), kText, Anchor::kMiddle, true, true);
  // Series.
  for (size_t si = 0; si < spec.series.size(); ++si) {
    const Series& s = spec.series[si];
    const Rgb c = series_colour(si);
    bool have_prev = false;
    double x0 = 0, y0 = 0;
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      const bool ok = std::isfinite(s.x[i]) && std::isfinite(s.y[i]) && !(spec.log_x && s.x[i] <= 0) &&
                      !(spec.log_y && s.y[i] <= 0);
      if (!ok) {
        have_prev = false;
        continue;
      }
      const double x = X(s.x[i]), y = Y(s.y[i]);
      if (have_prev) cv.line(x0, y0, x, y, c, 2, s.dashed);
      cv.circle(x, y, 3, c);
      x0 = x, y0 = y, have_prev = true;
    }
  }
  // Legend, top-left inside the plot.
  double ly = py + 12;
  for (size_t si = 0; si < spec.series.size(); ++si) {
    const Rgb c = series_colour(si);
    cv.line(px + 8, ly, px + 30, ly, c, 2, spec.series[si].dashed);
    cv.text(px + 36, ly, spec.series[si].name, kText, Anchor::kStart, false, false);
    ly += 15;
  }
}

void draw_figure(Canvas& cv, const std::vector<PlotSpec>& panels, int w, int h) {
  for (size_t p = 0; p < panels.size(); ++p) draw_panel(cv, panels[p], double(p) * w, 0, w, h);
}

void check_panels(const std::vector<PlotSpec>& panels, int w, int h) {
  check(!panels.empty(), ErrorKind::kInvalidArgument, "plot: expected at least one panel");
  check(w >= 160 && h >= 120 && w <= 4096 && h <= 4096, ErrorKind::kInvalidArgument,
        "plot: expected a panel size between 160x120 and 4096x4096, got ", w, "x", h);
}

}  // namespace

Rgb series_colour(size_t index) {
  // Okabe-Ito colour-blind-safe palette.
  static const Rgb kPalette[] = {{0, 114, 178}, {213, 94, 0},   {0, 158, 115}, {204, 121, 167},
                                 {230, 159, 0}, {86, 180, 233}, {0, 0, 0},     {240, 228, 66}};
  return kPalette[index % (sizeof kPalette / sizeof kPalette[0])];
}

std::string render_plots_svg(const std::vector<PlotSpec>& panels, int panel_width, int panel_height) {
  check_panels(panels, panel_width, panel_height);
  SvgCanvas cv;
  const int W = panel_width * int(panels.size()), H = panel_height;
  cv.os << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
        << " " << H << "\" font-family=\"sans-serif\">\n";
  cv.os << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"#ffffff\"/>\n";
  draw_figure(cv, panels, panel_width, panel_height);
  cv.os << "</svg>\n";
  return cv.os.str();
}

sr::Image render_plots_png(const std::vector<PlotSpec>& panels, int panel_width, int panel_height) {
  check_panels(panels, panel_width, panel_height);
  PngCanvas cv(panel_width * int(panels.size()), panel_height);
  draw_figure(cv, panels, panel_width, panel_height);
  return std::move(cv.img);
}

}  // namespace sattn::viz
