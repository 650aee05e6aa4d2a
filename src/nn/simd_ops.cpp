// SIMD kernels of nn/ops (Highway, compiled per target of simd/hwy_targets.hpp and picked at run time from the one
// target table, simd/target.hpp):
// the register-blocked GEMM, the flat depthwise 3x3 row, layer norm and GELU.
//
// Determinism: every output element of the GEMM is one fused-multiply-add chain over k in a fixed order (segments
// in order, k ascending), started from the value already in C, whatever its row/column position, the tile shape
// or the thread count — so results do not depend on how rows are batched (tiled == untiled, 1 == 2 threads).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "nn/simd_ops.cpp"
#include "simd/hwy_targets.hpp"
#include <hwy/foreach_target.h>  // must come before highway.h

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "nn/ops.hpp"
#include "sattn/error.hpp"

HWY_BEFORE_NAMESPACE();
namespace sattn::nn {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using MF = hn::Mask<DF>;

#include "simd/blocking.inc"  // kMR, kNV
#include "simd/gemm.inc"      // MicroKernel, MicroKernelHalf

// C[MR rows, NV vectors] += sum_s A_s[m, :K_s] · W rows (row stride ldw); the last vector of C masked to `rem`
// lanes when kMask, and its W loads too when kMaskW (else W rows are readable up to the full vector: padded).
template <int MR, int NV, bool kMask, bool kMaskW>
HWY_NOINLINE void Tile(int nseg, const float* const* A, const int64_t* K, int64_t lda, const float* HWY_RESTRICT W,
                       int64_t ldw, size_t rem, float* HWY_RESTRICT C, int64_t ldc) {
  const DF d;
  const size_t L = hn::Lanes(d);
  const auto mask = hn::FirstN(d, rem);
  VF acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      const float* p = C + m * ldc + v * L;
      acc[m][v] = (kMask && v == NV - 1) ? hn::MaskedLoad(mask, d, p) : hn::LoadU(d, p);
    }
  const float* w = W;
  for (int s = 0; s < nseg; ++s) {  // segment s: A_s [MR x K_s] times the next K_s rows of W
    MicroKernel<MR, NV>(acc, A[s], lda, 1, w, ldw, K[s], [&](const float* row, int v) {
      return (kMaskW && v == NV - 1) ? hn::MaskedLoad(mask, d, row + v * L) : hn::LoadU(d, row + v * L);
    });
    w += K[s] * ldw;
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) {
      float* p = C + m * ldc + v * L;
      if (kMask && v == NV - 1) hn::BlendedStore(acc[m][v], mask, d, p);
      else hn::StoreU(acc[m][v], d, p);
    }
}

#if HWY_TARGET != HWY_SCALAR
// As Tile, for a panel of NVF full vectors + one half vector (columns = (NVF + 1/2)·lanes, e.g. 40 = 16 + 16 + 8
// on AVX-512): no masks, and on CPUs that split 512-bit FMAs (AMD Zen 4) the half vector costs half a full one.
// Same per-element FMA chain as Tile.
template <int MR, int NVF>
HWY_NOINLINE void TileHalf(int nseg, const float* const* A, const int64_t* K, int64_t lda, const float* HWY_RESTRICT W,
                           int64_t ldw, float* HWY_RESTRICT C, int64_t ldc) {
  const DF d;
  const hn::Half<DF> dh;
  using VH = hn::Vec<decltype(dh)>;
  const size_t L = hn::Lanes(d);
  VF acc[MR][NVF > 0 ? NVF : 1];
  VH acch[MR];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NVF; ++v) acc[m][v] = hn::LoadU(d, C + m * ldc + v * L);
    acch[m] = hn::LoadU(dh, C + m * ldc + NVF * L);
  }
  const float* w = W;
  for (int s = 0; s < nseg; ++s) {
    MicroKernelHalf<MR, NVF>(acc, acch, A[s], lda, 1, w, ldw, K[s]);
    w += K[s] * ldw;
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NVF; ++v) hn::StoreU(acc[m][v], d, C + m * ldc + v * L);
    hn::StoreU(acch[m], dh, C + m * ldc + NVF * L);
  }
}

template <int MR, int NVF = kNV - 1>
HWY_INLINE void TileHalfNV(int nvf, int nseg, const float* const* A, const int64_t* K, int64_t lda, const float* W,
                           int64_t ldw, float* C, int64_t ldc) {
  if constexpr (NVF >= 0) {
    if (nvf == NVF) return TileHalf<MR, NVF>(nseg, A, K, lda, W, ldw, C, ldc);
    TileHalfNV<MR, NVF - 1>(nvf, nseg, A, K, lda, W, ldw, C, ldc);
  }
}

template <int MR = kMR>
HWY_INLINE void TileHalfMR(int mr, int nvf, int nseg, const float* const* A, const int64_t* K, int64_t lda,
                           const float* W, int64_t ldw, float* C, int64_t ldc) {
  if constexpr (MR >= 1) {
    if (mr == MR) return TileHalfNV<MR>(nvf, nseg, A, K, lda, W, ldw, C, ldc);
    TileHalfMR<MR - 1>(mr, nvf, nseg, A, K, lda, W, ldw, C, ldc);
  }
}
#endif

// masked: 0 = none, 1 = C only, 2 = C and W
template <int MR, int NV>
HWY_INLINE void TileMask(int masked, int nseg, const float* const* A, const int64_t* K, int64_t lda, const float* W,
                         int64_t N, size_t rem, float* C, int64_t ldc) {
  if (masked == 2) Tile<MR, NV, true, true>(nseg, A, K, lda, W, N, rem, C, ldc);
  else if (masked == 1) Tile<MR, NV, true, false>(nseg, A, K, lda, W, N, rem, C, ldc);
  else Tile<MR, NV, false, false>(nseg, A, K, lda, W, N, rem, C, ldc);
}

