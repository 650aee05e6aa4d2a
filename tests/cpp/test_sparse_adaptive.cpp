// Content-adaptive attention: selections are valid top-k of the fp64 scores (within 1e-5), the kernels match the
// reference on the mask of the selection they returned, ReLU / Mixed attention match their fp64 formulas.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/sparse.hpp"
#include "scoped.hpp"
#include "sparse/tiles.hpp"
#include "sparse_test_util.hpp"

using namespace sattn;
using namespace sattn::sparse;
using sattn::sparse_test::randn;
using sattn::sparse_test::rel_err;

namespace {

// fp64 score scale * q_i · k_j for batch b, query head h (kv head h / g).
double score(const Tensor& q, const Tensor& k, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t H = q.size(1), Lq = q.size(2), D = q.size(3), Hk = k.size(1), Lk = k.size(2), hk = h / (H / Hk);
  double s = 0;
  for (int64_t d = 0; d < D; ++d)
    s += double(q.data<float>()[((b * H + h) * Lq + i) * D + d]) * k.data<float>()[((b * Hk + hk) * Lk + j) * D + d];
  return s / std::sqrt(double(D));
}

// Runs the sparse kernel and the reference on the returned selection's mask; compares forward and backward.
void check_against_selection(const Pattern& p, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& sel,
                             const SparseOptions& so, const AttentionOptions& ro_in) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), Dv = v.size(3);
  const Tensor dout = randn({B, H, Lq, Dv}, 99);
  Tensor out(DType::kF32, {B, H, Lq, Dv}), lse(DType::kF32, {B, H, Lq});
  Tensor idx(DType::kI64, sel.shape());
  sparse_attention(q, k, v, p, so, out, lse, idx);
  const Tensor mask = selection_mask(p, idx, Lq, Lk);
  AttentionOptions ro = ro_in;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  ro.attn_mask = mask.view();
  Tensor rout(DType::kF64, out.shape()), rlse(DType::kF64, lse.shape());
  scaled_dot_product_attention(q, k, v, ro, {rout.view(), rlse.view(), {}});
  EXPECT_LE(rel_err(out, rout), 2e-5);
  EXPECT_LE(rel_err(lse, rlse), 2e-5);
  Tensor rdq(DType::kF64, q.shape()), rdk(DType::kF64, k.shape()), rdv(DType::kF64, v.shape());
  scaled_dot_product_attention_backward(dout, q, k, v, rout, rlse, ro, {rdq.view(), rdk.view(), rdv.view(), {}});
  for (int with_indices = 0; with_indices < 2; ++with_indices) {
    Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
    sparse_attention_backward(dout, q, k, v, out, lse, p, so, {dq.view(), dk.view(), dv.view(), {}, {}, {}},
                              with_indices ? idx.view() : TensorView{});
    EXPECT_LE(rel_err(dq, rdq), 1e-4);
    EXPECT_LE(rel_err(dk, rdk), 1e-4);
    EXPECT_LE(rel_err(dv, rdv), 1e-4);
  }
}

}  // namespace

