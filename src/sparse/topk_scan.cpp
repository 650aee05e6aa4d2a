// TopK's scoring pass (topk_scan.hpp), compiled once per SIMD target by Highway (simd/hwy_targets.hpp) and
// chosen at run time from the one target table (simd/target.hpp). Scores are computed in register tiles S[MR rows x W
// keys] from packed key tiles [d x W] (W = kNV vectors, keys in lanes, queries broadcast), the way the fused kernel's
// micro-kernel does. Each score vector is compared with its row's threshold in registers and the survivors are appended
// with Compress (no branch per key); a row whose buffer fills is shrunk with a sampled threshold that is verified by a
// vector count.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "sparse/topk_scan.cpp"
#include "simd/hwy_targets.hpp"
#include <hwy/foreach_target.h>  // must come before highway.h

#include <hwy/highway.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>

#include "sparse/tiles.hpp"
#include "sparse/topk_scan.hpp"

#ifndef SATTN_TOPK_SCAN_HELPERS
#define SATTN_TOPK_SCAN_HELPERS
namespace sattn::sparse::topk::detail {

constexpr int64_t kCapacity = 8;  // a row's buffer holds kCapacity * k candidates before it is shrunk
constexpr int64_t kMaxW = 64;     // largest tile width of any x86 target (4 x 16 lanes)

// A row never holds more than n candidates (each key is appended at most once), so the buffer needs
// min(kCapacity·k, n) plus slack for whole-vector stores past the end (and >= 64 floats of sample scratch).
inline int64_t stride_for(int64_t k, int64_t n) { return std::min(kCapacity * k, n) + 2 * kMaxW; }

// Keeps exactly the best k of a row's c candidates (scores s, key indices j, ascending in j), in place and in
// order: every score above the k-th best, then the ties at the k-th best with the lowest indices. Returns that
// k-th best score. `tmp` holds c floats.
inline float keep_best(float* s, int32_t* j, int64_t c, int64_t k, float* tmp) {
  std::copy(s, s + c, tmp);
  std::nth_element(tmp, tmp + (k - 1), tmp + c, std::greater<float>());
  const float v = tmp[k - 1];
  int64_t above = 0;
  for (int64_t x = 0; x < c; ++x) above += s[x] > v;
  int64_t ties = k - above, w = 0;
  for (int64_t x = 0; x < c; ++x) {  // branch-free stable compaction
    const bool tie = s[x] == v && ties > 0;
    ties -= tie;
    const bool keep = s[x] > v || tie;
    s[w] = s[x];
    j[w] = j[x];
    w += keep;
  }
  return v;
}

}  // namespace sattn::sparse::topk::detail
#endif

