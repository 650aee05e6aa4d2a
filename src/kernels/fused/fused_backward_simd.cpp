// The fused kernel's backward tile loops (dK/dV by key block, dQ and dmask by query block, and the query-side
// packing and row statistics they read), compiled once per SIMD target by Highway like the forward
// (fused_simd.cpp, whose header describes the tile layout) and chosen from the same target table.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/fused/fused_backward_simd.cpp"
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
#include <limits>
#include <new>

#include "core/workspace.hpp"
#include "kernels/fused/fused.hpp"
#include "sattn/error.hpp"
#include "sattn/random.hpp"
#include "simd/amx_tiles.hpp"

#include "kernels/fused/fused_tiles.inc"  // per target: the tile operations

HWY_BEFORE_NAMESPACE();
namespace sattn::fused {
namespace HWY_NAMESPACE {

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
// kRounded: P' and dS are rounded to bf16 next (Params::round_grads), so P takes the shorter exponential there.
template <bool kLogSum, bool kRounded>
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
        pdrow[ii] = p.keep(b, h, i0 + ii, kb + jj) ? keep_scale : 0.f;  // temporarily the dropout factor
      }
      for (int64_t ii = nq; ii < Br; ++ii) pdrow[ii] = 0.f;
    }
    // kU vectors of the row at a time: their exponentials interleaved (ExpN)
    const auto vectors = [&](int64_t x, auto u) {
      constexpr int kU = decltype(u)::value;
      VF pr[kU];
      for (int i = 0; i < kU; ++i) {
        pr[i] = hn::Sub(hn::Load(d, srow + x + i * N), hn::Load(d, lse_t + x + i * N));
        if constexpr (kLogSum) pr[i] = hn::Sub(pr[i], hn::Load(d, log_sum_t + x + i * N));
      }
#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
      if constexpr (kRounded) {
        // P (z clamped to 88 as Exp<false> does; min returns its second operand, z, when z is NaN)
        for (int i = 0; i < kU; ++i) pr[i] = VF{ExpForBf16(hn::Min(hn::Set(d, 88.f), pr[i]).raw)};
      } else {
        ExpN<false>(d, pr);  // P
      }
#else
      ExpN<false>(d, pr);  // P
#endif
      for (int i = 0; i < kU; ++i) {
        const int64_t xi = x + i * N;
        VF dp = hn::Load(d, dprow + xi);
        VF pd = pr[i];  // P' = P keep/(1-p)
        if (p.dropout_p > 0) {
          const VF f = hn::Load(d, pdrow + xi);
          dp = hn::Mul(dp, f);
          pd = hn::Mul(pr[i], f);
        }
        hn::Store(pd, d, pdrow + xi);
        hn::Store(hn::Mul(pr[i], hn::Sub(dp, hn::Load(d, delta_t + xi))), d, srow + xi);  // dS^T (in place of S^T)
      }
    };
    int64_t x = 0;
    for (; x + 4 * N <= Br; x += 4 * N) vectors(x, std::integral_constant<int, 4>());
    for (; x < Br; x += N) vectors(x, std::integral_constant<int, 1>());
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
  w.QT = p.qt_tile(t);
  w.dOT = p.dot_tile(t);
  auto k_rows = [&] {
    const Rows kr = RowsOf(p.k, b, hk, kb, nk, p.D, w.kbuf);
    if (p.nan_key_block && p.nan_key_block[(b * p.Hkv + hk) * p.num_k_blocks() + kb / p.Bc])
      return ZeroNanRows(kr, nk, p.D, w.kbuf);
    return kr;
  };
#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
  if (p.k_pairs) {  // the bf16 products: S^T = scale K Q^T, and dP'^T = V dO^T when dO is packed too (Params)
    const int64_t D2 = p.k_pair_stride(), Dv2 = p.dv_pair_stride(), kv = b * p.Hkv + hk;  // rows of pairs, padded
    if (kr_out) *kr_out = k_rows();
    // On the amx build the tiles multiply the same pairs (the task holds the tile configuration).
    // split_bf16: A's lo parts alo words on, B's after its K2 hi rows; three part products (lo·lo dropped)
    const auto product = [&](const uint32_t* A, int64_t K2, int64_t alo, const uint32_t* B, float* C, float mul) {
      if (p.amx_tiles) {
        CleanVectorsForTiles();
        if (p.split_bf16)
          simd::amx::gemm_pairs<AmxTiles, false, true, true, false>(A, K2, B, Br, K2 * Br, C, Br, nk, Br, 2 * K2, 1.f,
                                                                    alo);
        else simd::amx::gemm_pairs<AmxTiles, false, false>(A, K2, B, Br, 0, C, Br, nk, Br, 2 * K2, 1.f);
        if (mul != 1.f) ScaleRows(C, nk, Br, mul);
      } else GemmBf16<false, false>(A, K2, 1, B, Br, 0, C, Br, nk, nvec, K2, mul);
    };
    product(p.k_pairs + (kv * p.Lk + kb) * D2, D2, p.k_lo_words, p.qp_tile(t), w.ST, p.scale);
    if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, i0, kb, nk, w.bias, w.pad, w.ST);
    if (p.pk_dop) {
      product(p.v_row_pairs + (kv * p.Lk + kb) * Dv2, Dv2, p.v_lo_words, p.dop_tile(t), w.dPT, 1.f);
      if (vr_out) *vr_out = RowsOf(p.v, b, hk, kb, nk, p.Dv, w.vbuf);
    } else {
      const Rows vr = RowsOf(p.v, b, hk, kb, nk, p.Dv, w.vbuf);
      if (vr_out) *vr_out = vr;
      Gemm<false>(vr.ptr, vr.stride, 1, w.dOT, Br, w.dPT, Br, nk, nvec, p.Dv);
    }
  } else
