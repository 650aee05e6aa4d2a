// Linear attention with elu+1 and FAVOR+ feature maps, non-causal and causal (chunked prefix sums), forward and
// backward (see include/sattn/linear.hpp). fp32 matrix products on the sparse tile operations; float64 for the long
// sums (key/query states, denominators).
#include "sattn/attention.hpp"
#include "sattn/linear.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/threads.hpp"
#include "sattn/error.hpp"
#include "sattn/random.hpp"
#include "sparse/problem_sizes.hpp"
#include "sparse/tiles.hpp"

namespace sattn::sparse {

namespace {

constexpr int64_t kChunk = 64;

double load(const TensorView& t, int64_t off) {
  switch (t.dtype) {
    case DType::kF32: return static_cast<const float*>(t.data)[off];
    case DType::kF64: return static_cast<const double*>(t.data)[off];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(t.data)[off]);
    case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(t.data)[off]);
    default: return 0.0;
  }
}

void store(const TensorView& t, int64_t off, double x) {
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[off] = float(x); break;
    case DType::kF64: static_cast<double*>(t.data)[off] = x; break;
    case DType::kBF16: static_cast<uint16_t*>(t.data)[off] = float_to_bf16(float(x)); break;
    case DType::kF16: static_cast<uint16_t*>(t.data)[off] = float_to_fp16(float(x)); break;
    default: break;
  }
}

// Rows [L, D] of head (b, h) of a 4-D view, as float32 (contiguous).
void rows(const TensorView& t, int64_t b, int64_t h, std::vector<float>& r) {
  const int64_t L = t.shape[2], D = t.shape[3];
  r.resize(static_cast<size_t>(L * D));
  const int64_t base = b * t.strides[0] + h * t.strides[1];
  if (t.dtype == DType::kF32 && t.strides[3] == 1) {
    for (int64_t i = 0; i < L; ++i)
      std::copy_n(static_cast<const float*>(t.data) + base + i * t.strides[2], D, &r[size_t(i * D)]);
    return;
  }
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < D; ++d) r[size_t(i * D + d)] = float(load(t, base + i * t.strides[2] + d * t.strides[3]));
}

void store_rows(const TensorView& t, int64_t b, int64_t h, const float* r) {
  const int64_t L = t.shape[2], D = t.shape[3];
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < D; ++d)
      store(t, b * t.strides[0] + h * t.strides[1] + i * t.strides[2] + d * t.strides[3], r[size_t(i * D + d)]);
}

void check4(const TensorView& t, const char* name, const char* layout) {
  check(t.data != nullptr, ErrorKind::kInvalidArgument, name, ": required");
  check(t.dim() == 4 && t.strides.size() == 4, ErrorKind::kInvalidArgument, name, ": expected a 4-D tensor ", layout,
        ", got shape ", shape_text(t.shape));
  check(is_floating(t.dtype), ErrorKind::kTypeError, name, ": expected a float tensor, got ", to_string(t.dtype));
  for (int d = 0; d < 4; ++d)
    check(t.shape[d] > 0 && t.strides[d] >= 0, ErrorKind::kInvalidArgument, name,
          ": zero-size dimension or negative "
          "stride in shape ",
          shape_text(t.shape));
}

// The call's problem plus linear attention's own fields: the feature map and its size F (favor+: the projection).
struct Problem : ProblemSizes {
  int64_t F = 0;
  bool favor = false;
  int threads = 1;
  std::vector<float> omega, omega_t;  // [F, D] and [D, F] (favor+)
  bool causal() const { return problem.causal != Causal::kNone; }
};