HWY_BEFORE_NAMESPACE();
namespace sattn::sparse::topk {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using VF = hn::Vec<DF>;
using MF = hn::Mask<DF>;

#include "simd/blocking.inc"  // kMR, kNV
#include "simd/gemm.inc"      // MicroKernel

int64_t TileWidth() { return int64_t(kNV) * int64_t(hn::Lanes(DF())); }

// Appends the lanes of s strictly above t (scores and key indices j0 + lane) at s_out/j_out; returns how many.
// Writes a whole vector at each (the buffers have a vector of slack).
HWY_INLINE int64_t Append(VF s, VF t, hn::Vec<DI> idx, float* s_out, int32_t* j_out) {
  const DF df;
  const DI di;
  const auto keep = hn::Gt(s, t);
  hn::StoreU(hn::Compress(s, keep), df, s_out);
  hn::StoreU(hn::Compress(idx, hn::RebindMask(di, keep)), di, j_out);
  return int64_t(hn::CountTrue(df, keep));
}

// How many of s[0, c) are strictly above v: vector compares, no branch per element. Reads whole vectors (the
// lanes past c are masked off; the buffers have slack).
HWY_INLINE int64_t CountAbove(const float* s, int64_t c, float v) {
  const DF df;
  const int64_t N = int64_t(hn::Lanes(df));
  const VF vv = hn::Set(df, v);
  int64_t gt = 0, x = 0;
  for (; x + N <= c; x += N) gt += int64_t(hn::CountTrue(df, hn::Gt(hn::LoadU(df, s + x), vv)));
  if (x < c) gt += int64_t(hn::CountTrue(df, hn::And(hn::FirstN(df, size_t(c - x)), hn::Gt(hn::LoadU(df, s + x), vv))));
  return gt;
}

// Keeps, in place and in order, the candidates strictly above v (at least k of them, known); returns how many.
HWY_INLINE int64_t KeepAbove(float* s, int32_t* j, int64_t c, float v) {
  const DF df;
  const DI di;
  const int64_t N = int64_t(hn::Lanes(df));
  const VF vv = hn::Set(df, v);
  int64_t w = 0, x = 0;
  for (; x + N <= c; x += N) {
    const VF sv = hn::LoadU(df, s + x);
    const auto keep = hn::Gt(sv, vv);
    const auto jv = hn::LoadU(di, j + x);
    // Whole-vector stores at w <= x only overwrite lanes below x + N, which are already loaded.
    hn::StoreU(hn::Compress(sv, keep), df, s + w);
    hn::StoreU(hn::Compress(jv, hn::RebindMask(di, keep)), di, j + w);
    w += int64_t(hn::CountTrue(df, keep));
  }
  for (; x < c; ++x) {
    const bool keep = s[x] > v;
    s[w] = s[x];
    j[w] = j[x];
    w += keep;
  }
  return w;
}

// Exactly the best k of c candidates (c > k), in place and in key order; returns the k-th best score. For small
// c each score's rank (how many are above it) is counted with vector compares: the scores ranked below k are the
// top-k unless a tie straddles the cut (then more than k qualify), in which case nth_element
// (detail::keep_best, ties to the lower index) decides.
float KeepBest(float* s, int32_t* j, int64_t c, int64_t k, float* tmp) {
  if (c <= 256) {
    uint8_t* keep = reinterpret_cast<uint8_t*>(tmp);
    int64_t kept = 0;
    float kth = std::numeric_limits<float>::infinity();
    for (int64_t x = 0; x < c; ++x) {
      keep[x] = CountAbove(s, c, s[x]) < k;
      kept += keep[x];
      kth = keep[x] && s[x] < kth ? s[x] : kth;
    }
    if (kept == k) {
      int64_t w = 0;
      for (int64_t x = 0; x < c; ++x) {
        s[w] = s[x];
        j[w] = j[x];
        w += keep[x];
      }
      return kth;
    }
  }
  return detail::keep_best(s, j, c, k, tmp);
}

// Shrinks a row (c candidates, ascending keys) to between k and about `target` (>= k): a threshold v is read from
// a sample of 64 scores (its rank counted with vector compares) and accepted when at least k scores are strictly
// above it (then a score <= v can never be in the top k, now or later); otherwise the row is cut to exactly its
// best k. Returns the new threshold.
float Shrink(float* s, int32_t* j, int64_t& c, int64_t k, int64_t target, float* tmp) {
  constexpr int64_t kSample = 64;
  if (c >= 2 * kSample) {
    for (int64_t x = 0; x < kSample; ++x) tmp[x] = s[x * c / kSample];
    const int64_t rank = std::min<int64_t>(kSample - 1, target * kSample / c);  // ~target above, expected
    // v = the largest sample value with at least `rank` sample values above it.
    float v = -std::numeric_limits<float>::infinity();
    for (int64_t x = 0; x < kSample; ++x) v = CountAbove(tmp, kSample, tmp[x]) >= rank && tmp[x] > v ? tmp[x] : v;
    if (CountAbove(s, c, v) >= k) {
      c = KeepAbove(s, j, c, v);
      return v;
    }
  }
  const float v = KeepBest(s, j, c, k, tmp);
  c = k;
  return v;
}

// Rows [0, MR) of q against key tile `kt` ([d x W], keys j0 + lane): score, compare, append survivors.
template <int MR>
HWY_INLINE void Tile(const float* HWY_RESTRICT q, int64_t d, const float* HWY_RESTRICT kt, int64_t j0, int64_t n,
                     float scale, const float* kbias, int64_t k, int64_t stride, float* cs, int32_t* cj, int64_t* cnt,
                     float* thr, float* tmp) {
  const DF df;
  const DI di;
  const int64_t N = int64_t(hn::Lanes(df)), cap = detail::kCapacity * k;
  VF acc[MR][kNV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < kNV; ++v) acc[r][v] = hn::Zero(df);
  // Scores of the tile: Q rows (d apart) times the packed key tile [d x kNV vectors].
  MicroKernel<MR, kNV>(acc, q, d, 1, kt, kNV * N, d,
                       [&](const float* row, int v) { return hn::Load(df, row + v * N); });
  const VF vscale = hn::Set(df, scale);
  const VF zero = hn::Zero(df);
  VF bias[kNV];  // 0 for usable keys, -inf for padding and for lanes past n
  for (int v = 0; v < kNV; ++v) bias[v] = kbias ? hn::Load(df, kbias + j0 + v * N) : zero;
  const bool tail = j0 + kNV * N > n;
  if (tail && !kbias)
    for (int v = 0; v < kNV; ++v) {
      const auto lane = hn::Add(hn::Iota(di, 0), hn::Set(di, int32_t(j0 + v * N)));
      bias[v] = hn::IfThenElseZero(hn::RebindMask(df, hn::Gt(lane, hn::Set(di, int32_t(n - 1)))),
                                   hn::Set(df, -std::numeric_limits<float>::infinity()));
    }
  const bool use_bias = kbias || tail;
  for (int r = 0; r < MR; ++r) {
    const VF t = hn::Set(df, thr[r]);
    float* rs = cs + r * stride;
    int32_t* rj = cj + r * stride;
    int64_t c = cnt[r];
    for (int v = 0; v < kNV; ++v) {
      VF s = hn::Mul(acc[r][v], vscale);
      if (use_bias) s = hn::Add(s, bias[v]);
      c += Append(s, t, hn::Add(hn::Iota(di, 0), hn::Set(di, int32_t(j0 + v * N))), rs + c, rj + c);
    }
    if (c >= cap) thr[r] = Shrink(rs, rj, c, k, 2 * k, tmp);
    cnt[r] = c;
  }
}

template <int MR = kMR - 1>
HWY_INLINE void TailTile(int64_t rows, const float* q, int64_t d, const float* kt, int64_t j0, int64_t n, float scale,
                         const float* kbias, int64_t k, int64_t stride, float* cs, int32_t* cj, int64_t* cnt,
                         float* thr, float* tmp) {
  if constexpr (MR >= 1) {
    if (rows == MR) return Tile<MR>(q, d, kt, j0, n, scale, kbias, k, stride, cs, cj, cnt, thr, tmp);
    TailTile<MR - 1>(rows, q, d, kt, j0, n, scale, kbias, k, stride, cs, cj, cnt, thr, tmp);
  }
}

void Scan(const float* q, int64_t m, int64_t d, const float* kp, int64_t n, float scale, const float* kbias, int64_t k,
          float* cs, int32_t* cj, int64_t* cnt, float* thr, float* tmp) {
  const int64_t W = TileWidth(), stride = detail::stride_for(k, n);
  for (int64_t j0 = 0; j0 < n; j0 += W) {
    const float* kt = kp + j0 * d;  // tile j0 / W: [d x W]
    int64_t r = 0;
    for (; r + kMR <= m; r += kMR)
      Tile<kMR>(q + r * d, d, kt, j0, n, scale, kbias, k, stride, cs + r * stride, cj + r * stride, cnt + r, thr + r,
                tmp);
    if (r < m)
      TailTile(m - r, q + r * d, d, kt, j0, n, scale, kbias, k, stride, cs + r * stride, cj + r * stride, cnt + r,
               thr + r, tmp);
  }
  for (int64_t r = 0; r < m; ++r)
    if (cnt[r] > k) {
      int64_t c = cnt[r];
      Shrink(cs + r * stride, cj + r * stride, c, k, k + k / 2, tmp);  // a cheap cut to ~1.5 k first
      if (c > k) KeepBest(cs + r * stride, cj + r * stride, c, k, tmp);
      cnt[r] = k;
    }
}

// o[0, dv) = sum_x w[x] · v[j[x]·dv + (0, dv)]: the weighted sum of a row's kept value rows, vectors over dv.
void WeightedRows(const float* w, const int32_t* j, int64_t c, const float* v, int64_t dv, float* o) {
  const DF df;
  const int64_t N = int64_t(hn::Lanes(df));
  int64_t d0 = 0;
  for (; d0 + 4 * N <= dv; d0 += 4 * N) {  // four accumulators in registers per pass over the rows
    VF a0 = hn::Zero(df), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t x = 0; x < c; ++x) {
      const float* vr = v + int64_t(j[x]) * dv + d0;
      const VF wx = hn::Set(df, w[x]);
      a0 = hn::MulAdd(wx, hn::LoadU(df, vr), a0);
      a1 = hn::MulAdd(wx, hn::LoadU(df, vr + N), a1);
      a2 = hn::MulAdd(wx, hn::LoadU(df, vr + 2 * N), a2);
      a3 = hn::MulAdd(wx, hn::LoadU(df, vr + 3 * N), a3);
    }
    hn::StoreU(a0, df, o + d0);
    hn::StoreU(a1, df, o + d0 + N);
    hn::StoreU(a2, df, o + d0 + 2 * N);
    hn::StoreU(a3, df, o + d0 + 3 * N);
  }
  for (; d0 + N <= dv; d0 += N) {
    VF a = hn::Zero(df);
    for (int64_t x = 0; x < c; ++x) a = hn::MulAdd(hn::Set(df, w[x]), hn::LoadU(df, v + int64_t(j[x]) * dv + d0), a);
    hn::StoreU(a, df, o + d0);
  }
  for (; d0 < dv; ++d0) {
    float a = 0.0f;
    for (int64_t x = 0; x < c; ++x) a += w[x] * v[int64_t(j[x]) * dv + d0];
    o[d0] = a;
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace sattn::sparse::topk
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "simd/dispatch.hpp"
#include "simd/target.hpp"

namespace sattn::sparse::topk {

namespace {
struct Ops {
  int64_t (*tile_width)();
  void (*scan)(const float*, int64_t, int64_t, const float*, int64_t, float, const float*, int64_t, float*, int32_t*,
               int64_t*, float*, float*);
  void (*weighted_rows)(const float*, const int32_t*, int64_t, const float*, int64_t, float*);
};
#define SATTN_TOPK_OPS(NS) \
  Ops { &NS::TileWidth, &NS::Scan, &NS::WeightedRows }
const simd::Build<Ops> kBuilds[] = {SATTN_SIMD_BUILDS(SATTN_TOPK_OPS)};
const Ops& ops() { return simd::pick(kBuilds).ops; }
}  // namespace

const char* simd_build() { return simd::name(simd::pick(kBuilds).target); }
// Registered for simd_targets(); the symbol has C linkage so that the umbrella target sattn::sattn can make the
// linker keep this file (CMakeLists.txt).
extern "C" const bool sattn_simd_registered_topk = simd::register_build(simd::Component::kTopK, &simd_build);
int64_t tile_width() { return ops().tile_width(); }
int64_t row_stride(int64_t k, int64_t n) { return detail::stride_for(k, n); }

void weighted_rows(const float* w, const int32_t* j, int64_t c, const float* v, int64_t dv, float* o) {
  ops().weighted_rows(w, j, c, v, dv, o);
}

void pack_keys(const float* k, int64_t n, int64_t d, int64_t ld_in, float* out) {
  const int64_t W = tile_width(), ntiles = (n + W - 1) / W;
  for (int64_t t = 0; t < ntiles; ++t) {
    float* o = out + t * W * d;
    const int64_t keys = std::min(W, n - t * W);
    tiles::transpose_rows(k + t * W * ld_in, ld_in, keys, d, o, W);  // o[c][l] = k[t·W + l][c]
    for (int64_t c = 0; keys < W && c < d; ++c) std::fill(o + c * W + keys, o + (c + 1) * W, 0.0f);
  }
}

void scan(const float* q, int64_t m, int64_t d, const float* kpacked, int64_t n, float scale, const float* key_bias,
          int64_t k, float* cs, int32_t* cj, int64_t* cnt, float* thr, float* tmp) {
  ops().scan(q, m, d, kpacked, n, scale, key_bias, k, cs, cj, cnt, thr, tmp);
}

}  // namespace sattn::sparse::topk
#endif  // HWY_ONCE
