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
#include <hwy/cache_control.h>
#include <hwy/highway.h>
#include <hwy/contrib/math/math-inl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <limits>
#include <new>

#include "core/workspace.hpp"
#include "kernels/fused/fused.hpp"
#include "sattn/error.hpp"
#include "sattn/random.hpp"
#include "simd/amx_tiles.hpp"
#include "simd/target.hpp"

#include "kernels/fused/fused_tiles.inc"  // per target: the tile operations

HWY_BEFORE_NAMESPACE();
namespace sattn::fused {
namespace HWY_NAMESPACE {

// ---- forward ---------------------------------------------------------------------------------------------
// A row's lse from its max m and sum l: -inf for a row with no allowed key (l = 0), NaN for a NaN row.
inline float RowLse(float m, float l) { return l == 0.f ? kNegInf : m + std::log(l); }

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
    } else if ((p.out.dtype == DType::kF16 || p.out.dtype == DType::kBF16) && p.out.sd == 1) {
      float row[64];  // the row gathered, then converted a vector at a time
      for (int64_t d0 = 0; d0 < Dv; d0 += 64) {
        const int64_t n = std::min<int64_t>(64, Dv - d0);
        for (int64_t dd = 0; dd < n; ++dd) row[dd] = o(ii, d0 + dd);
        StoreHalf(p.out.dtype, static_cast<uint16_t*>(p.out.data) + obase + d0, row, n, inv);
      }
    } else {
      for (int64_t dd = 0; dd < Dv; ++dd) store_elem(p.out.data, p.out.dtype, obase + dd * p.out.sd, o(ii, dd) * inv);
    }
    if (p.lse.data)
      store_elem(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + (i0 + ii) * p.lse.sl, RowLse(M[ii], L[ii]));
  }
}

// FinishRows for a tile O^T [Dv x Br] whose rows go straight to out (no key split): the lanes of O^T times 1/l
// (0 where l = 0) in place, then stored through transposes. The same single product per element as FinishRows.
void FinishTransposedRows(const Params& p, int64_t b, int64_t h, int64_t i0, int64_t nq, const float* M, const float* L,
                          float* OT) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d)), Br = p.Br;
  for (int64_t x = 0; x < Br; x += N) {
    const VF l = hn::Load(d, L + x);
    const VF inv = hn::IfThenElseZero(hn::Ne(l, hn::Zero(d)), hn::Div(hn::Set(d, 1.f), l));
    for (int64_t dd = 0; dd < p.Dv; ++dd) hn::Store(hn::Mul(hn::Load(d, OT + dd * Br + x), inv), d, OT + dd * Br + x);
  }
  StoreTransposed(p.out, b * p.out.sb + h * p.out.sh + i0 * p.out.sl, OT, nq, p.Dv, Br, 1.f);
  if (!p.lse.data) return;
  for (int64_t ii = 0; ii < nq; ++ii)
    store_elem(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + (i0 + ii) * p.lse.sl, RowLse(M[ii], L[ii]));
}

// A vector of a row of float32 or bf16 values (bf16 widened in the register: exact).
HWY_INLINE VF LoadRowVec(DF d, const float* p) { return hn::LoadU(d, p); }
HWY_INLINE VF LoadRowVec(DF d, const hwy::bfloat16_t* p) {
  return hn::PromoteTo(d, hn::LoadU(hn::Rebind<hwy::bfloat16_t, DF>(), p));
}
HWY_INLINE VF LoadRowVec(DF d, const hwy::float16_t* p) { return LoadF16(d, p); }
HWY_INLINE float RowElem(const float* p) { return *p; }
HWY_INLINE float RowElem(const hwy::bfloat16_t* p) { return hwy::F32FromBF16(*p); }
HWY_INLINE float RowElem(const hwy::float16_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return fp16_to_float(bits);
}

// Decode scores of KEYS consecutive keys (rows of K, stride kstride, float32 or bf16 read in place) against NQ query
// rows (Q, stride qstride, zero padded to whole vectors): S[ii * sstride + j] = Q[ii] · K[j] over D. Each key and
// query has its own accumulator (one FMA chain along D). Float32 rows: the KEYS keys go along their rows together,
// one vector of each row at a time, so that all NQ × KEYS chains (about 8) overlap (two keys at a time left the
// chains' latency exposed: 10–16 % slower at 128–512 keys on a Zen 2, and no faster at 65536, where memory decides).
// Half-precision rows: two keys at a time, so that the rows are read in address order while the chains of a pair,
// and of the next pairs in the out-of-order window, overlap (bf16 on the same Zen 2: a few per cent faster at 65536
// keys than all keys together, about 10 % slower at 128).
// Rows of K and V are prefetched this many rows ahead, each cache line once, the K rows before the products.
// Half-precision rows want a shorter distance than float32 ones (measured on the AMX Xeon, bf16, Lq 1, Lk 65536,
// D 64/128: 12 rows ahead read 1.3x faster than 32). Where `near` is set (one query per row on a CPU whose own
// prefetchers stream better, simd::hardware_prefetch_suffices), float32 rows prefetch the lines about to be read
// (all of a pass's rows at once) and half-precision rows nothing (DecodePrefetchRows; -1: none).
template <typename T>
constexpr int64_t kPrefetchRows = sizeof(T) == 2 ? 12 : 32;
template <typename T>
HWY_INLINE int64_t DecodePrefetchRows(bool near) {
  return !near ? kPrefetchRows<T> : sizeof(T) == 2 ? -1 : 0;
}
template <typename T>
constexpr int64_t kLineElems = 64 / sizeof(T);
#include "simd/lane_sums.inc"  // SumsOfLanes8

