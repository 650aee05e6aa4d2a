// sattn::viz — a small imaging library for looking at attention: drawing on RGB images (sr::Image), perceptual
// colour maps, an embedded stroke font (stb_easy_font's glyphs), heatmaps with axes and a colour bar, grids of
// heads, query-focus views, line plots (SVG or PNG) with log axes, and base64 for HTML.
//
// Everything is drawn by C++ code; nothing here needs Python or a network.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "sattn/attention.hpp"
#include "sattn/diagnose.hpp"
#include "sattn/image.hpp"
#include "sattn/profile.hpp"
#include "sattn/tensor.hpp"

namespace sattn::viz {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

inline constexpr Rgb kWhite{255, 255, 255};
inline constexpr Rgb kBlack{0, 0, 0};
inline constexpr Rgb kMaskedGrey{200, 200, 200};  // cells with no value (masked keys, NaN)

// ---- drawing on an RGB image ----------------------------------------------------------------------------------
// Every picture here is an sr::Image (sattn/image.hpp) with 3 channels: the one image type of sattn, encoded by
// sr::encode_png / sr::write_png. Sizes are (height, width) as everywhere; drawing positions are (x, y) with (0, 0)
// at the top left. The functions below take RGB images only (sattn::Error kInvalidArgument otherwise).

// A height x width RGB image filled with `fill`, between 1x1 and 2^28 pixels.
sr::Image canvas(int height, int width, Rgb fill = kWhite);
Rgb pixel(const sr::Image& image, int x, int y);                      // kWhite outside the image
void set_pixel(sr::Image& image, int x, int y, Rgb c);                // ignores pixels outside the image
void fill_rect(sr::Image& image, int x, int y, int w, int h, Rgb c);  // clipped
void draw_rect(sr::Image& image, int x, int y, int w, int h, Rgb c);  // 1-px outline, clipped
void draw_line(sr::Image& image, double x0, double y0, double x1, double y1, Rgb c, double width = 1.0);
void fill_circle(sr::Image& image, double cx, double cy, double r, Rgb c);
void blit(sr::Image& image, const sr::Image& src, int x, int y);  // src with its top-left at (x, y), clipped
sr::Image rotated_ccw(const sr::Image& image);                    // 90 degrees counter-clockwise

// ---- colour maps ------------------------------------------------------------------------------------------
enum class Colormap { kViridis, kMagma, kGray };
Colormap parse_colormap(const std::string& name);  // "viridis" | "magma" | "gray"; throws sattn::Error otherwise
const char* to_string(Colormap cmap);
// Colour at t in [0, 1] (clamped); NaN gives kMaskedGrey. Tables are matplotlib's at 9 stops, interpolated.
Rgb colormap(Colormap cmap, double t);

// ---- text (stb_easy_font's 5x7-ish stroke font, drawn as pixel rectangles) -----------------------------------
// `scale` multiplies the font's pixel grid (1: ~7 px capitals, 2: ~14 px). Only printable ASCII.
void draw_text(sr::Image& image, int x, int y, const std::string& text, Rgb colour, int scale = 1);
int text_width(const std::string& text, int scale = 1);
int text_height(int scale = 1);  // height of one line of capitals, in pixels
// Text rotated 90 degrees counter-clockwise (reads bottom-to-top), top-left corner of its box at (x, y).
void draw_text_vertical(sr::Image& image, int x, int y, const std::string& text, Rgb colour, int scale = 1);

// ---- matrices and heatmaps --------------------------------------------------------------------------------
// A dense row-major matrix of doubles; NaN marks "no value" (a masked key), drawn in kMaskedGrey.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<double> data;
  Matrix() = default;
  Matrix(int64_t r, int64_t c, double fill = 0.0) : rows(r), cols(c), data(size_t(r * c), fill) {}
  double& at(int64_t i, int64_t j) { return data[size_t(i * cols + j)]; }
  double at(int64_t i, int64_t j) const { return data[size_t(i * cols + j)]; }
};

struct HeatmapStyle {
  Colormap cmap = Colormap::kViridis;
  double vmin = 0.0;
  double vmax = std::numeric_limits<double>::quiet_NaN();  // NaN: the largest finite value (at least vmin + 1e-12)
  std::string title;
  std::string xlabel = "key j";
  std::string ylabel = "query i";
  std::string colorbar_label = "weight";
  int plot_side = 384;  // target size of the longer side of the matrix area, in pixels
  bool colorbar = true;
};

// One matrix as a heatmap with title, tick labels on both axes, axis labels and a colour bar.
// Matrices larger than the plot area are max-pooled (a peak stays visible); smaller ones get square cells.
sr::Image render_heatmap(const Matrix& m, const HeatmapStyle& style);

// Several matrices (e.g. every head) in a grid with `columns` panels per row, each with its own title and
// tick labels, one shared colour scale and one colour bar. `style.plot_side` is the side of each panel.
sr::Image render_heatmap_grid(const std::vector<Matrix>& panels, const std::vector<std::string>& titles, int columns,
                              const HeatmapStyle& style);

