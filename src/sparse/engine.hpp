// The block-sparse attention engine (FlexAttention's semantics on a CPU, no JIT): a BlockMask says which
// (query block, key range) tiles to visit; mask_mod(b, h, i, j) -> bool is evaluated only inside partial ranges;
// score_mod transforms each computed score. Both are C++ callables inlined into the tile loop.
//
// Shapes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (any strides, f32/f64/bf16/f16),
// out [B, Hq, Lq, Dv], lse [B, Hq, Lq] (optional). Query head h reads kv head h / (Hq / Hkv).
// Rows with no allowed key: out = 0, lse = -inf, zero gradients. Rows with a NaN among their allowed scores: out and
// lse NaN, NaN gradients through their allowed keys only (never across a mask). Deterministic: every output
// element has one writer (forward: per query block; backward: dK/dV per key block, dQ per query block, in separate
// passes) and the work split does not depend on the thread count.
//
// MaskMod: bool operator()(b, h, i, j) (original indices); optionally
//   bool interval(b, h, i, kp0, kp1, int64_t& lo, int64_t& hi) const: the allowed layout key positions of row i in
//   [kp0, kp1) are exactly [lo, hi) ∩ [kp0, kp1) (return false to fall back to the per-pair predicate).
// ScoreMod concept (see NoScoreMod):
//   bool identity() const;                                   // true: skip the score_mod entirely
//   float operator()(float s, int64_t b, int64_t h, int64_t i, int64_t j) const;
//   float backward(float s, float ds, int64_t b, int64_t h, int64_t i, int64_t j, float* param_grad) const;
//       // d(loss)/d(s) given d(loss)/d(score_mod(s)); adds parameter gradients into param_grad
//   int64_t num_params() const;                              // size of param_grad (0: none)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "core/workspace.hpp"
#include "sattn/patterns.hpp"
#include "sattn/sparse.hpp"  // EngineOptions
#include "sattn/tensor.hpp"
#include "sparse/problem_sizes.hpp"
#include "sparse/tiles.hpp"

namespace sattn::sparse {

struct NoScoreMod {
  bool identity() const { return true; }
  float operator()(float s, int64_t, int64_t, int64_t, int64_t) const { return s; }
  float backward(float, float ds, int64_t, int64_t, int64_t, int64_t, float*) const { return ds; }
  int64_t num_params() const { return 0; }
};

struct AllowAll {
  bool operator()(int64_t, int64_t, int64_t, int64_t) const { return true; }
};

namespace detail {

// A read-only fp32 array [B, H, L, D] in layout order: a view of the caller's tensor when that already is fp32,
// contiguous and in layout order (no copy), else an owned packed copy.
struct FloatBuf {
  WorkspaceVector<float> own;
  const float* ptr = nullptr;
  size_t n = 0;
  FloatBuf() = default;
  FloatBuf(FloatBuf&&) = default;  // the vector's storage moves with it: ptr stays valid
  FloatBuf& operator=(FloatBuf&&) = default;
  FloatBuf(const FloatBuf& o) : own(o.own), ptr(o.own.empty() ? o.ptr : own.data()), n(o.n) {}
  FloatBuf& operator=(const FloatBuf& o) {
    own = o.own;
    ptr = o.own.empty() ? o.ptr : own.data();
    n = o.n;
    return *this;
  }
  const float& operator[](size_t i) const { return ptr[i]; }
  const float* data() const { return ptr; }
  size_t size() const { return n; }
};

// Inputs validated once (the problem: sizes, scale, key padding) and packed once: fp32, contiguous, in the block
// mask's layout order.
struct Packed : ProblemSizes {
  float scale = 1.0f;  // problem.scale in fp32, the factor of the tile products
  int threads = 1;
  FloatBuf q, k, v;                         // [B, Hq, Lq, D], [B, Hkv, Lk, D], [B, Hkv, Lk, Dv]
  std::vector<uint8_t> key_valid;           // [B, Lk] layout order (empty: no padding)
  std::vector<int32_t> key_invalid_prefix;  // [B, Lk + 1] prefix counts of padding keys
  FloatBuf dout;                            // backward only: [B, Hq, Lq, Dv]
  std::vector<float> lse, delta;            // backward only: [B, Hq, Lq], [B, Hq, Lq]
  int64_t invalid_in(int64_t b, int64_t lo, int64_t hi) const {
    if (key_invalid_prefix.empty()) return 0;
    const int32_t* p = &key_invalid_prefix[size_t(b * (Lk() + 1))];
    return p[hi] - p[lo];
  }
};

// The problem of a sparse call: describe_attention with the options' scale and key padding (validated there),
// plus the sparse entries' own rule that Hq may differ from Hkv only with enable_gqa.
AttentionProblem describe_inputs(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const EngineOptions& options, bool enable_gqa);
// Checks the block mask against the problem (from describe_inputs(q, k, v, options, ...)) and packs q, k, v and
// the key padding in the mask's layout order.
Packed pack_inputs(const AttentionProblem& problem, const TensorView& q, const TensorView& k, const TensorView& v,
                   const BlockMask& mask, const EngineOptions& options);
inline Packed pack_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
                          const EngineOptions& options, bool enable_gqa) {
  return pack_inputs(describe_inputs(q, k, v, options, enable_gqa), q, k, v, mask, options);
}
// Backward extras: validates and packs dout, lse (layout order) and delta = rowsum(dout * out).
void pack_backward(Packed& p, const BlockMask& mask, const TensorView& dout, const TensorView& out,
                   const TensorView& lse);
void check_outputs(const Packed& p, const TensorView& out, const TensorView& lse);
void check_grads(const Packed& p, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& dq,
                 const TensorView& dk, const TensorView& dv);
// Stores n floats into row (b, h, i, :) of a 4-D float view (any float dtype / strides); or one value of a 3-D view.
void store_row(const TensorView& t, int64_t b, int64_t h, int64_t i, const float* src, int64_t n);
void store_value(const TensorView& t, int64_t b, int64_t h, int64_t i, float value);
// Runs fn(ctx, item) for item in [0, n) on up to `threads` threads (OpenMP, no oversubscription).
void run_parallel(int64_t n, int threads, void* ctx, void (*fn)(void*, int64_t));
// Whether a forward takes the bf16 products (tiles.hpp): a build that has them, q, k and v in bf16 or float32, and
// rounding allowed: bf16 inputs with a bf16 out, or EngineOptions::float32_precision = kBF16.
bool forward_takes_bf16_pairs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              const EngineOptions& options);
// Whether a backward may take the bf16 products (all five: P and dS rounded to bf16 once, as the fused kernel's bf16
// backward): a build that has them, q, k and v in bf16 or float32, and rounding allowed: bf16 inputs with bf16
// gradients dq, dk, dv, or EngineOptions::float32_precision = kBF16. (The engine also requires an identity score mod.)
bool backward_takes_bf16_pairs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const EngineOptions& options);
// Rows [rows x width] of floats as bf16 pairs along the row (tiles::pack_pairs_along_rows): out[r·W2 + y] = (x[r, 2y],
// x[r, 2y+1]), W2 = ⌈width/2⌉, the second half of an odd width's last word 0 (the forward's bf16 products).
WorkspaceVector<uint32_t> pairs_along_rows(const float* x, int64_t rows, int64_t width);

