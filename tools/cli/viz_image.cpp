// `sattn viz --image`: runs the SattnSR model on a picture and draws, over the picture, what its window attention
// does: one window's per-head attention maps, a query pixel's attention over the window's pixels, and every
// block's router decisions (which windows get attention: textures, not flat regions).
#include "cli/viz_image.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>

#include "cli/sr_weights.hpp"
#include "cli/tool_inputs.hpp"
#include "io/writers.hpp"
#include "sattn/error.hpp"
#include "sattn/sr.hpp"
#include "sr/png_writer.hpp"
#include "viz/viz.hpp"

namespace sattn::cli {
namespace {

namespace fs = std::filesystem;
constexpr viz::Rgb kQueryMark{230, 30, 30};
constexpr viz::Rgb kEdge{30, 30, 30};

// --weights FILE, else the embedded weights, else the source tree's sr/weights/ file (as `sattn sr`).
// --sr-scale 0: the file's own scale, or x2 for the default weights.
sr::SrModel load_sr_model(const std::string& weights, int scale) {
  const int want = scale == 0 && weights.empty() ? 2 : scale;
  std::optional<sr::SrModel> m = find_sr_model(weights, want, "--sr-scale");
  check(
      m.has_value(), ErrorKind::kIO, "--image: no SR weights for x", want, ": ",
      [&] { return missing_sr_weights(want); }, " (pass --weights FILE)");
  return std::move(*m);
}

// "G.B" -> global block index.
int64_t parse_block(const std::string& text, const std::vector<sr::BlockGeometry>& geo) {
  const int64_t last_group = geo.back().group;
  std::string expect = "G.B (group.block) with G in [0, " + std::to_string(last_group + 1) + ")";
  const size_t dot = text.find('.');
  int64_t g = -1, b = -1;
  try {
    if (dot != std::string::npos && dot > 0 && dot + 1 < text.size() &&
        text.find_first_not_of("0123456789.") == std::string::npos) {
      g = std::stoll(text.substr(0, dot));
      b = std::stoll(text.substr(dot + 1));
    }
  } catch (const std::exception&) {
    g = b = -1;
  }
  for (size_t i = 0; i < geo.size(); ++i)
    if (geo[i].group == g && geo[i].index == b) return int64_t(i);
  std::string blocks;
  for (const auto& bg : geo)
    blocks += (blocks.empty() ? "" : ", ") + std::to_string(bg.group) + "." + std::to_string(bg.index);
  fail(ErrorKind::kInvalidArgument, "--block: expected ", expect, ", one of ", blocks, "; given '", text, "'");
}

std::string block_name(const sr::BlockGeometry& g) { return std::to_string(g.group) + "." + std::to_string(g.index); }

// The padded LR picture (reflect bottom/right, edge not repeated, as the model pads) of an RGB image.
sr::Image padded_picture(const sr::Image& im, int64_t H, int64_t W) {
  sr::Image out(H, W, 3);
  const int64_t h = im.height, w = im.width;
  for (int64_t i = 0; i < H; ++i)
    for (int64_t j = 0; j < W; ++j) {
      const int64_t si = i < h ? i : 2 * (h - 1) - i, sj = j < w ? j : 2 * (w - 1) - j;
      for (int64_t c = 0; c < 3; ++c) out.at(i, j, c) = im.at(si, sj, c);
    }
  return out;
}

// The h x w part of an RGB image with its top-left at (x0, y0); white where it is outside the image.
sr::Image crop_image(const sr::Image& im, int x0, int y0, int w, int h) {
  sr::Image out = viz::canvas(h, w);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) viz::set_pixel(out, x, y, viz::pixel(im, x0 + x, y0 + y));
  return out;
}

// Dark lines between neighbouring LR pixels (of the region [x0, x0+w) x [y0, y0+h)) whose labels differ, drawn on
// the picture magnified by f.
template <typename Label>
void draw_edges(sr::Image& img, int x0, int y0, int w, int h, int f, Label label, viz::Rgb c, double alpha) {
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      const auto here = label(x0 + x, y0 + y);
      if (x + 1 < w && label(x0 + x + 1, y0 + y) != here)
        for (int t = 0; t < f; ++t) viz::blend_pixel(img, (x + 1) * f - 1, y * f + t, c, alpha);
      if (y + 1 < h && label(x0 + x, y0 + y + 1) != here)
        for (int t = 0; t < f; ++t) viz::blend_pixel(img, x * f + t, (y + 1) * f - 1, c, alpha);
    }
}

