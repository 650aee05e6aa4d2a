// The doctor's findings as a picture: a header with the findings, then one bar chart per health statistic with
// a bar per head (red when the head is named by the finding that statistic explains) and the flag threshold.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "sattn/diagnose.hpp"
#include "sattn/error.hpp"
#include "viz/viz.hpp"

namespace sattn {
namespace {

constexpr viz::Rgb kText{20, 20, 20};
constexpr viz::Rgb kAxis{40, 40, 40};
constexpr viz::Rgb kGrid{225, 225, 225};
constexpr viz::Rgb kOk{0, 114, 178};   // blue
constexpr viz::Rgb kFlag{213, 94, 0};  // vermillion
constexpr viz::Rgb kThreshold{204, 121, 167};

struct Metric {
  std::string title;
  std::vector<double> values;      // one per head
  double top = 1.0;                // axis maximum
  double threshold = -1;           // drawn when >= 0
  std::vector<std::string> codes;  // findings this metric explains
};

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.3g", v);
  return b;
}

bool named(const Diagnosis& d, const std::vector<std::string>& codes, int64_t b, int64_t h) {
  for (const auto& f : d.findings)
    if (std::find(codes.begin(), codes.end(), f.code) != codes.end())
      for (const auto& bh : f.heads)
        if (bh.first == b && bh.second == h) return true;
  return false;
}

// Splits text into lines of at most `width` characters at spaces.
std::vector<std::string> wrap(const std::string& text, size_t width) {
  std::vector<std::string> lines;
  std::string line;
  size_t p = 0;
  while (p < text.size()) {
    size_t q = text.find(' ', p);
    if (q == std::string::npos) q = text.size();
    const std::string word = text.substr(p, q - p);
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(line);
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
    p = q + 1;
  }
  if (!line.empty()) lines.push_back(line);
  return lines;
}

}  // namespace