Problem describe(const TensorView& q, const TensorView& k, const TensorView& v, const LinearOptions& o) {
  AttentionOptions options;
  options.causal = o.causal ? Causal::kTopLeft : Causal::kNone;
  Problem p;
  p.problem = describe_attention(q, k, v, options);
  check(o.enable_gqa || p.Hq() == p.Hkv(), ErrorKind::kInvalidArgument, "key: Hq = ", p.Hq(),
        " must equal Hkv = ", p.Hkv(), " (or be a multiple of it with enable_gqa)");
  check(o.feature_map == "elu" || o.feature_map == "favor+", ErrorKind::kInvalidArgument,
        "feature_map: expected 'elu' or 'favor+', got '", o.feature_map, "'");
  p.favor = o.feature_map == "favor+";
  check(!p.causal() || p.Lq() == p.Lk(), ErrorKind::kInvalidArgument,
        "causal: linear attention needs Lq == Lk, got Lq = ", p.Lq(), ", Lk = ", p.Lk());
  check(o.num_features >= 0, ErrorKind::kInvalidArgument, "num_features: expected >= 0, got ", o.num_features);
  const int64_t D = p.D();
  if (p.favor) {
    p.F = o.num_features > 0 ? o.num_features
                             : std::max<int64_t>(1, int64_t(std::floor(double(D) * std::log(double(D)))));
    const Tensor w = favor_projection(D, p.F, o.seed);
    p.omega.assign(w.data<double>(), w.data<double>() + w.numel());
    p.omega_t.resize(p.omega.size());
    for (int64_t r = 0; r < p.F; ++r)
      for (int64_t d = 0; d < D; ++d) p.omega_t[size_t(d * p.F + r)] = p.omega[size_t(r * D + d)];
  } else {
    p.F = D;
  }
  p.threads = resolve_num_threads(o.num_threads);
  return p;
}

// fp32 matrix products on the sparse engine's tile operations (sparse/tiles.hpp); sums over many rows are cut into
// slabs whose fp32 partial products are added into float64 totals (fp64 only where long sums need it).
constexpr int64_t kSlab = 256;

// tot[n x d] (float64) += Aᵀ X over rows [0, m): A [m x n], X [m x d] (row strides n and d).
void atx_accumulate(const float* a, int64_t m, int64_t n, const float* x, int64_t d, std::vector<float>& tmp,
                    double* tot) {
  tmp.resize(size_t(n * d));
  for (int64_t r0 = 0; r0 < m; r0 += kSlab) {
    const int64_t rows = std::min(kSlab, m - r0);
    std::fill(tmp.begin(), tmp.end(), 0.0f);
    tiles::atx(a + r0 * n, rows, n, x + r0 * d, d, d, 1.0f, tmp.data());
    for (int64_t e = 0; e < n * d; ++e) tot[e] += tmp[size_t(e)];
  }
}

// Column sums of A [m x n] into tot[n] (float64).
void colsum_accumulate(const float* a, int64_t m, int64_t n, double* tot) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r) tot[r] += a[i * n + r];
}

// Feature rows φ [L, F] of x [L, D] (fp32). key_mode: one stabiliser for all rows (keys) instead of one per row.
void features(const Problem& p, const float* x, int64_t L, bool key_mode, std::vector<float>& f) {
  const int64_t D = p.D(), F = p.F;
  f.resize(static_cast<size_t>(L * F));
  if (!p.favor) {
    for (int64_t e = 0; e < L * D; ++e) f[size_t(e)] = x[e] > 0 ? x[e] + 1.0f : std::exp(x[e]);
    return;
  }
  const float s = float(std::pow(double(D), -0.25));
  const double norm_log = -0.5 * std::log(double(F));  // m^-1/2 folded into the exponent
  // Projections ω x̃ [L, F] = (s·x)·ωᵀ.
  tiles::qk(x, L, D, p.omega_t.data(), F, F, s, f.data());
  std::vector<double> half(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    double sq = 0;
    for (int64_t d = 0; d < D; ++d) sq += double(x[i * D + d]) * x[i * D + d];
    half[size_t(i)] = sq * double(s) * double(s) / 2;
  }
  float gmax = -std::numeric_limits<float>::infinity();
  if (key_mode)
    for (int64_t e = 0; e < L * F; ++e) gmax = std::max(gmax, f[size_t(e)]);
  for (int64_t i = 0; i < L; ++i) {
    float* fi = &f[size_t(i * F)];
    float c = gmax;
    if (!key_mode) c = *std::max_element(fi, fi + F);
    const float off = float(-half[size_t(i)] + norm_log);
    for (int64_t r = 0; r < F; ++r) fi[r] = std::exp(fi[r] - c + off);
  }
}

