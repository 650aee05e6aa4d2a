// SR: image I/O (valid, truncated, garbage, huge headers), bicubic and metric invariants, the channels-last
// building blocks against plain loops, and SattnSR model invariants on a tiny random model.
#include <gtest/gtest.h>
#include <unistd.h>
#include <zlib.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "nn/ops.hpp"
#include "sattn/safetensors.hpp"
#include "sattn/sr.hpp"
#include "scoped.hpp"

namespace {

using sattn::ErrorKind;
using sattn::sr::Image;

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("sattn_sr_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::string read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
void write_bytes(const std::string& p, const std::string& b) {
  std::ofstream f(p, std::ios::binary);
  f << b;
}

Image random_image(int64_t h, int64_t w, int64_t c, unsigned seed) {
  std::mt19937 rng(seed);
  Image im(h, w, c);
  for (auto& v : im.data) v = uint8_t(rng() % 256);
  return im;
}

// Expects read_image(path) to throw kIO whose message names the file and contains `needle`.
void expect_io_error(const std::string& path, const std::string& needle, int64_t max_pixels = 0) {
  try {
    if (max_pixels > 0) sattn::sr::read_image(path, max_pixels);
    else sattn::sr::read_image(path);
    ADD_FAILURE() << "no error for " << path << " (expected: " << needle << ")";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIO) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(SrImageIO, PngRoundTripRgbAndGray) {
  const Image rgb = random_image(13, 17, 3, 1);
  const std::string p = temp_path("rgb.png");
  sattn::sr::write_png(p, rgb);
  const Image back = sattn::sr::read_image(p);
  EXPECT_EQ(back.height, 13);
  EXPECT_EQ(back.width, 17);
  EXPECT_EQ(back.source_channels, 3);
  EXPECT_EQ(back.data, rgb.data);

  const Image gray = random_image(9, 5, 1, 2);
  const std::string g = temp_path("gray.png");
  sattn::sr::write_png(g, gray);
  const Image gb = sattn::sr::read_image(g);
  ASSERT_EQ(gb.channels, 3);
  EXPECT_EQ(gb.source_channels, 1);
  for (int64_t y = 0; y < 9; ++y)
    for (int64_t x = 0; x < 5; ++x)
      for (int c = 0; c < 3; ++c) EXPECT_EQ(gb.at(y, x, c), gray.at(y, x, 0));  // gray replicated to RGB
}

TEST(SrImageIO, TruncatedGarbageEmptyMissing) {
  const std::string p = temp_path("v.png");
  sattn::sr::write_png(p, random_image(40, 50, 3, 3));
  const std::string bytes = read_bytes(p);
  for (size_t n : {size_t(10), size_t(40), bytes.size() / 2, bytes.size() - 13}) {
    const std::string t = temp_path("trunc.png");
    write_bytes(t, bytes.substr(0, n));
    expect_io_error(t, "PNG");
  }
  const std::string g = temp_path("garbage.png");
  write_bytes(g, std::string(1000, '\x42'));
  expect_io_error(g, "unsupported format");
  const std::string gif = temp_path("x.gif");
  write_bytes(gif, std::string("GIF89a") + std::string(100, '\0'));
  expect_io_error(gif, "unsupported format");
  const std::string e = temp_path("empty.png");
  write_bytes(e, "");
  expect_io_error(e, "empty");
  expect_io_error(temp_path("does_not_exist.png"), "cannot open");
  expect_io_error(std::filesystem::temp_directory_path().string(), "");  // a directory
}

TEST(SrImageIO, HugeHeaderRejectedBeforeDecoding) {
  // PNG signature + an IHDR claiming 200000 x 300000 pixels, then an IDAT of zeros
  std::string png("\x89PNG\r\n\x1a\n", 8);
  auto be32 = [](uint32_t v) {
    return std::string{char(v >> 24), char((v >> 16) & 255), char((v >> 8) & 255), char(v & 255)};
  };
  const std::string ihdr = "IHDR" + be32(200000) + be32(300000) + std::string("\x08\x02\x00\x00\x00", 5);
  png += be32(13) + ihdr + be32(uint32_t(crc32(0, reinterpret_cast<const Bytef*>(ihdr.data()), uInt(ihdr.size()))));
  png += be32(64) + "IDAT" + std::string(64, '\0');
  const std::string p = temp_path("huge.png");
  write_bytes(p, png);
  try {
    sattn::sr::read_image(p);
    ADD_FAILURE() << "no error";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIO);
    const std::string m = e.what();
    EXPECT_NE(m.find(p), std::string::npos) << m;
    EXPECT_NE(m.find("200000x300000 = 60000000000 pixels is over the limit"), std::string::npos) << m;
  }
  // a valid image over a small limit
  const std::string v = temp_path("v2.png");
  sattn::sr::write_png(v, random_image(30, 30, 3, 4));
  expect_io_error(v, "over the limit", 899);
  EXPECT_NO_THROW(sattn::sr::read_image(v, 900));
}

TEST(SrImageIO, WriteErrors) {
  EXPECT_THROW(sattn::sr::write_png("/nonexistent_dir_sattn/x.png", random_image(4, 4, 3, 5)), sattn::Error);
  Image bad(4, 4, 2);
  EXPECT_THROW(sattn::sr::write_png(temp_path("bad.png"), bad), sattn::Error);
}

TEST(SrResize, ConstantStaysConstantAndScaleOneIsIdentity) {
  Image c(23, 17, 3);
  for (auto& v : c.data) v = 77;
  for (double s : {0.5, 0.25, 1.0 / 3, 2.0, 4.0, 3.0}) {
    const Image r = sattn::sr::imresize(c, s);
    EXPECT_EQ(r.height, int64_t(std::ceil(23 * s - 1e-9)));
    EXPECT_EQ(r.width, int64_t(std::ceil(17 * s - 1e-9)));
    for (auto v : r.data) ASSERT_EQ(v, 77) << "scale " << s;
  }
  const Image im = random_image(11, 9, 3, 6);
  EXPECT_EQ(sattn::sr::imresize(im, 1.0).data, im.data);
  EXPECT_THROW(sattn::sr::downscale(random_image(11, 9, 3, 7), 2), sattn::Error);
  EXPECT_THROW(sattn::sr::imresize(im, 0.0), sattn::Error);
  EXPECT_THROW(sattn::sr::imresize(Image(0, 0, 3), 2.0), sattn::Error);
}

TEST(SrResize, LinearRampIsReproducedInTheInterior) {
  // the cubic kernel reproduces linear functions exactly (away from the symmetric-padding border)
  std::vector<double> ramp(40 * 40);
  for (int y = 0; y < 40; ++y)
    for (int x = 0; x < 40; ++x) ramp[size_t(y * 40 + x)] = 3.0 * x + 2.0 * y;
  const auto up = sattn::sr::imresize_plane(ramp, 40, 40, 2.0, 80, 80);
  for (int y = 8; y < 72; ++y)
    for (int x = 8; x < 72; ++x) {
      // output pixel x (0-based) samples input coordinate (x + 1)/2 + 0.25 (1-based) -> 0-based: x/2 - 0.25
      const double ex = 3.0 * (x / 2.0 - 0.25) + 2.0 * (y / 2.0 - 0.25);
      ASSERT_NEAR(up[size_t(y * 80 + x)], ex, 1e-9);
    }
}

TEST(SrMetrics, KnownValues) {
  const Image a = random_image(20, 24, 3, 8);
  EXPECT_TRUE(std::isinf(sattn::sr::psnr_y(a, a, 2)));
  EXPECT_NEAR(sattn::sr::ssim_y(a, a, 2), 1.0, 1e-12);
  Image b = a;
  for (auto& v : b.data) v = uint8_t(std::min(255, v + 1));
  Image a2 = a;
  for (auto& v : a2.data) v = uint8_t(std::min(254, int(v)));  // so that +1 never saturates
  for (size_t i = 0; i < b.data.size(); ++i) b.data[i] = uint8_t(a2.data[i] + 1);
  const double dy = (65.481 + 128.553 + 24.966) / 255.0;  // Y step of +1 on every channel
  EXPECT_NEAR(sattn::sr::psnr_y(a2, b, 3), 20 * std::log10(255.0 / dy), 1e-9);
  EXPECT_LT(sattn::sr::ssim_y(a2, random_image(20, 24, 3, 9), 2), 0.5);
  EXPECT_THROW(sattn::sr::psnr_y(a, random_image(20, 25, 3, 1), 2), sattn::Error);
  EXPECT_THROW(sattn::sr::ssim_y(a, a, 6), sattn::Error);  // 8 x 12 left: smaller than the 11 x 11 window
}

// ---- building blocks vs plain loops ----------------------------------------------------------------------
std::vector<float> randv(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

float bf16_rounded(float x) { return sattn::bf16_to_float(sattn::float_to_bf16(x)); }

// fp64 plain loops of the 3x3 convolutions on [H, W, C] inputs (zero padding).
// Output channel o at pixel (y, x) of a dense one, PyTorch weight w [Co, Ci, 3, 3] and bias b; with `bf16`, every
// input and weight rounded to bf16 first; the sum of the terms' magnitudes into *mag when given.
double conv3x3_ref(const std::vector<float>& in, const std::vector<float>& w, const std::vector<float>& b, int H, int W,
                   int Ci, int y, int x, int o, bool bf16 = false, double* mag = nullptr) {
  const auto r = [bf16](float v) { return bf16 ? bf16_rounded(v) : v; };
  double s = b[size_t(o)], m = std::fabs(b[size_t(o)]);
  for (int i = 0; i < Ci; ++i)
    for (int ky = 0; ky < 3; ++ky)
      for (int kx = 0; kx < 3; ++kx) {
        const int yy = y + ky - 1, xx = x + kx - 1;
        if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
        const double t = double(r(w[size_t(((o * Ci + i) * 3 + ky) * 3 + kx)])) * r(in[size_t((yy * W + xx) * Ci + i)]);
        s += t, m += std::fabs(t);
      }
  if (mag) *mag = m;
  return s;
}
// Every channel at pixel (y, x) of act(depthwise(in) + bd), depthwise weights wd [9][C] (depthwise_weight_hwc's
// layout), act = the exact GELU when `gelu`, else identity.
std::vector<double> depthwise_act_ref(const std::vector<float>& in, const std::vector<float>& wd,
                                      const std::vector<float>& bd, int H, int W, int C, int y, int x, bool gelu) {
  std::vector<double> t(static_cast<size_t>(C));
  for (int c = 0; c < C; ++c) {
    double s = bd[size_t(c)];
    for (int ky = 0; ky < 3; ++ky)
      for (int kx = 0; kx < 3; ++kx) {
        const int yy = y + ky - 1, xx = x + kx - 1;
        if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
        s += double(wd[size_t((ky * 3 + kx) * C + c)]) * in[size_t((yy * W + xx) * C + c)];
      }
    t[size_t(c)] = gelu ? 0.5 * s * (1 + std::erf(s / std::sqrt(2.0))) : s;
  }
  return t;
}

TEST(SrOps, Conv3x3AndDepthwiseMatchPlainLoops) {
  // rows are split into four bands per thread: heights around the band counts test the band borders; rows of more
  // than one span of the depthwise row (about 1280 values), the last one partial, with and without a masked tail
  for (auto [H, W, Ci, Co, threads] :
       {std::tuple{5, 7, 3, 9, 2}, std::tuple{1, 1, 2, 2, 2}, std::tuple{6, 9, 40, 67, 2}, std::tuple{11, 4, 12, 12, 3},
        std::tuple{3, 5, 8, 8, 4}, std::tuple{4, 37, 40, 40, 2}, std::tuple{3, 150, 12, 12, 2},
        std::tuple{2, 131, 11, 11, 1}}) {
    const auto in = randv(size_t(H * W * Ci), 1), w = randv(size_t(Co * Ci * 9), 2), b = randv(size_t(Co), 3);
    const auto w9 = sattn::nn::conv3x3_weight_hwc(w.data(), Co, Ci);
    std::vector<float> out(size_t(H * W * Co)), one(out.size());
    sattn::nn::conv3x3_hwc(in.data(), H, W, Ci, w9.data(), b.data(), Co, out.data(), threads);
    sattn::nn::conv3x3_hwc(in.data(), H, W, Ci, w9.data(), b.data(), Co, one.data(), 1);
    ASSERT_EQ(0, std::memcmp(out.data(), one.data(), out.size() * sizeof(float))) << "thread count changed results";
    {  // with `add`: the same convolution, then + add, element by element
      const auto addend = randv(out.size(), 4);
      std::vector<float> sum(out.size());
      sattn::nn::conv3x3_hwc(in.data(), H, W, Ci, w9.data(), b.data(), Co, sum.data(), threads, addend.data());
      for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(sum[i], out[i] + addend[i]) << "add, element " << i;
    }
    if (Ci == Co) {  // in place
      std::vector<float> io = in;
      sattn::nn::conv3x3_hwc(io.data(), H, W, Ci, w9.data(), b.data(), Co, io.data(), threads);
      ASSERT_EQ(0, std::memcmp(out.data(), io.data(), out.size() * sizeof(float))) << "in place";
    }
    for (int y = 0; y < H; ++y)
      for (int x = 0; x < W; ++x)
        for (int o = 0; o < Co; ++o) {
          const double s = conv3x3_ref(in, w, b, H, W, Ci, y, x, o);
          ASSERT_NEAR(out[size_t((y * W + x) * Co + o)], s, 1e-4 * (1 + std::fabs(s)));
        }
    // depthwise on the first Ci channels
    const auto wd = sattn::nn::depthwise_weight_hwc(w.data(), Ci);
    std::vector<float> od(size_t(H * W * Ci)), odi = in;
    sattn::nn::depthwise3x3_hwc(in.data(), H, W, Ci, wd.data(), b.data(), od.data(), threads);
    sattn::nn::depthwise3x3_hwc(odi.data(), H, W, Ci, wd.data(), b.data(), odi.data(), threads);
    ASSERT_EQ(0, std::memcmp(od.data(), odi.data(), od.size() * sizeof(float))) << "depthwise in place";
    for (int y = 0; y < H; ++y)
      for (int x = 0; x < W; ++x)
        for (int c = 0; c < Ci; ++c) {
          double s = b[size_t(c)];
          for (int ky = 0; ky < 3; ++ky)
            for (int kx = 0; kx < 3; ++kx) {
              const int yy = y + ky - 1, xx = x + kx - 1;
              if (yy < 0 || yy >= H || xx < 0 || xx >= W) continue;
              s += double(w[size_t(c * 9 + ky * 3 + kx)]) * in[size_t((yy * W + xx) * Ci + c)];
            }
          ASSERT_NEAR(od[size_t((y * W + x) * Ci + c)], s, 1e-4 * (1 + std::fabs(s)));
        }
  }
}

TEST(SrOps, LinearLayerNormGelu) {
  const int M = 13, K = 7, N = 70;
  const auto x = randv(size_t(M * K), 4), w = randv(size_t(N * K), 5), b = randv(size_t(N), 6);
  const auto wt = sattn::nn::transpose_weight(w.data(), N, K);
  std::vector<float> y(size_t(M * N));
  sattn::nn::linear(x.data(), M, K, wt.data(), b.data(), N, y.data(), 2);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double s = b[size_t(n)];
      for (int k = 0; k < K; ++k) s += double(x[size_t(m * K + k)]) * w[size_t(n * K + k)];
      ASSERT_NEAR(y[size_t(m * N + n)], s, 1e-5 * (1 + std::fabs(s)));
    }
  // LayerNorm over channel counts that are and are not whole vectors of every target (4, 8 or 16 lanes), out of
  // place and in place
  for (const int Cn : {7, 16, 48, 50, 64}) {
    const auto xs = randv(size_t(M * Cn), 11), gs = randv(size_t(Cn), 12), bs = randv(size_t(Cn), 13);
    std::vector<float> ln(size_t(M * Cn)), in_place = xs;
    sattn::nn::layer_norm(xs.data(), M, Cn, gs.data(), bs.data(), 1e-5f, ln.data());
    sattn::nn::layer_norm(in_place.data(), M, Cn, gs.data(), bs.data(), 1e-5f, in_place.data());
    ASSERT_EQ(ln, in_place) << "C = " << Cn;
    for (int m = 0; m < M; ++m) {
      double mean = 0, var = 0;
      for (int k = 0; k < Cn; ++k) mean += xs[size_t(m * Cn + k)] / double(Cn);
      for (int k = 0; k < Cn; ++k) var += std::pow(xs[size_t(m * Cn + k)] - mean, 2) / Cn;
      for (int k = 0; k < Cn; ++k) {
        const double e = (xs[size_t(m * Cn + k)] - mean) / std::sqrt(var + 1e-5) * gs[size_t(k)] + bs[size_t(k)];
        ASSERT_NEAR(ln[size_t(m * Cn + k)], e, 1e-5 * (1 + std::fabs(e))) << "C = " << Cn << ", row " << m;
      }
    }
  }
  // GELU on every SIMD target
  std::vector<float> ref;
  for (int i = -4000; i <= 4000; ++i) ref.push_back(float(i) * 0.0025f);              // [-10, 10]
  for (int i = 0; i < 20000; ++i) ref.push_back(float(i - 10000) * 0.0004f + 1e-4f);  // [-4, 4]: the clamp's range
  ref.push_back(-1e30f), ref.push_back(1e30f), ref.push_back(0.f);
  for (const std::string& target : sattn::testing::simd_target_names()) {
    SCOPED_TRACE(target);
    const sattn::testing::ScopedSimdTarget scoped(target);
    auto v = ref;
    sattn::nn::gelu_inplace(v.data(), int64_t(v.size()));
    EXPECT_LE(std::fabs(v[v.size() - 3]), 0.0f) << "gelu(-1e30) must be -0 or 0";
    EXPECT_EQ(v[v.size() - 2], 1e30f);
    for (size_t i = 0; i < v.size(); ++i) {
      const double x = ref[i], e = 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
      // erf within 4.2e-7 (+ float rounding): |error| <= 0.5 |x| 5e-7 + 1 ulp
      ASSERT_NEAR(v[i], e, 0.5 * std::fabs(x) * 5e-7 + 1e-7 + 1.2e-7 * std::fabs(e)) << "x = " << x;
    }
  }
}

TEST(SrOps, GemmSegmentsAwkwardShapesAndRowIndependence) {
  // C += sum_s A_s · W_s over shapes around the register tiles (rows 1..13, columns 1..130), overlapping A rows
  // (lda < K) as the 3x3 convolution uses them, two segments, W row stride N (masked loads) or padded (garbage
  // past N that must not leak into C); then every row recomputed alone must be bitwise equal to the batched
  // result (what makes tiles == untiled and 1 == 2 threads).
  for (auto [M, N, K0, K1, lda] :
       {std::tuple{1, 1, 1, 0, 1}, std::tuple{7, 17, 5, 3, 5}, std::tuple{13, 40, 40, 40, 40},
        std::tuple{6, 130, 9, 9, 3}, std::tuple{11, 64, 12, 20, 4}, std::tuple{8, 120, 40, 0, 40}}) {
    for (const int64_t ldw : {int64_t(N), sattn::nn::padded_cols(N)}) {
      const int64_t K = K0 + K1, rows = (M - 1) * lda + std::max(K0, K1);
      const auto A0 = randv(size_t(rows), 7), A1 = randv(size_t(rows), 8), W = randv(size_t(K * ldw), 9),
                 C0 = randv(size_t(M * (N + 3)), 10);
      const float* a[2] = {A0.data(), A1.data()};
      const int64_t ks[2] = {K0, K1};
      auto C = C0;
      sattn::nn::gemm_acc_segments(K1 > 0 ? 2 : 1, a, ks, lda, M, W.data(), ldw, N, C.data(), N + 3);
      for (int m = 0; m < M; ++m) {
        for (int n = 0; n < N + 3; ++n) {
          const size_t i = size_t(m * (N + 3) + n);
          if (n >= N) {
            ASSERT_EQ(C[i], C0[i]) << "wrote past N";
            continue;
          }
          double s = C0[i];
          for (int k = 0; k < K0; ++k) s += double(A0[size_t(m * lda + k)]) * W[size_t(k * ldw + n)];
          for (int k = 0; k < K1; ++k) s += double(A1[size_t(m * lda + k)]) * W[size_t((K0 + k) * ldw + n)];
          ASSERT_NEAR(C[i], s, 1e-5 * (1 + std::fabs(s))) << M << "x" << N << " m " << m << " n " << n;
        }
        auto row = std::vector<float>(C0.begin() + m * (N + 3), C0.begin() + (m + 1) * (N + 3));
        const float* am[2] = {A0.data() + m * lda, A1.data() + m * lda};
        sattn::nn::gemm_acc_segments(K1 > 0 ? 2 : 1, am, ks, lda, 1, W.data(), ldw, N, row.data(), N + 3);
        ASSERT_EQ(0, std::memcmp(row.data(), &C[size_t(m * (N + 3))], size_t(N) * sizeof(float))) << "row " << m;
      }
    }
  }
}

TEST(SrOps, RouterWindowSumsEqualThePlainLoopsBitwise) {
  // the router's per-channel sums over pixel runs (channels around the vector width and the 4-vector blocks,
  // runs of 1..16 pixels): the same float sums as the plain loops, in pixel order and with the square rounded
  // before it is added
  for (const int64_t C : {1, 3, 16, 32, 40, 41, 48, 64, 100, 130}) {
    for (const int64_t count : {1, 8, 16}) {
      const auto p = randv(size_t(count * C), 21), mean = randv(size_t(C + 2), 22), acc0 = randv(size_t(C + 2), 23);
      auto sum = acc0, sq = acc0, sum_ref = acc0, sq_ref = acc0;
      sattn::nn::add_rows(p.data(), count, C, sum.data());
      sattn::nn::add_squared_deviations(p.data(), count, C, mean.data(), sq.data());
      for (int64_t t = 0; t < count; ++t)
        for (int64_t c = 0; c < C; ++c) {
          const float v = p[size_t(t * C + c)], dv = v - mean[size_t(c)];
          volatile float d2 = dv * dv;  // rounded, as the kernel does (no fused multiply-add)
          sum_ref[size_t(c)] += v;
          sq_ref[size_t(c)] += d2;
        }
      ASSERT_EQ(0, std::memcmp(sum.data(), sum_ref.data(), sum.size() * sizeof(float))) << "C " << C << " n " << count;
      ASSERT_EQ(0, std::memcmp(sq.data(), sq_ref.data(), sq.size() * sizeof(float))) << "C " << C << " n " << count;
    }
  }
}

TEST(SrOps, PlanarToU8RgbRoundsExactlyAsTheScalarFormula) {
  // floor(255 clamp(v, 0, 1) + 0.5) in double for every value (NaN -> 0), interleaved R, G, B; values at and one
  // ulp around every rounding boundary (k + 0.5) / 255, out-of-range and non-finite values, and lengths around
  // the vector width (the scalar tail).
  std::vector<float> v;
  for (int k = 0; k < 256; ++k) {
    const float t = float((k + 0.5) / 255.0);
    v.push_back(t), v.push_back(std::nextafter(t, 0.f)), v.push_back(std::nextafter(t, 2.f)), v.push_back(k / 255.f);
  }
  for (const float x : {-0.f, -1e-30f, -1.f, 1.f, 1.0000001f, 2.f, 1e30f, -INFINITY, INFINITY, NAN}) v.push_back(x);
  const auto rnd = randv(1000, 11);
  for (const float x : rnd) v.push_back(x * 0.8f + 0.5f);
  auto ref = [](float x) {
    const double d = double(std::min(1.0f, std::max(0.0f, x)));
    return uint8_t(std::floor(d * 255.0 + 0.5));
  };
  for (const int64_t n :
       {int64_t(0), int64_t(1), int64_t(7), int64_t(8), int64_t(9), int64_t(17), int64_t(v.size() / 3)}) {
    const float *r = v.data(), *g = v.data() + n, *b = v.data() + 2 * n;
    std::vector<uint8_t> out(size_t(3 * n + 5), 77);
    sattn::nn::planar_to_u8_rgb(r, g, b, n, out.data());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(out[size_t(3 * i)], ref(r[i])) << "r = " << r[i];
      ASSERT_EQ(out[size_t(3 * i + 1)], ref(g[i])) << "g = " << g[i];
      ASSERT_EQ(out[size_t(3 * i + 2)], ref(b[i])) << "b = " << b[i];
    }
    for (size_t i = size_t(3 * n); i < out.size(); ++i) ASSERT_EQ(out[i], 77) << "wrote past 3 n";
  }
}

TEST(SrOps, DepthwiseGeluPointwiseMatchesPlainLoops) {
  // out = res + pw_b + act(dw(in) + dw_b) · PW, in place on `in` (the model's cheap path) and with act = identity
  // rows are split into four bands per thread: heights around the band counts test the band borders
  for (auto [H, W, C, threads] :
       {std::tuple{5, 7, 3, 2}, std::tuple{1, 1, 2, 2}, std::tuple{4, 9, 40, 2}, std::tuple{13, 6, 40, 3},
        std::tuple{2, 5, 7, 3}, std::tuple{9, 4, 16, 1}, std::tuple{7, 3, 5, 7}, std::tuple{6, 5, 48, 2},
        std::tuple{3, 4, 64, 3}, std::tuple{3, 41, 40, 2}}) {
    const auto in = randv(size_t(H * W * C), 11), res = randv(size_t(H * W * C), 12), wd = randv(size_t(9 * C), 13),
               bd = randv(size_t(C), 14), pw = randv(size_t(C * C), 15), bp = randv(size_t(C), 16);
    for (bool gelu : {true, false}) {
      std::vector<float> out = in;                                    // aliasing in and out
      const auto pwt = sattn::nn::transpose_weight(pw.data(), C, C);  // pw as PyTorch's [out, in]
      sattn::nn::dw_act_pw_hwc(out.data(), H, W, C, wd.data(), bd.data(), gelu, pwt.data(), bp.data(), res.data(),
                               out.data(), threads);
      // the same rows from a separate output buffer, and on 1 thread, are bitwise the same
      std::vector<float> sep(in.size()), one = in;
      sattn::nn::dw_act_pw_hwc(in.data(), H, W, C, wd.data(), bd.data(), gelu, pwt.data(), bp.data(), res.data(),
                               sep.data(), threads);
      sattn::nn::dw_act_pw_hwc(one.data(), H, W, C, wd.data(), bd.data(), gelu, pwt.data(), bp.data(), res.data(),
                               one.data(), 1);
      ASSERT_EQ(0, std::memcmp(out.data(), sep.data(), out.size() * sizeof(float))) << H << "x" << W << "x" << C;
      ASSERT_EQ(0, std::memcmp(out.data(), one.data(), out.size() * sizeof(float))) << H << "x" << W << "x" << C;
      for (int y = 0; y < H; ++y)
        for (int x = 0; x < W; ++x) {
          const std::vector<double> t = depthwise_act_ref(in, wd, bd, H, W, C, y, x, gelu);
          for (int o = 0; o < C; ++o) {
            double s = double(res[size_t((y * W + x) * C + o)]) + bp[size_t(o)];
            for (int c = 0; c < C; ++c) s += t[size_t(c)] * pw[size_t(o * C + c)];
            ASSERT_NEAR(out[size_t((y * W + x) * C + o)], s, 1e-4 * (1 + std::fabs(s)));
          }
        }
    }
  }
}

// ---- bf16 products of the GEMMs (weight_pairs / W2) ---------------------------------------------------------
namespace {
std::vector<std::string> bf16_product_targets() {
  std::vector<std::string> r;
  for (const std::string& t : sattn::testing::simd_target_names())
    if (t == "amx" || t == "avx512bf16") r.push_back(t);
  return r;
}
}  // namespace

TEST(SrOps, Bf16GemmsMatchTheRoundedOperandsInFp64) {
  const auto targets = bf16_product_targets();
  if (targets.empty()) GTEST_SKIP() << "this CPU has no bf16 products (AVX512-BF16 or AMX-BF16): not checked";
  for (const std::string& target : targets) {
    sattn::testing::ScopedSimdTarget scoped(target);
    ASSERT_TRUE(sattn::nn::has_bf16_products()) << target;
    {  // the rounding: nearest even as float_to_bf16 for normal numbers, infinities and NaN; denormals to zero
      std::vector<float> x = randv(999, 20);
      for (int i = 0; i < 64; ++i) x.push_back(1.0f + float(i) * 0x1p-7f + 0x1p-8f);  // ties between bf16 values
      const float specials[] = {0.f, -0.f, 1e38f, -3e38f, INFINITY, -INFINITY, NAN, 1e-40f, -1e-40f};
      x.insert(x.end(), std::begin(specials), std::end(specials));
      std::vector<uint16_t> r(x.size());
      sattn::nn::round_to_bf16(x.data(), int64_t(x.size()), r.data());
      for (size_t i = 0; i < x.size(); ++i) {
        uint32_t u;
        std::memcpy(&u, &x[i], 4);
        const bool denormal = (u & 0x7f800000u) == 0 && (u & 0x7fffffu) != 0;
        const uint16_t e = denormal ? uint16_t((u >> 16) & 0x8000u) : sattn::float_to_bf16(x[i]);
        ASSERT_EQ(r[i], e) << target << ": " << x[i];
      }
    }
    {  // GELU and LayerNorm straight into bf16, and linear on bf16 rows: bitwise round_to_bf16 of the float32
       // values, and linear's results from the float32 rows
      std::vector<float> x = randv(1001, 31);
      for (auto& v : x) v *= 4.f;
      x.push_back(1e30f), x.push_back(-1e30f);  // 1003 values
      auto g = x;
      sattn::nn::gelu_inplace(g.data(), int64_t(g.size()));
      std::vector<uint16_t> want(g.size() + 1, 0xFFFFu), got(g.size() + 1, 0xFFFFu);
      sattn::nn::round_to_bf16(g.data(), int64_t(g.size()), want.data());
      sattn::nn::gelu_to_bf16(x.data(), int64_t(x.size()), got.data());
      ASSERT_EQ(got, want) << target << ": gelu_to_bf16";  // odd count: the pad half 0 in both
      for (const int C : {40, 48, 50}) {
        const int M = 13;
        const auto xs = randv(size_t(M * C), 32), gs = randv(size_t(C), 33), bs = randv(size_t(C), 34);
        std::vector<float> ln(size_t(M * C));
        sattn::nn::layer_norm(xs.data(), M, C, gs.data(), bs.data(), 1e-5f, ln.data());
        std::vector<uint16_t> lw(ln.size()), lg(ln.size());
        sattn::nn::round_to_bf16(ln.data(), int64_t(ln.size()), lw.data());
        sattn::nn::layer_norm_to_bf16(xs.data(), M, C, gs.data(), bs.data(), 1e-5f, lg.data());
        ASSERT_EQ(lg, lw) << target << ": layer_norm_to_bf16, C " << C;
        const int N = 56;
        const auto w = randv(size_t(C * sattn::nn::padded_cols(N)), 35), b = randv(size_t(N), 36);
        const auto w2 = sattn::nn::weight_pairs(w, N);
        std::vector<float> y(size_t(M * N)), y2(y.size());
        sattn::nn::linear(ln.data(), M, C, w.data(), b.data(), N, y.data(), 2, w2.data());
        sattn::nn::linear(lg.data(), M, C, b.data(), N, y2.data(), 2, w2.data());
        ASSERT_EQ(y2, y) << target << ": linear on bf16 rows, C " << C;
        // the two fused steps: LayerNorm into linear, GELU into a GEMM, with and without the pairs
        for (const bool with_pairs : {true, false}) {
          const uint32_t* pw = with_pairs ? w2.data() : nullptr;
          std::vector<float> want(y.size()), got(y.size());
          sattn::nn::linear(ln.data(), M, C, w.data(), b.data(), N, want.data(), 1, pw);
          sattn::nn::layer_norm_linear(xs.data(), M, C, gs.data(), bs.data(), 1e-5f, w.data(), b.data(), N, got.data(),
                                       pw);
          ASSERT_EQ(got, want) << target << ": layer_norm_linear, C " << C << (with_pairs ? " pairs" : "");
          const auto wg = randv(size_t(N * sattn::nn::padded_cols(C)), 37);
          const auto wg2 = sattn::nn::weight_pairs(wg, C);
          std::vector<float> h = y, hg = h, cw = randv(size_t(M * C), 38), cg = cw;
          sattn::nn::gelu_inplace(h.data(), int64_t(h.size()));
          sattn::nn::gemm_acc(h.data(), N, M, N, wg.data(), sattn::nn::padded_cols(C), C, cw.data(), C,
                              with_pairs ? wg2.data() : nullptr);
          sattn::nn::gelu_gemm_acc(hg.data(), M, N, wg.data(), C, cg.data(), C, with_pairs ? wg2.data() : nullptr);
          ASSERT_EQ(cg, cw) << target << ": gelu_gemm_acc, C " << C << (with_pairs ? " pairs" : "");
        }
      }
    }
    // C += sum_s A_s · W_s on rounded operands, shapes around the tiles (rows 1..13, columns 1..130 with whole,
    // masked and half last vectors), overlapping A rows (lda < K) as the 3x3 convolution uses them
    for (auto [M, N, K0, K1, lda] :
         {std::tuple{1, 1, 2, 0, 2}, std::tuple{7, 17, 6, 4, 6}, std::tuple{13, 40, 40, 40, 40},
          std::tuple{6, 130, 12, 12, 4}, std::tuple{11, 56, 12, 20, 4}, std::tuple{8, 120, 40, 0, 40},
          std::tuple{5, 12, 120, 120, 40}, std::tuple{9, 48, 80, 0, 80}, std::tuple{3, 8, 2, 2, 2}}) {
      const int64_t K = K0 + K1, ldw = sattn::nn::padded_cols(N), rows = (M - 1) * lda + std::max(K0, K1);
      const auto A0 = randv(size_t(rows), 21), A1 = randv(size_t(rows), 22), W = randv(size_t(K * ldw), 23),
                 C0 = randv(size_t(M * (N + 3)), 24);
      const auto W2 = sattn::nn::weight_pairs(W, N);
      ASSERT_EQ(W2.size(), size_t(K / 2 * ldw));
      std::vector<uint16_t> a0(A0.size()), a1(A1.size());
      sattn::nn::round_to_bf16(A0.data(), int64_t(A0.size()), a0.data());
      sattn::nn::round_to_bf16(A1.data(), int64_t(A1.size()), a1.data());
      const uint16_t* a[2] = {a0.data(), a1.data()};
      const int64_t ks[2] = {K0, K1};
      const int nseg = K1 > 0 ? 2 : 1;
      auto C = C0;
      sattn::nn::gemm_acc_segments_pairs(nseg, a, ks, lda, M, W2.data(), ldw, N, C.data(), N + 3);
      for (int m = 0; m < M; ++m) {
        for (int n = 0; n < N + 3; ++n) {
          const size_t i = size_t(m * (N + 3) + n);
          if (n >= N) {
            ASSERT_EQ(C[i], C0[i]) << target << ": wrote past N";
            continue;
          }
          double s = C0[i], mag = std::fabs(C0[i]);
          for (int k = 0; k < K; ++k) {
            const float av = k < K0 ? A0[size_t(m * lda + k)] : A1[size_t(m * lda + k - K0)];
            const double t = double(bf16_rounded(av)) * bf16_rounded(W[size_t(k * ldw + n)]);
            s += t, mag += std::fabs(t);
          }
          ASSERT_NEAR(C[i], s, 2e-6 * (1 + mag)) << target << " " << M << "x" << N << " m " << m << " n " << n;
        }
        auto row = std::vector<float>(C0.begin() + m * (N + 3), C0.begin() + (m + 1) * (N + 3));
        const uint16_t* am[2] = {a0.data() + m * lda, a1.data() + m * lda};
        sattn::nn::gemm_acc_segments_pairs(nseg, am, ks, lda, 1, W2.data(), ldw, N, row.data(), N + 3);
        ASSERT_EQ(0, std::memcmp(row.data(), &C[size_t(m * (N + 3))], size_t(N) * sizeof(float)))
            << target << ": row " << m << " alone differs";
      }
    }
    // linear, gemm_acc, conv3x3 and dw_act_pw with the pairs: close to fp64 on the rounded operands, apart from
    // float32 (the pairs did run), the same for 1 and 2 threads; an odd K takes the float32 weight (bitwise)
    {
      const int M = 37, K = 40, N = 120;
      const auto x = randv(size_t(M * K), 25), w = randv(size_t(N * K), 26), b = randv(size_t(N), 27);
      const auto wt = sattn::nn::transpose_weight(w.data(), N, K);
      const auto w2 = sattn::nn::weight_pairs(wt, N);
      std::vector<float> y(size_t(M * N)), y1(y.size()), y32(y.size());
      sattn::nn::linear(x.data(), M, K, wt.data(), b.data(), N, y.data(), 2, w2.data());
      sattn::nn::linear(x.data(), M, K, wt.data(), b.data(), N, y1.data(), 1, w2.data());
      sattn::nn::linear(x.data(), M, K, wt.data(), b.data(), N, y32.data(), 2);
      ASSERT_EQ(y, y1) << target << ": thread count changed the bf16 linear";
      double moved = 0;
      for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n) {
          double s = b[size_t(n)], mag = std::fabs(b[size_t(n)]);
          for (int k = 0; k < K; ++k) {
            const double t = double(bf16_rounded(x[size_t(m * K + k)])) * bf16_rounded(w[size_t(n * K + k)]);
            s += t, mag += std::fabs(t);
          }
          ASSERT_NEAR(y[size_t(m * N + n)], s, 2e-6 * (1 + mag)) << target << " linear " << m << "," << n;
          moved = std::max(moved, double(std::fabs(y[size_t(m * N + n)] - y32[size_t(m * N + n)])));
        }
      EXPECT_GT(moved, 1e-3) << target << ": the bf16 linear equals the float32 one";
      // odd K: no pairs, the float32 weight
      const auto wo = sattn::nn::transpose_weight(w.data(), N, K - 1);
      EXPECT_TRUE(sattn::nn::weight_pairs(wo, N).empty());
      // every pair row starts a cache line (the rows are padded_cols(N) words: whole lines)
      EXPECT_EQ(reinterpret_cast<uintptr_t>(w2.data()) % 64, 0u) << target;
    }
    for (auto [H, W, Ci, Co] :
         {std::tuple{5, 7, 40, 40}, std::tuple{6, 9, 40, 12}, std::tuple{4, 3, 8, 48}, std::tuple{7, 5, 3, 40}}) {
      const auto in = randv(size_t(H * W * Ci), 28), w = randv(size_t(Co * Ci * 9), 29), b = randv(size_t(Co), 30);
      const auto w9 = sattn::nn::conv3x3_weight_hwc(w.data(), Co, Ci);
      const auto w2 = sattn::nn::weight_pairs(w9, Co);
      ASSERT_EQ(w2.empty(), Ci % 2 != 0);
      std::vector<float> out(size_t(H * W * Co)), one(out.size()), f32(out.size());
      sattn::nn::conv3x3_hwc(in.data(), H, W, Ci, w9.data(), b.data(), Co, out.data(), 2, nullptr, w2.data());
      sattn::nn::conv3x3_hwc(in.data(), H, W, Ci, w9.data(), b.data(), Co, one.data(), 1, nullptr, w2.data());
      sattn::nn::conv3x3_hwc(in.data(), H, W, Ci, w9.data(), b.data(), Co, f32.data(), 2);
      ASSERT_EQ(0, std::memcmp(out.data(), one.data(), out.size() * sizeof(float))) << target << ": threads";
      if (Ci % 2 != 0) {
        ASSERT_EQ(0, std::memcmp(out.data(), f32.data(), out.size() * sizeof(float))) << target << ": odd Cin";
        continue;
      }
      for (int y = 0; y < H; ++y)
        for (int x = 0; x < W; ++x)
          for (int o = 0; o < Co; ++o) {
            double mag = 0;
            const double s = conv3x3_ref(in, w, b, H, W, Ci, y, x, o, true, &mag);
            ASSERT_NEAR(out[size_t((y * W + x) * Co + o)], s, 2e-6 * (1 + mag)) << target << " conv " << Ci;
          }
    }
    {  // dw_act_pw: the pointwise product on the rounded activations, within bf16's rounding of the float32 result
      const int H = 6, W = 11, C = 40;
      const auto in = randv(size_t(H * W * C), 31), res = randv(size_t(H * W * C), 32), wd = randv(size_t(9 * C), 33),
                 bd = randv(size_t(C), 34), pw = randv(size_t(C * C), 35), bp = randv(size_t(C), 36);
      const auto pwt = sattn::nn::transpose_weight(pw.data(), C, C);
      const auto pw2 = sattn::nn::weight_pairs(pwt, C);
      std::vector<float> o16(in.size()), one(in.size()), o32(in.size());
      sattn::nn::dw_act_pw_hwc(in.data(), H, W, C, wd.data(), bd.data(), true, pwt.data(), bp.data(), res.data(),
                               o16.data(), 2, pw2.data());
      sattn::nn::dw_act_pw_hwc(in.data(), H, W, C, wd.data(), bd.data(), true, pwt.data(), bp.data(), res.data(),
                               one.data(), 1, pw2.data());
      sattn::nn::dw_act_pw_hwc(in.data(), H, W, C, wd.data(), bd.data(), true, pwt.data(), bp.data(), res.data(),
                               o32.data(), 2);
      ASSERT_EQ(0, std::memcmp(o16.data(), one.data(), o16.size() * sizeof(float))) << target << ": threads";
      // |bf16(t) bf16(p) - t p| <= (2^-8 + 2^-16) |t p|; the row's magnitude sum bounds the whole change
      double moved = 0;
      for (int y = 0; y < H; ++y)
        for (int x = 0; x < W; ++x) {
          const std::vector<double> t = depthwise_act_ref(in, wd, bd, H, W, C, y, x, true);
          for (int o = 0; o < C; ++o) {
            double mag = 0;
            for (int c = 0; c < C; ++c) mag += std::fabs(t[size_t(c)] * pw[size_t(o * C + c)]);
            const size_t i = size_t((y * W + x) * C + o);
            ASSERT_NEAR(o16[i], o32[i], 0x1p-7 * mag + 1e-5) << target << " dw_act_pw " << y << "," << x << "," << o;
            moved = std::max(moved, double(std::fabs(o16[i] - o32[i])));
          }
        }
      EXPECT_GT(moved, 0.0) << target << ": the bf16 pointwise product equals the float32 one";
    }
  }
  // without bf16 products, the pairs are ignored: bitwise the float32 results
  for (const std::string& target : sattn::testing::simd_target_names()) {
    if (target == "amx" || target == "avx512bf16") continue;
    sattn::testing::ScopedSimdTarget scoped(target);
    ASSERT_FALSE(sattn::nn::has_bf16_products()) << target;
    const int M = 9, K = 40, N = 40;
    const auto x = randv(size_t(M * K), 37), w = randv(size_t(N * K), 38);
    const auto wt = sattn::nn::transpose_weight(w.data(), N, K);
    const auto w2 = sattn::nn::weight_pairs(wt, N);
    std::vector<float> a(size_t(M * N)), c(a.size());
    sattn::nn::linear(x.data(), M, K, wt.data(), nullptr, N, a.data(), 1, w2.data());
    sattn::nn::linear(x.data(), M, K, wt.data(), nullptr, N, c.data(), 1);
    ASSERT_EQ(a, c) << target;
  }
}