template <int MR, int NV = kNV>
HWY_INLINE void TileNV(int nv, int masked, int nseg, const float* const* A, const int64_t* K, int64_t lda,
                       const float* W, int64_t N, size_t rem, float* C, int64_t ldc) {
  if constexpr (NV >= 1) {
    if (nv == NV) return TileMask<MR, NV>(masked, nseg, A, K, lda, W, N, rem, C, ldc);
    TileNV<MR, NV - 1>(nv, masked, nseg, A, K, lda, W, N, rem, C, ldc);
  }
}

template <int MR = kMR>
HWY_INLINE void TileMR(int mr, int nv, int masked, int nseg, const float* const* A, const int64_t* K, int64_t lda,
                       const float* W, int64_t N, size_t rem, float* C, int64_t ldc) {
  if constexpr (MR >= 1) {
    if (mr == MR) return TileNV<MR>(nv, masked, nseg, A, K, lda, W, N, rem, C, ldc);
    TileMR<MR - 1>(mr, nv, masked, nseg, A, K, lda, W, N, rem, C, ldc);
  }
}

void GemmSegments(int nseg, const float* const* A, const int64_t* K, int64_t lda, int64_t M, const float* W,
                  int64_t ldw, int64_t N, float* C, int64_t ldc) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d)), panel = kNV * L;
  constexpr int kMaxSeg = 16;
  const float* Am[kMaxSeg];
  for (int64_t m0 = 0; m0 < M; m0 += kMR) {
    const int mr = int(std::min<int64_t>(kMR, M - m0));
    for (int s = 0; s < nseg; ++s) Am[s] = A[s] + m0 * lda;
    for (int64_t n0 = 0; n0 < N; n0 += panel) {
      const int64_t cols = std::min(panel, N - n0);
      const int nv = int((cols + L - 1) / L);
      const size_t rem = size_t(cols - (nv - 1) * L);
#if HWY_TARGET != HWY_SCALAR
      if (L >= 2 && rem == size_t(L / 2)) {
        TileHalfMR(mr, nv - 1, nseg, Am, K, lda, W + n0, ldw, C + m0 * ldc + n0, ldc);
        continue;
      }
#endif
      const int masked = rem == size_t(L) ? 0 : (n0 + nv * L <= ldw ? 1 : 2);
      TileMR(mr, nv, masked, nseg, Am, K, lda, W + n0, ldw, rem, C + m0 * ldc + n0, ldc);
    }
  }
}

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
// Phi(a) - 1/2 (Phi the standard normal CDF) for a = |x| in 32 quartic pieces over t = 5.75 a: piece i covers
// t in [i, i + 1) as sum_k kGeluPieces[k][i] f^k, f = t - i; the last (t >= 31) is the constant 1/2. Fitted by
// scripts/fit_gelu_pieces.py: |error| <= 3.5e-8 before float32 evaluation.
alignas(64) constexpr float kGeluPieces[5][32] = {
    {3.045041552e-09f, 6.903310120e-02f, 1.360146105e-01f, 1.990740150e-01f, 2.566766441e-01f, 3.077309728e-01f,
     3.516365886e-01f, 3.882723153e-01f, 4.179334342e-01f, 4.412340224e-01f, 4.589940906e-01f, 4.721287489e-01f,
     4.815539718e-01f, 4.881163239e-01f, 4.925496280e-01f, 4.954555929e-01f, 4.973038137e-01f, 4.984443486e-01f,
     4.991272688e-01f, 4.995239973e-01f, 4.997476637e-01f, 4.998699725e-01f, 4.999349117e-01f, 4.999683201e-01f,
     4.999850392e-01f, 4.999931157e-01f, 4.999969304e-01f, 4.999986589e-01f, 4.999994338e-01f, 4.999997616e-01f,
     4.999999106e-01f, 5.000000000e-01f},
    {6.938111037e-02f, 6.833978742e-02f, 6.530861557e-02f, 6.055247411e-02f, 5.447005481e-02f, 4.753879458e-02f,
     4.025344178e-02f, 3.306908906e-02f, 2.635759674e-02f, 2.038232423e-02f, 1.529205497e-02f, 1.113120560e-02f,
     7.861088961e-03f, 5.386259872e-03f, 3.580601187e-03f, 2.309343545e-03f, 1.445057103e-03f, 8.772943984e-04f,
     5.167368217e-04f, 2.952957293e-04f, 1.637225796e-04f, 8.806908590e-05f, 4.596231520e-05f, 2.327253424e-05f,
     1.143269947e-05f, 5.449003766e-06f, 2.519698683e-06f, 1.130428814e-06f, 4.920404990e-07f, 2.077884460e-07f,
     8.513434580e-08f, 0.000000000e+00f},
    {1.221470484e-06f,  -1.032438595e-03f, -1.974564511e-03f, -2.746833954e-03f, -3.295031143e-03f, -3.595016897e-03f,
     -3.653123975e-03f, -3.501443658e-03f, -3.189553740e-03f, -2.774780383e-03f, -2.313063946e-03f, -1.851983136e-03f,
     -1.426715055e-03f, -1.058926107e-03f, -7.580031524e-04f, -5.237318110e-04f, -3.495151759e-04f, -2.254118590e-04f,
     -1.405514195e-04f, -8.476254152e-05f, -4.945618275e-05f, -2.792559280e-05f, -1.526336564e-05f, -8.077033272e-06f,
     -4.138883924e-06f, -2.054052175e-06f, -9.874053148e-07f, -4.598198302e-07f, -2.074601753e-07f, -9.069394480e-08f,
     -3.841987706e-08f, 0.000000000e+00f},
    {-3.531766124e-04f, -3.370697668e-04f, -2.915242221e-04f, -2.231853869e-04f, -1.415941224e-04f, -5.734358274e-05f,
     1.981138303e-05f,  8.246654761e-05f,  1.264192251e-04f,  1.507748530e-04f,  1.574186899e-04f,  1.500917424e-04f,
     1.333509863e-04f,  1.116547937e-04f,  8.872323815e-05f,  6.721988029e-05f,  4.871666897e-05f,  3.385439777e-05f,
     2.259929533e-05f,  1.451196022e-05f,  8.974120647e-06f,  5.349128514e-06f,  3.075531140e-06f,  1.706751391e-06f,
     9.146571642e-07f,  4.735608172e-07f,  2.369664855e-07f,  1.146394979e-07f,  5.363423838e-08f,  2.427276513e-08f,
     1.062828048e-08f,  0.000000000e+00f},
    {3.934541382e-06f,  1.122089270e-05f,  1.687868280e-05f,  2.018970736e-05f,  2.088748442e-05f,  1.917079499e-05f,
     1.561274803e-05f,  1.099948804e-05f,  6.147454314e-06f,  1.746426847e-06f,  -1.739449090e-06f, -4.101940249e-06f,
     -5.359499028e-06f, -5.690465969e-06f, -5.354077075e-06f, -4.620301752e-06f, -3.720887662e-06f, -2.824842568e-06f,
     -2.034727686e-06f, -1.396642119e-06f, -9.164162407e-07f, -5.761592092e-07f, -3.477057646e-07f, -2.017031449e-07f,
     -1.125994302e-07f, -6.054582258e-08f, -3.138266180e-08f, -1.569037344e-08f, -7.570991833e-09f, -3.527375281e-09f,
     -1.587485698e-09f, 0.000000000e+00f}};