TEST(SparseAdaptive, TopKIsValidTopKAndMatchesReference) {
  struct C {
    std::string spec;
    int64_t B, H, Hk, Lq, Lk, D;
    bool pad;
  };
  for (const C& c : std::vector<C>{{"TopK(7)", 2, 2, 1, 37, 53, 16, false},
                                   {"TopK(5) & SlidingWindow(10, 10)", 1, 2, 2, 70, 70, 8, true},
                                   {"SlidingWindow(-1, 0) & TopK(16)", 1, 3, 3, 65, 65, 16, false},
                                   {"TopK(64)", 1, 1, 1, 20, 30, 8, false}}) {
    SCOPED_TRACE(c.spec);
    const Pattern p = Pattern::parse(c.spec);
    const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 1), k = randn({c.B, c.Hk, c.Lk, c.D}, 2),
                 v = randn({c.B, c.Hk, c.Lk, c.D}, 3);
    SparseOptions so;
    AttentionOptions ro;
    Tensor lengths(DType::kI64, {c.B});
    if (c.pad) {
      for (int64_t b = 0; b < c.B; ++b) lengths.data<int64_t>()[b] = c.Lk - 9;
      so.key_lengths = ro.key_lengths = lengths.view();
    }
    const Shape ishape = selection_shape(p, c.B, c.H, c.Lq, c.Lk);
    Tensor out(DType::kF32, {c.B, c.H, c.Lq, c.D}), idx(DType::kI64, ishape);
    sparse_attention(q, k, v, p, so, out, {}, idx);
    const int64_t K = ishape[3];
    // The fixed part of the pattern (for the allowed set).
    const Pattern fixed = c.spec.find('&') == std::string::npos
                              ? Pattern(Full())
                              : Pattern::parse(c.spec.find("TopK") == 0 ? c.spec.substr(c.spec.find('&') + 2)
                                                                        : c.spec.substr(0, c.spec.find(" &")));
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h)
        for (int64_t i = 0; i < c.Lq; ++i) {
          std::vector<int64_t> chosen;
          for (int64_t x = 0; x < K; ++x)
            if (const int64_t j = idx.data<int64_t>()[((b * c.H + h) * c.Lq + i) * K + x]; j >= 0) chosen.push_back(j);
          ASSERT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
          int64_t n_allowed = 0;
          double min_chosen = INFINITY, max_other = -INFINITY;
          for (int64_t j = 0; j < c.Lk; ++j) {
            const bool ok = fixed.allowed(b, h, i, j, c.Lq, c.Lk) && !(c.pad && j >= c.Lk - 9);
            const bool is_chosen = std::binary_search(chosen.begin(), chosen.end(), j);
            ASSERT_TRUE(ok || !is_chosen) << "selected a key that is not allowed: i=" << i << " j=" << j;
            if (!ok) continue;
            ++n_allowed;
            const double s = score(q, k, b, h, i, j);
            if (is_chosen) min_chosen = std::min(min_chosen, s);
            else max_other = std::max(max_other, s);
          }
          ASSERT_EQ(int64_t(chosen.size()), std::min(K, n_allowed));
          ASSERT_GE(min_chosen, max_other - 1e-5) << "not a top-k: b=" << b << " h=" << h << " i=" << i;
        }
    Tensor sel(DType::kI64, ishape);
    check_against_selection(p, q, k, v, sel, so, ro);
  }
}

TEST(SparseAdaptive, TopKTiesGoToTheLowerIndex) {
  // All keys equal: every score ties, so the k lowest indices must be chosen.
  const Tensor q = randn({1, 1, 5, 4}, 1);
  Tensor k(DType::kF32, {1, 1, 20, 4});
  for (int64_t x = 0; x < k.numel(); ++x) k.data<float>()[x] = 0.25f;
  Tensor out(DType::kF32, {1, 1, 5, 4}), idx(DType::kI64, {1, 1, 5, 3});
  sparse_attention(q, k, k, TopK(3), {}, out, {}, idx);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t x = 0; x < 3; ++x) EXPECT_EQ(idx.data<int64_t>()[i * 3 + x], x);
}

