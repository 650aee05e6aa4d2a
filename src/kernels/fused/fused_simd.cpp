// The fused kernel's tile loops, compiled once per SIMD target by Highway (simd/hwy_targets.hpp) and chosen at run
// time from the one target table (simd/target.hpp; see ops() at the end). Everything here works on one task (a
// query block for the forward and the dQ pass, a key block for the dK/dV pass) so that results never depend on
// the number of threads: the driver (fused_kernel.cpp) only decides which thread runs which task.
//
// Tile layout (queries in lanes): Q^T [D x Br] (pre-scaled), S^T [Bc x Br], O^T [Dv x Br]. Every matrix
// product is one register-blocked micro-kernel  C[M x N] (+)= A(m, k) · B[k x N]  with A read by scalar
// broadcasts through two strides (so K, V, K^T and V^T are all read in place) and B/C in lanes.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused/fused_simd.cpp"
#include "simd/hwy_targets.hpp"
#include <hwy/foreach_target.h>  // must come before highway.h

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/fused/fused.hpp"
#include "sattn/error.hpp"
#include "sattn/random.hpp"

#ifndef SATTN_FUSED_SIMD_HELPERS
#define SATTN_FUSED_SIMD_HELPERS
namespace sattn::fused::detail {

inline float load_elem(const void* base, DType dt, int64_t off) {
  switch (dt) {
    case DType::kF32: return static_cast<const float*>(base)[off];
    case DType::kF64: return float(static_cast<const double*>(base)[off]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[off]);
    case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(base)[off]);
    default: return 0.f;
  }
}
inline void store_elem(void* base, DType dt, int64_t off, float x) {
  switch (dt) {
    case DType::kF32: static_cast<float*>(base)[off] = x; break;
    case DType::kF64: static_cast<double*>(base)[off] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[off] = float_to_bf16(x); break;
    case DType::kF16: static_cast<uint16_t*>(base)[off] = float_to_fp16(x); break;
    default: break;
  }
}
inline double load_mask(const View4& m, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t off = b * m.sb + h * m.sh + i * m.sl + j * m.sd;
  switch (m.dtype) {
    case DType::kBool: return static_cast<const uint8_t*>(m.data)[off] ? 0.0 : -HUGE_VAL;
    case DType::kF32: return static_cast<const float*>(m.data)[off];
    case DType::kF64: return static_cast<const double*>(m.data)[off];
    default: return 0.0;
  }
}

// Aligned float scratch that reports its size to the workspace accounting.
struct Scratch {
  hwy::AlignedFreeUniquePtr<float[]> ptr;
  int64_t bytes = 0;
  float* alloc(int64_t n) {
    bytes = std::max<int64_t>(n, 1) * int64_t(sizeof(float));
    ptr = hwy::AllocateAligned<float>(size_t(std::max<int64_t>(n, 1)));
    check(ptr != nullptr, ErrorKind::kOutOfMemory, "fused attention: cannot allocate ", bytes, " bytes of scratch");
    workspace_add(bytes);
    return ptr.get();
  }
  ~Scratch() {
    if (ptr) workspace_add(-bytes);
  }
};

// Row-major f32 rows [n x width] of a [.., L, width] view: a pointer into the input when it is f32 with unit
// last stride, otherwise a converted copy in `buf`.
struct Rows {
  const float* ptr;
  int64_t stride;
};
inline Rows rows_of(const View4& t, int64_t b, int64_t h, int64_t j0, int64_t n, int64_t width, float* buf) {
  const int64_t base = b * t.sb + h * t.sh + j0 * t.sl;
  if (t.dtype == DType::kF32 && t.sd == 1) return {static_cast<const float*>(t.data) + base, t.sl};
  for (int64_t j = 0; j < n; ++j)
    for (int64_t x = 0; x < width; ++x) buf[j * width + x] = load_elem(t.data, t.dtype, base + j * t.sl + x * t.sd);
  return {buf, width};
}

}  // namespace sattn::fused::detail
#endif  // SATTN_FUSED_SIMD_HELPERS

HWY_BEFORE_NAMESPACE();
namespace sattn::fused {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace sattn::fused::detail;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using MF = hn::Mask<DF>;

#include "simd/blocking.inc"  // kMR, kNV
#include "simd/gemm.inc"      // MicroKernel

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kDecodeRows = 4;  // Lq up to this uses the keys-in-lanes decode kernel

#include "simd/exp.inc"  // Exp<kNoUpper>(d, x)

// C[MR x NV·lanes] (+)= sum_k A(m, k) · B[k, :];  A(m, k) = A[m·sam + k·sak].
template <int MR, int NV, bool kAcc>
HWY_INLINE void MicroTile(const float* HWY_RESTRICT A, int64_t sam, int64_t sak, const float* HWY_RESTRICT B,
                          int64_t ldb, float* HWY_RESTRICT C, int64_t ldc, int64_t K) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  VF acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NV; ++n) acc[m][n] = kAcc ? hn::Load(d, C + m * ldc + n * N) : hn::Zero(d);
  MicroKernel<MR, NV>(acc, A, sam, sak, B, ldb, K, [&](const float* row, int v) { return hn::Load(d, row + v * N); });
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NV; ++n) hn::Store(acc[m][n], d, C + m * ldc + n * N);
}

template <int NV, bool kAcc, int MR = kMR - 1>
HWY_INLINE void TailRows(int64_t rows, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C,
                         int64_t ldc, int64_t K) {
  if constexpr (MR >= 1) {
    if (rows == MR) return MicroTile<MR, NV, kAcc>(A, sam, sak, B, ldb, C, ldc, K);
    TailRows<NV, kAcc, MR - 1>(rows, A, sam, sak, B, ldb, C, ldc, K);
  }
}

template <int NV, bool kAcc>
HWY_INLINE void RowsLoop(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc,
                         int64_t M, int64_t K) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR) MicroTile<kMR, NV, kAcc>(A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, K);
  if (m < M) TailRows<NV, kAcc>(M - m, A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, K);
}

template <bool kAcc, int NV = kNV - 1>
HWY_INLINE void TailCols(int64_t nv, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C,
                         int64_t ldc, int64_t M, int64_t K) {
  if constexpr (NV >= 1) {
    if (nv == NV) return RowsLoop<NV, kAcc>(A, sam, sak, B, ldb, C, ldc, M, K);
    TailCols<kAcc, NV - 1>(nv, A, sam, sak, B, ldb, C, ldc, M, K);
  }
}

