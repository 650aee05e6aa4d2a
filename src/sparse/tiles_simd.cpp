// The tile operations of the block-sparse engine (sparse/tiles.hpp), compiled once per SIMD target by Highway
// (simd/hwy_targets.hpp) and chosen at run time from the one target table (simd/target.hpp; see the end). Every
// matrix product is one register-blocked micro-kernel, the same scheme as the dense
// fused kernel (fused_simd.cpp):  C[M x N] = alpha · A(M x K) · B[K x N] (+ C),  A read by scalar broadcasts through
// two strides (so Q, P and Pᵀ are read in place), B and C in lanes, the last vector of a row masked when N is not a
// multiple of the vector width. The exponential is simd/exp.inc's polynomial (|relative error| < 1.9e-7) that gives
// exactly 0 for -inf.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "sparse/tiles_simd.cpp"
#include "simd/hwy_targets.hpp"
#include <hwy/foreach_target.h>  // must come before highway.h

#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd/amx_tiles.hpp"
#include "sparse/tiles.hpp"

#pragma GCC diagnostic ignored "-Wpsabi"

HWY_BEFORE_NAMESPACE();
namespace sattn::sparse::tiles {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;
using MF = hn::Mask<DF>;

#include "simd/blocking.inc"  // kMR, kNV

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#include "simd/exp.inc"   // Exp<kNoUpper>(d, x)
#include "simd/gemm.inc"  // MicroKernel, LoadTail, StoreTail

// The same polynomial on one lane, so that a row's rescale factor matches its probabilities.
HWY_INLINE float ExpScalar(float x) {
  const hn::CappedTag<float, 1> d1;
  return hn::GetLane(Exp<false>(d1, hn::Set(d1, x)));
}

// C[MR x NV vectors] = alpha · sum_k A(m, k) · B[k, :] (+ C when acc);  A(m, k) = A[m·sam + k·sak]. kMasked: the
// last vector holds only the lanes of `tail` (masked loads and stores: nothing past the row's end is touched).
template <int MR, int NV, bool kMasked>
HWY_INLINE void Micro(const float* HWY_RESTRICT A, int64_t sam, int64_t sak, const float* HWY_RESTRICT B, int64_t ldb,
                      float* HWY_RESTRICT C, int64_t ldc, int64_t K, float alpha, bool acc, MF tail) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  VF c[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NV; ++n) c[m][n] = hn::Zero(d);
  MicroKernel<MR, NV>(c, A, sam, sak, B, ldb, K, [&](const float* row, int v) {
    return (kMasked && v == NV - 1) ? LoadTail(d, tail, row + v * N) : hn::LoadU(d, row + v * N);
  });
  const VF va = hn::Set(d, alpha);
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NV; ++n) {
      float* cp = C + m * ldc + n * N;
      if (kMasked && n == NV - 1) {
        const VF old = acc ? LoadTail(d, tail, cp) : hn::Zero(d);
        StoreTail(hn::MulAdd(c[m][n], va, old), d, tail, cp);
      } else {
        hn::StoreU(acc ? hn::MulAdd(c[m][n], va, hn::LoadU(d, cp)) : hn::Mul(c[m][n], va), d, cp);
      }
    }
}

// All rows of one column group of NV vectors.
template <int NV, bool kMasked>
HWY_INLINE void Rows(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc,
                     int64_t M, int64_t K, float alpha, bool acc, MF tail) {
  int64_t m = 0;
  for (; m + kMR <= M; m += kMR)
    Micro<kMR, NV, kMasked>(A + m * sam, sam, sak, B, ldb, C + m * ldc, ldc, K, alpha, acc, tail);
  const int64_t rest = M - m;
  A += m * sam;
  C += m * ldc;
  if constexpr (kMR > 1)
    if (rest == 1) return Micro<1, NV, kMasked>(A, sam, sak, B, ldb, C, ldc, K, alpha, acc, tail);
  if constexpr (kMR > 2)
    if (rest == 2) return Micro<2, NV, kMasked>(A, sam, sak, B, ldb, C, ldc, K, alpha, acc, tail);
  if constexpr (kMR > 3)
    if (rest == 3) return Micro<3, NV, kMasked>(A, sam, sak, B, ldb, C, ldc, K, alpha, acc, tail);
  if constexpr (kMR > 4)
    if (rest == 4) return Micro<4, NV, kMasked>(A, sam, sak, B, ldb, C, ldc, K, alpha, acc, tail);
  if constexpr (kMR > 5)
    if (rest == 5) return Micro<5, NV, kMasked>(A, sam, sak, B, ldb, C, ldc, K, alpha, acc, tail);
}

