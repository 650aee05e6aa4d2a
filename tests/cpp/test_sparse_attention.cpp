// The block-sparse engine against the library's reference (kernel="reference", accumulate_fp64) with the
// pattern's dense mask: forward <= 2e-5, backward <= 1e-4, relative to max(1, |ref|_inf), fp32 inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/sparse.hpp"
#include "sparse/engine.hpp"
#include "sparse/tiles.hpp"
#include "scoped.hpp"
#include "sparse_test_util.hpp"

using namespace sattn;
using namespace sattn::sparse;
using sattn::sparse_test::randn;
using sattn::sparse_test::rel_err;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Case {
  std::string spec;
  int64_t B, Hq, Hkv, Lq, Lk, D, Dv;
  int64_t block = 64;
  int padding = 0;  // 0 none, 1 lengths, 2 bool mask
  bool alibi = false, bias = false, rel_pos = false;
  // 1: a NaN in q row (B-1, 0, Lq/2); 2: NaN in k rows (0, Hkv-1, Lk/3) and (0, Hkv-1, Lk-1); 3: a NaN in the
  // bias at an allowed (h, i, j) of row Lq/2 and at a masked one of row Lq/3 (needs bias)
  int nan = 0;
};

struct Result {
  Tensor out, lse, dq, dk, dv, dbias, drel;
};

// Additive float mask for the reference: 0 / -inf from the pattern, plus the score-mod biases.
Tensor reference_mask(const Case& c, const Pattern& p, const Tensor& bias, const Tensor& rel, int64_t win,
                      int64_t width) {
  const Tensor dm = p.dense_mask(c.Lq, c.Lk, c.Hq);
  Tensor m(DType::kF64, {c.Hq, c.Lq, c.Lk});
  const std::vector<float> slopes = alibi_slopes(c.Hq);
  for (int64_t h = 0; h < c.Hq; ++h)
    for (int64_t i = 0; i < c.Lq; ++i)
      for (int64_t j = 0; j < c.Lk; ++j) {
        const int64_t hs = dm.size(0) == 1 ? 0 : h;
        double& v = m.data<double>()[(h * c.Lq + i) * c.Lk + j];
        v = -kInf;  // the pattern masks the pair whatever its score mods (a NaN bias included)
        if (!dm.data<uint8_t>()[(hs * c.Lq + i) * c.Lk + j]) continue;
        v = 0.0;
        if (c.alibi) v -= slopes[h] * std::abs(double(i + c.Lk - c.Lq - j));
        if (c.bias) v += bias.data<float>()[((bias.size(0) == 1 ? 0 : h) * c.Lq + i) * c.Lk + j];
        if (c.rel_pos) {
          const int64_t dr = i / width - j / width, dc = i % width - j % width;
          if (std::abs(dr) < win && std::abs(dc) < win)
            v += rel.data<float>()[((dr + win - 1) * (2 * win - 1) + dc + win - 1) * c.Hq + h];
        }
      }
  return m;
}

// Tolerances of bf16 inputs whose out is bf16 (the bf16 products round P once; out's own rounding is 2^-9
// relative): as the fused kernel's (test_fused.cpp, kBf16OutTol).
// Gradients (P and dS rounded once, then the gradients' own rounding): measured up to 3.2e-3 on the float32 products
// and 6.3e-3 on the bf16 ones (dq of a BigBird case), half the fused kernel's kBf16GradTol.
constexpr double kBf16OutTol = 1e-2, kBf16GradTol = 1.5e-2;

