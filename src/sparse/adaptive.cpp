// Content-adaptive attention: TopK, BlockTopK, ReLUAttention, MixedAttention (see patterns.hpp / sparse.hpp).
#include "sparse/adaptive.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>

#include "sattn/error.hpp"
#include "sparse/topk_scan.hpp"

#include <hwy/aligned_allocator.h>

namespace sattn::sparse {

// ---- helpers --------------------------------------------------------------------------------------------------

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct FixedMask {
  const Pattern::Node* node;  // null: everything allowed
  int64_t lq, lk;
  bool operator()(int64_t, int64_t h, int64_t i, int64_t j) const {
    return node == nullptr || node->allowed(h, i, j, lq, lk);
  }
};

TensorView slice_batch(const TensorView& t, int64_t b) {
  if (!t.data) return t;
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + b * t.strides[0] * int64_t(dtype_size(t.dtype));
  s.shape[0] = 1;
  return s;
}

void check_indices(const TensorView& t, const Shape& shape, const char* what) {
  check(t.dtype == DType::kI64, ErrorKind::kTypeError, "indices: expected int64, got ", to_string(t.dtype));
  check(t.shape == shape && t.strides.size() == shape.size(), ErrorKind::kInvalidArgument, "indices: expected ", what,
        " ", shape_to_string(shape), ", got ", shape_to_string(t.shape));
}

int64_t& idx_at(const TensorView& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return static_cast<int64_t*>(t.data)[a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3]];
}

void require_no_mods(const SparseOptions& o, const char* what) {
  check(o.alibi_slopes.empty() && o.softcap == 0.0 && !o.bias.data && !o.rel_pos_bias.data,
        ErrorKind::kInvalidArgument, what, ": score mods (alibi_slopes, softcap, bias, rel_pos_bias) are not supported "
        "with content-adaptive patterns");
}

BlockMask fixed_block_mask(const Pattern& fixed, int64_t lq, int64_t lk, int64_t hq, int64_t block) {
  return fixed.defined() ? fixed.block_mask(lq, lk, hq, block) : Full().block_mask(lq, lk, hq, block);
}

// ---- TopK ------------------------------------------------------------------------------------------------------

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
void topk_forward_full(const AdaptiveNode& a, const TensorView& q, const TensorView& k, const TensorView& v,
                       const SparseOptions& o, const TensorView& out, const TensorView& lse,
                       const TensorView& indices) {
  constexpr int64_t kQueryRows = 48;  // a query block: 48 x D floats stay in L1 beside one key tile
  const int64_t lq = q.shape[2], lk = k.shape[2];
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);  // identity layout for packing
  detail::Packed p = detail::pack_inputs(q, k, v, ident, o, o.enable_gqa);
  detail::check_outputs(p, out, lse);
  const int64_t K_out = a.k, K = std::min(a.k, p.Lk);
  if (indices.data) check_indices(indices, {p.B, p.Hq, p.Lq, K_out}, "[B, Hq, Lq, k]");
  const int64_t D = p.D, Dv = p.Dv, W = topk::tile_width(), lk_pad = (p.Lk + W - 1) / W * W;
  // Packed key tiles of every (b, kv head): as many floats as K itself (plus padding to W keys).
  auto kp = hwy::AllocateAligned<float>(size_t(std::max<int64_t>(1, p.B * p.Hkv * lk_pad * D)));
  check(kp != nullptr, ErrorKind::kOutOfMemory, "TopK: cannot allocate the packed keys");
  auto pack = [&](int64_t bh) {
    topk::pack_keys(&p.k[size_t(bh * p.Lk * D)], p.Lk, D, D, kp.get() + bh * lk_pad * D);
  };
  detail::parallel(p.B * p.Hkv, p.threads, pack);
  // Key padding as an additive bias per batch entry (0 or -inf; -inf past Lk up to the last tile's end).
  hwy::AlignedFreeUniquePtr<float[]> kbias;
  if (!p.key_valid.empty()) {
    kbias = hwy::AllocateAligned<float>(size_t(p.B * lk_pad));
    check(kbias != nullptr, ErrorKind::kOutOfMemory, "TopK: cannot allocate the key padding bias");
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t j = 0; j < lk_pad; ++j)
        kbias[size_t(b * lk_pad + j)] = j < p.Lk && p.key_valid[size_t(b * p.Lk + j)] ? 0.0f : kNegInf;
  }
  const int64_t nqb = (p.Lq + kQueryRows - 1) / kQueryRows;
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
    const int64_t q0 = qb * kQueryRows, m = std::min(kQueryRows, p.Lq - q0);
    const int64_t stride = topk::row_stride(K, p.Lk);
    thread_local std::vector<float> cs, thr, tmp, o_row, w;
    thread_local std::vector<int32_t> cj;
    thread_local std::vector<int64_t> cnt;
    cs.resize(size_t(m * stride));
    cj.resize(size_t(m * stride));
    tmp.resize(size_t(stride));
    cnt.assign(size_t(m), 0);
    thr.assign(size_t(m), kNegInf);
    topk::scan(&p.q[size_t(((b * p.Hq + h) * p.Lq + q0) * D)], m, D, kp.get() + (b * p.Hkv + hk) * lk_pad * D, p.Lk,
               p.scale, kbias ? kbias.get() + b * lk_pad : nullptr, K, cs.data(), cj.data(), cnt.data(), thr.data(),
               tmp.data());
    const float* vbase = &p.v[size_t((b * p.Hkv + hk) * p.Lk * Dv)];
    for (int64_t r = 0; r < m; ++r)
      topk_finish(&cs[size_t(r * stride)], &cj[size_t(r * stride)], &cj[size_t(r * stride)], cnt[size_t(r)], vbase,
                  Dv, b, h, q0 + r, out, lse, indices, K_out, o_row, w);
  };
  detail::parallel(p.B * p.Hq * nqb, p.threads, item);
}