// ---- tiny model ------------------------------------------------------------------------------------------
std::string tiny_model(const std::string& name, bool drop_tensor = false, bool bad_shape = false) {
  const int C = 4, hid = 8, s = 2;
  std::map<std::string, sattn::Tensor> t;
  unsigned seed = 10;
  auto add = [&](const std::string& n, sattn::Shape shape, float scale) {
    sattn::Tensor x(sattn::DType::kF32, shape);
    const auto v = randv(size_t(x.numel()), seed++);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = scale * v[size_t(i)];
    t[n] = x;
  };
  add("head.weight", {C, 3, 3, 3}, 0.3f), add("head.bias", {C}, 0.1f);
  add("body_tail.weight", {C, C, 3, 3}, 0.2f), add("body_tail.bias", {C}, 0.1f);
  add("up.weight", {3 * s * s, C, 3, 3}, 0.1f), add("up.bias", {3 * s * s}, 0.05f);
  for (int g = 0; g < 2; ++g) {
    const std::string gp = "groups." + std::to_string(g) + ".";
    add(gp + "dw.weight", {C, 1, 3, 3}, 0.3f), add(gp + "dw.bias", {C}, 0.1f);
    add(gp + "pw.weight", {C, C, 1, 1}, 0.3f), add(gp + "pw.bias", {C}, 0.1f);
    for (int b = 0; b < 2; ++b) {
      const std::string p = gp + "blocks." + std::to_string(b) + ".";
      add(p + "dw.weight", {C, 1, 3, 3}, 0.3f), add(p + "dw.bias", {C}, 0.1f);
      add(p + "pw.weight", {C, C, 1, 1}, 0.3f), add(p + "pw.bias", {C}, 0.1f);
      add(p + "router.weight", {1, 2 * C}, 1.0f), add(p + "router.bias", {1}, 0.3f);
      add(p + "norm1.weight", {C}, 0.2f), add(p + "norm1.bias", {C}, 0.1f);
      add(p + "qkv.weight", {3 * C, C}, 0.5f), add(p + "qkv.bias", {3 * C}, 0.1f);
      add(p + "proj.weight", {C, C}, 0.3f), add(p + "proj.bias", {C}, 0.1f);
      add(p + "norm2.weight", {C}, 0.2f), add(p + "norm2.bias", {C}, 0.1f);
      add(p + "fc1.weight", {hid, C}, 0.3f), add(p + "fc1.bias", {hid}, 0.1f);
      add(p + "fc2.weight", {C, hid}, 0.3f), add(p + "fc2.bias", {C}, 0.1f);
    }
  }
  if (drop_tensor) t.erase("groups.1.blocks.1.fc2.bias");
  if (bad_shape) add("up.bias", {5}, 0.1f);
  std::map<std::string, sattn::TensorView> views;
  for (auto& [k, v] : t) views[k] = v.view();
  const std::string cfg =
      R"({"format": "sattn-sr-v1", "scale": 2, "dim": 4, "heads": 2, "head_dim": 2, "mlp_hidden": 8,)"
      R"( "groups": [[4, 4], [8, 8]], "pad_multiple": 8, "layer_norm_eps": 1e-5, "router_std_eps": 1e-6,)"
      R"( "route_threshold": 0.5, "training_step": 3})";
  const std::string p = temp_path(name);
  sattn::write_safetensors(p, views, {{"sattn_sr_config", cfg}});
  return p;
}