// The case against the reference. bf16: q, k, v and dout rounded to bf16 and given as bf16 with a bf16 out and bf16
// gradients (the reference on the same values; out within kBf16OutTol, lse within 2e-5, dq, dk, dv within
// kBf16GradTol, in the one-pass and the two-pass form; the same out and gradients on 1 and 3 threads), its out and
// the one-pass form's dq in *bf16_out, *bf16_dq when given.
void run_case(const Case& c, bool bf16 = false, Tensor* bf16_out = nullptr, Tensor* bf16_dq = nullptr) {
  SCOPED_TRACE(c.spec + " B=" + std::to_string(c.B) + " Hq=" + std::to_string(c.Hq) + " Hkv=" + std::to_string(c.Hkv) +
               " Lq=" + std::to_string(c.Lq) + " Lk=" + std::to_string(c.Lk) + " D=" + std::to_string(c.D) +
               " Dv=" + std::to_string(c.Dv) + " block=" + std::to_string(c.block) +
               " pad=" + std::to_string(c.padding) + " nan=" + std::to_string(c.nan));
  const Pattern p = Pattern::parse(c.spec);
  const uint64_t seed = std::hash<std::string>{}(c.spec) ^ uint64_t(c.Lq * 131 + c.Lk);
  Tensor q = randn({c.B, c.Hq, c.Lq, c.D}, seed + 1), k = randn({c.B, c.Hkv, c.Lk, c.D}, seed + 2),
         v = randn({c.B, c.Hkv, c.Lk, c.Dv}, seed + 3), dout = randn({c.B, c.Hq, c.Lq, c.Dv}, seed + 4);
  if (bf16) {
    q = q.to(DType::kBF16).to(DType::kF32), k = k.to(DType::kBF16).to(DType::kF32);
    v = v.to(DType::kBF16).to(DType::kF32), dout = dout.to(DType::kBF16).to(DType::kF32);
  }
  if (c.nan == 1) q.data<float>()[(((c.B - 1) * c.Hq) * c.Lq + c.Lq / 2) * c.D + 1] = std::nanf("");
  if (c.nan == 2)
    for (int64_t j : {c.Lk / 3, c.Lk - 1}) k.data<float>()[((c.Hkv - 1) * c.Lk + j) * c.D + 1] = std::nanf("");
  SparseOptions so;
  so.block = c.block;
  so.num_threads = 2;
  AttentionOptions ro;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  Tensor lengths(DType::kI64, {c.B}), kpm(DType::kBool, {c.B, c.Lk});
  if (c.padding == 1) {
    for (int64_t b = 0; b < c.B; ++b) lengths.data<int64_t>()[b] = std::max<int64_t>(0, c.Lk - 3 - 7 * b);
    so.key_lengths = ro.key_lengths = lengths.view();
  } else if (c.padding == 2) {
    std::mt19937 g(7);
    for (int64_t x = 0; x < kpm.numel(); ++x) kpm.data<uint8_t>()[x] = (g() % 4) == 0;
    so.key_padding_mask = ro.key_padding_mask = kpm.view();
  }
  if (c.alibi) so.alibi_slopes = alibi_slopes(c.Hq);
  const Tensor bias = randn({c.Hq, c.Lq, c.Lk}, seed + 5, 0.5);
  if (c.bias) so.bias = bias.view();
  if (c.nan == 3) {
    const Tensor dm = p.dense_mask(c.Lq, c.Lk, c.Hq);
    const int64_t h = dm.size(0) - 1;
    for (const auto& [i, allowed] : {std::pair{c.Lq / 2, true}, std::pair{c.Lq / 3, false}}) {
      const uint8_t* row = dm.data<uint8_t>() + (h * c.Lq + i) * c.Lk;
      const int64_t j = std::find(row, row + c.Lk, allowed ? 1 : 0) - row;
      ASSERT_LT(j, c.Lk) << "row " << i << " has no " << (allowed ? "allowed" : "masked") << " key";
      bias.data<float>()[(h * c.Lq + i) * c.Lk + j] = std::nanf("");
    }
  }
  int64_t width = 0, win = 0;
  Tensor rel;
  if (c.rel_pos) {
    ASSERT_TRUE(p.node_ptr() != nullptr);
    // WindowAttention2D(height, width, window, ...): geometry from the spec.
    int64_t height = 0;
    ASSERT_EQ(std::sscanf(c.spec.c_str(), "WindowAttention2D(%ld, %ld, %ld", &height, &width, &win), 3);
    rel = randn({(2 * win - 1) * (2 * win - 1), c.Hq}, seed + 6, 0.5);
    so.rel_pos_bias = rel.view();
  }
  const Tensor mask = reference_mask(c, p, bias, rel, win, width);
  ro.attn_mask = mask.view();

  // Reference (fp64 accumulation).
  Tensor rout(DType::kF64, {c.B, c.Hq, c.Lq, c.Dv}), rlse(DType::kF64, {c.B, c.Hq, c.Lq});
  scaled_dot_product_attention(q, k, v, ro, {rout.view(), rlse.view(), {}});
  Tensor rdq(DType::kF64, q.shape()), rdk(DType::kF64, k.shape()), rdv(DType::kF64, v.shape()),
      rdm(DType::kF64, mask.shape());
  scaled_dot_product_attention_backward(dout, q, k, v, rout, rlse, ro,
                                        {rdq.view(), rdk.view(), rdv.view(), rdm.view()});

  if (bf16) {
    const Tensor qb = q.to(DType::kBF16), kb = k.to(DType::kBF16), vb = v.to(DType::kBF16);
    Tensor out(DType::kBF16, rout.shape()), lse(DType::kF32, rlse.shape());
    sparse_attention(qb, kb, vb, p, so, out, lse);
    EXPECT_LE(rel_err(out.to(DType::kF32), rout), kBf16OutTol);
    EXPECT_LE(rel_err(lse, rlse), 2e-5);
    Tensor out1(DType::kBF16, rout.shape()), out3(DType::kBF16, rout.shape());
    so.num_threads = 1;
    sparse_attention(qb, kb, vb, p, so, out1);
    so.num_threads = 3;
    sparse_attention(qb, kb, vb, p, so, out3);
    EXPECT_EQ(std::memcmp(out.data(), out1.data(), out.nbytes()), 0);
    EXPECT_EQ(std::memcmp(out.data(), out3.data(), out.nbytes()), 0);
    if (bf16_out) *bf16_out = out;
    const Tensor dob = dout.to(DType::kBF16);
    Tensor dbias(DType::kF32, bias.shape()), drel(DType::kF32, c.rel_pos ? rel.shape() : Shape{1});
    for (const char* form : {"one_pass", "two_pass"})
      for (std::vector<Tensor> first; int threads : {2, 1, 3}) {
        SCOPED_TRACE(form);
        const sattn::testing::ScopedEnv env("SATTN_SPARSE_BACKWARD", form);
        so.num_threads = threads;
        Tensor dq(DType::kBF16, q.shape()), dk(DType::kBF16, k.shape()), dv(DType::kBF16, v.shape());
        SparseGrads g{dq.view(), dk.view(), dv.view(), {}, {}, {}};
        if (c.bias) g.dbias = dbias.view();
        if (c.rel_pos) g.drel_pos_bias = drel.view();
        sparse_attention_backward(dob, qb, kb, vb, out, lse, p, so, g);
        if (first.empty()) {
          EXPECT_LE(rel_err(dq.to(DType::kF32), rdq), kBf16GradTol);
          EXPECT_LE(rel_err(dk.to(DType::kF32), rdk), kBf16GradTol);
          EXPECT_LE(rel_err(dv.to(DType::kF32), rdv), kBf16GradTol);
          first = {dq, dk, dv};
          if (bf16_dq && form == std::string("one_pass")) *bf16_dq = dq;
          continue;
        }
        EXPECT_EQ(std::memcmp(dq.data(), first[0].data(), dq.nbytes()), 0) << threads << " threads";
        EXPECT_EQ(std::memcmp(dk.data(), first[1].data(), dk.nbytes()), 0) << threads << " threads";
        EXPECT_EQ(std::memcmp(dv.data(), first[2].data(), dv.nbytes()), 0) << threads << " threads";
      }
    return;
  }

  // Sparse.
  Tensor out(DType::kF32, rout.shape()), lse(DType::kF32, rlse.shape());
  sparse_attention(q, k, v, p, so, out, lse);
  EXPECT_LE(rel_err(out, rout), 2e-5);
  EXPECT_LE(rel_err(lse, rlse), 2e-5);
  Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
  Tensor dbias(DType::kF32, bias.shape()), drel(DType::kF32, c.rel_pos ? rel.shape() : Shape{1});
  SparseGrads g{dq.view(), dk.view(), dv.view(), {}, {}, {}};
  if (c.bias) g.dbias = dbias.view();
  if (c.rel_pos) g.drel_pos_bias = drel.view();
  sparse_attention_backward(dout, q, k, v, out, lse, p, so, g);
  EXPECT_LE(rel_err(dq, rdq), 1e-4);
  EXPECT_LE(rel_err(dk, rdk), 1e-4);
  EXPECT_LE(rel_err(dv, rdv), 1e-4);
  if (c.bias) {
    EXPECT_LE(rel_err(dbias, rdm), 1e-4);
  }
  if (c.rel_pos) {
    Tensor want(DType::kF64, rel.shape());
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < c.Lq; ++i)
        for (int64_t j = 0; j < c.Lk; ++j) {
          const int64_t dr = i / width - j / width, dc = i % width - j % width;
          if (std::abs(dr) < win && std::abs(dc) < win)
            want.data<double>()[((dr + win - 1) * (2 * win - 1) + dc + win - 1) * c.Hq + h] +=
                rdm.data<double>()[(h * c.Lq + i) * c.Lk + j];
        }
    EXPECT_LE(rel_err(drel, want), 1e-4);
  }
}

}  // namespace