// dx [L, D] from dφ [L, F] (the stabilisers are constants: the ratio does not depend on them).
void features_backward(const Problem& p, const float* x, const float* f, std::vector<float>& df, int64_t L,
                       std::vector<float>& dx) {
  const int64_t D = p.D(), F = p.F;
  dx.assign(static_cast<size_t>(L * D), 0.0f);
  if (!p.favor) {
    for (int64_t e = 0; e < L * D; ++e) dx[size_t(e)] = df[size_t(e)] * (x[e] > 0 ? 1.0f : f[e]);
    return;
  }
  // φ_r = m^-1/2 exp(ω_r·x̃ - |x̃|²/2 - c): dx̃ = Σ_r t_r (ω_r - x̃), t = dφ ⊙ φ; dx = dx̃ · D^-1/4.
  const float s = float(std::pow(double(D), -0.25));
  std::vector<float> tsum(static_cast<size_t>(L));
  for (int64_t i = 0; i < L; ++i) {
    double ts = 0;
    for (int64_t r = 0; r < F; ++r) {
      df[size_t(i * F + r)] *= f[i * F + r];
      ts += df[size_t(i * F + r)];
    }
    tsum[size_t(i)] = float(ts);
  }
  tiles::pv(df.data(), L, F, p.omega.data(), D, D, s, dx.data());  // s · T·ω
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < D; ++d) dx[size_t(i * D + d)] -= tsum[size_t(i)] * x[i * D + d] * s * s;
}

// Per-thread buffers of one head.
struct Work {
  std::vector<float> qx, kx, vx, gx, fq, fk, out, G, dfq, dfk, dv, dx, tmp, st, kt, a, e, s32, r32t;
  std::vector<double> n, hh, S, z, R, rr;
};

// Lower-triangular causal mask inside a chunk: a[i][j] = 0 for j > i (i, j local).
void causal_zero(float* a, int64_t m) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = i + 1; j < m; ++j) a[i * m + j] = 0.0f;
}