// Splits the query blocks into runs of consecutive blocks (whose key hulls overlap heavily) and colours the runs so
// that the runs of one colour read disjoint key positions (their key hulls, over every head slot, do not overlap):
// colour c holds the runs x in [colour_start[c], colour_start[c+1]), each the blocks [runs[x], run_ends[x]).
// Returns false when that would take more than max(1, batch_heads · num_q_blocks / 8) colours
// (SATTN_SPARSE_BACKWARD=two_pass: always false; =one_pass: no limit): then the backward runs its two-pass form.
// Depends only on the block mask and batch_heads (= B · Hkv).
bool colour_query_blocks(const BlockMask& bm, int64_t batch_heads, std::vector<int64_t>& colour_start,
                         std::vector<int32_t>& runs, std::vector<int32_t>& run_ends);

template <typename F>
void parallel(int64_t n, int threads, F& f) {
  run_parallel(n, threads, &f, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); });
}

constexpr int64_t kChunk = 64;  // keys per computed chunk

// A chunk of keys assembled from consecutive key ranges of one query block.
struct Segment {
  int32_t begin, end, col;  // layout key positions [begin, end), first column in the chunk
  bool full;
  uint16_t q_lo = 0, q_hi = 0;  // the ranges' query rows (KeyRange::q_lo/q_hi; the same for the whole chunk)
  int64_t q_first(int64_t m) const { return q_lo < m ? int64_t(q_lo) : m; }
  int64_t q_last(int64_t m) const { return q_hi == 0 || q_hi > m ? m : int64_t(q_hi); }
};

// Per-thread scratch of the bf16 products of one query block (tiles.hpp), in words: Q2^T [D2 x ldq], a chunk's K
// rows in pairs [n x D2] when it has several ranges, its V in pairs across keys [⌈n/2⌉ x Dvp] and P in pairs
// [m x ⌈n/2⌉], for chunks of at most n keys.
struct PairScratch {
  std::vector<uint32_t> q2t, qw, k2, v2, p2;  // qw: the query rows in pairs [m x D2], before their transpose
  int64_t ldq = 0;
  void ensure(int64_t m, int64_t D2, int64_t Dvp, int64_t n = kChunk) {
    ldq = (m + 15) / 16 * 16 + 16;  // B operand rows are read in whole vectors from any query column
    q2t.assign(size_t(D2 * ldq), 0u);
    k2.resize(size_t(n * D2)), v2.resize(size_t((n + 1) / 2 * Dvp)), p2.resize(size_t(m * ((n + 1) / 2)));
  }
};
// X2^T of rows x [m x width] into dst [⌈width/2⌉ x ldq] words: (x[i, 2y], x[i, 2y+1]) rounded to bf16 at row y,
// column i (work: the rows in pairs, before their transpose).
inline void pack_transposed_pairs(const float* x, int64_t m, int64_t width, int64_t ldq, std::vector<uint32_t>& work,
                                  uint32_t* dst) {
  const int64_t w2 = (width + 1) / 2;
  work.resize(size_t(m * w2));
  tiles::pack_pairs_along_rows(x, width, m, width, work.data(), w2);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t y = 0; y < w2; ++y) dst[y * ldq + i] = work[size_t(i * w2 + y)];
}
// Q2^T of query rows q [m x D] into ps.q2t.
inline void pack_query_pairs(const float* q, int64_t m, int64_t D, PairScratch& ps) {
  pack_transposed_pairs(q, m, D, ps.ldq, ps.qw, ps.q2t.data());
}

// Per-thread scratch of the backward's bf16 products for up to m query rows and a chunk of keys (tiles.hpp), in
// words: Q^T and dO^T in pairs along D / Dv [⌈D/2⌉ or ⌈Dv/2⌉ x ldq]; a chunk's K and V rows in pairs along D / Dv
// when it has several ranges; K in pairs across keys [⌈n/2⌉ x Dp]; the computed rows of Q and dO in pairs across
// rows [⌈mm/2⌉ x Dp or Dvp]; dS in pairs along keys and Aᵀ in pairs across rows (pv_pairs', atx_pairs' scratch);
// S^T or dP^T as floats [n x mm] (st). Dp, Dvp: D, Dv rounded up to 16.
struct BackwardPairScratch {
  std::vector<uint32_t> q2t, do2t, work, k2, v2, kx, qx, dox, p2, a2;
  std::vector<float> st;
  int64_t ldq = 0;
  void ensure(int64_t m, int64_t D, int64_t Dv) {
    const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2, Dp = (D + 15) / 16 * 16, Dvp = (Dv + 15) / 16 * 16;
    const int64_t m2 = (m + 1) / 2, n2 = (kChunk + 1) / 2;
    ldq = (m + 15) / 16 * 16 + 16;  // B operand rows are read in whole vectors from any query column
    q2t.assign(size_t(D2 * ldq), 0u), do2t.assign(size_t(Dv2 * ldq), 0u);
    k2.resize(size_t(kChunk * D2)), v2.resize(size_t(kChunk * Dv2)), kx.resize(size_t(n2 * Dp));
    qx.resize(size_t(m2 * Dp)), dox.resize(size_t(m2 * Dvp)), p2.resize(size_t(m * n2));
    a2.resize(size_t(m2 * ((kChunk + 15) / 16 * 16))), st.resize(size_t(kChunk * m));
  }
};

// Per-thread scratch of one query block.
struct Scratch {
  std::vector<float> s, p2, kt, vt, kc, vc, acc, mx, sum, dq;
  void ensure(int64_t m, int64_t D, int64_t Dv) {
    const size_t tile = size_t(m * kChunk);
    if (s.size() < tile) s.resize(tile), p2.resize(tile);
    kt.resize(size_t(D * kChunk)), vt.resize(size_t(Dv * kChunk));
    kc.resize(size_t(kChunk * D)), vc.resize(size_t(kChunk * Dv));
    acc.resize(size_t(m * std::max(D, Dv))), mx.resize(size_t(m)), sum.resize(size_t(m)), dq.resize(size_t(m * D));
  }
};

// Walks the key ranges [r0, r1) of a query block in chunks of at most kChunk keys: calls
// f(segments, nseg, n) with the chunk's segments (consecutive ranges with the same query rows are packed together).
template <typename F>
void for_each_chunk(const KeyRange* ranges, int64_t count, F&& f) {
  Segment segs[kChunk];
  int64_t nseg = 0, n = 0;
  for (int64_t r = 0; r < count; ++r) {
    if (n > 0 && (ranges[r].q_lo != segs[0].q_lo || ranges[r].q_hi != segs[0].q_hi)) {
      f(segs, nseg, n);
      nseg = 0;
      n = 0;
    }
    int32_t b = ranges[r].begin;
    while (b < ranges[r].end) {
      const int32_t e = int32_t(std::min<int64_t>(ranges[r].end, b + (kChunk - n)));
      segs[nseg++] = {b, e, int32_t(n), ranges[r].full != 0, ranges[r].q_lo, ranges[r].q_hi};
      n += e - b;
      b = e;
      if (n == kChunk) {
        f(segs, nseg, n);
        nseg = 0;
        n = 0;
      }
    }
  }
  if (n > 0) f(segs, nseg, n);
}