template <bool kMasked>
HWY_INLINE void Group(int64_t nv, const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C,
                      int64_t ldc, int64_t M, int64_t K, float alpha, bool acc, MF tail) {
  switch (nv) {
    case 1: return Rows<1, kMasked>(A, sam, sak, B, ldb, C, ldc, M, K, alpha, acc, tail);
    case 2:
      if constexpr (kNV >= 2) return Rows<2, kMasked>(A, sam, sak, B, ldb, C, ldc, M, K, alpha, acc, tail);
      break;
    case 3:
      if constexpr (kNV >= 3) return Rows<3, kMasked>(A, sam, sak, B, ldb, C, ldc, M, K, alpha, acc, tail);
      break;
    case 4:
      if constexpr (kNV >= 4) return Rows<4, kMasked>(A, sam, sak, B, ldb, C, ldc, M, K, alpha, acc, tail);
      break;
    default: break;
  }
}

// C[M x N] = alpha · A(M x K) · B[K x N] (+ C when acc), for any N (row strides ldb, ldc >= N).
void Gemm(const float* A, int64_t sam, int64_t sak, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t M,
          int64_t N, int64_t K, float alpha, bool acc) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {  // empty sum: C = 0 (or unchanged)
    if (!acc)
      for (int64_t m = 0; m < M; ++m) std::memset(C + m * ldc, 0, sizeof(float) * size_t(N));
    return;
  }
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  const int64_t full = N / L, rem = N % L;
  const MF all = hn::FirstN(d, size_t(L));
  int64_t v = 0;
  for (; v + kNV <= full; v += kNV)
    Rows<kNV, false>(A, sam, sak, B + v * L, ldb, C + v * L, ldc, M, K, alpha, acc, all);
  // Last group: the remaining full vectors plus (if any) one masked vector.
  const int64_t nv = full - v + (rem > 0 ? 1 : 0);
  if (nv == 0) return;
  if (rem > 0) {
    if (nv <= kNV)
      return Group<true>(nv, A, sam, sak, B + v * L, ldb, C + v * L, ldc, M, K, alpha, acc, hn::FirstN(d, size_t(rem)));
  }
  Group<false>(nv, A, sam, sak, B + v * L, ldb, C + v * L, ldc, M, K, alpha, acc, all);
}

void Qk(const float* q, int64_t m, int64_t d, const float* kt, int64_t ldk, int64_t n, float scale, float* s) {
  Gemm(q, d, 1, kt, ldk, s, n, m, n, d, scale, false);  // S = scale · Q · Kᵀ
}

void Pv(const float* p, int64_t m, int64_t n, const float* v, int64_t ldv, int64_t dv, float alpha, float* acc) {
  Gemm(p, n, 1, v, ldv, acc, dv, m, dv, n, alpha, true);  // acc += alpha · P · V
}

void Atx(const float* a, int64_t m, int64_t n, const float* x, int64_t ldx, int64_t d, float alpha, float* out) {
  Gemm(a, 1, n, x, ldx, out, d, n, d, m, alpha, true);  // out += alpha · Aᵀ · X  (Aᵀ(j, i) = a[i·n + j])
}