// C[M x nvec·lanes] (+)= A(M x K) · B[K x nvec·lanes]; B and C rows aligned to the vector size.
template <bool kAcc>
void Gemm(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
          int64_t nvec, int64_t K) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  int64_t n = 0;
  for (; n + kNV <= nvec; n += kNV) RowsLoop<kNV, kAcc>(A, sam, sak, B + n * N, ldb, C + n * N, ldc, M, K);
  if (n < nvec) TailCols<kAcc>(nvec - n, A, sam, sak, B + n * N, ldb, C + n * N, ldc, M, K);
}

// ---- shared tile helpers -----------------------------------------------------------------------------------

// Rows of K or V as f32: in place for f32 with unit last stride; bf16/f16 with unit last stride converted
// with vector loads (per tile, so that half-precision inputs cost about what f32 costs); else element-wise.
Rows RowsOf(const View4& t, int64_t b, int64_t h, int64_t j0, int64_t n, int64_t width, float* buf) {
  if (t.sd != 1 || (t.dtype != DType::kBF16 && t.dtype != DType::kF16)) return rows_of(t, b, h, j0, n, width, buf);
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t base = b * t.sb + h * t.sh + j0 * t.sl;
  for (int64_t j = 0; j < n; ++j) {
    float* dst = buf + j * width;
    int64_t x = 0;
    if (t.dtype == DType::kBF16) {
      const hn::Rebind<hwy::bfloat16_t, DF> dh;
      const auto* src = static_cast<const hwy::bfloat16_t*>(t.data) + base + j * t.sl;
      for (; x + N <= width; x += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, src + x)), d, dst + x);
    } else {
      const hn::Rebind<hwy::float16_t, DF> dh;
      const auto* src = static_cast<const hwy::float16_t*>(t.data) + base + j * t.sl;
      for (; x + N <= width; x += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, src + x)), d, dst + x);
    }
    for (; x < width; ++x) dst[x] = load_elem(t.data, t.dtype, base + j * t.sl + x);
  }
  return {buf, width};
}

// Q^T [D x Br] of query rows [i0, i0 + nq), multiplied by `mul`; lanes past nq are 0.
void PackTransposed(const View4& t, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t width, int64_t Br, float mul,
                    float* out) {
  std::memset(out, 0, sizeof(float) * size_t(width * Br));
  const int64_t base = b * t.sb + h * t.sh + i0 * t.sl;
  if (t.dtype == DType::kF32 && t.sd == 1) {
    const float* src = static_cast<const float*>(t.data) + base;
    for (int64_t ii = 0; ii < nq; ++ii)
      for (int64_t x = 0; x < width; ++x) out[x * Br + ii] = src[ii * t.sl + x] * mul;
    return;
  }
  for (int64_t ii = 0; ii < nq; ++ii)
    for (int64_t x = 0; x < width; ++x)
      out[x * Br + ii] = load_elem(t.data, t.dtype, base + ii * t.sl + x * t.sd) * mul;
}

// Row-major [Br x wpad] copy of rows [i0, i0 + nq) times `mul`, zero padded.
void PackRows(const View4& t, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t width, int64_t wpad, int64_t Br,
              float mul, float* out) {
  std::memset(out, 0, sizeof(float) * size_t(Br * wpad));
  const int64_t base = b * t.sb + h * t.sh + i0 * t.sl;
  for (int64_t ii = 0; ii < nq; ++ii)
    for (int64_t x = 0; x < width; ++x)
      out[ii * wpad + x] = load_elem(t.data, t.dtype, base + ii * t.sl + x * t.sd) * mul;
}

// Which keys of a tile are usable at all, and the additive bias of the tile.
struct TileMask {
  bool skip = false;  // nothing in the tile is allowed
  bool causal_partial = false;
  bool has_bias = false;  // bias[jj * Br + ii] is valid (attn_mask; -inf where not allowed)
  bool has_pad = false;   // pad[jj] != 0: key padded
};

// Evaluates masks for queries [i0, i0 + nq) x keys [kb, kb + nk) of (b, h).
TileMask PrepareTileMask(const Params& p, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t kb, int64_t nk,
                         float* bias, uint8_t* pad) {
  TileMask t;
  int64_t usable_keys = nk;
  if (p.kp) {
    usable_keys = 0;
    for (int64_t jj = 0; jj < nk; ++jj) {
      pad[jj] = p.kp[b * p.kp_sb + (kb + jj) * p.kp_sk];
      usable_keys += !pad[jj];
      t.has_pad |= pad[jj] != 0;
    }
    if (usable_keys == 0) return t.skip = true, t;
  }
  if (p.causal) {
    if (kb > i0 + nq - 1 + p.causal_offset) return t.skip = true, t;
    t.causal_partial = kb + nk - 1 > i0 + p.causal_offset;
  }
  if (p.mask != MaskKind::kNone) {
    const int64_t Br = p.Br;
    bool any = false;
    for (int64_t jj = 0; jj < nk; ++jj) {
      float* row = bias + jj * Br;
      for (int64_t ii = 0; ii < nq; ++ii) {
        const float x = float(load_mask(p.mask_view, b, h, i0 + ii, kb + jj));
        row[ii] = x;
        any |= x != kNegInf && (!p.causal || kb + jj <= i0 + ii + p.causal_offset) && !(p.kp && pad[jj]);
      }
      for (int64_t ii = nq; ii < Br; ++ii) row[ii] = 0.f;
    }
    if (!any) return t.skip = true, t;
    t.has_bias = true;
  }
  return t;
}