TEST(SrModel, LoadErrorsNameTheProblem) {
  auto expect = [](const std::string& p, const std::string& needle) {
    try {
      sattn::sr::SrModel::load(p);
      ADD_FAILURE() << "no error, expected " << needle;
    } catch (const sattn::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect(tiny_model("m1.safetensors", true), "groups.1.blocks.1.fc2.bias");
  expect(tiny_model("m2.safetensors", false, true), "up.bias");
  std::map<std::string, sattn::TensorView> none;
  const std::string p = temp_path("nocfg.safetensors");
  sattn::write_safetensors(p, none, {});
  expect(p, "sattn_sr_config");
  const auto m = sattn::sr::SrModel::load(tiny_model("ok.safetensors"));
  EXPECT_EQ(m.scale(), 2);
  EXPECT_EQ(m.config().training_step, 3);
  EXPECT_EQ(m.receptive_radius(), 3 + 2 + (4 + 4 + 8 + 8));
}

TEST(SrModel, SparseAllRoutedEqualsDenseThreadsBitwiseAndRouting) {
  const auto m = sattn::sr::SrModel::load(tiny_model("ok2.safetensors"));
  const Image lr = random_image(13, 21, 3, 20);  // padded to 16 x 24
  const sattn::Tensor x = sattn::sr::image_to_tensor(lr);
  sattn::sr::UpscaleOptions dense;
  dense.mode = sattn::sr::AttentionMode::kDense;
  dense.num_threads = 1;
  const sattn::Tensor yd = m.forward(x, dense);
  ASSERT_EQ(yd.shape(), (sattn::Shape{3, 26, 42}));
  dense.num_threads = 2;
  const sattn::Tensor yd2 = m.forward(x, dense);
  EXPECT_EQ(0, std::memcmp(yd.data(), yd2.data(), yd.nbytes())) << "thread count changed the result";

  sattn::sr::UpscaleOptions sp;
  sp.mode = sattn::sr::AttentionMode::kSparse;
  std::vector<uint8_t> routing;
  std::vector<float> gates;
  sp.routing_out = &routing;
  sp.gates_out = &gates;
  sattn::sr::UpscaleStats st;
  const sattn::Tensor ys = m.forward(x, sp, &st);
  const int64_t windows = 2 * (4 * 6) + 2 * (2 * 3);
  ASSERT_EQ(int64_t(routing.size()), windows);
  EXPECT_EQ(st.windows_total, windows);
  int64_t routed = 0;
  for (size_t i = 0; i < routing.size(); ++i) {
    EXPECT_EQ(routing[i], gates[i] > 0.5f);
    routed += routing[i];
  }
  EXPECT_EQ(routed, st.windows_routed);
  EXPECT_GT(routed, 0);
  EXPECT_LT(routed, windows) << "pick weights that route some windows only";
  // feeding "route everything" to sparse mode is dense mode
  std::vector<uint8_t> all(size_t(windows), 1);
  sp.routing_in = &all;
  sp.routing_out = nullptr;
  sp.gates_out = nullptr;
  const sattn::Tensor ya = m.forward(x, sp);
  EXPECT_EQ(0, std::memcmp(yd.data(), ya.data(), yd.nbytes()));
  // feeding its own decisions reproduces the sparse output
  sp.routing_in = &routing;
  const sattn::Tensor yr = m.forward(x, sp);
  EXPECT_EQ(0, std::memcmp(ys.data(), yr.data(), ys.nbytes()));
  std::vector<uint8_t> wrong(3, 1);
  sp.routing_in = &wrong;
  EXPECT_THROW(m.forward(x, sp), sattn::Error);
  // too small for the reflect padding
  EXPECT_THROW(m.forward(sattn::sr::image_to_tensor(random_image(3, 21, 3, 1)), dense), sattn::Error);
}

TEST(SrModel, TilesMatchUntiledAwayFromTheWrapBands) {
  const auto m = sattn::sr::SrModel::load(tiny_model("ok3.safetensors"));
  const int64_t h = 120, w = 9;
  const Image lr = random_image(h, w, 3, 30);
  sattn::sr::UpscaleOptions o;
  sattn::sr::UpscaleStats s1, s2;
  const Image full = m.upscale(lr, o, &s1);
  o.tile = 40;
  const Image tiled = m.upscale(lr, o, &s2);
  EXPECT_EQ(s1.tiles, 1);
  EXPECT_EQ(s2.tiles, 3);
  const int64_t r = m.receptive_radius() + 4, hp = h;  // 120 is a multiple of 8
  for (int64_t y = 2 * r; y < 2 * (hp - 4 - r); ++y)
    for (int64_t x = 0; x < 2 * w; ++x)
      for (int c = 0; c < 3; ++c) ASSERT_EQ(full.at(y, x, c), tiled.at(y, x, c)) << y << "," << x;
}

// The x8 self-ensemble is the mean of the model's outputs on the 8 flips/transposes of the input, each mapped back
// (the transforms written out here independently: forward maps instead of the library's inverse maps).
TEST(SrModel, SelfEnsembleIsTheMeanOfTheEightTransformedOutputs) {
  const auto m = sattn::sr::SrModel::load(tiny_model("ok4.safetensors"));
  const int64_t h = 13, w = 21, s = 2;
  const Image lr = random_image(h, w, 3, 40);
  // Where pixel (y, x) of an H x W grid goes under transform t: transpose (t & 4), then flip rows (t & 2), then
  // flip columns (t & 1).
  auto dest = [](int t, int64_t y, int64_t x, int64_t H, int64_t W, int64_t* dy, int64_t* dx) {
    if (t & 4) std::swap(y, x), std::swap(H, W);
    if (t & 2) y = H - 1 - y;
    if (t & 1) x = W - 1 - x;
    *dy = y, *dx = x;
  };
  for (auto mode : {sattn::sr::AttentionMode::kDense, sattn::sr::AttentionMode::kSparse}) {
    sattn::sr::UpscaleOptions o;
    o.mode = mode;
    o.num_threads = 2;
    std::vector<float> sum(size_t(h * s * w * s * 3), 0.0f);
    for (int t = 0; t < 8; ++t) {
      Image in(t & 4 ? w : h, t & 4 ? h : w, 3);
      for (int64_t y = 0; y < h; ++y)
        for (int64_t x = 0; x < w; ++x) {
          int64_t dy = 0, dx = 0;
          dest(t, y, x, h, w, &dy, &dx);
          for (int c = 0; c < 3; ++c) in.at(dy, dx, c) = lr.at(y, x, c);
        }
      const sattn::Tensor out = m.forward(sattn::sr::image_to_tensor(in), o);
      const int64_t oh = out.size(1), ow = out.size(2);
      for (int64_t y = 0; y < h * s; ++y)
        for (int64_t x = 0; x < w * s; ++x) {
          int64_t dy = 0, dx = 0;
          dest(t, y, x, h * s, w * s, &dy, &dx);
          for (int c = 0; c < 3; ++c)
            sum[size_t((y * w * s + x) * 3 + c)] += out.data<float>()[(c * oh + dy) * ow + dx];
        }
    }
    o.self_ensemble = true;
    sattn::sr::UpscaleStats st;
    const Image got = m.upscale(lr, o, &st);
    ASSERT_EQ(got.height, h * s);
    ASSERT_EQ(got.width, w * s);
    EXPECT_EQ(st.tiles, 8);
    for (size_t i = 0; i < sum.size(); ++i) {
      const double v = std::min(1.0, std::max(0.0, double(sum[i] * 0.125f)));
      ASSERT_EQ(int(got.data[i]), int(std::floor(v * 255.0 + 0.5))) << i;
    }
  }
  sattn::sr::UpscaleOptions bad;
  bad.self_ensemble = true;
  std::vector<uint8_t> routing;
  bad.routing_out = &routing;
  EXPECT_THROW(m.upscale(lr, bad), sattn::Error);
}

}  // namespace

// UpscaleOptions::max_output_pixels: an output of more pixels is refused before anything is allocated, in upscale()
// (tiled or not, self-ensemble too) and forward(); the limit itself is allowed.
TEST(SrModel, MaxOutputPixelsRefusesLargerOutputs) {
  const auto m = sattn::sr::SrModel::load(tiny_model("ok6.safetensors"));
  const Image lr = random_image(20, 30, 3, 60);  // x2: 40 x 60 = 2400 output pixels
  sattn::sr::UpscaleOptions o;
  o.num_threads = 1;
  o.max_output_pixels = 2400;
  EXPECT_EQ(m.upscale(lr, o).data.size(), size_t(2400 * 3));
  o.max_output_pixels = 2399;
  for (const int64_t tile : {0, 16})
    for (const bool ensemble : {false, true}) {
      o.tile = tile;
      o.self_ensemble = ensemble;
      try {
        m.upscale(lr, o);
        ADD_FAILURE() << "no error";
      } catch (const sattn::Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
        const std::string want = "30x20 input at x2 makes 2400 output pixels, over max_output_pixels = 2399";
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
  o.tile = 0;
  o.self_ensemble = false;
  EXPECT_THROW(m.forward(sattn::sr::image_to_tensor(lr), o), sattn::Error);
  o.max_output_pixels = 0;
  EXPECT_THROW(m.upscale(lr, o), sattn::Error);
}

// UpscaleOptions::profile: every stage is timed, in order, the block stages count their windows as the routing
// does, calls with the same stats accumulate, and profiling changes no output bit.
TEST(SrModel, ProfileTimesEveryStageInOrderAndChangesNothing) {
  const auto m = sattn::sr::SrModel::load(tiny_model("ok5.safetensors"));
  const sattn::Tensor x = sattn::sr::image_to_tensor(random_image(13, 21, 3, 50));  // padded to 16 x 24
  sattn::sr::UpscaleOptions o;
  o.num_threads = 2;
  sattn::sr::UpscaleStats plain_stats;
  const sattn::Tensor plain = m.forward(x, o, &plain_stats);
  EXPECT_TRUE(plain_stats.stages.empty());
  o.profile = true;
  sattn::sr::UpscaleStats st;
  const auto t0 = std::chrono::steady_clock::now();
  const sattn::Tensor y = m.forward(x, o, &st);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(0, std::memcmp(plain.data(), y.data(), y.nbytes()));
  std::vector<std::string> want{"head conv"};
  const int ws[4] = {4, 4, 8, 8};
  for (int b = 0; b < 4; ++b) {
    const std::string p =
        "block " + std::to_string(b) + " (" + std::to_string(ws[b]) + "x" + std::to_string(ws[b]) + "): ";
    for (const char* k : {"conv path", "router", "attention windows"}) want.push_back(p + k);
    if (b % 2 == 1) want.push_back("group " + std::to_string(b / 2) + " tail");
  }
  for (const char* k : {"body tail conv + skip", "upsample conv + shuffle", "other"}) want.push_back(k);
  ASSERT_EQ(st.stages.size(), want.size());
  double sum = 0;
  int64_t total = 0, routed = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const auto& s = st.stages[i];
    EXPECT_EQ(s.name, want[i]);
    EXPECT_GE(s.seconds, 0.0) << s.name;
    sum += s.seconds;
    const bool attn = s.name.find("attention windows") != std::string::npos;
    EXPECT_EQ(s.windows_total > 0, attn) << s.name;
    if (attn) {
      const int w = s.name.find("(4x4)") != std::string::npos ? 4 : 8;
      EXPECT_EQ(s.windows_total, (16 / w) * (24 / w)) << s.name;
      EXPECT_LE(s.windows_routed, s.windows_total);
    }
    total += s.windows_total;
    routed += s.windows_routed;
  }
  EXPECT_EQ(total, st.windows_total);
  EXPECT_EQ(routed, st.windows_routed);
  EXPECT_GT(sum, 0.0);
  EXPECT_LE(sum, wall * 1.001 + 1e-6);
  // a second call with the same stats adds to the same stages
  const std::vector<sattn::sr::SrStageTime> first = st.stages;
  m.forward(x, o, &st);
  ASSERT_EQ(st.stages.size(), first.size());
  for (size_t i = 0; i < first.size(); ++i) {
    EXPECT_GE(st.stages[i].seconds, first[i].seconds);
    EXPECT_EQ(st.stages[i].windows_total, 2 * first[i].windows_total);
  }
  // tiled: the stages sum over the tiles, as the window counts do
  sattn::sr::UpscaleStats tiled;
  o.tile = 40;
  const Image lr = random_image(120, 9, 3, 51);
  m.upscale(lr, o, &tiled);
  EXPECT_EQ(tiled.tiles, 3);
  int64_t tt = 0;
  for (const auto& s : tiled.stages) tt += s.windows_total;
  EXPECT_EQ(tt, tiled.windows_total);
}

// ---- --precision bf16: the model's matrix products on bf16 operands ------------------------------------------
namespace {
std::string shipped_x2_weights() { return std::string(SATTN_TEST_SOURCE_DIR) + "/sr/weights/sattn_sr_x2.safetensors"; }

float max_abs_diff(const sattn::Tensor& a, const sattn::Tensor& b) {
  float m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.data<float>()[i] - b.data<float>()[i]));
  return m;
}
}  // namespace

