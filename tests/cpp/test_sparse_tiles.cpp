// The sparse engine's tile operations (sparse/tiles.hpp) against fp64 loops, in every build this CPU runs
// (AVX-512, AVX2, portable), on sizes that are not multiples of the vector width and with row strides wider than
// the rows: results within fp32 rounding, and nothing written outside the tile.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "sparse/tiles.hpp"
#include "scoped.hpp"

namespace tiles = sattn::sparse::tiles;

namespace {

constexpr float kGuard = 12345.0f;  // fills every slot outside the tile: must survive each call

std::vector<float> randv(size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = d(g);
  return x;
}

const int64_t kSizes[][3] = {{1, 1, 1},    {5, 7, 3},    {6, 16, 16}, {13, 17, 19}, {7, 33, 64},
                             {64, 64, 64}, {64, 49, 32}, {12, 65, 8}, {3, 100, 5}};

TEST(SparseTiles, ProductsMatchFp64InEveryBuild) {
  const auto isas = sattn::testing::simd_target_names();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.back(), "portable");
  for (const std::string& isa : isas) {
    const sattn::testing::ScopedSimdTarget target(isa);
    ASSERT_EQ(isa, tiles::simd_build());
    uint64_t seed = 1;
    for (const auto& sz : kSizes) {
      const int64_t m = sz[0], n = sz[1], d = sz[2], pad = 3;
      SCOPED_TRACE(isa + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " d=" + std::to_string(d));
      // qk: S[m x n] = scale · Q[m x d] · Kt[d x n] (Kt row stride n + pad).
      {
        const auto q = randv(size_t(m * d), seed++), kt = randv(size_t(d * (n + pad)), seed++);
        std::vector<float> s(size_t(m * n) + 8, kGuard);
        tiles::qk(q.data(), m, d, kt.data(), n + pad, n, 0.5f, s.data());
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double want = 0;
            for (int64_t c = 0; c < d; ++c) want += double(q[size_t(i * d + c)]) * kt[size_t(c * (n + pad) + j)];
            EXPECT_NEAR(s[size_t(i * n + j)], 0.5 * want, 1e-5 * (1 + std::abs(want)));
          }
        for (size_t x = size_t(m * n); x < s.size(); ++x) EXPECT_EQ(s[x], kGuard);
      }
      // pv: acc[m x dv] (+)= alpha · P[m x n] · V[n x dv] (V row stride dv + pad); acc starts non-zero.
      {
        const int64_t dv = d;
        const auto p = randv(size_t(m * n), seed++), v = randv(size_t(n * (dv + pad)), seed++);
        auto acc = randv(size_t(m * dv), seed++);
        const auto acc0 = acc;
        acc.resize(acc.size() + 8, kGuard);
        tiles::pv(p.data(), m, n, v.data(), dv + pad, dv, 0.25f, acc.data());
        for (int64_t i = 0; i < m; ++i)
          for (int64_t c = 0; c < dv; ++c) {
            double want = 0;
            for (int64_t j = 0; j < n; ++j) want += double(p[size_t(i * n + j)]) * v[size_t(j * (dv + pad) + c)];
            want = acc0[size_t(i * dv + c)] + 0.25 * want;
            EXPECT_NEAR(acc[size_t(i * dv + c)], want, 1e-5 * (1 + std::abs(want)));
          }
        for (size_t x = size_t(m * dv); x < acc.size(); ++x) EXPECT_EQ(acc[x], kGuard);
      }
      // atx: out[n x d] += alpha · Aᵀ · X, A [m x n], X [m x d] (row stride d + pad).
      {
        const auto a = randv(size_t(m * n), seed++), x = randv(size_t(m * (d + pad)), seed++);
        auto out = randv(size_t(n * d), seed++);
        const auto out0 = out;
        out.resize(out.size() + 8, kGuard);
        tiles::atx(a.data(), m, n, x.data(), d + pad, d, 2.0f, out.data());
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < d; ++c) {
            double want = 0;
            for (int64_t i = 0; i < m; ++i) want += double(a[size_t(i * n + j)]) * x[size_t(i * (d + pad) + c)];
            want = out0[size_t(j * d + c)] + 2.0 * want;
            EXPECT_NEAR(out[size_t(j * d + c)], want, 1e-5 * (1 + std::abs(want)));
          }
        for (size_t e = size_t(n * d); e < out.size(); ++e) EXPECT_EQ(out[e], kGuard);
      }
      // transpose_rows: dst[d x n] (row stride n + pad) = src[n x d] (row stride d + pad)ᵀ.
      {
        const auto src = randv(size_t(n * (d + pad)), seed++);
        std::vector<float> dst(size_t(d * (n + pad)), kGuard);
        tiles::transpose_rows(src.data(), d + pad, n, d, dst.data(), n + pad);
        for (int64_t c = 0; c < d; ++c)
          for (int64_t j = 0; j < n + pad; ++j)
            EXPECT_EQ(dst[size_t(c * (n + pad) + j)], j < n ? src[size_t(j * (d + pad) + c)] : kGuard);
      }
    }
  }
}