TEST(SparseAdaptive, BlockTopKIsValidAndMatchesReference) {
  struct C {
    std::string spec;
    int64_t B, H, Hk, Lq, Lk, D;
  };
  for (const C& c : std::vector<C>{{"BlockTopK(16, 3)", 2, 2, 1, 100, 100, 16},
                                   {"BlockTopK(8, 2, causal=True)", 1, 2, 2, 61, 77, 8},
                                   {"BlockTopK(16, 2, local=False)", 1, 2, 2, 64, 64, 8},
                                   {"BlockTopK(8, 3) & SlidingWindow(20, 20)", 1, 2, 2, 90, 90, 8},
                                   {"BlockTopK(4, 3)", 1, 2, 1, 300, 300, 8},
                                   {"BlockTopK(4, 5, causal=True)", 1, 2, 2, 250, 280, 8}}) {
    SCOPED_TRACE(c.spec);
    const Pattern p = Pattern::parse(c.spec);
    const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 4), k = randn({c.B, c.Hk, c.Lk, c.D}, 5),
                 v = randn({c.B, c.Hk, c.Lk, c.D}, 6);
    const Shape ishape = selection_shape(p, c.B, c.H, c.Lq, c.Lk);
    Tensor out(DType::kF32, {c.B, c.H, c.Lq, c.D}), idx(DType::kI64, ishape);
    sparse_attention(q, k, v, p, {}, out, {}, idx);
    // Validate against fp64 block scores: mean(q block) · mean(k block).
    int blk = 0, kb_n = 0, local = 1, causal = 0;
    {
      std::string s = c.spec;
      ASSERT_GE(std::sscanf(s.c_str(), "BlockTopK(%d, %d", &blk, &kb_n), 2);
      local = s.find("local=False") == std::string::npos;
      causal = s.find("causal=True") != std::string::npos;
    }
    const int64_t off = c.Lk - c.Lq, nkb = (c.Lk + blk - 1) / blk, D = c.D, nqb = ishape[2];
    const bool has_fixed = c.spec.find('&') != std::string::npos;
    const Pattern fixed = has_fixed ? Pattern::parse(c.spec.substr(c.spec.find('&') + 2)) : Pattern(Full());
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t h = 0; h < c.H; ++h) {
        int64_t qb = -1, q0 = 0;
        for (int64_t i = 0; i <= c.Lq; ++i) {
          if (i < c.Lq && !(i == 0 || ((i + off) % blk + blk) % blk == 0)) continue;
          if (qb >= 0) {  // validate query block [q0, i)
            const int64_t t = (q0 + off) >= 0 ? (q0 + off) / blk : -((-(q0 + off) + blk - 1) / blk);
            std::vector<double> qm(D, 0.0);
            for (int64_t r = q0; r < i; ++r)
              for (int64_t d = 0; d < D; ++d)
                qm[d] += q.data<float>()[((b * c.H + h) * c.Lq + r) * D + d] / double(i - q0);
            std::vector<int64_t> chosen;
            for (int64_t x = 0; x < kb_n; ++x)
              if (int64_t kb = idx.data<int64_t>()[((b * c.H + h) * nqb + qb) * kb_n + x]; kb >= 0)
                chosen.push_back(kb);
            std::vector<std::pair<int64_t, double>> cands;
            for (int64_t kb = 0; kb < nkb; ++kb) {
              if (causal && kb > t) continue;
              bool any = false;
              for (int64_t r = q0; r < i && !any; ++r)
                for (int64_t j = kb * blk; j < std::min<int64_t>(c.Lk, (kb + 1) * blk) && !any; ++j)
                  any = fixed.allowed(b, h, r, j, c.Lq, c.Lk);
              if (!any) continue;
              const int64_t hk = h / (c.H / c.Hk), n = std::min<int64_t>(c.Lk, (kb + 1) * blk) - kb * blk;
              double s = 0;
              for (int64_t d = 0; d < D; ++d) {
                double km = 0;
                for (int64_t j = kb * blk; j < kb * blk + n; ++j)
                  km += k.data<float>()[((b * c.Hk + hk) * c.Lk + j) * D + d];
                s += qm[d] * km / double(n);
              }
              cands.emplace_back(kb, s);
            }
            const bool own = local && t >= 0 && t < nkb &&
                             std::any_of(cands.begin(), cands.end(), [&](auto& x) { return x.first == t; });
            ASSERT_EQ(int64_t(chosen.size()), std::min<int64_t>(kb_n, int64_t(cands.size())));
            if (own) {
              ASSERT_TRUE(std::binary_search(chosen.begin(), chosen.end(), t)) << "local block not chosen";
            }
            double min_chosen = INFINITY, max_other = -INFINITY;
            for (auto& [kb, s] : cands) {
              if (own && kb == t) continue;
              if (std::binary_search(chosen.begin(), chosen.end(), kb)) min_chosen = std::min(min_chosen, s);
              else max_other = std::max(max_other, s);
            }
            ASSERT_GE(min_chosen, max_other - 1e-5) << "not a top-k of the block scores, qb=" << qb;
          }
          ++qb;
          q0 = i;
        }
      }
    check_against_selection(p, q, k, v, Tensor(DType::kI64, ishape), {}, {});
  }
}