// Applies bias / padding / partial causality to S^T [nk x Br] in place.
void ApplyTileMask(const Params& p, const TileMask& t, int64_t i0, int64_t kb, int64_t nk, const float* bias,
                   const uint8_t* pad, float* ST) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d)), Br = p.Br;
  const VF ninf = hn::Set(d, kNegInf);
  const auto iota = hn::Iota(hn::RebindToSigned<DF>(), 0);
  for (int64_t jj = 0; jj < nk; ++jj) {
    float* row = ST + jj * Br;
    if (t.has_pad && pad[jj]) {
      for (int64_t x = 0; x < Br; x += N) hn::Store(ninf, d, row + x);
      continue;
    }
    if (t.has_bias)
      for (int64_t x = 0; x < Br; x += N) {  // s + bias, and -inf wherever bias is -inf (even for a NaN s)
        const VF bv = hn::Load(d, bias + jj * Br + x);
        hn::Store(hn::IfThenElse(hn::Eq(bv, ninf), ninf, hn::Add(hn::Load(d, row + x), bv)), d, row + x);
      }
    if (t.causal_partial) {
      // allowed iff kb + jj <= i0 + ii + offset  <=>  ii >= kb + jj - offset - i0
      const int64_t first = kb + jj - p.causal_offset - i0;
      if (first <= 0) continue;
      const hn::RebindToSigned<DF> di;
      for (int64_t x = 0; x < Br; x += N) {
        if (x + N <= first) {
          hn::Store(ninf, d, row + x);
          continue;
        }
        if (x >= first) break;
        const auto lane = hn::Add(iota, hn::Set(di, int32_t(x)));
        const auto ok = hn::RebindMask(d, hn::Gt(lane, hn::Set(di, int32_t(first - 1))));
        hn::Store(hn::IfThenElse(ok, hn::Load(d, row + x), ninf), d, row + x);
      }
    }
  }
}

// ---- forward ---------------------------------------------------------------------------------------------

// One key tile of the online softmax for the queries in lanes ST[0, N) of the rows jj < nk of S^T (row stride Br):
// m' = max(m, max_j s_j), l' = l e^(m − m') + Σ_j e^(s_j − m'); the rows are overwritten with e^(s_j − m').
// Returns e^(m − m'), the factor for what was accumulated with the old max.
HWY_INLINE VF OnlineSoftmaxStep(DF d, float* HWY_RESTRICT ST, int64_t nk, int64_t Br, float* M, float* L) {
  const VF ninf = hn::Set(d, kNegInf), zero = hn::Zero(d);
  // four independent maxima: one chain would wait out Max's latency (~4 cycles) on every key
  VF mx0 = ninf, mx1 = ninf, mx2 = ninf, mx3 = ninf;
  int64_t jj = 0;
  for (; jj + 4 <= nk; jj += 4) {
    mx0 = hn::Max(mx0, hn::Load(d, ST + jj * Br));
    mx1 = hn::Max(mx1, hn::Load(d, ST + (jj + 1) * Br));
    mx2 = hn::Max(mx2, hn::Load(d, ST + (jj + 2) * Br));
    mx3 = hn::Max(mx3, hn::Load(d, ST + (jj + 3) * Br));
  }
  for (; jj < nk; ++jj) mx0 = hn::Max(mx0, hn::Load(d, ST + jj * Br));
  const VF mx = hn::Max(hn::Max(mx0, mx1), hn::Max(mx2, mx3));
  const VF m_old = hn::Load(d, M);
  const VF m_new = hn::Max(m_old, mx);
  const VF m_use = hn::IfThenElse(hn::Eq(m_new, ninf), zero, m_new);  // all masked so far: keep 0s
  const VF alpha = Exp<true>(d, hn::Sub(m_old, m_use));               // exp(-inf) = 0
  VF sum = zero;
  for (jj = 0; jj < nk; ++jj) {
    const VF e = Exp<true>(d, hn::Sub(hn::Load(d, ST + jj * Br), m_use));
    sum = hn::Add(sum, e);
    hn::Store(e, d, ST + jj * Br);
  }
  hn::Store(hn::MulAdd(hn::Load(d, L), alpha, sum), d, L);
  hn::Store(m_new, d, M);
  return alpha;
}

// out = O / l; lse = m + log l; rows with no allowed key (l = 0): out 0, lse -inf; rows with a NaN score have
// l = NaN and get NaN. In decode mode (kv_chunk > 0) the results are partials: O / l [row][chunk][Dv], m and l
// [row][chunk], merged by the driver.
template <typename GetO>
void FinishRows(const Params& p, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t chunk, const float* M,
                const float* L, GetO&& o) {
  const int64_t Dv = p.Dv, nchunks = p.num_kv_chunks();
  for (int64_t ii = 0; ii < nq; ++ii) {
    const bool empty = L[ii] == 0.f;
    const float inv = empty ? 0.f : 1.f / L[ii];
    auto lse = [&] { return empty ? kNegInf : M[ii] + std::log(L[ii]); };  // only where it is wanted
    if (p.kv_chunk > 0) {
      const int64_t row = (b * p.Hq + h) * p.Lq + i0 + ii;
      float* po = p.part_o + (row * nchunks + chunk) * Dv;
      for (int64_t dd = 0; dd < Dv; ++dd) po[dd] = o(ii, dd) * inv;
      p.part_max[row * nchunks + chunk] = empty ? kNegInf : M[ii];
      p.part_sum[row * nchunks + chunk] = empty ? 0.f : L[ii];
      continue;
    }
    const int64_t obase = b * p.out.sb + h * p.out.sh + (i0 + ii) * p.out.sl;
    if (p.out.dtype == DType::kF32) {
      float* po = static_cast<float*>(p.out.data) + obase;
      for (int64_t dd = 0; dd < Dv; ++dd) po[dd * p.out.sd] = o(ii, dd) * inv;
    } else {
      for (int64_t dd = 0; dd < Dv; ++dd) store_elem(p.out.data, p.out.dtype, obase + dd * p.out.sd, o(ii, dd) * inv);
    }
    if (p.lse.data) store_elem(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + (i0 + ii) * p.lse.sl, lse());
  }
}

