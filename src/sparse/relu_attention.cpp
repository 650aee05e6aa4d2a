// ReLUAttention(power, normalize): weights relu(s)^power, optionally normalised by their row sum, instead of a
// softmax; MixedAttention(logits): a learned mix w1 · softmax attention + w2 · ReLU attention (w = softmax(logits)).
#include "sparse/adaptive_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <vector>

#include <hwy/aligned_allocator.h>

namespace sattn::sparse {

namespace {
inline float relu_pow(float s, double power) {
  if (!(s > 0.0f)) return 0.0f;
  return power == 2.0 ? s * s : power == 1.0 ? s : float(std::pow(double(s), power));
}
inline float relu_pow_grad(float s, double power) {  // d/ds relu(s)^power
  if (!(s > 0.0f)) return 0.0f;
  return power == 2.0 ? 2.0f * s : power == 1.0 ? 1.0f : float(power * std::pow(double(s), power - 1.0));
}

// out (fp32, [B, Hq, Lq, Dv] dense) of ReLU attention; also the per-row normaliser Z ([B, Hq, Lq]; 1 for "none").
void relu_forward(double power, int normalize, const Pattern& fixed, const AttentionProblem& problem,
                  const TensorView& q, const TensorView& k, const TensorView& v, const SparseOptions& o,
                  std::vector<float>& out, std::vector<float>& z) {
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const BlockMask bm = fixed_block_mask(fixed, lq, lk, problem.heads_q, o.block);
  const detail::Packed p = detail::pack_inputs(problem, q, k, v, bm, o);
  const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, lq, lk};
  const int64_t nqb = bm.num_q_blocks(), D = p.D(), Dv = p.Dv(), group = p.group();
  out.assign(size_t(p.B() * p.Hq() * p.Lq() * Dv), 0.0f);
  z.assign(size_t(p.B() * p.Hq() * p.Lq()), 1.0f);
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq(), h = bh % p.Hq(), hk = h / group;
    const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
    thread_local detail::Scratch sc;
    sc.ensure(m, D, Dv);
    const float* qt = &p.q[size_t(((b * p.Hq() + h) * p.Lq() + q0) * D)];
    const float* kbase = &p.k[size_t((b * p.Hkv() + hk) * p.Lk() * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
    std::fill_n(sc.acc.data(), m * Dv, 0.0f);
    std::fill_n(sc.sum.data(), m, 0.0f);
    std::vector<int64_t> count(static_cast<size_t>(m), 0);
    const int64_t row = bm.slot(h) * nqb + qb;
    detail::for_each_chunk(&bm.ranges[size_t(bm.row_ptr[row])], bm.row_ptr[row + 1] - bm.row_ptr[row],
                           [&](const detail::Segment* segs, int64_t nseg, int64_t n) {
                             const float* vp =
                                 detail::gather_chunk(segs, nseg, n, kbase, vbase, D, Dv, sc, false, nullptr, false);
                             float* s = sc.s.data();
                             tiles::qk(qt, m, D, sc.kt.data(), n, n, p.scale, s);
                             detail::mod_and_mask(s, nullptr, m, n, segs, nseg, bm, q0, b, h, p, fm, NoScoreMod{});
                             for (int64_t r = 0; r < m; ++r)
                               for (int64_t c = 0; c < n; ++c) {
                                 float& x = s[r * n + c];
                                 count[size_t(r)] += x != kNegInf;
                                 x = relu_pow(x, power);
                                 sc.sum[r] += x;
                               }
                             tiles::pv(s, m, n, vp, Dv, Dv, 1.0f, sc.acc.data());
                           });
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = bm.q_index(q0 + r);
      const size_t orow = size_t((b * p.Hq() + h) * p.Lq() + i);
      float zr = 1.0f;
      if (normalize == 1) zr = sc.sum[r];
      if (normalize == 2) zr = float(count[size_t(r)]);
      z[orow] = zr;
      const float inv = normalize == 0 ? 1.0f : (zr > 0.0f ? 1.0f / zr : 0.0f);
      for (int64_t d = 0; d < Dv; ++d) out[orow * Dv + d] = sc.acc[size_t(r * Dv + d)] * inv;
    }
  };
  detail::parallel(p.B() * p.Hq() * nqb, p.threads, item);
}

// Adds the gradients of ReLU attention (given its out and Z) into dq/dk/dv (fp32 dense buffers).
void relu_backward(double power, int normalize, const Pattern& fixed, const AttentionProblem& problem,
                   const TensorView& q, const TensorView& k, const TensorView& v, const std::vector<float>& dout,
                   const std::vector<float>& out, const std::vector<float>& z, const SparseOptions& o,
                   std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv) {
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const BlockMask bm = fixed_block_mask(fixed, lq, lk, problem.heads_q, o.block);
  const detail::Packed p = detail::pack_inputs(problem, q, k, v, bm, o);
  const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, lq, lk};
  const int64_t nqb = bm.num_q_blocks(), D = p.D(), Dv = p.Dv(), group = p.group();
  // One item per (b, kv head): serial over its query heads and blocks; owns dK/dV rows of that head.
  auto item = [&](int64_t it) {
    const int64_t b = it / p.Hkv(), hk = it % p.Hkv();
    detail::Scratch sc;
    std::vector<float> dkl(static_cast<size_t>(p.Lk() * D), 0.0f), dvl(static_cast<size_t>(p.Lk() * Dv), 0.0f);
    const float* kbase = &p.k[size_t((b * p.Hkv() + hk) * p.Lk() * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h)
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
        sc.ensure(m, D, Dv);
        const float* qt = &p.q[size_t(((b * p.Hq() + h) * p.Lq() + q0) * D)];
        // Per row: dO_i / Z_i (in layout order), delta_i = dO_i·out_i / Z_i for "sum".
        std::vector<float> gz(static_cast<size_t>(m * Dv)), delta(static_cast<size_t>(m), 0.0f),
            dqt(static_cast<size_t>(m * D), 0.0f);
        for (int64_t r = 0; r < m; ++r) {
          const size_t orow = size_t((b * p.Hq() + h) * p.Lq() + bm.q_index(q0 + r));
          const float zr = z[orow], inv = normalize == 0 ? 1.0f : (zr > 0.0f ? 1.0f / zr : 0.0f);
          for (int64_t d = 0; d < Dv; ++d) {
            gz[size_t(r * Dv + d)] = dout[orow * Dv + d] * inv;
            if (normalize == 1) delta[size_t(r)] += dout[orow * Dv + d] * out[orow * Dv + d] * inv;
          }
        }
        const int64_t row = bm.slot(h) * nqb + qb;
        detail::for_each_chunk(
            &bm.ranges[size_t(bm.row_ptr[row])], bm.row_ptr[row + 1] - bm.row_ptr[row],
            [&](const detail::Segment* segs, int64_t nseg, int64_t n) {
              const float* kp = nullptr;
              detail::gather_chunk(segs, nseg, n, kbase, vbase, D, Dv, sc, true, &kp, true);
              float* s = sc.s.data();
              float* dw = sc.p2.data();
              tiles::qk(qt, m, D, sc.kt.data(), n, n, p.scale, s);
              detail::mod_and_mask(s, nullptr, m, n, segs, nseg, bm, q0, b, h, p, fm, NoScoreMod{});
              tiles::qk(gz.data(), m, Dv, sc.vt.data(), n, n, 1.0f, dw);  // dO·v_j / Z
              std::vector<float> w(static_cast<size_t>(m * n));
              for (int64_t r = 0; r < m; ++r)
                for (int64_t c = 0; c < n; ++c) {
                  const float x = s[r * n + c];
                  w[size_t(r * n + c)] = relu_pow(x, power);
                  // d out / d w_ij = (v_j - out_i) / Z ("sum"), v_j / Z otherwise; ds = dw * relu^power'(s).
                  dw[r * n + c] = (dw[r * n + c] - delta[size_t(r)]) * relu_pow_grad(x, power) * p.scale;
                }
              tiles::pv(dw, m, n, kp, D, D, 1.0f, dqt.data());
              // dK, dV rows of this chunk (layout positions of the segments).
              for (int64_t x = 0; x < nseg; ++x) {
                const int64_t len = segs[x].end - segs[x].begin;
                std::vector<float> ds_seg(static_cast<size_t>(m * len)), w_seg(static_cast<size_t>(m * len));
                for (int64_t r = 0; r < m; ++r)
                  for (int64_t c = 0; c < len; ++c) {
                    ds_seg[size_t(r * len + c)] = dw[r * n + segs[x].col + c];
                    w_seg[size_t(r * len + c)] = w[size_t(r * n + segs[x].col + c)];
                  }
                tiles::atx(ds_seg.data(), m, len, qt, D, D, 1.0f, &dkl[size_t(int64_t(segs[x].begin) * D)]);
                tiles::atx(w_seg.data(), m, len, gz.data(), Dv, Dv, 1.0f, &dvl[size_t(int64_t(segs[x].begin) * Dv)]);
              }
            });
        for (int64_t r = 0; r < m; ++r) {
          const size_t orow = size_t((b * p.Hq() + h) * p.Lq() + bm.q_index(q0 + r));
          for (int64_t d = 0; d < D; ++d) dq[orow * D + d] += dqt[size_t(r * D + d)];
        }
      }
    for (int64_t x = 0; x < p.Lk(); ++x) {
      const size_t krow = size_t((b * p.Hkv() + hk) * p.Lk() + bm.k_index(x));
      for (int64_t d = 0; d < D; ++d) dk[krow * D + d] += dkl[size_t(x * D + d)];
      for (int64_t d = 0; d < Dv; ++d) dv[krow * Dv + d] += dvl[size_t(x * Dv + d)];
    }
  };
  detail::parallel(p.B() * p.Hkv(), p.threads, item);
}