#endif
  {
    const Rows kr = k_rows(), vr = RowsOf(p.v, b, hk, kb, nk, p.Dv, w.vbuf);
    if (kr_out) *kr_out = kr;
    if (vr_out) *vr_out = vr;
    Gemm<false>(kr.ptr, kr.stride, 1, w.QT, Br, w.ST, Br, nk, nvec, p.D);
    if (tm.has_bias || tm.has_pad || tm.causal_partial) ApplyTileMask(p, tm, i0, kb, nk, w.bias, w.pad, w.ST);
    Gemm<false>(vr.ptr, vr.stride, 1, w.dOT, Br, w.dPT, Br, nk, nvec, p.Dv);  // dP'^T = V dO^T
  }
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
    if (p.round_grads) TileProbabilities<true, true>(p, w, b, h, i0, nq, kb, nk, lse_t, log_sum_t, delta_t);
    else TileProbabilities<true, false>(p, w, b, h, i0, nq, kb, nk, lse_t, log_sum_t, delta_t);
  } else if (p.round_grads) {
    TileProbabilities<false, true>(p, w, b, h, i0, nq, kb, nk, lse_t, nullptr, delta_t);
  } else {
    TileProbabilities<false, false>(p, w, b, h, i0, nq, kb, nk, lse_t, nullptr, delta_t);
  }
  return true;
}

struct BwdScratch {
  Scratch s_st, s_dpt, s_pdt, s_bias, s_kbuf, s_vbuf, s_pairs;
  BwdTile w{};
  uint8_t pad[1024];
  // round_grads: P'^T and dS^T in pairs along the queries [Bc x Br/2] words, dS^T in pairs along the keys
  // [Bc/2 x Br], and one row of K^T pairs [D] for an odd last key (GemmKeyPairs); split_grads: each of the three
  // with its lo parts after it (tile_words() on).
  uint32_t *pd_pairs = nullptr, *ds_pairs = nullptr, *ds_key_pairs = nullptr, *kt_last = nullptr;
  static int64_t tile_words(const Params& p) { return p.Bc * p.Br / 2; }
  float* dk_tile = nullptr;  // the amx build's dS^T Q [Bc x pad16(D)], before it is scaled into dK
  Scratch s_dk_tile;
  explicit BwdScratch(const Params& p) {
    w.ST = s_st.alloc(p.Bc * p.Br);
    w.dPT = s_dpt.alloc(p.Bc * p.Br);
    w.PdT = s_pdt.alloc(p.Bc * p.Br);
    w.bias = p.mask != MaskKind::kNone ? s_bias.alloc(p.Bc * p.Br) : nullptr;
    w.kbuf = s_kbuf.alloc(p.Bc * p.D);
    w.vbuf = s_vbuf.alloc(p.Bc * p.Dv);
    w.pad = pad;
    if (p.grad_pairs()) {
      const int64_t parts = p.pair_parts() * tile_words(p);
      pd_pairs = reinterpret_cast<uint32_t*>(s_pairs.alloc(3 * parts + Params::pad16(p.D)));
      ds_pairs = pd_pairs + parts;
      ds_key_pairs = ds_pairs + parts;
      kt_last = ds_key_pairs + parts;
      if (p.amx_tiles) dk_tile = s_dk_tile.alloc(p.Bc * Params::pad16(p.D));
    }
  }
};

