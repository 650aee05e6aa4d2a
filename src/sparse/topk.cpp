// TopK(k): each query attends to its k best-scoring keys, found by the streaming SIMD scan of topk_scan.cpp.
#include "sparse/adaptive_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <vector>

#include <hwy/aligned_allocator.h>

#include "sparse/topk_scan.hpp"

namespace sattn::sparse {

namespace {
struct Cand {
  float s;
  int32_t j;   // original key index
  int32_t kp;  // layout position
};
// "a is better than b": higher score, ties to the lower key index (a strict total order on distinct keys).
inline bool better(const Cand& a, const Cand& b) { return a.s > b.s || (a.s == b.s && a.j < b.j); }

// Softmax and PV over a row's c kept keys (scores s, V rows vrow of vbase, key indices j ascending): O(c * Dv).
// Writes out, lse and the indices (-1 past c) of query row (b, h, i). vrow = j when keys are in their own order.
void topk_finish(const float* s, const int32_t* vrow, const int32_t* j, int64_t c, const float* vbase, int64_t Dv,
                 int64_t b, int64_t h, int64_t i, const TensorView& out, const TensorView& lse,
                 const TensorView& indices, int64_t K_out, std::vector<float>& o_row, std::vector<float>& w) {
  o_row.assign(size_t(Dv), 0.0f);
  w.resize(size_t(c));
  float mx = kNegInf;
  for (int64_t x = 0; x < c; ++x) mx = std::max(mx, s[x]);
  float sum = 0.0f;
  for (int64_t x = 0; x < c; ++x) {
    w[size_t(x)] = std::exp(s[x] - mx);
    sum += w[size_t(x)];
  }
  const float inv = c > 0 ? 1.0f / sum : 0.0f;
  for (int64_t x = 0; x < c; ++x) w[size_t(x)] *= inv;
  if (c > 0) topk::weighted_rows(w.data(), vrow, c, vbase, Dv, o_row.data());
  detail::store_row(out, b, h, i, o_row.data(), Dv);
  if (lse.data) detail::store_value(lse, b, h, i, c > 0 ? mx + std::log(sum) : kNegInf);
  if (indices.data)
    for (int64_t x = 0; x < K_out; ++x) idx_at(indices, b, h, i, x) = x < c ? j[x] : -1;
}

// TopK without a fixed pattern: keys packed once per (b, kv head) into SIMD tiles, the scoring pass of
// topk_scan.cpp per block of kQueryRows queries (scores in registers, only threshold survivors leave them),
// then softmax and PV over the k kept keys.
void topk_forward_full(const AttentionProblem& problem, const AdaptiveNode& a, const TensorView& q, const TensorView& k,
                       const TensorView& v, const SparseOptions& o, const TensorView& out, const TensorView& lse,
                       const TensorView& indices) {
  constexpr int64_t kQueryRows = 48;  // a query block: 48 x D floats stay in L1 beside one key tile
  const BlockMask ident = Full().block_mask(problem.len_q, problem.len_k, 1, o.block);  // identity layout
  detail::Packed p = detail::pack_inputs(problem, q, k, v, ident, o);
  detail::check_outputs(p, out, lse);
  const int64_t K_out = a.k, K = std::min(a.k, p.Lk());
  if (indices.data) check_indices(indices, {p.B(), p.Hq(), p.Lq(), K_out}, "[B, Hq, Lq, k]");
  const int64_t D = p.D(), Dv = p.Dv(), group = p.group(), W = topk::tile_width(), lk_pad = (p.Lk() + W - 1) / W * W;
  // Packed key tiles of every (b, kv head): as many floats as K itself (plus padding to W keys).
  auto kp = hwy::AllocateAligned<float>(size_t(std::max<int64_t>(1, p.B() * p.Hkv() * lk_pad * D)));
  check(kp != nullptr, ErrorKind::kOutOfMemory, "TopK: cannot allocate the packed keys");
  auto pack = [&](int64_t bh) {
    topk::pack_keys(&p.k[size_t(bh * p.Lk() * D)], p.Lk(), D, D, kp.get() + bh * lk_pad * D);
  };
  detail::parallel(p.B() * p.Hkv(), p.threads, pack);
  // Key padding as an additive bias per batch entry (0 or -inf; -inf past Lk up to the last tile's end).
  hwy::AlignedFreeUniquePtr<float[]> kbias;
  if (!p.key_valid.empty()) {
    kbias = hwy::AllocateAligned<float>(size_t(p.B() * lk_pad));
    check(kbias != nullptr, ErrorKind::kOutOfMemory, "TopK: cannot allocate the key padding bias");
    for (int64_t b = 0; b < p.B(); ++b)
      for (int64_t j = 0; j < lk_pad; ++j)
        kbias[size_t(b * lk_pad + j)] = j < p.Lk() && p.key_valid[size_t(b * p.Lk() + j)] ? 0.0f : kNegInf;
  }
  const int64_t nqb = (p.Lq() + kQueryRows - 1) / kQueryRows;
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq(), h = bh % p.Hq(), hk = h / group;
    const int64_t q0 = qb * kQueryRows, m = std::min(kQueryRows, p.Lq() - q0);
    const int64_t stride = topk::row_stride(K, p.Lk());
    thread_local std::vector<float> cs, thr, tmp, o_row, w;
    thread_local std::vector<int32_t> cj;
    thread_local std::vector<int64_t> cnt;
    cs.resize(size_t(m * stride));
    cj.resize(size_t(m * stride));
    tmp.resize(size_t(stride));
    cnt.assign(size_t(m), 0);
    thr.assign(size_t(m), kNegInf);
    topk::scan(&p.q[size_t(((b * p.Hq() + h) * p.Lq() + q0) * D)], m, D, kp.get() + (b * p.Hkv() + hk) * lk_pad * D,
               p.Lk(), p.scale, kbias ? kbias.get() + b * lk_pad : nullptr, K, cs.data(), cj.data(), cnt.data(),
               thr.data(), tmp.data());
    const float* vbase = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
    for (int64_t r = 0; r < m; ++r)
      topk_finish(&cs[size_t(r * stride)], &cj[size_t(r * stride)], &cj[size_t(r * stride)], cnt[size_t(r)], vbase, Dv,
                  b, h, q0 + r, out, lse, indices, K_out, o_row, w);
  };
  detail::parallel(p.B() * p.Hq() * nqb, p.threads, item);
}

}  // namespace