// Forward for one (b, h): w.out [Lq, Dv] (normalised) and the denominators w.n [Lq]; w.fq, w.fk, w.vx given.
void forward_head(const Problem& p, Work& w) {
  const int64_t F = p.F, Dv = p.Dv(), Lq = p.Lq();
  w.out.assign(size_t(Lq * Dv), 0.0f);
  w.n.assign(size_t(Lq), 0.0);
  w.S.assign(size_t(F * Dv), 0.0);
  w.z.assign(size_t(F), 0.0);
  w.s32.assign(size_t(F * Dv), 0.0f);
  auto refresh = [&] {
    for (int64_t e = 0; e < F * Dv; ++e) w.s32[size_t(e)] = float(w.S[size_t(e)]);
  };
  auto read = [&](int64_t i0, int64_t i1) {  // rows [i0, i1) += φq·S, n += φq·z
    tiles::pv(&w.fq[size_t(i0 * F)], i1 - i0, F, w.s32.data(), Dv, Dv, 1.0f, &w.out[size_t(i0 * Dv)]);
    for (int64_t i = i0; i < i1; ++i) {
      double t = 0;
      for (int64_t r = 0; r < F; ++r) t += double(w.fq[size_t(i * F + r)]) * w.z[size_t(r)];
      w.n[size_t(i)] += t;
    }
  };
  if (!p.causal()) {
    atx_accumulate(w.fk.data(), p.Lk(), F, w.vx.data(), Dv, w.tmp, w.S.data());
    colsum_accumulate(w.fk.data(), p.Lk(), F, w.z.data());
    refresh();
    read(0, Lq);
  } else {
    w.kt.resize(size_t(F * kChunk));
    w.a.resize(size_t(kChunk * kChunk));
    for (int64_t c0 = 0; c0 < Lq; c0 += kChunk) {
      const int64_t c1 = std::min(Lq, c0 + kChunk), mc = c1 - c0;
      read(c0, c1);  // keys of earlier chunks
      // This chunk, causal inside: A = φQc φKcᵀ (lower triangle), out += A Vc, n += rowsum(A).
      tiles::transpose_rows(&w.fk[size_t(c0 * F)], F, mc, F, w.kt.data(), mc);
      tiles::qk(&w.fq[size_t(c0 * F)], mc, F, w.kt.data(), mc, mc, 1.0f, w.a.data());
      causal_zero(w.a.data(), mc);
      for (int64_t i = 0; i < mc; ++i) {
        double t = 0;
        for (int64_t j = 0; j <= i; ++j) t += w.a[size_t(i * mc + j)];
        w.n[size_t(c0 + i)] += t;
      }
      tiles::pv(w.a.data(), mc, mc, &w.vx[size_t(c0 * Dv)], Dv, Dv, 1.0f, &w.out[size_t(c0 * Dv)]);
      atx_accumulate(&w.fk[size_t(c0 * F)], mc, F, &w.vx[size_t(c0 * Dv)], Dv, w.tmp, w.S.data());
      colsum_accumulate(&w.fk[size_t(c0 * F)], mc, F, w.z.data());
      refresh();
    }
  }
  for (int64_t i = 0; i < Lq; ++i) {
    const float inv = float(1.0 / w.n[size_t(i)]);
    for (int64_t c = 0; c < Dv; ++c) w.out[size_t(i * Dv + c)] *= inv;
  }
}

// Transpose of a float64 [n x d] matrix into float32 [d x n].
void transpose_to_f32(const double* a, int64_t n, int64_t d, std::vector<float>& t) {
  t.resize(size_t(n * d));
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < d; ++c) t[size_t(c * n + r)] = float(a[r * d + c]);
}

