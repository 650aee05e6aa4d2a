// TopK's streaming SIMD scoring pass (src/sparse/topk_scan.cpp) and BlockTopK's block selection on inputs large
// enough that the per-row candidate buffers fill and shrink many times: the selection is a valid top-k of the
// fp64 scores (exact with ties to the lower index when scores tie), the outputs match the reference on the
// selection's mask, results do not depend on the thread count or on the SIMD target.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "sattn/attention.hpp"
#include "sattn/sparse.hpp"
#include "scoped.hpp"
#include "sparse/topk_scan.hpp"
#include "sparse_test_util.hpp"

using namespace sattn;
using namespace sattn::sparse;
using sattn::sparse_test::randn;
using sattn::sparse_test::rel_err;

namespace {

struct Case {
  int64_t B, H, Hk, Lq, Lk, D, K, valid;  // valid: keys [0, valid) usable (key_lengths), = Lk: no padding
};

struct Result {
  Tensor out, lse, idx;
};

Result run_topk(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v, int threads) {
  SparseOptions so;
  so.num_threads = threads;
  Tensor lengths(DType::kI64, {c.B});
  if (c.valid < c.Lk) {
    for (int64_t b = 0; b < c.B; ++b) lengths.data<int64_t>()[b] = c.valid;
    so.key_lengths = lengths.view();
  }
  Result r{Tensor(DType::kF32, {c.B, c.H, c.Lq, v.size(3)}), Tensor(DType::kF32, {c.B, c.H, c.Lq}),
           Tensor(DType::kI64, {c.B, c.H, c.Lq, c.K})};
  sparse_attention(q, k, v, TopK(c.K), so, r.out, r.lse, r.idx);
  return r;
}

// fp64 scores of row (b, h, i) against every key.
std::vector<double> row_scores(const Tensor& q, const Tensor& k, int64_t b, int64_t h, int64_t i) {
  const int64_t H = q.size(1), Lq = q.size(2), D = q.size(3), Hk = k.size(1), Lk = k.size(2), hk = h / (H / Hk);
  std::vector<double> s(static_cast<size_t>(Lk));
  for (int64_t j = 0; j < Lk; ++j) {
    double d = 0;
    for (int64_t x = 0; x < D; ++x)
      d += double(q.data<float>()[((b * H + h) * Lq + i) * D + x]) * k.data<float>()[((b * Hk + hk) * Lk + j) * D + x];
    s[size_t(j)] = d / std::sqrt(double(D));
  }
  return s;
}

// Valid top-k of the fp64 scores within 1e-5; `exact`: the selection must equal the fp64 order with ties to the
// lower index (for inputs whose distinct scores are far apart).
void check_selection(const Case& c, const Tensor& q, const Tensor& k, const Tensor& idx, bool exact) {
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.Lq; ++i) {
        const std::vector<double> s = row_scores(q, k, b, h, i);
        std::vector<int64_t> chosen;
        for (int64_t x = 0; x < c.K; ++x)
          if (const int64_t j = idx.data<int64_t>()[((b * c.H + h) * c.Lq + i) * c.K + x]; j >= 0) chosen.push_back(j);
        ASSERT_TRUE(std::is_sorted(chosen.begin(), chosen.end()));
        ASSERT_EQ(int64_t(chosen.size()), std::min(c.K, c.valid));
        double min_chosen = INFINITY, max_other = -INFINITY;
        for (int64_t j = 0; j < c.valid; ++j) {
          if (std::binary_search(chosen.begin(), chosen.end(), j)) min_chosen = std::min(min_chosen, s[size_t(j)]);
          else max_other = std::max(max_other, s[size_t(j)]);
        }
        ASSERT_TRUE(chosen.empty() || chosen.back() < c.valid) << "selected a padding key";
        ASSERT_GE(min_chosen, max_other - 1e-5) << "not a top-k: b=" << b << " h=" << h << " i=" << i;
        if (exact) {
          std::vector<int64_t> order(static_cast<size_t>(c.valid));
          for (int64_t j = 0; j < c.valid; ++j) order[size_t(j)] = j;
          std::stable_sort(order.begin(), order.end(),
                           [&](int64_t x, int64_t y) { return s[size_t(x)] > s[size_t(y)]; });
          order.resize(size_t(std::min(c.K, c.valid)));
          std::sort(order.begin(), order.end());
          ASSERT_EQ(chosen, order) << "ties must go to the lower index: i=" << i;
        }
      }
}