std::vector<float> dense4(const TensorView& t) {
  const BlockMask ident = Full().block_mask(t.shape[2], t.shape[2], 1, 64);
  detail::Packed p = detail::pack_inputs(t, t, t, ident, {}, true);
  return std::vector<float>(p.q.data(), p.q.data() + p.q.size());
}

void store4(const TensorView& t, const std::vector<float>& x) {
  const int64_t B = t.shape[0], H = t.shape[1], L = t.shape[2], D = t.shape[3];
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < L; ++i) detail::store_row(t, b, h, i, &x[size_t(((b * H + h) * L + i) * D)], D);
}

void mixed_weights(const AdaptiveNode& a, double& w1, double& w2) {
  const double m = std::max(a.logit_softmax, a.logit_relu);
  const double e1 = std::exp(a.logit_softmax - m), e2 = std::exp(a.logit_relu - m);
  w1 = e1 / (e1 + e2);
  w2 = e2 / (e1 + e2);
}

}  // namespace

void relu_mixed_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                        const TensorView& q, const TensorView& k, const TensorView& v, const SparseOptions& o,
                        const TensorView& out, const TensorView& lse, const TensorView& indices) {
  check(!indices.data, ErrorKind::kInvalidArgument, "return_indices: ", a.repr(), " selects no keys");
  const int64_t B = problem.batch, Hq = problem.heads_q, Lq = problem.len_q, Lk = problem.len_k;
  std::vector<float> o_relu, z;
  const bool mixed = a.kind == AdaptiveNode::kMixed;
  relu_forward(mixed ? 2.0 : a.power, mixed ? 0 : a.normalize, fixed, problem, q, k, v, o, o_relu, z);
  if (!mixed) {
    const Shape out_shape = {B, Hq, Lq, problem.head_dim_v};
    check(out.data && out.dim() == 4 && out.shape == out_shape, ErrorKind::kInvalidArgument, "out: expected shape ",
          shape_text(out_shape), ", got ", shape_text(out.shape));
    store4(out, o_relu);
    if (lse.data) {  // no softmax: report log(Z) (log of the row sum; -inf for an empty row)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t i = 0; i < Lq; ++i)
            detail::store_value(lse, b, h, i, std::log(z[size_t((b * Hq + h) * Lq + i)]));
    }
    return;
  }
  double w1, w2;
  mixed_weights(a, w1, w2);
  const BlockMask bm = fixed_block_mask(fixed, Lq, Lk, Hq, o.block);
  block_sparse_attention(problem, q, k, v, bm, FixedMask{fixed.defined() ? &fixed.node() : nullptr, Lq, Lk},
                         NoScoreMod{}, o, out, lse);
  std::vector<float> o_soft = dense4(out);
  for (size_t x = 0; x < o_soft.size(); ++x) o_soft[x] = float(w1 * o_soft[x] + w2 * o_relu[x]);
  store4(out, o_soft);
}