void blend_cell(sr::Image& img, int x, int y, int f, viz::Rgb c, double alpha) {
  for (int dy = 0; dy < f; ++dy)
    for (int dx = 0; dx < f; ++dx) viz::blend_pixel(img, x * f + dx, y * f + dy, c, alpha);
}

void mark_query(sr::Image& img, int x, int y, int f) {
  const int m = std::max(2, f / 2);
  for (int k = 0; k < 2; ++k)
    viz::draw_rect(img, x * f - m + k, y * f - m + k, f + 2 * (m - k), f + 2 * (m - k), kQueryMark);
}

// "embedded:/a/b/w.safetensors" -> "embedded:w.safetensors" (the pictures should not show build paths)
std::string short_name(const std::string& name) {
  const size_t colon = name.find(':');
  const std::string prefix = colon == std::string::npos ? "" : name.substr(0, colon + 1);
  return prefix + fs::path(colon == std::string::npos ? name : name.substr(colon + 1)).filename().string();
}

std::string fixed(double v, int digits = 2) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

void check_viz_image_args(const VizImageArgs& a) {
  check(a.sr_scale == 0 || a.sr_scale == 2 || a.sr_scale == 3 || a.sr_scale == 4, ErrorKind::kInvalidArgument,
        "--sr-scale: expected 2, 3 or 4, given ", a.sr_scale);
  check(a.window < 0 || a.at.empty(), ErrorKind::kInvalidArgument, "--window and --at: give one or the other");
  check(a.at.empty() || a.at.size() == 2, ErrorKind::kInvalidArgument, "--at: expected X,Y, given ", a.at.size(),
        " values");
  check(a.crop.empty() || a.crop.size() == 4, ErrorKind::kInvalidArgument, "--crop: expected X,Y,W,H, given ",
        a.crop.size(), " values");
  check(a.max_pixels > 0, ErrorKind::kInvalidArgument, "--max-pixels: expected > 0, given ", a.max_pixels);
}

// --image, cropped by --crop, within --max-pixels.
sr::Image read_cropped_image(const VizImageArgs& a) {
  sr::Image im = sr::read_image(a.image);
  if (!a.crop.empty()) {
    const int64_t x0 = a.crop[0], y0 = a.crop[1], cw = a.crop[2], ch = a.crop[3];
    check(x0 >= 0 && y0 >= 0 && cw > 0 && ch > 0 && x0 + cw <= im.width && y0 + ch <= im.height,
          ErrorKind::kInvalidArgument, "--crop: expected X,Y,W,H inside the ", im.width, "x", im.height,
          " image with W, H > 0, given ", x0, ",", y0, ",", cw, ",", ch);
    im = crop_image(im, int(x0), int(y0), int(cw), int(ch));
  }
  check(im.width * im.height <= a.max_pixels, ErrorKind::kInvalidArgument, "--image '", a.image, "': ", im.width, "x",
        im.height, " = ", im.width * im.height, " pixels is over --max-pixels ", a.max_pixels,
        " (the model runs on the whole picture at once and every panel shows all of it); pass --crop X,Y,W,H "
        "(e.g. --crop 0,0,128,128), a smaller image, or raise --max-pixels");
  return im;
}

// The probed block, window and query: the query pixel (qx, qy) and its token in the window.
struct ProbeTarget {
  int64_t block = 0, window = 0, qx = 0, qy = 0, q_token = -1;
};