// Backward contributions of one query head h: dφq (returned in w.dfq) and, added into w.dfk / w.dv, its part of
// dφk and dv. w.fq, w.fk, w.vx, w.gx given.
void backward_head(const Problem& p, Work& w) {
  const int64_t F = p.F, Dv = p.Dv(), Lq = p.Lq(), Lk = p.Lk();
  forward_head(p, w);
  // G_i = g_i / n_i, hh_i = g_i·out_i / n_i.
  w.G.resize(size_t(Lq * Dv));
  w.hh.assign(size_t(Lq), 0.0);
  for (int64_t i = 0; i < Lq; ++i) {
    const double inv = 1.0 / w.n[size_t(i)];
    double t = 0;
    for (int64_t c = 0; c < Dv; ++c) {
      w.G[size_t(i * Dv + c)] = float(w.gx[size_t(i * Dv + c)] * inv);
      t += double(w.gx[size_t(i * Dv + c)]) * w.out[size_t(i * Dv + c)];
    }
    w.hh[size_t(i)] = t * inv;
  }
  w.dfq.resize(size_t(Lq * F));
  if (!p.causal()) {
    // dφQ = G Sᵀ - hh zᵀ (S, z: totals over all keys, left by forward_head).
    transpose_to_f32(w.S.data(), F, Dv, w.st);
    tiles::qk(w.G.data(), Lq, Dv, w.st.data(), F, F, 1.0f, w.dfq.data());
    for (int64_t i = 0; i < Lq; ++i)
      for (int64_t r = 0; r < F; ++r) w.dfq[size_t(i * F + r)] -= float(w.hh[size_t(i)] * w.z[size_t(r)]);
    // R = φQᵀ G, rr = φQᵀ hh; dφK += V Rᵀ - 1 rrᵀ; dV += φK R.
    w.R.assign(size_t(F * Dv), 0.0);
    w.rr.assign(size_t(F), 0.0);
    atx_accumulate(w.fq.data(), Lq, F, w.G.data(), Dv, w.tmp, w.R.data());
    for (int64_t i = 0; i < Lq; ++i)
      for (int64_t r = 0; r < F; ++r) w.rr[size_t(r)] += double(w.fq[size_t(i * F + r)]) * w.hh[size_t(i)];
    transpose_to_f32(w.R.data(), F, Dv, w.r32t);
    w.tmp.resize(size_t(std::max(Lk * F, F * Dv)));
    tiles::qk(w.vx.data(), Lk, Dv, w.r32t.data(), F, F, 1.0f, w.tmp.data());
    for (int64_t j = 0; j < Lk; ++j)
      for (int64_t r = 0; r < F; ++r) w.dfk[size_t(j * F + r)] += w.tmp[size_t(j * F + r)] - float(w.rr[size_t(r)]);
    std::vector<float> r32(size_t(F * Dv));
    for (int64_t e = 0; e < F * Dv; ++e) r32[size_t(e)] = float(w.R[size_t(e)]);
    tiles::pv(w.fk.data(), Lk, F, r32.data(), Dv, Dv, 1.0f, w.dv.data());
    return;
  }
  // Causal. dφq_i = Σ_{j<=i} φk_j (v_j·G_i - hh_i): prefix states S, z of earlier chunks plus the chunk's own
  // lower triangle E = Gc Vcᵀ - hh 1ᵀ.
  w.kt.resize(size_t(std::max(F, Dv) * kChunk));
  w.a.resize(size_t(kChunk * kChunk));
  w.e.resize(size_t(kChunk * kChunk));
  w.S.assign(size_t(F * Dv), 0.0);
  w.z.assign(size_t(F), 0.0);
  std::vector<float> tile(size_t(kChunk * std::max(F, Dv)));
  for (int64_t c0 = 0; c0 < Lq; c0 += kChunk) {
    const int64_t c1 = std::min(Lq, c0 + kChunk), mc = c1 - c0;
    float* dq = &w.dfq[size_t(c0 * F)];
    transpose_to_f32(w.S.data(), F, Dv, w.st);
    tiles::qk(&w.G[size_t(c0 * Dv)], mc, Dv, w.st.data(), F, F, 1.0f, dq);
    for (int64_t i = 0; i < mc; ++i)
      for (int64_t r = 0; r < F; ++r) dq[i * F + r] -= float(w.hh[size_t(c0 + i)] * w.z[size_t(r)]);
    tiles::transpose_rows(&w.vx[size_t(c0 * Dv)], Dv, mc, Dv, w.kt.data(), mc);
    tiles::qk(&w.G[size_t(c0 * Dv)], mc, Dv, w.kt.data(), mc, mc, 1.0f, w.e.data());
    for (int64_t i = 0; i < mc; ++i)
      for (int64_t j = 0; j <= i; ++j) w.e[size_t(i * mc + j)] -= float(w.hh[size_t(c0 + i)]);
    causal_zero(w.e.data(), mc);
    tiles::pv(w.e.data(), mc, mc, &w.fk[size_t(c0 * F)], F, F, 1.0f, dq);
    atx_accumulate(&w.fk[size_t(c0 * F)], mc, F, &w.vx[size_t(c0 * Dv)], Dv, w.tmp, w.S.data());
    colsum_accumulate(&w.fk[size_t(c0 * F)], mc, F, w.z.data());
  }
  // dφk_j = Σ_{i>=j} φq_i (G_i·v_j - hh_i), dv_j = Σ_{i>=j} (φq_i·φk_j) G_i: suffix states R = Σ φq Gᵀ,
  // rr = Σ φq hh of later chunks plus the chunk's own triangle (Eᵀ φQc and Wᵀ Gc with W = φQc φKcᵀ).
  w.R.assign(size_t(F * Dv), 0.0);
  w.rr.assign(size_t(F), 0.0);
  std::vector<float> r32(size_t(F * Dv));
  const int64_t last = ((Lk - 1) / kChunk) * kChunk;
  for (int64_t c0 = last; c0 >= 0; c0 -= kChunk) {
    const int64_t c1 = std::min(Lk, c0 + kChunk), mc = c1 - c0;
    float* dk = &w.dfk[size_t(c0 * F)];
    float* dvc = &w.dv[size_t(c0 * Dv)];
    transpose_to_f32(w.R.data(), F, Dv, w.r32t);
    for (int64_t e = 0; e < F * Dv; ++e) r32[size_t(e)] = float(w.R[size_t(e)]);
    tiles::qk(&w.vx[size_t(c0 * Dv)], mc, Dv, w.r32t.data(), F, F, 1.0f, tile.data());
    for (int64_t j = 0; j < mc; ++j)
      for (int64_t r = 0; r < F; ++r) dk[j * F + r] += tile[size_t(j * F + r)] - float(w.rr[size_t(r)]);
    tiles::pv(&w.fk[size_t(c0 * F)], mc, F, r32.data(), Dv, Dv, 1.0f, dvc);
    // E (rows i, columns j, lower triangle) as in the dφq sweep.
    tiles::transpose_rows(&w.vx[size_t(c0 * Dv)], Dv, mc, Dv, w.kt.data(), mc);
    tiles::qk(&w.G[size_t(c0 * Dv)], mc, Dv, w.kt.data(), mc, mc, 1.0f, w.e.data());
    for (int64_t i = 0; i < mc; ++i)
      for (int64_t j = 0; j <= i; ++j) w.e[size_t(i * mc + j)] -= float(w.hh[size_t(c0 + i)]);
    causal_zero(w.e.data(), mc);
    tiles::atx(w.e.data(), mc, mc, &w.fq[size_t(c0 * F)], F, F, 1.0f, dk);
    tiles::transpose_rows(&w.fk[size_t(c0 * F)], F, mc, F, w.kt.data(), mc);
    tiles::qk(&w.fq[size_t(c0 * F)], mc, F, w.kt.data(), mc, mc, 1.0f, w.a.data());
    causal_zero(w.a.data(), mc);
    tiles::atx(w.a.data(), mc, mc, &w.G[size_t(c0 * Dv)], Dv, Dv, 1.0f, dvc);
    atx_accumulate(&w.fq[size_t(c0 * F)], mc, F, &w.G[size_t(c0 * Dv)], Dv, w.tmp, w.R.data());
    for (int64_t i = 0; i < mc; ++i)
      for (int64_t r = 0; r < F; ++r) w.rr[size_t(r)] += double(w.fq[size_t((c0 + i) * F + r)]) * w.hh[size_t(c0 + i)];
  }
}
}  // namespace