// Few queries (decode): keys in the lanes instead of queries, so that no lane is wasted when Lq = 1.
// Scores are dot products over D (vector FMAs + one lane reduction per key and query), the softmax runs over
// lanes of keys, and O[i, :] += p_ij V[j, :] uses vectors over Dv. Same masks, dropout and results layout.
// Rows r < NQ are queries (rh[r], ri[r]) of one kv head hk: several queries of one head, or (GQA) the same
// queries of every head of the group, so that K and V are read once for all of them.
template <int NQ>
void DecodeRows(const Params& p, int64_t b, int64_t hk, const int64_t* rh, const int64_t* ri, int64_t kbeg,
                int64_t kend, int64_t chunk) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t Bc = p.Bc, D = p.D, Dv = p.Dv, Br = p.Br;
  const int64_t Dp = Params::pad16(D), Dvp = Params::pad16(Dv), Dfull = D / N * N, Dvfull = Dv / N * N;
  Scratch s_q, s_o, s_s, s_bias, s_kbuf, s_vbuf;
  float* Q = s_q.alloc(NQ * Dp);  // scale·q rows, zero padded
  float* O = s_o.alloc(NQ * Dvp);
  float* S = s_s.alloc(NQ * Bc);  // scores, then probabilities, of one key tile
  float* bias = p.mask != MaskKind::kNone ? s_bias.alloc(NQ * Bc * Br) : nullptr;
  float* kbuf = s_kbuf.alloc(Bc * D);
  float* vbuf = s_vbuf.alloc(Bc * Dv);
  uint8_t pad[1024];
  float M[NQ], L[NQ];
  TileMask tm[NQ];
  std::memset(Q, 0, sizeof(float) * size_t(NQ * Dp));
  std::memset(O, 0, sizeof(float) * size_t(NQ * Dvp));
  for (int ii = 0; ii < NQ; ++ii) {
    M[ii] = kNegInf, L[ii] = 0.f;
    const int64_t base = b * p.q.sb + rh[ii] * p.q.sh + ri[ii] * p.q.sl;
    for (int64_t x = 0; x < D; ++x) Q[ii * Dp + x] = load_elem(p.q.data, p.q.dtype, base + x * p.q.sd) * p.scale;
  }
  const float keep_scale = p.dropout_p > 0 ? float(1.0 / (1.0 - p.dropout_p)) : 1.f;
  for (int64_t kb = kbeg; kb < kend; kb += Bc) {
    const int64_t nk = std::min(Bc, kend - kb);
    bool live = false, masked = false;
    for (int ii = 0; ii < NQ; ++ii) {
      tm[ii] = PrepareTileMask(p, b, rh[ii], ri[ii], 1, kb, nk, bias ? bias + ii * Bc * Br : nullptr, pad);
      live |= !tm[ii].skip;
      masked |= tm[ii].skip || tm[ii].has_bias || tm[ii].has_pad || tm[ii].causal_partial;
    }
    if (!live) continue;
    const Rows kr = RowsOf(p.k, b, hk, kb, nk, D, kbuf);
    for (int64_t jj = 0; jj < nk; ++jj) {  // S[ii, jj] = (scale q_ii) · k_jj
      const float* krow = kr.ptr + jj * kr.stride;
      VF acc[NQ];
      for (int ii = 0; ii < NQ; ++ii) acc[ii] = hn::Zero(d);
      for (int64_t x = 0; x < Dfull; x += N) {
        const VF kv = hn::LoadU(d, krow + x);
        for (int ii = 0; ii < NQ; ++ii) acc[ii] = hn::MulAdd(kv, hn::Load(d, Q + ii * Dp + x), acc[ii]);
      }
      for (int ii = 0; ii < NQ; ++ii) {
        float sdot = hn::GetLane(hn::SumOfLanes(d, acc[ii]));
        for (int64_t x = Dfull; x < D; ++x) sdot += krow[x] * Q[ii * Dp + x];
        S[ii * Bc + jj] = sdot;
      }
    }
    if (masked)
      for (int ii = 0; ii < NQ; ++ii)
        for (int64_t jj = 0; jj < nk; ++jj) {
          const TileMask& t = tm[ii];
          float& x = S[ii * Bc + jj];
          if (t.skip || (t.has_pad && pad[jj])) x = kNegInf;
          else if (t.causal_partial && kb + jj > ri[ii] + p.causal_offset) x = kNegInf;
          else if (t.has_bias) {
            const float bv = bias[ii * Bc * Br + jj * Br];
            x = bv == kNegInf ? bv : x + bv;  // -inf stays -inf (even for a NaN score)
          }
        }
    for (int ii = 0; ii < NQ; ++ii) {  // online softmax of row ii over the tile's keys
      float* srow = S + ii * Bc;
      float mx = kNegInf;
      for (int64_t jj = 0; jj < nk; ++jj) mx = std::max(mx, srow[jj]);
      const float m_new = std::max(M[ii], mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      const float alpha = std::exp(M[ii] - m_use);
      const VF vm = hn::Set(d, m_use);
      VF vsum = hn::Zero(d);
      int64_t jj = 0;
      for (; jj + N <= nk; jj += N) {
        const VF e = Exp<true>(d, hn::Sub(hn::LoadU(d, srow + jj), vm));
        vsum = hn::Add(vsum, e);
        hn::StoreU(e, d, srow + jj);
      }
      float sum = hn::GetLane(hn::SumOfLanes(d, vsum));
      for (; jj < nk; ++jj) {
        srow[jj] = srow[jj] == kNegInf ? 0.f : std::exp(srow[jj] - m_use);
        sum += srow[jj];
      }
      L[ii] = L[ii] * alpha + sum;
      M[ii] = m_new;
      if (alpha != 1.f)
        for (int64_t x = 0; x < Dv; ++x) O[ii * Dvp + x] *= alpha;
      if (p.dropout_p > 0) {
        for (int64_t j = 0; j < nk; ++j) {
          const bool keep =
              dropout_keep(p.seed, p.dropout_p, uint32_t(b), uint32_t(rh[ii]), uint32_t(ri[ii]), uint32_t(kb + j));
          srow[j] = keep ? srow[j] * keep_scale : 0.f;
        }
      }
    }
    const Rows vr = RowsOf(p.v, b, hk, kb, nk, Dv, vbuf);
    for (int64_t x = 0; x < Dvfull; x += N) {  // O[ii, x:x+N] += sum_j P[ii, j] V[j, x:x+N]
      VF acc[NQ];
      for (int ii = 0; ii < NQ; ++ii) acc[ii] = hn::Load(d, O + ii * Dvp + x);
      for (int64_t jj = 0; jj < nk; ++jj) {
        const VF vv = hn::LoadU(d, vr.ptr + jj * vr.stride + x);
        for (int ii = 0; ii < NQ; ++ii) acc[ii] = hn::MulAdd(hn::Set(d, S[ii * Bc + jj]), vv, acc[ii]);
      }
      for (int ii = 0; ii < NQ; ++ii) hn::Store(acc[ii], d, O + ii * Dvp + x);
    }
    for (int64_t x = Dvfull; x < Dv; ++x)
      for (int64_t jj = 0; jj < nk; ++jj)
        for (int ii = 0; ii < NQ; ++ii) O[ii * Dvp + x] += S[ii * Bc + jj] * vr.ptr[jj * vr.stride + x];
  }
  for (int ii = 0; ii < NQ; ++ii)
    FinishRows(p, b, rh[ii], ri[ii], 1, chunk, M + ii, L + ii, [&](int64_t, int64_t dd) { return O[ii * Dvp + dd]; });
}