ProbeTarget choose_probe(const VizImageArgs& a, const std::vector<sr::BlockGeometry>& geo, int64_t w, int64_t h) {
  ProbeTarget pt;
  // default block: the first one with the widest windows (the long-range attention of the deep blocks)
  pt.block = a.block.empty() ? int64_t(std::max_element(geo.begin(), geo.end(),
                                                        [](const sr::BlockGeometry& x, const sr::BlockGeometry& y) {
                                                          return x.window < y.window;
                                                        }) -
                                       geo.begin())
                             : parse_block(a.block, geo);
  const sr::BlockGeometry& bg = geo[size_t(pt.block)];
  const int64_t ws = bg.window, L = ws * ws, H = bg.height, W = bg.width;
  int64_t qx = w / 2, qy = h / 2, q_token = -1;
  if (!a.at.empty()) {
    qx = a.at[0], qy = a.at[1];
    check(qx >= 0 && qx < w && qy >= 0 && qy < h, ErrorKind::kInvalidArgument, "--at: expected a pixel X,Y inside the ",
          w, "x", h, " image", a.crop.empty() ? "" : " (after --crop)", ", given ", qx, ",", qy);
  }
  if (a.window < 0 && a.at.empty()) {  // default: the centre of the window holding the image centre
    const int64_t n = bg.window_of(qy, qx);
    q_token = (ws / 2) * ws + ws / 2;
    bg.token_pixel(n, q_token, &qy, &qx);
    pt.window = n;
  } else if (a.window >= 0) {
    check(a.window < bg.num_windows(), ErrorKind::kInvalidArgument, "--window: expected an index in [0, ",
          bg.num_windows(), ") for block ", block_name(bg), " (", bg.windows_x, "x", bg.windows_y, " windows of ", ws,
          "x", ws, " on the ", W, "x", H, " padded image), given ", a.window);
    pt.window = a.window;
    q_token = (ws / 2) * ws + ws / 2;  // the window's centre
    bg.token_pixel(pt.window, q_token, &qy, &qx);
  } else {
    pt.window = bg.window_of(qy, qx);
    for (int64_t l = 0; l < L && q_token < 0; ++l) {
      int64_t y = 0, x = 0;
      bg.token_pixel(pt.window, l, &y, &x);
      if (y == qy && x == qx) q_token = l;
    }
  }
  check(q_token >= 0, ErrorKind::kInternal, "viz --image: pixel ", qx, ",", qy, " not found in its window");
  pt.qx = qx, pt.qy = qy, pt.q_token = q_token;
  return pt;
}

// One forward with the probe: the probed window's attention, every block's routing and gates, the statistics.
struct ProbedRun {
  ProbedRun(const VizImageArgs& args, const sr::SrModel& m, const sr::Image& image)
      : a(args),
        model(m),
        im(image),
        geo(m.block_geometry(image.height, image.width)),
        h(image.height),
        w(image.width),
        H(geo.front().height),
        W(geo.front().width) {}
  const VizImageArgs& a;
  const sr::SrModel& model;
  const sr::Image& im;
  std::vector<sr::BlockGeometry> geo;
  int64_t h = 0, w = 0, H = 0, W = 0;
  ProbeTarget target;
  sr::AttentionProbe probe;
  sr::AttentionMode mode = sr::AttentionMode::kSparse;
  std::vector<uint8_t> routed;
  std::vector<float> gates;
  sr::UpscaleStats stats;
  viz::Colormap cmap{};
  std::string where, state;  // "block G.B window n", the window's routing state
  const sr::BlockGeometry& bg() const { return geo[size_t(probe.block)]; }
};

void run_probed_forward(ProbedRun& r) {
  sr::UpscaleOptions opt;
  opt.mode = sr::parse_attention_mode(r.a.attention);
  opt.routing_out = &r.routed;
  opt.gates_out = &r.gates;
  opt.probe = &r.probe;
  const bool tty = isatty(STDERR_FILENO) != 0;
  if (tty)
    std::cerr << "viz: running the SR model (" << r.model.name() << ") on " << r.w << "x" << r.h << "..." << std::flush;
  r.model.forward(sr::image_to_tensor(r.im), opt, &r.stats);
  if (tty) std::cerr << "\r\033[K" << std::flush;
  r.mode = opt.mode;
  r.where = "block " + block_name(r.bg()) + " window " + std::to_string(r.probe.window);
  r.state = opt.mode == sr::AttentionMode::kDense ? "dense: every window attends"
            : r.probe.routed                      ? "routed, gate " + fixed(r.probe.gate)
                             : "not routed, gate " + fixed(r.probe.gate) + ": weights as if it were";
}

using Save = std::function<void(const std::string&, sr::Image)>;