// The products of keys [J0, J0 + G) along their rows, one vector of each row at a time: acc[ii][j] += Q[ii] · K[j].
// A template argument J0, so that the accumulators have constant indices and stay in registers.
template <int J0, int G, int NQ, int KEYS, typename T>
HWY_INLINE void DecodeProducts(const T* k, int64_t kstride, const float* Q, int64_t qstride, int64_t Dfull,
                               VF (&acc)[NQ][KEYS]) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  for (int64_t x = 0; x < Dfull; x += N) {
    VF qv[NQ];
    for (int ii = 0; ii < NQ; ++ii) qv[ii] = hn::Load(d, Q + ii * qstride + x);
    for (int j = J0; j < J0 + G; ++j) {
      const VF kv = LoadRowVec(d, k + j * kstride + x);
      for (int ii = 0; ii < NQ; ++ii) acc[ii][j] = hn::MulAdd(kv, qv[ii], acc[ii][j]);
    }
  }
}
template <int NQ, int KEYS, typename T>
HWY_INLINE void DecodeScores(const T* k, int64_t kstride, const float* Q, int64_t qstride, int64_t D, float* S,
                             int64_t sstride, bool near) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d)), Dfull = D / N * N;
  VF acc[NQ][KEYS];
  for (int ii = 0; ii < NQ; ++ii)
    for (int j = 0; j < KEYS; ++j) acc[ii][j] = hn::Zero(d);
  // Prefetched before the products: a prefetch inside their loop (on every line's first vector) made the compiler
  // keep the accumulators in memory, and the scores took twice as long as the P·V update of as many bytes.
  if (const int64_t ahead = DecodePrefetchRows<T>(near); ahead >= 0)
    for (int j = 0; j < KEYS; ++j)
      for (int64_t x = 0; x < D; x += kLineElems<T>) hwy::Prefetch(k + (j + ahead) * kstride + x);
  constexpr int G = sizeof(T) == 2 ? (KEYS % 2 == 0 ? 2 : 1) : KEYS;  // keys per pass along the rows
  [&]<int... P>(std::integer_sequence<int, P...>) {
    (DecodeProducts<P * G, G>(k, kstride, Q, qstride, Dfull, acc), ...);
  }
  (std::make_integer_sequence<int, KEYS / G>{});
  // The lane sums first, in a loop of constant trip counts only: with the tail's loop inside it, the compiler kept acc
  // in memory and stored every accumulator on each step of the products.
  if constexpr (NQ * KEYS == 8) {
    VF flat[8];
    for (int ii = 0; ii < NQ; ++ii)
      for (int j = 0; j < KEYS; ++j) flat[ii * KEYS + j] = acc[ii][j];
    float sums[8];
    SumsOfLanes8(flat, sums);
    for (int ii = 0; ii < NQ; ++ii)
      for (int j = 0; j < KEYS; ++j) S[ii * sstride + j] = sums[ii * KEYS + j];
  } else {
    for (int ii = 0; ii < NQ; ++ii)
      for (int j = 0; j < KEYS; ++j) S[ii * sstride + j] = hn::GetLane(hn::SumOfLanes(d, acc[ii][j]));
  }
  if (Dfull < D)
    for (int ii = 0; ii < NQ; ++ii)
      for (int j = 0; j < KEYS; ++j) {
        float sdot = S[ii * sstride + j];
        for (int64_t x = Dfull; x < D; ++x) sdot += RowElem(k + j * kstride + x) * Q[ii * qstride + x];
        S[ii * sstride + j] = sdot;
      }
}

// Decode output update over one key tile: O[ii, 0 : COLS·N] += sum_j P[ii, j] V[j, x0 : x0 + COLS·N], with V rows
// (float32 or bf16, stride vstride), P in S (stride sstride) and O rows of stride ostride. The NQ × COLS
// accumulators stay in registers over all nk keys.
template <int NQ, int COLS, typename T>
HWY_INLINE void DecodeAccumulate(const T* v, int64_t vstride, int64_t nk, const float* S, int64_t sstride, float* O,
                                 int64_t ostride, int64_t x0, bool near) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t ahead = DecodePrefetchRows<T>(near);
  VF acc[NQ][COLS];
  for (int ii = 0; ii < NQ; ++ii)
    for (int c = 0; c < COLS; ++c) acc[ii][c] = hn::Load(d, O + ii * ostride + c * N);
  for (int64_t jj = 0; jj < nk; ++jj) {
    const T* vrow = v + jj * vstride + x0;
    if (ahead >= 0)
      for (int64_t x = 0; x < COLS * N; x += kLineElems<T>) hwy::Prefetch(vrow + ahead * vstride + x);
    VF pv[NQ];
    for (int ii = 0; ii < NQ; ++ii) pv[ii] = hn::Set(d, S[ii * sstride + jj]);
    for (int c = 0; c < COLS; ++c) {
      const VF vv = LoadRowVec(d, vrow + c * N);
      for (int ii = 0; ii < NQ; ++ii) acc[ii][c] = hn::MulAdd(pv[ii], vv, acc[ii][c]);
    }
  }
  for (int ii = 0; ii < NQ; ++ii)
    for (int c = 0; c < COLS; ++c) hn::Store(acc[ii][c], d, O + ii * ostride + c * N);
}

// Calls f(rows, stride) on rows [j0, j0 + n) of (b, h) of t: bf16 and float16 rows of unit stride where they are
// (widened in registers by the decode products), others as a float32 copy in buf (RowsOf).
template <class F>
HWY_INLINE void WithDecodeRows(const View4& t, int64_t b, int64_t h, int64_t j0, int64_t n, int64_t width, float* buf,
                               F&& f) {
  const int64_t first = b * t.sb + h * t.sh + j0 * t.sl;
  if (t.dtype == DType::kBF16 && t.sd == 1) return f(static_cast<const hwy::bfloat16_t*>(t.data) + first, t.sl);
  if (t.dtype == DType::kF16 && t.sd == 1) return f(static_cast<const hwy::float16_t*>(t.data) + first, t.sl);
  const Rows r = RowsOf(t, b, h, j0, n, width, buf);
  f(r.ptr, r.stride);
}