Tensor favor_projection(int64_t D, int64_t m, uint64_t seed) {
  check(D >= 1 && m >= 1, ErrorKind::kInvalidArgument, "favor_projection: expected D, m >= 1, got ", D, ", ", m);
  Tensor w(DType::kF64, {m, D});
  double* o = w.data<double>();
  uint32_t counter = 0;
  // Standard normals from Philox (Box-Muller), a pure function of (seed, draw index).
  auto gauss = [&]() {
    const auto r = philox4x32_10({counter++, 0xFA7u, 0u, 0u}, {uint32_t(seed), uint32_t(seed >> 32)});
    const double u1 = (double(r[0]) + 1.0) / 4294967297.0, u2 = double(r[1]) / 4294967296.0;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  };
  for (int64_t b0 = 0; b0 < m; b0 += D) {
    // One block: D Gaussian rows orthonormalised (modified Gram-Schmidt), each scaled by an independent χ(D) norm.
    std::vector<double> g(static_cast<size_t>(D * D));
    for (auto& x : g) x = gauss();
    for (int64_t r = 0; r < D; ++r) {
      double* gr = &g[size_t(r * D)];
      for (int64_t s = 0; s < r; ++s) {
        const double* gs = &g[size_t(s * D)];
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += gr[d] * gs[d];
        for (int64_t d = 0; d < D; ++d) gr[d] -= dot * gs[d];
      }
      double nr = 0;
      for (int64_t d = 0; d < D; ++d) nr += gr[d] * gr[d];
      nr = std::sqrt(nr);
      for (int64_t d = 0; d < D; ++d) gr[d] /= nr;
    }
    for (int64_t r = 0; r < D && b0 + r < m; ++r) {
      double chi = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double x = gauss();
        chi += x * x;
      }
      chi = std::sqrt(chi);
      for (int64_t d = 0; d < D; ++d) o[(b0 + r) * D + d] = g[size_t(r * D + d)] * chi;
    }
  }
  return w;
}