// Writes dK [nk x pad16(D)] and dV [nk x pad16(Dv)] of keys [kb, kb + nk) of (b, hk).
void StoreKeyGrads(const Params& p, int64_t b, int64_t hk, int64_t kb, int64_t nk, const float* dK, const float* dV) {
  const int64_t Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv);
  const int64_t kbase = b * p.dk.sb + hk * p.dk.sh + kb * p.dk.sl;
  const int64_t vbase = b * p.dv.sb + hk * p.dv.sh + kb * p.dv.sl;
  for (int64_t jj = 0; jj < nk; ++jj) {
    StoreRow(p.dk, kbase + jj * p.dk.sl, dK + jj * Dp, p.D);
    StoreRow(p.dv, vbase + jj * p.dv.sl, dV + jj * Dvp, p.Dv);
  }
}

void BackwardKVTask(const Params& p, int64_t task) {
  const AmxTaskScope tile_config(p.amx_tiles && p.k_pairs);
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
        const float* Qr = p.qr_tile(t);
        const float* dOr = p.dor_tile(t);
        Gemm<true>(sc.w.PdT, Br, 1, dOr, Dvp, dV, Dvp, nk_eff, Dvp / N, Br);  // dV += P'^T dO
        Gemm<true>(sc.w.ST, Br, 1, Qr, Dp, dK, Dp, nk_eff, Dp / N, Br);       // dK += dS^T (scale Q)
      }
    }
  }
  StoreKeyGrads(p, b, hk, kb, nk, dK, dV);
}

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
// split_grads: dV += P'^T dO, dK += scale dS^T Q and dQ^T += K^T dS^T of one computed tile (P'^T in sc.w.PdT, dS^T
// in sc.w.ST) on the amx tiles, every operand as two bf16 parts (three part products: the lo parts' product dropped).
void SplitGradProducts(const Params& p, BwdScratch& sc, int64_t b, int64_t hk, int64_t t, int64_t kb, int64_t nk,
                       float* dK, float* dV, float* dQT) {
  namespace amx = simd::amx;
  const int64_t Br = p.Br, Br2 = Br / 2, Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv),
                tw = BwdScratch::tile_words(p);
  PackRowsAsSplitPairs(sc.w.PdT, nk, Br, sc.pd_pairs, tw);
  PackRowsAsSplitPairs(sc.w.ST, nk, Br, sc.ds_pairs, tw);
  PackProbabilityPairs<true>(sc.w.ST, nk, Br, sc.ds_key_pairs, tw);
  CleanVectorsForTiles();
  amx::gemm_pairs<AmxTiles, true, true, true, false>(sc.pd_pairs, Br2, p.dorp_tile(t), Dvp, Br2 * Dvp, dV, Dvp, nk, Dvp,
                                                     Br, 1.f, tw);
  CleanVectorsForTiles();
  amx::gemm_pairs<AmxTiles, false, true, true, false>(sc.ds_pairs, Br2, p.qrp_tile(t), Dp, Br2 * Dp, sc.dk_tile, Dp, nk,
                                                      Dp, Br, 1.f, tw);
  AddScaledRows(dK, sc.dk_tile, nk * Dp, p.scale);  // dK += scale · (dS^T Q)
  const uint32_t* ktb = p.kt_pairs + (b * p.Hkv + hk) * p.kt_pairs_head_words() + kb / 2 * p.D;
  CleanVectorsForTiles();
  amx::gemm_pairs<AmxTiles, true, true, true, false>(ktb, p.Bc / 2, sc.ds_key_pairs, Br, tw, dQT, Br, p.D, Br, nk, 1.f,
                                                     p.kt_lo_words);
}