// The scores S = Q K^T and the update O += P V of one decode key tile, on rows read where they are (float32 rows
// of unit stride, or bf16 ones: no converted copy) or from a float32 copy (kr, vr).
template <int NQ, int KEYS, typename T>
HWY_INLINE void DecodeTileScores(const T* k, int64_t kstride, int64_t nk, const float* Q, int64_t D, float* S,
                                 int64_t Bc, bool near) {
  const int64_t Dp = Params::pad16(D);
  int64_t j0 = 0;  // S[ii, jj] = (scale q_ii) · k_jj: KEYS keys at a time, so that the FMA chains overlap
  for (; j0 + KEYS <= nk; j0 += KEYS) DecodeScores<NQ, KEYS>(k + j0 * kstride, kstride, Q, Dp, D, S + j0, Bc, near);
  for (; j0 < nk; ++j0) DecodeScores<NQ, 1>(k + j0 * kstride, kstride, Q, Dp, D, S + j0, Bc, near);
}
template <int NQ, int COLS, typename T>
HWY_INLINE void DecodeTileUpdate(const T* v, int64_t vstride, int64_t nk, const float* S, int64_t Bc, float* O,
                                 int64_t Dv, bool near) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d)), Dvp = Params::pad16(Dv), Dvfull = Dv / N * N;
  // O[ii, x] += sum_j P[ii, j] V[j, x]: up to COLS vectors of O per query held over a run of keys, the strips of
  // COLS vectors one after the other. With several queries (GQA decode: few vectors per strip, several strips per
  // row) and rows of at most 256 bytes, the runs are 4 keys: the strips of a run read the same 4 rows, so a row's
  // lines are read (and prefetched ahead by the strips) close together instead of one strip's line of every row of
  // the tile at a time. float32 D 128 (512-byte rows) gained nothing from runs and keeps whole-tile strips
  // (docs/PERFORMANCE.md, Decode). The same FMA chain per element, keys ascending.
  const bool runs = NQ > 1 && COLS * N < Dvfull && Dv * int64_t(sizeof(T)) <= 256;
  const int64_t run = runs ? 4 : nk;
  for (int64_t j0 = 0; j0 < nk; j0 += run) {
    const int64_t n = std::min(run, nk - j0);
    const T* vr = v + j0 * vstride;
    const float* Sr = S + j0;
    int64_t x0 = 0;
    for (; x0 + COLS * N <= Dvfull; x0 += COLS * N)
      DecodeAccumulate<NQ, COLS>(vr, vstride, n, Sr, Bc, O + x0, Dvp, x0, near);
    if (COLS > 4 && x0 + 4 * N <= Dvfull)
      DecodeAccumulate<NQ, 4>(vr, vstride, n, Sr, Bc, O + x0, Dvp, x0, near), x0 += 4 * N;
    if (COLS > 2 && x0 + 2 * N <= Dvfull)
      DecodeAccumulate<NQ, 2>(vr, vstride, n, Sr, Bc, O + x0, Dvp, x0, near), x0 += 2 * N;
    for (; x0 < Dvfull; x0 += N) DecodeAccumulate<NQ, 1>(vr, vstride, n, Sr, Bc, O + x0, Dvp, x0, near);
  }
  for (int64_t x = Dvfull; x < Dv; ++x)
    for (int64_t jj = 0; jj < nk; ++jj)
      for (int ii = 0; ii < NQ; ++ii) O[ii * Dvp + x] += S[ii * Bc + jj] * RowElem(v + jj * vstride + x);
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
  const int64_t Dp = Params::pad16(D), Dvp = Params::pad16(Dv);
  constexpr int kKeys = NQ == 1 ? 8 : NQ == 2 ? 4 : 2, kCols = NQ == 1 ? 8 : NQ == 2 ? 4 : 2;  // about 8 chains
  // Prefetching near (DecodePrefetchRows) streams one query's K and V faster on a Zen 4, one thread (Lk 65536, D
  // 64 / 128: float32 1.2x / 1.3x, bf16 1.25x / 1.5x; two threads, which share the memory, about the same); with
  // several queries per row (GQA) the far prefetches were as fast or up to 1.2x faster (docs/PERFORMANCE.md, Decode).
  const bool near = NQ == 1 && simd::hardware_prefetch_suffices();
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
    int64_t x = 0;
    if (p.q.dtype == DType::kF32 && p.q.sd == 1)  // whole vectors where they are; the same product per element
      for (const float* src = static_cast<const float*>(p.q.data) + base; x + N <= D; x += N)
        hn::StoreU(hn::Mul(hn::LoadU(d, src + x), hn::Set(d, p.scale)), d, Q + ii * Dp + x);
    for (; x < D; ++x) Q[ii * Dp + x] = load_elem(p.q.data, p.q.dtype, base + x * p.q.sd) * p.scale;
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
    WithDecodeRows(p.k, b, hk, kb, nk, D, kbuf,
                   [&](const auto* k, int64_t ks) { DecodeTileScores<NQ, kKeys>(k, ks, nk, Q, D, S, Bc, near); });
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
      // The tile's maximum, NaN scores ignored as std::max(mx, s) does (their exponentials make the row NaN): lanes
      // first, so that no chain of one max per key waits on the last.
      VF vmax = hn::Set(d, kNegInf);
      int64_t jm = 0;
      for (; jm + N <= nk; jm += N) {
        const VF sv = hn::LoadU(d, srow + jm);
        vmax = hn::IfThenElse(hn::Gt(sv, vmax), sv, vmax);
      }
      float mx = hn::GetLane(hn::MaxOfLanes(d, vmax));
      for (; jm < nk; ++jm) mx = std::max(mx, srow[jm]);
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
        for (int64_t j = 0; j < nk; ++j) srow[j] = p.keep(b, rh[ii], ri[ii], kb + j) ? srow[j] * keep_scale : 0.f;
      }
    }
    WithDecodeRows(p.v, b, hk, kb, nk, Dv, vbuf,
                   [&](const auto* v, int64_t vs) { DecodeTileUpdate<NQ, kCols>(v, vs, nk, S, Bc, O, Dv, near); });
  }
  for (int ii = 0; ii < NQ; ++ii)
    FinishRows(p, b, rh[ii], ri[ii], 1, chunk, M + ii, L + ii, [&](int64_t, int64_t dd) { return O[ii * Dvp + dd]; });
}

