// sattn::viz: drawing on sr::Image, PNG round trips, colour maps, text, heatmaps, grids, query focus, plots,
// base64, attention maps.
#include <gtest/gtest.h>

#include <cmath>

#include "sattn/attention.hpp"
#include "sattn/profile.hpp"
#include "viz/viz.hpp"
#include "tools_test_util.hpp"

using namespace sattn;
using namespace sattn::viz;
using namespace sattn::testing_tools;

namespace {
bool has_colour(const Decoded& d, Rgb c) {
  for (size_t p = 0; p + 2 < d.rgb.size(); p += 3)
    if (d.rgb[p] == c.r && d.rgb[p + 1] == c.g && d.rgb[p + 2] == c.b) return true;
  return false;
}
double luminance(Rgb c) { return 0.2126 * c.r + 0.7152 * c.g + 0.0722 * c.b; }
}  // namespace

TEST(VizImage, PngRoundTripIsExact) {
  sr::Image img = canvas(23, 37);
  for (int y = 0; y < 23; ++y)
    for (int x = 0; x < 37; ++x) set_pixel(img, x, y, Rgb{uint8_t(x * 7), uint8_t(y * 11), uint8_t((x * y) & 255)});
  const Decoded d = decode_png_bytes(sr::encode_png(img));
  ASSERT_TRUE(d.ok);
  EXPECT_EQ(d.width, 37);
  EXPECT_EQ(d.height, 23);
  EXPECT_EQ(d.rgb, img.data);
}

TEST(VizImage, WritePngToBadPathThrowsIOError) {
  const sr::Image img = canvas(4, 4);
  try {
    sr::write_png("/nonexistent-dir/x.png", img);
    FAIL() << "expected sattn::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIO);
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/x.png"), std::string::npos);
  }
  EXPECT_THROW(canvas(5, 0), Error);
}

// canvas takes (height, width) as sr::Image does; pixels are addressed (x, y); drawing needs RGB.
TEST(VizImage, CanvasIsHeightByWidthAndDrawingNeedsRgb) {
  sr::Image img = canvas(3, 5, Rgb{1, 2, 3});
  EXPECT_EQ(img.height, 3);
  EXPECT_EQ(img.width, 5);
  EXPECT_EQ(img.channels, 3);
  EXPECT_EQ(pixel(img, 4, 2), (Rgb{1, 2, 3}));
  EXPECT_EQ(pixel(img, 5, 0), kWhite);  // outside
  set_pixel(img, 4, 2, kBlack);
  EXPECT_EQ(img.at(2, 4, 0), 0);
  const sr::Image r = rotated_ccw(img);  // (x, y) -> (y, W - 1 - x)
  EXPECT_EQ(r.height, 5);
  EXPECT_EQ(r.width, 3);
  EXPECT_EQ(pixel(r, 2, 0), kBlack);
  sr::Image big = canvas(4, 8);
  blit(big, img, 6, 1);  // clipped at the right border
  EXPECT_EQ(pixel(big, 7, 1), (Rgb{1, 2, 3}));
  sr::Image gray(4, 4, 1);
  EXPECT_THROW(fill_rect(gray, 0, 0, 2, 2, kBlack), Error);
  EXPECT_THROW(set_pixel(gray, 0, 0, kBlack), Error);
  EXPECT_THROW(blit(big, gray, 0, 0), Error);
}

TEST(VizColormap, EndpointsMonotoneAndNaN) {
  EXPECT_EQ(colormap(Colormap::kViridis, 0.0), (Rgb{68, 1, 84}));
  EXPECT_EQ(colormap(Colormap::kViridis, 1.0), (Rgb{253, 231, 37}));
  EXPECT_EQ(colormap(Colormap::kMagma, 0.0), (Rgb{0, 0, 4}));
  EXPECT_EQ(colormap(Colormap::kViridis, -3.0), colormap(Colormap::kViridis, 0.0));  // clamped
  EXPECT_EQ(colormap(Colormap::kViridis, std::nan("")), kMaskedGrey);
  for (Colormap c : {Colormap::kViridis, Colormap::kMagma, Colormap::kGray}) {
    double prev = -1;
    for (int i = 0; i <= 64; ++i) {  // perceptual maps: luminance increases with the value
      const double l = luminance(colormap(c, i / 64.0));
      EXPECT_GT(l, prev) << to_string(c) << " at " << i;
      prev = l;
    }
  }
  EXPECT_EQ(parse_colormap("magma"), Colormap::kMagma);
  EXPECT_THROW(parse_colormap("jet"), Error);
}