// Gathers a chunk's K rows transposed into kt [D x n] and (if need_vt) V rows transposed into vt [Dv x n]; returns
// the chunk's V rows [n x Dv] (in place when the chunk is one range, else copied into vc; nullptr when need_vt and
// the chunk has several ranges: V is then transposed straight from its rows, never copied) and, if kptr, its K
// rows. Several ranges' K rows are first copied row by row (contiguous memcpy) and then transposed as one block.
inline const float* gather_chunk(const Segment* segs, int64_t nseg, int64_t n, const float* kbase, const float* vbase,
                                 int64_t D, int64_t Dv, Scratch& sc, bool need_kc, const float** kptr, bool need_vt) {
  (void)need_kc;
  if (nseg == 1) {
    const float* kp = kbase + int64_t(segs[0].begin) * D;
    const float* vp = vbase + int64_t(segs[0].begin) * Dv;
    tiles::transpose_rows(kp, D, n, D, sc.kt.data(), n);
    if (need_vt) tiles::transpose_rows(vp, Dv, n, Dv, sc.vt.data(), n);
    if (kptr) *kptr = kp;
    return vp;
  }
  for (int64_t x = 0; x < nseg; ++x) {
    const int64_t len = segs[x].end - segs[x].begin;
    if (need_vt) tiles::transpose_rows(vbase + int64_t(segs[x].begin) * Dv, Dv, len, Dv, sc.vt.data() + segs[x].col, n);
    else std::copy_n(vbase + int64_t(segs[x].begin) * Dv, len * Dv, sc.vc.data() + int64_t(segs[x].col) * Dv);
    std::copy_n(kbase + int64_t(segs[x].begin) * D, len * D, sc.kc.data() + int64_t(segs[x].col) * D);
  }
  tiles::transpose_rows(sc.kc.data(), D, n, D, sc.kt.data(), n);
  if (kptr) *kptr = sc.kc.data();
  return need_vt ? nullptr : sc.vc.data();
}

// Applies score_mod to the raw scores (keeping them in raw) and the masks (mask_mod on partial segments,
// key padding) to a chunk's score tile s [m x n]; masked entries become -inf.
template <typename MaskMod, typename ScoreMod>
void mod_and_mask(float* s, float* raw, int64_t m, int64_t n, const Segment* segs, int64_t nseg, const BlockMask& bm,
                  int64_t q0, int64_t b, int64_t h, const Packed& p, MaskMod& mask_mod, const ScoreMod& score_mod) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (!score_mod.identity()) {
    if (raw) std::copy_n(s, m * n, raw);
    for (int64_t x = 0; x < nseg; ++x)
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = bm.q_index(q0 + r);
        float* sr = s + r * n + segs[x].col - segs[x].begin;
        for (int32_t kp = segs[x].begin; kp < segs[x].end; ++kp) sr[kp] = score_mod(sr[kp], b, h, i, bm.k_index(kp));
      }
  }
  for (int64_t x = 0; x < nseg; ++x) {
    const Segment& g = segs[x];
    if (!g.full)
      for (int64_t r = 0; r < m; ++r) {
        const int64_t i = bm.q_index(q0 + r);
        float* sr = s + r * n + g.col - g.begin;
        // Fast path: a mask_mod that can state the row's allowed layout positions as an interval [lo, hi).
        if constexpr (requires(int64_t x) { mask_mod.interval(b, h, i, x, x, x, x); }) {
          int64_t lo = 0, hi = 0;
          if (mask_mod.interval(b, h, i, g.begin, g.end, lo, hi)) {
            for (int32_t kp = g.begin; kp < g.end; ++kp)
              if (kp < lo || kp >= hi) sr[kp] = kNegInf;
            continue;
          }
        }
        for (int32_t kp = g.begin; kp < g.end; ++kp)
          if (!mask_mod(b, h, i, int64_t(bm.k_index(kp)))) sr[kp] = kNegInf;
      }
    if (p.invalid_in(b, g.begin, g.end) > 0) {
      const uint8_t* valid = &p.key_valid[size_t(b * p.Lk())];
      for (int32_t kp = g.begin; kp < g.end; ++kp)
        if (!valid[kp])
          for (int64_t r = 0; r < m; ++r) s[r * n + g.col + (kp - g.begin)] = kNegInf;
    }
  }
}

}  // namespace detail