void topk_forward(const AdaptiveNode& a, const Pattern& fixed, const TensorView& q, const TensorView& k,
                  const TensorView& v, const SparseOptions& o, const TensorView& out, const TensorView& lse,
                  const TensorView& indices) {
  if (!fixed.defined()) return topk_forward_full(a, q, k, v, o, out, lse, indices);
  const int64_t lq = q.shape[2], lk = k.shape[2], hq = q.shape[1];
  const BlockMask bm = fixed_block_mask(fixed, lq, lk, hq, o.block);
  detail::Packed p = detail::pack_inputs(q, k, v, bm, o, o.enable_gqa);
  detail::check_outputs(p, out, lse);
  const int64_t K_out = a.k, K = std::min(a.k, p.Lk);  // at most Lk keys can be kept
  if (indices.data) check_indices(indices, {p.B, p.Hq, p.Lq, K_out}, "[B, Hq, Lq, k]");
  const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, lq, lk};
  const int64_t nqb = bm.num_q_blocks(), D = p.D, Dv = p.Dv;
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
    const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
    thread_local detail::Scratch sc;
    thread_local std::vector<Cand> heap;
    thread_local std::vector<int64_t> cnt;
    sc.ensure(m, D, Dv);
    thread_local std::vector<float> thr_row;
    heap.resize(size_t(m * 2 * K));
    cnt.assign(size_t(m), 0);
    thr_row.assign(size_t(m), kNegInf);
    const float* qt = &p.q[size_t(((b * p.Hq + h) * p.Lq + q0) * D)];
    const float* kbase = &p.k[size_t((b * p.Hkv + hk) * p.Lk * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv + hk) * p.Lk * Dv)];
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
  detail::parallel(p.B * p.Hq * nqb, p.threads, item);
}

void topk_backward(const AdaptiveNode& a, const Pattern& fixed, const TensorView& dout, const TensorView& q,
                   const TensorView& k, const TensorView& v, const TensorView& lse, const SparseOptions& o,
                   const SparseGrads& g, const TensorView& indices_in) {
  const int64_t B = q.shape[0], hq = q.shape[1], lq = q.shape[2], lk = k.shape[2];
  // The selection: the given indices, or recomputed (deterministically) by the forward pass, with at most Lk
  // columns (a k beyond Lk keeps every allowed key, as k = Lk does).
  const int64_t K = indices_in.data ? a.k : std::min(a.k, lk);
  Tensor idx_t, out_t, lse_t;
  TensorView indices = indices_in;
  if (!indices.data) {
    AdaptiveNode at_most_lk = a;
    at_most_lk.k = K;
    idx_t = Tensor(DType::kI64, {B, hq, lq, K});
    out_t = Tensor(DType::kF32, {B, hq, lq, v.shape[3]});
    lse_t = Tensor(DType::kF32, {B, hq, lq});
    topk_forward(at_most_lk, fixed, q, k, v, o, out_t, lse_t, idx_t);
    indices = idx_t.view();
  }
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);  // identity layout for packing
  detail::Packed p = detail::pack_inputs(q, k, v, ident, o, o.enable_gqa);
  detail::check_grads(p, q, k, v, g.dq, g.dk, g.dv);
  check_indices(indices, {p.B, p.Hq, p.Lq, K}, "[B, Hq, Lq, k]");
  check(dout.shape == Shape{p.B, p.Hq, p.Lq, p.Dv}, ErrorKind::kInvalidArgument, "dout: expected shape ",
        shape_to_string({p.B, p.Hq, p.Lq, p.Dv}), ", got ", shape_to_string(dout.shape));
  check(lse.data && lse.shape == Shape{p.B, p.Hq, p.Lq}, ErrorKind::kInvalidArgument, "lse: expected shape ",
        shape_to_string({p.B, p.Hq, p.Lq}));
  detail::pack_backward(p, ident, dout, dout, lse);  // packs dout and lse (delta unused here)
  const int64_t D = p.D, Dv = p.Dv;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t i = 0; i < p.Lq; ++i)
        for (int64_t x = 0; x < K; ++x) {
          const int64_t j = idx_at(indices, b, h, i, x);
          check(j >= -1 && j < p.Lk, ErrorKind::kInvalidArgument, "indices: key index ", j, " out of range [-1, ",
                p.Lk, ")");
        }
  // One item per (b, kv head): owns dK/dV of that head and dQ of its query heads (deterministic).
  auto item = [&](int64_t it) {
    const int64_t b = it / p.Hkv, hk = it % p.Hkv;
    std::vector<float> dk(static_cast<size_t>(p.Lk * D), 0.0f), dv(static_cast<size_t>(p.Lk * Dv), 0.0f), dq(static_cast<size_t>(D)), pr(static_cast<size_t>(K)),
        dp(static_cast<size_t>(K));
    const float* kb = &p.k[size_t((b * p.Hkv + hk) * p.Lk * D)];
    const float* vb = &p.v[size_t((b * p.Hkv + hk) * p.Lk * Dv)];
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h)
      for (int64_t i = 0; i < p.Lq; ++i) {
        const size_t row = size_t((b * p.Hq + h) * p.Lq + i);
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
    for (int64_t j = 0; j < p.Lk; ++j) {
      detail::store_row(g.dk, b, hk, j, &dk[size_t(j * D)], D);
      detail::store_row(g.dv, b, hk, j, &dv[size_t(j * Dv)], Dv);
    }
  };
  detail::parallel(p.B * p.Hkv, p.threads, item);
}

// ---- BlockTopK -------------------------------------------------------------------------------------------------

struct BlockSelection {
  BlockMask mask;               // heads = Hq, identity layout, query blocks = aligned blocks
  int64_t nqb = 0, width = 0;   // min(k_blocks, number of key blocks) (at least 1): no more can be chosen
  std::vector<int64_t> chosen;  // [Hq, nqb, width], -1 fill
  const int64_t* row(int64_t h, int64_t qb) const { return &chosen[size_t((h * nqb + qb) * width)]; }
  // The y-th chosen key block of (h, qb) as the indices output reports it ([..., k_blocks], -1 fill).
  int64_t index(int64_t h, int64_t qb, int64_t y) const { return y < width ? row(h, qb)[y] : -1; }
};

std::vector<int32_t> aligned_bounds(int64_t lq, int64_t off, int64_t block) {
  std::vector<int32_t> bounds;
  for (int64_t i = 1; i <= lq; ++i)
    if (i == lq || ((i + off) % block + block) % block == 0) bounds.push_back(int32_t(i));
  return bounds;
}

int64_t floor_div(int64_t x, int64_t y) { return x >= 0 ? x / y : -((-x + y - 1) / y); }