// float32 values rounded to bf16 (round to nearest even), as the bf16 products' operands hold them.
float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &u, sizeof u);
  return x;
}
std::vector<float> randv_bf16(size_t n, uint64_t seed) {
  std::vector<float> x = randv(n, seed);
  for (float& v : x) v = bf16_round(v);
  return x;
}

// The bf16 products (the avx512bf16 build; the amx one, kq_pairs and pv_pairs on the tiles) against fp64 sums of the
// same bf16 values: kq_pairs
// within float32 rounding, pv_pairs and atx_pairs within float32 rounding of the sums of the rounded operands
// (P or A rounded to bf16 inside), the packings bit for bit
// (floats rounded to nearest even); odd widths and key counts, strides wider than the rows, nothing written outside
// the tile.
TEST(SparseTiles, Bf16ProductsMatchFp64) {
  int ran = 0;
  for (const std::string& isa : sattn::testing::simd_target_names()) {
    const sattn::testing::ScopedSimdTarget target(isa);
    EXPECT_EQ(tiles::has_bf16_products(), isa == "avx512bf16" || isa == "amx") << isa;
    if (!tiles::has_bf16_products()) continue;
    ++ran;
    uint64_t seed = 300;
    for (const auto& sz : kSizes) {
      const int64_t m = sz[0], n = sz[1], d = sz[2], d2 = (d + 1) / 2;
      SCOPED_TRACE(isa + " m=" + std::to_string(m) + " n=" + std::to_string(n) + " d=" + std::to_string(d));
      const auto pairs_of = [](const std::vector<float>& x, int64_t rows, int64_t width) {
        const int64_t w2 = (width + 1) / 2;
        std::vector<uint32_t> out(size_t(rows * w2));
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t y = 0; y < w2; ++y) {
            uint32_t lo, hi = 0;
            std::memcpy(&lo, &x[size_t(r * width + 2 * y)], sizeof lo);
            if (2 * y + 1 < width) std::memcpy(&hi, &x[size_t(r * width + 2 * y + 1)], sizeof hi);
            out[size_t(r * w2 + y)] = lo >> 16 | (hi & 0xFFFF0000u);
          }
        return out;
      };
      // kq_pairs: S^T [n x m] (row stride m + 3) = 0.5 · K [n x d] · Q^T, Q^T in pairs [d2 x ldq].
      const auto q = randv_bf16(size_t(m * d), seed++), k = randv_bf16(size_t(n * d), seed++);
      const int64_t ldq = (m + 15) / 16 * 16 + 16, lds = m + 3;
      std::vector<uint32_t> q2t(size_t(d2 * ldq), 0x7FC07FC0u);  // NaN pairs past m: never reach S^T
      const auto q2 = pairs_of(q, m, d);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t y = 0; y < d2; ++y) q2t[size_t(y * ldq + i)] = q2[size_t(i * d2 + y)];
      std::vector<float> st(size_t(n * lds), kGuard);
      tiles::kq_pairs(pairs_of(k, n, d).data(), n, d2, q2t.data(), ldq, m, 0.5f, st.data(), lds);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < lds; ++i) {
          if (i >= m) {
            EXPECT_EQ(st[size_t(j * lds + i)], kGuard);
            continue;
          }
          double want = 0;
          for (int64_t c = 0; c < d; ++c) want += double(k[size_t(j * d + c)]) * q[size_t(i * d + c)];
          EXPECT_NEAR(st[size_t(j * lds + i)], 0.5 * want, 1e-5 * (1 + std::abs(want)));
        }
      // The bf16 bits of a float rounded to nearest even.
      const auto bits = [](float x) {
        const float r = bf16_round(x);
        uint32_t u;
        std::memcpy(&u, &r, sizeof u);
        return u >> 16;
      };
      // pack_pairs_along_rows: float rows [n x d] (row stride d + 2) rounded into pairs along the row [n x ldw].
      {
        const int64_t ldx = d + 2, ldw = d2 + 1;
        const auto x = randv(size_t(n * ldx), seed++);
        std::vector<uint32_t> w(size_t(n * ldw), 0xDEADBEEFu);
        tiles::pack_pairs_along_rows(x.data(), ldx, n, d, w.data(), ldw);
        for (int64_t r = 0; r < n; ++r)
          for (int64_t y = 0; y < ldw; ++y) {
            const uint32_t want = y == d2 ? 0xDEADBEEFu
                                          : bits(x[size_t(r * ldx + 2 * y)]) |
                                                (2 * y + 1 < d ? bits(x[size_t(r * ldx + 2 * y + 1)]) << 16 : 0u);
            EXPECT_EQ(w[size_t(r * ldw + y)], want) << r << "," << y;
          }
      }
      // pack_pairs_across_rows: V [n x d] (row stride d + 2) rounded into pairs of rows [⌈n/2⌉ x ldo].
      const int64_t ldv = d + 2, ldo = (d + 15) / 16 * 16;
      auto v = randv(size_t(n * ldv), seed++);
      std::vector<uint32_t> v2(size_t((n + 1) / 2 * ldo) + 8, 0xDEADBEEFu);
      tiles::pack_pairs_across_rows(v.data(), ldv, n, d, v2.data(), ldo);
      for (int64_t y = 0; y < (n + 1) / 2; ++y)
        for (int64_t x = 0; x < ldo; ++x) {
          uint32_t want = 0;
          if (x < d) {
            want = bits(v[size_t(2 * y * ldv + x)]);
            if (2 * y + 1 < n) want |= bits(v[size_t((2 * y + 1) * ldv + x)]) << 16;
          }
          EXPECT_EQ(v2[size_t(y * ldo + x)], want) << y << "," << x;
        }
      for (size_t x = size_t((n + 1) / 2 * ldo); x < v2.size(); ++x) EXPECT_EQ(v2[x], 0xDEADBEEFu);
      for (float& x : v) x = bf16_round(x);  // the values the products see
      // pv_pairs: acc [m x d] += P [m x n] · V, P rounded to bf16 inside; acc starts non-zero.
      const auto p = randv(size_t(m * n), seed++);
      auto acc = randv(size_t(m * d), seed++);
      const auto acc0 = acc;
      acc.resize(acc.size() + 8, kGuard);
      std::vector<uint32_t> p2(size_t(m * ((n + 1) / 2)));
      tiles::pv_pairs(p.data(), m, n, v2.data(), ldo, d, p2.data(), acc.data());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < d; ++c) {
          double want = 0, size = 0;
          for (int64_t j = 0; j < n; ++j) {
            want += double(bf16_round(p[size_t(i * n + j)])) * v[size_t(j * ldv + c)];
            size += std::abs(double(p[size_t(i * n + j)]) * v[size_t(j * ldv + c)]);
          }
          want += acc0[size_t(i * d + c)];
          EXPECT_NEAR(acc[size_t(i * d + c)], want, 1e-5 * (1 + std::abs(want) + size));
        }
      for (size_t x = size_t(m * d); x < acc.size(); ++x) EXPECT_EQ(acc[x], kGuard);
      // atx_pairs: out [n x d] (row stride d + 1) += 0.5 · Aᵀ · X, A [m x n] rounded to bf16 inside, X [m x d] in
      // pairs across its rows (pack_pairs_across_rows, checked above); out starts non-zero.
      {
        const int64_t ldx = (d + 15) / 16 * 16, ld = d + 1;
        const auto a = randv(size_t(m * n), seed++);
        auto x = randv(size_t(m * d), seed++);
        std::vector<uint32_t> x2(size_t((m + 1) / 2 * ldx)), a2(size_t((m + 1) / 2 * ((n + 15) / 16 * 16)));
        tiles::pack_pairs_across_rows(x.data(), d, m, d, x2.data(), ldx);
        for (float& e : x) e = bf16_round(e);
        auto out = randv(size_t(n * ld), seed++);
        const auto out0 = out;
        out.resize(out.size() + 8, kGuard);
        tiles::atx_pairs(a.data(), m, n, x2.data(), ldx, d, 0.5f, a2.data(), out.data(), ld);
        for (int64_t j = 0; j < n; ++j)
          for (int64_t c = 0; c < ld; ++c) {
            if (c >= d) {  // the stride's gap is not written
              EXPECT_EQ(out[size_t(j * ld + c)], out0[size_t(j * ld + c)]);
              continue;
            }
            double want = 0, size = 0;
            for (int64_t i = 0; i < m; ++i) {
              want += double(bf16_round(a[size_t(i * n + j)])) * x[size_t(i * d + c)];
              size += std::abs(double(a[size_t(i * n + j)]) * x[size_t(i * d + c)]);
            }
            want = 0.5 * want + out0[size_t(j * ld + c)];
            EXPECT_NEAR(out[size_t(j * ld + c)], want, 1e-5 * (1 + std::abs(want) + size)) << j << "," << c;
          }
        for (size_t e = size_t(n * ld); e < out.size(); ++e) EXPECT_EQ(out[e], kGuard);
      }
    }
  }
  if (ran == 0) GTEST_SKIP() << "this CPU runs no build with bf16 products (no AVX512-BF16): not tested here";
}