void relu_mixed_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                         const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                         const SparseOptions& o, const SparseGrads& g) {
  const bool mixed = a.kind == AdaptiveNode::kMixed;
  const BlockMask ident = Full().block_mask(problem.len_q, problem.len_k, 1, o.block);
  detail::Packed p = detail::pack_inputs(problem, q, k, v, ident, o);
  detail::check_grads(p, q, k, v, g.dq, g.dk, g.dv);
  check(dout.data && dout.shape == Shape({p.B(), p.Hq(), p.Lq(), p.Dv()}), ErrorKind::kInvalidArgument,
        "dout: expected shape ", shape_text({p.B(), p.Hq(), p.Lq(), p.Dv()}));
  std::vector<float> dq(p.q.size(), 0.0f), dk(p.k.size(), 0.0f), dv(p.v.size(), 0.0f);
  const std::vector<float> d_out = dense4(dout);
  std::vector<float> o_relu, z;
  relu_forward(mixed ? 2.0 : a.power, mixed ? 0 : a.normalize, fixed, problem, q, k, v, o, o_relu, z);
  if (!mixed) {
    relu_backward(a.power, a.normalize, fixed, problem, q, k, v, d_out, o_relu, z, o, dq, dk, dv);
  } else {
    double w1, w2;
    mixed_weights(a, w1, w2);
    // Recompute the softmax part (out and lse) and d(logits) = w ⊙ (g - w·g), g_c = sum(dout * out_c).
    const BlockMask bm = fixed_block_mask(fixed, p.Lq(), p.Lk(), p.Hq(), o.block);
    const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, p.Lq(), p.Lk()};
    Tensor o_soft(DType::kF32, {p.B(), p.Hq(), p.Lq(), p.Dv()}), lse_soft(DType::kF32, {p.B(), p.Hq(), p.Lq()});
    block_sparse_attention(problem, q, k, v, bm, fm, NoScoreMod{}, o, o_soft, lse_soft);
    double g1 = 0, g2 = 0;
    for (size_t x = 0; x < d_out.size(); ++x) {
      g1 += double(d_out[x]) * o_soft.data<float>()[x];
      g2 += double(d_out[x]) * o_relu[x];
    }
    if (g.dlogits.data) {
      check(g.dlogits.numel() == 2 && g.dlogits.dim() == 1, ErrorKind::kInvalidArgument,
            "dlogits: expected shape [2], got ", shape_text(g.dlogits.shape));
      const double wg = w1 * g1 + w2 * g2;
      const int64_t i0[1] = {0}, i1[1] = {1};
      g.dlogits.set(i0, w1 * (g1 - wg));
      g.dlogits.set(i1, w2 * (g2 - wg));
    }
    std::vector<float> d1(d_out.size()), d2(d_out.size());
    for (size_t x = 0; x < d_out.size(); ++x) {
      d1[x] = float(w1 * d_out[x]);
      d2[x] = float(w2 * d_out[x]);
    }
    Tensor d1t(DType::kF32, {p.B(), p.Hq(), p.Lq(), p.Dv()});
    std::copy(d1.begin(), d1.end(), d1t.data<float>());
    Tensor sq(DType::kF32, q.shape), sk(DType::kF32, k.shape), sv(DType::kF32, v.shape);
    block_sparse_attention_backward(problem, d1t, q, k, v, o_soft, lse_soft, bm, fm, NoScoreMod{}, o, sq, sk, sv);
    relu_backward(2.0, 0, fixed, problem, q, k, v, d2, o_relu, z, o, dq, dk, dv);
    for (size_t x = 0; x < dq.size(); ++x) dq[x] += sq.data<float>()[x];
    for (size_t x = 0; x < dk.size(); ++x) dk[x] += sk.data<float>()[x];
    for (size_t x = 0; x < dv.size(); ++x) dv[x] += sv.data<float>()[x];
  }
  store4(g.dq, dq);
  store4(g.dk, dk);
  store4(g.dv, dv);
}

}  // namespace sattn::sparse