// fp64 block score qm · km: four independent sums in a fixed order (deterministic; the order the selection is
// defined with).
inline double block_score64(const double* qm, const double* km, int64_t D) {
  double s4[4] = {0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 4 <= D; d += 4)
    for (int u = 0; u < 4; ++u) s4[u] += qm[d + u] * km[d + u];
  for (; d < D; ++d) s4[0] += qm[d] * km[d];
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// The shape of one batch entry's selection: aligned query blocks (bounds, with qbounds = {0, bounds...}) against
// key blocks of a.block positions.
struct SelectGeometry {
  const AdaptiveNode& a;
  const Pattern& fixed;
  const detail::Packed& p;
  int64_t b, lq, lk, off, blk, nkb, D, nqb, KB;
  const std::vector<int32_t>& qbounds;
};

// Key-block means over valid keys of one batch entry, per kv head (fp64), their fp32 transposes and norms.
struct KeyBlockMeans {
  std::vector<double> kmean;      // [Hkv, nkb, D]
  std::vector<int64_t> kvalid;    // [nkb] valid keys per block
  std::vector<float> kmt;         // [Hkv, D, nkb]
  std::vector<double> knorm_max;  // [Hkv] largest norm of a block mean with a valid key
};

// The chosen blocks as given (indices [Hq, nqb, k_blocks], -1 = none): sorted, duplicates dropped.
void select_given(const SelectGeometry& g, const int64_t* given, BlockSelection& sel) {
  const AdaptiveNode& a = g.a;
  for (int64_t h = 0; h < g.p.Hq; ++h)
    for (int64_t qb = 0; qb < g.nqb; ++qb) {
      std::vector<int64_t> picks;
      for (int64_t x = 0; x < a.k_blocks; ++x) {
        const int64_t kb = given[(h * g.nqb + qb) * a.k_blocks + x];
        check(kb >= -1 && kb < g.nkb, ErrorKind::kInvalidArgument, "indices: key block ", kb, " out of range");
        if (kb >= 0) picks.push_back(kb);
      }
      std::sort(picks.begin(), picks.end());
      picks.erase(std::unique(picks.begin(), picks.end()), picks.end());  // (so at most `width` of them)
      std::copy(picks.begin(), picks.end(), &sel.chosen[size_t((h * g.nqb + qb) * g.KB)]);
    }
}

KeyBlockMeans key_block_means(const SelectGeometry& g) {
  const detail::Packed& p = g.p;
  const int64_t b = g.b, lk = g.lk, blk = g.blk, nkb = g.nkb, D = g.D;
  KeyBlockMeans km;
  km.kmean.assign(static_cast<size_t>(p.Hkv * nkb * D), 0.0);
  km.kvalid.assign(static_cast<size_t>(nkb), 0);
  std::vector<double>& kmean = km.kmean;
  for (int64_t j = 0; j < lk; ++j)
    if (p.key_valid.empty() || p.key_valid[size_t(b * lk + j)]) km.kvalid[size_t(j / blk)]++;
  // Sums per (kv head, run of 16 key blocks) in parallel; each block's sum is in key order for any thread count.
  constexpr int64_t kSumBlocks = 16;
  const int64_t sum_runs = (nkb + kSumBlocks - 1) / kSumBlocks;
  auto sum_keys = [&](int64_t it) {
    const int64_t hk = it / sum_runs, j_lo = (it % sum_runs) * kSumBlocks * blk;
    const int64_t j_hi = std::min(lk, j_lo + kSumBlocks * blk);
    for (int64_t j = j_lo; j < j_hi; ++j) {
      if (!(p.key_valid.empty() || p.key_valid[size_t(b * lk + j)])) continue;
      const float* kr = &p.k[size_t(((b * p.Hkv + hk) * lk + j) * D)];
      double* m = &kmean[size_t((hk * nkb + j / blk) * D)];
      for (int64_t d = 0; d < D; ++d) m[d] += kr[d];
    }
  };
  detail::parallel(p.Hkv * sum_runs, p.threads, sum_keys);
  km.kmt.resize(static_cast<size_t>(p.Hkv * D * nkb));
  km.knorm_max.assign(static_cast<size_t>(p.Hkv), 0.0);
  for (int64_t hk = 0; hk < p.Hkv; ++hk)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      double* m = &kmean[size_t((hk * nkb + kb) * D)];
      double n2 = 0;
      for (int64_t d = 0; d < D; ++d) {
        if (km.kvalid[size_t(kb)] > 0) m[d] /= double(km.kvalid[size_t(kb)]);
        km.kmt[size_t((hk * D + d) * nkb + kb)] = float(m[d]);
        n2 += m[d] * m[d];
      }
      if (km.kvalid[size_t(kb)] > 0) km.knorm_max[size_t(hk)] = std::max(km.knorm_max[size_t(hk)], std::sqrt(n2));
    }
  return km;
}

// The fixed pattern's key ranges per (head, query block), gathered serially (Pattern nodes need not be
// thread-safe). Empty without a fixed pattern.
std::vector<std::vector<KeyRange>> fixed_key_ranges(const SelectGeometry& g) {
  std::vector<std::vector<KeyRange>> franges;
  if (!g.fixed.defined()) return franges;
  franges.resize(size_t(g.p.Hq * g.nqb));
  for (int64_t h = 0; h < g.p.Hq; ++h)
    for (int64_t qb = 0; qb < g.nqb; ++qb)
      g.fixed.node().ranges_for(g.fixed.head_dependent() ? h : 0, g.qbounds[size_t(qb)], g.qbounds[size_t(qb + 1)],
                                g.lq, g.lk, g.blk, franges[size_t(h * g.nqb + qb)]);
  return franges;
}

// Query-block means of head h, blocks [c0, c0 + rows): fp64 into qm [rows x D] and their fp32 copies into qmf.
void query_block_means(const SelectGeometry& g, int64_t h, int64_t c0, int64_t rows, double* qm, float* qmf) {
  const int64_t D = g.D;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q0 = g.qbounds[size_t(c0 + r)], q1 = g.qbounds[size_t(c0 + r + 1)];
    double* m = &qm[size_t(r * D)];
    for (int64_t i = q0; i < q1; ++i) {
      const float* qr = &g.p.q[size_t(((g.b * g.p.Hq + h) * g.lq + i) * D)];
      for (int64_t d = 0; d < D; ++d) m[d] += qr[d];
    }
    for (int64_t d = 0; d < D; ++d) {
      m[d] /= double(q1 - q0);
      qmf[size_t(r * D + d)] = float(m[d]);
    }
  }
}

// One query block's selection: the candidates it may choose from and where its picks go.
struct RowChoice {
  int64_t t = 0;       // the key block of the query block's first position (its own block)
  int64_t kb_end = 0;  // candidates are key blocks < kb_end
  bool own = false;    // the own block is picked first (local)
  bool every_block_usable = false;
  const uint8_t* cand = nullptr;  // [nkb] allowed by the fixed pattern (unused when every_block_usable)
  const int64_t* kvalid = nullptr;
  const float* sr = nullptr;  // fp32 block scores [nkb]
  int64_t* ch = nullptr;      // the picks, sorted at the end
  int64_t npick = 0;
  bool usable(int64_t kb) const {
    return (every_block_usable || (cand[size_t(kb)] && kvalid[size_t(kb)] > 0)) && !(own && kb == t);
  }
};