// round_grads: dV += P'^T dO, dK += scale dS^T Q and dQ^T += K^T dS^T of one computed tile (P'^T in sc.w.PdT,
// dS^T in sc.w.ST) on the bf16 products, P' and dS rounded to bf16 once.
void RoundedGradProducts(const Params& p, BwdScratch& sc, int64_t b, int64_t hk, int64_t t, int64_t kb, int64_t nk,
                         float* dK, float* dV, float* dQT) {
  const int64_t Br = p.Br, Br2 = Br / 2, Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv);
  PackRowsAsPairs(sc.w.PdT, nk, Br, sc.pd_pairs);
  PackRowsAsPairs(sc.w.ST, nk, Br, sc.ds_pairs);
  PackProbabilityPairs<false>(sc.w.ST, nk, Br, sc.ds_key_pairs, 0);  // no lo parts
  if (p.amx_tiles) {  // the same three products on the tiles (K^T pairs per key block, Params::kt_pairs_head_words)
    namespace amx = simd::amx;
    CleanVectorsForTiles();
    amx::gemm_pairs<AmxTiles, true, false>(sc.pd_pairs, Br2, p.dorp_tile(t), Dvp, 0, dV, Dvp, nk, Dvp, Br, 1.f);
    CleanVectorsForTiles();
    amx::gemm_pairs<AmxTiles, false, false>(sc.ds_pairs, Br2, p.qrp_tile(t), Dp, 0, sc.dk_tile, Dp, nk, Dp, Br, 1.f);
    AddScaledRows(dK, sc.dk_tile, nk * Dp, p.scale);  // dK += scale · (dS^T Q)
    const uint32_t* ktb = p.kt_pairs + (b * p.Hkv + hk) * p.kt_pairs_head_words() + kb / 2 * p.D;
    CleanVectorsForTiles();
    amx::gemm_pairs<AmxTiles, true, false>(ktb, p.Bc / 2, sc.ds_key_pairs, Br, 0, dQT, Br, p.D, Br, nk, 1.f);
    return;
  }
  GemmBf16<true, false>(sc.pd_pairs, Br2, 1, p.dorp_tile(t), Dvp, 0, dV, Dvp, nk, Dvp / 16, Br2, 1.f);
  GemmBf16<true, false>(sc.ds_pairs, Br2, 1, p.qrp_tile(t), Dp, 0, dK, Dp, nk, Dp / 16, Br2, p.scale);
  const uint32_t* kt = p.kt_pairs + ((b * p.Hkv + hk) * p.lk_pairs() + kb / 2) * p.D;
  GemmKeyPairs<false>(kt, p.D, sc.ds_key_pairs, Br, 0, dQT, Br, Br / 16, nk, sc.kt_last);
}
#endif

void ReduceDQTask(const Params& p, int64_t task);
void PackQTask(const Params& p, int64_t task);
void RowStatsTask(const Params& p, int64_t task);