void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v, const LinearOptions& o,
                      const TensorView& out) {
  const Problem p = describe(q, k, v, o);
  check(out.data && out.shape == Shape({p.B(), p.Hq(), p.Lq(), p.Dv()}) && is_floating(out.dtype),
        ErrorKind::kInvalidArgument, "out: expected a float tensor of shape ",
        shape_text({p.B(), p.Hq(), p.Lq(), p.Dv()}), ", got ", shape_text(out.shape));
  const int64_t group = p.group();
  parallel_for(p.B() * p.Hq(), p.threads, [&](int64_t bh) {
    const int64_t b = bh / p.Hq(), h = bh % p.Hq(), hk = h / group;
    thread_local Work w;
    rows(q, b, h, w.qx);
    rows(k, b, hk, w.kx);
    rows(v, b, hk, w.vx);
    features(p, w.qx.data(), p.Lq(), false, w.fq);
    features(p, w.kx.data(), p.Lk(), true, w.fk);
    forward_head(p, w);
    store_rows(out, b, h, w.out.data());
  });
}

void linear_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const LinearOptions& o, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv) {
  const Problem p = describe(q, k, v, o);
  check4(dout, "dout", "[B, Hq, Lq, Dv]");
  check(dout.shape == Shape({p.B(), p.Hq(), p.Lq(), p.Dv()}), ErrorKind::kInvalidArgument, "dout: expected shape ",
        shape_text({p.B(), p.Hq(), p.Lq(), p.Dv()}), ", got ", shape_text(dout.shape));
  check(dq.data && dk.data && dv.data && dq.shape == q.shape && dk.shape == k.shape && dv.shape == v.shape,
        ErrorKind::kInvalidArgument, "dq/dk/dv: required, with the shapes of query, key and value");
  const int64_t F = p.F, Dv = p.Dv(), group = p.group();
  // One item per (b, kv head): owns dK/dV of the head and dQ of its query heads.
  parallel_for(p.B() * p.Hkv(), p.threads, [&](int64_t it) {
    const int64_t b = it / p.Hkv(), hk = it % p.Hkv();
    thread_local Work w;
    rows(k, b, hk, w.kx);
    rows(v, b, hk, w.vx);
    features(p, w.kx.data(), p.Lk(), true, w.fk);
    w.dfk.assign(size_t(p.Lk() * F), 0.0f);
    w.dv.assign(size_t(p.Lk() * Dv), 0.0f);
    for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
      rows(q, b, h, w.qx);
      rows(dout, b, h, w.gx);
      features(p, w.qx.data(), p.Lq(), false, w.fq);
      backward_head(p, w);
      features_backward(p, w.qx.data(), w.fq.data(), w.dfq, p.Lq(), w.dx);
      store_rows(dq, b, h, w.dx.data());
    }
    features_backward(p, w.kx.data(), w.fk.data(), w.dfk, p.Lk(), w.dx);
    store_rows(dk, b, hk, w.dx.data());
    store_rows(dv, b, hk, w.dv.data());
  });
}

}  // namespace sattn::sparse