// Ranking of fp32 block scores: higher score first, ties to the lower block (a closure type, inlined into the sort).
constexpr auto better32 = [](const std::pair<float, int32_t>& x, const std::pair<float, int32_t>& y) {
  return x.first > y.first || (x.first == y.first && x.second < y.second);
};

// Pass 1: the need-th best fp32 score by a streaming threshold (a buffer of 4·need, cut to its best need when
// full): O(nkb) compares, a few small nth_elements. Leaves the surviving candidates in scored; returns the number
// of usable blocks and whether all their scores are finite.
int64_t threshold_pass(const RowChoice& rc, int64_t need, std::vector<std::pair<float, int32_t>>& scored,
                       bool& all_finite) {
  const float* sr = rc.sr;
  const int64_t kb_end = rc.kb_end, t = rc.t;
  const bool own = rc.own;
  int64_t n_usable = 0;
  float thr = -std::numeric_limits<float>::infinity();
  auto offer = [&](float x, int64_t kb) {
    scored.emplace_back(x, int32_t(kb));
    if (int64_t(scored.size()) == 4 * need) {
      std::nth_element(scored.begin(), scored.begin() + (need - 1), scored.end(), better32);
      scored.resize(size_t(need));
      thr = scored.back().first;
    }
  };
  if (rc.every_block_usable) {
    // No fixed pattern and no padding: every block before kb_end but the own one is a candidate. Runs of
    // 16 scores: their maximum (NaN-free: std::max keeps the first operand) and finiteness in one
    // branch-free pass; a run is scanned only when its maximum passes the threshold.
    n_usable = kb_end - (own ? 1 : 0);
    for (int64_t c0 = 0; c0 < kb_end; c0 += 16) {
      const int64_t c1 = std::min(kb_end, c0 + 16);
      float mx = -std::numeric_limits<float>::infinity();
      bool fin = true;
      for (int64_t kb = c0; kb < c1; ++kb) {
        mx = std::max(mx, sr[kb]);
        fin &= sr[kb] - sr[kb] == 0.0f;
      }
      all_finite &= fin;
      if (mx > thr)
        for (int64_t kb = c0; kb < c1; ++kb)
          if (sr[kb] > thr && !(own && kb == t)) offer(sr[kb], kb);
    }
  } else {
    for (int64_t kb = 0; kb < kb_end; ++kb) {
      if (!rc.usable(kb)) continue;
      ++n_usable;
      const float x = sr[kb];
      all_finite &= std::isfinite(x);
      if (x > thr) offer(x, kb);
    }
  }
  return n_usable;
}

// Pass 2: with cut the need-th best fp32 score, every block below cut - 2E is below all `need` blocks at or above
// the cut in fp64 too; the others (about `need`) are rescored in fp64 (query-block mean m against the key-block
// means kmean of the kv head) and ranked exactly (higher score, ties to the lower block).
void rescore_pass(RowChoice& rc, int64_t need, std::vector<std::pair<float, int32_t>>& scored, bool all_finite,
                  const double* m, const double* kmean, double knorm_max, int64_t D,
                  std::vector<std::pair<double, int64_t>>& exact) {
  const float* sr = rc.sr;
  const int64_t kb_end = rc.kb_end;
  // (A non-finite score, possible only for huge inputs, sends the row to the exact fp64 ranking of all.)
  all_finite &= int64_t(scored.size()) >= need;
  float cut = 0.0f;
  if (all_finite) {
    std::nth_element(scored.begin(), scored.begin() + (need - 1), scored.end(), better32);
    cut = scored[size_t(need - 1)].first;
  }
  double n2 = 0;
  for (int64_t d = 0; d < D; ++d) n2 += m[d] * m[d];
  // |fp32 score - fp64 score| <= E: products of D fp32-rounded terms, FMA sums (<= (D + 3)·2^-24·|qm|·|km|).
  const double E = double(D + 4) * 0x1p-23 * std::sqrt(n2) * knorm_max;
  const bool finite = all_finite && std::isfinite(E);
  exact.clear();
  const double bound = double(cut) - 2.0 * E;
  for (int64_t c0 = 0; c0 < kb_end; c0 += 16) {  // runs of 16 whose maximum is below the bound are skipped
    const int64_t c1 = std::min(kb_end, c0 + 16);
    if (finite) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t kb = c0; kb < c1; ++kb) mx = std::max(mx, sr[kb]);
      if (double(mx) < bound) continue;
    }
    for (int64_t kb = c0; kb < c1; ++kb)
      if (rc.usable(kb) && (!finite || double(sr[kb]) >= bound))
        exact.emplace_back(-block_score64(m, &kmean[size_t(kb * D)], D), kb);
  }
  const size_t cutn = std::min(exact.size(), size_t(need));
  std::nth_element(exact.begin(), exact.begin() + std::ptrdiff_t(cutn - 1), exact.end());
  for (size_t x = 0; x < cutn; ++x) rc.ch[rc.npick++] = exact[x].second;
}