void ForwardTask(const Params& p, int64_t task) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nqb = p.num_q_blocks(), Br = p.Br, Bc = p.Bc, D = p.D, Dv = p.Dv, nvec = Br / N;
  // Split keys (decode): task = ((b * Hq + h) * nqb + qb) * nchunks + chunk, keys [chunk·kv_chunk, +kv_chunk).
  const int64_t nchunks = p.num_kv_chunks(), chunk = task % nchunks;
  task /= nchunks;
  if (p.decode_group) {  // GQA decode: task = (b * Hkv + hk) * nchunks + chunk, rows = group heads x Lq queries
    const int64_t b = task / p.Hkv, hk = task % p.Hkv, nr = p.group * p.Lq;
    int64_t kend = p.Lk, kbeg = 0;
    if (p.kv_chunk > 0) kbeg = chunk * p.kv_chunk, kend = std::min(kend, kbeg + p.kv_chunk);
    if (p.key_len) kend = std::min(kend, p.key_len[b]);
    if (p.causal) kend = std::min(kend, p.Lq - 1 + p.causal_offset + 1);
    int64_t rh[kDecodeRows], ri[kDecodeRows];
    for (int64_t r = 0; r < nr; ++r) rh[r] = hk * p.group + r / p.Lq, ri[r] = r % p.Lq;
    switch (nr) {
      case 2: return DecodeRows<2>(p, b, hk, rh, ri, kbeg, kend, chunk);
      case 3: return DecodeRows<3>(p, b, hk, rh, ri, kbeg, kend, chunk);
      default: return DecodeRows<4>(p, b, hk, rh, ri, kbeg, kend, chunk);
    }
  }
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);

  int64_t kend = p.Lk, kbeg = 0;
  if (p.kv_chunk > 0) kbeg = chunk * p.kv_chunk, kend = std::min(kend, kbeg + p.kv_chunk);
  if (p.key_len) kend = std::min(kend, p.key_len[b]);
  if (p.causal) kend = std::min(kend, i0 + nq - 1 + p.causal_offset + 1);
  if (p.Lq <= kDecodeRows) {  // keys in lanes (Lq = 1..4)
    int64_t rh[kDecodeRows], ri[kDecodeRows];
    for (int64_t r = 0; r < nq; ++r) rh[r] = h, ri[r] = i0 + r;
    switch (nq) {
      case 1: return DecodeRows<1>(p, b, hk, rh, ri, kbeg, kend, chunk);
      case 2: return DecodeRows<2>(p, b, hk, rh, ri, kbeg, kend, chunk);
      case 3: return DecodeRows<3>(p, b, hk, rh, ri, kbeg, kend, chunk);
      default: return DecodeRows<4>(p, b, hk, rh, ri, kbeg, kend, chunk);
    }
  }

  Scratch s_qt, s_st, s_ot, s_ml, s_bias, s_kbuf, s_vbuf, s_pt;
  float* QT = s_qt.alloc(D * Br);
  float* ST = s_st.alloc(Bc * Br);
  float* OT = s_ot.alloc(Dv * Br);
  float* M = s_ml.alloc(2 * Br);
  float* L = M + Br;
  float* bias = p.mask != MaskKind::kNone ? s_bias.alloc(Bc * Br) : nullptr;
  const bool k_direct = p.k.dtype == DType::kF32 && p.k.sd == 1, v_direct = p.v.dtype == DType::kF32 && p.v.sd == 1;
  float* kbuf = k_direct ? nullptr : s_kbuf.alloc(Bc * D);
  float* vbuf = v_direct ? nullptr : s_vbuf.alloc(Bc * Dv);
  float* PT = p.dropout_p > 0 ? s_pt.alloc(Bc * Br) : nullptr;
  uint8_t pad[1024];  // Bc <= 1024 (checked by the driver)

  std::fill(M, M + Br, kNegInf);
  std::fill(L, L + Br, 0.f);
  std::memset(OT, 0, sizeof(float) * size_t(Dv * Br));
  if (kend > kbeg) PackTransposed(p.q, b, h, i0, nq, D, Br, p.scale, QT);

  const float keep_scale = p.dropout_p > 0 ? float(1.0 / (1.0 - p.dropout_p)) : 1.f;
  for (int64_t kb = kbeg; kb < kend; kb += Bc) {
    const int64_t nk = std::min(Bc, kend - kb);
    const TileMask tm = PrepareTileMask(p, b, h, i0, nq, kb, nk, bias, pad);
    if (tm.skip) continue;
    const Rows kr = RowsOf(p.k, b, hk, kb, nk, D, kbuf);
    Gemm<false>(kr.ptr, kr.stride, 1, QT, Br, ST, Br, nk, nvec, D);  // S^T = K (scale Q)^T
    if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, i0, kb, nk, bias, pad, ST);

    // Online softmax, lane-wise: m' = max(m, max_j s), l' = l e^{m - m'} + sum_j e^{s - m'}, O' = O e^{m - m'}.
    for (int64_t x = 0; x < Br; x += N) {
      const VF alpha = OnlineSoftmaxStep(d, ST + x, nk, Br, M + x, L + x);
      if (!hn::AllTrue(d, hn::Eq(alpha, hn::Set(d, 1.f))))
        for (int64_t dd = 0; dd < Dv; ++dd)
          hn::Store(hn::Mul(hn::Load(d, OT + dd * Br + x), alpha), d, OT + dd * Br + x);
    }
    const float* P = ST;
    if (PT) {  // dropout: P' = P keep / (1 - p) feeds the output; the normaliser l uses P
      for (int64_t jj = 0; jj < nk; ++jj)
        for (int64_t ii = 0; ii < Br; ++ii)
          PT[jj * Br + ii] = ii < nq && dropout_keep(p.seed, p.dropout_p, uint32_t(b), uint32_t(h), uint32_t(i0 + ii),
                                                     uint32_t(kb + jj))
                                 ? ST[jj * Br + ii] * keep_scale
                                 : 0.f;
      P = PT;
    }
    const Rows vr = RowsOf(p.v, b, hk, kb, nk, Dv, vbuf);
    Gemm<true>(vr.ptr, 1, vr.stride, P, Br, OT, Br, Dv, nvec, nk);  // O^T += V^T P^T
  }

  FinishRows(p, b, h, i0, nq, chunk, M, L, [&](int64_t ii, int64_t dd) { return OT[dd * Br + ii]; });
}