// One-pass backward: dK, dV of the key blocks of group g and their partial dQ^T of every query block that sees
// them (with query chunks, Params::q_chunks: of the chunk's query blocks, dK and dV partial). Loops: query head h,
// query block qb, key block of the group; dK and dV of a key block add the same tiles in the same order as
// BackwardKVTask (so they equal its results without chunks), and dQ^T is summed over the group's key blocks.
// With Params::dscores, each tile's dS goes there too (the additive mask's gradient); with Params::dmask_part, it is
// added into the chunk's partial sums.
void BackwardKVQTask(const Params& p, int64_t task) {
  const AmxTaskScope tile_config(p.amx_tiles && p.k_pairs);
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nkb = p.num_k_blocks(), nqb = p.num_q_blocks(), ng = p.num_kv_groups(), Br = p.Br, Bc = p.Bc;
  const int64_t gt = task / p.q_chunks, qc = task % p.q_chunks;
  const int64_t bhk = gt / ng, g = gt % ng, b = bhk / p.Hkv, hk = bhk % p.Hkv;
  const int64_t kb0 = g * p.kv_group * Bc, kend = std::min(p.Lk, std::min(nkb, (g + 1) * p.kv_group) * Bc);
  const int64_t nblocks = (kend - kb0 + Bc - 1) / Bc;
  const int64_t Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv), nvec = Br / N;
  // the chunk's (query head, query block) items: h = hk·group + item / nqb, qb = item % nqb
  const int64_t items = p.group * nqb, it0 = items * qc / p.q_chunks, it1 = items * (qc + 1) / p.q_chunks;
  Scratch s_dk, s_dv;
  float* dK = p.q_chunks > 1 ? p.dkv_part_tile(task) : s_dk.alloc(nblocks * Bc * Dp);
  float* dV = p.q_chunks > 1 ? dK + p.Lk_blocks_rows() * Dp : s_dv.alloc(nblocks * Bc * Dvp);
  // the rows of the group's keys, to whole groups of 16 (the tile products' rows); rows past them are neither summed
  // into nor stored
  const int64_t rows = Params::pad16(kend - kb0);
  std::memset(dK, 0, sizeof(float) * size_t(rows * Dp));
  std::memset(dV, 0, sizeof(float) * size_t(rows * Dvp));
  const int64_t klive = p.key_len ? std::min(kend, p.key_len[b]) : kend;  // keys past key_len get 0 gradients
  if (p.dmask_part && b % p.dm_chunk == 0)  // the chunk's first batch: its sums of the group's keys start from 0
    for (int64_t hm = 0; hm < p.dm_heads; ++hm)
      std::memset(p.mask_part(b, hk * p.group + hm) + kb0 * p.dm_lqp, 0,
                  sizeof(float) * size_t((kend - kb0) * p.dm_lqp));
  // The group's columns [kb0, kend) of dS: each tile's, and 0 where no tile is computed (masked, causal, past
  // key_len): columns [c0, c1) of rows [i0, i0 + n) of head h.
  const auto zero_scores = [&](int64_t h, int64_t i0, int64_t n, int64_t c0, int64_t c1) {
    if (!p.dscores || c0 >= c1) return;
    for (int64_t i = i0; i < i0 + n; ++i)
      std::memset(p.dscores + ((b * p.Hq + h) * p.Lq + i) * p.Lk + c0, 0, sizeof(float) * size_t(c1 - c0));
  };
  if (kb0 >= klive)
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t h = hk * p.group + it / nqb, qb = it % nqb, i0 = qb * Br;
      zero_scores(h, i0, std::min(Br, p.Lq - i0), kb0, kend);
      if (p.pk_one_block) ReduceDQTask(p, (b * p.Hq + h) * nqb + qb);  // dQ = 0 (no partial)
    }
  if (kb0 < klive) {
    BwdScratch sc(p);
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t h = hk * p.group + it / nqb, qb = it % nqb;
      const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0), t = (b * p.Hq + h) * nqb + qb;
      if (qb < p.first_q_block(kb0)) {
        zero_scores(h, i0, nq, kb0, kend);
        if (p.pk_one_block) ReduceDQTask(p, t);
        continue;
      }
      if (p.pk_one_block) {
        PackQTask(p, t);
        if (p.block_has_log_sum[t]) RowStatsTask(p, t);
      }
      zero_scores(h, i0, nq, klive, kend);
      float* dQT = p.dq_part_tile(t, g);
      std::memset(dQT, 0, sizeof(float) * size_t(p.D * Br));
      const float* Qr = p.qr_tile(t);
      const float* dOr = p.dor_tile(t);
      for (int64_t kb = kb0; kb < klive; kb += Bc) {
        const int64_t nk = std::min(Bc, klive - kb), x = (kb - kb0) / Bc;
        Rows kr{};  // the rounded products read K^T pairs instead
        if (!ComputeTile(p, sc.w, b, h, i0, nq, kb, nk, p.grad_pairs() ? nullptr : &kr, nullptr)) {
          zero_scores(h, i0, nq, kb, kb + nk);
          continue;
        }
        // dS^T [nk x Br] into dS [Lq x Lk] rows (one writer per element)
        if (p.dscores) {
          float* ds = p.dscores + ((b * p.Hq + h) * p.Lq + i0) * p.Lk + kb;
          if (p.stream_dscores) TransposeRows<true>(sc.w.ST, Br, nk, nq, 1.f, ds, p.Lk, nk);
          else TransposeRows(sc.w.ST, Br, nk, nq, 1.f, ds, p.Lk, nk);
        }
        if (p.dmask_part) {  // dS^T rows added into the chunk's sums (lanes past Lq are never read)
          float* part = p.mask_part(b, h) + kb * p.dm_lqp + i0;
          for (int64_t jj = 0; jj < nk; ++jj)
            for (int64_t x = 0; x < Br; x += N) {
              float* at = part + jj * p.dm_lqp + x;
              hn::StoreU(hn::Add(hn::LoadU(d, at), hn::Load(d, sc.w.ST + jj * Br + x)), d, at);
            }
        }
#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
        if (p.split_grads) {
          SplitGradProducts(p, sc, b, hk, t, kb, nk, dK + x * Bc * Dp, dV + x * Bc * Dvp, dQT);
          continue;
        }
        if (p.round_grads) {
          RoundedGradProducts(p, sc, b, hk, t, kb, nk, dK + x * Bc * Dp, dV + x * Bc * Dvp, dQT);
          continue;
        }
#endif
        Gemm<true>(sc.w.PdT, Br, 1, dOr, Dvp, dV + x * Bc * Dvp, Dvp, nk, Dvp / N, Br);  // dV += P'^T dO
        Gemm<true>(sc.w.ST, Br, 1, Qr, Dp, dK + x * Bc * Dp, Dp, nk, Dp / N, Br);        // dK += dS^T (scale Q)
        Gemm<true>(kr.ptr, 1, kr.stride, sc.w.ST, Br, dQT, Br, p.D, nvec, nk);           // dQ^T += K^T dS^T
      }
      if (p.pk_one_block) ReduceDQTask(p, t);
    }
  }
  if (p.stream_dscores) hwy::FlushStream();  // the non-temporal stores of dS, before the task ends
  if (p.q_chunks > 1) return;                // partial dK and dV: ReduceKVTask
  for (int64_t kb = kb0; kb < kend; kb += Bc) {
    const int64_t x = (kb - kb0) / Bc;
    StoreKeyGrads(p, b, hk, kb, std::min(Bc, kend - kb), dK + x * Bc * Dp, dV + x * Bc * Dvp);
  }
}

