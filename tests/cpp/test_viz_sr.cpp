// `sattn viz --image`: the SR model's block geometry and attention probe (library), and the command's pictures,
// routing summary and errors (CLI). Uses the x2 weights committed in sr/weights/ (embedded in build/sattn).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "sattn/error.hpp"
#include "sattn/patterns.hpp"
#include "sattn/sr.hpp"
#include "tools_test_util.hpp"

using namespace sattn;
using namespace sattn::testing_tools;
namespace fs = std::filesystem;

namespace {

std::string x2_weights() { return std::string(SATTN_TEST_SOURCE_DIR) + "/sr/weights/sattn_sr_x2.safetensors"; }

// Left half flat (value `flat`), right half uniform noise.
sr::Image half_flat_half_noise(int64_t h, int64_t w, uint8_t flat, unsigned seed) {
  std::mt19937 rng(seed);
  sr::Image im(h, w, 3);
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x)
      for (int64_t c = 0; c < 3; ++c) im.at(y, x, c) = x < w / 2 ? flat : uint8_t(rng() % 256);
  return im;
}

TEST(SrGeometry, WindowsPartitionThePaddedImageAndInvertTokenPixel) {
  if (!fs::exists(x2_weights())) GTEST_SKIP() << "no " << x2_weights();
  const auto m = sr::SrModel::load(x2_weights());
  const auto geo = m.block_geometry(37, 50);  // padded to 48 x 64
  ASSERT_EQ(int64_t(geo.size()), m.config().num_blocks());
  int64_t offset = 0;
  for (const auto& g : geo) {
    EXPECT_EQ(g.height, 48);
    EXPECT_EQ(g.width, 64);
    EXPECT_EQ(g.offset, offset);
    EXPECT_EQ(g.shift, g.index % 2 == 1 ? g.window / 2 : 0);
    offset += g.num_windows();
    std::vector<int> seen(size_t(g.height * g.width), 0);
    for (int64_t n = 0; n < g.num_windows(); ++n)
      for (int64_t l = 0; l < g.window * g.window; ++l) {
        int64_t y = -1, x = -1;
        g.token_pixel(n, l, &y, &x);
        ASSERT_TRUE(y >= 0 && y < g.height && x >= 0 && x < g.width);
        ASSERT_EQ(g.window_of(y, x), n) << "block " << g.group << "." << g.index << " token " << l;
        seen[size_t(y * g.width + x)] += 1;
      }
    for (int s : seen) ASSERT_EQ(s, 1);  // every pixel in exactly one window
  }
}

TEST(SrProbe, AgreesWithRoutingLeavesTheOutputAloneAndIsASoftmax) {
  if (!fs::exists(x2_weights())) GTEST_SKIP() << "no " << x2_weights();
  const auto m = sr::SrModel::load(x2_weights());
  const sr::Image im = half_flat_half_noise(30, 32, 90, 3);  // padded to 32 x 32
  const Tensor x = sr::image_to_tensor(im);
  const auto geo = m.block_geometry(30, 32);
  sr::UpscaleOptions plain;
  const Tensor y0 = m.forward(x, plain);
  for (int64_t b = 0; b < int64_t(geo.size()); ++b) {
    const auto& g = geo[size_t(b)];
    // the last window touches the bottom-right border: masked in shifted blocks
    for (int64_t n : {int64_t(0), g.num_windows() - 1}) {
      sr::AttentionProbe probe;
      probe.block = b, probe.window = n;
      std::vector<uint8_t> routed;
      std::vector<float> gates;
      sr::UpscaleOptions o;
      o.probe = &probe, o.routing_out = &routed, o.gates_out = &gates;
      const Tensor y = m.forward(x, o);
      ASSERT_EQ(0, std::memcmp(y.data(), y0.data(), y.nbytes())) << "the probe changed the output";
      EXPECT_EQ(probe.gate, gates[size_t(g.offset + n)]);
      EXPECT_EQ(probe.routed, routed[size_t(g.offset + n)] != 0);
      const int64_t L = g.window * g.window, H = m.config().heads;
      ASSERT_EQ(probe.weights.shape(), (Shape{H, L, L}));
      ASSERT_EQ(probe.allowed.shape(), (Shape{L, L}));
      const float* w = probe.weights.data<float>();
      const uint8_t* a = probe.allowed.data<uint8_t>();
      int64_t forbidden = 0;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < L; ++i) {
          double sum = 0;
          for (int64_t j = 0; j < L; ++j) {
            const float v = w[(h * L + i) * L + j];
            if (a[i * L + j]) {
              EXPECT_GT(v, 0.0f);
              sum += v;
            } else {
              EXPECT_EQ(v, 0.0f);
              forbidden += h == 0;
            }
          }
          ASSERT_NEAR(sum, 1.0, 1e-5) << "block " << b << " window " << n << " row " << i;
        }
      // only the shifted blocks' border windows carry the Swin mask
      EXPECT_EQ(forbidden > 0, g.shift > 0 && n == g.num_windows() - 1) << "block " << b << " window " << n;
    }
  }
  sr::AttentionProbe bad;
  bad.block = int64_t(geo.size());
  sr::UpscaleOptions o;
  o.probe = &bad;
  EXPECT_THROW(m.forward(x, o), Error);
  bad.block = 0, bad.window = geo[0].num_windows();
  EXPECT_THROW(m.forward(x, o), Error);
  o.tile = 16;
  bad.window = 0;
  EXPECT_THROW(m.upscale(im, o), Error);  // tiled runs cannot be probed
}