// The query rows of a tile are a multiple of this (ForwardOps::query_granule): whole vectors, at least 8.
constexpr int64_t kQueryGranule = HWY_LANES(float) > 8 ? int64_t(HWY_LANES(float)) : 8;

// Rows [0, L) x [0, width) of (b, h) of t (bf16 or float16, unit element stride) as dense float32 rows.
void WidenRows(const View4& t, int64_t b, int64_t h, int64_t L, int64_t width, float* out) {
  for (int64_t j0 = 0; j0 < L; j0 += 64) RowsOf(t, b, h, j0, std::min<int64_t>(64, L - j0), width, out + j0 * width);
}

// Params::vt_blocks of key block task % num_k_blocks of (b, kv head) task / num_k_blocks: V^T [Dv x Bc], keys past
// Lk zero; the float32 rows the forward would read (RowsOf: in place, or widened exactly), each value times 1.
void PackVtBlock(const Params& p, int64_t task, float* out) {
  const int64_t nkb = p.num_k_blocks(), bh = task / nkb, kb = task % nkb * p.Bc, nk = std::min(p.Bc, p.Lk - kb);
  Scratch s_rows;
  const Rows r = RowsOf(p.v, bh / p.Hkv, bh % p.Hkv, kb, nk, p.Dv, s_rows.alloc(nk * p.Dv));
  TransposeRows(r.ptr, r.stride, nk, p.Dv, 1.f, out + task * p.Dv * p.Bc, p.Bc, p.Bc);
}