// 1. per-head maps of the window's L x L attention, and the grid
void draw_head_maps(const ProbedRun& r, const Save& save) {
  const VizImageArgs& a = r.a;
  const int64_t heads = r.probe.weights.size(0), ws = r.bg().window, L = ws * ws;
  const float* wts = r.probe.weights.data<float>();
  const uint8_t* allowed = r.probe.allowed.data<uint8_t>();
  std::vector<viz::Matrix> mats;
  std::vector<std::string> titles;
  for (int64_t hh = 0; hh < heads; ++hh) {
    viz::Matrix m(L, L);
    for (int64_t i = 0; i < L * L; ++i)
      m.data[size_t(i)] = allowed[i] ? double(wts[hh * L * L + i]) : std::numeric_limits<double>::quiet_NaN();
    viz::HeatmapStyle s;
    s.cmap = r.cmap;
    s.title = r.where + " head " + std::to_string(hh) + " (" + r.state + ")";
    s.xlabel = "key token";
    s.ylabel = "query token";
    if (a.side > 0) s.plot_side = a.side;
    save("head_" + std::to_string(hh) + ".png", viz::render_heatmap(m, s));
    mats.push_back(std::move(m));
    titles.push_back("head " + std::to_string(hh));
  }
  viz::HeatmapStyle s;
  s.cmap = r.cmap;
  s.title = r.where + ", " + std::to_string(ws) + "x" + std::to_string(ws) + " tokens (" + r.state + ")";
  s.xlabel = "key token";
  s.ylabel = "query token";
  s.plot_side = a.side > 0 ? a.side : 256;
  save("heads.png",
       viz::render_heatmap_grid(mats, titles, a.columns > 0 ? a.columns : int(std::min<int64_t>(heads, 4)), s));
}

// 2. query focus over the picture: the query pixel's weights on the window's pixels
void draw_focus(const ProbedRun& r, const sr::Image& padded, const Save& save) {
  const VizImageArgs& a = r.a;
  const sr::BlockGeometry& bg = r.bg();
  const sr::AttentionProbe& probe = r.probe;
  const int64_t H = r.H, W = r.W, ws = bg.window, L = ws * ws, heads = probe.weights.size(0);
  const int64_t qx = r.target.qx, qy = r.target.qy, q_token = r.target.q_token;
  const float* wts = probe.weights.data<float>();
  const uint8_t* allowed = probe.allowed.data<uint8_t>();
  int64_t y0 = H, y1 = -1, x0 = W, x1 = -1;
  for (int64_t l = 0; l < L; ++l) {
    int64_t y = 0, x = 0;
    bg.token_pixel(probe.window, l, &y, &x);
    y0 = std::min(y0, y), y1 = std::max(y1, y), x0 = std::min(x0, x), x1 = std::max(x1, x);
  }
  const bool wraps = y1 - y0 + 1 != ws || x1 - x0 + 1 != ws;  // shifted window across the border
  if (wraps) {
    y0 = 0, x0 = 0, y1 = H - 1, x1 = W - 1;
  } else {
    y0 = std::max<int64_t>(0, y0 - ws / 2), x0 = std::max<int64_t>(0, x0 - ws / 2);
    y1 = std::min(H - 1, y1 + ws / 2), x1 = std::min(W - 1, x1 + ws / 2);
  }
  const int cw = int(x1 - x0 + 1), ch = int(y1 - y0 + 1);
  const int f = std::clamp((a.side > 0 ? a.side : 256) / std::max(cw, ch), 1, 32);
  const sr::Image crop = crop_image(padded, int(x0), int(y0), cw, ch);
  auto in_window = [&](int x, int y) { return bg.window_of(y, x) == probe.window; };
  // colour scale from the smallest to the largest weight of the query's row (over heads): windows of flat
  // content attend almost uniformly, and a 0-based scale would hide their structure
  double vmin = std::numeric_limits<double>::infinity(), vmax = 0;
  for (int64_t hh = 0; hh < heads; ++hh)
    for (int64_t l = 0; l < L; ++l)
      if (allowed[q_token * L + l]) {
        vmax = std::max(vmax, double(wts[(hh * L + q_token) * L + l]));
        vmin = std::min(vmin, double(wts[(hh * L + q_token) * L + l]));
      }
  vmax = std::max(vmax, vmin + 1e-12);
  std::vector<sr::Image> panels;
  std::vector<std::string> caps;
  sr::Image input = viz::magnify(crop, f);
  draw_edges(input, int(x0), int(y0), cw, ch, f, in_window, viz::kWhite, 0.9);
  mark_query(input, int(qx - x0), int(qy - y0), f);
  panels.push_back(std::move(input));
  caps.push_back("input");
  for (int64_t hh = 0; hh < heads; ++hh) {
    sr::Image p = viz::magnify(viz::faded_gray(crop, 0.45), f);
    for (int64_t l = 0; l < L; ++l) {
      if (!allowed[q_token * L + l]) continue;
      int64_t y = 0, x = 0;
      bg.token_pixel(probe.window, l, &y, &x);
      const double v = wts[(hh * L + q_token) * L + l];
      blend_cell(p, int(x - x0), int(y - y0), f, viz::colormap(r.cmap, (v - vmin) / (vmax - vmin)), 0.85);
    }
    draw_edges(p, int(x0), int(y0), cw, ch, f, in_window, kEdge, 0.8);
    mark_query(p, int(qx - x0), int(qy - y0), f);
    panels.push_back(std::move(p));
    caps.push_back("head " + std::to_string(hh));
  }
  viz::PanelGridStyle s;
  s.title = "attention of pixel (" + std::to_string(qx) + ", " + std::to_string(qy) + ") over its window";
  s.legend = {
      r.where + " (" + std::to_string(ws) + "x" + std::to_string(ws) + (bg.shift ? ", shifted" : "") + "), " + r.state,
      "red: the query pixel; coloured: the weight it gives each pixel of the window (uniform would be " +
          fixed(1.0 / double(L), 5) + ")"};
  s.colorbar = true;
  s.vmin = vmin, s.vmax = vmax, s.cmap = r.cmap, s.colorbar_label = "weight";
  save("focus.png", viz::render_panel_grid(panels, caps, a.columns > 0 ? a.columns : 4, s));
}