// ---- backward --------------------------------------------------------------------------------------------
// Pass 1, one task per (b, kv head, key block): dV = sum P'^T dO, dK = scale sum dS^T Q over the group's query
// heads and every query block that can see the key block. Pass 2, one task per (b, h, query block):
// dQ = scale sum dS K (and the dmask rows). Each output element has exactly one writer and a fixed order.
//   P = exp(S - lse), dP = dO V^T (times keep/(1-p) under dropout), dS = P (dP - Di), Di = rowsum(dO ∘ O).

// Recomputes P^T and dS^T [nk x Br] for one (query block, key block) tile. Returns false if the tile is empty.
struct BwdTile {
  float *QT, *dOT, *ST, *dPT, *PdT, *bias, *kbuf, *vbuf;
  uint8_t* pad;
};

// P, P' = P·dropout factor and dS = P (dP − Di) of one tile, in place of S^T, dP'^T and PdT.
// P = exp(S − lse); with kLogSum, P = exp((S − m) − log l): lse_t then holds the row max m (or lse for the rows
// that do not need it, whose log_sum_t is 0).
template <bool kLogSum>
HWY_INLINE void TileProbabilities(const Params& p, BwdTile& w, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t kb,
                                  int64_t nk, const float* lse_t, const float* log_sum_t, const float* delta_t) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d)), Br = p.Br;
  const float keep_scale = p.dropout_p > 0 ? float(1.0 / (1.0 - p.dropout_p)) : 1.f;
  for (int64_t jj = 0; jj < nk; ++jj) {
    float* srow = w.ST + jj * Br;
    float* dprow = w.dPT + jj * Br;
    float* pdrow = w.PdT + jj * Br;
    if (p.dropout_p > 0) {
      for (int64_t ii = 0; ii < nq; ++ii) {
        const bool keep =
            dropout_keep(p.seed, p.dropout_p, uint32_t(b), uint32_t(h), uint32_t(i0 + ii), uint32_t(kb + jj));
        pdrow[ii] = keep ? keep_scale : 0.f;  // temporarily the dropout factor
      }
      for (int64_t ii = nq; ii < Br; ++ii) pdrow[ii] = 0.f;
    }
    for (int64_t x = 0; x < Br; x += N) {
      VF z = hn::Sub(hn::Load(d, srow + x), hn::Load(d, lse_t + x));
      if constexpr (kLogSum) z = hn::Sub(z, hn::Load(d, log_sum_t + x));
      const VF pr = Exp<false>(d, z);  // P
      VF dp = hn::Load(d, dprow + x);
      VF pd = pr;  // P' = P keep/(1-p)
      if (p.dropout_p > 0) {
        const VF f = hn::Load(d, pdrow + x);
        dp = hn::Mul(dp, f);
        pd = hn::Mul(pr, f);
      }
      hn::Store(pd, d, pdrow + x);
      hn::Store(hn::Mul(pr, hn::Sub(dp, hn::Load(d, delta_t + x))), d, srow + x);  // dS^T (in place of S^T)
    }
  }
}

// The rows [n x width] with a NaN replaced by zeros, in buf.
Rows ZeroNanRows(const Rows& r, int64_t n, int64_t width, float* buf) {
  for (int64_t j = 0; j < n; ++j) {
    const float* src = r.ptr + j * r.stride;
    float* dst = buf + j * width;
    bool nan = false;
    for (int64_t x = 0; x < width; ++x) nan |= std::isnan(src[x]);
    if (nan) std::fill(dst, dst + width, 0.f);
    else if (dst != src) std::copy(src, src + width, dst);
  }
  return {buf, width};
}

bool ComputeTile(const Params& p, BwdTile& w, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t kb, int64_t nk,
                 Rows* kr_out, Rows* vr_out) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d)), Br = p.Br, nvec = Br / N, hk = h / p.group;
  const TileMask tm = PrepareTileMask(p, b, h, i0, nq, kb, nk, w.bias, w.pad);
  if (tm.skip) return false;
  const int64_t t = (b * p.Hq + h) * p.num_q_blocks() + i0 / Br;
  w.QT = p.pk_qt + t * p.D * Br;
  w.dOT = p.pk_dot + t * p.Dv * Br;
  Rows kr = RowsOf(p.k, b, hk, kb, nk, p.D, w.kbuf);
  if (p.nan_key_block && p.nan_key_block[(b * p.Hkv + hk) * p.num_k_blocks() + kb / p.Bc])
    kr = ZeroNanRows(kr, nk, p.D, w.kbuf);
  const Rows vr = RowsOf(p.v, b, hk, kb, nk, p.Dv, w.vbuf);
  if (kr_out) *kr_out = kr;
  if (vr_out) *vr_out = vr;
  Gemm<false>(kr.ptr, kr.stride, 1, w.QT, Br, w.ST, Br, nk, nvec, p.D);
  if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, i0, kb, nk, w.bias, w.pad, w.ST);
  Gemm<false>(vr.ptr, vr.stride, 1, w.dOT, Br, w.dPT, Br, nk, nvec, p.Dv);  // dP'^T = V dO^T
  const int64_t row0 = (b * p.Hq + h) * p.Lq + i0;
  if (p.block_has_nan_row[t])  // NaN rows: a NaN score at every allowed key (lse_eff = +inf, Di = 0 elsewhere)
    for (int64_t ii = 0; ii < nq; ++ii)
      if (p.nan_row[row0 + ii])
        for (int64_t jj = 0; jj < nk; ++jj) {
          float& s = w.ST[jj * Br + ii];
          if (s != kNegInf) s = std::numeric_limits<float>::quiet_NaN();
        }
  alignas(64) float lse_t[1024], delta_t[1024];
  for (int64_t ii = 0; ii < Br; ++ii) {
    lse_t[ii] = ii < nq ? p.lse_eff[row0 + ii] : std::numeric_limits<float>::infinity();
    delta_t[ii] = ii < nq ? p.delta[row0 + ii] : 0.f;
  }
  if (p.row_log_sum && p.block_has_log_sum[t]) {
    alignas(64) float log_sum_t[1024];
    for (int64_t ii = 0; ii < Br; ++ii) log_sum_t[ii] = ii < nq ? p.row_log_sum[row0 + ii] : 0.f;
    TileProbabilities<true>(p, w, b, h, i0, nq, kb, nk, lse_t, log_sum_t, delta_t);
  } else {
    TileProbabilities<false>(p, w, b, h, i0, nq, kb, nk, lse_t, nullptr, delta_t);
  }
  return true;
}