TEST(SparseAttention, FixedPatternsMatchReference) {
  const std::vector<Case> cases = {
      {"SlidingWindow(5, 3)", 2, 4, 2, 67, 67, 16, 24},
      {"SlidingWindow(-1, 0)", 1, 2, 1, 65, 130, 32, 32},
      {"SlidingWindow(20, 20, alignment='top_left')", 1, 2, 2, 130, 65, 8, 8},
      {"SlidingWindow(2, 0)", 1, 3, 3, 100, 40, 16, 16},  // Lq > Lk: leading rows see no key
      {"SlidingWindow(30, 30)", 2, 2, 2, 129, 129, 64, 64, 16, 1},
      {"Dilated(4, 3)", 1, 2, 2, 129, 129, 16, 16},
      {"Dilated(2, 2)", 2, 4, 1, 70, 100, 16, 8, 64, 2},
      {"BlockLocal(16)", 1, 2, 2, 100, 100, 16, 16},
      {"BlockLocal(7, alignment='top_left')", 1, 2, 1, 33, 64, 16, 16},
      {"GlobalTokens([0, 5, 64], SlidingWindow(4, 4))", 1, 2, 2, 129, 129, 16, 16},
      {"BigBird(16, 3, 1, 2, seed=7)", 1, 4, 2, 150, 150, 16, 16},
      {"BigBird(8, 3, 1, 1, seed=3)", 2, 2, 2, 63, 90, 8, 16, 16, 1},
      {"Neighborhood2D(12, 13, 5, dilation=2)", 1, 2, 2, 156, 156, 16, 16},
      {"Neighborhood2D(11, 9, 3, causal=True)", 1, 2, 1, 99, 99, 16, 16},
      {"Neighborhood2D(16, 16, 7)", 1, 1, 1, 256, 256, 32, 32},
      // 16 x 4 query tiles whose key rows are computed only for the tile rows that reach them (narrowed ranges):
      // awkward grids (partial tiles on both axes), GQA, causal, dilation, key padding, smaller blocks.
      {"Neighborhood2D(30, 27, 7)", 1, 4, 2, 810, 810, 32, 32},
      {"Neighborhood2D(23, 19, 7, causal=True)", 2, 2, 1, 437, 437, 16, 16, 64, 1},
      {"Neighborhood2D(26, 21, 5, dilation=2)", 1, 2, 2, 546, 546, 16, 8, 64, 2},
      {"Neighborhood2D(22, 25, 7)", 1, 2, 1, 550, 550, 16, 16, 16},
      {"WindowAttention2D(16, 16, 8)", 1, 2, 2, 256, 256, 16, 16},
      {"WindowAttention2D(12, 8, 4, shift=2)", 1, 2, 2, 96, 96, 16, 16},
      {"SlidingWindow(8, 0) | Dilated(3, 5)", 1, 2, 2, 120, 120, 16, 16},
      {"SlidingWindow(-1, 0) & BlockLocal(32)", 1, 2, 2, 100, 100, 16, 16},
      {"Full()", 2, 2, 1, 1, 77, 16, 16},
      {"Full()", 1, 2, 2, 65, 64, 80, 24, 64, 2},
  };
  for (const Case& c : cases) run_case(c);
}

// A NaN in q, k or the bias: the rows whose allowed scores hold it are NaN (out, lse, dq, and dk, dv, dbias of
// their allowed keys), and nothing else is, as in the reference: a NaN that only masked pairs see (a query row with
// no allowed key, a padding key, a masked bias entry) changes nothing. Both backward forms, ALiBi and bias,
// padding, every tile build.
TEST(SparseAttention, NanRowsMatchReference) {
  std::vector<Case> cases = {
      {"SlidingWindow(5, 3)", 2, 4, 2, 67, 67, 16, 24, 16},
      {"SlidingWindow(2, 0)", 1, 3, 3, 100, 40, 16, 16},  // rows < 60 see no key
      {"Dilated(2, 2) | GlobalTokens([0, 5], BlockLocal(16))", 2, 4, 1, 70, 100, 16, 8, 16, 2},
      {"BigBird(8, 3, 1, 1, seed=3)", 2, 2, 2, 63, 90, 8, 16, 16, 1, true, true},
      {"Neighborhood2D(8, 9, 3, dilation=2)", 1, 2, 2, 72, 72, 16, 16, 64, 0, false, true},
      {"Full()", 2, 2, 1, 1, 77, 16, 16},
  };
  for (size_t x = 0, n = cases.size(); x < n; ++x)
    for (int nan : {2, 3}) {
      if (nan == 3 && !cases[x].bias) continue;
      cases.push_back(cases[x]);
      cases.back().nan = nan;
    }
  for (Case& c : cases)
    if (c.nan == 0) c.nan = 1;
  for (const std::string& isa : sattn::testing::simd_target_names())
    for (const char* form : {"one_pass", "two_pass"}) {
      SCOPED_TRACE(isa + " " + form);
      const sattn::testing::ScopedSimdTarget target(isa);
      const sattn::testing::ScopedEnv env("SATTN_SPARSE_BACKWARD", form);
      for (const Case& c : cases) run_case(c);
    }
}

// The backward's one-pass form (coloured query blocks) and two-pass form, each forced, against the reference.
TEST(SparseAttention, BackwardFormsMatchReference) {
  const std::vector<Case> cases = {
      {"SlidingWindow(5, 3)", 2, 4, 2, 67, 67, 16, 24, 16},
      {"Dilated(2, 2)", 2, 4, 1, 70, 100, 16, 8, 16, 2},
      {"GlobalTokens([0, 5, 64], SlidingWindow(4, 4))", 1, 2, 2, 129, 129, 16, 16, 16},
      {"BigBird(8, 3, 1, 1, seed=3)", 2, 2, 2, 63, 90, 8, 16, 16, 1},
      {"Neighborhood2D(12, 13, 5, dilation=2)", 1, 2, 2, 156, 156, 16, 16},
      {"Neighborhood2D(16, 16, 7)", 1, 2, 1, 256, 256, 32, 32},
      {"Neighborhood2D(30, 27, 7)", 1, 4, 2, 810, 810, 32, 32},
      {"Neighborhood2D(23, 19, 7, causal=True)", 2, 2, 1, 437, 437, 16, 16, 64, 1},
      {"Neighborhood2D(26, 21, 5, dilation=2)", 1, 2, 2, 546, 546, 16, 8, 16},
      {"WindowAttention2D(12, 8, 4, shift=2)", 1, 2, 2, 96, 96, 16, 16},
      {"SlidingWindow(-1, 0) & BlockLocal(32)", 1, 2, 2, 100, 100, 16, 16, 16},
  };
  for (const char* form : {"one_pass", "two_pass"}) {
    SCOPED_TRACE(form);
    const sattn::testing::ScopedEnv env("SATTN_SPARSE_BACKWARD", form);
    for (const Case& c : cases) run_case(c);
  }
}