// Forward. mask_mod: bool(b, h, i, j) on original indices, consulted only in partial ranges. out/lse: see top.
// problem: detail::describe_inputs(q, k, v, options, enable_gqa) (the overload below builds it).
template <typename MaskMod, typename ScoreMod = NoScoreMod>
void block_sparse_attention(const AttentionProblem& problem, const TensorView& q, const TensorView& k,
                            const TensorView& v, const BlockMask& bm, MaskMod mask_mod, const ScoreMod& score_mod,
                            const EngineOptions& options, const TensorView& out, const TensorView& lse = {}) {
  using namespace detail;
  const Packed p = pack_inputs(problem, q, k, v, bm, options);
  check_outputs(p, out, lse);
  const int64_t nqb = bm.num_q_blocks(), D = p.D(), Dv = p.Dv(), group = p.group();
  // On the bf16 products (forward_takes_bf16_pairs): S and P·V on bf16 pairs (tiles.hpp), K in pairs along D once
  // per call, Q^T per query block, V per chunk.
  const bool pairs = forward_takes_bf16_pairs(q, k, v, out, options);
  const int64_t D2 = (D + 1) / 2, Dvp = (Dv + 15) / 16 * 16;
  const WorkspaceVector<uint32_t> k2 =
      pairs ? pairs_along_rows(p.k.data(), p.B() * p.Hkv() * p.Lk(), D) : WorkspaceVector<uint32_t>();
  auto item = [&](int64_t it) {
    const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq(), h = bh % p.Hq(), hk = h / group;
    const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
    thread_local Scratch sc;
    sc.ensure(m, D, Dv);
    const float* qt = &p.q[size_t(((b * p.Hq() + h) * p.Lq() + q0) * D)];
    const float* kbase = &p.k[size_t((b * p.Hkv() + hk) * p.Lk() * D)];
    const float* vbase = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
    std::fill_n(sc.acc.data(), m * Dv, 0.0f);
    std::fill_n(sc.mx.data(), m, -std::numeric_limits<float>::infinity());
    std::fill_n(sc.sum.data(), m, 0.0f);
    thread_local PairScratch ps;
    const uint32_t* k2base = nullptr;
    if (pairs) {
      ps.ensure(m, D2, Dvp);
      pack_query_pairs(qt, m, D, ps);
      k2base = k2.data() + (b * p.Hkv() + hk) * p.Lk() * D2;
    }
    const int64_t row = bm.slot(h) * nqb + qb;
    for_each_chunk(
        &bm.ranges[size_t(bm.row_ptr[row])], bm.row_ptr[row + 1] - bm.row_ptr[row],
        [&](const Segment* segs, int64_t nseg, int64_t n) {
          if (!p.key_invalid_prefix.empty()) {  // skip chunks that are all padding
            int64_t inv = 0;
            for (int64_t x = 0; x < nseg; ++x) inv += p.invalid_in(b, segs[x].begin, segs[x].end);
            if (inv == n) return;
          }
          const int64_t qa = segs[0].q_first(m), mm = segs[0].q_last(m) - qa;  // computed rows
          if (mm <= 0) return;
          if (pairs) {
            const uint32_t* kr = k2base + int64_t(segs[0].begin) * D2;
            const float* vr = vbase + int64_t(segs[0].begin) * Dv;
            if (nseg > 1) {  // the ranges' rows back to back
              for (int64_t x = 0; x < nseg; ++x) {
                const int64_t len = segs[x].end - segs[x].begin;
                std::copy_n(k2base + int64_t(segs[x].begin) * D2, len * D2, ps.k2.data() + int64_t(segs[x].col) * D2);
                std::copy_n(vbase + int64_t(segs[x].begin) * Dv, len * Dv, sc.vc.data() + int64_t(segs[x].col) * Dv);
              }
              kr = ps.k2.data(), vr = sc.vc.data();
            }
            tiles::pack_pairs_across_rows(vr, Dv, n, Dv, ps.v2.data(), Dvp);
            tiles::kq_pairs(kr, n, D2, ps.q2t.data() + qa, ps.ldq, mm, p.scale, sc.p2.data(), mm);
            tiles::transpose_rows(sc.p2.data(), mm, n, mm, sc.s.data(), n);  // S^T -> S [mm x n]
            mod_and_mask(sc.s.data(), nullptr, mm, n, segs, nseg, bm, q0 + qa, b, h, p, mask_mod, score_mod);
            tiles::softmax_update(sc.s.data(), mm, n, sc.mx.data() + qa, sc.sum.data() + qa, sc.acc.data() + qa * Dv,
                                  Dv);
            tiles::pv_pairs(sc.s.data(), mm, n, ps.v2.data(), Dvp, Dv, ps.p2.data(), sc.acc.data() + qa * Dv);
            return;
          }
          const float* vp = gather_chunk(segs, nseg, n, kbase, vbase, D, Dv, sc, false, nullptr, false);
          const int64_t ldv = Dv;
          tiles::qk(qt + qa * D, mm, D, sc.kt.data(), n, n, p.scale, sc.s.data());
          mod_and_mask(sc.s.data(), nullptr, mm, n, segs, nseg, bm, q0 + qa, b, h, p, mask_mod, score_mod);
          tiles::softmax_update(sc.s.data(), mm, n, sc.mx.data() + qa, sc.sum.data() + qa, sc.acc.data() + qa * Dv, Dv);
          tiles::pv(sc.s.data(), mm, n, vp, ldv, Dv, 1.0f, sc.acc.data() + qa * Dv);
        });
    for (int64_t r = 0; r < m; ++r) {
      const int64_t i = bm.q_index(q0 + r);
      float* ar = sc.acc.data() + r * Dv;
      const bool empty = sc.sum[r] == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / sc.sum[r];
      for (int64_t c = 0; c < Dv; ++c) ar[c] *= inv;
      store_row(out, b, h, i, ar, Dv);
      if (lse.data)
        store_value(lse, b, h, i, empty ? -std::numeric_limits<float>::infinity() : sc.mx[r] + std::log(sc.sum[r]));
    }
  };
  parallel(p.B() * p.Hq() * nqb, p.threads, item);
}

template <typename MaskMod, typename ScoreMod = NoScoreMod>
void block_sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& bm,
                            MaskMod mask_mod, const ScoreMod& score_mod, const EngineOptions& options,
                            const TensorView& out, const TensorView& lse = {}, bool enable_gqa = true) {
  block_sparse_attention(detail::describe_inputs(q, k, v, options, enable_gqa), q, k, v, bm, mask_mod, score_mod,
                         options, out, lse);
}