TEST(SparseTiles, SoftmaxOperationsMatchFp64InEveryBuild) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (const std::string& isa : sattn::testing::simd_target_names()) {
    const sattn::testing::ScopedSimdTarget target(isa);
    uint64_t seed = 100;
    for (const auto& sz : kSizes) {
      const int64_t m = sz[0], n = sz[1], dv = sz[2];
      SCOPED_TRACE(isa + " m=" + std::to_string(m) + " n=" + std::to_string(n));
      // Scores with masked (-inf) entries, one fully masked row, large values; a running state from earlier tiles
      // (row 0 fresh, row 1 with an old max above this tile's).
      auto s = randv(size_t(m * n), seed++);
      for (size_t x = 0; x < s.size(); ++x) s[x] = x % 5 == 3 ? kNegInf : 8.0f * s[x];
      // Rows 2 and 3 fully masked in this tile, row 3 (like row 0) with no earlier tile.
      for (int64_t i = 2; i < std::min<int64_t>(m, 4); ++i)
        for (int64_t j = 0; j < n; ++j) s[size_t(i * n + j)] = kNegInf;
      std::vector<float> mx(static_cast<size_t>(m)), sum(static_cast<size_t>(m)), acc = randv(size_t(m * dv), seed++);
      for (int64_t i = 0; i < m; ++i) {
        const bool fresh = i == 0 || i == 3;
        mx[size_t(i)] = fresh ? kNegInf : (i == 1 ? 50.0f : 1.0f);
        sum[size_t(i)] = fresh ? 0.0f : 2.0f;
      }
      const auto s0 = s, mx0 = mx, sum0 = sum, acc0 = acc;
      s.resize(s.size() + 8, kGuard);
      tiles::softmax_update(s.data(), m, n, mx.data(), sum.data(), acc.data(), dv);
      for (int64_t i = 0; i < m; ++i) {
        double tmax = -HUGE_VAL;
        for (int64_t j = 0; j < n; ++j) tmax = std::max(tmax, double(s0[size_t(i * n + j)]));
        const double nm = std::max(tmax, double(mx0[size_t(i)]));
        ASSERT_EQ(mx[size_t(i)], float(nm));
        if (nm == -HUGE_VAL) {
          for (int64_t j = 0; j < n; ++j) EXPECT_EQ(s[size_t(i * n + j)], 0.0f);
          continue;
        }
        const double alpha = std::exp(double(mx0[size_t(i)]) - nm);
        double tsum = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double p = std::exp(double(s0[size_t(i * n + j)]) - nm);
          tsum += p;
          EXPECT_NEAR(s[size_t(i * n + j)], p, 1e-6 * (1 + p));
          if (s0[size_t(i * n + j)] == kNegInf) {
            EXPECT_EQ(s[size_t(i * n + j)], 0.0f);
          }
        }
        const double want_sum = sum0[size_t(i)] * alpha + tsum;
        EXPECT_NEAR(sum[size_t(i)], want_sum, 1e-5 * (1 + want_sum));
        for (int64_t c = 0; c < dv; ++c)
          EXPECT_NEAR(acc[size_t(i * dv + c)], acc0[size_t(i * dv + c)] * alpha,
                      1e-6 * (1 + std::abs(acc0[size_t(i * dv + c)])));
      }
      for (size_t x = size_t(m * n); x < s.size(); ++x) EXPECT_EQ(s[x], kGuard);

      // probabilities: P = exp(S - lse) (lse -inf rows: 0); softmax_backward: dS = P (dP - delta).
      auto t = s0;
      std::vector<float> lse(static_cast<size_t>(m));
      for (int64_t i = 0; i < m; ++i) lse[size_t(i)] = i == 1 ? kNegInf : 10.0f + float(i);
      t.resize(t.size() + 8, kGuard);
      tiles::probabilities(t.data(), m, n, lse.data());
      const auto dp0 = randv(size_t(m * n), seed++);
      auto dp = dp0;
      dp.resize(dp.size() + 8, kGuard);
      std::vector<float> delta = randv(size_t(m), seed++);
      tiles::softmax_backward(t.data(), dp.data(), m, n, delta.data());
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const double p = lse[size_t(i)] == kNegInf ? 0.0 : std::exp(double(s0[size_t(i * n + j)]) - lse[size_t(i)]);
          EXPECT_NEAR(t[size_t(i * n + j)], p, 1e-6 * (1 + p));
          const double ds = t[size_t(i * n + j)] * (double(dp0[size_t(i * n + j)]) - delta[size_t(i)]);
          EXPECT_NEAR(dp[size_t(i * n + j)], ds, 1e-6 * (1 + std::abs(ds)));
        }
      for (size_t x = size_t(m * n); x < t.size(); ++x) {
        EXPECT_EQ(t[x], kGuard);
        EXPECT_EQ(dp[x], kGuard);
      }
    }
  }
}

}  // namespace