// bf16 inputs with a bf16 out (the bf16 products where the build has them, P rounded once): against the reference
// on the selection's mask and the same values, out within 1e-2 (as the fused kernel's bf16 outputs) and lse within
// 2e-5; the same on 1 and 3 threads; every target. Where the bf16 products run, some out differs from the avx512
// build's: they ran. The direct forward (BlockTopK alone) and the engine's (with a fixed pattern); odd D and blocks.
TEST(SparseAdaptive, BlockTopKBf16OutputsMatchReference) {
  struct C {
    std::string spec;
    int64_t B, H, Hk, Lq, Lk, D;
  };
  const std::vector<C> cases = {{"BlockTopK(16, 3)", 2, 2, 1, 100, 100, 16},
                                {"BlockTopK(8, 2, causal=True)", 1, 2, 2, 61, 77, 8},
                                {"BlockTopK(5, 3)", 1, 2, 1, 77, 77, 9},
                                {"BlockTopK(64, 4, causal=True)", 1, 2, 1, 300, 300, 64},
                                {"BlockTopK(8, 3) & SlidingWindow(20, 20)", 1, 2, 2, 90, 90, 17}};
  const auto targets = sattn::testing::simd_target_names();
  std::vector<Tensor> avx512;
  int differ = 0;
  for (const std::string& isa : {std::string("avx512"), std::string("avx512bf16"), std::string("amx"),
                                 std::string("avx2"), std::string("portable")}) {
    if (std::find(targets.begin(), targets.end(), isa) == targets.end()) continue;
    const sattn::testing::ScopedSimdTarget target(isa);
    for (size_t x = 0; x < cases.size(); ++x) {
      const C& c = cases[x];
      SCOPED_TRACE(isa + " " + c.spec);
      const Pattern p = Pattern::parse(c.spec);
      const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 14).to(DType::kBF16),
                   k = randn({c.B, c.Hk, c.Lk, c.D}, 15).to(DType::kBF16),
                   v = randn({c.B, c.Hk, c.Lk, c.D}, 16).to(DType::kBF16);
      const Shape ishape = selection_shape(p, c.B, c.H, c.Lq, c.Lk);
      SparseOptions so;
      so.num_threads = 2;
      Tensor out(DType::kBF16, {c.B, c.H, c.Lq, c.D}), lse(DType::kF32, {c.B, c.H, c.Lq}), idx(DType::kI64, ishape);
      sparse_attention(q, k, v, p, so, out, lse, idx);
      AttentionOptions ro;
      ro.kernel = "reference";
      ro.accumulate_fp64 = true;
      const Tensor mask = selection_mask(p, idx, c.Lq, c.Lk);
      ro.attn_mask = mask.view();
      Tensor rout(DType::kF64, out.shape()), rlse(DType::kF64, lse.shape());
      scaled_dot_product_attention(q.to(DType::kF32), k.to(DType::kF32), v.to(DType::kF32), ro,
                                   {rout.view(), rlse.view(), {}});
      EXPECT_LE(rel_err(out.to(DType::kF32), rout), 1e-2);
      EXPECT_LE(rel_err(lse, rlse), 2e-5);
      for (int threads : {1, 3}) {
        so.num_threads = threads;
        Tensor again(DType::kBF16, out.shape());
        sparse_attention(q, k, v, p, so, again);
        EXPECT_EQ(std::memcmp(again.data(), out.data(), out.nbytes()), 0) << threads << " threads";
      }
      if (isa == "avx512") avx512.push_back(out);
      else if (tiles::has_bf16_products() && x < avx512.size())
        differ += std::memcmp(out.data(), avx512[x].data(), out.nbytes()) != 0;
    }
  }
  if (std::find(targets.begin(), targets.end(), "avx512bf16") != targets.end() && !avx512.empty()) {
    EXPECT_GT(differ, 0);
  }
}