#endif

// GELU 0.5 x (1 + erf(x / sqrt 2)) = x Phi(x) of a vector. On AVX-512: x/2 + |x| (Phi(|x|) - 1/2), the bracket from
// kGeluPieces (two-register permutes pick each coefficient; |error| of the GELU <= 4e-7 |x| + 1 ulp, within the
// bound below). Elsewhere: erf as z·P(z²)/Q(z²) on z clamped to [-4, 4] (the float32 rational approximation of
// Eigen/XLA; |error| <= 4.2e-7).
HWY_INLINE VF GeluVec(DF d, VF v) {
#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
  (void)d;
  const __m512 x = v.raw, a = _mm512_abs_ps(x);
  // min(NaN, 31) = 31: a NaN takes the constant piece and stays NaN through x/2
  const __m512 t = _mm512_min_ps(_mm512_mul_ps(a, _mm512_set1_ps(5.75f)), _mm512_set1_ps(31.0f));
  const __m512i piece = _mm512_cvttps_epi32(t);
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t)
  const auto coef = [&](int k) {
    return _mm512_permutex2var_ps(_mm512_load_ps(kGeluPieces[k]), piece, _mm512_load_ps(kGeluPieces[k] + 16));
  };
  __m512 h = coef(4);
  for (int k = 3; k >= 0; --k) h = _mm512_fmadd_ps(h, f, coef(k));
  return VF{_mm512_fmadd_ps(a, h, _mm512_mul_ps(x, _mm512_set1_ps(0.5f)))};
#else
  const VF kInvSqrt2 = hn::Set(d, 0.70710678118654752440f), four = hn::Set(d, 4.0f), one = hn::Set(d, 1.0f),
           half = hn::Set(d, 0.5f);
  const VF z = hn::Min(four, hn::Max(hn::Neg(four), hn::Mul(v, kInvSqrt2))), z2 = hn::Mul(z, z);
  VF p = hn::Set(d, -2.72614225801306e-10f);
  p = hn::MulAdd(p, z2, hn::Set(d, 2.77068142495902e-08f));
  p = hn::MulAdd(p, z2, hn::Set(d, -2.10102402082508e-06f));
  p = hn::MulAdd(p, z2, hn::Set(d, -5.69250639462346e-05f));
  p = hn::MulAdd(p, z2, hn::Set(d, -7.34990630326855e-04f));
  p = hn::MulAdd(p, z2, hn::Set(d, -2.95459980854025e-03f));
  p = hn::MulAdd(p, z2, hn::Set(d, -1.60960333262415e-02f));
  VF q = hn::Set(d, -1.45660718464996e-05f);
  q = hn::MulAdd(q, z2, hn::Set(d, -2.13374055278905e-04f));
  q = hn::MulAdd(q, z2, hn::Set(d, -1.68282697438203e-03f));
  q = hn::MulAdd(q, z2, hn::Set(d, -7.37332916720468e-03f));
  q = hn::MulAdd(q, z2, hn::Set(d, -1.42647390514189e-02f));
  const VF erf = hn::Min(one, hn::Max(hn::Neg(one), hn::Div(hn::Mul(z, p), q)));  // keeps 1 + erf >= 0
  return hn::Mul(hn::Mul(half, v), hn::Add(one, erf));
#endif
}

#include "simd/lane_sums.inc"  // SumsOfLanes8

// LayerNorm's statistics of the rows j < n <= 8 of x [n, C] (masked loads past C unless kWhole: C a whole number of
// vectors): mean[j] and inv[j] = 1/sqrt(var + eps). Each row sums its vectors lane-wise, then the lanes of the 8
// rows are summed at once (SumsOfLanes8, a third of the operations of one lane sum per row); a row's statistics do not
// depend on the rows beside it.
template <bool kWhole>
HWY_INLINE void RowNormStats8(DF d, const float* x, int64_t C, int n, float invC, float eps, float* mean, float* inv) {
  const int64_t L = int64_t(hn::Lanes(d));
  const auto load = [&](const float* p, int64_t c) {
    return kWhole ? hn::LoadU(d, p + c) : hn::MaskedLoad(hn::FirstN(d, size_t(std::min(L, C - c))), d, p + c);
  };
  VF v[8];
  // (the row loops unrolled, so that the 8 sums stay in registers)
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    v[j] = hn::Zero(d);
    if (j < n)
      for (int64_t c = 0; c < C; c += L) v[j] = hn::Add(v[j], load(x + j * C, c));
  }
  SumsOfLanes8(v, mean);
  for (int j = 0; j < 8; ++j) mean[j] *= invC;
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const VF mv = hn::Set(d, mean[j]);
    v[j] = hn::Zero(d);
    if (j < n)
      for (int64_t c = 0; c < C; c += L) {  // deviations, zero past C
        const VF t =
            kWhole ? hn::Sub(load(x + j * C, c), mv)
                   : hn::IfThenElseZero(hn::FirstN(d, size_t(std::min(L, C - c))), hn::Sub(load(x + j * C, c), mv));
        v[j] = hn::MulAdd(t, t, v[j]);
      }
  }
  float var[8];
  SumsOfLanes8(v, var);
  for (int j = 0; j < n; ++j) inv[j] = 1.0f / std::sqrt(var[j] * invC + eps);
}

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
// ---- bf16 products (the avx512bf16 build) ------------------------------------------------------------------
// A's rows are bf16 (consecutive k make a word), W's rows are pairs of weight rows (weight_pairs).
#include "simd/gemm_bf16.inc"  // MicroKernelPairs, RoundPairsAlongRow, SATTN_BF16_ATTR