struct BwdScratch {
  Scratch s_st, s_dpt, s_pdt, s_bias, s_kbuf, s_vbuf;
  BwdTile w{};
  uint8_t pad[1024];
  explicit BwdScratch(const Params& p) {
    w.ST = s_st.alloc(p.Bc * p.Br);
    w.dPT = s_dpt.alloc(p.Bc * p.Br);
    w.PdT = s_pdt.alloc(p.Bc * p.Br);
    w.bias = p.mask != MaskKind::kNone ? s_bias.alloc(p.Bc * p.Br) : nullptr;
    w.kbuf = s_kbuf.alloc(p.Bc * p.D);
    w.vbuf = s_vbuf.alloc(p.Bc * p.Dv);
    w.pad = pad;
  }
};

void BackwardKVTask(const Params& p, int64_t task) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nkb = p.num_k_blocks(), nqb = p.num_q_blocks(), Br = p.Br, Bc = p.Bc;
  const int64_t bhk = task / nkb, kbi = task % nkb, b = bhk / p.Hkv, hk = bhk % p.Hkv;
  const int64_t kb = kbi * Bc, nk = std::min(Bc, p.Lk - kb);
  const int64_t Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv);
  Scratch s_dk, s_dv;
  float* dK = s_dk.alloc(Bc * Dp);
  float* dV = s_dv.alloc(Bc * Dvp);
  std::memset(dK, 0, sizeof(float) * size_t(Bc * Dp));
  std::memset(dV, 0, sizeof(float) * size_t(Bc * Dvp));
  const bool live = !p.key_len || kb < p.key_len[b];
  if (live) {
    BwdScratch sc(p);
    const int64_t nk_eff = p.key_len ? std::min(nk, p.key_len[b] - kb) : nk;
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
      // Query blocks that can see key kb: causal needs i >= kb - offset.
      int64_t qb0 = 0;
      if (p.causal) qb0 = std::max<int64_t>(0, (kb - p.causal_offset) / Br);
      for (int64_t qb = qb0; qb < nqb; ++qb) {
        const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
        if (!ComputeTile(p, sc.w, b, h, i0, nq, kb, nk_eff, nullptr, nullptr)) continue;
        const int64_t t = (b * p.Hq + h) * nqb + qb;
        const float* Qr = p.pk_qr + t * Br * Dp;
        const float* dOr = p.pk_dor + t * Br * Dvp;
        Gemm<true>(sc.w.PdT, Br, 1, dOr, Dvp, dV, Dvp, nk_eff, Dvp / N, Br);  // dV += P'^T dO
        Gemm<true>(sc.w.ST, Br, 1, Qr, Dp, dK, Dp, nk_eff, Dp / N, Br);       // dK += dS^T (scale Q)
      }
    }
  }
  const int64_t kbase = b * p.dk.sb + hk * p.dk.sh + kb * p.dk.sl;
  const int64_t vbase = b * p.dv.sb + hk * p.dv.sh + kb * p.dv.sl;
  for (int64_t jj = 0; jj < nk; ++jj) {
    for (int64_t x = 0; x < p.D; ++x)
      store_elem(p.dk.data, p.dk.dtype, kbase + jj * p.dk.sl + x * p.dk.sd, dK[jj * Dp + x]);
    for (int64_t x = 0; x < p.Dv; ++x)
      store_elem(p.dv.data, p.dv.dtype, vbase + jj * p.dv.sl + x * p.dv.sd, dV[jj * Dvp + x]);
  }
}

// Adds the dS^T tile [nk x Br] of (b, h) into a broadcast mask's gradient, in double: a broadcast element sums
// up to B·Hq·Lq·Lk values, and a float running sum over thousands of them loses several digits. A mask broadcast
// over the keys first sums the tile's keys of each query in float lanes (at most Bc values).
void AddMaskGradient(const Params& p, int64_t b, int64_t h, int64_t i0, int64_t nq, int64_t kb, int64_t nk,
                     const float* dST, float* key_sums) {
  double* dm = p.dmask_sum + b * p.dm_sb + h * p.dm_sh;
  const int64_t Br = p.Br;
  if (p.dm_sj == 0) {
    const DF d;
    const int64_t N = int64_t(hn::Lanes(d));
    for (int64_t x = 0; x < Br; x += N) {
      VF acc = hn::Zero(d);
      for (int64_t jj = 0; jj < nk; ++jj) acc = hn::Add(acc, hn::Load(d, dST + jj * Br + x));
      hn::Store(acc, d, key_sums + x);
    }
    for (int64_t ii = 0; ii < nq; ++ii) dm[(i0 + ii) * p.dm_sl] += double(key_sums[ii]);
    return;
  }
  for (int64_t jj = 0; jj < nk; ++jj)
    for (int64_t ii = 0; ii < nq; ++ii) dm[(i0 + ii) * p.dm_sl + (kb + jj) * p.dm_sj] += double(dST[jj * Br + ii]);
}