// Selection of head h's query blocks [c0, c0 + rows): block scores (one fp32 product of query-block means and
// key-block means), then per query block its candidates, pass 1 (select) and pass 2 (rescore).
void select_chunk(const SelectGeometry& g, const KeyBlockMeans& km,
                  const std::vector<std::vector<KeyRange>>& franges, int64_t h, int64_t c0, int64_t rows,
                  BlockSelection& sel) {
  const AdaptiveNode& a = g.a;
  const int64_t D = g.D, nkb = g.nkb, blk = g.blk, hk = h / g.p.group;
  const bool every_block_usable = !g.fixed.defined() && g.p.key_valid.empty();
  thread_local std::vector<double> qm;
  thread_local std::vector<float> qmf, s;
  thread_local std::vector<uint8_t> cand;
  thread_local std::vector<std::pair<float, int32_t>> scored;
  thread_local std::vector<std::pair<double, int64_t>> exact;
  qm.assign(size_t(rows * D), 0.0);
  qmf.resize(size_t(rows * D));
  s.resize(size_t(rows * nkb));
  query_block_means(g, h, c0, rows, qm.data(), qmf.data());
  tiles::qk(qmf.data(), rows, D, &km.kmt[size_t(hk * D * nkb)], nkb, nkb, 1.0f, s.data());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qb = c0 + r, q0 = g.qbounds[size_t(qb)], t = floor_div(q0 + g.off, blk);
    // Candidates: key blocks with a valid key, allowed by the fixed pattern, not after the query block if causal.
    if (!every_block_usable) cand.assign(size_t(nkb), g.fixed.defined() ? 0 : 1);
    if (g.fixed.defined())
      for (const auto& fr : franges[size_t(h * g.nqb + qb)])
        for (int64_t kb = fr.begin / blk; kb * blk < fr.end; ++kb) cand[size_t(kb)] = 1;
    RowChoice rc;
    rc.t = t;
    rc.kb_end = a.causal ? std::min(nkb, t + 1) : nkb;
    rc.every_block_usable = every_block_usable;
    rc.cand = cand.data();
    rc.kvalid = km.kvalid.data();
    rc.sr = &s[size_t(r * nkb)];
    rc.ch = &sel.chosen[size_t((h * g.nqb + qb) * g.KB)];
    rc.own = a.local && t >= 0 && t < rc.kb_end &&
             (every_block_usable || (cand[size_t(t)] && km.kvalid[size_t(t)] > 0));
    if (rc.own) rc.ch[rc.npick++] = t;
    const int64_t need = g.KB - rc.npick;
    int64_t n_usable = 0;
    bool all_finite = true;
    scored.clear();
    if (need > 0) n_usable = threshold_pass(rc, need, scored, all_finite);
    if (need > 0 && n_usable <= need) {
      for (int64_t kb = 0; kb < rc.kb_end; ++kb)
        if (rc.usable(kb)) rc.ch[rc.npick++] = kb;
    } else if (need > 0) {
      rescore_pass(rc, need, scored, all_finite, &qm[size_t(r * D)], &km.kmean[size_t(hk * nkb * D)],
                   km.knorm_max[size_t(hk)], D, exact);
    }
    std::sort(rc.ch, rc.ch + rc.npick);
  }
}

// The block mask of a selection: each query block's chosen key blocks (full but where the fixed pattern or the
// causal diagonal needs the mask).
BlockMask selection_mask(const SelectGeometry& g, const std::vector<int32_t>& bounds, const BlockSelection& sel) {
  const int64_t blk = g.blk, lk = g.lk;
  return detail::build_identity_layout(
      g.lq, lk, g.p.Hq, bounds, [&](int64_t h, int64_t q0, int64_t, std::vector<KeyRange>& out) {
        const int64_t qb = std::lower_bound(g.qbounds.begin(), g.qbounds.end(), int32_t(q0)) - g.qbounds.begin();
        const int64_t t = floor_div(q0 + g.off, blk);
        const int64_t* ch = &sel.chosen[size_t((h * g.nqb + qb) * g.KB)];
        for (int64_t x = 0; x < g.KB && ch[x] >= 0; ++x)
          detail::emit_range(out, ch[x] * blk, std::min(lk, (ch[x] + 1) * blk),
                             !g.fixed.defined() && !(g.a.causal && ch[x] == t), blk);
      });
}

// Selection for batch entry b (q, k: 4-D views of that entry, [1, H, L, D]); `given` (optional) = [Hq, nqb, kb].
// Block means are computed once (fp64, O(L·D)); all block scores of a head are one fp32 matrix product
// (query-block means x key-block means, tiles::qk), and each query block picks its best candidates with a
// streaming threshold on the fp32 scores; candidates within the fp32 error bound of the cut are rescored in fp64,
// so the selection is exactly the fp64 top-k (higher score, ties to the lower block). with_mask = false leaves
// sel.mask empty (the direct forward reads only sel.chosen).
BlockSelection block_select(const AdaptiveNode& a, const Pattern& fixed, const detail::Packed& p, int64_t b,
                            const int64_t* given, bool with_mask = true) {
  const int64_t lq = p.Lq, lk = p.Lk, off = lk - lq, blk = a.block, nkb = (lk + blk - 1) / blk, D = p.D;
  const std::vector<int32_t> bounds = aligned_bounds(lq, off, blk);
  const int64_t nqb = int64_t(bounds.size()), KB = std::max<int64_t>(1, std::min(a.k_blocks, nkb));
  BlockSelection sel;
  sel.nqb = nqb;
  sel.width = KB;
  sel.chosen.assign(size_t(p.Hq * nqb * KB), -1);
  const std::vector<int32_t> qbounds = [&] {
    std::vector<int32_t> x = {0};
    x.insert(x.end(), bounds.begin(), bounds.end());
    return x;
  }();
  const SelectGeometry g{a, fixed, p, b, lq, lk, off, blk, nkb, D, nqb, KB, qbounds};
  if (given) {
    select_given(g, given, sel);
  } else {
    const KeyBlockMeans km = key_block_means(g);
    const std::vector<std::vector<KeyRange>> franges = fixed_key_ranges(g);
    constexpr int64_t kRows = 32;  // query blocks per work item (scores: kRows x nkb floats)
    const int64_t chunks = (nqb + kRows - 1) / kRows;
    auto item = [&](int64_t it) {
      const int64_t h = it / chunks, c0 = (it % chunks) * kRows;
      select_chunk(g, km, franges, h, c0, std::min(kRows, nqb - c0), sel);
    };
    detail::parallel(p.Hq * chunks, p.threads, item);
  }
  if (with_mask) sel.mask = selection_mask(g, bounds, sel);
  return sel;
}

struct BlockTopKMask {
  const Pattern::Node* fixed;
  bool causal;
  int64_t lq, lk;
  bool operator()(int64_t, int64_t h, int64_t i, int64_t j) const {
    return (!causal || j <= i + lk - lq) && (fixed == nullptr || fixed->allowed(h, i, j, lq, lk));
  }
};

SparseOptions batch_options(const SparseOptions& o, int64_t b) {
  SparseOptions s = o;
  if (o.key_padding_mask.data) s.key_padding_mask = slice_batch(o.key_padding_mask, b);
  if (o.key_lengths.data) s.key_lengths = slice_batch(o.key_lengths, b);
  return s;
}

int64_t blocktopk_nqb(const AdaptiveNode& a, int64_t lq, int64_t lk) {
  return int64_t(aligned_bounds(lq, lk - lq, a.block).size());
}