// bf16 inputs with a bf16 out and bf16 gradients: on a build with bf16 products (avx512bf16; amx runs it too) S and
// P·V take them in the forward, P rounded once, and all five products of the one-pass backward, P and dS rounded
// once (score mods with parameters take the two-pass backward on float32 products); elsewhere the float32 products.
// Against the reference on the same values (run_case's bf16 mode): chunks of one range and of several (BigBird,
// global tokens), narrowed query rows (Neighborhood2D), odd D and Dv, GQA, padding, score mods, NaN rows; every
// target. Where the bf16 products run, some out and some dq differ from the avx512 build's: they ran.
TEST(SparseAttention, Bf16OutputsMatchReferenceOnEveryTarget) {
  std::vector<Case> cases = {
      {"SlidingWindow(5, 3)", 2, 4, 2, 67, 67, 16, 24, 16},
      {"SlidingWindow(100, 0)", 1, 2, 1, 300, 300, 64, 64},
      {"Dilated(2, 2)", 2, 4, 1, 70, 100, 17, 9, 16, 2},
      {"GlobalTokens([0, 5, 64], SlidingWindow(4, 4))", 1, 2, 2, 129, 129, 16, 16, 16},
      {"BigBird(8, 3, 1, 1, seed=3)", 2, 2, 2, 63, 90, 8, 16, 16, 1},
      {"Neighborhood2D(23, 19, 7, causal=True)", 2, 2, 1, 437, 437, 33, 16, 64, 1},
      {"Full()", 1, 2, 2, 65, 64, 80, 24, 64, 2},
      {"SlidingWindow(30, 30)", 1, 2, 2, 129, 129, 64, 64, 64, 0, true, true},
      {"WindowAttention2D(12, 8, 4, shift=2)", 1, 2, 2, 96, 96, 16, 16, 64, 0, false, false, true},
  };
  for (size_t x = 0; x < 3; ++x) {  // NaN in q, and in k
    for (int nan : {1, 2}) {
      cases.push_back(cases[x]);
      cases.back().nan = nan;
    }
  }
  std::vector<Tensor> avx512, avx512_dq;
  int differ = 0, differ_dq = 0;
  const auto targets = sattn::testing::simd_target_names();
  for (const std::string& isa : {std::string("avx512"), std::string("avx512bf16"), std::string("amx"),
                                 std::string("avx2"), std::string("portable")}) {
    if (std::find(targets.begin(), targets.end(), isa) == targets.end()) continue;
    SCOPED_TRACE(isa);
    const sattn::testing::ScopedSimdTarget target(isa);
    for (size_t x = 0; x < cases.size(); ++x) {
      Tensor out, dq;
      run_case(cases[x], true, &out, &dq);
      if (isa == "avx512") {
        avx512.push_back(out), avx512_dq.push_back(dq);
      } else if (tiles::has_bf16_products() && x < avx512.size()) {
        differ += std::memcmp(out.data(), avx512[x].data(), out.nbytes()) != 0;
        differ_dq += std::memcmp(dq.data(), avx512_dq[x].data(), dq.nbytes()) != 0;
      }
    }
  }
  const bool any_bf16 = std::find(targets.begin(), targets.end(), "avx512bf16") != targets.end();
  if (any_bf16 && !avx512.empty()) {
    EXPECT_GT(differ, 0);
    EXPECT_GT(differ_dq, 0);
  }
}

// The inputs the engine widens to float32 before its products (bf16 and float16 rows, and float32 rows that are not
// back to back: a [B, L, H, D] layout seen as [B, H, L, D], the last stride not 1): out, lse and gradients are
// bitwise those of the float32 copies of the same values, on 1 and 2 threads (the conversion is split over (b, h)),
// one-pass and two-pass backward, with a permuted layout (Neighborhood2D) too. The float32 products throughout: out
// and gradients are float32.
TEST(SparseAttention, HalfAndStridedInputsEqualTheirFloat32Copies) {
  const int64_t B = 2, H = 2, L = 96, D = 24;
  for (const char* spec : {"SlidingWindow(20, 5)", "Neighborhood2D(8, 12, 5)"}) {
    const Pattern p = Pattern::parse(spec);
    for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
      // the values, rounded to dt; dt == kF32: given through a strided view
      Tensor q = randn({B, H, L, D}, 41), k = randn({B, H, L, D}, 42), v = randn({B, H, L, D}, 43);
      const Tensor dout = randn({B, H, L, D}, 44);
      if (dt != DType::kF32) q = q.to(dt).to(DType::kF32), k = k.to(dt).to(DType::kF32), v = v.to(dt).to(DType::kF32);
      std::vector<Tensor> keep;
      const auto given = [&](const Tensor& t) {
        if (dt != DType::kF32) return keep.emplace_back(t.to(dt)).view();
        Tensor blh(DType::kF32, {B, L, H, D + 3});  // [B, L, H, D] rows padded to D + 3: strides (L·H·(D+3), D+3, …)
        for (int64_t b = 0; b < B; ++b)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < L; ++i)
              for (int64_t d = 0; d < D; ++d)
                blh.data<float>()[((b * L + i) * H + h) * (D + 3) + d] = t.data<float>()[((b * H + h) * L + i) * D + d];
        keep.push_back(blh);
        return TensorView(keep.back().data(), DType::kF32, {B, H, L, D}, {L * H * (D + 3), D + 3, H * (D + 3), 1});
      };
      const TensorView qv = given(q), kv = given(k), vv = given(v);
      for (const char* form : {"one_pass", "two_pass"})
        for (int threads : {1, 2}) {
          SCOPED_TRACE(std::string(spec) + " " + to_string(dt) + " " + form + " " + std::to_string(threads));
          const sattn::testing::ScopedEnv env("SATTN_SPARSE_BACKWARD", form);
          SparseOptions so;
          so.num_threads = threads;
          Tensor out0(DType::kF32, {B, H, L, D}), lse0(DType::kF32, {B, H, L}), out1(out0.dtype(), out0.shape()),
              lse1(lse0.dtype(), lse0.shape());
          sparse_attention(q, k, v, p, so, out0, lse0);
          sparse_attention(qv, kv, vv, p, so, out1, lse1);
          EXPECT_EQ(std::memcmp(out0.data(), out1.data(), out0.nbytes()), 0);
          EXPECT_EQ(std::memcmp(lse0.data(), lse1.data(), lse0.nbytes()), 0);
          std::vector<Tensor> g0, g1;
          for (auto* g : {&g0, &g1})
            for (int x = 0; x < 3; ++x) g->emplace_back(DType::kF32, Shape{B, H, L, D});
          sparse_attention_backward(dout, q, k, v, out0, lse0, p, so,
                                    {g0[0].view(), g0[1].view(), g0[2].view(), {}, {}, {}});
          sparse_attention_backward(dout, qv, kv, vv, out0, lse0, p, so,
                                    {g1[0].view(), g1[1].view(), g1[2].view(), {}, {}, {}});
          for (int x = 0; x < 3; ++x) EXPECT_EQ(std::memcmp(g0[x].data(), g1[x].data(), g0[x].nbytes()), 0) << x;
        }
    }
  }
}

