// The AMX tile products (simd/amx_tiles.hpp) against a float64 product of the same bf16 pairs, over awkward
// shapes: on a software model of the tiles everywhere, and on the CPU's tiles where it has AMX-BF16.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "simd/amx_tiles.hpp"
#include "simd/target.hpp"

namespace {

using sattn::simd::amx::TileConfig;

float bf16_value(uint32_t bits16) {
  uint32_t b = bits16 << 16;
  if ((b & 0x7F800000u) == 0) b &= 0x80000000u;  // denormals are zero
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// The tiles as the architecture describes them: 8 tiles of up to 16 rows x 64 bytes, each of the rows and bytes per
// row its configuration gives (palette 1); a load fills the configured part and zeroes the rest. tdpbf16ps adds, per
// element and per pair k, the low then the high product, each addition rounded to float32, over the pairs of the
// left operand's configured row width, which must equal the right operand's configured rows. It refuses work
// before a configuration is loaded, and tile numbers outside the product's roles.
struct EmulatedTiles {
  struct State {
    bool configured = false;
    int rows[8] = {}, colsb[8] = {};
    uint32_t tile[8][16][16] = {};
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void require_configured() {
    if (!state().configured) throw std::logic_error("tile instruction without a loaded configuration");
  }
  static void configure(const TileConfig& c) {
    if (c.palette_id != 1 || c.start_row != 0) throw std::logic_error("palette 1 from row 0 expected");
    for (int t = 0; t < 8; ++t) {
      if (c.rows[t] < 1 || c.rows[t] > 16 || c.colsb[t] < 4 || c.colsb[t] > 64 || c.colsb[t] % 4 != 0)
        throw std::logic_error("tiles of 1..16 rows of 4..64 bytes (whole words) expected");
      state().rows[t] = c.rows[t], state().colsb[t] = c.colsb[t];
    }
    state().configured = true;
  }
  static void release() { state().configured = false; }
  template <int t>
  static void zero() {
    require_configured();
    std::memset(state().tile[t], 0, sizeof state().tile[t]);
  }
  template <int t>
  static void load(const void* base, int64_t stride) {
    require_configured();
    auto& s = state();
    std::memset(s.tile[t], 0, sizeof s.tile[t]);
    for (int r = 0; r < s.rows[t]; ++r)
      std::memcpy(s.tile[t][r], static_cast<const char*>(base) + r * stride, size_t(s.colsb[t]));
  }
  template <int t>
  static void store(void* base, int64_t stride) {
    require_configured();
    auto& s = state();
    for (int r = 0; r < s.rows[t]; ++r)
      std::memcpy(static_cast<char*>(base) + r * stride, s.tile[t][r], size_t(s.colsb[t]));
  }
  template <int c, int a, int b>
  static void dot() {
    static_assert(c >= 0 && c < 4 && a >= 4 && a < 6 && b >= 6 && b < 8, "accumulator, left, right tiles");
    require_configured();
    auto& s = state();
    const int K = s.colsb[a] / 4;
    if (s.rows[b] != K || s.rows[a] != s.rows[c] || s.colsb[b] != s.colsb[c])
      throw std::logic_error("tdpbf16ps: tile shapes do not match");
    for (int m = 0; m < s.rows[c]; ++m)
      for (int n = 0; n < s.colsb[c] / 4; ++n) {
        float acc;
        std::memcpy(&acc, &s.tile[c][m][n], sizeof acc);
        for (int k = 0; k < K; ++k) {
          const uint32_t x = s.tile[a][m][k], y = s.tile[b][k][n];
          acc += bf16_value(x & 0xFFFFu) * bf16_value(y & 0xFFFFu);
          acc += bf16_value(x >> 16) * bf16_value(y >> 16);
        }
        std::memcpy(&s.tile[c][m][n], &acc, sizeof acc);
      }
  }
};

uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return uint16_t((b + 0x7FFFu + (b >> 16 & 1u)) >> 16);
}

constexpr uint32_t kNaNPair = 0x7FC07FC0u;

struct Case {
  int64_t M, N, K;
  bool acc, split;
  float mul;
  bool split_a = false;
  bool lo_lo = true;  // with split and split_a: false drops the product of the two second parts (kLoLo)
};

// Runs gemm_pairs on Tiles for one case and checks every element of C against float64, and that nothing outside
// C [M x N] changed. Memory past the operands (the rest of A's rows, pairs past K, the high half of an odd K's
// last pair) holds NaN: none of it may reach C.
template <class Tiles>
void check_case(const Case& c, std::mt19937& rng) {
  using sattn::simd::amx::gemm_pairs;
  const int64_t K2 = (c.K + 1) / 2, lda = K2 + 3, ldb = c.N + 16, ldc = c.N + 5;
  std::normal_distribution<float> normal(0.f, 1.f);
  const int64_t alo = (c.M + 1) * lda;  // the second left-hand matrix (split_a)
  std::vector<uint32_t> A(size_t(alo * 2), kNaNPair), B(size_t((K2 + 2) * ldb * 2), kNaNPair);
  auto elem = [](uint32_t w, int half) { return double(bf16_value(half ? w >> 16 : w & 0xFFFFu)); };
  for (int part = 0; part < 2; ++part)
    for (int64_t m = 0; m < c.M; ++m)
      for (int64_t k = 0; k < K2; ++k) {
        const float scale = part && c.lo_lo ? 1.f / 512 : 1.f;  // (without lo·lo: parts alike, so it would show)
        const uint32_t hi = 2 * k + 1 < c.K ? to_bf16(scale * normal(rng)) : 0x7FC0u;
        A[size_t(part * alo + m * lda + k)] = to_bf16(scale * normal(rng)) | hi << 16;
      }
  const int64_t lo = (K2 + 2) * ldb;  // the second right-hand matrix (kSplit)
  for (int part = 0; part < 2; ++part)
    for (int64_t k = 0; k < K2; ++k)
      for (int64_t n = 0; n < c.N; ++n) {
        const float scale = part && c.lo_lo ? 1.f / 256 : 1.f;
        const uint32_t hi = 2 * k + 1 < c.K ? to_bf16(scale * normal(rng)) : 0x7FC0u;
        B[size_t(part * lo + k * ldb + n)] = to_bf16(scale * normal(rng)) | hi << 16;
      }
  const int64_t rows_c = c.M + 2;
  std::vector<float> C(size_t(rows_c * ldc));
  for (auto& x : C) x = normal(rng);
  const std::vector<float> C0 = C;

  const sattn::simd::amx::TileConfigScope<Tiles> scope(true);
  auto run = [&](auto f) { f(A.data(), lda, B.data(), ldb, lo, C.data(), ldc, c.M, c.N, c.K, c.mul, alo); };
  if (c.split_a && !c.lo_lo) {
    if (c.acc) run(gemm_pairs<Tiles, true, true, true, false>);
    else run(gemm_pairs<Tiles, false, true, true, false>);
  } else if (c.split_a) {
    if (c.acc && c.split) run(gemm_pairs<Tiles, true, true, true>);
    if (c.acc && !c.split) run(gemm_pairs<Tiles, true, false, true>);
    if (!c.acc && c.split) run(gemm_pairs<Tiles, false, true, true>);
    if (!c.acc && !c.split) run(gemm_pairs<Tiles, false, false, true>);
  } else {
    if (c.acc && c.split) run(gemm_pairs<Tiles, true, true>);
    if (c.acc && !c.split) run(gemm_pairs<Tiles, true, false>);
    if (!c.acc && c.split) run(gemm_pairs<Tiles, false, true>);
    if (!c.acc && !c.split) run(gemm_pairs<Tiles, false, false>);
  }

  const std::string where = "M " + std::to_string(c.M) + " N " + std::to_string(c.N) + " K " + std::to_string(c.K) +
                            (c.acc ? " acc" : "") + (c.split ? " split" : "") + (c.split_a ? " split_a" : "") +
                            (c.lo_lo ? "" : " no lo·lo") + " mul " + std::to_string(c.mul);
  for (int64_t m = 0; m < rows_c; ++m)
    for (int64_t n = 0; n < ldc; ++n) {
      const float got = C[size_t(m * ldc + n)];
      if (m >= c.M || n >= c.N) {
        ASSERT_EQ(got, C0[size_t(m * ldc + n)]) << where << ": element (" << m << ", " << n << ") outside C changed";
        continue;
      }
      double sum = 0, magnitude = 0;
      for (int apart = 0; apart < (c.split_a ? 2 : 1); ++apart)
        for (int part = 0; part < (c.split ? 2 : 1); ++part)
          for (int64_t k = 0; k < c.K && (c.lo_lo || apart == 0 || part == 0); ++k) {
            const double t = elem(A[size_t(apart * alo + m * lda + k / 2)], int(k % 2)) *
                             elem(B[size_t(part * lo + k / 2 * ldb + n)], int(k % 2));
            sum += t, magnitude += std::fabs(t);
          }
      const double want = c.mul * sum + (c.acc ? double(C0[size_t(m * ldc + n)]) : 0.0);
      const double terms = double(c.K * (c.split_a ? 2 : 1) + 2);  // additions into one element, about
      const double tol = 4e-7 * (std::fabs(c.mul) * magnitude * terms + std::fabs(want)) + 1e-30;
      ASSERT_NEAR(got, want, tol) << where << ": element (" << m << ", " << n << ")";
    }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int64_t M : {1, 15, 16, 17, 31, 32, 33, 64, 70})
    for (int64_t N : {16, 32, 48, 64})
      for (int64_t K : {1, 2, 3, 31, 32, 33, 64, 65, 128})
        out.push_back({M, N, K, (M + N + K) % 2 == 0, (M + K) % 3 == 0, (N / 16 + K) % 2 ? 0.125f : 1.f});
  for (bool acc : {false, true})
    for (bool split : {false, true})
      for (float mul : {1.f, 0.125f}) out.push_back({33, 48, 63, acc, split, mul});
  // a second left-hand matrix (float16 operands as two bf16 parts)
  for (int64_t M : {16, 17, 33, 64})
    for (int64_t K : {31, 64, 65})
      for (bool acc : {false, true})
        for (bool split : {false, true}) out.push_back({M, 48, K, acc, split, M % 2 ? 0.125f : 1.f, true});
  // both split, without the product of the two second parts (float32 operands as two bf16: three products)
  for (int64_t M : {16, 17, 33, 64})
    for (int64_t K : {31, 64, 65})
      for (bool acc : {false, true}) out.push_back({M, 48, K, acc, true, M % 2 ? 0.125f : 1.f, true, false});
  return out;
}

TEST(AmxTiles, ProductsOnTheTileModelMatchFloat64OverAwkwardShapes) {
  std::mt19937 rng(7);
  for (const Case& c : cases()) check_case<EmulatedTiles>(c, rng);
}

TEST(AmxTiles, TheModelRefusesWorkWithoutAConfiguration) {
  std::vector<uint32_t> A(16 * 16, 0), B(16 * 16, 0);
  std::vector<float> C(16 * 16, 0.f);
  EXPECT_THROW((sattn::simd::amx::gemm_pairs<EmulatedTiles, false, false>(A.data(), 16, B.data(), 16, 0, C.data(), 16,
                                                                          16, 16, 32, 1.f)),
               std::logic_error);
}

// gemm_segments_pairs (the amx builds of the nn GEMMs and the sparse tiles) on Tiles: C (+)= alpha Σ_s A_s · W_s
// over segments whose pair counts share a divisor of 8 to 16 (the configured chunk) or not (chunks of 16, the last
// ones staged), rows that overlap (the 3x3 convolution's), partial row and column tiles; every element of C against
// float64, nothing past M x N touched (C's padding columns and the row below hold sentinels, W's columns past N NaN),
// and every row alone bitwise equal to the same row inside the batch.
template <class Tiles>
void check_segments(std::mt19937& rng) {
  using sattn::simd::amx::gemm_segments_pairs;
  std::normal_distribution<float> normal(0.f, 1.f);
  struct Seg {
    int64_t M, N, lda;
    std::vector<int64_t> K2;
  };
  const Seg shapes[] = {{256, 40, 20, {60, 60, 60}},  // a 3x3 convolution's output row, C = 40
                        {37, 40, 20, {20}},           // a linear layer
                        {50, 120, 20, {20}},          // qkv
                        {33, 40, 40, {40}},           // fc2
                        {17, 12, 20, {60, 60, 60}},   // the upsampling convolution (N = 12)
                        {16, 16, 16, {16}},           // whole tiles
                        {1, 1, 1, {1}},               // one element
                        {21, 70, 7, {6, 10}},         // chunks of 16, each segment's one staged
                        {19, 33, 13, {13, 26, 13}},   // chunks of 13
                        {40, 64, 9, {9}},             // chunks of 9
                        {5, 17, 3, {7, 14}},          // chunks of 16, the last ones staged, rows overlapping
                        {33, 20, 37, {37}},           // 16, 16 and 5 staged
                        {64, 64, 32, {32}},           // whole tiles
                        {48, 48, 24, {24}}};          // chunks of 12
  for (const Seg& sh : shapes) {
    const int nseg = int(sh.K2.size());
    int64_t sumk = 0, maxk = 0;
    for (int64_t k : sh.K2) sumk += k, maxk = std::max(maxk, k);
    const int64_t ldw = (sh.N + 15) / 16 * 16, ldc = sh.N + 3;
    auto A = std::vector<std::vector<uint32_t>>(size_t(nseg));
    for (auto& a : A) {
      a.resize(size_t((sh.M - 1) * sh.lda + maxk));
      for (auto& w : a) w = to_bf16(normal(rng)) | uint32_t(to_bf16(normal(rng))) << 16;
    }
    std::vector<uint32_t> W(size_t(sumk * ldw), kNaNPair);  // NaN in the columns past N: none may reach C
    for (int64_t k = 0; k < sumk; ++k)
      for (int64_t n = 0; n < sh.N; ++n)
        W[size_t(k * ldw + n)] = to_bf16(normal(rng)) | uint32_t(to_bf16(normal(rng))) << 16;
    std::vector<float> C(size_t((sh.M + 1) * ldc));
    for (auto& x : C) x = normal(rng);
    const auto C0 = C;
    std::vector<const uint32_t*> a(size_t(nseg), nullptr);
    for (int s = 0; s < nseg; ++s) a[size_t(s)] = A[size_t(s)].data();
    // C += Σ, C = alpha Σ, C += alpha Σ, C = Σ in turn over the shapes
    const int variant = int(&sh - shapes) % 4;
    const bool accumulate = variant % 2 == 0;
    const float alpha = variant == 0 || variant == 3 ? 1.f : variant == 1 ? 0.125f : -0.5f;
    gemm_segments_pairs<Tiles>(nseg, a.data(), sh.K2.data(), sh.lda, sh.M, W.data(), ldw, sh.N, C.data(), ldc,
                               accumulate, alpha);
    const std::string where = "M " + std::to_string(sh.M) + " N " + std::to_string(sh.N) + " K2[0] " +
                              std::to_string(sh.K2[0]) + (accumulate ? " acc" : "") + " alpha " + std::to_string(alpha);
    auto elem = [](uint32_t w, int half) { return double(bf16_value(half ? w >> 16 : w & 0xFFFFu)); };
    for (int64_t m = 0; m <= sh.M; ++m) {
      for (int64_t n = 0; n < ldc; ++n) {
        const size_t i = size_t(m * ldc + n);
        if (m == sh.M || n >= sh.N) {
          ASSERT_EQ(C[i], C0[i]) << where << ": element (" << m << ", " << n << ") outside C changed";
          continue;
        }
        double sum = 0, magnitude = 0;
        int64_t w0 = 0;
        for (int s = 0; s < nseg; ++s) {
          for (int64_t k = 0; k < sh.K2[size_t(s)]; ++k)
            for (int half = 0; half < 2; ++half) {
              const double t =
                  elem(A[size_t(s)][size_t(m * sh.lda + k)], half) * elem(W[size_t((w0 + k) * ldw + n)], half);
              sum += t, magnitude += std::fabs(t);
            }
          w0 += sh.K2[size_t(s)];
        }
        const double c0 = accumulate ? double(C0[i]) : 0.0, want = c0 + alpha * sum;
        const double tol = 4e-7 * (std::fabs(alpha) * magnitude + std::fabs(c0)) * double(2 * sumk + 2);
        ASSERT_NEAR(C[i], want, tol) << where << ": element (" << m << ", " << n << ")";
      }
      if (m == sh.M) break;
      std::vector<float> row(C0.begin() + m * ldc, C0.begin() + (m + 1) * ldc);
      std::vector<const uint32_t*> am(size_t(nseg), nullptr);
      for (int s = 0; s < nseg; ++s) am[size_t(s)] = a[size_t(s)] + m * sh.lda;
      gemm_segments_pairs<Tiles>(nseg, am.data(), sh.K2.data(), sh.lda, 1, W.data(), ldw, sh.N, row.data(), ldc,
                                 accumulate, alpha);
      ASSERT_EQ(0, std::memcmp(row.data(), &C[size_t(m * ldc)], size_t(sh.N) * sizeof(float)))
          << where << ": row " << m << " alone differs";
    }
    // From an init row (exactly N floats): C = init + Σ without reading C (NaN inside M x N), bitwise C set to the
    // init rows and then accumulated; nothing outside M x N touched.
    std::vector<float> init(size_t(sh.N));
    for (auto& x : init) x = normal(rng);
    std::vector<float> from_init = C0, from_rows = C0;
    for (int64_t m = 0; m < sh.M; ++m)
      for (int64_t n = 0; n < sh.N; ++n)
        from_init[size_t(m * ldc + n)] = std::numeric_limits<float>::quiet_NaN(),
                                   from_rows[size_t(m * ldc + n)] = init[size_t(n)];
    gemm_segments_pairs<Tiles>(nseg, a.data(), sh.K2.data(), sh.lda, sh.M, W.data(), ldw, sh.N, from_init.data(), ldc,
                               true, 1.f, init.data());
    gemm_segments_pairs<Tiles>(nseg, a.data(), sh.K2.data(), sh.lda, sh.M, W.data(), ldw, sh.N, from_rows.data(), ldc);
    ASSERT_EQ(0, std::memcmp(from_init.data(), from_rows.data(), from_rows.size() * sizeof(float)))
        << where << ": from the init row";
  }
}

TEST(AmxTiles, SegmentProductsOnTheTileModelMatchFloat64) {
  std::mt19937 rng(11);
  check_segments<EmulatedTiles>(rng);
}

#if defined(__x86_64__) && defined(__GNUC__)
TEST(AmxTiles, SegmentProductsOnTheCpuTilesMatchFloat64) {
  const std::string why = sattn::simd::amx_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << "no AMX tiles here: " << why;
  std::mt19937 rng(11);
  check_segments<sattn::simd::amx::HardwareTiles>(rng);
}

TEST(AmxTiles, ProductsOnTheCpuTilesMatchFloat64OverAwkwardShapes) {
  const std::string why = sattn::simd::amx_unavailable_reason();
  if (!why.empty()) GTEST_SKIP() << "no AMX tiles here: " << why;
  std::mt19937 rng(7);
  for (const Case& c : cases()) check_case<sattn::simd::amx::HardwareTiles>(c, rng);
}
#endif

}  // namespace