// dQ rows of (b, h, query block) and, when the additive mask has a gradient, the dS contributions to the mask
// rows of this block. Tasks whose mask rows are shared (mask broadcast over b, h or queries) are serialised by
// the driver.
void BackwardQTask(const Params& p, int64_t task) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nqb = p.num_q_blocks(), Br = p.Br, Bc = p.Bc, nvec = Br / N;
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
  int64_t kend = p.Lk;
  if (p.key_len) kend = std::min(kend, p.key_len[b]);
  if (p.causal) kend = std::min(kend, i0 + nq - 1 + p.causal_offset + 1);
  BwdScratch sc(p);
  Scratch s_dqt;
  float* dQT = s_dqt.alloc(p.D * Br);
  alignas(64) float key_sums[1024];
  std::memset(dQT, 0, sizeof(float) * size_t(p.D * Br));
  for (int64_t kb = 0; kb < kend; kb += Bc) {
    const int64_t nk = std::min(Bc, kend - kb);
    Rows kr{};
    if (!ComputeTile(p, sc.w, b, h, i0, nq, kb, nk, &kr, nullptr)) continue;
    Gemm<true>(kr.ptr, 1, kr.stride, sc.w.ST, Br, dQT, Br, p.D, nvec, nk);  // dQ^T += K^T dS^T
    if (p.dmask) {                                                          // one dS value per element
      float* dm = p.dmask + b * p.dm_sb + h * p.dm_sh;
      for (int64_t jj = 0; jj < nk; ++jj)
        for (int64_t ii = 0; ii < nq; ++ii) dm[(i0 + ii) * p.dm_sl + (kb + jj) * p.dm_sj] += sc.w.ST[jj * Br + ii];
    } else if (p.dmask_sum) {
      AddMaskGradient(p, b, h, i0, nq, kb, nk, sc.w.ST, key_sums);
    }
  }
  const int64_t base = b * p.dq.sb + h * p.dq.sh + i0 * p.dq.sl;
  for (int64_t ii = 0; ii < nq; ++ii)
    for (int64_t x = 0; x < p.D; ++x)
      store_elem(p.dq.data, p.dq.dtype, base + ii * p.dq.sl + x * p.dq.sd, dQT[x * Br + ii] * p.scale);
}

void PackQTask(const Params& p, int64_t task) {
  const int64_t nqb = p.num_q_blocks(), Br = p.Br;
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
  const int64_t Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv);
  float *qt = p.pk_qt + task * p.D * Br, *qr = p.pk_qr + task * Br * Dp;
  PackTransposed(p.q, b, h, i0, nq, p.D, Br, p.scale, qt);
  PackTransposed(p.dout, b, h, i0, nq, p.Dv, Br, 1.f, p.pk_dot + task * p.Dv * Br);
  PackRows(p.q, b, h, i0, nq, p.D, Dp, Br, p.scale, qr);
  PackRows(p.dout, b, h, i0, nq, p.Dv, Dvp, Br, 1.f, p.pk_dor + task * Br * Dvp);
  // A NaN in q makes the row a NaN row; its packed q is zeroed (0 · NaN would reach dK through masked keys).
  const int64_t row0 = bh * p.Lq + i0;
  for (int64_t ii = 0; ii < nq; ++ii) {
    bool nan = false;
    for (int64_t x = 0; x < p.D; ++x) nan |= std::isnan(qr[ii * Dp + x]);
    if (!nan) continue;
    for (int64_t x = 0; x < p.D; ++x) qr[ii * Dp + x] = qt[x * Br + ii] = 0.f;
    p.nan_row[row0 + ii] = 1;
    p.lse_eff[row0 + ii] = std::numeric_limits<float>::infinity();
    p.delta[row0 + ii] = 0.f;
    p.block_has_nan_row[task] = 1;
  }
}

// Backward, for the rows of one (b, h, query block) whose lse cannot carry log l (lse_needs_row_stats): the exact
// row max m and l = Σ_j e^(s_j − m), by the forward's online softmax on the same S tiles, stored as lse_eff = m
// and row_log_sum = log l. The block's other rows keep their lse (and row_log_sum 0).
void RowStatsTask(const Params& p, int64_t task) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nqb = p.num_q_blocks(), Br = p.Br, Bc = p.Bc, nvec = Br / N;
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
  int64_t kend = p.Lk;
  if (p.key_len) kend = std::min(kend, p.key_len[b]);
  if (p.causal) kend = std::min(kend, i0 + nq - 1 + p.causal_offset + 1);
  Scratch s_st, s_ml, s_bias, s_kbuf;
  float* ST = s_st.alloc(Bc * Br);
  float* M = s_ml.alloc(2 * Br);
  float* L = M + Br;
  float* bias = p.mask != MaskKind::kNone ? s_bias.alloc(Bc * Br) : nullptr;
  float* kbuf = p.k.dtype == DType::kF32 && p.k.sd == 1 ? nullptr : s_kbuf.alloc(Bc * p.D);
  uint8_t pad[1024];
  std::fill(M, M + Br, kNegInf);
  std::fill(L, L + Br, 0.f);
  const float* QT = p.pk_qt + task * p.D * Br;
  for (int64_t kb = 0; kb < kend; kb += Bc) {
    const int64_t nk = std::min(Bc, kend - kb);
    const TileMask tm = PrepareTileMask(p, b, h, i0, nq, kb, nk, bias, pad);
    if (tm.skip) continue;
    const Rows kr = RowsOf(p.k, b, hk, kb, nk, p.D, kbuf);
    Gemm<false>(kr.ptr, kr.stride, 1, QT, Br, ST, Br, nk, nvec, p.D);  // S^T = K (scale Q)^T
    if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, i0, kb, nk, bias, pad, ST);
    for (int64_t x = 0; x < Br; x += N) OnlineSoftmaxStep(d, ST + x, nk, Br, M + x, L + x);
  }
  const int64_t row0 = bh * p.Lq + i0;
  for (int64_t ii = 0; ii < nq; ++ii)
    if (lse_needs_row_stats(p.lse_eff[row0 + ii]) && L[ii] > 0.f) {
      p.lse_eff[row0 + ii] = M[ii];
      p.row_log_sum[row0 + ii] = std::log(L[ii]);
    }
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace sattn::fused
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <atomic>

#include "simd/dispatch.hpp"

namespace sattn::fused {

namespace {
std::atomic<int64_t> g_workspace{0}, g_workspace_peak{0};

#define SATTN_FUSED_OPS(NS) \
  Ops { &NS::ForwardTask, &NS::BackwardKVTask, &NS::BackwardQTask, &NS::PackQTask, &NS::RowStatsTask }
const simd::Build<Ops> kBuilds[] = {SATTN_SIMD_BUILDS(SATTN_FUSED_OPS)};
}  // namespace

const Ops& ops() { return simd::pick(kBuilds).ops; }
const char* simd_build() { return simd::name(simd::pick(kBuilds).target); }

void workspace_add(int64_t bytes) {
  const int64_t now = g_workspace.fetch_add(bytes) + bytes;
  int64_t peak = g_workspace_peak.load();
  while (now > peak && !g_workspace_peak.compare_exchange_weak(peak, now)) {
  }
}
int64_t workspace_peak_bytes() { return g_workspace_peak.load(); }
void workspace_reset_peak() { g_workspace_peak.store(g_workspace.load()); }

}  // namespace sattn::fused
#endif  // HWY_ONCE