TEST(SrModel, Bf16PrecisionIsFloat32WhereTheTargetHasNoBf16Products) {
  const auto m = sattn::sr::SrModel::load(shipped_x2_weights());
  const sattn::Tensor x = sattn::sr::image_to_tensor(random_image(40, 36, 3, 31));
  for (const std::string& target : sattn::testing::simd_target_names()) {
    if (target == "amx" || target == "avx512bf16") continue;
    sattn::testing::ScopedSimdTarget scoped(target);
    sattn::sr::UpscaleOptions fp32, bf16;
    fp32.mode = bf16.mode = sattn::sr::AttentionMode::kDense;
    bf16.float32_precision = sattn::Float32Precision::kBF16;
    const sattn::Tensor a = m.forward(x, fp32), b = m.forward(x, bf16);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes())) << target;
  }
}

// Shipped x2 weights (head dim 20: ten bf16 pairs; C = 40), dense and sparse (the float32 run's routing fed in, so
// that both run the same windows): with the attention, convolution, projection and MLP products on bf16 operands the
// output moves by under one 8-bit gray level (1/255) and does move (bf16 products ran).
TEST(SrModel, Bf16ProductsMoveTheOutputByUnderOneGrayLevel) {
  std::vector<std::string> bf16_targets;
  for (const std::string& t : sattn::testing::simd_target_names())
    if (t == "amx" || t == "avx512bf16") bf16_targets.push_back(t);
  if (bf16_targets.empty()) GTEST_SKIP() << "this CPU has no bf16 products (AVX512-BF16 or AMX-BF16): not checked";
  const auto m = sattn::sr::SrModel::load(shipped_x2_weights());
  const sattn::Tensor x = sattn::sr::image_to_tensor(random_image(40, 36, 3, 32));
  for (const std::string& target : bf16_targets) {
    sattn::testing::ScopedSimdTarget scoped(target);
    for (const auto mode : {sattn::sr::AttentionMode::kDense, sattn::sr::AttentionMode::kSparse}) {
      std::vector<uint8_t> routing;
      sattn::sr::UpscaleOptions fp32, bf16;
      fp32.mode = bf16.mode = mode;
      if (mode == sattn::sr::AttentionMode::kSparse) fp32.routing_out = &routing, bf16.routing_in = &routing;
      bf16.float32_precision = sattn::Float32Precision::kBF16;
      const sattn::Tensor a = m.forward(x, fp32), b = m.forward(x, bf16);
      const float d = max_abs_diff(a, b);
      EXPECT_GT(d, 0.0f) << target << ": no change, so the bf16 products did not run";
      EXPECT_LT(d, 1.0f / 255) << target;
      std::printf("%s %s: max |bf16 - fp32| = %.3g\n", target.c_str(),
                  mode == sattn::sr::AttentionMode::kDense ? "dense" : "sparse", double(d));
    }
  }
}