// As Tile on bf16 operands: C[MR rows, NV vectors] += sum_s A_s[m, :2·K2_s] · W2 (K2_s word rows per segment),
// each float32 accumulator started from C and taking one vdpbf16ps per pair of k, in order. kLast: C's last vector
// is 0 = whole, 1 = the first `tail` lanes, 2 = a half vector (8 lanes, on a 256-bit register). W2 rows are readable
// to whole vectors (padded with zeros).
template <int MR, int NV, int kLast>
SATTN_BF16_ATTR HWY_NOINLINE void TilePairs(int nseg, const uint32_t* const* A, const int64_t* K2, int64_t lda2,
                                            const uint32_t* HWY_RESTRICT W2, int64_t ldw, __mmask16 tail, float* C,
                                            int64_t ldc, const float* I, int64_t ldi) {
  constexpr int NF = kLast == 2 ? NV - 1 : NV;  // 512-bit vectors
  __m512 acc[MR][NF > 0 ? NF : 1];
  __m256 acch[MR];
  for (int m = 0; m < MR; ++m) {  // the accumulators start from I (C itself, or an init row: ldi 0)
    for (int v = 0; v < NF; ++v) {
      const float* p = I + m * ldi + v * 16;
      acc[m][v] = (kLast == 1 && v == NV - 1) ? _mm512_maskz_loadu_ps(tail, p) : _mm512_loadu_ps(p);
    }
    acch[m] = kLast == 2 ? _mm256_loadu_ps(I + m * ldi + NF * 16) : _mm256_setzero_ps();
  }
  const uint32_t* w = W2;
  for (int s = 0; s < nseg; ++s) {
    MicroKernelPairs<MR, NF, kLast == 2>(acc, acch, A[s], lda2, w, ldw, K2[s]);
    w += K2[s] * ldw;
  }
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < NF; ++v) {
      float* p = C + m * ldc + v * 16;
      if (kLast == 1 && v == NV - 1) _mm512_mask_storeu_ps(p, tail, acc[m][v]);
      else _mm512_storeu_ps(p, acc[m][v]);
    }
    if constexpr (kLast == 2) _mm256_storeu_ps(C + m * ldc + NF * 16, acch[m]);
  }
}

template <int MR, int NV = kNV>
SATTN_BF16_ATTR HWY_INLINE void TilePairsNV(int nv, int last, int nseg, const uint32_t* const* A, const int64_t* K2,
                                            int64_t lda2, const uint32_t* W2, int64_t ldw, __mmask16 tail, float* C,
                                            int64_t ldc, const float* I, int64_t ldi) {
  if constexpr (NV >= 1) {
    if (nv == NV) {
      if (last == 2) return TilePairs<MR, NV, 2>(nseg, A, K2, lda2, W2, ldw, tail, C, ldc, I, ldi);
      if (last == 1) return TilePairs<MR, NV, 1>(nseg, A, K2, lda2, W2, ldw, tail, C, ldc, I, ldi);
      return TilePairs<MR, NV, 0>(nseg, A, K2, lda2, W2, ldw, tail, C, ldc, I, ldi);
    }
    TilePairsNV<MR, NV - 1>(nv, last, nseg, A, K2, lda2, W2, ldw, tail, C, ldc, I, ldi);
  }
}

template <int MR = kMR>
SATTN_BF16_ATTR HWY_INLINE void TilePairsMR(int mr, int nv, int last, int nseg, const uint32_t* const* A,
                                            const int64_t* K2, int64_t lda2, const uint32_t* W2, int64_t ldw,
                                            __mmask16 tail, float* C, int64_t ldc, const float* I, int64_t ldi) {
  if constexpr (MR >= 1) {
    if (mr == MR) return TilePairsNV<MR>(nv, last, nseg, A, K2, lda2, W2, ldw, tail, C, ldc, I, ldi);
    TilePairsMR<MR - 1>(mr, nv, last, nseg, A, K2, lda2, W2, ldw, tail, C, ldc, I, ldi);
  }
}

// As GemmSegments on bf16 operands: C[m, :N] += sum_s A_s[m, :K_s] · W2_s for m < M; A_s bf16 rows of lda (even)
// values, K_s even, W2 [sum K_s / 2][ldw >= N rounded up to 16 words]. Each C element is one vdpbf16ps chain in a
// fixed order (segments, then k ascending) whatever its position: results do not depend on how rows are batched.
// With `init`, the chains start from that row instead of from C.
SATTN_BF16_ATTR void GemmSegmentsPairs(int nseg, const uint16_t* const* A, const int64_t* K, int64_t lda, int64_t M,
                                       const uint32_t* W2, int64_t ldw, int64_t N, float* C, int64_t ldc,
                                       const float* init) {
  constexpr int64_t L = 16, panel = kNV * L;
  constexpr int kMaxSeg = 16;
  const uint32_t* Am[kMaxSeg];
  int64_t K2[kMaxSeg];
  for (int s = 0; s < nseg; ++s) K2[s] = K[s] / 2;
  for (int64_t m0 = 0; m0 < M; m0 += kMR) {
    const int mr = int(std::min<int64_t>(kMR, M - m0));
    for (int s = 0; s < nseg; ++s) Am[s] = reinterpret_cast<const uint32_t*>(A[s] + m0 * lda);
    for (int64_t n0 = 0; n0 < N; n0 += panel) {
      const int64_t cols = std::min(panel, N - n0);
      const int nv = int((cols + L - 1) / L);
      const int64_t rem = cols - (nv - 1) * L;
      const int last = rem == L ? 0 : rem == L / 2 ? 2 : 1;
      TilePairsMR(mr, nv, last, nseg, Am, K2, lda / 2, W2 + n0, ldw, __mmask16((1u << rem) - 1u), C + m0 * ldc + n0,
                  ldc, init ? init + n0 : C + m0 * ldc + n0, init ? 0 : ldc);
    }
  }
}