namespace detail {

// P and dS of a chunk on the bf16 products (backward_takes_bf16_pairs): S^T = scale·K2·Q2^T and dP^T = V2·dO2^T
// (kr, vr: the chunk's K and V rows in pairs along D and Dv; q2t, do2t: its computed query rows' columns of Q2^T and
// dO2^T, row stride ldq), transposed into s and dp [mm x n] through st; the masks; P = exp(S - lse) in s and
// dS = P ⊙ (dP - Di) in dp. Rows from i0 (the layout position of the first computed row).
template <typename MaskMod, typename ScoreMod>
void chunk_grads_pairs(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod,
                       const uint32_t* kr, const uint32_t* vr, const uint32_t* q2t, const uint32_t* do2t, int64_t ldq,
                       int64_t mm, int64_t n, const Segment* segs, int64_t nseg, int64_t i0, int64_t b, int64_t h,
                       const float* lse, const float* delta, float* st, float* s, float* dp) {
  const int64_t D2 = (p.D() + 1) / 2, Dv2 = (p.Dv() + 1) / 2;
  tiles::kq_pairs(kr, n, D2, q2t, ldq, mm, p.scale, st, mm);
  tiles::transpose_rows(st, mm, n, mm, s, n);  // S^T -> S [mm x n]
  mod_and_mask(s, nullptr, mm, n, segs, nseg, bm, i0, b, h, p, mask_mod, score_mod);
  tiles::probabilities(s, mm, n, lse);
  tiles::kq_pairs(vr, n, Dv2, do2t, ldq, mm, 1.0f, st, mm);
  tiles::transpose_rows(st, mm, n, mm, dp, n);  // dP^T -> dP
  tiles::softmax_backward(s, dp, mm, n, delta);
}

// A chunk's K and V rows in pairs along D and Dv, and its K rows as floats: in place for one range, else the
// ranges' rows copied back to back into ps.k2, ps.v2 and sc.kc.
struct ChunkRows {
  const uint32_t* k2;
  const uint32_t* v2;
  const float* k;
};
inline ChunkRows chunk_rows_pairs(const Segment* segs, int64_t nseg, const uint32_t* k2base, const uint32_t* v2base,
                                  const float* kbase, int64_t D, int64_t Dv, BackwardPairScratch& ps, Scratch& sc) {
  const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2;
  if (nseg == 1) {
    const int64_t j = segs[0].begin;
    return {k2base + j * D2, v2base + j * Dv2, kbase + j * D};
  }
  for (int64_t x = 0; x < nseg; ++x) {
    const int64_t len = segs[x].end - segs[x].begin, col = segs[x].col, j = segs[x].begin;
    std::copy_n(k2base + j * D2, len * D2, ps.k2.data() + col * D2);
    std::copy_n(v2base + j * Dv2, len * Dv2, ps.v2.data() + col * Dv2);
    std::copy_n(kbase + j * D, len * D, sc.kc.data() + col * D);
  }
  return {ps.k2.data(), ps.v2.data(), sc.kc.data()};
}

// One-pass backward, one query block qb of (b, kv head hk): recomputes P and dS once per chunk, writes dQ of the
// block's rows (every query head of the group) and adds dK/dV into the layout-order key gradients gk, gv. k2, v2
// (every key's K and V rows in pairs along D and Dv, pairs_along_rows, in the layout order; or null): the five
// products on bf16 pairs with float32 sums, P and dS rounded to bf16 once; the same chunks, masks and order of sums.
template <typename MaskMod, typename ScoreMod>
void one_pass_block(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod,
                    const TensorView& dq, int64_t qb, int64_t b, int64_t hk, float* gk, float* gv, const uint32_t* k2,
                    const uint32_t* v2) {
  const int64_t nqb = bm.num_q_blocks(), D = p.D(), Dv = p.Dv(), group = p.group();
  const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2, Dp = (D + 15) / 16 * 16, Dvp = (Dv + 15) / 16 * 16;
  const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
  thread_local Scratch sc;
  thread_local BackwardPairScratch ps;
  thread_local std::vector<float> dkc, dvc;
  sc.ensure(m, D, Dv);
  if (k2) ps.ensure(m, D, Dv);
  dkc.resize(size_t(kChunk * D));
  dvc.resize(size_t(kChunk * Dv));
  const size_t kv0 = size_t((b * p.Hkv() + hk) * p.Lk());
  const float* kbase = &p.k[kv0 * D];
  const float* vbase = &p.v[kv0 * Dv];
  float* gkb = &gk[kv0 * D];
  float* gvb = &gv[kv0 * Dv];
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const size_t qrow = size_t((b * p.Hq() + h) * p.Lq() + q0);
    const float* qt = &p.q[qrow * D];
    const float* dot = &p.dout[qrow * Dv];
    const float* lse_t = &p.lse[qrow];
    const float* delta = &p.delta[qrow];
    if (k2) {
      pack_transposed_pairs(qt, m, D, ps.ldq, ps.work, ps.q2t.data());
      pack_transposed_pairs(dot, m, Dv, ps.ldq, ps.work, ps.do2t.data());
    }
    int64_t packed_qa = -1, packed_mm = -1;  // the rows of Q and dO in ps.qx, ps.dox
    std::fill_n(sc.dq.data(), m * D, 0.0f);
    const int64_t row = bm.slot(h) * nqb + qb;
    for_each_chunk(
        &bm.ranges[size_t(bm.row_ptr[row])], bm.row_ptr[row + 1] - bm.row_ptr[row],
        [&](const Segment* segs, int64_t nseg, int64_t n) {
          const int64_t qa = segs[0].q_first(m), mm = segs[0].q_last(m) - qa;  // computed rows
          if (mm <= 0) return;
          const float* qa_t = qt + qa * D;
          const float* qa_do = dot + qa * Dv;
          float* s = sc.s.data();
          float* dp = sc.p2.data();
          // dV and dK of the chunk's keys: in place for contiguous keys, else in dvc, dkc, added per range below
          float* ov = nseg == 1 ? gvb + int64_t(segs[0].begin) * Dv : dvc.data();
          float* ok = nseg == 1 ? gkb + int64_t(segs[0].begin) * D : dkc.data();
          if (nseg > 1) std::fill_n(dvc.data(), n * Dv, 0.0f), std::fill_n(dkc.data(), n * D, 0.0f);
          if (k2) {
            const ChunkRows cr = chunk_rows_pairs(segs, nseg, k2 + kv0 * D2, v2 + kv0 * Dv2, kbase, D, Dv, ps, sc);
            chunk_grads_pairs(p, bm, mask_mod, score_mod, cr.k2, cr.v2, ps.q2t.data() + qa, ps.do2t.data() + qa, ps.ldq,
                              mm, n, segs, nseg, q0 + qa, b, h, lse_t + qa, delta + qa, ps.st.data(), s, dp);
            // dQ without the scale (applied once when stored): dS · K, K in pairs across the keys
            tiles::pack_pairs_across_rows(cr.k, D, n, D, ps.kx.data(), Dp);
            tiles::pv_pairs(dp, mm, n, ps.kx.data(), Dp, D, ps.p2.data(), sc.dq.data() + qa * D);
            if (qa != packed_qa || mm != packed_mm) {
              tiles::pack_pairs_across_rows(qa_t, D, mm, D, ps.qx.data(), Dp);
              tiles::pack_pairs_across_rows(qa_do, Dv, mm, Dv, ps.dox.data(), Dvp);
              packed_qa = qa, packed_mm = mm;
            }
            tiles::atx_pairs(s, mm, n, ps.dox.data(), Dvp, Dv, 1.0f, ps.a2.data(), ov, Dv);
            tiles::atx_pairs(dp, mm, n, ps.qx.data(), Dp, D, p.scale, ps.a2.data(), ok, D);
          } else {
            const float* kp = nullptr;
            gather_chunk(segs, nseg, n, kbase, vbase, D, Dv, sc, true, &kp, true);
            tiles::qk(qa_t, mm, D, sc.kt.data(), n, n, p.scale, s);
            mod_and_mask(s, nullptr, mm, n, segs, nseg, bm, q0 + qa, b, h, p, mask_mod, score_mod);
            tiles::probabilities(s, mm, n, lse_t + qa);
            tiles::qk(qa_do, mm, Dv, sc.vt.data(), n, n, 1.0f, dp);
            tiles::softmax_backward(s, dp, mm, n, delta + qa);
            tiles::pv(dp, mm, n, kp, D, D, p.scale, sc.dq.data() + qa * D);
            tiles::atx(s, mm, n, qa_do, Dv, Dv, 1.0f, ov);
            tiles::atx(dp, mm, n, qa_t, D, D, p.scale, ok);
          }
          for (int64_t g = 0; nseg > 1 && g < nseg; ++g) {
            const int64_t len = segs[g].end - segs[g].begin;
            float* tv = gvb + int64_t(segs[g].begin) * Dv;
            const float* iv = dvc.data() + int64_t(segs[g].col) * Dv;
            for (int64_t e = 0; e < len * Dv; ++e) tv[e] += iv[e];
            float* tk = gkb + int64_t(segs[g].begin) * D;
            const float* ik = dkc.data() + int64_t(segs[g].col) * D;
            for (int64_t e = 0; e < len * D; ++e) tk[e] += ik[e];
          }
        });
    if (k2)
      for (int64_t e = 0; e < m * D; ++e) sc.dq[size_t(e)] *= p.scale;
    for (int64_t r = 0; r < m; ++r) store_row(dq, b, h, bm.q_index(q0 + r), sc.dq.data() + r * D, D);
  }
}

// Stores the layout-order key gradients gk [B, Hkv, Lk, D], gv [B, Hkv, Lk, Dv] into dk, dv.
inline void store_key_grads(const Packed& p, const BlockMask& bm, const float* gk, const float* gv,
                            const TensorView& dk, const TensorView& dv) {
  const int64_t D = p.D(), Dv = p.Dv();
  auto store = [&](int64_t bhk) {
    const int64_t b = bhk / p.Hkv(), hk = bhk % p.Hkv();
    const size_t kv0 = size_t(bhk * p.Lk());
    // Keys in their own order and fp32 outputs with contiguous rows: one copy per (b, kv head).
    const auto contiguous = [&](const TensorView& t, int64_t d) {
      return t.dtype == DType::kF32 && (d == 1 || t.strides[3] == 1) && (p.Lk() == 1 || t.strides[2] == d);
    };
    if (bm.k_perm.empty() && contiguous(dk, D) && contiguous(dv, Dv)) {
      std::copy_n(&gk[kv0 * size_t(D)], p.Lk() * D,
                  static_cast<float*>(dk.data) + b * dk.strides[0] + hk * dk.strides[1]);
      std::copy_n(&gv[kv0 * size_t(Dv)], p.Lk() * Dv,
                  static_cast<float*>(dv.data) + b * dv.strides[0] + hk * dv.strides[1]);
      return;
    }
    for (int64_t kp = 0; kp < p.Lk(); ++kp) {
      const int64_t j = bm.k_index(kp);
      store_row(dk, b, hk, j, &gk[(kv0 + size_t(kp)) * size_t(D)], D);
      store_row(dv, b, hk, j, &gv[(kv0 + size_t(kp)) * size_t(Dv)], Dv);
    }
  };
  parallel(p.B() * p.Hkv(), p.threads, store);
}