sr::Image render_diagnosis(const Diagnosis& d, const DiagnoseOptions& options) {
  check(!d.heads.empty(), ErrorKind::kInvalidArgument, "render_diagnosis: the diagnosis has no heads");
  const size_t n = d.heads.size();
  std::vector<Metric> metrics(5);
  metrics[0] = {"entropy (norm.)", {}, 1.0, -1, {"saturated_softmax"}};
  metrics[1] = {"max weight", {}, 1.0, options.saturation_max_prob, {"saturated_softmax"}};
  metrics[2] = {"saturated rows", {}, 1.0, options.saturation_row_fraction, {"saturated_softmax"}};
  metrics[3] = {"score std", {}, options.unscaled_std * 1.5, options.unscaled_std, {"unscaled_scores"}};
  metrics[4] = {"leak", {}, 1.0, -1, {"causal_leak", "padding_leak"}};
  for (const auto& h : d.heads) {
    metrics[0].values.push_back(h.entropy_normalised);
    metrics[1].values.push_back(h.max_prob_mean);
    metrics[2].values.push_back(h.saturated_row_fraction);
    metrics[3].values.push_back(h.scaled_scores.std);
    metrics[4].values.push_back(std::max(h.causal_leak_max, h.padding_leak_max));
  }
  for (double v : metrics[3].values)
    if (std::isfinite(v)) metrics[3].top = std::max(metrics[3].top, v * 1.1);

  // header: title, problem, then each finding (code, heads, the message's first sentence)
  std::vector<std::pair<std::string, viz::Rgb>> header;
  header.emplace_back("problem: " + d.problem, kText);
  header.emplace_back("scale " + fmt(d.scale) + " (1/sqrt(" + std::to_string(d.head_dim) +
                          ") = " + fmt(d.default_scale) + "), kernel " + d.kernel + ", two runs " +
                          (d.deterministic ? "bitwise identical" : "DIFFER"),
                      kText);
  if (d.findings.empty()) header.emplace_back("healthy: no findings", kOk);
  for (const auto& f : d.findings) {
    std::string heads;
    for (size_t i = 0; i < f.heads.size() && i < 8; ++i)
      heads += (i ? ", " : "") + std::string("b") + std::to_string(f.heads[i].first) + "h" +
               std::to_string(f.heads[i].second);
    if (f.heads.size() > 8) heads += ", ... (" + std::to_string(f.heads.size()) + " heads)";
    const size_t dot = f.message.find(". ");
    const std::string first = dot == std::string::npos ? f.message : f.message.substr(0, dot + 1);
    const auto lines = wrap("[" + f.code + "]" + (heads.empty() ? "" : " " + heads) + ": " + first, 140);
    for (const auto& l : lines) header.emplace_back(l, kFlag);
  }

  const int fs = 2, small = 1, panel_w = 180, panel_h = 150, gap = 48, left = 44;
  const int width = std::max(int(metrics.size()) * (panel_w + gap) + left, 760);
  const int title_h = viz::text_height(fs) + 16, line_h = viz::text_height(small) + 6;
  const int top = 10 + title_h + int(header.size()) * line_h + 16;
  const int height = top + viz::text_height(fs) + 10 + panel_h + 30 + 3 * line_h;
  sr::Image img = viz::canvas(height, width);
  const std::string title =
      std::string("sattn doctor: ") +
      (d.findings.empty() ? "healthy"
                          : std::to_string(d.findings.size()) + " finding" + (d.findings.size() > 1 ? "s" : ""));
  viz::draw_text(img, 12, 10, title, d.findings.empty() ? kOk : kFlag, fs);
  int y = 10 + title_h;
  for (const auto& [line, colour] : header) {
    viz::draw_text(img, 12, y, line, colour, small);
    y += line_h;
  }
  for (size_t m = 0; m < metrics.size(); ++m) {
    const Metric& mt = metrics[m];
    const int ox = left + int(m) * (panel_w + gap), oy = top + viz::text_height(fs) + 10;
    viz::draw_text(img, ox, top, mt.title, kText, fs);
    for (double t : {0.0, 0.5, 1.0}) {  // grid and y ticks at 0, top/2, top
      const int gy = oy + panel_h - int(std::lround(t * panel_h));
      viz::fill_rect(img, ox, gy, panel_w, 1, kGrid);
      const std::string s = fmt(t * mt.top);
      viz::draw_text(img, ox - 6 - viz::text_width(s, small), gy - viz::text_height(small) / 2, s, kText, small);
    }
    const double bw = double(panel_w) / double(n);
    for (size_t i = 0; i < n; ++i) {
      const double v = mt.values[i];
      const int bh = std::isfinite(v) ? int(std::lround(std::clamp(v / mt.top, 0.0, 1.0) * panel_h)) : 0;
      const int x0 = ox + int(std::lround(i * bw)) + (bw >= 4 ? 1 : 0);
      const int x1 = ox + int(std::lround((i + 1) * bw)) - (bw >= 4 ? 1 : 0);
      const bool flag = named(d, mt.codes, d.heads[i].batch, d.heads[i].head);
      viz::fill_rect(img, x0, oy + panel_h - bh, std::max(1, x1 - x0), bh, flag ? kFlag : kOk);
      if (n <= 16 && bw >= 10) {
        std::string lab = "h";  // appended, not "h" + to_string(...): GCC 12's -Wrestrict misfires on that
        lab += std::to_string(d.heads[i].head);
        viz::draw_text(img, (x0 + x1 - viz::text_width(lab, small)) / 2, oy + panel_h + 5, lab, kText, small);
      }
    }
    if (mt.threshold >= 0 && mt.threshold <= mt.top) {
      const int ty = oy + panel_h - int(std::lround(mt.threshold / mt.top * panel_h));
      for (int x = ox; x < ox + panel_w; x += 6) viz::fill_rect(img, x, ty, 3, 2, kThreshold);
    }
    viz::fill_rect(img, ox, oy + panel_h, panel_w, 1, kAxis);
    viz::fill_rect(img, ox, oy, 1, panel_h, kAxis);
  }
  const std::string notes[3] = {
      "red: the head is named by the finding this statistic explains; dashed: the flag threshold; one bar per "
      "(batch, head)",
      "entropy: mean H / log(allowed keys), 1 = uniform; max weight: mean of each row's largest weight; saturated: "
      "rows with max weight > " +
          fmt(options.saturation_max_prob),
      "score std: of the scaled scores; leak: the largest weight on a key the expected mask forbids (--expect)"};
  for (int i = 0; i < 3; ++i) viz::draw_text(img, 12, height - (3 - i) * line_h - 4, notes[i], kText, small);
  return img;
}

}  // namespace sattn