// Forward against the fp64 reference on the selection's mask.
void check_outputs(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v, const Result& r) {
  const Tensor mask = selection_mask(TopK(c.K), r.idx, c.Lq, c.Lk);
  AttentionOptions ro;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  ro.attn_mask = mask.view();
  Tensor rout(DType::kF64, r.out.shape()), rlse(DType::kF64, r.lse.shape());
  scaled_dot_product_attention(q, k, v, ro, {rout.view(), rlse.view(), {}});
  EXPECT_LE(rel_err(r.out, rout), 2e-5);
  EXPECT_LE(rel_err(r.lse, rlse), 2e-5);
}

bool same(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::equal(static_cast<const char*>(a.view().data),
                    static_cast<const char*>(a.view().data) + a.numel() * int64_t(dtype_size(a.dtype())),
                    static_cast<const char*>(b.view().data));
}

}  // namespace

TEST(SparseTopKScan, StreamingSelectionIsTopKAndMatchesReference) {
  // Rows of 1..6 (register-tile tails), keys past whole tiles, buffers that fill and shrink many times (Lk >> k),
  // k = 1, k >= Lk, key padding, GQA, Lq != Lk, odd D.
  for (const Case& c : std::vector<Case>{{1, 2, 1, 53, 700, 16, 5, 700},
                                         {2, 2, 2, 19, 1000, 13, 16, 1000},
                                         {1, 3, 1, 40, 300, 8, 1, 300},
                                         {1, 1, 1, 9, 30, 8, 64, 30},
                                         {1, 2, 1, 31, 517, 24, 12, 470},
                                         {2, 1, 1, 7, 200, 8, 250, 150}}) {
    SCOPED_TRACE(::testing::Message() << "Lq=" << c.Lq << " Lk=" << c.Lk << " K=" << c.K << " valid=" << c.valid);
    const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 11), k = randn({c.B, c.Hk, c.Lk, c.D}, 12),
                 v = randn({c.B, c.Hk, c.Lk, c.D}, 13);
    const Result r = run_topk(c, q, k, v, 2);
    check_selection(c, q, k, r.idx, false);
    check_outputs(c, q, k, v, r);
  }
}

TEST(SparseTopKScan, TiesGoToTheLowerIndexWhileStreaming) {
  // Keys drawn from 6 distinct vectors: every score ties with many others, across shrinks of the buffers.
  const Case c{1, 2, 1, 20, 900, 8, 37, 900};
  const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 21), base = randn({6, c.D}, 22);
  Tensor k(DType::kF32, {c.B, c.Hk, c.Lk, c.D});
  std::mt19937_64 g(23);
  for (int64_t j = 0; j < c.Lk; ++j) {
    const int64_t pick = int64_t(g() % 6);
    for (int64_t x = 0; x < c.D; ++x) k.data<float>()[j * c.D + x] = base.data<float>()[pick * c.D + x];
  }
  const Tensor v = randn({c.B, c.Hk, c.Lk, c.D}, 24);
  const Result r = run_topk(c, q, k, v, 1);
  check_selection(c, q, k, r.idx, true);
  check_outputs(c, q, k, v, r);
}

TEST(SparseTopKScan, SameResultsForAnyThreadCount) {
  const Case c{1, 3, 1, 100, 400, 16, 9, 380};
  const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 31), k = randn({c.B, c.Hk, c.Lk, c.D}, 32),
               v = randn({c.B, c.Hk, c.Lk, c.D}, 33);
  const Result r1 = run_topk(c, q, k, v, 1);
  for (int threads : {2, 3}) {
    const Result r = run_topk(c, q, k, v, threads);
    EXPECT_TRUE(same(r.out, r1.out)) << threads;
    EXPECT_TRUE(same(r.lse, r1.lse)) << threads;
    EXPECT_TRUE(same(r.idx, r1.idx)) << threads;
  }
}