// One-pass form (FlashAttention-2's five tile products instead of seven): when the query blocks can be coloured
// so that the blocks of a colour touch disjoint keys, one item per (b, kv head, query block) recomputes P and dS
// once and writes dQ of its rows and adds dK/dV into the (layout-order) key gradients; the colours run one after
// the other. Each key's gradient is summed in a fixed order (colour, then head, then chunk) with one writer at a
// time, so the result does not depend on the thread count. k2, v2 (pairs_along_rows of K and V, or null): on the
// bf16 products (one_pass_block).
template <typename MaskMod, typename ScoreMod>
void backward_one_pass(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod,
                       const std::vector<int64_t>& colour_start, const std::vector<int32_t>& colour_runs,
                       const std::vector<int32_t>& run_ends, const TensorView& dq, const TensorView& dk,
                       const TensorView& dv, const uint32_t* k2, const uint32_t* v2) {
  WorkspaceVector<float> gk(size_t(p.B() * p.Hkv() * p.Lk() * p.D()), 0.0f),
      gv(size_t(p.B() * p.Hkv() * p.Lk() * p.Dv()), 0.0f);
  int64_t c_lo = 0, c_n = 0;
  // One item: a run of consecutive query blocks of one colour for one (b, kv head), block after block.
  auto item = [&](int64_t x) {
    const int64_t run = c_lo + x % c_n, bhk = x / c_n, b = bhk / p.Hkv(), hk = bhk % p.Hkv();
    for (int64_t qb = colour_runs[size_t(run)]; qb < run_ends[size_t(run)]; ++qb)
      one_pass_block(p, bm, mask_mod, score_mod, dq, qb, b, hk, gk.data(), gv.data(), k2, v2);
  };
  for (size_t c = 0; c + 1 < colour_start.size(); ++c) {
    c_lo = colour_start[c];
    c_n = colour_start[c + 1] - c_lo;
    if (c_n > 0) parallel(p.B() * p.Hkv() * c_n, p.threads, item);
  }
  store_key_grads(p, bm, gk.data(), gv.data(), dk, dv);
}

// dS of a chunk through the score_mod backward (entries with P = 0 get none): dp [mm x n] from the raw
// (pre-score_mod) scores; parameter gradients are added into g when given.
template <typename ScoreMod>
void score_mod_backward_chunk(const ScoreMod& score_mod, const BlockMask& bm, const Segment* segs, int64_t nseg,
                              int64_t n, int64_t mm, int64_t q0, int64_t b, int64_t h, const float* s, const float* raw,
                              float* dp, float* g) {
  for (int64_t x = 0; x < nseg; ++x)
    for (int64_t r = 0; r < mm; ++r) {
      const int64_t i = bm.q_index(q0 + r);
      for (int32_t c = segs[x].col; c < segs[x].col + (segs[x].end - segs[x].begin); ++c) {
        float& d = dp[r * n + c];
        if (s[r * n + c] == 0.0f) {
          d = 0.0f;
          continue;
        }
        d = score_mod.backward(raw[size_t(r * n + c)], d, b, h, i, bm.k_index(segs[x].begin + (c - segs[x].col)), g);
      }
    }
}

// Two-pass form, dQ of one (b, h, query block) item; score-mod parameter gradients added into g. k2, v2 (or null):
// on the bf16 products (identity score mods only), as one_pass_block.
template <typename MaskMod, typename ScoreMod>
void dq_item(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod, const TensorView& dq,
             int64_t it, float* g, const uint32_t* k2, const uint32_t* v2) {
  const int64_t nqb = bm.num_q_blocks(), D = p.D(), Dv = p.Dv(), group = p.group();
  const int64_t qb = it % nqb, bh = it / nqb, b = bh / p.Hq(), h = bh % p.Hq(), hk = h / group;
  const int64_t q0 = bm.q_block_start[qb], m = bm.q_block_start[qb + 1] - q0;
  thread_local Scratch sc;
  thread_local BackwardPairScratch ps;
  sc.ensure(m, D, Dv);
  const size_t kv0 = size_t((b * p.Hkv() + hk) * p.Lk());
  const size_t qrow = size_t((b * p.Hq() + h) * p.Lq() + q0);
  const float* qt = &p.q[qrow * D];
  const float* dot = &p.dout[qrow * Dv];
  const float* lse_t = &p.lse[qrow];
  const float* delta = &p.delta[qrow];
  const float* kbase = &p.k[size_t((b * p.Hkv() + hk) * p.Lk() * D)];
  const float* vbase = &p.v[size_t((b * p.Hkv() + hk) * p.Lk() * Dv)];
  std::fill_n(sc.dq.data(), m * D, 0.0f);
  const int64_t row = bm.slot(h) * nqb + qb;
  // Raw (pre-score_mod) scores for the score_mod backward: reused thread-local storage, no allocation per item.
  thread_local std::vector<float> raw_buf;
  float* raw = nullptr;
  if (!score_mod.identity()) {
    if (raw_buf.size() < size_t(m * kChunk)) raw_buf.resize(size_t(m * kChunk));
    raw = raw_buf.data();
  }
  if (k2) {
    ps.ensure(m, D, Dv);
    pack_transposed_pairs(qt, m, D, ps.ldq, ps.work, ps.q2t.data());
    pack_transposed_pairs(dot, m, Dv, ps.ldq, ps.work, ps.do2t.data());
  }
  for_each_chunk(&bm.ranges[size_t(bm.row_ptr[row])], bm.row_ptr[row + 1] - bm.row_ptr[row],
                 [&](const Segment* segs, int64_t nseg, int64_t n) {
                   const int64_t qa = segs[0].q_first(m), mm = segs[0].q_last(m) - qa;  // computed rows
                   if (mm <= 0) return;
                   if (k2) {  // dQ without the scale (applied once when stored) = dS · K, K in pairs across keys
                     const int64_t Dp = (D + 15) / 16 * 16;
                     const ChunkRows cr = chunk_rows_pairs(segs, nseg, k2 + kv0 * size_t((D + 1) / 2),
                                                           v2 + kv0 * size_t((Dv + 1) / 2), kbase, D, Dv, ps, sc);
                     chunk_grads_pairs(p, bm, mask_mod, score_mod, cr.k2, cr.v2, ps.q2t.data() + qa,
                                       ps.do2t.data() + qa, ps.ldq, mm, n, segs, nseg, q0 + qa, b, h, lse_t + qa,
                                       delta + qa, ps.st.data(), sc.s.data(), sc.p2.data());
                     tiles::pack_pairs_across_rows(cr.k, D, n, D, ps.kx.data(), Dp);
                     tiles::pv_pairs(sc.p2.data(), mm, n, ps.kx.data(), Dp, D, ps.p2.data(), sc.dq.data() + qa * D);
                     return;
                   }
                   const float* kp = nullptr;
                   gather_chunk(segs, nseg, n, kbase, vbase, D, Dv, sc, true, &kp, true);
                   float* s = sc.s.data();
                   float* dp = sc.p2.data();
                   tiles::qk(qt + qa * D, mm, D, sc.kt.data(), n, n, p.scale, s);
                   mod_and_mask(s, raw, mm, n, segs, nseg, bm, q0 + qa, b, h, p, mask_mod, score_mod);
                   tiles::probabilities(s, mm, n, lse_t + qa);
                   tiles::qk(dot + qa * Dv, mm, Dv, sc.vt.data(), n, n, 1.0f, dp);
                   tiles::softmax_backward(s, dp, mm, n, delta + qa);
                   if (!score_mod.identity())
                     score_mod_backward_chunk(score_mod, bm, segs, nseg, n, mm, q0 + qa, b, h, s, raw, dp, g);
                   tiles::pv(dp, mm, n, kp, D, D, p.scale, sc.dq.data() + qa * D);
                 });
  if (k2)
    for (int64_t e = 0; e < m * D; ++e) sc.dq[size_t(e)] *= p.scale;
  for (int64_t r = 0; r < m; ++r) store_row(dq, b, h, bm.q_index(q0 + r), sc.dq.data() + r * D, D);
}