void ForwardTask(const Params& p, int64_t task) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t Br = p.Br, Bc = p.Bc, D = p.D, Dv = p.Dv, nvec = Br / N;
  // Split keys (decode): task = ((b * Hq + h) * num_q_blocks + qb) * nchunks + chunk, keys [chunk·kv_chunk, +kv_chunk).
  const int64_t nchunks = p.num_kv_chunks(), chunk = task % nchunks;
  task /= nchunks;
  if (p.decode_group) {  // GQA decode: task = (b * Hkv + hk) * nchunks + chunk, rows = group heads x Lq queries
    const int64_t b = task / p.Hkv, hk = task % p.Hkv, nr = p.group * p.Lq;
    int64_t kend = p.key_end(b, 0, p.Lq), kbeg = 0;
    if (p.kv_chunk > 0) kbeg = chunk * p.kv_chunk, kend = std::min(kend, kbeg + p.kv_chunk);
    int64_t rh[kDecodeRows], ri[kDecodeRows];
    for (int64_t r = 0; r < nr; ++r) rh[r] = hk * p.group + r / p.Lq, ri[r] = r % p.Lq;
    switch (nr) {
      case 2: return DecodeRows<2>(p, b, hk, rh, ri, kbeg, kend, chunk);
      case 3: return DecodeRows<3>(p, b, hk, rh, ri, kbeg, kend, chunk);
      default: return DecodeRows<4>(p, b, hk, rh, ri, kbeg, kend, chunk);
    }
  }
  const Params::QueryTask qt = p.query_task(task);
  const int64_t b = qt.b, h = qt.h, hk = h / p.group, qb0 = qt.qb0, ntiles = qt.count;
  // The keys of the query block that starts at row i0 (nq rows), within this task's chunk.
  const auto key_end = [&](int64_t i0, int64_t nq) {
    const int64_t kend = p.key_end(b, i0, nq);
    return p.kv_chunk > 0 ? std::min(kend, (chunk + 1) * p.kv_chunk) : kend;
  };
  const int64_t kbeg = p.kv_chunk > 0 ? chunk * p.kv_chunk : 0;
  if (p.Lq <= kDecodeRows) {  // keys in lanes (Lq = 1..4; one query block)
    const int64_t i0 = qb0 * Br, nq = std::min(Br, p.Lq - i0), kend = key_end(i0, nq);
    int64_t rh[kDecodeRows], ri[kDecodeRows];
    for (int64_t r = 0; r < nq; ++r) rh[r] = h, ri[r] = i0 + r;
    switch (nq) {
      case 1: return DecodeRows<1>(p, b, hk, rh, ri, kbeg, kend, chunk);
      case 2: return DecodeRows<2>(p, b, hk, rh, ri, kbeg, kend, chunk);
      case 3: return DecodeRows<3>(p, b, hk, rh, ri, kbeg, kend, chunk);
      default: return DecodeRows<4>(p, b, hk, rh, ri, kbeg, kend, chunk);
    }
  }

  // Per query block: Q^T, O^T, M, L. Shared by the blocks (used within one block's turn on the keys): S^T, the bias
  // and padding of a key block, K and V rows widened to float32, the dropped P.
  Scratch s_qt, s_st, s_ot, s_ml, s_bias, s_kbuf, s_vbuf, s_pt;
  float* QT = s_qt.alloc(ntiles * D * Br);
  float* ST = s_st.alloc(Bc * Br);
  float* OT = s_ot.alloc(ntiles * Dv * Br);
  float* ML = s_ml.alloc(ntiles * 2 * Br);
  float* bias = p.mask != MaskKind::kNone ? s_bias.alloc(Bc * Br) : nullptr;
  const bool k_direct = p.k.dtype == DType::kF32 && p.k.sd == 1, v_direct = p.v.dtype == DType::kF32 && p.v.sd == 1;
  float* kbuf = k_direct ? nullptr : s_kbuf.alloc(Bc * D);
  float* vbuf = v_direct ? nullptr : s_vbuf.alloc(Bc * Dv);
  float* PT = p.dropout_p > 0 ? s_pt.alloc(Bc * Br) : nullptr;
  uint8_t pad[1024];  // Bc <= 1024 (checked by the driver)
  std::memset(OT, 0, sizeof(float) * size_t(ntiles * Dv * Br));
  std::fill(ML, ML + ntiles * 2 * Br, kNegInf);

  struct Tile {
    int64_t i0, nq, kend;
    float *QT, *OT, *M, *L;
  } tiles[Params::kMaxQBlocksPerTask];
  int64_t kend_max = kbeg;
  for (int64_t g = 0; g < ntiles; ++g) {
    Tile& t = tiles[g];
    t.i0 = (qb0 + g) * Br, t.nq = std::min(Br, p.Lq - t.i0), t.kend = key_end(t.i0, t.nq);
    t.QT = QT + g * D * Br, t.OT = OT + g * Dv * Br, t.M = ML + g * 2 * Br, t.L = t.M + Br;
    std::fill(t.L, t.L + Br, 0.f);
    if (t.kend > kbeg) PackTransposed(p.q, b, h, t.i0, t.nq, D, Br, p.scale, t.QT);
    kend_max = std::max(kend_max, t.kend);
  }

  // Query tiles of up to 32 rows (a few queries over many keys) do too little arithmetic per key for the hardware
  // prefetchers to keep up: each key block prefetches the next one's float32 K and V rows (docs/PERFORMANCE.md,
  // "Short keys": a few queries over many keys).
  const bool prefetch = k_direct && v_direct && Br <= 32;
  // The key blocks [k0, k1) of query block t.
  const auto keys = [&](const Tile& t, int64_t k0, int64_t k1) {
    for (int64_t kb = k0; kb < k1; kb += Bc) {
      const int64_t nk = std::min(Bc, k1 - kb);
      if (prefetch && kb + Bc < t.kend) {  // (across the end of a pass too: a lone block goes on there)
        const float* kn = static_cast<const float*>(p.k.data) + b * p.k.sb + hk * p.k.sh + (kb + Bc) * p.k.sl;
        const float* vn = static_cast<const float*>(p.v.data) + b * p.v.sb + hk * p.v.sh + (kb + Bc) * p.v.sl;
        for (int64_t j = 0; j < std::min(Bc, t.kend - kb - Bc); ++j) {
          for (int64_t x = 0; x < D; x += kLineElems<float>) hwy::Prefetch(kn + j * p.k.sl + x);
          for (int64_t x = 0; x < Dv; x += kLineElems<float>) hwy::Prefetch(vn + j * p.v.sl + x);
        }
      }
      const TileMask tm = PrepareTileMask(p, b, h, t.i0, t.nq, kb, nk, bias, pad);
      if (tm.skip) continue;
      const Rows kr = RowsOf(p.k, b, hk, kb, nk, D, kbuf);
      Gemm<false>(kr.ptr, kr.stride, 1, t.QT, Br, ST, Br, nk, nvec, D);  // S^T = K (scale Q)^T
      if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, t.i0, kb, nk, bias, pad, ST);
      const float* P = SoftmaxTile(p, b, h, t.i0, t.nq, kb, nk, ST, PT, t.OT, t.M, t.L);
      if (p.vt_blocks) {  // O^T += V^T P^T, V^T's rows Bc apart
        const float* vt = p.vt_blocks + ((b * p.Hkv + hk) * p.num_k_blocks() + kb / Bc) * Dv * Bc;
        Gemm<true>(vt, Bc, 1, P, Br, t.OT, Br, Dv, nvec, nk);
      } else {
        const Rows vr = RowsOf(p.v, b, hk, kb, nk, Dv, vbuf);
        Gemm<true>(vr.ptr, 1, vr.stride, P, Br, t.OT, Br, Dv, nvec, nk);  // O^T += V^T P^T
      }
    }
  };
  // Passes of key_pass keys (Params::key_pass), each block taking its turn, so that a pass's K and V rows are read
  // from L2 by all of them; a pass starts on a key block, so each block computes exactly what it computes alone.
  const int64_t pass = p.key_pass > 0 ? p.key_pass : kend_max - kbeg;
  for (int64_t k0 = kbeg; k0 < kend_max; k0 += pass)
    for (int64_t g = 0; g < ntiles; ++g) keys(tiles[g], k0, std::min(k0 + pass, tiles[g].kend));

  for (int64_t g = 0; g < ntiles; ++g) {
    const Tile& t = tiles[g];
    if (p.kv_chunk > 0)
      FinishRows(p, b, h, t.i0, t.nq, chunk, t.M, t.L, [&](int64_t ii, int64_t dd) { return t.OT[dd * Br + ii]; });
    else FinishTransposedRows(p, b, h, t.i0, t.nq, t.M, t.L, t.OT);
  }
}

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
// ---- bf16 products (the amx and avx512bf16 builds) ---------------------------------------------------------
// The same tiles, masks and online softmax as ForwardTask; the two products take bf16 pairs: vdpbf16ps adds
// a.lo·b.lo + a.hi·b.hi to each float32 lane (the products of two bf16 are exact in float32). S^T = K Q^T pairs
// along D (K from k_pairs, Q packed per task; Q is not pre-scaled, so that bf16 inputs enter unrounded: the scale
// multiplies the float32 sums), O^T += V^T P^T pairs along the keys (V from v_pairs; P, in float32, as the sum of
// two bf16 matrices, so that O keeps float32 accuracy; with Float32Precision::kBF16 rounded to bf16 once, as
// FlashAttention does, 2^-9 relative). With bf16 inputs every product is then as accurate as the float32 path's.
// float32 inputs take this path only with kBF16 (rounded to bf16 when packed). vdpbf16ps flushes denormal bf16 to zero.
// The bf16 GEMM and packing are in fused_tiles.inc. The amx build computes the same products on AMX tiles
// (simd/amx_tiles.hpp; V^T pairs, see Params::amx_tiles), which flush bf16 denormals too.
// One query block's tiles on the bf16 products.
struct Bf16ForwardTile {
  int64_t b, h, i0, nq, kend;
  const uint32_t *kp, *vp;  // this head's K pairs and V (or V^T) pairs
  uint32_t* QP;             // Q^T pairs [k_pair_stride() x Br]
  float* ST[2];             // S^T [Bc x Br]; the second for the amx loop, which computes the next while using one
  float *OT, *M, *L, *MX, *bias, *PT;
  uint32_t* PP;  // P^T pairs [pv_keys/2 x Br], hi and lo
  uint8_t* pad;
  float* sums;             // [Br]: a tile's sums of P while its max check is pending (ForwardKeysAmx)
  int64_t check_wait = 0;  // key blocks to go before the max check is folded into the softmax again
};