// dK and dV of one (b, kv head) of the one-pass backward with query chunks (Params::q_chunks): the sum of the
// chunks' partials, in chunk order, into the first's.
void ReduceKVTask(const Params& p, int64_t bhk) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv), rows = p.Lk_blocks_rows();
  float* dK = p.dkv_part_tile(bhk * p.q_chunks);
  float* dV = dK + rows * Dp;
  const auto add = [&](float* sum, const float* part, int64_t n) {
    for (int64_t x = 0; x < n; x += N) hn::Store(hn::Add(hn::Load(d, sum + x), hn::Load(d, part + x)), d, sum + x);
  };
  for (int64_t c = 1; c < p.q_chunks; ++c) {  // the rows of the keys (those past Lk are never stored)
    const float* part = p.dkv_part_tile(bhk * p.q_chunks + c);
    add(dK, part, p.Lk * Dp);
    add(dV, part + rows * Dp, p.Lk * Dvp);
  }
  const int64_t b = bhk / p.Hkv, hk = bhk % p.Hkv;
  for (int64_t kb = 0; kb < p.Lk; kb += p.Bc)
    StoreKeyGrads(p, b, hk, kb, std::min(p.Bc, p.Lk - kb), dK + kb * Dp, dV + kb * Dvp);
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
  const AmxTaskScope tile_config(p.amx_tiles && p.k_pairs);
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nqb = p.num_q_blocks(), Br = p.Br, Bc = p.Bc, nvec = Br / N;
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
  const int64_t kend = p.key_end(b, i0, nq);
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
  StoreTransposed(p.dq, b * p.dq.sb + h * p.dq.sh + i0 * p.dq.sl, dQT, nq, p.D, Br, p.scale);
}

// dQ = scale · Σ_g dQ^T partial of group g, in g order, of one (b, h, query block).
void ReduceDQTask(const Params& p, int64_t task) {
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  const int64_t nqb = p.num_q_blocks(), ng = p.num_kv_groups(), Br = p.Br, n = p.D * Br;
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
  Scratch s_dqt;
  float* dQT = s_dqt.alloc(n);
  std::memset(dQT, 0, sizeof(float) * size_t(n));
  for (int64_t g = 0; g < ng; ++g) {
    if (!p.group_has_dq_part(b, g, qb)) continue;
    const float* part = p.dq_part_tile(task, g);
    for (int64_t x = 0; x < n; x += N) hn::Store(hn::Add(hn::Load(d, dQT + x), hn::Load(d, part + x)), d, dQT + x);
  }
  StoreTransposed(p.dq, b * p.dq.sb + h * p.dq.sh + i0 * p.dq.sl, dQT, nq, p.D, Br, p.scale);
}

// BackwardOps::store_half: n floats rounded to bf16 or float16 (StoreHalf).
void StoreHalfRow(DType dt, uint16_t* dst, const float* src, int64_t n) { StoreHalf(dt, dst, src, n, 1.f); }