TEST(VizText, DrawsPixelsAndMeasures) {
  sr::Image img = canvas(30, 120);
  draw_text(img, 2, 2, "query 12", kBlack, 2);
  const Decoded d = decode_png_bytes(sr::encode_png(img));
  EXPECT_TRUE(has_colour(d, kBlack));
  EXPECT_GT(text_width("query 12", 2), text_width("q", 2));
  EXPECT_EQ(text_width("ab", 2), 2 * text_width("ab", 1));
  sr::Image v = canvas(120, 30);
  draw_text_vertical(v, 2, 2, "key", kBlack, 2);
  bool any = false;
  for (int y = 0; y < 120; ++y)
    any = any || pixel(v, 8, y) == kBlack || pixel(v, 6, y) == kBlack || pixel(v, 10, y) == kBlack;
  EXPECT_TRUE(any);
}

TEST(VizBase64, KnownVectors) {
  auto b = [](const std::string& s) { return base64_encode(std::vector<uint8_t>(s.begin(), s.end())); };
  EXPECT_EQ(b(""), "");
  EXPECT_EQ(b("f"), "Zg==");
  EXPECT_EQ(b("fo"), "Zm8=");
  EXPECT_EQ(b("foo"), "Zm9v");
  EXPECT_EQ(b("foobar"), "Zm9vYmFy");
  EXPECT_EQ(base64_encode({0xff, 0xfe, 0x00}), "//4A");
  EXPECT_EQ(html_escape("<a href=\"x\">&"), "&lt;a href=&quot;x&quot;&gt;&amp;");
  EXPECT_EQ(png_data_uri(canvas(2, 2)).rfind("data:image/png;base64,iVBORw0KGgo", 0), 0u);
}

TEST(VizHeatmap, SizeColourBarAndMaskedCells) {
  Matrix m(10, 14);
  for (int64_t i = 0; i < 10; ++i)
    for (int64_t j = 0; j < 14; ++j) m.at(i, j) = j > i ? std::nan("") : double(i + j);
  HeatmapStyle s;
  s.title = "t";
  s.plot_side = 140;
  const sr::Image img = render_heatmap(m, s);
  const Decoded d = decode_png_bytes(sr::encode_png(img));
  ASSERT_TRUE(d.ok);
  EXPECT_EQ(d.width, img.width);
  EXPECT_GE(img.width, 140);  // the matrix area alone is 14 cells x 10 px
  EXPECT_LT(img.width, 600);
  EXPECT_TRUE(d.non_constant());
  EXPECT_TRUE(has_colour(d, kMaskedGrey));                        // masked cells
  EXPECT_TRUE(has_colour(d, colormap(Colormap::kViridis, 1.0)));  // the maximum (and the colour bar top)
  EXPECT_TRUE(has_colour(d, colormap(Colormap::kViridis, 0.0)));  // the minimum
  EXPECT_GT(d.distinct_colours(), 20);
  EXPECT_THROW(render_heatmap(Matrix(), s), Error);
}

TEST(VizHeatmap, LargeMatrixIsPooledAndKeepsASpike) {
  Matrix m(1000, 700, 0.0);
  m.at(500, 300) = 1.0;  // one peak among zeros must survive max-pooling
  HeatmapStyle s;
  s.plot_side = 256;
  s.vmax = 1.0;
  const sr::Image img = render_heatmap(m, s);
  EXPECT_LT(img.height, 256 + 200);
  EXPECT_TRUE(has_colour(decode_png_bytes(sr::encode_png(img)), colormap(Colormap::kViridis, 1.0)));
  int bright = 0;  // the spike covers one pooled pixel; the colour bar adds a few more rows of the top colour
  for (int y = 0; y < int(img.height); ++y)
    for (int x = 0; x < int(img.width) - 150; ++x) bright += pixel(img, x, y) == colormap(Colormap::kViridis, 1.0);
  EXPECT_GE(bright, 1);
  EXPECT_LE(bright, 4);
}