void blocktopk_run(const AdaptiveNode& a, const Pattern& fixed, const TensorView& q, const TensorView& k,
                   const TensorView& v, const SparseOptions& o, const TensorView& indices, bool indices_given,
                   const std::function<void(int64_t, const BlockMask&, const SparseOptions&)>& run) {
  const int64_t lq = q.shape[2], lk = k.shape[2];
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);
  const detail::Packed p = detail::pack_inputs(q, k, v, ident, o, o.enable_gqa);
  const int64_t nqb = blocktopk_nqb(a, lq, lk), KB = a.k_blocks;
  if (indices.data) check_indices(indices, {p.B, p.Hq, nqb, KB}, "[B, Hq, num_query_blocks, k_blocks]");
  for (int64_t b = 0; b < p.B; ++b) {
    std::vector<int64_t> given;
    if (indices_given) {
      given.resize(size_t(p.Hq * nqb * KB));
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t x = 0; x < nqb; ++x)
          for (int64_t y = 0; y < KB; ++y) given[size_t((h * nqb + x) * KB + y)] = idx_at(indices, b, h, x, y);
    }
    const BlockSelection sel = block_select(a, fixed, p, b, indices_given ? given.data() : nullptr);
    if (indices.data && !indices_given)
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t x = 0; x < nqb; ++x)
          for (int64_t y = 0; y < KB; ++y) idx_at(indices, b, h, x, y) = sel.index(h, x, y);
    run(b, sel.mask, batch_options(o, b));
  }
}

// BlockTopK forward without a fixed pattern: one packing of the inputs, the selection, then per (head, query
// block) an online softmax over its chosen key blocks, with K pre-transposed once per (b, kv head) into key-block
// tiles [D x block] that tiles::qk reads in place and V read in place (the engine would gather, copy and transpose
// both for every query block). Masks as in
// BlockTopKMask: causal inside the diagonal block, key padding in blocks that have some.
void blocktopk_forward_direct(const AdaptiveNode& a, const TensorView& q, const TensorView& k, const TensorView& v,
                              const SparseOptions& o, const TensorView& out, const TensorView& lse,
                              const TensorView& indices) {
  const int64_t lq = q.shape[2], lk = k.shape[2];
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);
  const detail::Packed p = detail::pack_inputs(q, k, v, ident, o, o.enable_gqa);
  detail::check_outputs(p, out, lse);
  const int64_t nqb = blocktopk_nqb(a, lq, lk), KB = a.k_blocks, blk = a.block, nkb = (lk + blk - 1) / blk;
  const int64_t D = p.D, Dv = p.Dv, off = lk - lq;
  const int64_t bw = std::min(blk, lk);  // columns of a key block in memory (one block of Lk keys when blk > Lk)
  if (indices.data) check_indices(indices, {p.B, p.Hq, nqb, KB}, "[B, Hq, num_query_blocks, k_blocks]");
  // K of one (b, kv head) at a time as transposed key blocks [nkb][D][bw] (one head's worth of memory).
  detail::HugeVector<float> kt(static_cast<size_t>(nkb * D * bw));
  std::vector<int32_t> qbounds = {0};
  for (int32_t x : aligned_bounds(lq, off, blk)) qbounds.push_back(x);
  for (int64_t b = 0; b < p.B; ++b) {
    const BlockSelection sel = block_select(a, Pattern(), p, b, nullptr, false);
    if (indices.data)
      for (int64_t h = 0; h < p.Hq; ++h)
        for (int64_t x = 0; x < nqb; ++x)
          for (int64_t y = 0; y < KB; ++y) idx_at(indices, b, h, x, y) = sel.index(h, x, y);
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      const int64_t bh = b * p.Hkv + hk;
      auto pack = [&](int64_t kb) {
        tiles::transpose_rows(&p.k[size_t((bh * lk + kb * blk) * D)], D, std::min(blk, lk - kb * blk), D,
                              &kt[size_t(kb * D * bw)], bw);
      };
      detail::parallel(nkb, p.threads, pack);
      auto item = [&](int64_t it) {
        const int64_t h = hk * p.group + it / nqb, qb = it % nqb;
        const int64_t q0 = qbounds[size_t(qb)], m = qbounds[size_t(qb + 1)] - q0, t = floor_div(q0 + off, blk);
        thread_local std::vector<float> s, acc, mx, sum;
        s.resize(size_t(m * bw));
        acc.assign(size_t(m * Dv), 0.0f);
        mx.assign(size_t(m), kNegInf);
        sum.assign(size_t(m), 0.0f);
        const float* qt = &p.q[size_t(((b * p.Hq + h) * lq + q0) * D)];
        const int64_t* ch = sel.row(h, qb);
        for (int64_t x = 0; x < sel.width && ch[x] >= 0; ++x) {
          const int64_t kb = ch[x], j0 = kb * blk, n = std::min(blk, lk - j0);
          const float* ktb = &kt[size_t(kb * D * bw)];
          const float* vb = &p.v[size_t((bh * lk + j0) * Dv)];
          tiles::qk(qt, m, D, ktb, bw, n, p.scale, s.data());
          if (a.causal && kb == t)  // key j allowed iff j <= i + off
            for (int64_t r = 0; r < m; ++r)
              for (int64_t c = std::max<int64_t>(0, q0 + r + off - j0 + 1); c < n; ++c) s[size_t(r * n + c)] = kNegInf;
          if (p.invalid_in(b, j0, j0 + n) > 0)
            for (int64_t c = 0; c < n; ++c)
              if (!p.key_valid[size_t(b * lk + j0 + c)])
                for (int64_t r = 0; r < m; ++r) s[size_t(r * n + c)] = kNegInf;
          tiles::softmax_update(s.data(), m, n, mx.data(), sum.data(), acc.data(), Dv);
          tiles::pv(s.data(), m, n, vb, Dv, Dv, 1.0f, acc.data());
        }
        for (int64_t r = 0; r < m; ++r) {
          float* ar = &acc[size_t(r * Dv)];
          const bool empty = sum[size_t(r)] == 0.0f;
          const float inv = empty ? 0.0f : 1.0f / sum[size_t(r)];
          for (int64_t c = 0; c < Dv; ++c) ar[c] *= inv;
          detail::store_row(out, b, h, q0 + r, ar, Dv);
          if (lse.data) detail::store_value(lse, b, h, q0 + r, empty ? kNegInf : mx[size_t(r)] + std::log(sum[size_t(r)]));
        }
      };
      detail::parallel(p.group * nqb, p.threads, item);
    }
  }
}

// ---- ReLU attention ------------------------------------------------------------------------------------------------

inline float relu_pow(float s, double power) {
  if (!(s > 0.0f)) return 0.0f;
  return power == 2.0 ? s * s : power == 1.0 ? s : float(std::pow(double(s), power));
}
inline float relu_pow_grad(float s, double power) {  // d/ds relu(s)^power
  if (!(s > 0.0f)) return 0.0f;
  return power == 2.0 ? 2.0f * s : power == 1.0 ? 1.0f : float(power * std::pow(double(s), power - 1.0));
}