// The packed query-side tiles of one (b, h, query block), and Di = rowsum(dO ∘ O) of its rows (0 for NaN rows).
void PackQTask(const Params& p, int64_t task) {
  const int64_t nqb = p.num_q_blocks(), Br = p.Br;
  const int64_t bh = task / nqb, qb = task % nqb, b = bh / p.Hq, h = bh % p.Hq;
  const int64_t i0 = qb * Br, nq = std::min(Br, p.Lq - i0);
  const int64_t Dp = Params::pad16(p.D), Dvp = Params::pad16(p.Dv);
  float *qt = p.qt_tile(task), *qr = p.qr_tile(task), *dor = p.dor_tile(task);
  Scratch s_rows;
  float* buf = s_rows.alloc(nq * std::max(p.D, p.Dv));
  PackRows(RowsOf(p.q, b, h, i0, nq, p.D, buf), nq, p.D, Dp, Br, p.scale, qr, qt);
  PackRows(RowsOf(p.dout, b, h, i0, nq, p.Dv, buf), nq, p.Dv, Dvp, Br, 1.f, dor, p.dot_tile(task));
#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
  if (p.split_bf16) {  // Q^T and dO^T as two bf16 parts each, the lo rows after the hi ones (no NaN: Params)
    PackTransposedSplitPairs(p.q, b, h, i0, nq, p.D, Br, p.qp_tile(task), p.k_pair_stride() * Br);
    PackTransposedSplitPairs(p.dout, b, h, i0, nq, p.Dv, Br, p.dop_tile(task), p.dv_pair_stride() * Br);
    if (p.split_grads) {
      PackRowPairsAlongRowsSplit(p.q, b, h, i0, nq, p.D, Dp, Br, p.qrp_tile(task), Br / 2 * Dp);
      PackRowPairsAlongRowsSplit(p.dout, b, h, i0, nq, p.Dv, Dvp, Br, p.dorp_tile(task), Br / 2 * Dvp);
    }
  } else if (p.pk_qp) {  // Q^T and dO^T (when dO is bf16 too) in bf16 pairs; a NaN row of q is zeroed below
    PackTransposedPairs(p.q, b, h, i0, nq, p.D, Br, p.qp_tile(task));
    std::fill(p.qp_tile(task) + p.d_pairs() * Br, p.qp_tile(task) + p.k_pair_stride() * Br, 0u);  // pad rows
    if (p.pk_dop) {
      PackTransposedPairs(p.dout, b, h, i0, nq, p.Dv, Br, p.dop_tile(task));
      std::fill(p.dop_tile(task) + p.dv_pairs() * Br, p.dop_tile(task) + p.dv_pair_stride() * Br, 0u);
    }
    if (p.pk_qrp) {
      PackRowPairsAlongRows(p.q, b, h, i0, nq, p.D, Dp, Br, p.qrp_tile(task));
      PackRowPairsAlongRows(p.dout, b, h, i0, nq, p.Dv, Dvp, Br, p.dorp_tile(task));
    }
  }
#endif
  const int64_t row0 = bh * p.Lq + i0;
  const Rows o = RowsOf(p.o, b, h, i0, nq, p.Dv, buf);
  const DF d;
  const int64_t N = int64_t(hn::Lanes(d));
  for (int64_t ii = 0; ii < nq; ++ii) {
    if (p.nan_row[row0 + ii]) continue;  // marked by the driver (lse NaN): Di stays 0
    const float *dr = dor + ii * Dvp, *orow = o.ptr + ii * o.stride;
    VF acc = hn::Zero(d);
    int64_t x = 0;
    for (; x + N <= p.Dv; x += N) acc = hn::MulAdd(hn::Load(d, dr + x), hn::LoadU(d, orow + x), acc);
    float di = hn::GetLane(hn::SumOfLanes(d, acc));
    for (; x < p.Dv; ++x) di += dr[x] * orow[x];
    p.delta[row0 + ii] = di;
  }
  // A NaN in q makes the row a NaN row; its packed q is zeroed (0 · NaN would reach dK through masked keys).
  for (int64_t ii = 0; ii < nq; ++ii) {
    MF nan = hn::FirstN(d, 0);
    for (int64_t x = 0; x < Dp; x += N) nan = hn::Or(nan, hn::IsNaN(hn::Load(d, qr + ii * Dp + x)));
    if (hn::AllFalse(d, nan)) continue;
    for (int64_t x = 0; x < p.D; ++x) qr[ii * Dp + x] = qt[x * Br + ii] = 0.f;
    if (p.pk_qp)
      for (int64_t x = 0; x < p.d_pairs(); ++x) p.qp_tile(task)[x * Br + ii] = 0;
    if (p.pk_qrp)  // the row's half of its pairs
      for (int64_t x = 0; x < p.D; ++x) p.qrp_tile(task)[ii / 2 * Dp + x] &= ii % 2 ? 0xFFFFu : 0xFFFF0000u;
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
  const int64_t kend = p.key_end(b, i0, nq);
  Scratch s_st, s_ml, s_bias, s_kbuf;
  float* ST = s_st.alloc(Bc * Br);
  float* M = s_ml.alloc(2 * Br);
  float* L = M + Br;
  float* bias = p.mask != MaskKind::kNone ? s_bias.alloc(Bc * Br) : nullptr;
  float* kbuf = p.k.dtype == DType::kF32 && p.k.sd == 1 ? nullptr : s_kbuf.alloc(Bc * p.D);
  uint8_t pad[1024];
  std::fill(M, M + Br, kNegInf);
  std::fill(L, L + Br, 0.f);
  const float* QT = p.qt_tile(task);
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

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64
// K^T pairs of one (b, kv head) into kt (Params::kt_pairs, the amx layout per key block) from the bf16 elements of its
// rows of k_pairs at k16 (2·k_pair_stride() halves apart).
void PackKeyPairsTransposed(const Params& p, const uint16_t* k16, uint32_t* kt) {
  const int64_t D2 = p.k_pair_stride(), Lk2 = p.lk_pairs(), Bc2 = p.Bc / 2;
  const auto pair_row = [&](int64_t y, uint32_t* out) {
    const uint16_t* r0 = k16 + 2 * y * 2 * D2;
    PairsAcrossRowsContiguous(r0, 2 * y + 1 < p.Lk ? r0 + 2 * D2 : nullptr, p.D, out);
  };
  std::vector<uint32_t> rows(size_t(16 * p.D));
  int64_t y = 0;
  if (p.amx_tiles)  // K^T per key block, pair y of dimension x at (y / Bc2)·D·Bc2 + x·Bc2 + y % Bc2: 16 pair rows
    for (; y + 16 <= Lk2 && Bc2 % 16 == 0; y += 16) {  // at a time, transposed in registers
      for (int64_t i = 0; i < 16; ++i) pair_row(y + i, rows.data() + i * p.D);
      StoreTransposed16(rows.data(), p.D, p.D, kt + y / Bc2 * p.D * Bc2 + y % Bc2, Bc2);
    }
  for (; y < Lk2; ++y) {
    pair_row(y, rows.data());
    for (int64_t x = 0; x < p.D; ++x) kt[p.amx_tiles ? (y / Bc2 * p.D + x) * Bc2 + y % Bc2 : y * p.D + x] = rows[x];
  }
}

// k_pairs (rows with a NaN zeroed, as ZeroNanRows does for the float32 products) and v_row_pairs of one (b, kv
// head): task = b * Hkv + hk.
void PackKVRowPairs(const Params& p, int64_t task) {
  const int64_t b = task / p.Hkv, hk = task % p.Hkv;
  const int64_t D2 = p.k_pair_stride(), Dv2 = p.dv_pair_stride();  // words per row, pad words zeroed
  if (p.split_bf16) {  // hi and lo parts (K and V hold no NaN there: Params::split_bf16)
    uint32_t *kp = p.k_pairs + task * p.Lk * D2, *vp = p.v_row_pairs + task * p.Lk * Dv2;
    for (int64_t j = 0; j < p.Lk; ++j) {
      RowPairsSplitAt(p.k, b * p.k.sb + hk * p.k.sh + j * p.k.sl, p.D, kp + j * D2, kp + j * D2 + p.k_lo_words);
      RowPairsSplitAt(p.v, b * p.v.sb + hk * p.v.sh + j * p.v.sl, p.Dv, vp + j * Dv2, vp + j * Dv2 + p.v_lo_words);
    }
  } else {
    PackRowPairs(p.k, b * p.k.sb + hk * p.k.sh, p.Lk, p.D, true, p.k_pairs + task * p.Lk * D2, D2);
    PackRowPairs(p.v, b * p.v.sb + hk * p.v.sh, p.Lk, p.Dv, false, p.v_row_pairs + task * p.Lk * Dv2, Dv2);
  }
  if (!p.kt_pairs) return;
  // kt_pairs from the k_pairs just packed (NaN rows already zero): (k[2y, x], k[2y + 1, x]); split_grads: the hi
  // parts' and then the lo parts'.
  for (int64_t part = 0; part < p.pair_parts(); ++part)
    PackKeyPairsTransposed(p, reinterpret_cast<const uint16_t*>(p.k_pairs + part * p.k_lo_words + task * p.Lk * D2),
                           p.kt_pairs + part * p.kt_lo_words + task * p.kt_pairs_head_words());
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace sattn::fused
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "simd/dispatch.hpp"

namespace sattn::fused {

namespace {
#define SATTN_FUSED_BACKWARD_OPS(NS)                                                                     \
  BackwardOps {                                                                                          \
    &NS::BackwardKVTask, &NS::BackwardQTask, &NS::BackwardKVQTask, &NS::ReduceDQTask, &NS::ReduceKVTask, \
        &NS::PackQTask, &NS::RowStatsTask, &NS::StoreHalfRow, nullptr, false                             \
  }
const simd::Build<BackwardOps> kBuilds[] = {
#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64
    {simd::Target::kAmx, BackwardOps{&N_AVX3::BackwardKVTask, &N_AVX3::BackwardQTask, &N_AVX3::BackwardKVQTask,
                                     &N_AVX3::ReduceDQTask, &N_AVX3::ReduceKVTask, &N_AVX3::PackQTask,
                                     &N_AVX3::RowStatsTask, &N_AVX3::StoreHalfRow, &N_AVX3::PackKVRowPairs, true}},
    {simd::Target::kAvx512Bf16,
     BackwardOps{&N_AVX3::BackwardKVTask, &N_AVX3::BackwardQTask, &N_AVX3::BackwardKVQTask, &N_AVX3::ReduceDQTask,
                 &N_AVX3::ReduceKVTask, &N_AVX3::PackQTask, &N_AVX3::RowStatsTask, &N_AVX3::StoreHalfRow,
                 &N_AVX3::PackKVRowPairs, false}},
#endif
    SATTN_SIMD_BUILDS(SATTN_FUSED_BACKWARD_OPS)};
}  // namespace

const BackwardOps& backward_ops() { return simd::pick(kBuilds).ops; }

}  // namespace sattn::fused
#endif  // HWY_ONCE