void topk_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& q,
                  const TensorView& k, const TensorView& v, const SparseOptions& o, const TensorView& out,
                  const TensorView& lse, const TensorView& indices) {
  if (!fixed.defined()) return topk_forward_full(problem, a, q, k, v, o, out, lse, indices);
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const BlockMask bm = fixed_block_mask(fixed, lq, lk, problem.heads_q, o.block);
  detail::Packed p = detail::pack_inputs(problem, q, k, v, bm, o);
  detail::check_outputs(p, out, lse);
  const int64_t K_out = a.k, K = std::min(a.k, p.Lk());  // at most Lk keys can be kept
  if (indices.data) check_indices(indices, {p.B(), p.Hq(), p.Lq(), K_out}, "[B, Hq, Lq, k]");
  const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, lq, lk};
  const int64_t nqb = bm.num_q_blocks(), D = p.D(), Dv = p.Dv(), group = p.group();
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq(), h = bh % p.Hq(), hk = h / group;
    const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
    thread_local detail::Scratch sc;
    thread_local std::vector<Cand> heap;
    thread_local std::vector<int64_t> cnt;
    sc.ensure(m, D, Dv);
    thread_local std::vector<float> thr_row;
    heap.resize(size_t(m * 2 * K));
    cnt.assign(size_t(m), 0);
    thr_row.assign(size_t(m), kNegInf);
    const float* qt = &p.q[size_t(((b * p.Hq() + h) * p.Lq() + q0) * D)];
    const float* kbase = &p.k[size_t((b * p.Hkv() + hk) * p.Lk() * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
    const int64_t row = bm.slot(h) * nqb + qb;
    // Scoring pass: streaming top-k per row, never materialising the row: scores at or above the row's threshold
    // (the worst kept score; -inf until 2k candidates were seen) are appended to a 2k buffer; when it is full,
    // nth_element keeps the best k (higher score, ties to the lower key index: a strict total order, so the result
    // does not depend on when compactions happen) and raises the threshold.
    detail::for_each_chunk(&bm.ranges[size_t(bm.row_ptr[row])], bm.row_ptr[row + 1] - bm.row_ptr[row],
                           [&](const detail::Segment* segs, int64_t nseg, int64_t n) {
                             detail::gather_chunk(segs, nseg, n, kbase, vbase, D, Dv, sc, false, nullptr, false);
                             tiles::qk(qt, m, D, sc.kt.data(), n, n, p.scale, sc.s.data());
                             detail::mod_and_mask(sc.s.data(), nullptr, m, n, segs, nseg, bm, q0, b, h, p, fm,
                                                  NoScoreMod{});
                             for (int64_t r = 0; r < m; ++r) {
                               Cand* hp = &heap[size_t(r * 2 * K)];
                               int64_t& c = cnt[size_t(r)];
                               float& thr = thr_row[size_t(r)];
                               for (int64_t x = 0; x < nseg; ++x) {
                                 const float* srow = &sc.s[size_t(r * n + segs[x].col)] - segs[x].begin;
                                 for (int32_t kp = segs[x].begin; kp < segs[x].end; ++kp) {
                                   const float s = srow[kp];
                                   if (s < thr || s == kNegInf) continue;  // one compare for most scores
                                   hp[c++] = Cand{s, bm.k_index(kp), kp};
                                   if (c == 2 * K) {  // keep the best K of the 2K, raise the threshold
                                     std::nth_element(hp, hp + (K - 1), hp + 2 * K, better);
                                     c = K;
                                     thr = hp[K - 1].s;
                                   }
                                 }
                               }
                             }
                           });
    for (int64_t r = 0; r < m; ++r)
      if (cnt[size_t(r)] > K) {
        Cand* hp = &heap[size_t(r * 2 * K)];
        std::nth_element(hp, hp + (K - 1), hp + cnt[size_t(r)], better);
        cnt[size_t(r)] = K;
      }
    // Softmax and PV over the k kept keys (ascending key index): O(k * Dv) per row.
    thread_local std::vector<float> ks, o_row, w;
    thread_local std::vector<int32_t> kv, kj;
    for (int64_t r = 0; r < m; ++r) {
      Cand* hp = &heap[size_t(r * 2 * K)];
      const int64_t c = cnt[size_t(r)];
      std::sort(hp, hp + c, [](const Cand& x, const Cand& y) { return x.j < y.j; });
      ks.resize(size_t(c));
      kv.resize(size_t(c));
      kj.resize(size_t(c));
      for (int64_t x = 0; x < c; ++x) ks[size_t(x)] = hp[x].s, kv[size_t(x)] = hp[x].kp, kj[size_t(x)] = hp[x].j;
      topk_finish(ks.data(), kv.data(), kj.data(), c, vbase, Dv, b, h, bm.q_index(q0 + r), out, lse, indices, K_out,
                  o_row, w);
    }
  };
  detail::parallel(p.B() * p.Hq() * nqb, p.threads, item);
}