// The SR model's cyclic shifted windows (roll, full windows, Swin's mask) allow, in image coordinates, exactly the
// pairs of the non-wrapping pattern WindowAttention2D(H, W, ws, shift) (docs/sparse.md, "Shifted windows"): every
// window's mask, read through token_pixel, agrees with the pattern, and the windows hold all the pattern's pairs.
TEST(SrProbe, CyclicShiftMaskAllowsThePairsOfWindowAttention2D) {
  if (!fs::exists(x2_weights())) GTEST_SKIP() << "no " << x2_weights();
  const auto m = sr::SrModel::load(x2_weights());
  const sr::Image im = half_flat_half_noise(40, 30, 90, 4);  // padded to 48 x 32
  const Tensor x = sr::image_to_tensor(im);
  const auto geo = m.block_geometry(40, 30);
  std::vector<std::pair<int64_t, int64_t>> done;  // (window, shift) checked
  for (int64_t b = 0; b < int64_t(geo.size()); ++b) {
    const auto& g = geo[size_t(b)];
    if (std::find(done.begin(), done.end(), std::make_pair(g.window, g.shift)) != done.end()) continue;
    done.emplace_back(g.window, g.shift);
    const int64_t HW = g.height * g.width, L = g.window * g.window;
    const sparse::WindowAttention2D pattern(g.height, g.width, g.window, g.shift);
    int64_t pattern_pairs = 0, window_pairs = 0;
    for (int64_t i = 0; i < HW; ++i)
      for (int64_t j = 0; j < HW; ++j) pattern_pairs += pattern.allowed(0, 0, i, j, HW, HW);
    for (int64_t n = 0; n < g.num_windows(); ++n) {
      sr::AttentionProbe probe;
      probe.block = b, probe.window = n;
      sr::UpscaleOptions o;
      o.probe = &probe;
      m.forward(x, o);
      const uint8_t* a = probe.allowed.data<uint8_t>();
      for (int64_t qi = 0; qi < L; ++qi)
        for (int64_t kj = 0; kj < L; ++kj) {
          int64_t qy = 0, qx = 0, ky = 0, kx = 0;
          g.token_pixel(n, qi, &qy, &qx);
          g.token_pixel(n, kj, &ky, &kx);
          const bool want = pattern.allowed(0, 0, qy * g.width + qx, ky * g.width + kx, HW, HW);
          ASSERT_EQ(a[qi * L + kj] != 0, want) << "block " << b << " window " << n << " tokens " << qi << ", " << kj;
          window_pairs += want;
        }
    }
    EXPECT_EQ(window_pairs, pattern_pairs) << "block " << b;
  }
  EXPECT_EQ(done.size(), 4u);  // windows 8 and 16, each unshifted and shifted
}

// ---- the command -------------------------------------------------------------------------------------------

nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text(path)); }