namespace {

// fp64 ReLU / Mixed attention for one problem [1, H, L, D] (no GQA), `allowed` from a fixed pattern.
// mode: 0 relu (power, normalize), 1 mixed (w1, w2).
void formula(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v, int64_t H,
             int64_t L, int64_t D, const Pattern& fixed, double power, int normalize, bool mixed, double w1, double w2,
             std::vector<double>& out) {
  out.assign(size_t(H * L * D), 0.0);
  const double scale = 1.0 / std::sqrt(double(D));
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < L; ++i) {
      std::vector<double> s(L), w(L, 0.0), p(L, 0.0);
      double z = 0, n = 0, mx = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        if (!fixed.allowed(0, h, i, j, L, L)) continue;
        double d = 0;
        for (int64_t c = 0; c < D; ++c) d += q[(h * L + i) * D + c] * k[(h * L + j) * D + c];
        s[j] = scale * d;
        w[j] = s[j] > 0 ? std::pow(s[j], mixed ? 2.0 : power) : 0.0;
        z += w[j];
        n += 1;
        mx = std::max(mx, s[j]);
      }
      double norm = 1.0;
      if (!mixed && normalize == 1) norm = z > 0 ? 1.0 / z : 0.0;
      if (!mixed && normalize == 2) norm = n > 0 ? 1.0 / n : 0.0;
      double se = 0;
      if (mixed)
        for (int64_t j = 0; j < L; ++j)
          if (fixed.allowed(0, h, i, j, L, L)) se += std::exp(s[j] - mx);
      for (int64_t j = 0; j < L; ++j) {
        if (!fixed.allowed(0, h, i, j, L, L)) continue;
        const double a = mixed ? w1 * std::exp(s[j] - mx) / se + w2 * w[j] : w[j] * norm;
        for (int64_t c = 0; c < D; ++c) out[(h * L + i) * D + c] += a * v[(h * L + j) * D + c];
      }
    }
}

std::vector<double> to64(const Tensor& t) {
  std::vector<double> x(size_t(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) x[i] = t.data<float>()[i];
  return x;
}

}  // namespace