// out[i] = x[i] rounded to bf16 for i < n (pairs along the row: an odd n's pad half written 0).
SATTN_BF16_ATTR void RoundToBf16(const float* HWY_RESTRICT x, int64_t n, uint16_t* HWY_RESTRICT out) {
  RoundPairsAlongRow(x, n, reinterpret_cast<uint32_t*>(out));
}

// 16 floats (the lanes of `live`) rounded to bf16 at out, as RoundToBf16 rounds them.
SATTN_BF16_ATTR inline void StoreRoundedBf16(__m512 v, __mmask16 live, uint16_t* out) {
  _mm256_mask_storeu_epi16(out, live, (__m256i)_mm512_cvtneps_pbh(v));
}

// GeluInplace's values rounded to bf16 into out[n], as RoundToBf16 of them (an odd n's pad half written 0).
SATTN_BF16_ATTR void GeluToBf16(const float* HWY_RESTRICT x, int64_t n, uint16_t* HWY_RESTRICT out) {
  const DF d;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // two vectors into one 512-bit store of bf16
    const __m512 lo = GeluVec(d, VF{_mm512_loadu_ps(x + i)}).raw, hi = GeluVec(d, VF{_mm512_loadu_ps(x + i + 16)}).raw;
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  for (; i < n; i += 16) {
    const __mmask16 live = LiveLanes(n - i);
    StoreRoundedBf16(GeluVec(d, VF{_mm512_maskz_loadu_ps(live, x + i)}).raw, live, out + i);
  }
  if (n % 2) out[n] = 0;
}

// LayerNormRows's general loop with its rows rounded to bf16 into y [M, C], as RoundToBf16 of them.
SATTN_BF16_ATTR void LayerNormRowsToBf16(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta,
                                         float eps, uint16_t* y) {
  const DF d;
  const float invC = 1.0f / float(C);
  for (int64_t r0 = 0; r0 < M; r0 += 8) {
    const int n = int(std::min<int64_t>(8, M - r0));
    float mean[8], inv[8];
    RowNormStats8<false>(d, x + r0 * C, C, n, invC, eps, mean, inv);
    for (int j = 0; j < n; ++j) {
      const float* p = x + (r0 + j) * C;
      const VF mv = hn::Set(d, mean[j]), iv = hn::Set(d, inv[j]);
      for (int64_t c = 0; c < C; c += 16) {
        const __mmask16 live = LiveLanes(C - c);
        const auto m = hn::FirstN(d, size_t(std::min<int64_t>(16, C - c)));
        const VF t = hn::Mul(hn::Sub(hn::MaskedLoad(m, d, p + c), mv), iv);
        StoreRoundedBf16(hn::MulAdd(t, hn::MaskedLoad(m, d, gamma + c), hn::MaskedLoad(m, d, beta + c)).raw, live,
                         y + (r0 + j) * C + c);
      }
    }
  }
}
#endif

// One output row of a depthwise 3x3 from three zero-padded input rows [W+2, C] (a0 above, a1, a2 below): out[x, c]
// = bias[c] + sum_{ky,kx} a_ky[x+kx, c] · Wd[ky*3+kx][c]. Flat over the row's W·C values; the weights are tiled to a
// period P (a multiple of both C and the lane count) in Wt [10][P] (9 taps, then the bias).
void DepthwiseRow3(const float* a0, const float* a1, const float* a2, int64_t W, int64_t C, const float* Wt, int64_t P,
                   float* out) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d)), R = W * C, full = R / L * L;
  // The output vector at flat index i takes the weights at phase i mod P (P a multiple of L): one phase at a time,
  // its 9 taps and bias held in registers, every whole vector of that phase along the row (9 loads per output
  // vector instead of 19); then the row's last partial vector, masked. Each output is bias + the 9 taps in order
  // (ky, kx), whatever the loop: the same sums as a flat loop over the row, bitwise. The row goes in spans of whole
  // periods of about kDepthwiseSpan values, all phases of a span before the next, so that the span of the three
  // input rows stays in L1 across its phases (a whole row of 256 x 40 values per phase streams them from L2;
  // docs/sr_cpp.md has the measurement).
  constexpr int64_t kDepthwiseSpan = 1280;
  const int64_t span = P * std::max<int64_t>(1, kDepthwiseSpan / P);
  for (int64_t x0 = 0; x0 < full; x0 += span) {
    const int64_t x1 = std::min(full, x0 + span);
    for (int64_t c0 = 0; c0 < P; c0 += L) {
      const VF w0 = hn::LoadU(d, Wt + c0), w1 = hn::LoadU(d, Wt + P + c0), w2 = hn::LoadU(d, Wt + 2 * P + c0);
      const VF w3 = hn::LoadU(d, Wt + 3 * P + c0), w4 = hn::LoadU(d, Wt + 4 * P + c0);
      const VF w5 = hn::LoadU(d, Wt + 5 * P + c0), w6 = hn::LoadU(d, Wt + 6 * P + c0);
      const VF w7 = hn::LoadU(d, Wt + 7 * P + c0), w8 = hn::LoadU(d, Wt + 8 * P + c0);
      const VF bias = hn::LoadU(d, Wt + 9 * P + c0);
      for (int64_t i = x0 + c0; i < x1; i += P) {
        VF acc = hn::MulAdd(hn::LoadU(d, a0 + i), w0, bias);
        acc = hn::MulAdd(hn::LoadU(d, a0 + i + C), w1, acc);
        acc = hn::MulAdd(hn::LoadU(d, a0 + i + 2 * C), w2, acc);
        acc = hn::MulAdd(hn::LoadU(d, a1 + i), w3, acc);
        acc = hn::MulAdd(hn::LoadU(d, a1 + i + C), w4, acc);
        acc = hn::MulAdd(hn::LoadU(d, a1 + i + 2 * C), w5, acc);
        acc = hn::MulAdd(hn::LoadU(d, a2 + i), w6, acc);
        acc = hn::MulAdd(hn::LoadU(d, a2 + i + C), w7, acc);
        acc = hn::MulAdd(hn::LoadU(d, a2 + i + 2 * C), w8, acc);
        hn::StoreU(acc, d, out + i);
      }
    }
  }
  if (full == R) return;
  const auto m = hn::FirstN(d, size_t(R - full));
  const int64_t ph = full % P;
  const float* rows[3] = {a0, a1, a2};
  VF acc = hn::LoadU(d, Wt + 9 * P + ph);
  for (int ky = 0; ky < 3; ++ky)
    for (int kx = 0; kx < 3; ++kx)
      acc = hn::MulAdd(hn::MaskedLoad(m, d, rows[ky] + full + kx * C), hn::LoadU(d, Wt + (ky * 3 + kx) * P + ph), acc);
  hn::BlendedStore(acc, m, d, out + full);
}