// True where every lane of M [Br] is finite or +inf (not -inf, not NaN).
SATTN_BF16_ATTR inline bool AllAboveNegInf(const float* M, int64_t Br) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  auto below = hn::FirstN(d, 0);
  for (int64_t x = 0; x < Br; x += N) below = hn::Or(below, hn::Not(hn::Gt(hn::Load(d, M + x), hn::Set(d, kNegInf))));
  return hn::AllFalse(d, below);
}

// Key blocks that check their max first after a block whose max moved in the softmax's own check.
inline constexpr int64_t kCheckWait = 4;

// The online softmax of S^T (scores divided by fold) into P^T pairs at out (their lo parts lo_offset words on),
// against the max the caller has moved where TileMaxMoves asked; between(x) runs before each group of query
// lanes x (the amx loop's next S^T product). With dropout, SoftmaxTile moves the max and rescales O^T itself.
template <class Between>
SATTN_BF16_ATTR void SoftmaxIntoPairs(const Params& p, const Bf16ForwardTile& t, int64_t kb, int64_t nk, float* ST,
                                      float fold, uint32_t* out, int64_t lo_offset, Between&& between) {
  if (t.PT) {  // dropout: P and the dropped P' in float32, then packed
    if (fold != 1.f) ScaleRows(ST, nk, p.Br, fold);
    const float* P = SoftmaxTile(p, t.b, t.h, t.i0, t.nq, kb, nk, ST, t.PT, t.OT, t.M, t.L);
    if (p.round_p) PackProbabilityPairs<false>(P, nk, p.Br, out, lo_offset);  // P rounded once: no lo parts
    else PackProbabilityPairs(P, nk, p.Br, out, lo_offset);
  } else if (p.round_p) SoftmaxToPairs<false>(p, nk, ST, fold, out, lo_offset, t.M, t.L, between);
  else SoftmaxToPairs<true>(p, nk, ST, fold, out, lo_offset, t.M, t.L, between);
}

// The amx build's key loop over keys [k0, k1) (all of them, or a pass of Params::key_pass keys that begins on a
// slab; the P left at its end goes into O^T, as it would at the slab's end). The tiles take S^T of the next live
// key block while the vector units run this block's softmax (its blocks are issued between the softmax's lane
// groups; out-of-order execution overlaps them).
// The P of consecutive key blocks collect in t.PP, up to a slab of pv_keys() keys, and go into O^T in one product
// O^T += V^T P^T (one load and store of each O^T tile per slab instead of per key block): before the max moves
// (it rescales O^T), at the end of a slab or of a run of live blocks, and after every block with dropout. The tiles
// store unscaled sums: the scale goes into the softmax's exponent (fold), or onto S^T first where a float bias is
// added to the scaled scores. kSplit (Params::split_bf16): K, Q and V in two bf16 parts each, every product
// summing the four part products (P is in two parts already: round_p is off), or three without kLoLo (float32
// inputs, whose parts are not exact anyway: the two rounding errors' product dropped, as bfloat16x3 does).
template <bool kSplit, bool kLoLo = true>
SATTN_BF16_ATTR void ForwardKeysAmx(const Params& p, Bf16ForwardTile& t, int64_t k0, int64_t k1) {
  const int64_t Br = p.Br, Bc = p.Bc, D2 = p.d_pairs(), D2s = p.k_pair_stride(), Dvt = p.vt_rows(), S = p.pv_keys(),
                S2 = S / 2, lo_offset = S2 * Br;
  namespace amx = simd::amx;
  const int64_t kstop = std::min(k1, t.kend);  // keys [k0, kstop): whole key blocks, k0 a multiple of pv_keys()
  const auto next_live = [&](int64_t kb, TileMask& tm) {  // fills bias and pad for the block it returns
    for (; kb < kstop; kb += Bc)
      if (!(tm = PrepareTileMask(p, t.b, t.h, t.i0, t.nq, kb, std::min(Bc, t.kend - kb), t.bias, t.pad)).skip) break;
    return kb;
  };
  const auto scores = [&](int64_t kb, float* ST) {
    const int64_t nk = std::min(Bc, t.kend - kb);
    return amx::PairsProduct<AmxTiles, false, kSplit, kSplit, kLoLo>{
        t.kp + kb * D2s, D2s, t.QP, Br, kSplit ? D2 * Br : 0, ST, Br, nk, Br, 2 * D2s, 1.f, p.k_lo_words};
  };
  int64_t buf_k0 = 0, buf_n = 0;  // keys [buf_k0, buf_k0 + buf_n) have their P in t.PP, not yet in O^T
  const auto flush = [&] {
    if (buf_n == 0) return;
    const uint32_t* vt = t.vp + buf_k0 / S * Dvt * S2 + buf_k0 % S / 2;  // their V^T pairs, rows S2 words apart
    if (kSplit)
      amx::gemm_pairs<AmxTiles, true, true, true, kLoLo>(vt, S2, t.PP, Br, lo_offset, t.OT, Br, Dvt, Br, buf_n, 1.f,
                                                         p.v_lo_words);
    else if (p.round_p)
      amx::gemm_pairs<AmxTiles, true, false>(vt, S2, t.PP, Br, lo_offset, t.OT, Br, Dvt, Br, buf_n, 1.f);
    else amx::gemm_pairs<AmxTiles, true, true>(vt, S2, t.PP, Br, lo_offset, t.OT, Br, Dvt, Br, buf_n, 1.f);
    buf_n = 0;
  };
  TileMask tm;
  int64_t kb = next_live(k0, tm);
  if (kb < kstop) scores(kb, t.ST[0]).run();
  for (int cur = 0; kb < kstop; cur ^= 1) {
    const int64_t nk = std::min(Bc, t.kend - kb);
    float* ST = t.ST[cur];
    float fold = p.scale;
    if (tm.has_bias || !(p.scale > 0.f)) ScaleRows(ST, nk, Br, p.scale), fold = 1.f;
    if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, t.i0, kb, nk, t.bias, t.pad, ST);
    // Step 1 (the tile max) folded into the softmax's pass where every lane has its max already (the usual case
    // after a row's first block): P against the max as it is, redone in the rare tile whose max moves after all
    // (then step 1 goes first for the next kCheckWait blocks). Without dropout, on key blocks of a multiple of 4.
    const bool check_in_softmax = !t.PT && nk % 4 == 0 && t.check_wait == 0 && AllAboveNegInf(t.M, Br);
    if (t.check_wait > 0) --t.check_wait;
    const bool moves = !t.PT && !check_in_softmax && TileMaxMoves(p, nk, ST, fold, t.M, t.MX);
    if (moves || t.PT || kb != buf_k0 + buf_n || kb / S != buf_k0 / S) flush();
    if (moves) MoveTileMax(p, t.MX, t.M, t.L, t.OT);
    if (buf_n == 0) buf_k0 = kb;
    TileMask tm_next;
    const int64_t kb_next = next_live(kb + Bc, tm_next);
    const auto next = scores(std::min(kb_next, kstop - 1), t.ST[cur ^ 1]);
    const int64_t nblocks = kb_next < kstop ? next.num_blocks() : 0;
    int64_t done = 0;
    const auto between = [&](int64_t) {
      if (done < nblocks) CleanVectorsForTiles(), next.run_block(done++);
    };
    if (check_in_softmax) {
      uint32_t* out = t.PP + buf_n / 2 * Br;
      const bool moved =
          p.round_p ? SoftmaxToPairs<false, true>(p, nk, ST, fold, out, lo_offset, t.M, t.L, between, t.MX, t.sums)
                    : SoftmaxToPairs<true, true>(p, nk, ST, fold, out, lo_offset, t.M, t.L, between, t.MX, t.sums);
      if (!moved) {
        AddScaledRows(t.L, t.sums, Br, 1.f);  // l += the sums (times 1: exact, the same sum)
      } else {  // as if step 1 had said so: the P before this block into O^T, the max moved, this block's P again
        flush();
        MoveTileMax(p, t.MX, t.M, t.L, t.OT);
        buf_k0 = kb;
        SoftmaxIntoPairs(p, t, kb, nk, ST, fold, t.PP, lo_offset, [](int64_t) {});
        t.check_wait = kCheckWait;
      }
    } else {
      SoftmaxIntoPairs(p, t, kb, nk, ST, fold, t.PP + buf_n / 2 * Br, lo_offset, between);
    }
    while (done < nblocks) next.run_block(done++);
    buf_n += nk;
    if (t.PT || nk % 2) flush();  // dropout rescales O^T in the next SoftmaxTile; an odd tile ends the keys
    kb = kb_next, tm = tm_next;
  }
  flush();
}