// 3. routing map: every block's windows over the picture, coloured by gate where routed, grey where skipped; the
// per-block routing goes to js["blocks"]
void draw_routing(const ProbedRun& r, const sr::Image& padded, nlohmann::json& js, const Save& save) {
  const VizImageArgs& a = r.a;
  const int64_t h = r.h, w = r.w;
  const std::vector<uint8_t>& routed = r.routed;
  const std::vector<float>& gates = r.gates;
  const int f = std::clamp((a.side > 0 ? a.side : 192) / int(std::max(h, w)), 1, 16);
  const sr::Image real = crop_image(padded, 0, 0, int(w), int(h));
  std::vector<sr::Image> panels{viz::magnify(real, f)};
  std::vector<std::string> caps{"input"};
  js["blocks"] = nlohmann::json::array();
  for (const sr::BlockGeometry& g : r.geo) {
    sr::Image p = viz::magnify(viz::faded_gray(real, 0.3), f);
    int64_t n_routed = 0;
    for (int64_t n = 0; n < g.num_windows(); ++n) n_routed += routed[size_t(g.offset + n)];
    for (int y = 0; y < int(h); ++y)
      for (int x = 0; x < int(w); ++x) {
        const int64_t n = g.window_of(y, x);
        if (routed[size_t(g.offset + n)])
          blend_cell(p, x, y, f, viz::colormap(r.cmap, gates[size_t(g.offset + n)]), 0.6);
      }
    draw_edges(
        p, 0, 0, int(w), int(h), f, [&](int x, int y) { return g.window_of(y, x); }, kEdge, 0.5);
    panels.push_back(std::move(p));
    caps.push_back("block " + block_name(g) + " (" + std::to_string(g.window) + (g.shift ? "s" : "") +
                   "): " + std::to_string(n_routed) + "/" + std::to_string(g.num_windows()));
    nlohmann::json b;
    b["block"] = block_name(g);
    b["window"] = g.window;
    b["shift"] = g.shift;
    b["windows_x"] = g.windows_x;
    b["windows_y"] = g.windows_y;
    b["routed"] = n_routed;
    b["gates"] = std::vector<float>(gates.begin() + g.offset, gates.begin() + g.offset + g.num_windows());
    b["routed_mask"] = std::vector<int>(routed.begin() + g.offset, routed.begin() + g.offset + g.num_windows());
    js["blocks"].push_back(b);
  }
  viz::PanelGridStyle s;
  s.title = "where the SR model spends attention";
  s.legend = {"coloured: windows the router sends through attention (colour = gate, routed if > " +
                  fixed(r.model.config().route_threshold) + "); grey: skipped (flat)",
              "caption: block G.B (window size, s = shifted): routed / windows; " +
                  std::to_string(r.stats.windows_routed) + "/" + std::to_string(r.stats.windows_total) +
                  " windows routed in all",
              "attention " + std::string(sr::to_string(r.mode)) + ", weights " + short_name(r.model.name())};
  s.colorbar = true;
  s.vmin = 0, s.vmax = 1, s.cmap = r.cmap, s.colorbar_label = "router gate";
  save("routing.png", viz::render_panel_grid(panels, caps, a.columns > 0 ? a.columns : 4, s));
}