void topk_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& dout,
                   const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& lse,
                   const SparseOptions& o, const SparseGrads& g, const TensorView& indices_in) {
  const int64_t B = problem.batch, hq = problem.heads_q, lq = problem.len_q, lk = problem.len_k;
  // The selection: the given indices, or recomputed (deterministically) by the forward pass, with at most Lk
  // columns (a k beyond Lk keeps every allowed key, as k = Lk does).
  const int64_t K = indices_in.data ? a.k : std::min(a.k, lk);
  Tensor idx_t, out_t, lse_t;
  TensorView indices = indices_in;
  if (!indices.data) {
    AdaptiveNode at_most_lk = a;
    at_most_lk.k = K;
    idx_t = Tensor(DType::kI64, {B, hq, lq, K});
    out_t = Tensor(DType::kF32, {B, hq, lq, problem.head_dim_v});
    lse_t = Tensor(DType::kF32, {B, hq, lq});
    topk_forward(problem, at_most_lk, fixed, q, k, v, o, out_t, lse_t, idx_t);
    indices = idx_t.view();
  }
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);  // identity layout for packing
  detail::Packed p = detail::pack_inputs(problem, q, k, v, ident, o);
  detail::check_grads(p, q, k, v, g.dq, g.dk, g.dv);
  check_indices(indices, {p.B(), p.Hq(), p.Lq(), K}, "[B, Hq, Lq, k]");
  check(dout.shape == Shape{p.B(), p.Hq(), p.Lq(), p.Dv()}, ErrorKind::kInvalidArgument, "dout: expected shape ",
        shape_text({p.B(), p.Hq(), p.Lq(), p.Dv()}), ", got ", shape_text(dout.shape));
  check(lse.data && lse.shape == Shape{p.B(), p.Hq(), p.Lq()}, ErrorKind::kInvalidArgument, "lse: expected shape ",
        shape_text({p.B(), p.Hq(), p.Lq()}));
  detail::pack_backward(p, ident, dout, dout, lse);  // packs dout and lse (delta unused here)
  const int64_t D = p.D(), Dv = p.Dv(), group = p.group();
  for (int64_t b = 0; b < p.B(); ++b)
    for (int64_t h = 0; h < p.Hq(); ++h)
      for (int64_t i = 0; i < p.Lq(); ++i)
        for (int64_t x = 0; x < K; ++x) {
          const int64_t j = idx_at(indices, b, h, i, x);
          check(j >= -1 && j < p.Lk(), ErrorKind::kInvalidArgument, "indices: key index ", j, " out of range [-1, ",
                p.Lk(), ")");
        }
  // One item per (b, kv head): owns dK/dV of that head and dQ of its query heads (deterministic).
  auto item = [&](int64_t it) {
    const int64_t b = it / p.Hkv(), hk = it % p.Hkv();
    std::vector<float> dk(static_cast<size_t>(p.Lk() * D), 0.0f), dv(static_cast<size_t>(p.Lk() * Dv), 0.0f),
        dq(static_cast<size_t>(D)), pr(static_cast<size_t>(K)), dp(static_cast<size_t>(K));
    const float* kb = &p.k[size_t((b * p.Hkv() + hk) * p.Lk() * D)];
    const float* vb = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
      for (int64_t i = 0; i < p.Lq(); ++i) {
        const size_t row = size_t((b * p.Hq() + h) * p.Lq() + i);
        const float* qi = &p.q[row * D];
        const float* doi = &p.dout[row * Dv];
        const float l = p.lse[row];
        std::fill(dq.begin(), dq.end(), 0.0f);
        float delta = 0.0f;
        for (int64_t x = 0; x < K; ++x) {
          const int64_t j = idx_at(indices, b, h, i, x);
          pr[size_t(x)] = dp[size_t(x)] = 0.0f;
          if (j < 0 || l == kNegInf) continue;
          float s = 0.0f, d2 = 0.0f;
          for (int64_t d = 0; d < D; ++d) s += qi[d] * kb[j * D + d];
          for (int64_t d = 0; d < Dv; ++d) d2 += doi[d] * vb[j * Dv + d];
          pr[size_t(x)] = std::exp(p.scale * s - l);
          dp[size_t(x)] = d2;
          delta += pr[size_t(x)] * d2;
        }
        for (int64_t x = 0; x < K; ++x) {
          const int64_t j = idx_at(indices, b, h, i, x);
          if (j < 0 || pr[size_t(x)] == 0.0f) continue;
          const float ds = pr[size_t(x)] * (dp[size_t(x)] - delta) * p.scale;
          for (int64_t d = 0; d < D; ++d) {
            dq[size_t(d)] += ds * kb[j * D + d];
            dk[size_t(j * D + d)] += ds * qi[d];
          }
          for (int64_t d = 0; d < Dv; ++d) dv[size_t(j * Dv + d)] += pr[size_t(x)] * doi[d];
        }
        detail::store_row(g.dq, b, h, i, dq.data(), D);
      }
    for (int64_t j = 0; j < p.Lk(); ++j) {
      detail::store_row(g.dk, b, hk, j, &dk[size_t(j * D)], D);
      detail::store_row(g.dv, b, hk, j, &dv[size_t(j * Dv)], Dv);
    }
  };
  detail::parallel(p.B() * p.Hkv(), p.threads, item);
}

}  // namespace sattn::sparse