// float32 inputs with float32_precision = kBF16: where the build has bf16 products the forward and the backward take
// them (q, k, v, dout rounded to bf16, P and dS rounded once; out and gradients within 2e-2 of the reference and not
// the float32 products' result), elsewhere they are bitwise the kHighest results; the engine and BlockTopK's direct
// forward, every target.
TEST(SparseAttention, Float32PrecisionBf16RoundsFloat32InputsWhereTheBuildHasBf16Products) {
  const int64_t B = 1, Hq = 4, Hkv = 2, L = 200, D = 40;
  const Tensor q = randn({B, Hq, L, D}, 31), k = randn({B, Hkv, L, D}, 32), v = randn({B, Hkv, L, D}, 33),
               dout = randn({B, Hq, L, D}, 34);
  const auto targets = sattn::testing::simd_target_names();
  for (const char* spec : {"SlidingWindow(30, 30)", "BigBird(8, 3, 1, 2, seed=1)", "BlockTopK(16, 3)"}) {
    const Pattern p = Pattern::parse(spec);
    const Shape ishape = selection_shape(p, B, Hq, L, L);
    for (const std::string& isa : targets) {
      SCOPED_TRACE(std::string(spec) + " " + isa);
      const sattn::testing::ScopedSimdTarget target(isa);
      SparseOptions so;
      Tensor high(DType::kF32, {B, Hq, L, D}), low(DType::kF32, {B, Hq, L, D}),
          idx(DType::kI64, ishape.empty() ? Shape{1} : ishape);
      const TensorView iv = ishape.empty() ? TensorView{} : idx.view();
      sparse_attention(q, k, v, p, so, high, {}, iv);
      so.float32_precision = Float32Precision::kBF16;
      sparse_attention(q, k, v, p, so, low, {}, iv);
      const bool same = std::memcmp(high.data(), low.data(), high.nbytes()) == 0;
      EXPECT_EQ(same, !tiles::has_bf16_products());
      // the reference on the mask of the pattern (or of BlockTopK's selection)
      AttentionOptions ro;
      ro.kernel = "reference";
      ro.accumulate_fp64 = true;
      const Tensor mask = ishape.empty() ? p.dense_mask(L, L, Hq) : selection_mask(p, idx, L, L);
      ro.attn_mask = mask.view();
      Tensor ref(DType::kF64, high.shape()), rlse(DType::kF64, {B, Hq, L});
      scaled_dot_product_attention(q, k, v, ro, {ref.view(), rlse.view(), {}});
      EXPECT_LE(rel_err(high, ref), 2e-5);
      EXPECT_LE(rel_err(low, ref), 2e-2);
      // the backward from the kHighest forward's out and lse
      Tensor lse(DType::kF32, {B, Hq, L});
      so.float32_precision = Float32Precision::kHighest;
      sparse_attention(q, k, v, p, so, high, lse, iv);
      Tensor rdq(DType::kF64, q.shape()), rdk(DType::kF64, k.shape()), rdv(DType::kF64, v.shape());
      scaled_dot_product_attention_backward(dout, q, k, v, ref, rlse, ro, {rdq.view(), rdk.view(), rdv.view(), {}});
      std::vector<Tensor> grads[2];
      for (int x = 0; x < 2; ++x) {
        so.float32_precision = x == 0 ? Float32Precision::kHighest : Float32Precision::kBF16;
        grads[x] = {Tensor(DType::kF32, q.shape()), Tensor(DType::kF32, k.shape()), Tensor(DType::kF32, v.shape())};
        sparse_attention_backward(dout, q, k, v, high, lse, p, so,
                                  {grads[x][0].view(), grads[x][1].view(), grads[x][2].view(), {}, {}, {}}, iv);
      }
      const Tensor* want[3] = {&rdq, &rdk, &rdv};
      for (int g = 0; g < 3; ++g) {
        SCOPED_TRACE("gradient " + std::to_string(g));
        EXPECT_LE(rel_err(grads[0][size_t(g)], *want[g]), 1e-4);
        EXPECT_LE(rel_err(grads[1][size_t(g)], *want[g]), 2e-2);
        EXPECT_EQ(
            std::memcmp(grads[0][size_t(g)].data(), grads[1][size_t(g)].data(), grads[0][size_t(g)].nbytes()) == 0,
            !tiles::has_bf16_products());
      }
    }
  }
}

TEST(SparseAttention, ScoreModsMatchReference) {
  Case alibi{"SlidingWindow(16, 0)", 1, 4, 2, 90, 100, 16, 16};
  alibi.alibi = true;
  run_case(alibi);
  Case bias{"Dilated(3, 2) | SlidingWindow(4, 4)", 1, 2, 2, 70, 70, 16, 16};
  bias.bias = true;
  run_case(bias);
  Case rel{"WindowAttention2D(12, 8, 4, shift=2)", 1, 2, 2, 96, 96, 16, 16};
  rel.rel_pos = true;
  run_case(rel);
  Case rel2{"WindowAttention2D(8, 8, 4)", 2, 3, 1, 64, 64, 8, 8, 16, 1};
  rel2.rel_pos = true;
  rel2.alibi = true;
  run_case(rel2);
}