TEST(SparseAdaptive, ReLUAndMixedMatchFormulas) {
  const int64_t H = 2, L = 29, D = 8;
  const Tensor q = randn({1, H, L, D}, 11), k = randn({1, H, L, D}, 12), v = randn({1, H, L, D}, 13),
               dout = randn({1, H, L, D}, 14);
  struct C {
    std::string spec;
    double power;
    int normalize;
    bool mixed;
    double a1, a2;
  };
  for (const C& c :
       std::vector<C>{{"ReLUAttention()", 2, 0, false, 0, 0},
                      {"ReLUAttention(power=3.0, normalize='sum') & SlidingWindow(5, 5)", 3, 1, false, 0, 0},
                      {"ReLUAttention(normalize='length') & SlidingWindow(-1, 0)", 2, 2, false, 0, 0},
                      {"MixedAttention(logits=(0.3, -0.4))", 2, 0, true, 0.3, -0.4},
                      {"MixedAttention(logits=(1.0, 0.5)) & Dilated(3, 2)", 2, 0, true, 1.0, 0.5}}) {
    SCOPED_TRACE(c.spec);
    const Pattern p = Pattern::parse(c.spec);
    EXPECT_EQ(p.repr(), c.spec);
    const std::string fs = c.spec.find('&') == std::string::npos ? "Full()" : c.spec.substr(c.spec.find('&') + 2);
    const Pattern fixed = Pattern::parse(fs);
    const double e1 = std::exp(c.a1), e2 = std::exp(c.a2), w1 = e1 / (e1 + e2), w2 = e2 / (e1 + e2);
    Tensor out(DType::kF32, {1, H, L, D}), lse(DType::kF32, {1, H, L});
    sparse_attention(q, k, v, p, {}, out, lse);
    std::vector<double> ref;
    auto Q = to64(q), K = to64(k), V = to64(v), G = to64(dout);
    formula(Q, K, V, H, L, D, fixed, c.power, c.normalize, c.mixed, w1, w2, ref);
    double err = 0, mx = 1;
    for (size_t x = 0; x < ref.size(); ++x) {
      err = std::max(err, std::abs(ref[x] - out.data<float>()[x]));
      mx = std::max(mx, std::abs(ref[x]));
    }
    EXPECT_LE(err / mx, 2e-5);
    // Backward: directional derivatives of the fp64 loss sum(dout * out) by central differences.
    Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape()), dl(DType::kF32, {2});
    SparseGrads g{dq.view(), dk.view(), dv.view(), {}, {}, {}};
    if (c.mixed) g.dlogits = dl.view();
    sparse_attention_backward(dout, q, k, v, out, lse, p, {}, g);
    auto loss = [&](const std::vector<double>& q_, const std::vector<double>& k_, const std::vector<double>& v_,
                    double ww1, double ww2) {
      std::vector<double> o;
      formula(q_, k_, v_, H, L, D, fixed, c.power, c.normalize, c.mixed, ww1, ww2, o);
      double s = 0;
      for (size_t x = 0; x < o.size(); ++x) s += o[x] * G[x];
      return s;
    };
    std::mt19937_64 rng(5);
    std::normal_distribution<double> nd;
    const double eps = 1e-5;
    for (int which = 0; which < 3; ++which)
      for (int rep = 0; rep < 2; ++rep) {
        std::vector<double> dir(Q.size());
        for (auto& x : dir) x = nd(rng);
        std::vector<double> plus[3] = {Q, K, V}, minus[3] = {Q, K, V};
        for (size_t x = 0; x < dir.size(); ++x) {
          plus[which][x] += eps * dir[x];
          minus[which][x] -= eps * dir[x];
        }
        const double fd =
            (loss(plus[0], plus[1], plus[2], w1, w2) - loss(minus[0], minus[1], minus[2], w1, w2)) / (2 * eps);
        const Tensor& gr = which == 0 ? dq : which == 1 ? dk : dv;
        double an = 0, scale = 0;
        for (size_t x = 0; x < dir.size(); ++x) {
          an += gr.data<float>()[x] * dir[x];
          scale += std::abs(gr.data<float>()[x] * dir[x]);
        }
        EXPECT_LE(std::abs(an - fd), 1e-4 * std::max(1.0, scale)) << "grad " << which;
      }
    if (c.mixed) {
      for (int l = 0; l < 2; ++l) {
        const double a1p = c.a1 + (l == 0 ? eps : 0), a2p = c.a2 + (l == 1 ? eps : 0);
        const double a1m = c.a1 - (l == 0 ? eps : 0), a2m = c.a2 - (l == 1 ? eps : 0);
        auto ws = [](double x, double y, double& u, double& w) {
          u = std::exp(x) / (std::exp(x) + std::exp(y));
          w = 1 - u;
        };
        double u1, u2, m1, m2;
        ws(a1p, a2p, u1, u2);
        ws(a1m, a2m, m1, m2);
        const double fd = (loss(Q, K, V, u1, u2) - loss(Q, K, V, m1, m2)) / (2 * eps);
        EXPECT_NEAR(dl.data<float>()[l], fd, 1e-4 * std::max(1.0, std::abs(fd)));
      }
    }
  }
}

TEST(SparseAdaptive, CompositionRules) {
  EXPECT_THROW(TopK(4).dense_mask(8, 8), Error);
  EXPECT_THROW(GlobalTokens({0}, TopK(3)), Error);
  const Tensor q = randn({1, 1, 8, 4}, 1);
  Tensor out(DType::kF32, {1, 1, 8, 4});
  EXPECT_THROW(sparse_attention(q, q, q, TopK(2) | SlidingWindow(1, 1), {}, out), Error);
  EXPECT_THROW(sparse_attention(q, q, q, TopK(2) & ReLUAttention(), {}, out), Error);
  EXPECT_EQ(Pattern::parse("BlockTopK(64, 16, local=False, causal=True)").repr(),
            "BlockTopK(64, 16, local=False, causal=True)");
  EXPECT_EQ(Pattern::parse("TopK(16) & WindowAttention2D(8, 8, 4)").repr(), "TopK(16) & WindowAttention2D(8, 8, 4)");
  EXPECT_THROW(Pattern::parse("MixedAttention(logits=(1, 2, 3))"), Error);
  EXPECT_THROW(Pattern::parse("ReLUAttention(normalize='max')"), Error);
}