void SoftmaxUpdate(float* s, int64_t m, int64_t n, float* row_max, float* row_sum, float* acc, int64_t dv) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  const int64_t full = n / L * L;
  const MF tail = hn::FirstN(d, size_t(n - full));
  const VF ninf = hn::Set(d, kNegInf);
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * n;
    VF vm = ninf;
    int64_t j = 0;
    for (; j < full; j += L) vm = hn::Max(vm, hn::LoadU(d, si + j));
    if (j < n) vm = hn::Max(vm, hn::IfThenElse(tail, LoadTail(d, tail, si + j), ninf));
    const float tile_max = hn::GetLane(hn::MaxOfLanes(d, vm));
    const float mx = tile_max > row_max[i] ? tile_max : row_max[i];
    if (mx == kNegInf) {  // every score masked, or NaN (lost by the max): a NaN makes the row NaN
      bool nan = false;
      for (int64_t c = 0; c < n; ++c) nan |= std::isnan(si[c]);
      if (nan) row_sum[i] = std::numeric_limits<float>::quiet_NaN();
      std::memset(si, 0, sizeof(float) * size_t(n));
      continue;
    }
    const float alpha = ExpScalar(row_max[i] - mx);  // 0 when the old max was -inf
    const VF vmx = hn::Set(d, mx);
    VF vs = hn::Zero(d);
    for (j = 0; j < full; j += L) {
      const VF p = Exp<true>(d, hn::Sub(hn::LoadU(d, si + j), vmx));
      hn::StoreU(p, d, si + j);
      vs = hn::Add(vs, p);
    }
    if (j < n) {
      const VF p = hn::IfThenElseZero(tail, Exp<true>(d, hn::Sub(LoadTail(d, tail, si + j), vmx)));
      StoreTail(p, d, tail, si + j);
      vs = hn::Add(vs, p);
    }
    if (alpha != 1.0f) {
      float* ai = acc + i * dv;
      const VF va = hn::Set(d, alpha);
      int64_t c = 0;
      for (; c + L <= dv; c += L) hn::StoreU(hn::Mul(hn::LoadU(d, ai + c), va), d, ai + c);
      for (; c < dv; ++c) ai[c] *= alpha;
    }
    row_sum[i] = row_sum[i] * alpha + hn::GetLane(hn::SumOfLanes(d, vs));
    row_max[i] = mx;
  }
}

void SoftmaxBackward(const float* p, float* dp, int64_t m, int64_t n, const float* delta) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  const int64_t full = n / L * L;
  const MF tail = hn::FirstN(d, size_t(n - full));
  for (int64_t i = 0; i < m; ++i) {
    const float* pi = p + i * n;
    float* di = dp + i * n;
    const VF dl = hn::Set(d, delta[i]);
    int64_t j = 0;
    for (; j < full; j += L) hn::StoreU(hn::Mul(hn::LoadU(d, pi + j), hn::Sub(hn::LoadU(d, di + j), dl)), d, di + j);
    if (j < n) StoreTail(hn::Mul(LoadTail(d, tail, pi + j), hn::Sub(LoadTail(d, tail, di + j), dl)), d, tail, di + j);
  }
}

void Probabilities(float* s, int64_t m, int64_t n, const float* lse) {
  const DF d;
  const int64_t L = int64_t(hn::Lanes(d));
  const int64_t full = n / L * L;
  const MF tail = hn::FirstN(d, size_t(n - full));
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * n;
    if (lse[i] == kNegInf) {
      std::memset(si, 0, sizeof(float) * size_t(n));
      continue;
    }
    if (std::isnan(lse[i])) {  // a NaN row: NaN at every allowed key, 0 at the masked ones
      for (int64_t j = 0; j < n; ++j) si[j] = si[j] == kNegInf ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const VF l = hn::Set(d, lse[i]);
    int64_t j = 0;
    for (; j < full; j += L) hn::StoreU(Exp<false>(d, hn::Sub(hn::LoadU(d, si + j), l)), d, si + j);
    if (j < n) StoreTail(Exp<false>(d, hn::Sub(LoadTail(d, tail, si + j), l)), d, tail, si + j);
  }
}