// Two-pass form, dQ pass (and score-mod parameter gradients): one item per (b, h, query block).
template <typename MaskMod, typename ScoreMod>
void backward_dq_pass(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod,
                      const TensorView& dq, float* param_grad, const uint32_t* k2, const uint32_t* v2) {
  const int64_t nparams = score_mod.num_params();
  const int64_t n_items = p.B() * p.Hq() * bm.num_q_blocks();
  // Parameter gradients: a fixed number of item groups, each with its own buffer, reduced in order.
  // (At most 16 groups, and at most 2^26 floats of buffers; the split depends only on the sizes.)
  const int64_t n_groups =
      nparams > 0 ? std::max<int64_t>(1, std::min<int64_t>({n_items, 16, (int64_t(1) << 26) / nparams})) : 0;
  std::vector<float> gbuf(size_t(n_groups * nparams), 0.0f);
  if (n_groups == 0) {
    auto f = [&](int64_t it) { dq_item(p, bm, mask_mod, score_mod, dq, it, nullptr, k2, v2); };
    parallel(n_items, p.threads, f);
  } else {
    auto f = [&](int64_t gi) {
      const int64_t lo = gi * n_items / n_groups, hi = (gi + 1) * n_items / n_groups;
      for (int64_t it = lo; it < hi; ++it)
        dq_item(p, bm, mask_mod, score_mod, dq, it, &gbuf[size_t(gi * nparams)], k2, v2);
    };
    parallel(n_groups, p.threads, f);
    if (param_grad)
      for (int64_t gi = 0; gi < n_groups; ++gi)
        for (int64_t x = 0; x < nparams; ++x) param_grad[x] += gbuf[size_t(gi * nparams + x)];
  }
}

// A (query block, key sub-range) pair that touches a key block: the block mask transposed for the dK/dV pass.
struct KeyBlockEntry {
  int32_t qb, begin, end;
  bool full;
  uint16_t q_lo, q_hi;
};

// For each head slot and key block of kChunk layout positions, the (query block, key sub-range) pairs that touch
// it: [slot * nkb + key block].
inline std::vector<std::vector<KeyBlockEntry>> transpose_block_mask(const BlockMask& bm, int64_t nkb) {
  const int64_t nqb = bm.num_q_blocks();
  std::vector<std::vector<KeyBlockEntry>> tr(size_t(bm.heads * nkb));
  for (int64_t s = 0; s < bm.heads; ++s)
    for (int64_t qb = 0; qb < nqb; ++qb)
      for (int64_t r = bm.row_ptr[s * nqb + qb]; r < bm.row_ptr[s * nqb + qb + 1]; ++r) {
        const KeyRange& kr = bm.ranges[size_t(r)];
        for (int64_t kb = kr.begin / kChunk; kb * kChunk < kr.end; ++kb)
          tr[size_t(s * nkb + kb)].push_back({int32_t(qb), int32_t(std::max<int64_t>(kr.begin, kb * kChunk)),
                                              int32_t(std::min<int64_t>(kr.end, (kb + 1) * kChunk)), kr.full != 0,
                                              kr.q_lo, kr.q_hi});
      }
  return tr;
}