// O^T [Dv x Br] as rows O [nq x ld] for FinishRows: 16 x 16 blocks transposed in registers, the last Dv % 16
// dimensions one by one (FinishRows reading O^T in place reads a cache line per element).
inline void TransposeToRows(const float* OT, int64_t Dv, int64_t Br, int64_t nq, float* O, int64_t ld) {
  int64_t d0 = 0;
  for (; d0 + 16 <= Dv; d0 += 16)
    for (int64_t q0 = 0; q0 < nq; q0 += 16) {  // Br is a multiple of 16
      __m512i r[16];
      for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_si512(OT + (d0 + k) * Br + q0);
      Transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(O + (q0 + i) * ld + d0, r[i]);
    }
  for (; d0 < Dv; ++d0)
    for (int64_t ii = 0; ii < nq; ++ii) O[ii * ld + d0] = OT[d0 * Br + ii];
}

// Rows of O for FinishRows. (A lambda inside ForwardTaskBf16 would carry its bf16 target and could not be inlined
// into FinishRows: a call per element.)
struct DenseRows {
  const float* O;
  int64_t ld;
  float operator()(int64_t ii, int64_t dd) const { return O[ii * ld + dd]; }
};

SATTN_BF16_ATTR void ForwardTaskBf16(const Params& p, int64_t task) {
  if (!p.k_pairs) return ForwardTask(p, task);  // decode and float32 inputs: the float32 products
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t Br = p.Br, Bc = p.Bc, Dv = p.Dv, nvec = Br / N, D2 = p.d_pairs(), D2s = p.k_pair_stride();
  const Params::QueryTask qt = p.query_task(task);
  const int64_t b = qt.b, h = qt.h, hk = h / p.group, qb0 = qt.qb0, ntiles = qt.count;
  const int64_t qp_words = D2s * Br * (p.split_bf16 ? 2 : 1), ot_floats = p.vt_rows() * Br;

  // Per query block: Q^T pairs, O^T, M, L, MX. Shared by the blocks (used within one block's turn on the keys):
  // S^T, P pairs, the bias and padding of a key block, the dropped P.
  Scratch s_qp, s_st, s_ot, s_ml, s_bias, s_pp, s_pt, s_vlast, s_o;
  uint8_t pad[1024];  // Bc <= 1024 (checked by the driver)
  auto* QP = reinterpret_cast<uint32_t*>(s_qp.alloc(ntiles * qp_words));
  float* ST = s_st.alloc(Bc * Br * (p.amx_tiles ? 2 : 1));
  float* OT = s_ot.alloc(ntiles * ot_floats);  // the pad rows (amx) stay zero
  float* ML = s_ml.alloc(ntiles * 4 * Br);
  float* bias = p.mask != MaskKind::kNone ? s_bias.alloc(Bc * Br) : nullptr;
  auto* PP = reinterpret_cast<uint32_t*>(s_pp.alloc(p.pv_keys() / 2 * Br * 2));
  float* PT = p.dropout_p > 0 ? s_pt.alloc(Bc * Br) : nullptr;
  auto* vlast = reinterpret_cast<uint32_t*>(s_vlast.alloc(Dv));
  std::memset(OT, 0, sizeof(float) * size_t(ntiles * ot_floats));

  Bf16ForwardTile tiles[Params::kMaxQBlocksPerTask];
  int64_t kend_max = 0;
  for (int64_t g = 0; g < ntiles; ++g) {
    const int64_t i0 = (qb0 + g) * Br, nq = std::min(Br, p.Lq - i0), kend = p.key_end(b, i0, nq);
    kend_max = std::max(kend_max, kend);
    Bf16ForwardTile& t = tiles[g];
    t = Bf16ForwardTile{b,
                        h,
                        i0,
                        nq,
                        kend,
                        p.k_pairs + (b * p.Hkv + hk) * p.Lk * D2s,
                        p.v_pairs + (b * p.Hkv + hk) * p.v_pairs_head_words()};
    t.QP = QP + g * qp_words;
    t.ST[0] = ST;
    t.ST[1] = ST + (p.amx_tiles ? Bc * Br : 0);
    t.OT = OT + g * ot_floats;
    t.M = ML + g * 4 * Br;
    t.L = t.M + Br;
    t.MX = t.L + Br;
    t.sums = t.MX + Br;
    t.bias = bias;
    t.PP = PP;
    t.PT = PT;
    t.pad = pad;
    std::fill(t.M, t.M + Br, kNegInf);
    std::fill(t.L, t.L + Br, 0.f);
    if (p.split_bf16) PackTransposedSplitPairs(p.q, b, h, i0, nq, p.D, Br, t.QP, D2 * Br);
    else PackTransposedPairs(p.q, b, h, i0, nq, p.D, Br, t.QP);
    std::fill(t.QP + D2 * Br, t.QP + D2s * Br, 0u);  // the pad rows of k_pair_stride()
  }
  if (p.amx_tiles) {
    const AmxTaskScope tile_config(true);
    const int64_t pass = p.key_pass > 0 ? p.key_pass : kend_max;  // one pass over all keys
    for (int64_t k0 = 0; k0 < kend_max; k0 += pass)
      for (int64_t g = 0; g < ntiles; ++g) {
        if (k0 >= tiles[g].kend) continue;
        if (p.split_bf16 && p.q.dtype == DType::kF32) ForwardKeysAmx<true, false>(p, tiles[g], k0, k0 + pass);
        else if (p.split_bf16) ForwardKeysAmx<true>(p, tiles[g], k0, k0 + pass);
        else ForwardKeysAmx<false>(p, tiles[g], k0, k0 + pass);
      }
  } else {
    for (int64_t g = 0; g < ntiles; ++g) {  // one block per task (q_blocks_per_task is the amx build's)
      Bf16ForwardTile& t = tiles[g];
      for (int64_t kb = 0; kb < t.kend; kb += Bc) {
        const int64_t nk = std::min(Bc, t.kend - kb);
        const TileMask tm = PrepareTileMask(p, b, h, t.i0, t.nq, kb, nk, t.bias, pad);
        if (tm.skip) continue;
        GemmBf16<false, false>(t.kp + kb * D2, D2, 1, t.QP, Br, 0, t.ST[0], Br, nk, nvec, D2, p.scale);  // scale K Q^T
        if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, t.i0, kb, nk, t.bias, pad, t.ST[0]);
        if (!t.PT && TileMaxMoves(p, nk, t.ST[0], 1.f, t.M, t.MX)) MoveTileMax(p, t.MX, t.M, t.L, t.OT);
        SoftmaxIntoPairs(p, t, kb, nk, t.ST[0], 1.f, t.PP, (nk + 1) / 2 * Br, [](int64_t) {});
        const uint32_t* vt = t.vp + kb / 2 * Dv;  // O^T += V^T P^T
        const int64_t lo = (nk + 1) / 2 * Br;
        if (p.round_p) GemmKeyPairs<false>(vt, Dv, t.PP, Br, lo, t.OT, Br, nvec, nk, vlast);
        else GemmKeyPairs<true>(vt, Dv, t.PP, Br, lo, t.OT, Br, nvec, nk, vlast);
      }
    }
  }
  // Rows straight to out: O^T times 1/l in place, stored through transposes; a key chunk's partial rows through
  // FinishRows (rows of O transposed first).
  float* O = p.kv_chunk > 0 ? s_o.alloc(Br * Params::pad16(Dv)) : nullptr;
  for (int64_t g = 0; g < ntiles; ++g) {
    const Bf16ForwardTile& t = tiles[g];
    if (p.kv_chunk == 0) {
      FinishTransposedRows(p, b, h, t.i0, t.nq, t.M, t.L, t.OT);
      continue;
    }
    TransposeToRows(t.OT, Dv, Br, t.nq, O, Params::pad16(Dv));
    FinishRows(p, b, h, t.i0, t.nq, 0, t.M, t.L, DenseRows{O, Params::pad16(Dv)});
  }
}
#endif  // HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64

}  // namespace HWY_NAMESPACE
}  // namespace sattn::fused
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <atomic>

#include "simd/dispatch.hpp"

namespace sattn::fused {

namespace {
std::atomic<int64_t> g_workspace{0}, g_workspace_peak{0};

#define SATTN_FUSED_FORWARD_OPS(NS) \
  ForwardOps { &NS::ForwardTask, nullptr, false, &NS::WidenRows, NS::kQueryGranule, &NS::PackVtBlock }
const simd::Build<ForwardOps> kBuilds[] = {
#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64
    {simd::Target::kAmx,
     ForwardOps{&N_AVX3::ForwardTaskBf16, &N_AVX3::PackKVPairs, true, &N_AVX3::WidenRows, 16, &N_AVX3::PackVtBlock}},
    {simd::Target::kAvx512Bf16,
     ForwardOps{&N_AVX3::ForwardTaskBf16, &N_AVX3::PackKVPairs, false, &N_AVX3::WidenRows, 16, &N_AVX3::PackVtBlock}},
#endif
    SATTN_SIMD_BUILDS(SATTN_FUSED_FORWARD_OPS)};
}  // namespace

const ForwardOps& forward_ops() { return simd::pick(kBuilds).ops; }
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