// dst[c·ldd + j] = src[j·lds + c] for j < n, c < d: the shared core's transpose (square blocks in registers).
void TransposeKeys(const float* HWY_RESTRICT src, int64_t lds, int64_t n, int64_t d, float* HWY_RESTRICT dst,
                   int64_t ldd) {
  TransposeRows(src, lds, n, d, 1.f, dst, ldd, n);
}

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
// ---- bf16 products (the avx512bf16 build) ------------------------------------------------------------------
#include "simd/gemm_bf16.inc"  // GemmPairs, RoundPairsAlongRow, RoundPairsAcrossRows

SATTN_BF16_ATTR void KqPairs(const uint32_t* k2, int64_t n, int64_t d2, const uint32_t* q2t, int64_t ldq, int64_t m,
                             float scale, float* st, int64_t lds) {
  GemmPairs(k2, d2, 1, q2t, ldq, st, lds, n, m, d2, scale, false);
}

SATTN_BF16_ATTR void PackPairsAlongRows(const float* rows, int64_t lds, int64_t n, int64_t width, uint32_t* out,
                                        int64_t ldo) {
  for (int64_t r = 0; r < n; ++r) RoundPairsAlongRow(rows + r * lds, width, out + r * ldo);
}

SATTN_BF16_ATTR void PvPairs(const float* p, int64_t m, int64_t n, const uint32_t* v2, int64_t ldv, int64_t dv,
                             uint32_t* p2, float* acc) {
  const int64_t n2 = (n + 1) / 2;  // P's rows in pairs along the keys, an odd n's last pair ending in 0
  PackPairsAlongRows(p, n, m, n, p2, n2);
  GemmPairs(p2, n2, 1, v2, ldv, acc, dv, m, dv, n2, 1.f, true);
}

SATTN_BF16_ATTR void PackPairsAcrossRows(const float* rows, int64_t lds, int64_t n, int64_t width, uint32_t* out,
                                         int64_t ldo) {
  for (int64_t y = 0; y < (n + 1) / 2; ++y) {
    const float* a = rows + 2 * y * lds;
    RoundPairsAcrossRows(a, 2 * y + 1 < n ? a + lds : nullptr, width, ldo, out + y * ldo);
  }
}

SATTN_BF16_ATTR void AtxPairs(const float* a, int64_t m, int64_t n, const uint32_t* x2, int64_t ldx, int64_t d,
                              float alpha, uint32_t* a2, float* out, int64_t ldo) {
  const int64_t lda = (n + 15) / 16 * 16;  // A's rows in pairs across its rows: A^T(j, y) = a2[j + y·lda]
  PackPairsAcrossRows(a, n, m, n, a2, lda);
  GemmPairs(a2, 1, lda, x2, ldx, out, ldo, n, d, (m + 1) / 2, alpha, true);
}