// Soft-capping is not expressible as a mask, so the reference here is the formula in fp64.
TEST(SparseAttention, SoftCapMatchesFormula) {
  const int64_t L = 70, D = 16;
  const double cap = 2.0, scale = 1.0 / std::sqrt(double(D));
  const Tensor q = randn({1, 1, L, D}, 1, 2.0), k = randn({1, 1, L, D}, 2, 2.0), v = randn({1, 1, L, D}, 3),
               dout = randn({1, 1, L, D}, 4);
  const Pattern p = SlidingWindow(10, 5);
  SparseOptions so;
  so.softcap = cap;
  Tensor out(DType::kF32, {1, 1, L, D}), lse(DType::kF32, {1, 1, L});
  sparse_attention(q, k, v, p, so, out, lse);
  Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
  sparse_attention_backward(dout, q, k, v, out, lse, p, so, {dq.view(), dk.view(), dv.view(), {}, {}, {}});
  // fp64: s = cap tanh(scale q·k / cap); P = softmax; dS = P (dP - rowsum(P dP)) * (1 - tanh^2).
  Tensor ro(DType::kF64, out.shape()), rdq(DType::kF64, q.shape()), rdk(DType::kF64, k.shape()),
      rdv(DType::kF64, v.shape());
  auto Q = [&](int64_t i, int64_t d) { return double(q.data<float>()[i * D + d]); };
  auto K = [&](int64_t i, int64_t d) { return double(k.data<float>()[i * D + d]); };
  auto V = [&](int64_t i, int64_t d) { return double(v.data<float>()[i * D + d]); };
  auto G = [&](int64_t i, int64_t d) { return double(dout.data<float>()[i * D + d]); };
  for (int64_t i = 0; i < L; ++i) {
    std::vector<double> s(L, -INFINITY), t(L, 0), P(L, 0), dP(L, 0);
    double mx = -INFINITY;
    for (int64_t j = 0; j < L; ++j) {
      if (!p.allowed(0, 0, i, j, L, L)) continue;
      double dot = 0;
      for (int64_t d = 0; d < D; ++d) dot += Q(i, d) * K(j, d);
      t[j] = std::tanh(scale * dot / cap);
      s[j] = cap * t[j];
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < L; ++j) sum += std::isinf(s[j]) ? 0 : std::exp(s[j] - mx);
    double rowdot = 0;
    for (int64_t j = 0; j < L; ++j) {
      P[j] = std::isinf(s[j]) ? 0 : std::exp(s[j] - mx) / sum;
      for (int64_t d = 0; d < D; ++d) {
        ro.data<double>()[i * D + d] += P[j] * V(j, d);
        dP[j] += G(i, d) * V(j, d);
        rdv.data<double>()[j * D + d] += P[j] * G(i, d);
      }
      rowdot += P[j] * dP[j];
    }
    for (int64_t j = 0; j < L; ++j) {
      const double ds = P[j] * (dP[j] - rowdot) * (1 - t[j] * t[j]) * scale;
      for (int64_t d = 0; d < D; ++d) {
        rdq.data<double>()[i * D + d] += ds * K(j, d);
        rdk.data<double>()[j * D + d] += ds * Q(i, d);
      }
    }
  }
  EXPECT_LE(rel_err(out, ro), 2e-5);
  EXPECT_LE(rel_err(dq, rdq), 1e-4);
  EXPECT_LE(rel_err(dk, rdk), 1e-4);
  EXPECT_LE(rel_err(dv, rdv), 1e-4);
}

TEST(SparseAttention, BlockMaskFromDenseMatchesReference) {
  const int64_t B = 2, H = 2, Lq = 77, Lk = 91, D = 16;
  Tensor dm(DType::kBool, {H, Lq, Lk});
  std::mt19937 g(3);
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < Lq; ++i)
      for (int64_t j = 0; j < Lk; ++j)
        dm.data<uint8_t>()[(h * Lq + i) * Lk + j] = i % 11 != 3 && (std::abs(i - j) < 9 || g() % 5 == 0);
  const Tensor q = randn({B, H, Lq, D}, 1), k = randn({B, H, Lk, D}, 2), v = randn({B, H, Lk, D}, 3),
               dout = randn({B, H, Lq, D}, 4);
  const BlockMask bm = block_mask_from_dense(dm, 16, 16);
  AttentionOptions ro;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  ro.attn_mask = dm.view();
  Tensor rout(DType::kF64, {B, H, Lq, D}), rlse(DType::kF64, {B, H, Lq});
  scaled_dot_product_attention(q, k, v, ro, {rout.view(), rlse.view(), {}});
  Tensor rdq(DType::kF64, q.shape()), rdk(DType::kF64, k.shape()), rdv(DType::kF64, v.shape());
  scaled_dot_product_attention_backward(dout, q, k, v, rout, rlse, ro, {rdq.view(), rdk.view(), rdv.view(), {}});
  Tensor out(DType::kF32, rout.shape()), lse(DType::kF32, rlse.shape());
  SparseOptions so;
  block_sparse_attention(q, k, v, bm, dm, so, out, lse);
  EXPECT_LE(rel_err(out, rout), 2e-5);
  EXPECT_LE(rel_err(lse, rlse), 2e-5);
  Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
  block_sparse_attention_backward(dout, q, k, v, out, lse, bm, dm, so, {dq.view(), dk.view(), dv.view(), {}, {}, {}});
  EXPECT_LE(rel_err(dq, rdq), 1e-4);
  EXPECT_LE(rel_err(dk, rdk), 1e-4);
  EXPECT_LE(rel_err(dv, rdv), 1e-4);
  // The same mask as a function (flex_attention): the same engine, the same numbers.
  const MaskFunction mask_mod = [&](int64_t, int64_t h, int64_t i, int64_t j) {
    return dm.data<uint8_t>()[(h * Lq + i) * Lk + j] != 0;
  };
  Tensor fout(DType::kF32, rout.shape()), flse(DType::kF32, rlse.shape());
  flex_attention(q, k, v, bm, mask_mod, so, fout, flse);
  EXPECT_EQ(rel_err(fout, out), 0.0);
  EXPECT_EQ(rel_err(flse, lse), 0.0);
  Tensor fdq(DType::kF32, q.shape()), fdk(DType::kF32, k.shape()), fdv(DType::kF32, v.shape());
  flex_attention_backward(dout, q, k, v, fout, flse, bm, mask_mod, so,
                          {fdq.view(), fdk.view(), fdv.view(), {}, {}, {}});
  EXPECT_EQ(rel_err(fdq, dq), 0.0);
  EXPECT_EQ(rel_err(fdk, dk), 0.0);
  EXPECT_EQ(rel_err(fdv, dv), 0.0);
}