TEST(VizImageCli, WritesMapsFocusRoutingAndSummary) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_image");
  sr::write_png(dir + "/in.png", half_flat_half_noise(40, 56, 90, 5));  // padded to 48 x 64
  const RunResult r = run_sattn("viz --image in.png --out o", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");  // not a terminal: no progress
  for (const char* f : {"head_0.png", "head_1.png", "heads.png", "focus.png", "routing.png"}) {
    const Decoded d = decode_png_file(dir + "/o/" + f);
    ASSERT_TRUE(d.ok) << f;
    EXPECT_TRUE(d.non_constant()) << f;
    EXPECT_GT(d.distinct_colours(), 20) << f;
    EXPECT_NE(r.out.find(f), std::string::npos) << f;
  }
  const Decoded head = decode_png_file(dir + "/o/head_0.png");
  EXPECT_GT(head.width, 256 + 100);  // 256 x 256 tokens (one px each in a 384 px plot), axes and colour bar
  EXPECT_GT(head.height, 256 + 50);
  // routing.png: the input and the blocks of 56 x 40 px magnified x3 (192 / 56), 4 per row -> 2 rows or more
  const Decoded routing = decode_png_file(dir + "/o/routing.png");
  EXPECT_GT(routing.width, 4 * 56 * 3);
  EXPECT_GT(routing.height, 2 * 40 * 3);
  const auto js = read_json(dir + "/o/routing.json");
  ASSERT_EQ(js["blocks"].size(), 8u);  // the shipped x2 model: 4 groups of 2 blocks
  EXPECT_EQ(js["padded"], nlohmann::json({64, 48}));
  int64_t routed = 0, total = 0;
  for (const auto& b : js["blocks"]) {
    const int64_t ws = b["window"];
    EXPECT_EQ(b["gates"].size(), size_t((48 / ws) * (64 / ws)));
    int64_t n = 0;
    for (size_t i = 0; i < b["gates"].size(); ++i) {
      EXPECT_EQ(b["routed_mask"][i].get<int>(), b["gates"][i].get<float>() > 0.5f ? 1 : 0);
      n += b["routed_mask"][i].get<int>();
    }
    EXPECT_EQ(b["routed"].get<int64_t>(), n);
    routed += n, total += int64_t(b["gates"].size());
  }
  EXPECT_EQ(js["windows_routed"].get<int64_t>(), routed);
  EXPECT_EQ(js["windows_total"].get<int64_t>(), total);
  // default: block 2.0 (the first with the widest, 16 x 16, windows), the window holding the image centre (28, 20),
  // its centre token
  EXPECT_EQ(js["probe"]["block"], "2.0");
  EXPECT_EQ(js["probe"]["window"], 1 * 4 + 1);
  EXPECT_EQ(js["probe"]["query_pixel"], nlohmann::json({24, 24}));
}