TEST(SparseTopKScan, EverySimdTargetSelectsATopK) {
  const Case c{1, 2, 1, 25, 333, 16, 7, 320};
  const Tensor q = randn({c.B, c.H, c.Lq, c.D}, 41), k = randn({c.B, c.Hk, c.Lk, c.D}, 42),
               v = randn({c.B, c.Hk, c.Lk, c.D}, 43);
  int tested = 0;
  for (const std::string& target : sattn::testing::simd_target_names()) {
    const sattn::testing::ScopedSimdTarget scoped(target);
    SCOPED_TRACE(::testing::Message() << "target " << target << ", tile " << topk::tile_width());
    EXPECT_EQ(topk::simd_build(),
              target == "avx512bf16" || target == "amx" ? "avx512" : target);  // no bf16 build: its avx512 one
    // Tiles of kNV vectors (simd/blocking.inc): 4 x 16 floats, 2 x 8, 2 x 4; portable 4 x 4 (Highway's EMU128)
    // or 4 x 1 (SCALAR, what Highway builds with GCC before 12.3).
    if (target == "portable") {
      EXPECT_TRUE(topk::tile_width() == 16 || topk::tile_width() == 4);
    } else {
      EXPECT_EQ(topk::tile_width(), target.rfind("avx512", 0) == 0 || target == "amx" ? 64 : target == "avx2" ? 16 : 8);
    }
    const Result r = run_topk(c, q, k, v, 1);
    check_selection(c, q, k, r.idx, false);
    check_outputs(c, q, k, v, r);
    ++tested;
  }
  EXPECT_GE(tested, 2);
}

TEST(SparseTopKScan, BlockTopKSameSelectionForAnyThreadCount) {
  const Tensor q = randn({1, 4, 333, 8}, 51), k = randn({1, 2, 333, 8}, 52), v = randn({1, 2, 333, 8}, 53);
  for (const char* spec : {"BlockTopK(4, 5)", "BlockTopK(4, 3, causal=True)", "BlockTopK(4, 4, local=False)"}) {
    SCOPED_TRACE(spec);
    const Pattern p = Pattern::parse(spec);
    const Shape ishape = selection_shape(p, 1, 4, 333, 333);
    Tensor ref_out, ref_idx;
    for (int threads : {1, 2, 3}) {
      SparseOptions so;
      so.num_threads = threads;
      Tensor out(DType::kF32, {1, 4, 333, 8}), idx(DType::kI64, ishape);
      sparse_attention(q, k, v, p, so, out, {}, idx);
      if (threads == 1) {
        ref_out = std::move(out);
        ref_idx = std::move(idx);
        continue;
      }
      EXPECT_TRUE(same(out, ref_out)) << threads;
      EXPECT_TRUE(same(idx, ref_idx)) << threads;
    }
  }
}

TEST(SparseTopKScan, BlockTopKTiedBlockScoresGoToTheLowerBlock) {
  // Key blocks repeat with period 3 (identical block means: exactly tied fp64 block scores); queries random.
  const int64_t L = 256, blk = 8, D = 8, nkb = L / blk, KB = 6;
  const Tensor q = randn({1, 1, L, D}, 61), base = randn({1, 1, 3 * blk, D}, 62), v = randn({1, 1, L, D}, 63);
  Tensor k(DType::kF32, {1, 1, L, D});
  for (int64_t j = 0; j < L; ++j)
    for (int64_t x = 0; x < D; ++x)
      k.data<float>()[j * D + x] = base.data<float>()[((j / blk) % 3 * blk + j % blk) * D + x];
  const Pattern p = BlockTopK(blk, KB, false);
  const int64_t nqb = selection_shape(p, 1, 1, L, L)[2];
  Tensor out(DType::kF32, {1, 1, L, D}), idx(DType::kI64, {1, 1, nqb, KB});
  sparse_attention(q, k, v, p, {}, out, {}, idx);
  for (int64_t qb = 0; qb < nqb; ++qb) {
    std::vector<double> qm(static_cast<size_t>(D), 0.0), score(static_cast<size_t>(nkb), 0.0);
    for (int64_t i = qb * blk; i < (qb + 1) * blk; ++i)
      for (int64_t x = 0; x < D; ++x) qm[size_t(x)] += q.data<float>()[i * D + x] / double(blk);
    for (int64_t kb = 0; kb < nkb; ++kb)
      for (int64_t x = 0; x < D; ++x) {
        double km = 0;
        for (int64_t j = kb * blk; j < (kb + 1) * blk; ++j) km += k.data<float>()[j * D + x];
        score[size_t(kb)] += qm[size_t(x)] * km / double(blk);
      }
    std::vector<int64_t> order(static_cast<size_t>(nkb));
    for (int64_t kb = 0; kb < nkb; ++kb) order[size_t(kb)] = kb;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t x, int64_t y) { return score[size_t(x)] > score[size_t(y)]; });
    order.resize(size_t(KB));
    std::sort(order.begin(), order.end());
    const std::vector<int64_t> got(idx.data<int64_t>() + qb * KB, idx.data<int64_t>() + (qb + 1) * KB);
    EXPECT_EQ(got, order) << "qb=" << qb;
  }
}