TEST(VizHeatmap, GridAndQueryFocus) {
  std::vector<Matrix> panels;
  std::vector<std::string> titles;
  for (int p = 0; p < 6; ++p) {
    Matrix m(8, 8);
    for (int64_t i = 0; i < 8; ++i) m.at(i, (i + p) % 8) = 1.0;
    panels.push_back(m);
    titles.push_back("h" + std::to_string(p));
  }
  HeatmapStyle s;
  s.plot_side = 64;
  const sr::Image grid = render_heatmap_grid(panels, titles, 4, s);
  const sr::Image grid1 = render_heatmap_grid({panels[0]}, {"h0"}, 4, s);
  EXPECT_GT(grid.width, 4 * 64);
  EXPECT_GT(grid.height, 2 * 64);
  EXPECT_GT(grid.width, grid1.width + 3 * 64);
  EXPECT_TRUE(decode_png_bytes(sr::encode_png(grid)).non_constant());
  Matrix rows(3, 20, 0.01);
  rows.at(1, 7) = 0.9;
  rows.at(2, 19) = std::nan("");
  const sr::Image f = render_query_focus(rows, {"h0", "h1", "h2"}, "query 5", s);
  const Decoded d = decode_png_bytes(sr::encode_png(f));
  ASSERT_TRUE(d.ok);
  EXPECT_TRUE(has_colour(d, colormap(Colormap::kViridis, 1.0)));  // the 0.9 bar is the maximum
  EXPECT_TRUE(has_colour(d, kMaskedGrey));                        // the masked key's tick
  EXPECT_THROW(render_heatmap_grid({}, {}, 4, s), Error);
}

TEST(VizPlot, SvgIsWellFormedWithLogAxes) {
  PlotSpec a{"time", "L",  "ms",
             true,   true, {{"ref", {256, 512, 1024}, {1, 4, 16}, false}, {"x", {256, 512}, {2, 3}, true}}};
  PlotSpec b{"mem", "L", "MiB", true, true, {{"ref", {256, 512, 1024}, {0.25, 1, 4}, false}}};
  const std::string svg = render_plots_svg({a, b}, 400, 300);
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"800\" height=\"300\"", 0), 0u);
  EXPECT_EQ(count_of(svg, "<circle"), 3u + 2u + 3u);  // one marker per point
  EXPECT_GE(count_of(svg, ">1024</text>"), 2u);       // the swept L values label the log x axis
  EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
  EXPECT_NE(svg.find("ms (log)"), std::string::npos);
  // Log axis: equal ratios are equal distances (256 -> 512 -> 1024 markers equally spaced).
  std::vector<double> xs;
  for (size_t p = svg.find("<circle cx=\""); p != std::string::npos && xs.size() < 3;
       p = svg.find("<circle cx=\"", p + 1))
    xs.push_back(std::stod(svg.substr(p + 12)));
  ASSERT_EQ(xs.size(), 3u);
  EXPECT_NEAR(xs[1] - xs[0], xs[2] - xs[1], 1e-2);  // SVG numbers carry 6 significant digits
  const sr::Image png = render_plots_png({a, b}, 400, 300);
  EXPECT_EQ(png.width, 800);
  EXPECT_TRUE(decode_png_bytes(sr::encode_png(png)).non_constant());
  EXPECT_THROW(render_plots_svg({}, 400, 300), Error);
}

TEST(VizMaps, MatchTheReferenceAndShowTheMask) {
  const Tensor q = randn({2, 2, 9, 8}, 1), k = randn({2, 1, 11, 8}, 2);
  AttentionOptions o;
  o.causal = Causal::kBottomRight;
  Tensor lengths(DType::kI64, {2});
  lengths.data<int64_t>()[0] = 11;
  lengths.data<int64_t>()[1] = 6;
  o.key_lengths = lengths.view();
  const AttentionMaps maps = attention_maps(q, k, o);
  ASSERT_EQ(maps.maps.size(), 4u);
  const Tensor v = randn({2, 1, 11, 1}, 3);
  const AttentionResult r = attention(q, k, v, o, false, true);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 9; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < 11; ++j) {
          const bool allowed = j <= i + 11 - 9 && j < lengths.data<int64_t>()[b];
          const double x = maps.at(b, h).at(i, j);
          EXPECT_EQ(std::isnan(x), !allowed) << b << h << i << j;
          if (allowed) {
            EXPECT_NEAR(x, r.weights.view().get({b, h, i, j}), 1e-6);
            sum += x;
          }
        }
        EXPECT_NEAR(sum, 1.0, 1e-5);
      }
}