// out (fp32, [B, Hq, Lq, Dv] dense) of ReLU attention; also the per-row normaliser Z ([B, Hq, Lq]; 1 for "none").
void relu_forward(double power, int normalize, const Pattern& fixed, const TensorView& q, const TensorView& k,
                  const TensorView& v, const SparseOptions& o, std::vector<float>& out, std::vector<float>& z) {
  const int64_t lq = q.shape[2], lk = k.shape[2], hq = q.shape[1];
  const BlockMask bm = fixed_block_mask(fixed, lq, lk, hq, o.block);
  const detail::Packed p = detail::pack_inputs(q, k, v, bm, o, o.enable_gqa);
  const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, lq, lk};
  const int64_t nqb = bm.num_q_blocks(), D = p.D, Dv = p.Dv;
  out.assign(size_t(p.B * p.Hq * p.Lq * Dv), 0.0f);
  z.assign(size_t(p.B * p.Hq * p.Lq), 1.0f);
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
    const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
    thread_local detail::Scratch sc;
    sc.ensure(m, D, Dv);
    const float* qt = &p.q[size_t(((b * p.Hq + h) * p.Lq + q0) * D)];
    const float* kbase = &p.k[size_t((b * p.Hkv + hk) * p.Lk * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv + hk) * p.Lk * Dv)];
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
      const size_t orow = size_t((b * p.Hq + h) * p.Lq + i);
      float zr = 1.0f;
      if (normalize == 1) zr = sc.sum[r];
      if (normalize == 2) zr = float(count[size_t(r)]);
      z[orow] = zr;
      const float inv = normalize == 0 ? 1.0f : (zr > 0.0f ? 1.0f / zr : 0.0f);
      for (int64_t d = 0; d < Dv; ++d) out[orow * Dv + d] = sc.acc[size_t(r * Dv + d)] * inv;
    }
  };
  detail::parallel(p.B * p.Hq * nqb, p.threads, item);
}

// Adds the gradients of ReLU attention (given its out and Z) into dq/dk/dv (fp32 dense buffers).
void relu_backward(double power, int normalize, const Pattern& fixed, const TensorView& q, const TensorView& k,
                   const TensorView& v, const std::vector<float>& dout, const std::vector<float>& out,
                   const std::vector<float>& z, const SparseOptions& o, std::vector<float>& dq, std::vector<float>& dk,
                   std::vector<float>& dv) {
  const int64_t lq = q.shape[2], lk = k.shape[2], hq = q.shape[1];
  const BlockMask bm = fixed_block_mask(fixed, lq, lk, hq, o.block);
  const detail::Packed p = detail::pack_inputs(q, k, v, bm, o, o.enable_gqa);
  const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, lq, lk};
  const int64_t nqb = bm.num_q_blocks(), D = p.D, Dv = p.Dv;
  // One item per (b, kv head): serial over its query heads and blocks; owns dK/dV rows of that head.
  auto item = [&](int64_t it) {
    const int64_t b = it / p.Hkv, hk = it % p.Hkv;
    detail::Scratch sc;
    std::vector<float> dkl(static_cast<size_t>(p.Lk * D), 0.0f), dvl(static_cast<size_t>(p.Lk * Dv), 0.0f);
    const float* kbase = &p.k[size_t((b * p.Hkv + hk) * p.Lk * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv + hk) * p.Lk * Dv)];
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h)
      for (int64_t qb = 0; qb < nqb; ++qb) {
        const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
        sc.ensure(m, D, Dv);
        const float* qt = &p.q[size_t(((b * p.Hq + h) * p.Lq + q0) * D)];
        // Per row: dO_i / Z_i (in layout order), delta_i = dO_i·out_i / Z_i for "sum".
        std::vector<float> gz(static_cast<size_t>(m * Dv)), delta(static_cast<size_t>(m), 0.0f), dqt(static_cast<size_t>(m * D), 0.0f);
        for (int64_t r = 0; r < m; ++r) {
          const size_t orow = size_t((b * p.Hq + h) * p.Lq + bm.q_index(q0 + r));
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
          const size_t orow = size_t((b * p.Hq + h) * p.Lq + bm.q_index(q0 + r));
          for (int64_t d = 0; d < D; ++d) dq[orow * D + d] += dqt[size_t(r * D + d)];
        }
      }
    for (int64_t x = 0; x < p.Lk; ++x) {
      const size_t krow = size_t((b * p.Hkv + hk) * p.Lk + bm.k_index(x));
      for (int64_t d = 0; d < D; ++d) dk[krow * D + d] += dkl[size_t(x * D + d)];
      for (int64_t d = 0; d < Dv; ++d) dv[krow * Dv + d] += dvl[size_t(x * Dv + d)];
    }
  };
  detail::parallel(p.B * p.Hkv, p.threads, item);
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

// ---- entry points ------------------------------------------------------------------------------------------------

void adaptive_forward(const AdaptiveNode& a, const Pattern& fixed, const TensorView& q, const TensorView& k,
                      const TensorView& v, const SparseOptions& o, const TensorView& out, const TensorView& lse,
                      const TensorView& indices) {
  require_no_mods(o, a.repr().c_str());
  switch (a.kind) {
    case AdaptiveNode::kTopK: topk_forward(a, fixed, q, k, v, o, out, lse, indices); return;
    case AdaptiveNode::kBlockTopK: {
      if (!fixed.defined()) return blocktopk_forward_direct(a, q, k, v, o, out, lse, indices);
      blocktopk_run(a, fixed, q, k, v, o, indices, false,
                    [&](int64_t b, const BlockMask& bm, const SparseOptions& ob) {
                      block_sparse_attention(slice_batch(q, b), slice_batch(k, b), slice_batch(v, b), bm,
                                             BlockTopKMask{fixed.defined() ? &fixed.node() : nullptr, a.causal,
                                                           q.shape[2], k.shape[2]},
                                             NoScoreMod{}, ob, slice_batch(out, b), slice_batch(lse, b), ob.enable_gqa);
                    });
      return;
    }
    case AdaptiveNode::kReLU:
    case AdaptiveNode::kMixed: {
      check(!indices.data, ErrorKind::kInvalidArgument, "return_indices: ", a.repr(), " selects no keys");
      std::vector<float> o_relu, z;
      const bool mixed = a.kind == AdaptiveNode::kMixed;
      relu_forward(mixed ? 2.0 : a.power, mixed ? 0 : a.normalize, fixed, q, k, v, o, o_relu, z);
      if (!mixed) {
        check(out.data && out.dim() == 4 && out.shape == Shape({q.shape[0], q.shape[1], q.shape[2], v.shape[3]}),
              ErrorKind::kInvalidArgument, "out: expected shape ",
              shape_to_string({q.shape[0], q.shape[1], q.shape[2], v.shape[3]}), ", got ", shape_to_string(out.shape));
        store4(out, o_relu);
        if (lse.data) {  // no softmax: report log(Z) (log of the row sum; -inf for an empty row)
          for (int64_t b = 0; b < q.shape[0]; ++b)
            for (int64_t h = 0; h < q.shape[1]; ++h)
              for (int64_t i = 0; i < q.shape[2]; ++i)
                detail::store_value(lse, b, h, i, std::log(z[size_t((b * q.shape[1] + h) * q.shape[2] + i)]));
        }
        return;
      }
      double w1, w2;
      mixed_weights(a, w1, w2);
      const BlockMask bm = fixed_block_mask(fixed, q.shape[2], k.shape[2], q.shape[1], o.block);
      block_sparse_attention(q, k, v, bm, FixedMask{fixed.defined() ? &fixed.node() : nullptr, q.shape[2], k.shape[2]},
                             NoScoreMod{}, o, out, lse, o.enable_gqa);
      std::vector<float> o_soft = dense4(out);
      for (size_t x = 0; x < o_soft.size(); ++x) o_soft[x] = float(w1 * o_soft[x] + w2 * o_relu[x]);
      store4(out, o_soft);
      return;
    }
  }
}