TEST(SparseTopKScan, BlockTopKWithKeyPaddingMatchesReference) {
  // Lq != Lk (bottom-right aligned blocks), GQA, keys [64, 77) padding: block 8 (keys 64..71) is fully masked and
  // never a candidate, block 9 (72..76) too; the local block of the last query blocks is then not chosen.
  const int64_t B = 2, H = 2, Hk = 1, Lq = 50, Lk = 77, D = 8, valid = 64;
  const Tensor q = randn({B, H, Lq, D}, 71), k = randn({B, Hk, Lk, D}, 72), v = randn({B, Hk, Lk, D}, 73);
  Tensor lengths(DType::kI64, {B});
  for (int64_t b = 0; b < B; ++b) lengths.data<int64_t>()[b] = valid - 5 * b;  // 64 and 59: one partial block
  for (const char* spec : {"BlockTopK(8, 3)", "BlockTopK(8, 3, causal=True)", "BlockTopK(8, 2, local=False)"}) {
    SCOPED_TRACE(spec);
    const Pattern p = Pattern::parse(spec);
    const Shape ishape = selection_shape(p, B, H, Lq, Lk);
    SparseOptions so;
    so.key_lengths = lengths.view();
    Tensor out(DType::kF32, {B, H, Lq, D}), lse(DType::kF32, {B, H, Lq}), idx(DType::kI64, ishape);
    sparse_attention(q, k, v, p, so, out, lse, idx);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t x = 0; x < H * ishape[2] * ishape[3]; ++x) {
        const int64_t kb = idx.data<int64_t>()[b * H * ishape[2] * ishape[3] + x];
        EXPECT_TRUE(kb < 0 || kb * 8 < lengths.data<int64_t>()[b]) << "a fully padded key block was chosen";
      }
    // Per batch entry (the selection mask has no batch axis).
    for (int64_t b = 0; b < B; ++b) {
      auto slice = [&](const Tensor& t, DType dt) {
        Shape s = t.shape();
        s[0] = 1;
        Tensor r(dt, s);
        const int64_t n = r.numel();
        if (dt == DType::kI64) std::copy_n(t.data<int64_t>() + b * n, n, r.data<int64_t>());
        else std::copy_n(t.data<float>() + b * n, n, r.data<float>());
        return r;
      };
      const Tensor qb = slice(q, DType::kF32), kb = slice(k, DType::kF32), vb = slice(v, DType::kF32);
      const Tensor ob = slice(out, DType::kF32), lb = slice(lse, DType::kF32), ib = slice(idx, DType::kI64);
      Tensor len1(DType::kI64, {1});
      len1.data<int64_t>()[0] = lengths.data<int64_t>()[b];
      const Tensor mask = selection_mask(p, ib, Lq, Lk);
      AttentionOptions ro;
      ro.kernel = "reference";
      ro.accumulate_fp64 = true;
      ro.attn_mask = mask.view();
      ro.key_lengths = len1.view();
      Tensor rout(DType::kF64, ob.shape()), rlse(DType::kF64, lb.shape());
      scaled_dot_product_attention(qb, kb, vb, ro, {rout.view(), rlse.view(), {}});
      EXPECT_LE(rel_err(ob, rout), 2e-5) << "b=" << b;
      EXPECT_LE(rel_err(lb, rlse), 2e-5) << "b=" << b;
    }
  }
}
