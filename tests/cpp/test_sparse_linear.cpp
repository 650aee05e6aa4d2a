// Linear attention against its fp64 formula (forward) and central differences of it (backward).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <cstring>

#include "sattn/error.hpp"
#include "sattn/linear.hpp"

using namespace sattn;
using namespace sattn::sparse;

namespace {

Tensor randn(Shape shape, uint64_t seed, double sd) {
  Tensor t(DType::kF32, std::move(shape));
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, float(sd));
  for (int64_t x = 0; x < t.numel(); ++x) t.data<float>()[x] = n(g);
  return t;
}

std::vector<double> to64(const Tensor& t) {
  std::vector<double> x(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = t.data<float>()[i];
  return x;
}

// φ of one row, written from the definition (no stabiliser).
std::vector<double> phi(const double* x, int64_t D, bool favor, const Tensor& omega) {
  if (!favor) {
    std::vector<double> f(D);
    for (int64_t d = 0; d < D; ++d) f[d] = x[d] > 0 ? x[d] + 1 : std::exp(x[d]);
    return f;
  }
  const int64_t m = omega.size(0);
  const double s = std::pow(double(D), -0.25);
  double sq = 0;
  for (int64_t d = 0; d < D; ++d) sq += x[d] * s * x[d] * s;
  std::vector<double> f(m);
  for (int64_t r = 0; r < m; ++r) {
    double pr = 0;
    for (int64_t d = 0; d < D; ++d) pr += omega.data<double>()[r * D + d] * x[d] * s;
    f[r] = std::exp(pr - sq / 2) / std::sqrt(double(m));
  }
  return f;
}

std::vector<double> formula(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                            int64_t B, int64_t H, int64_t Hk, int64_t Lq, int64_t Lk, int64_t D, int64_t Dv, bool favor,
                            bool causal, const Tensor& omega) {
  std::vector<double> out(size_t(B * H * Lq * Dv), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t hk = h / (H / Hk);
      for (int64_t i = 0; i < Lq; ++i) {
        const auto fq = phi(&q[((b * H + h) * Lq + i) * D], D, favor, omega);
        double n = 0;
        std::vector<double> a(Dv, 0.0);
        for (int64_t j = 0; j < Lk; ++j) {
          if (causal && j > i) continue;
          const auto fk = phi(&k[((b * Hk + hk) * Lk + j) * D], D, favor, omega);
          double w = 0;
          for (size_t r = 0; r < fq.size(); ++r) w += fq[r] * fk[r];
          n += w;
          for (int64_t c = 0; c < Dv; ++c) a[c] += w * v[((b * Hk + hk) * Lk + j) * Dv + c];
        }
        for (int64_t c = 0; c < Dv; ++c) out[((b * H + h) * Lq + i) * Dv + c] = a[c] / n;
      }
    }
  return out;
}

}  // namespace

