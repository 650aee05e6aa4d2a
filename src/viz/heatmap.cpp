// Heatmaps (one matrix, a grid of matrices) and the query-focus view, drawn with axes, ticks and a colour bar.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "sattn/error.hpp"
#include "viz/viz.hpp"

namespace sattn::viz {
namespace {

constexpr Rgb kAxis{40, 40, 40};
constexpr Rgb kText{20, 20, 20};

std::string format_value(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", v);
  return buf;
}

// Tick positions for indices 0..n-1: multiples of a 1-2-5 step, at most ~max_ticks of them.
std::vector<int64_t> index_ticks(int64_t n, int max_ticks) {
  int64_t step = 1;
  for (int64_t base = 1;; base *= 10) {
    bool done = false;
    for (int64_t m : {1, 2, 5}) {
      if ((n - 1) / (base * m) + 1 <= max_ticks) {
        step = base * m;
        done = true;
        break;
      }
    }
    if (done) break;
  }
  std::vector<int64_t> ticks;
  for (int64_t t = 0; t < n; t += step) ticks.push_back(t);
  return ticks;
}

// How a matrix is fitted into an area of about `side` pixels, per axis: `pool` indices per block (max-pooled)
// and `cell` pixels per block. Square cells when both sides fit; a short axis (e.g. one query against 1000 keys)
// is stretched to at least `min_side` pixels so that the map stays readable.
struct Fit {
  int64_t pool_r = 1, pool_c = 1;
  int cell_h = 1, cell_w = 1;
  int width = 0, height = 0;  // pixels
  double ppx = 1, ppy = 1;    // pixels per index along x (keys) and y (queries)
};

Fit fit_matrix(int64_t rows, int64_t cols, int side, int min_side = 48) {
  Fit f;
  const int64_t n = std::max(rows, cols);
  const int square = n <= side ? std::max<int>(1, int(side / n)) : 1;
  auto axis = [&](int64_t len, int64_t* pool, int* cell) {
    *pool = len <= side ? 1 : (len + side - 1) / side;
    *cell = square;
    const int64_t blocks = (len + *pool - 1) / *pool;
    if (blocks * *cell < min_side) *cell = int((min_side + blocks - 1) / blocks);
  };
  axis(rows, &f.pool_r, &f.cell_h);
  axis(cols, &f.pool_c, &f.cell_w);
  f.width = int((cols + f.pool_c - 1) / f.pool_c) * f.cell_w;
  f.height = int((rows + f.pool_r - 1) / f.pool_r) * f.cell_h;
  f.ppx = double(f.cell_w) / double(f.pool_c);
  f.ppy = double(f.cell_h) / double(f.pool_r);
  return f;
}

// Value range: [vmin, vmax] with vmax = the largest finite value when unset.
std::pair<double, double> value_range(const std::vector<const Matrix*>& ms, const HeatmapStyle& style) {
  double vmax = style.vmax;
  if (std::isnan(vmax)) {
    vmax = -std::numeric_limits<double>::infinity();
    for (const Matrix* m : ms)
      for (double v : m->data)
        if (std::isfinite(v)) vmax = std::max(vmax, v);
    if (!std::isfinite(vmax)) vmax = style.vmin + 1.0;
  }
  if (vmax <= style.vmin) vmax = style.vmin + 1e-12;
  return {style.vmin, vmax};
}

// Draws the cells of `m` with their top-left at (ox, oy); pooled blocks show their largest value.
void draw_cells(sr::Image& img, int ox, int oy, const Matrix& m, const Fit& f, double vmin, double vmax,
                Colormap cmap) {
  const int64_t prow = (m.rows + f.pool_r - 1) / f.pool_r, pcol = (m.cols + f.pool_c - 1) / f.pool_c;
  for (int64_t bi = 0; bi < prow; ++bi) {
    for (int64_t bj = 0; bj < pcol; ++bj) {
      double best = std::numeric_limits<double>::quiet_NaN();
      for (int64_t i = bi * f.pool_r; i < std::min(m.rows, (bi + 1) * f.pool_r); ++i)
        for (int64_t j = bj * f.pool_c; j < std::min(m.cols, (bj + 1) * f.pool_c); ++j) {
          const double v = m.at(i, j);
          if (!std::isnan(v) && (std::isnan(best) || v > best)) best = v;
        }
      const Rgb c = colormap(cmap, std::isnan(best) ? best : (best - vmin) / (vmax - vmin));
      fill_rect(img, ox + int(bj) * f.cell_w, oy + int(bi) * f.cell_h, f.cell_w, f.cell_h, c);
    }
  }
  draw_rect(img, ox - 1, oy - 1, f.width + 2, f.height + 2, kAxis);
}

// Tick marks and index labels under (x axis) and left of (y axis) a panel at (ox, oy).
void draw_ticks(sr::Image& img, int ox, int oy, int64_t rows, int64_t cols, const Fit& f, int scale, bool x_labels,
                bool y_labels) {
  const int tick_len = 3 * scale;
  for (int64_t t : index_ticks(cols, std::max(2, f.width / (text_width("0000", scale) + 4)))) {
    const int x = ox + int((double(t) + 0.5) * f.ppx);
    fill_rect(img, x, oy + f.height + 1, 1, tick_len, kAxis);
    if (x_labels) {
      const std::string s = std::to_string(t);
      draw_text(img, x - text_width(s, scale) / 2, oy + f.height + tick_len + 3, s, kText, scale);
    }
  }
  for (int64_t t : index_ticks(rows, std::max(2, f.height / (text_height(scale) * 3)))) {
    const int y = oy + int((double(t) + 0.5) * f.ppy);
    fill_rect(img, ox - 1 - tick_len, y, tick_len, 1, kAxis);
    if (y_labels) {
      const std::string s = std::to_string(t);
      draw_text(img, ox - tick_len - 4 - text_width(s, scale), y - text_height(scale) / 2, s, kText, scale);
    }
  }
}

int ytick_label_width(int64_t rows, int scale) {
  return text_width(std::to_string(std::max<int64_t>(rows - 1, 0)), scale);
}

// A vertical colour bar of `height` pixels with three value labels and a vertical caption; returns its width.
int colorbar_width_impl(double vmin, double vmax, const std::string& label, int scale) {
  int w = 0;
  for (double v : {vmin, (vmin + vmax) / 2, vmax}) w = std::max(w, text_width(format_value(v), scale));
  return 16 + 8 + w + (label.empty() ? 0 : 6 + text_height(scale) + 2 * scale);
}

void draw_colorbar_impl(sr::Image& img, int ox, int oy, int height, double vmin, double vmax, Colormap cmap,
                        const std::string& label, int scale) {
  const int bar_w = 16;
  for (int y = 0; y < height; ++y) {
    const double t = 1.0 - double(y) / std::max(1, height - 1);
    fill_rect(img, ox, oy + y, bar_w, 1, colormap(cmap, t));
  }
  draw_rect(img, ox - 1, oy - 1, bar_w + 2, height + 2, kAxis);
  int w = 0;
  const double vals[3] = {vmax, (vmin + vmax) / 2, vmin};
  for (int k = 0; k < 3; ++k) {
    const int y = oy + int(std::lround(k * (height - 1) / 2.0));
    fill_rect(img, ox + bar_w, y, 4, 1, kAxis);
    const std::string s = format_value(vals[k]);
    w = std::max(w, text_width(s, scale));
    draw_text(img, ox + bar_w + 8, std::clamp(y - text_height(scale) / 2, oy - 2, oy + height - text_height(scale)), s,
              kText, scale);
  }
  if (!label.empty())
    draw_text_vertical(img, ox + bar_w + 8 + w + 6, oy + (height - text_width(label, scale)) / 2, label, kText, scale);
}

}  // namespace

void draw_colorbar(sr::Image& image, int x, int y, int height, double vmin, double vmax, Colormap cmap,
                   const std::string& label, int scale) {
  draw_colorbar_impl(image, x, y, height, vmin, vmax, cmap, label, scale);
}
int colorbar_width(double vmin, double vmax, const std::string& label, int scale) {
  return colorbar_width_impl(vmin, vmax, label, scale);
}

sr::Image render_heatmap(const Matrix& m, const HeatmapStyle& style) {
  check(m.rows > 0 && m.cols > 0 && m.data.size() == size_t(m.rows * m.cols), ErrorKind::kInvalidArgument,
        "heatmap: expected a non-empty matrix, got ", m.rows, "x", m.cols);
  const int fs = 2;  // font scale
  // Tall enough for the vertical axis label and the colour bar's three labels.
  const int min_side = std::max(text_width(style.ylabel, fs) + 8, 6 * text_height(fs));
  const Fit f = fit_matrix(m.rows, m.cols, std::max(16, style.plot_side), min_side);
  const auto [vmin, vmax] = value_range({&m}, style);
  const int th = text_height(fs);
  const int left = 8 + th + 8 + ytick_label_width(m.rows, fs) + 3 * fs + 6;
  const int top = (style.title.empty() ? 10 : th + 20);
  const int bottom = 3 * fs + 6 + th + 10 + th + 10;
  const int right = style.colorbar ? 24 + colorbar_width_impl(vmin, vmax, style.colorbar_label, fs) + 10 : 14;
  const int title_w = text_width(style.title, fs);
  const int width = std::max(left + f.width + right, title_w + 20);
  sr::Image img = canvas(top + f.height + bottom, width);
  if (!style.title.empty()) draw_text(img, (width - title_w) / 2, 8, style.title, kText, fs);
  draw_cells(img, left, top, m, f, vmin, vmax, style.cmap);
  draw_ticks(img, left, top, m.rows, m.cols, f, fs, true, true);
  draw_text(img, left + (f.width - text_width(style.xlabel, fs)) / 2, top + f.height + 3 * fs + 6 + th + 10,
            style.xlabel, kText, fs);
  draw_text_vertical(img, 8, top + (f.height - text_width(style.ylabel, fs)) / 2, style.ylabel, kText, fs);
  if (style.colorbar)
    draw_colorbar_impl(img, left + f.width + 24, top, f.height, vmin, vmax, style.cmap, style.colorbar_label, fs);
  return img;
}

sr::Image render_heatmap_grid(const std::vector<Matrix>& panels, const std::vector<std::string>& titles, int columns,
                              const HeatmapStyle& style) {
  check(!panels.empty(), ErrorKind::kInvalidArgument, "heatmap grid: expected at least one panel");
  check(columns >= 1, ErrorKind::kInvalidArgument, "heatmap grid: expected columns >= 1, got ", columns);
  for (const Matrix& m : panels)
    check(m.rows > 0 && m.cols > 0 && m.data.size() == size_t(m.rows * m.cols), ErrorKind::kInvalidArgument,
          "heatmap grid: expected non-empty matrices, got ", m.rows, "x", m.cols);
  const int fs = 1, big = 2;
  std::vector<const Matrix*> ptrs;
  int64_t max_rows = 0;
  for (const Matrix& m : panels) {
    ptrs.push_back(&m);
    max_rows = std::max(max_rows, m.rows);
  }
  const auto [vmin, vmax] = value_range(ptrs, style);
  const int cols = std::min<int>(columns, int(panels.size()));
  const int nrows = int((panels.size() + size_t(cols) - 1) / size_t(cols));
  // Every panel has the same fit (same shapes in practice); use the largest for the cell size.
  int64_t max_cols = 0;
  for (const Matrix& m : panels) max_cols = std::max(max_cols, m.cols);
  const Fit f = fit_matrix(max_rows, max_cols, std::max(16, style.plot_side), 64);
  const int th = text_height(fs), bth = text_height(big);
  const int tick_w = ytick_label_width(max_rows, fs) + 3 * fs + 6;
  const int cell_w = tick_w + f.width + 14;
  const int cell_h = bth + 10 + f.height + 3 * fs + 4 + th + 10;
  const int left = 8 + bth + 10, top = (style.title.empty() ? 8 : bth + 18);
  const int grid_w = cols * cell_w, grid_h = nrows * cell_h;
  const int right = style.colorbar ? 16 + colorbar_width_impl(vmin, vmax, style.colorbar_label, big) + 10 : 10;
  const int bottom = bth + 14;
  const int width = std::max(left + grid_w + right, text_width(style.title, big) + 20);
  sr::Image img = canvas(top + grid_h + bottom, width);
  if (!style.title.empty()) draw_text(img, (width - text_width(style.title, big)) / 2, 8, style.title, kText, big);
  for (size_t p = 0; p < panels.size(); ++p) {
    const int r = int(p) / cols, c = int(p) % cols;
    const int ox = left + c * cell_w + tick_w, oy = top + r * cell_h + bth + 10;
    const std::string t = p < titles.size() ? titles[p] : std::string();
    draw_text(img, ox + (f.width - text_width(t, big)) / 2, oy - bth - 6, t, kText, big);
    draw_cells(img, ox, oy, panels[p], f, vmin, vmax, style.cmap);
    draw_ticks(img, ox, oy, panels[p].rows, panels[p].cols, f, fs, true, true);
  }
  draw_text(img, left + (grid_w - text_width(style.xlabel, big)) / 2, top + grid_h + 4, style.xlabel, kText, big);
  draw_text_vertical(img, 8, top + (grid_h - text_width(style.ylabel, big)) / 2, style.ylabel, kText, big);
  if (style.colorbar)
    draw_colorbar_impl(img, left + grid_w + 16, top + bth + 10,
                       std::max(f.height, std::min(grid_h - bth - 30, 3 * f.height)), vmin, vmax, style.cmap,
                       style.colorbar_label, big);
  return img;
}

sr::Image render_query_focus(const Matrix& rows, const std::vector<std::string>& row_labels, const std::string& title,
                             const HeatmapStyle& style) {
  check(rows.rows > 0 && rows.cols > 0 && rows.data.size() == size_t(rows.rows * rows.cols),
        ErrorKind::kInvalidArgument, "query focus: expected a non-empty matrix, got ", rows.rows, "x", rows.cols);
  const int fs = 2;
  const auto [vmin, vmax] = value_range({&rows}, style);
  const int side = std::max(64, style.plot_side * 3 / 2);
  const int64_t pool = rows.cols <= side ? 1 : (rows.cols + side - 1) / side;
  const int bar_w = pool == 1 ? std::max(1, int(side / rows.cols)) : 1;
  const int64_t nbars = (rows.cols + pool - 1) / pool;
  const int plot_w = int(nbars) * bar_w;
  const int row_h = 64, gap = 10;
  const int th = text_height(fs);
  int label_w = 0;
  for (const auto& l : row_labels) label_w = std::max(label_w, text_width(l, fs));
  const int left = 10 + label_w + 10;
  const int top = title.empty() ? 10 : th + 22;
  const int plot_h = int(rows.rows) * (row_h + gap);
  const int bottom = 3 * fs + 8 + th + 10 + th + 12;
  const int right = style.colorbar ? 24 + colorbar_width_impl(vmin, vmax, style.colorbar_label, fs) + 10 : 14;
  const int width = std::max(left + plot_w + right, text_width(title, fs) + 20);
  sr::Image img = canvas(top + plot_h + bottom, width);
  if (!title.empty()) draw_text(img, (width - text_width(title, fs)) / 2, 8, title, kText, fs);
  for (int64_t r = 0; r < rows.rows; ++r) {
    const int base = top + int(r) * (row_h + gap) + row_h;  // baseline y
    if (size_t(r) < row_labels.size()) draw_text(img, 10, base - row_h / 2 - th / 2, row_labels[size_t(r)], kText, fs);
    fill_rect(img, left, base - row_h, plot_w, row_h, Rgb{245, 245, 245});
    for (int64_t b = 0; b < nbars; ++b) {
      double best = std::numeric_limits<double>::quiet_NaN();
      for (int64_t j = b * pool; j < std::min(rows.cols, (b + 1) * pool); ++j) {
        const double v = rows.at(r, j);
        if (!std::isnan(v) && (std::isnan(best) || v > best)) best = v;
      }
      const int x = left + int(b) * bar_w;
      if (std::isnan(best)) {  // masked key: grey tick under the axis
        fill_rect(img, x, base + 1, bar_w, 4, kMaskedGrey);
        continue;
      }
      const double t = std::clamp((best - vmin) / (vmax - vmin), 0.0, 1.0);
      const int h = int(std::lround(t * (row_h - 2)));
      fill_rect(img, x, base - h, std::max(1, bar_w - (bar_w > 3 ? 1 : 0)), h, colormap(style.cmap, t));
    }
    fill_rect(img, left, base, plot_w, 1, kAxis);
  }
  // Key ticks along the bottom axis.
  const int axis_y = top + plot_h - gap;
  const double px_per_index = double(bar_w) / double(pool);
  for (int64_t t : index_ticks(rows.cols, std::max(2, plot_w / (text_width("0000", fs) + 8)))) {
    const int x = left + int((double(t) + 0.5) * px_per_index);
    fill_rect(img, x, axis_y + 5, 1, 3 * fs, kAxis);
    const std::string s = std::to_string(t);
    draw_text(img, x - text_width(s, fs) / 2, axis_y + 5 + 3 * fs + 3, s, kText, fs);
  }
  draw_text(img, left + (plot_w - text_width(style.xlabel, fs)) / 2, axis_y + 5 + 3 * fs + 3 + th + 10, style.xlabel,
            kText, fs);
  if (style.colorbar)
    draw_colorbar_impl(img, left + plot_w + 24, top, plot_h - gap, vmin, vmax, style.cmap, style.colorbar_label, fs);
  return img;
}

}  // namespace sattn::viz