// User callables: FlexAttention-style mask_mod and score_mod inlined by the template engine.
TEST(SparseAttention, TemplateEngineWithCallables) {
  const int64_t L = 100, D = 16;
  const Tensor q = randn({1, 2, L, D}, 1), k = randn({1, 2, L, D}, 2), v = randn({1, 2, L, D}, 3);
  const Pattern win = SlidingWindow(-1, 0);
  const BlockMask bm = win.block_mask(L, L, 2, 32);
  // Causal with the even keys only; score + 0.1 * h.
  auto mask_mod = [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i && j % 2 == 0; };
  struct HeadBias {
    bool identity() const { return false; }
    float operator()(float s, int64_t, int64_t h, int64_t, int64_t) const { return s + 0.1f * float(h); }
    float backward(float, float ds, int64_t, int64_t, int64_t, int64_t, float*) const { return ds; }
    int64_t num_params() const { return 0; }
  };
  // The block mask's full ranges claim all pairs allowed, but this mask_mod drops odd keys: use a block mask
  // whose ranges are all partial, as FlexAttention would for a mask it cannot prove full.
  BlockMask partial = bm;
  for (auto& r : partial.ranges) r.full = 0;
  Tensor out(DType::kF32, {1, 2, L, D});
  block_sparse_attention(q, k, v, partial, mask_mod, HeadBias{}, {}, out);
  Tensor dm(DType::kBool, {L, L});
  for (int64_t i = 0; i < L; ++i)
    for (int64_t j = 0; j < L; ++j) dm.data<uint8_t>()[i * L + j] = mask_mod(0, 0, i, j);
  AttentionOptions ro;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  ro.attn_mask = dm.view();
  Tensor rout(DType::kF64, {1, 2, L, D});
  scaled_dot_product_attention(q, k, v, ro, {rout.view(), {}, {}});  // a per-head constant does not change softmax
  EXPECT_LE(rel_err(out, rout), 2e-5);
}

TEST(SparseAttention, DeterministicAcrossThreadCounts) {
  // The second pattern runs the backward's one-pass form (forced), the first its two-pass form (global tokens).
  for (const char* spec :
       {"Neighborhood2D(16, 12, 5) | GlobalTokens([3], SlidingWindow(2, 2))", "Neighborhood2D(16, 12, 5)"}) {
    SCOPED_TRACE(spec);
    const Pattern p = Pattern::parse(spec);
    const sattn::testing::ScopedEnv env("SATTN_SPARSE_BACKWARD",
                                        std::string(spec) == "Neighborhood2D(16, 12, 5)" ? "one_pass" : "auto");
    const int64_t L = 192, D = 16;
    const Tensor q = randn({2, 4, L, D}, 1), k = randn({2, 2, L, D}, 2), v = randn({2, 2, L, D}, 3),
                 dout = randn({2, 4, L, D}, 4);
    Tensor outs[3], dqs[3], dks[3], dvs[3];
    for (int t = 0; t < 3; ++t) {
      SparseOptions so;
      so.num_threads = t + 1;
      outs[t] = Tensor(DType::kF32, {2, 4, L, D});
      Tensor lse(DType::kF32, {2, 4, L});
      sparse_attention(q, k, v, p, so, outs[t], lse);
      dqs[t] = Tensor(DType::kF32, q.shape());
      dks[t] = Tensor(DType::kF32, k.shape());
      dvs[t] = Tensor(DType::kF32, v.shape());
      sparse_attention_backward(dout, q, k, v, outs[t], lse, p, so,
                                {dqs[t].view(), dks[t].view(), dvs[t].view(), {}, {}, {}});
    }
    for (int t = 1; t < 3; ++t) {
      EXPECT_EQ(std::memcmp(outs[0].data(), outs[t].data(), outs[0].nbytes()), 0);
      EXPECT_EQ(std::memcmp(dqs[0].data(), dqs[t].data(), dqs[0].nbytes()), 0);
      EXPECT_EQ(std::memcmp(dks[0].data(), dks[t].data(), dks[0].nbytes()), 0);
      EXPECT_EQ(std::memcmp(dvs[0].data(), dvs[t].data(), dvs[0].nbytes()), 0);
    }
  }
}

// The one-pass backward walks runs of consecutive query blocks per work item (here runs of up to 5 Neighborhood2D
// tiles, and of sliding-window blocks): against the reference, and bitwise the same for 1, 2 and 3 threads.
TEST(SparseAttention, OnePassRunsMatchReferenceAndAreDeterministic) {
  run_case({"Neighborhood2D(40, 40, 7)", 2, 4, 4, 1600, 1600, 16, 16});
  run_case({"SlidingWindow(40, 40)", 2, 4, 2, 1100, 1100, 16, 16, 16});
  const Pattern p = Neighborhood2D(40, 40, 7);
  const int64_t L = 1600, D = 16;
  const Tensor q = randn({2, 4, L, D}, 5), k = randn({2, 4, L, D}, 6), v = randn({2, 4, L, D}, 7),
               dout = randn({2, 4, L, D}, 8);
  Tensor dqs[3], dks[3], dvs[3];
  for (int t = 0; t < 3; ++t) {
    SparseOptions so;
    so.num_threads = t + 1;
    Tensor out(DType::kF32, {2, 4, L, D}), lse(DType::kF32, {2, 4, L});
    sparse_attention(q, k, v, p, so, out, lse);
    dqs[t] = Tensor(DType::kF32, q.shape());
    dks[t] = Tensor(DType::kF32, k.shape());
    dvs[t] = Tensor(DType::kF32, v.shape());
    sparse_attention_backward(dout, q, k, v, out, lse, p, so,
                              {dqs[t].view(), dks[t].view(), dvs[t].view(), {}, {}, {}});
  }
  for (int t = 1; t < 3; ++t) {
    EXPECT_EQ(std::memcmp(dqs[0].data(), dqs[t].data(), dqs[0].nbytes()), 0);
    EXPECT_EQ(std::memcmp(dks[0].data(), dks[t].data(), dks[0].nbytes()), 0);
    EXPECT_EQ(std::memcmp(dvs[0].data(), dvs[t].data(), dvs[0].nbytes()), 0);
  }
}