// Layer norm of M rows of C values (biased variance, eps inside the sqrt), affine; x and y may alias.
void LayerNormRows(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps, float* y) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  const float invC = 1.0f / float(C);
  // Whole vectors (the SR model's C = 48 and 64): plain loads instead of masked ones, the same sums in the same order
  // as with masks, so the results are bitwise those of the general loop.
  const bool whole = C % L == 0;
  for (int64_t r0 = 0; r0 < M; r0 += 8) {
    const int n = int(std::min<int64_t>(8, M - r0));
    float mean[8], inv[8];
    if (whole) RowNormStats8<true>(d, x + r0 * C, C, n, invC, eps, mean, inv);
    else RowNormStats8<false>(d, x + r0 * C, C, n, invC, eps, mean, inv);
    for (int j = 0; j < n; ++j) {
      const float* p = x + (r0 + j) * C;
      float* o = y + (r0 + j) * C;
      const VF mv = hn::Set(d, mean[j]), iv = hn::Set(d, inv[j]);
      if (whole) {
        for (int64_t c = 0; c < C; c += L) {
          const VF t = hn::Mul(hn::Sub(hn::LoadU(d, p + c), mv), iv);
          hn::StoreU(hn::MulAdd(t, hn::LoadU(d, gamma + c), hn::LoadU(d, beta + c)), d, o + c);
        }
        continue;
      }
      for (int64_t c = 0; c < C; c += L) {
        const auto m = hn::FirstN(d, size_t(std::min(L, C - c)));
        const VF t = hn::Mul(hn::Sub(hn::MaskedLoad(m, d, p + c), mv), iv);
        const VF v = hn::MulAdd(t, hn::MaskedLoad(m, d, gamma + c), hn::MaskedLoad(m, d, beta + c));
        hn::BlendedStore(v, m, d, o + c);
      }
    }
  }
}

// GELU (GeluVec) in place.
void GeluInplace(float* x, int64_t n) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  for (int64_t i = 0; i < n; i += L) {
    const size_t cnt = size_t(std::min(L, n - i));
    const auto m = hn::FirstN(d, cnt);
    const VF v = cnt == size_t(L) ? hn::LoadU(d, x + i) : hn::MaskedLoad(m, d, x + i);
    const VF r = GeluVec(d, v);
    if (cnt == size_t(L)) hn::StoreU(r, d, x + i);
    else hn::BlendedStore(r, m, d, x + i);
  }
}

// Window statistics of the SR router over a run of `count` pixels of C channels (p [count, C]), per channel in
// pixel order: acc[c] += sum_t p[t, c] (AddRows), acc[c] += sum_t (p[t, c] - mean[c])^2 (AddSquaredDeviations,
// the square rounded before the sum, not fused: the sums of the plain loop, so routing and outputs do not change).
// Up to kStatVectors channel vectors are summed at once, pixel by pixel: independent add chains instead of one
// chain per vector, and each channel still adds its pixels in order.
constexpr int64_t kStatVectors = 4;
// (fp-contract off: the square and the sum stay two roundings, as in the PyTorch model.)
template <bool kSquares>
#if HWY_COMPILER_GCC_ACTUAL
__attribute__((optimize("fp-contract=off")))
#endif
void AddRowStats(const float* HWY_RESTRICT p, int64_t count, int64_t C, const float* HWY_RESTRICT mean,
                            float* HWY_RESTRICT acc) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  // a + x, or a + (x - mu)^2
  const auto add = [](VF a, VF x, VF mu) {
    if constexpr (kSquares) {
      const VF dv = hn::Sub(x, mu);
      return hn::Add(a, hn::Mul(dv, dv));
    } else {
      return hn::Add(a, x);
    }
  };
  for (int64_t c0 = 0; c0 < C; c0 += kStatVectors * L) {
    if (c0 + kStatVectors * L <= C) {  // whole vectors: the unrolled loop
      VF a[kStatVectors], mu[kStatVectors];
      for (int64_t k = 0; k < kStatVectors; ++k) {
        a[k] = hn::LoadU(d, acc + c0 + k * L);
        mu[k] = kSquares ? hn::LoadU(d, mean + c0 + k * L) : hn::Zero(d);
      }
      for (int64_t t = 0; t < count; ++t) {
        const float* row = p + t * C + c0;
        for (int64_t k = 0; k < kStatVectors; ++k) {
          a[k] = add(a[k], hn::LoadU(d, row + k * L), mu[k]);
        }
      }
      for (int64_t k = 0; k < kStatVectors; ++k) hn::StoreU(a[k], d, acc + c0 + k * L);
      continue;
    }
    for (int64_t c = c0; c < std::min(C, c0 + kStatVectors * L); c += L) {  // the rest, a vector at a time
      const auto m = hn::FirstN(d, size_t(std::min(L, C - c)));
      VF a = hn::MaskedLoad(m, d, acc + c);
      const VF mu = kSquares ? hn::MaskedLoad(m, d, mean + c) : hn::Zero(d);
      for (int64_t t = 0; t < count; ++t) {
        a = add(a, hn::MaskedLoad(m, d, p + t * C + c), mu);
      }
      hn::BlendedStore(a, m, d, acc + c);
    }
  }
}
void AddRows(const float* HWY_RESTRICT p, int64_t count, int64_t C, float* HWY_RESTRICT acc) {
  AddRowStats<false>(p, count, C, nullptr, acc);
}
void AddSquaredDeviations(const float* HWY_RESTRICT p, int64_t count, int64_t C, const float* HWY_RESTRICT mean,
                          float* HWY_RESTRICT acc) {
  AddRowStats<true>(p, count, C, mean, acc);
}