// routing.json (after js["blocks"]) and the one-line summary
void describe_run(const ProbedRun& r, nlohmann::json& js, VizImagePictures& result) {
  const int64_t qx = r.target.qx, qy = r.target.qy;
  js["image"] = r.a.image;
  js["width"] = r.w;
  js["height"] = r.h;
  js["padded"] = {r.W, r.H};
  js["weights"] = r.model.name();
  js["attention"] = sr::to_string(r.mode);
  js["windows_total"] = r.stats.windows_total;
  js["windows_routed"] = r.stats.windows_routed;
  js["probe"] = {{"block", block_name(r.bg())}, {"window", r.probe.window}, {"query_token", r.target.q_token},
                 {"query_pixel", {qx, qy}},     {"routed", r.probe.routed}, {"gate", r.probe.gate}};
  result.json = js.dump(1) + "\n";
  result.summary = std::to_string(r.stats.windows_routed) + " of " + std::to_string(r.stats.windows_total) +
                   " windows routed to attention; " + r.where + " (" + r.state + "), query pixel (" +
                   std::to_string(qx) + ", " + std::to_string(qy) + "); weights " + short_name(r.model.name());
}

}  // namespace

VizImagePictures render_viz_image(const VizImageArgs& a) {
  check_viz_image_args(a);
  const sr::Image im = read_cropped_image(a);
  // --sr-scale 0 (unset): the scale of --weights, else x2 (the embedded default)
  const sr::SrModel model = load_sr_model(a.weights, a.sr_scale);
  ProbedRun r(a, model, im);
  // the block, window and query token
  r.target = choose_probe(a, r.geo, r.w, r.h);
  r.probe.block = r.target.block;
  r.probe.window = r.target.window;
  // one forward, capturing the window and every block's gates
  run_probed_forward(r);

  VizImagePictures result;
  const Save save = [&](const std::string& name, sr::Image img) { result.pictures.emplace_back(name, std::move(img)); };
  r.cmap = viz::parse_colormap(a.cmap);
  draw_head_maps(r, save);
  const sr::Image padded = padded_picture(im, r.H, r.W);
  draw_focus(r, padded, save);
  nlohmann::json js;
  draw_routing(r, padded, js, save);
  describe_run(r, js, result);
  return result;
}

void run_viz_image(const VizImageArgs& a) {
  create_output_directory(a.out);
  io::OutputFiles outputs;  // routing.json is opened before the work: an unwritable folder fails at once
  const std::string json_path = (fs::path(a.out) / "routing.json").string();
  io::OutputFile& json = outputs.add(json_path, "--out");
  const VizImagePictures r = render_viz_image(a);
  std::vector<std::string> written;
  for (const auto& [name, img] : r.pictures) {
    const std::string path = (fs::path(a.out) / name).string();
    io::OutputFile& f = outputs.add(path, "--out");
    sr::write_png(f, img);
    f.close();  // one open file at a time; the renames wait for commit()
    written.push_back(path);
  }
  json.write(r.json);
  written.push_back(json_path);
  outputs.commit();
  for (const auto& p : written) std::cout << p << "\n";
}

}  // namespace sattn::cli