// Packed inputs of 4 MiB and more come from the huge-page block cache; a second call reuses the freed blocks.
TEST(SparseAttention, LargeBuffersFromTheBlockCache) {
  const int64_t L = 16384, D = 64;
  const Pattern p = Pattern::parse("Dilated(3, 2)");  // residue layout: q/k/v are packed (permuted)
  const Tensor q = randn({1, 1, L, D}, 1), k = randn({1, 1, L, D}, 2), v = randn({1, 1, L, D}, 3),
               dout = randn({1, 1, L, D}, 4);
  Tensor out[2], lse[2], dq[2], dk[2], dv[2];
  for (int t = 0; t < 2; ++t) {
    SparseOptions so;
    out[t] = Tensor(DType::kF32, {1, 1, L, D});
    lse[t] = Tensor(DType::kF32, {1, 1, L});
    sparse_attention(q, k, v, p, so, out[t], lse[t]);
    dq[t] = Tensor(DType::kF32, q.shape());
    dk[t] = Tensor(DType::kF32, k.shape());
    dv[t] = Tensor(DType::kF32, v.shape());
    sparse_attention_backward(dout, q, k, v, out[t], lse[t], p, so,
                              {dq[t].view(), dk[t].view(), dv[t].view(), {}, {}, {}});
  }
  EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].nbytes()), 0);
  EXPECT_EQ(std::memcmp(dq[0].data(), dq[1].data(), dq[0].nbytes()), 0);
  EXPECT_EQ(std::memcmp(dk[0].data(), dk[1].data(), dk[0].nbytes()), 0);
  EXPECT_EQ(std::memcmp(dv[0].data(), dv[1].data(), dv[0].nbytes()), 0);
  // A few rows against the formula: keys j with |i - j| <= 6 and (i - j) even.
  const float *Q = q.data<float>(), *K = k.data<float>(), *V = v.data<float>(), *O = out[0].data<float>();
  for (int64_t i : {int64_t(0), int64_t(1), int64_t(7777), L - 2, L - 1}) {
    std::vector<double> w;
    std::vector<int64_t> js;
    double mx = -1e300;
    for (int64_t j = std::max<int64_t>(0, i - 6); j <= std::min(L - 1, i + 6); j += 1) {
      if ((i - j) % 2 != 0) continue;
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += double(Q[i * D + d]) * K[j * D + d];
      s /= std::sqrt(double(D));
      w.push_back(s);
      js.push_back(j);
      mx = std::max(mx, s);
    }
    double sum = 0;
    for (double& x : w) sum += (x = std::exp(x - mx));
    for (int64_t d = 0; d < D; ++d) {
      double o = 0;
      for (size_t x = 0; x < js.size(); ++x) o += w[x] / sum * V[js[x] * D + d];
      EXPECT_NEAR(O[i * D + d], o, 2e-5) << "row " << i;
    }
  }
}

TEST(SparseAttention, BadInputsGiveClearErrors) {
  const Tensor q = randn({1, 2, 16, 8}, 1), k = randn({1, 2, 16, 8}, 2), v = randn({1, 2, 16, 8}, 3);
  Tensor out(DType::kF32, {1, 2, 16, 8});
  SparseOptions so;
  auto msg = [&](auto&& f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(msg([&] { sparse_attention(q, k, v, Neighborhood2D(4, 5, 3), so, out); }).find("height * width"),
            std::string::npos);
  const Tensor k3 = randn({1, 1, 16, 8}, 2);
  so.enable_gqa = false;
  EXPECT_NE(msg([&] { sparse_attention(q, k3, k3, SlidingWindow(1, 1), so, out); }).find("enable_gqa"),
            std::string::npos);
  so.enable_gqa = true;
  Tensor bad_out(DType::kF32, {1, 2, 15, 8});
  EXPECT_NE(msg([&] { sparse_attention(q, k, v, SlidingWindow(1, 1), so, bad_out); }).find("out: expected shape"),
            std::string::npos);
  so.alibi_slopes = {1.0f};
  EXPECT_NE(msg([&] { sparse_attention(q, k, v, SlidingWindow(1, 1), so, out); }).find("alibi_slopes"),
            std::string::npos);
  so.alibi_slopes.clear();
  Tensor rel(DType::kF32, {9, 2});
  so.rel_pos_bias = rel.view();
  EXPECT_NE(msg([&] { sparse_attention(q, k, v, SlidingWindow(1, 1), so, out); }).find("WindowAttention2D"),
            std::string::npos);
  so.rel_pos_bias = {};
  BlockMask bm = SlidingWindow(1, 1).block_mask(16, 16);
  bm.ranges[0].end = 99;
  EXPECT_NE(msg([&] { block_sparse_attention(q, k, v, bm, {}, so, out); }).find("block_mask"), std::string::npos);
}

// float64 / bfloat16 inputs and strided (non-contiguous) views are packed per tile; the result equals the fp32
// kernel on the converted, contiguous inputs (bf16: up to its own rounding of the output).
TEST(SparseAttention, DtypesAndStridedViews) {
  const int64_t B = 1, H = 2, L = 70, D = 16;
  const Tensor q = randn({B, H, L, D}, 1), k = randn({B, H, L, D}, 2), v = randn({B, H, L, D}, 3);
  const Pattern p = Dilated(3, 2) | SlidingWindow(4, 0);
  SparseOptions so;
  Tensor out(DType::kF32, {B, H, L, D});
  sparse_attention(q, k, v, p, so, out);
  // float64 inputs and output.
  const Tensor q64 = q.to(DType::kF64), k64 = k.to(DType::kF64), v64 = v.to(DType::kF64);
  Tensor out64(DType::kF64, {B, H, L, D});
  sparse_attention(q64, k64, v64, p, so, out64);
  EXPECT_LE(rel_err(out64, out), 1e-6);
  // A strided view: q stored as [B, L, H, D] and viewed as [B, H, L, D].
  Tensor qt(DType::kF32, {B, L, H, D});
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < L; ++i)
      for (int64_t d = 0; d < D; ++d) qt.data<float>()[(i * H + h) * D + d] = q.data<float>()[(h * L + i) * D + d];
  const TensorView qv(qt.data(), DType::kF32, {B, H, L, D}, {L * H * D, D, H * D, 1});
  Tensor out_s(DType::kF32, {B, H, L, D});
  sparse_attention(qv, k, v, p, so, out_s);
  EXPECT_EQ(std::memcmp(out_s.data(), out.data(), out.nbytes()), 0);
  // bfloat16 inputs: equal to the fp32 kernel on the bf16-rounded inputs.
  const Tensor qb = q.to(DType::kBF16), kb = k.to(DType::kBF16), vb = v.to(DType::kBF16);
  Tensor out_b(DType::kF32, {B, H, L, D}), out_r(DType::kF32, {B, H, L, D});
  sparse_attention(qb, kb, vb, p, so, out_b);
  sparse_attention(qb.to(DType::kF32), kb.to(DType::kF32), vb.to(DType::kF32), p, so, out_r);
  EXPECT_EQ(std::memcmp(out_b.data(), out_r.data(), out_b.nbytes()), 0);
}