// Planar float rows -> interleaved uint8 RGB: out[3 i + c] = floor(255 clamp(v_c[i], 0, 1) + 0.5), NaN -> 0.
// The product and the + 0.5 in double are exact (a float times 255 needs at most 32 significant bits), so the
// result is the correctly rounded one for every input, as the scalar reference.
void PlanarToU8Rgb(const float* r, const float* g, const float* b, int64_t n, uint8_t* out) {
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;
  const hn::Rebind<int32_t, decltype(dd)> di;
  const hn::Rebind<uint8_t, decltype(dd)> d8;
  const int64_t L = int64_t(hn::Lanes(dd));
  const auto zero = hn::Zero(df), one = hn::Set(df, 1.0f);
  const auto k255 = hn::Set(dd, 255.0), half = hn::Set(dd, 0.5);
  auto conv = [&](const float* p) {
    auto v = hn::LoadU(df, p);
    v = hn::Min(hn::IfThenElseZero(hn::Gt(v, zero), v), one);  // NaN fails v > 0: 0
    const auto x = hn::Floor(hn::MulAdd(hn::PromoteTo(dd, v), k255, half));
    return hn::DemoteTo(d8, hn::DemoteTo(di, x));
  };
  int64_t i = 0;
  for (; i + L <= n; i += L) hn::StoreInterleaved3(conv(r + i), conv(g + i), conv(b + i), d8, out + 3 * i);
  for (; i < n; ++i) {
    const float* planes[3] = {r, g, b};
    for (int c = 0; c < 3; ++c) {
      const double v = double(std::min(1.0f, std::max(0.0f, planes[c][i])));  // std::max(0, NaN) = 0
      out[3 * i + c] = uint8_t(std::floor(v * 255.0 + 0.5));
    }
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace sattn::nn
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "simd/amx_tiles.hpp"
#include "simd/dispatch.hpp"
#include "simd/target.hpp"

namespace sattn::nn {
namespace {
#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64 && defined(__GNUC__)
// GemmSegmentsPairs on the AMX tiles (the amx build): each C element is its old value plus one tile product per
// chunk of the sum (simd::amx::gemm_segments_pairs), in a fixed order whatever its position: results do not depend
// on how rows are batched. They differ from the vdpbf16ps build's in the float32 rounding of the sums.
void GemmSegmentsPairsAmx(int nseg, const uint16_t* const* A, const int64_t* K, int64_t lda, int64_t M,
                          const uint32_t* W2, int64_t ldw, int64_t N, float* C, int64_t ldc, const float* init) {
  constexpr int kMaxSeg = 16;
  const uint32_t* a[kMaxSeg];
  int64_t k2[kMaxSeg];
  for (int s = 0; s < nseg; ++s) a[s] = reinterpret_cast<const uint32_t*>(A[s]), k2[s] = K[s] / 2;
  simd::amx::gemm_segments_pairs<simd::amx::HardwareTiles>(nseg, a, k2, lda / 2, M, W2, ldw, N, C, ldc, true, 1.f,
                                                           init);
}
#endif

struct Ops {
  void (*gemm_segments)(int, const float* const*, const int64_t*, int64_t, int64_t, const float*, int64_t, int64_t,
                        float*, int64_t);
  void (*depthwise_row_3)(const float*, const float*, const float*, int64_t, int64_t, const float*, int64_t, float*);
  void (*layer_norm_rows)(const float*, int64_t, int64_t, const float*, const float*, float, float*);
  void (*gelu_inplace)(float*, int64_t);
  void (*planar_to_u8_rgb)(const float*, const float*, const float*, int64_t, uint8_t*);
  void (*add_rows)(const float*, int64_t, int64_t, float*);
  void (*add_squared_deviations)(const float*, int64_t, int64_t, const float*, float*);
  // the bf16 products: null but in the avx512bf16 build
  void (*gemm_segments_pairs)(int, const uint16_t* const*, const int64_t*, int64_t, int64_t, const uint32_t*, int64_t,
                              int64_t, float*, int64_t, const float*);
  void (*round_to_bf16)(const float*, int64_t, uint16_t*);
  void (*gelu_to_bf16)(const float*, int64_t, uint16_t*);
  void (*layer_norm_rows_to_bf16)(const float*, int64_t, int64_t, const float*, const float*, float, uint16_t*);
};
// The builds without bf16 products (their last four entries null), and the amx and avx512bf16 ones.
#define SATTN_NN_OPS_WITH(NS, PAIRS, ROUND, GELU2, LN2)                                                            \
  Ops {                                                                                                            \
    &NS::GemmSegments, &NS::DepthwiseRow3, &NS::LayerNormRows, &NS::GeluInplace, &NS::PlanarToU8Rgb, &NS::AddRows, \
        &NS::AddSquaredDeviations, PAIRS, ROUND, GELU2, LN2                                                        \
  }
#define SATTN_NN_OPS(NS) SATTN_NN_OPS_WITH(NS, nullptr, nullptr, nullptr, nullptr)
#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64 && defined(__GNUC__)
#define SATTN_NN_OPS_BF16_WITH(PAIRS) \
  SATTN_NN_OPS_WITH(N_AVX3, PAIRS, &N_AVX3::RoundToBf16, &N_AVX3::GeluToBf16, &N_AVX3::LayerNormRowsToBf16)
#define SATTN_NN_OPS_BF16                                              \
  {simd::Target::kAmx, SATTN_NN_OPS_BF16_WITH(&GemmSegmentsPairsAmx)}, \
      {simd::Target::kAvx512Bf16, SATTN_NN_OPS_BF16_WITH(&N_AVX3::GemmSegmentsPairs)},
#else
#define SATTN_NN_OPS_BF16
#endif
const simd::Build<Ops> kBuilds[] = {SATTN_NN_OPS_BF16 SATTN_SIMD_BUILDS(SATTN_NN_OPS)};
const Ops& ops() { return simd::pick(kBuilds).ops; }
}  // namespace

const char* simd_build() { return simd::name(simd::pick(kBuilds).target); }
// Registered for simd_targets(); the symbol has C linkage so that the umbrella target sattn::sattn can make the
// linker keep this file (CMakeLists.txt).
extern "C" const bool sattn_simd_registered_nn = simd::register_build(simd::Component::kNn, &simd_build);

void gemm_acc_segments(int nseg, const float* const* A, const int64_t* K, int64_t lda, int64_t M, const float* W,
                       int64_t ldw, int64_t N, float* C, int64_t ldc) {
  check(nseg >= 1 && nseg <= 16, ErrorKind::kInternal, "gemm_acc_segments: nseg must be 1..16, given ", nseg);
  if (M <= 0 || N <= 0) return;
  check(ldw >= N, ErrorKind::kInternal, "gemm_acc_segments: ldw ", ldw, " < N ", N);
  ops().gemm_segments(nseg, A, K, lda, M, W, ldw, N, C, ldc);
}
bool has_bf16_products() { return ops().gemm_segments_pairs != nullptr; }
void gemm_acc_segments_pairs(int nseg, const uint16_t* const* A, const int64_t* K, int64_t lda, int64_t M,
                             const uint32_t* W2, int64_t ldw, int64_t N, float* C, int64_t ldc, const float* init) {
  if (!has_bf16_products())
    fail(ErrorKind::kInternal, "gemm_acc_segments_pairs: the SIMD target in use (", simd_build(),
         ") has no bf16 products");
  check(nseg >= 1 && nseg <= 16, ErrorKind::kInternal, "gemm_acc_segments_pairs: nseg must be 1..16, given ", nseg);
  check(lda % 2 == 0, ErrorKind::kInternal, "gemm_acc_segments_pairs: lda must be even, given ", lda);
  for (int s = 0; s < nseg; ++s)
    check(K[s] % 2 == 0, ErrorKind::kInternal, "gemm_acc_segments_pairs: K must be even, given ", K[s]);
  if (M <= 0 || N <= 0) return;
  check(ldw >= padded_cols(N), ErrorKind::kInternal, "gemm_acc_segments_pairs: ldw ", ldw, " < padded N ",
        padded_cols(N));
  ops().gemm_segments_pairs(nseg, A, K, lda, M, W2, ldw, N, C, ldc, init);
}
void round_to_bf16(const float* x, int64_t n, uint16_t* out) {
  if (!has_bf16_products())
    fail(ErrorKind::kInternal, "round_to_bf16: the SIMD target in use (", simd_build(), ") has no bf16 products");
  ops().round_to_bf16(x, n, out);
}
void gelu_to_bf16(const float* x, int64_t n, uint16_t* out) {
  if (!has_bf16_products())
    fail(ErrorKind::kInternal, "gelu_to_bf16: the SIMD target in use (", simd_build(), ") has no bf16 products");
  ops().gelu_to_bf16(x, n, out);
}
void layer_norm_to_bf16(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps,
                        uint16_t* y) {
  if (!has_bf16_products())
    fail(ErrorKind::kInternal, "layer_norm_to_bf16: the SIMD target in use (", simd_build(), ") has no bf16 products");
  ops().layer_norm_rows_to_bf16(x, M, C, gamma, beta, eps, y);
}
void gemm_acc(const float* A, int64_t lda, int64_t M, int64_t K, const float* W, int64_t ldw, int64_t N, float* C,
              int64_t ldc, const uint32_t* W2) {
  if (pairs_run(W2, K)) {
    thread_local WorkspaceVector<uint16_t> a2;
    a2.resize(size_t(M * K));
    if (lda == K) round_to_bf16(A, M * K, a2.data());
    else
      for (int64_t m = 0; m < M; ++m) round_to_bf16(A + m * lda, K, a2.data() + m * K);
    const uint16_t* a[1] = {a2.data()};
    const int64_t k[1] = {K};
    return gemm_acc_segments_pairs(1, a, k, K, M, W2, padded_cols(N), N, C, ldc);
  }
  const float* a[1] = {A};
  const int64_t k[1] = {K};
  gemm_acc_segments(1, a, k, lda, M, W, ldw, N, C, ldc);
}
void depthwise_row_3(const float* above, const float* centre, const float* below, int64_t W, int64_t C, const float* Wt,
                     int64_t period, float* out) {
  ops().depthwise_row_3(above, centre, below, W, C, Wt, period, out);
}
void layer_norm(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps, float* y) {
  ops().layer_norm_rows(x, M, C, gamma, beta, eps, y);
}
void gelu_inplace(float* x, int64_t n) { ops().gelu_inplace(x, n); }
void add_rows(const float* p, int64_t count, int64_t C, float* acc) { ops().add_rows(p, count, C, acc); }
void add_squared_deviations(const float* p, int64_t count, int64_t C, const float* mean, float* acc) {
  ops().add_squared_deviations(p, count, C, mean, acc);
}
void planar_to_u8_rgb(const float* r, const float* g, const float* b, int64_t n, uint8_t* out) {
  ops().planar_to_u8_rgb(r, g, b, n, out);
}
}  // namespace sattn::nn
#endif  // HWY_ONCE