void adaptive_backward(const AdaptiveNode& a, const Pattern& fixed, const TensorView& dout, const TensorView& q,
                       const TensorView& k, const TensorView& v, const TensorView& out, const TensorView& lse,
                       const SparseOptions& o, const SparseGrads& g, const TensorView& indices) {
  require_no_mods(o, a.repr().c_str());
  switch (a.kind) {
    case AdaptiveNode::kTopK: topk_backward(a, fixed, dout, q, k, v, lse, o, g, indices); return;
    case AdaptiveNode::kBlockTopK:
      blocktopk_run(a, fixed, q, k, v, o, indices, indices.data != nullptr,
                    [&](int64_t b, const BlockMask& bm, const SparseOptions& ob) {
                      block_sparse_attention_backward(
                          slice_batch(dout, b), slice_batch(q, b), slice_batch(k, b), slice_batch(v, b),
                          slice_batch(out, b), slice_batch(lse, b), bm,
                          BlockTopKMask{fixed.defined() ? &fixed.node() : nullptr, a.causal, q.shape[2], k.shape[2]},
                          NoScoreMod{}, ob, slice_batch(g.dq, b), slice_batch(g.dk, b), slice_batch(g.dv, b), nullptr,
                          ob.enable_gqa);
                    });
      return;
    case AdaptiveNode::kReLU:
    case AdaptiveNode::kMixed: {
      const bool mixed = a.kind == AdaptiveNode::kMixed;
      const BlockMask ident = Full().block_mask(q.shape[2], k.shape[2], 1, o.block);
      detail::Packed p = detail::pack_inputs(q, k, v, ident, o, o.enable_gqa);
      detail::check_grads(p, q, k, v, g.dq, g.dk, g.dv);
      check(dout.data && dout.shape == Shape({p.B, p.Hq, p.Lq, p.Dv}), ErrorKind::kInvalidArgument,
            "dout: expected shape ", shape_to_string({p.B, p.Hq, p.Lq, p.Dv}));
      std::vector<float> dq(p.q.size(), 0.0f), dk(p.k.size(), 0.0f), dv(p.v.size(), 0.0f);
      const std::vector<float> d_out = dense4(dout);
      std::vector<float> o_relu, z;
      relu_forward(mixed ? 2.0 : a.power, mixed ? 0 : a.normalize, fixed, q, k, v, o, o_relu, z);
      if (!mixed) {
        relu_backward(a.power, a.normalize, fixed, q, k, v, d_out, o_relu, z, o, dq, dk, dv);
      } else {
        double w1, w2;
        mixed_weights(a, w1, w2);
        // Recompute the softmax part (out and lse) and d(logits) = w ⊙ (g - w·g), g_c = sum(dout * out_c).
        const BlockMask bm = fixed_block_mask(fixed, q.shape[2], k.shape[2], q.shape[1], o.block);
        const FixedMask fm{fixed.defined() ? &fixed.node() : nullptr, q.shape[2], k.shape[2]};
        Tensor o_soft(DType::kF32, {p.B, p.Hq, p.Lq, p.Dv}), lse_soft(DType::kF32, {p.B, p.Hq, p.Lq});
        block_sparse_attention(q, k, v, bm, fm, NoScoreMod{}, o, o_soft, lse_soft, o.enable_gqa);
        double g1 = 0, g2 = 0;
        for (size_t x = 0; x < d_out.size(); ++x) {
          g1 += double(d_out[x]) * o_soft.data<float>()[x];
          g2 += double(d_out[x]) * o_relu[x];
        }
        if (g.dlogits.data) {
          check(g.dlogits.numel() == 2 && g.dlogits.dim() == 1, ErrorKind::kInvalidArgument,
                "dlogits: expected shape [2], got ", shape_to_string(g.dlogits.shape));
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
        Tensor d1t(DType::kF32, {p.B, p.Hq, p.Lq, p.Dv});
        std::copy(d1.begin(), d1.end(), d1t.data<float>());
        Tensor sq(DType::kF32, q.shape), sk(DType::kF32, k.shape), sv(DType::kF32, v.shape);
        block_sparse_attention_backward(d1t, q, k, v, o_soft, lse_soft, bm, fm, NoScoreMod{}, o, sq, sk, sv, nullptr,
                                        o.enable_gqa);
        relu_backward(2.0, 0, fixed, q, k, v, d2, o_relu, z, o, dq, dk, dv);
        for (size_t x = 0; x < dq.size(); ++x) dq[x] += sq.data<float>()[x];
        for (size_t x = 0; x < dk.size(); ++x) dk[x] += sk.data<float>()[x];
        for (size_t x = 0; x < dv.size(); ++x) dv[x] += sv.data<float>()[x];
      }
      store4(g.dq, dq);
      store4(g.dk, dk);
      store4(g.dv, dv);
      return;
    }
  }
}

Shape adaptive_indices_shape(const AdaptiveNode& a, int64_t B, int64_t hq, int64_t lq, int64_t lk) {
  if (a.kind == AdaptiveNode::kTopK) return {B, hq, lq, a.k};
  if (a.kind == AdaptiveNode::kBlockTopK) return {B, hq, blocktopk_nqb(a, lq, lk), a.k_blocks};
  return {};
}

}  // namespace sattn::sparse