// AtxPairs on the AMX tiles (the amx build), whose left operand has its rows along the sum: A's pairs across its rows
// (a2, packed as AtxPairs packs them) transposed 16 x 16 words at a time into A^T's rows [n x ⌈m/2⌉], then one tile
// product per block (simd::amx::gemm_segments_pairs).
SATTN_BF16_ATTR void AtxPairsTiles(const float* a, int64_t m, int64_t n, const uint32_t* x2, int64_t ldx, int64_t d,
                                   float alpha, uint32_t* a2, float* out, int64_t ldo) {
  const int64_t lda = (n + 15) / 16 * 16, m2 = (m + 1) / 2, m2p = (m2 + 15) / 16 * 16;
  PackPairsAcrossRows(a, n, m, n, a2, lda);  // [m2 x lda], zero past n
  thread_local std::vector<uint32_t> at;
  at.resize(size_t(lda * m2p));
  for (int64_t y0 = 0; y0 < m2; y0 += 16)
    for (int64_t j0 = 0; j0 < lda; j0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = y0 + i < m2 ? _mm512_loadu_si512(a2 + (y0 + i) * lda + j0) : _mm512_setzero_si512();
      Transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(at.data() + (j0 + i) * m2p + y0, r[i]);
    }
  const uint32_t* rows[1] = {at.data()};
  const int64_t k2[1] = {m2};
  simd::amx::gemm_segments_pairs<simd::amx::HardwareTiles>(1, rows, k2, m2p, n, x2, ldx, d, out, ldo, true, alpha);
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace sattn::sparse::tiles
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "simd/amx_tiles.hpp"
#include "simd/dispatch.hpp"
#include "simd/target.hpp"

namespace sattn::sparse::tiles {

namespace {

#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64 && defined(__GNUC__)
// kq_pairs and pv_pairs on the AMX tiles (the amx build; simd::amx::gemm_segments_pairs); atx_pairs is
// N_AVX3::AtxPairsTiles.
void KqPairsAmx(const uint32_t* k2, int64_t n, int64_t d2, const uint32_t* q2t, int64_t ldq, int64_t m, float scale,
                float* st, int64_t lds) {
  const uint32_t* a[1] = {k2};
  const int64_t k[1] = {d2};
  simd::amx::gemm_segments_pairs<simd::amx::HardwareTiles>(1, a, k, d2, n, q2t, ldq, m, st, lds, false, scale);
}
void PvPairsAmx(const float* p, int64_t m, int64_t n, const uint32_t* v2, int64_t ldv, int64_t dv, uint32_t* p2,
                float* acc) {
  const int64_t n2 = (n + 1) / 2;  // P's rows in pairs along the keys, an odd n's last pair ending in 0
  N_AVX3::PackPairsAlongRows(p, n, m, n, p2, n2);
  const uint32_t* a[1] = {p2};
  const int64_t k[1] = {n2};
  simd::amx::gemm_segments_pairs<simd::amx::HardwareTiles>(1, a, k, n2, m, v2, ldv, dv, acc, dv);
}
#endif

struct Ops {
  void (*qk)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, float*);
  void (*softmax_update)(float*, int64_t, int64_t, float*, float*, float*, int64_t);
  void (*pv)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, float*);
  void (*atx)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, float*);
  void (*softmax_backward)(const float*, float*, int64_t, int64_t, const float*);
  void (*probabilities)(float*, int64_t, int64_t, const float*);
  void (*transpose_rows)(const float*, int64_t, int64_t, int64_t, float*, int64_t);
  // the bf16 products: null but in the avx512bf16 build
  void (*kq_pairs)(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float, float*, int64_t);
  void (*pv_pairs)(const float*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, uint32_t*, float*);
  void (*pack_pairs)(const float*, int64_t, int64_t, int64_t, uint32_t*, int64_t);
  void (*pack_pairs_along)(const float*, int64_t, int64_t, int64_t, uint32_t*, int64_t);
  void (*atx_pairs)(const float*, int64_t, int64_t, const uint32_t*, int64_t, int64_t, float, uint32_t*, float*,
                    int64_t);
};

// The builds without bf16 products (their last five entries null), then the amx and avx512bf16 ones.
#define SATTN_TILE_OPS(NS)                                                                                        \
  Ops {                                                                                                           \
    &NS::Qk, &NS::SoftmaxUpdate, &NS::Pv, &NS::Atx, &NS::SoftmaxBackward, &NS::Probabilities, &NS::TransposeKeys, \
        nullptr, nullptr, nullptr, nullptr, nullptr                                                               \
  }
#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64 && defined(__GNUC__)
#define SATTN_TILE_OPS_BF16_WITH(KQ, PV, ATX)                                                                         \
  Ops {                                                                                                               \
    &N_AVX3::Qk, &N_AVX3::SoftmaxUpdate, &N_AVX3::Pv, &N_AVX3::Atx, &N_AVX3::SoftmaxBackward, &N_AVX3::Probabilities, \
        &N_AVX3::TransposeKeys, KQ, PV, &N_AVX3::PackPairsAcrossRows, &N_AVX3::PackPairsAlongRows, ATX                \
  }