// Two-pass form, dK/dV of one (b, kv head, key block of kChunk layout positions) item. k2, v2 (or null): on the
// bf16 products (identity score mods only), as one_pass_block.
template <typename MaskMod, typename ScoreMod>
void kv_item(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod,
             const std::vector<std::vector<KeyBlockEntry>>& tr, int64_t nkb, int64_t max_m, const TensorView& dk,
             const TensorView& dv, int64_t it, const uint32_t* k2, const uint32_t* v2) {
  const int64_t D = p.D(), Dv = p.Dv(), group = p.group();
  const int64_t kb = it % nkb, bhk = it / nkb, b = bhk / p.Hkv(), hk = bhk % p.Hkv();
  const int64_t k0 = kb * kChunk, nk = std::min(p.Lk(), k0 + kChunk) - k0;
  thread_local Scratch sc;
  thread_local BackwardPairScratch ps;
  thread_local std::vector<float> dkacc, dvacc, raw;
  sc.ensure(max_m, D, Dv);
  if (k2) ps.ensure(max_m, D, Dv);
  dkacc.assign(size_t(nk * D), 0.0f);
  dvacc.assign(size_t(nk * Dv), 0.0f);
  raw.resize(size_t(max_m * kChunk));
  const float* kbase = &p.k[size_t(((b * p.Hkv() + hk) * p.Lk() + k0) * D)];
  const float* vbase = &p.v[size_t(((b * p.Hkv() + hk) * p.Lk() + k0) * Dv)];
  if (!k2) {
    tiles::transpose_rows(kbase, D, nk, D, sc.kt.data(), nk);
    tiles::transpose_rows(vbase, Dv, nk, Dv, sc.vt.data(), nk);
  }
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    for (const KeyBlockEntry& e : tr[size_t(bm.slot(h) * nkb + kb)]) {
      const int64_t qbeg = bm.q_block_start[e.qb], mb = bm.q_block_start[e.qb + 1] - qbeg;
      const Segment seg{e.begin, e.end, 0, e.full, e.q_lo, e.q_hi};
      const int64_t q0 = qbeg + seg.q_first(mb), m = seg.q_last(mb) - seg.q_first(mb);  // the computed rows
      if (m <= 0) continue;
      const int64_t n = e.end - e.begin, c0 = e.begin - k0;
      if (p.invalid_in(b, e.begin, e.end) == n) continue;
      const size_t qrow = size_t((b * p.Hq() + h) * p.Lq() + q0);
      const float* qt = &p.q[qrow * D];
      const float* dot = &p.dout[qrow * Dv];
      float* s = sc.s.data();
      float* dp = sc.p2.data();
      if (k2) {
        const int64_t D2 = (D + 1) / 2, Dv2 = (Dv + 1) / 2, Dp = (D + 15) / 16 * 16, Dvp = (Dv + 15) / 16 * 16;
        const size_t j0 = size_t((b * p.Hkv() + hk) * p.Lk() + e.begin);
        pack_transposed_pairs(qt, m, D, ps.ldq, ps.work, ps.q2t.data());
        pack_transposed_pairs(dot, m, Dv, ps.ldq, ps.work, ps.do2t.data());
        chunk_grads_pairs(p, bm, mask_mod, score_mod, k2 + j0 * D2, v2 + j0 * Dv2, ps.q2t.data(), ps.do2t.data(),
                          ps.ldq, m, n, &seg, 1, q0, b, h, &p.lse[qrow], &p.delta[qrow], ps.st.data(), s, dp);
        tiles::pack_pairs_across_rows(qt, D, m, D, ps.qx.data(), Dp);
        tiles::pack_pairs_across_rows(dot, Dv, m, Dv, ps.dox.data(), Dvp);
        tiles::atx_pairs(s, m, n, ps.dox.data(), Dvp, Dv, 1.0f, ps.a2.data(), dvacc.data() + c0 * Dv, Dv);
        tiles::atx_pairs(dp, m, n, ps.qx.data(), Dp, D, p.scale, ps.a2.data(), dkacc.data() + c0 * D, D);
        continue;
      }
      tiles::qk(qt, m, D, sc.kt.data() + c0, nk, n, p.scale, s);
      mod_and_mask(s, score_mod.identity() ? nullptr : raw.data(), m, n, &seg, 1, bm, q0, b, h, p, mask_mod, score_mod);
      tiles::probabilities(s, m, n, &p.lse[qrow]);
      tiles::atx(s, m, n, dot, Dv, Dv, 1.0f, dvacc.data() + c0 * Dv);
      tiles::qk(dot, m, Dv, sc.vt.data() + c0, nk, n, 1.0f, dp);
      tiles::softmax_backward(s, dp, m, n, &p.delta[qrow]);
      if (!score_mod.identity())
        for (int64_t r = 0; r < m; ++r) {
          const int64_t i = bm.q_index(q0 + r);
          for (int64_t c = 0; c < n; ++c) {
            float& d = dp[r * n + c];
            d = s[r * n + c] == 0.0f
                    ? 0.0f
                    : score_mod.backward(raw[size_t(r * n + c)], d, b, h, i, bm.k_index(e.begin + c), nullptr);
          }
        }
      tiles::atx(dp, m, n, qt, D, D, p.scale, dkacc.data() + c0 * D);
    }
  }
  for (int64_t c = 0; c < nk; ++c) {
    const int64_t j = bm.k_index(k0 + c);
    store_row(dk, b, hk, j, dkacc.data() + c * D, D);
    store_row(dv, b, hk, j, dvacc.data() + c * Dv, Dv);
  }
}

// Two-pass form, dK/dV pass: one item per (b, kv head, key block of kChunk layout positions); entries transposed
// from the block mask: for each head slot and key block, the (query block, key sub-range) pairs that touch it.
template <typename MaskMod, typename ScoreMod>
void backward_dkv_pass(const Packed& p, const BlockMask& bm, MaskMod& mask_mod, const ScoreMod& score_mod,
                       const TensorView& dk, const TensorView& dv, const uint32_t* k2, const uint32_t* v2) {
  const int64_t nqb = bm.num_q_blocks();
  const int64_t nkb = (p.Lk() + kChunk - 1) / kChunk;
  const std::vector<std::vector<KeyBlockEntry>> tr = transpose_block_mask(bm, nkb);
  int64_t max_m = 0;
  for (int64_t x = 0; x < nqb; ++x) max_m = std::max<int64_t>(max_m, bm.q_block_start[x + 1] - bm.q_block_start[x]);
  auto item = [&](int64_t it) { kv_item(p, bm, mask_mod, score_mod, tr, nkb, max_m, dk, dv, it, k2, v2); };
  parallel(p.B() * p.Hkv() * nkb, p.threads, item);
}

}  // namespace detail

// Backward from the saved out and lse: dq, dk, dv (same shapes as q, k, v; any float dtype) and, when the score
// mod has parameters, their gradient added into param_grad[0 .. score_mod.num_params()).
// problem: detail::describe_inputs(q, k, v, options, enable_gqa) (the overload below builds it).
template <typename MaskMod, typename ScoreMod = NoScoreMod>
void block_sparse_attention_backward(const AttentionProblem& problem, const TensorView& dout, const TensorView& q,
                                     const TensorView& k, const TensorView& v, const TensorView& out,
                                     const TensorView& lse, const BlockMask& bm, MaskMod mask_mod,
                                     const ScoreMod& score_mod, const EngineOptions& options, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv, float* param_grad = nullptr) {
  using namespace detail;
  Packed p = pack_inputs(problem, q, k, v, bm, options);
  check_grads(p, q, k, v, dq, dk, dv);
  pack_backward(p, bm, dout, out, lse);
  // On the bf16 products (identity score mods: the parameters' gradients keep float32 products, as the fused
  // kernel's mask gradient): K and V in pairs along D and Dv, once per call.
  const bool pairs = score_mod.identity() && backward_takes_bf16_pairs(q, k, v, dq, dk, dv, options);
  const int64_t kv_rows = p.B() * p.Hkv() * p.Lk();
  const WorkspaceVector<uint32_t> k2 = pairs ? pairs_along_rows(p.k.data(), kv_rows, p.D())
                                             : WorkspaceVector<uint32_t>(),
                                  v2 = pairs ? pairs_along_rows(p.v.data(), kv_rows, p.Dv())
                                             : WorkspaceVector<uint32_t>();
  const uint32_t* k2p = pairs ? k2.data() : nullptr;
  const uint32_t* v2p = pairs ? v2.data() : nullptr;
  std::vector<int64_t> colour_start;
  std::vector<int32_t> colour_runs, run_ends;
  if (score_mod.identity() && colour_query_blocks(bm, p.B() * p.Hkv(), colour_start, colour_runs, run_ends)) {
    backward_one_pass(p, bm, mask_mod, score_mod, colour_start, colour_runs, run_ends, dq, dk, dv, k2p, v2p);
    return;
  }
  backward_dq_pass(p, bm, mask_mod, score_mod, dq, param_grad, k2p, v2p);
  backward_dkv_pass(p, bm, mask_mod, score_mod, dk, dv, k2p, v2p);
}

template <typename MaskMod, typename ScoreMod = NoScoreMod>
void block_sparse_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& out, const TensorView& lse,
                                     const BlockMask& bm, MaskMod mask_mod, const ScoreMod& score_mod,
                                     const EngineOptions& options, const TensorView& dq, const TensorView& dk,
                                     const TensorView& dv, float* param_grad = nullptr, bool enable_gqa = true) {
  block_sparse_attention_backward(detail::describe_inputs(q, k, v, options, enable_gqa), dout, q, k, v, out, lse, bm,
                                  mask_mod, score_mod, options, dq, dk, dv, param_grad);
}

}  // namespace sattn::sparse