TEST(SparseLinear, MatchesFormulaForwardAndBackward) {
  struct C {
    const char* map;
    bool causal;
    int64_t B, H, Hk, Lq, Lk, D, Dv, m;
  };
  for (const C& c : std::vector<C>{{"elu", false, 2, 4, 2, 37, 70, 8, 6, 0},
                                   {"elu", true, 1, 2, 1, 150, 150, 8, 6, 0},
                                   {"favor+", false, 1, 2, 2, 40, 33, 8, 8, 0},
                                   {"favor+", true, 2, 2, 1, 130, 130, 8, 5, 20}}) {
    SCOPED_TRACE(std::string(c.map) + (c.causal ? " causal" : "") + " Lq=" + std::to_string(c.Lq));
    LinearOptions o;
    o.feature_map = c.map;
    o.causal = c.causal;
    o.num_features = c.m;
    o.seed = 7;
    const bool favor = std::string(c.map) == "favor+";
    const int64_t m = c.m > 0 ? c.m : int64_t(std::floor(c.D * std::log(double(c.D))));
    const Tensor omega = favor_projection(c.D, m, 7);
    const double sd = favor ? 0.5 : 1.0;
    const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 1, sd), k = randn({c.B, c.Hk, c.Lk, c.D}, 2, sd),
                 v = randn({c.B, c.Hk, c.Lk, c.Dv}, 3, 1.0), dout = randn({c.B, c.H, c.Lq, c.Dv}, 4, 1.0);
    Tensor out(DType::kF32, {c.B, c.H, c.Lq, c.Dv});
    linear_attention(q, k, v, o, out);
    auto Q = to64(q), K = to64(k), V = to64(v), G = to64(dout);
    const auto ref = formula(Q, K, V, c.B, c.H, c.Hk, c.Lq, c.Lk, c.D, c.Dv, favor, c.causal, omega);
    double err = 0, mx = 1;
    for (size_t x = 0; x < ref.size(); ++x) {
      err = std::max(err, std::abs(ref[x] - out.data<float>()[x]));
      mx = std::max(mx, std::abs(ref[x]));
    }
    EXPECT_LE(err / mx, 2e-5);
    Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
    linear_attention_backward(dout, q, k, v, o, dq, dk, dv);
    auto loss = [&](const std::vector<double>& a, const std::vector<double>& b_, const std::vector<double>& c_) {
      const auto o_ = formula(a, b_, c_, c.B, c.H, c.Hk, c.Lq, c.Lk, c.D, c.Dv, favor, c.causal, omega);
      double s = 0;
      for (size_t x = 0; x < o_.size(); ++x) s += o_[x] * G[x];
      return s;
    };
    std::mt19937_64 rng(9);
    std::normal_distribution<double> nd;
    const double eps = 1e-5;
    for (int which = 0; which < 3; ++which) {
      std::vector<double> P[3] = {Q, K, V}, M[3] = {Q, K, V};
      std::vector<double> dir(P[which].size());
      for (auto& x : dir) x = nd(rng);
      for (size_t x = 0; x < dir.size(); ++x) {
        P[which][x] += eps * dir[x];
        M[which][x] -= eps * dir[x];
      }
      const double fd = (loss(P[0], P[1], P[2]) - loss(M[0], M[1], M[2])) / (2 * eps);
      const Tensor& gr = which == 0 ? dq : which == 1 ? dk : dv;
      double an = 0, scale = 0;
      for (size_t x = 0; x < dir.size(); ++x) {
        an += gr.data<float>()[x] * dir[x];
        scale += std::abs(gr.data<float>()[x] * dir[x]);
      }
      EXPECT_LE(std::abs(an - fd), 1e-4 * std::max(1.0, scale)) << "gradient " << which << ": " << an << " vs " << fd;
    }
  }
}

TEST(SparseLinear, FavorProjectionIsBlockOrthogonalAndSeeded) {
  const int64_t D = 8, m = 20;
  const Tensor w = favor_projection(D, m, 3), w2 = favor_projection(D, m, 3), w3 = favor_projection(D, m, 4);
  EXPECT_EQ(std::memcmp(w.data(), w2.data(), w.nbytes()), 0);
  EXPECT_NE(std::memcmp(w.data(), w3.data(), w.nbytes()), 0);
  for (int64_t b0 = 0; b0 < m; b0 += D)
    for (int64_t r = b0; r < std::min(m, b0 + D); ++r)
      for (int64_t s = b0; s < r; ++s) {
        double dot = 0, nr = 0, ns = 0;
        for (int64_t d = 0; d < D; ++d) {
          dot += w.data<double>()[r * D + d] * w.data<double>()[s * D + d];
          nr += std::pow(w.data<double>()[r * D + d], 2);
          ns += std::pow(w.data<double>()[s * D + d], 2);
        }
        EXPECT_NEAR(dot / std::sqrt(nr * ns), 0.0, 1e-12);
      }
  Tensor out(DType::kF32, {1, 1, 4, 8});
  const Tensor q = randn({1, 1, 4, 8}, 1, 1.0), k5 = randn({1, 1, 5, 8}, 1, 1.0);
  LinearOptions o;
  o.causal = true;
  EXPECT_THROW(linear_attention(q, k5, k5, o, out), Error);
  o.causal = false;
  o.feature_map = "relu";
  EXPECT_THROW(linear_attention(q, q, q, o, out), Error);
}