TEST(VizImageCli, RoutingSeparatesTheFlatHalfFromTheTexturedHalf) {
  // Identical flat windows get one gate (one decision); noise windows get many different ones. Block 0.0 sees
  // 2 px of context (head conv + the block's dw conv), so windows 2+ px away from the border and the noise are
  // exactly flat.
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_image_flat");
  sr::write_png(dir + "/in.png", half_flat_half_noise(64, 96, 60, 7));
  const RunResult r = run_sattn("viz --image in.png --out o --block 0.0", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto js = read_json(dir + "/o/routing.json");
  const auto& b = js["blocks"][0];
  ASSERT_EQ(b["block"], "0.0");
  ASSERT_EQ(b["window"], 8);
  const int64_t nx = b["windows_x"], ny = b["windows_y"];
  std::vector<float> flat, noise;
  for (int64_t wy = 1; wy + 1 < ny; ++wy)
    for (int64_t wx = 1; wx + 1 < nx; ++wx) {
      const float g = b["gates"][size_t(wy * nx + wx)];
      if ((wx + 1) * 8 + 2 <= 48) flat.push_back(g);
      if (wx * 8 >= 48) noise.push_back(g);
    }
  ASSERT_GE(flat.size(), 8u);
  ASSERT_GE(noise.size(), 8u);
  const auto [fmin, fmax] = std::minmax_element(flat.begin(), flat.end());
  const auto [nmin, nmax] = std::minmax_element(noise.begin(), noise.end());
  EXPECT_LT(*fmax - *fmin, 1e-6f) << "flat windows should share one gate";
  EXPECT_GT(*nmax - *nmin, 1e-3f) << "noise windows should not";
  EXPECT_NE(*fmin, *nmin);
}

TEST(VizImageCli, AtChoosesTheWindowHoldingThePixelAlsoInShiftedBlocks) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_image_at");
  sr::write_png(dir + "/in.png", half_flat_half_noise(40, 80, 120, 9));  // padded to 48 x 80
  RunResult r = run_sattn("viz --image in.png --at 70,10 --out o", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  auto js = read_json(dir + "/o/routing.json");
  EXPECT_EQ(js["probe"]["window"], 0 * 5 + 70 / 16);
  EXPECT_EQ(js["probe"]["query_pixel"], nlohmann::json({70, 10}));
  EXPECT_EQ(js["probe"]["query_token"], 10 * 16 + 70 % 16);
  // block 0.1: 8 x 8 windows rolled by 4: pixel (70, 10) sits at (66, 6) -> window row 0, column 8
  r = run_sattn("viz --image in.png --block 0.1 --at 70,10 --out o2 --side 64", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  js = read_json(dir + "/o2/routing.json");
  EXPECT_EQ(js["probe"]["window"], 8);
  EXPECT_EQ(js["probe"]["query_token"], 6 * 8 + 66 % 8);
  // --window: its centre token
  r = run_sattn("viz --image in.png --block 1.0 --window 13 --out o3 --side 64", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  js = read_json(dir + "/o3/routing.json");
  EXPECT_EQ(js["probe"]["window"], 13);
  EXPECT_EQ(js["probe"]["query_pixel"], nlohmann::json({3 * 8 + 4, 1 * 8 + 4}));  // 10 windows per row
}

TEST(VizImageCli, BadInputExitsTwoWithAClearMessage) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("viz_image_bad");
  sr::write_png(dir + "/in.png", half_flat_half_noise(24, 32, 100, 11));
  sr::write_png(dir + "/big.png", half_flat_half_noise(300, 240, 100, 12));
  auto expect = [&](const std::string& args, const std::string& needle) {
    const RunResult r = run_sattn(args, dir);
    EXPECT_EQ(r.code, 2) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << "\n" << r.err;
  };
  expect("viz --image missing.png --out o", "missing.png");
  expect("viz --image in.png --window 999 --out o", "--window");
  expect("viz --image in.png --at 40,3 --out o", "--at");
  expect("viz --image in.png --at 4,3 --window 0 --out o", "--window and --at");
  expect("viz --image in.png --block 7.0 --out o", "--block");
  expect("viz --image in.png --block x --out o", "--block");
  expect("viz --image in.png --crop 0,0,40,8 --out o", "--crop");
  expect("viz --image big.png --out o", "--max-pixels");
  expect("viz --image in.png --q in.png --out o", "--image");
  expect("viz --example --window 3 --out o", "only with --image");
  expect("viz --image in.png --sr-scale 4 --weights " + x2_weights() + " --out o", "x2");
  // a crop brings a large picture under the limit
  const RunResult r = run_sattn("viz --image big.png --crop 100,100,48,40 --side 64 --out c", dir);
  EXPECT_EQ(r.code, 0) << r.err;
  const auto js = read_json(dir + "/c/routing.json");
  EXPECT_EQ(js["width"], 48);
  EXPECT_EQ(js["height"], 40);
}

}  // namespace

namespace {
TEST(VizImageCli, ReportEmbedsTheRoutingMapAndFocus) {
  ASSERT_TRUE(have_binary());
  const std::string dir = temp_dir("report_image");
  sr::write_png(dir + "/in.png", half_flat_half_noise(32, 48, 60, 13));
  RunResult r = run_sattn("report plain.html --no-profile", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  r = run_sattn("report sr.html --no-profile --image in.png --at 40,8", dir);
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string plain = read_text(dir + "/plain.html"), html = read_text(dir + "/sr.html");
  EXPECT_EQ(count_of(html, "data:image/png;base64,"), count_of(plain, "data:image/png;base64,") + 2);
  EXPECT_NE(html.find("Super-resolution model"), std::string::npos);
  EXPECT_NE(html.find("query pixel (40, 8)"), std::string::npos);
  r = run_sattn("report bad.html --no-profile --image in.png --at 99,8", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--at"), std::string::npos) << r.err;
}
}  // namespace
