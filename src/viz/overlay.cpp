// Pictures over a photograph: magnification, blending, a muted grey backdrop, and a captioned grid of panels with
// one colour bar (used by `sattn viz --image` for the SR model's attention and routing maps).
#include <algorithm>
#include <cmath>

#include "sattn/error.hpp"
#include "viz/viz.hpp"

namespace sattn::viz {

namespace {
constexpr Rgb kText{20, 20, 20};
}  // namespace

sr::Image magnify(const sr::Image& image, int factor) {
  check(factor >= 1 && factor <= 64, ErrorKind::kInvalidArgument, "magnify: factor must be in [1, 64], given ", factor);
  const int h = int(image.height), w = int(image.width);
  sr::Image out = canvas(h * factor, w * factor);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) fill_rect(out, x * factor, y * factor, factor, factor, pixel(image, x, y));
  return out;
}

void blend_pixel(sr::Image& image, int x, int y, Rgb c, double alpha) {
  if (x < 0 || y < 0 || x >= image.width || y >= image.height) return;
  const Rgb o = pixel(image, x, y);
  const double a = std::clamp(alpha, 0.0, 1.0);
  auto mix = [a](uint8_t p, uint8_t q) { return uint8_t(std::lround((1.0 - a) * p + a * q)); };
  set_pixel(image, x, y, Rgb{mix(o.r, c.r), mix(o.g, c.g), mix(o.b, c.b)});
}

sr::Image faded_gray(const sr::Image& image, double fade) {
  const int h = int(image.height), w = int(image.width);
  sr::Image out = canvas(h, w);
  const double f = std::clamp(fade, 0.0, 1.0);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const Rgb c = pixel(image, x, y);
      // BT.601 luma, then mixed towards white
      const double l = 0.299 * c.r + 0.587 * c.g + 0.114 * c.b;
      const auto g = uint8_t(std::lround((1.0 - f) * l + f * 255.0));
      set_pixel(out, x, y, Rgb{g, g, g});
    }
  return out;
}

sr::Image render_panel_grid(const std::vector<sr::Image>& panels, const std::vector<std::string>& captions, int columns,
                            const PanelGridStyle& style) {
  check(!panels.empty() && captions.size() == panels.size(), ErrorKind::kInvalidArgument,
        "panel grid: expected one caption per panel and at least one panel, given ", panels.size(), " panels and ",
        captions.size(), " captions");
  check(columns >= 1, ErrorKind::kInvalidArgument, "panel grid: columns must be >= 1, given ", columns);
  const int fs = 2, small = 1, th = text_height(fs), gap = 14;
  const int n = int(panels.size()), cols = std::min(columns, n), rows = (n + cols - 1) / cols;
  int cell_w = 0, cell_h = 0;
  for (size_t i = 0; i < panels.size(); ++i) {
    cell_w = std::max({cell_w, int(panels[i].width), text_width(captions[i], fs)});
    cell_h = std::max(cell_h, int(panels[i].height));
  }
  cell_h += th + 8;
  const int top = 10 + (style.title.empty() ? 0 : th + 10) + int(style.legend.size()) * (text_height(small) + 6) +
                  (style.legend.empty() ? 0 : 4);
  const int grid_w = cols * cell_w + (cols - 1) * gap, grid_h = rows * cell_h + (rows - 1) * gap;
  const int bar_h = std::min(grid_h - th - 8, 256);
  const int right = style.colorbar ? 16 + colorbar_width(style.vmin, style.vmax, style.colorbar_label, fs) + 10 : 10;
  int width = 10 + grid_w + right;
  width = std::max(width, text_width(style.title, fs) + 20);
  for (const auto& line : style.legend) width = std::max(width, text_width(line, small) + 20);
  sr::Image img = canvas(top + grid_h + 10, width);
  int y = 10;
  if (!style.title.empty()) {
    draw_text(img, (width - text_width(style.title, fs)) / 2, y, style.title, kText, fs);
    y += th + 10;
  }
  for (const auto& line : style.legend) {
    draw_text(img, 10, y, line, kText, small);
    y += text_height(small) + 6;
  }
  for (int i = 0; i < n; ++i) {
    const int cx = 10 + (i % cols) * (cell_w + gap), cy = top + (i / cols) * (cell_h + gap);
    draw_text(img, cx, cy, captions[size_t(i)], kText, fs);
    blit(img, panels[size_t(i)], cx, cy + th + 8);
  }
  if (style.colorbar && bar_h > 8)
    draw_colorbar(img, 10 + grid_w + 16, top + th + 8, bar_h, style.vmin, style.vmax, style.cmap, style.colorbar_label,
                  fs);
  return img;
}

}  // namespace sattn::viz