#define SATTN_TILE_OPS_BF16                                                                         \
  {simd::Target::kAmx, SATTN_TILE_OPS_BF16_WITH(&KqPairsAmx, &PvPairsAmx, &N_AVX3::AtxPairsTiles)}, \
      {simd::Target::kAvx512Bf16, SATTN_TILE_OPS_BF16_WITH(&N_AVX3::KqPairs, &N_AVX3::PvPairs, &N_AVX3::AtxPairs)},
#else
#define SATTN_TILE_OPS_BF16
#endif
const simd::Build<Ops> kBuilds[] = {SATTN_TILE_OPS_BF16 SATTN_SIMD_BUILDS(SATTN_TILE_OPS)};

const Ops& ops() { return simd::pick(kBuilds).ops; }

}  // namespace

const char* simd_build() { return simd::name(simd::pick(kBuilds).target); }
// Registered for simd_targets(); the symbol has C linkage so that the umbrella target sattn::sattn can make the
// linker keep this file (CMakeLists.txt).
extern "C" const bool sattn_simd_registered_sparse_tiles =
    simd::register_build(simd::Component::kSparseTiles, &simd_build);

void qk(const float* q, int64_t m, int64_t d, const float* kt, int64_t ldk, int64_t n, float scale, float* s) {
  ops().qk(q, m, d, kt, ldk, n, scale, s);
}
void softmax_update(float* s, int64_t m, int64_t n, float* row_max, float* row_sum, float* acc, int64_t dv) {
  ops().softmax_update(s, m, n, row_max, row_sum, acc, dv);
}
void pv(const float* p, int64_t m, int64_t n, const float* v, int64_t ldv, int64_t dv, float alpha, float* acc) {
  ops().pv(p, m, n, v, ldv, dv, alpha, acc);
}
void atx(const float* a, int64_t m, int64_t n, const float* x, int64_t ldx, int64_t d, float alpha, float* out) {
  ops().atx(a, m, n, x, ldx, d, alpha, out);
}
void softmax_backward(const float* p, float* dp, int64_t m, int64_t n, const float* delta) {
  ops().softmax_backward(p, dp, m, n, delta);
}
void probabilities(float* s, int64_t m, int64_t n, const float* lse) { ops().probabilities(s, m, n, lse); }
void transpose_rows(const float* src, int64_t lds, int64_t n, int64_t d, float* dst, int64_t ldd) {
  ops().transpose_rows(src, lds, n, d, dst, ldd);
}
bool has_bf16_products() { return ops().kq_pairs != nullptr; }
void kq_pairs(const uint32_t* k2, int64_t n, int64_t d2, const uint32_t* q2t, int64_t ldq, int64_t m, float scale,
              float* st, int64_t lds) {
  ops().kq_pairs(k2, n, d2, q2t, ldq, m, scale, st, lds);
}
void pv_pairs(const float* p, int64_t m, int64_t n, const uint32_t* v2, int64_t ldv, int64_t dv, uint32_t* p2,
              float* acc) {
  ops().pv_pairs(p, m, n, v2, ldv, dv, p2, acc);
}
void pack_pairs_across_rows(const float* rows, int64_t lds, int64_t n, int64_t width, uint32_t* out, int64_t ldo) {
  ops().pack_pairs(rows, lds, n, width, out, ldo);
}
void pack_pairs_along_rows(const float* rows, int64_t lds, int64_t n, int64_t width, uint32_t* out, int64_t ldo) {
  ops().pack_pairs_along(rows, lds, n, width, out, ldo);
}
void atx_pairs(const float* a, int64_t m, int64_t n, const uint32_t* x2, int64_t ldx, int64_t d, float alpha,
               uint32_t* a2, float* out, int64_t ldo) {
  ops().atx_pairs(a, m, n, x2, ldx, d, alpha, a2, out, ldo);
}

}  // namespace sattn::sparse::tiles
#endif  // HWY_ONCE