TEST(VizMaps, ExampleInputsHaveTheirStructure) {
  const ExampleInputs ex = example_inputs(1, 4, 40, 32, 3);
  const AttentionMaps maps = attention_maps(ex.q, ex.k, {});
  int diag = 0, back3 = 0, sink = 0;
  for (int64_t i = 3; i < 40; ++i) {
    auto argmax = [&](int64_t h) {
      int64_t best = 0;
      for (int64_t j = 1; j < 40; ++j)
        if (maps.at(0, h).at(i, j) > maps.at(0, h).at(i, best)) best = j;
      return best;
    };
    diag += argmax(0) == i;
    back3 += argmax(1) == i - 3;
    sink += argmax(2) <= 2;
  }
  EXPECT_GE(diag, 33);
  EXPECT_GE(back3, 33);
  EXPECT_GE(sink, 30);
}

TEST(Profile, MeasuresTimeAndMemoryPerPoint) {
  ProfileOptions o;
  o.lengths = {16, 64};
  o.heads = {1, 2};
  o.head_dim = 8;
  o.repeats = 1;
  o.num_threads = 1;  // no OpenMP in the forked child (this test process may already have used it)
  const auto pts = run_profile(o);
  ASSERT_EQ(pts.size(), 4u);
  for (const auto& p : pts) {
    EXPECT_TRUE(p.error.empty()) << p.error;
    EXPECT_GT(p.ms, 0.0);
    EXPECT_GE(p.peak_mib, 0.0);
    EXPECT_DOUBLE_EQ(p.analytic_mib, double(p.heads * p.length * p.length * 4) / (1 << 20));
  }
  const std::string csv = profile_to_csv(pts);
  EXPECT_EQ(csv.rfind("kernel,L,heads,ms,peak_mib,analytic_mib\nreference,16,1,", 0), 0u);
  EXPECT_EQ(count_of(csv, "\n"), 5u);
  EXPECT_NE(profile_to_table(pts).find("reference"), std::string::npos);
  EXPECT_EQ(xml_problem(render_plots_svg(profile_plot_specs(pts))), "");
  o.kernels = {"nope"};
  try {
    run_profile(o);
    FAIL() << "expected an error for an unknown kernel";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("available: "), std::string::npos) << e.what();
  }
}

TEST(Profile, MeasuredPeakGrowsWithTheScoreMatrix) {
  // The reference materialises B·h·L² floats (+1 byte of flags): the measured peak must see it.
  ProfileOptions o;
  o.lengths = {1024};
  o.heads = {4};
  o.head_dim = 8;
  o.repeats = 1;
  o.num_threads = 1;
  const auto pts = run_profile(o);
  ASSERT_EQ(pts.size(), 1u);
  ASSERT_TRUE(pts[0].error.empty()) << pts[0].error;
  EXPECT_DOUBLE_EQ(pts[0].analytic_mib, 16.0);
  EXPECT_GE(pts[0].peak_mib, 0.9 * 16.0);
}

TEST(VizHeatmap, OneQueryAgainstManyKeysStaysReadable) {
  Matrix m(1, 1000, 0.001);
  m.at(0, 10) = 0.5;
  HeatmapStyle s;
  s.plot_side = 256;
  const sr::Image img = render_heatmap(m, s);
  EXPECT_GE(img.height, 48 + 60);  // the single row is stretched to >= 48 px
  EXPECT_TRUE(decode_png_bytes(sr::encode_png(img)).non_constant());
  EXPECT_TRUE(has_colour(decode_png_bytes(sr::encode_png(img)), colormap(Colormap::kViridis, 1.0)));
}