// The keys one query attends to: one bar chart per row of `rows` (e.g. per head), bars coloured by weight,
// masked keys (NaN) marked with a grey tick under the axis. `row_labels` name the rows ("h0", ...).
sr::Image render_query_focus(const Matrix& rows, const std::vector<std::string>& row_labels, const std::string& title,
                             const HeatmapStyle& style);

// A vertical colour bar `height` pixels tall with its top-left at (x, y): min/middle/max labels and a vertical
// caption `label`; colourbar_width says how wide it is drawn.
void draw_colorbar(sr::Image& image, int x, int y, int height, double vmin, double vmax, Colormap cmap,
                   const std::string& label, int scale = 2);
int colorbar_width(double vmin, double vmax, const std::string& label, int scale = 2);

// ---- pictures over a photograph (sattn viz --image) ----------------------------------------------------------
// Each source pixel becomes a factor x factor block (nearest neighbour).
sr::Image magnify(const sr::Image& image, int factor);
// Mixes colour c into the pixel at (x, y): (1 - alpha) * old + alpha * c. Outside the image: ignored.
void blend_pixel(sr::Image& image, int x, int y, Rgb c, double alpha);
// The luminance of each pixel, as grey, mixed with white by `fade` in [0, 1] (a muted backdrop for overlays).
sr::Image faded_gray(const sr::Image& image, double fade);
// Panels (same size or not) in a grid of `columns` per row, each with its caption above, a title over the whole
// figure and, if `colorbar` is set, one colour bar on the right for [vmin, vmax] in `cmap`.
struct PanelGridStyle {
  std::string title;
  bool colorbar = false;
  double vmin = 0, vmax = 1;
  Colormap cmap = Colormap::kViridis;
  std::string colorbar_label;
  std::vector<std::string> legend;  // extra lines under the title (small font)
};
sr::Image render_panel_grid(const std::vector<sr::Image>& panels, const std::vector<std::string>& captions, int columns,
                            const PanelGridStyle& style);

// ---- line plots --------------------------------------------------------------------------------------------
struct Series {
  std::string name;
  std::vector<double> x, y;  // non-positive values are skipped on a log axis
  bool dashed = false;
};
struct PlotSpec {
  std::string title, xlabel, ylabel;
  bool log_x = true, log_y = true;
  std::vector<Series> series;
};
// Panels side by side in one figure, each `panel_width` x `panel_height` pixels, with axes, ticks, grid and legend.
std::string render_plots_svg(const std::vector<PlotSpec>& panels, int panel_width = 480, int panel_height = 360);
sr::Image render_plots_png(const std::vector<PlotSpec>& panels, int panel_width = 480, int panel_height = 360);
// The same colours the plots use, in series order.
Rgb series_colour(size_t index);

// ---- HTML helpers ----------------------------------------------------------------------------------------
std::string base64_encode(const std::vector<uint8_t>& bytes);
std::string png_data_uri(const sr::Image& image);  // "data:image/png;base64,..."
std::string html_escape(const std::string& text);

// ---- attention maps ----------------------------------------------------------------------------------------
// Attention weights [B, Hq, Lq, Lk] from the reference kernel (with the masks in `options`), as matrices per
// (b, h) in row-major (b, h) order, with NaN where a key is not allowed (masked, padded, causal) so that a map
// shows the mask as well as the weights. Shapes as in attention.hpp.
struct AttentionMaps {
  int64_t batch = 0, heads = 0, len_q = 0, len_k = 0;
  std::vector<Matrix> maps;  // batch * heads
  const Matrix& at(int64_t b, int64_t h) const { return maps[size_t(b * heads + h)]; }
};
AttentionMaps attention_maps(const TensorView& q, const TensorView& k, const AttentionOptions& options);

// Whether key j is allowed for query i of (b, h) under `options`' masks, as a [B, Hq, Lq, Lk] uint8 tensor
// (1 = allowed). The same rules as the kernels: bool False, additive -inf, padding and causality mask a key.
Tensor allowed_keys(const AttentionProblem& problem, const AttentionOptions& options);

// Example inputs with visible structure, for demos and the report: q, k [B, H, L, D], v [B, H, L, D].
// Head h % 4 == 0 attends to the diagonal, 1 to three keys back, 2 to the first keys (a "sink"), 3 is random.
struct ExampleInputs {
  Tensor q, k, v;
};
ExampleInputs example_inputs(int64_t batch, int64_t heads, int64_t len, int64_t dim, uint64_t seed = 0);

}  // namespace sattn::viz

namespace sattn {

// The findings of diagnose() as a picture (sattn doctor --plot): a header listing the findings, then bar charts with
// one bar per (batch, head) — normalised entropy, mean max weight, saturated rows, scaled-score std, leak — red where
// the head is named by the finding the statistic explains, with the flag thresholds of `options` dashed.
sr::Image render_diagnosis(const Diagnosis& d, const DiagnoseOptions& options = {});

// The profile (run_profile) as two panels on log-log axes: time vs L and peak memory vs L (measured solid, analytic
// dashed), a series per (kernel, heads). Render with viz::render_plots_svg / render_plots_png.
std::vector<viz::PlotSpec> profile_plot_specs(const std::vector<ProfilePoint>& points);

}  // namespace sattn
