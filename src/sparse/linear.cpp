// Linear attention with elu+1 and FAVOR+ feature maps, non-causal and causal (chunked prefix sums), forward and
// backward (see include/sattn/linear.hpp).
#include "sattn/attention.hpp"
#include "sattn/linear.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/threads.hpp"
#include "sattn/error.hpp"
#include "sattn/random.hpp"

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

// Rows [L, D] of head (b, h) of a 4-D view, as float64.
std::vector<double> rows(const TensorView& t, int64_t b, int64_t h) {
  const int64_t L = t.shape[2], D = t.shape[3];
  std::vector<double> r(static_cast<size_t>(L * D));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < D; ++d)
      r[size_t(i * D + d)] = load(t, b * t.strides[0] + h * t.strides[1] + i * t.strides[2] + d * t.strides[3]);
  return r;
}

void store_rows(const TensorView& t, int64_t b, int64_t h, const std::vector<double>& r) {
  const int64_t L = t.shape[2], D = t.shape[3];
  for (int64_t i = 0; i < L; ++i)
    for (int64_t d = 0; d < D; ++d)
      store(t, b * t.strides[0] + h * t.strides[1] + i * t.strides[2] + d * t.strides[3], r[size_t(i * D + d)]);
}

void check4(const TensorView& t, const char* name, const char* layout) {
  check(t.data != nullptr, ErrorKind::kInvalidArgument, name, ": required");
  check(t.dim() == 4 && t.strides.size() == 4, ErrorKind::kInvalidArgument, name, ": expected a 4-D tensor ", layout,
        ", got shape ", shape_to_string(t.shape));
  check(is_floating(t.dtype), ErrorKind::kTypeError, name, ": expected a float tensor, got ", to_string(t.dtype));
  for (int d = 0; d < 4; ++d)
    check(t.shape[d] > 0 && t.strides[d] >= 0, ErrorKind::kInvalidArgument, name, ": zero-size dimension or negative "
          "stride in shape ", shape_to_string(t.shape));
}

struct Problem {
  int64_t B, Hq, Hkv, Lq, Lk, D, Dv, F, group;
  bool favor, causal;
  int threads;
  std::vector<double> omega;  // [F, D] (favor+)
};

Problem describe(const TensorView& q, const TensorView& k, const TensorView& v, const LinearOptions& o) {
  // q/k/v shapes, dtypes and strides are validated once, by the dense API's boundary.
  const AttentionProblem ap = describe_attention(q, k, v, AttentionOptions{});
  Problem p{};
  p.B = ap.batch;
  p.Hq = ap.heads_q;
  p.Lq = ap.len_q;
  p.D = ap.head_dim;
  p.Hkv = ap.heads_kv;
  p.Lk = ap.len_k;
  p.Dv = ap.head_dim_v;
  check(p.Hq % p.Hkv == 0 && (o.enable_gqa || p.Hq == p.Hkv), ErrorKind::kInvalidArgument, "key: Hq = ", p.Hq,
        " must equal Hkv = ", p.Hkv, " (or be a multiple of it with enable_gqa)");
  p.group = p.Hq / p.Hkv;
  check(o.feature_map == "elu" || o.feature_map == "favor+", ErrorKind::kInvalidArgument,
        "feature_map: expected 'elu' or 'favor+', got '", o.feature_map, "'");
  p.favor = o.feature_map == "favor+";
  p.causal = o.causal;
  check(!p.causal || p.Lq == p.Lk, ErrorKind::kInvalidArgument, "causal: linear attention needs Lq == Lk, got Lq = ",
        p.Lq, ", Lk = ", p.Lk);
  check(o.num_features >= 0, ErrorKind::kInvalidArgument, "num_features: expected >= 0, got ", o.num_features);
  if (p.favor) {
    p.F = o.num_features > 0 ? o.num_features : std::max<int64_t>(1, int64_t(std::floor(double(p.D) * std::log(double(p.D)))));
    const Tensor w = favor_projection(p.D, p.F, o.seed);
    p.omega.assign(w.data<double>(), w.data<double>() + w.numel());
  } else {
    p.F = p.D;
  }
  p.threads = resolve_num_threads(o.num_threads);
  return p;
}

// Feature rows φ [L, F] of x [L, D]. key_mode: one stabiliser for all rows (keys) instead of one per row (queries).
std::vector<double> features(const Problem& p, const std::vector<double>& x, int64_t L, bool key_mode) {
  const int64_t D = p.D, F = p.F;
  std::vector<double> f(static_cast<size_t>(L * F));
  if (!p.favor) {
    for (int64_t x_ = 0; x_ < L * D; ++x_) f[size_t(x_)] = x[size_t(x_)] > 0 ? x[size_t(x_)] + 1.0 : std::exp(x[size_t(x_)]);
    return f;
  }
  const double s = std::pow(double(D), -0.25), norm = 1.0 / std::sqrt(double(F));
  std::vector<double> half(static_cast<size_t>(L));
  double gmax = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < L; ++i) {
    double sq = 0;
    for (int64_t d = 0; d < D; ++d) sq += (x[size_t(i * D + d)] * s) * (x[size_t(i * D + d)] * s);
    half[size_t(i)] = sq / 2;
    for (int64_t r = 0; r < F; ++r) {
      double pr = 0;
      for (int64_t d = 0; d < D; ++d) pr += p.omega[size_t(r * D + d)] * x[size_t(i * D + d)] * s;
      f[size_t(i * F + r)] = pr;
      gmax = std::max(gmax, pr);
    }
  }
  for (int64_t i = 0; i < L; ++i) {
    double c = gmax;
    if (!key_mode) {
      c = -std::numeric_limits<double>::infinity();
      for (int64_t r = 0; r < F; ++r) c = std::max(c, f[size_t(i * F + r)]);
    }
    for (int64_t r = 0; r < F; ++r) f[size_t(i * F + r)] = norm * std::exp(f[size_t(i * F + r)] - half[size_t(i)] - c);
  }
  return f;
}

// dx [L, D] from dφ [L, F] (the stabilisers are constants: the ratio does not depend on them).
std::vector<double> features_backward(const Problem& p, const std::vector<double>& x, const std::vector<double>& f,
                                      const std::vector<double>& df, int64_t L) {
  const int64_t D = p.D, F = p.F;
  std::vector<double> dx(static_cast<size_t>(L * D), 0.0);
  if (!p.favor) {
    for (int64_t x_ = 0; x_ < L * D; ++x_)
      dx[size_t(x_)] = df[size_t(x_)] * (x[size_t(x_)] > 0 ? 1.0 : std::exp(x[size_t(x_)]));
    return dx;
  }
  // φ_r = m^-1/2 exp(ω_r·x̃ - |x̃|²/2 - c): dx̃ = Σ_r t_r (ω_r - x̃), t = dφ ⊙ φ; dx = dx̃ · D^-1/4.
  const double s = std::pow(double(D), -0.25);
  for (int64_t i = 0; i < L; ++i) {
    double tsum = 0;
    for (int64_t r = 0; r < F; ++r) {
      const double t = df[size_t(i * F + r)] * f[size_t(i * F + r)];
      tsum += t;
      for (int64_t d = 0; d < D; ++d) dx[size_t(i * D + d)] += t * p.omega[size_t(r * D + d)];
    }
    for (int64_t d = 0; d < D; ++d) dx[size_t(i * D + d)] = (dx[size_t(i * D + d)] - tsum * x[size_t(i * D + d)] * s) * s;
  }
  return dx;
}

// Forward for one (b, h): out [Lq, Dv] and the denominators n [Lq].
void forward_head(const Problem& p, const std::vector<double>& fq, const std::vector<double>& fk,
                  const std::vector<double>& v, std::vector<double>& out, std::vector<double>& n) {
  const int64_t F = p.F, Dv = p.Dv;
  out.assign(size_t(p.Lq * Dv), 0.0);
  n.assign(size_t(p.Lq), 0.0);
  std::vector<double> S(static_cast<size_t>(F * Dv), 0.0), z(size_t(F), 0.0);
  auto add_state = [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t r = 0; r < F; ++r) {
        const double a = fk[size_t(j * F + r)];
        z[size_t(r)] += a;
        for (int64_t c = 0; c < Dv; ++c) S[size_t(r * Dv + c)] += a * v[size_t(j * Dv + c)];
      }
  };
  auto read_state = [&](int64_t i) {
    for (int64_t r = 0; r < F; ++r) {
      const double a = fq[size_t(i * F + r)];
      n[size_t(i)] += a * z[size_t(r)];
      for (int64_t c = 0; c < Dv; ++c) out[size_t(i * Dv + c)] += a * S[size_t(r * Dv + c)];
    }
  };
  if (!p.causal) {
    add_state(0, p.Lk);
    for (int64_t i = 0; i < p.Lq; ++i) read_state(i);
  } else {
    for (int64_t c0 = 0; c0 < p.Lq; c0 += kChunk) {
      const int64_t c1 = std::min(p.Lq, c0 + kChunk);
      for (int64_t i = c0; i < c1; ++i) {
        read_state(i);  // keys of earlier chunks
        for (int64_t j = c0; j <= i; ++j) {  // this chunk, causal inside
          double w = 0;
          for (int64_t r = 0; r < F; ++r) w += fq[size_t(i * F + r)] * fk[size_t(j * F + r)];
          n[size_t(i)] += w;
          for (int64_t c = 0; c < Dv; ++c) out[size_t(i * Dv + c)] += w * v[size_t(j * Dv + c)];
        }
      }
      add_state(c0, c1);
    }
  }
  for (int64_t i = 0; i < p.Lq; ++i)
    for (int64_t c = 0; c < Dv; ++c) out[size_t(i * Dv + c)] /= n[size_t(i)];
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
  check(out.data && out.shape == Shape({p.B, p.Hq, p.Lq, p.Dv}) && is_floating(out.dtype), ErrorKind::kInvalidArgument,
        "out: expected a float tensor of shape ", shape_to_string({p.B, p.Hq, p.Lq, p.Dv}), ", got ",
        shape_to_string(out.shape));
  parallel_for(p.B * p.Hq, p.threads, [&](int64_t bh) {
    const int64_t b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
    const auto fq = features(p, rows(q, b, h), p.Lq, false);
    const auto fk = features(p, rows(k, b, hk), p.Lk, true);
    std::vector<double> o_, n;
    forward_head(p, fq, fk, rows(v, b, hk), o_, n);
    store_rows(out, b, h, o_);
  });
}

void linear_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const LinearOptions& o, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv) {
  const Problem p = describe(q, k, v, o);
  check4(dout, "dout", "[B, Hq, Lq, Dv]");
  check(dout.shape == Shape({p.B, p.Hq, p.Lq, p.Dv}), ErrorKind::kInvalidArgument, "dout: expected shape ",
        shape_to_string({p.B, p.Hq, p.Lq, p.Dv}), ", got ", shape_to_string(dout.shape));
  check(dq.data && dk.data && dv.data && dq.shape == q.shape && dk.shape == k.shape && dv.shape == v.shape,
        ErrorKind::kInvalidArgument, "dq/dk/dv: required, with the shapes of query, key and value");
  const int64_t F = p.F, Dv = p.Dv;
  // One item per (b, kv head): owns dK/dV of the head and dQ of its query heads.
  parallel_for(p.B * p.Hkv, p.threads, [&](int64_t it) {
    const int64_t b = it / p.Hkv, hk = it % p.Hkv;
    const auto kx = rows(k, b, hk), vv = rows(v, b, hk);
    const auto fk = features(p, kx, p.Lk, true);
    std::vector<double> dfk(static_cast<size_t>(p.Lk * F), 0.0), dvv(size_t(p.Lk * Dv), 0.0);
    for (int64_t h = hk * p.group; h < (hk + 1) * p.group; ++h) {
      const auto qx = rows(q, b, h), g = rows(dout, b, h);
      const auto fq = features(p, qx, p.Lq, false);
      std::vector<double> out, n;
      forward_head(p, fq, fk, vv, out, n);
      // G_i = g_i / n_i, hh_i = g_i·out_i / n_i.
      std::vector<double> G(static_cast<size_t>(p.Lq * Dv)), hh(size_t(p.Lq), 0.0);
      for (int64_t i = 0; i < p.Lq; ++i)
        for (int64_t c = 0; c < Dv; ++c) {
          G[size_t(i * Dv + c)] = g[size_t(i * Dv + c)] / n[size_t(i)];
          hh[size_t(i)] += g[size_t(i * Dv + c)] * out[size_t(i * Dv + c)] / n[size_t(i)];
        }
      std::vector<double> dfq(static_cast<size_t>(p.Lq * F), 0.0);
      // dφq_i = Σ_{j allowed} φk_j (v_j·G_i - hh_i): prefix states S = Σ φk vᵀ, z = Σ φk (+ intra-chunk terms).
      {
        std::vector<double> S(static_cast<size_t>(F * Dv), 0.0), z(size_t(F), 0.0);
        auto add = [&](int64_t j0, int64_t j1) {
          for (int64_t j = j0; j < j1; ++j)
            for (int64_t r = 0; r < F; ++r) {
              z[size_t(r)] += fk[size_t(j * F + r)];
              for (int64_t c = 0; c < Dv; ++c) S[size_t(r * Dv + c)] += fk[size_t(j * F + r)] * vv[size_t(j * Dv + c)];
            }
        };
        auto read = [&](int64_t i) {
          for (int64_t r = 0; r < F; ++r) {
            double a = -z[size_t(r)] * hh[size_t(i)];
            for (int64_t c = 0; c < Dv; ++c) a += S[size_t(r * Dv + c)] * G[size_t(i * Dv + c)];
            dfq[size_t(i * F + r)] += a;
          }
        };
        if (!p.causal) {
          add(0, p.Lk);
          for (int64_t i = 0; i < p.Lq; ++i) read(i);
        } else {
          for (int64_t c0 = 0; c0 < p.Lq; c0 += kChunk) {
            const int64_t c1 = std::min(p.Lq, c0 + kChunk);
            for (int64_t i = c0; i < c1; ++i) {
              read(i);
              for (int64_t j = c0; j <= i; ++j) {
                double e = -hh[size_t(i)];
                for (int64_t c = 0; c < Dv; ++c) e += vv[size_t(j * Dv + c)] * G[size_t(i * Dv + c)];
                for (int64_t r = 0; r < F; ++r) dfq[size_t(i * F + r)] += e * fk[size_t(j * F + r)];
              }
            }
            add(c0, c1);
          }
        }
      }
      // dφk_j = Σ_{i: j allowed} φq_i (G_i·v_j - hh_i), dv_j = Σ (φq_i·φk_j) G_i: suffix states R = Σ φq Gᵀ, rr = Σ φq hh.
      {
        std::vector<double> R(static_cast<size_t>(F * Dv), 0.0), rr(size_t(F), 0.0);
        auto add = [&](int64_t i0, int64_t i1) {
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t r = 0; r < F; ++r) {
              rr[size_t(r)] += fq[size_t(i * F + r)] * hh[size_t(i)];
              for (int64_t c = 0; c < Dv; ++c) R[size_t(r * Dv + c)] += fq[size_t(i * F + r)] * G[size_t(i * Dv + c)];
            }
        };
        auto read = [&](int64_t j) {
          for (int64_t r = 0; r < F; ++r) {
            double a = -rr[size_t(r)];
            for (int64_t c = 0; c < Dv; ++c) {
              a += R[size_t(r * Dv + c)] * vv[size_t(j * Dv + c)];
              dvv[size_t(j * Dv + c)] += R[size_t(r * Dv + c)] * fk[size_t(j * F + r)];
            }
            dfk[size_t(j * F + r)] += a;
          }
        };
        if (!p.causal) {
          add(0, p.Lq);
          for (int64_t j = 0; j < p.Lk; ++j) read(j);
        } else {
          const int64_t last = ((p.Lk - 1) / kChunk) * kChunk;
          for (int64_t c0 = last; c0 >= 0; c0 -= kChunk) {
            const int64_t c1 = std::min(p.Lk, c0 + kChunk);
            for (int64_t j = c0; j < c1; ++j) {
              read(j);  // queries of later chunks
              for (int64_t i = j; i < c1; ++i) {
                double e = -hh[size_t(i)], w = 0;
                for (int64_t c = 0; c < Dv; ++c) e += vv[size_t(j * Dv + c)] * G[size_t(i * Dv + c)];
                for (int64_t r = 0; r < F; ++r) {
                  dfk[size_t(j * F + r)] += e * fq[size_t(i * F + r)];
                  w += fq[size_t(i * F + r)] * fk[size_t(j * F + r)];
                }
                for (int64_t c = 0; c < Dv; ++c) dvv[size_t(j * Dv + c)] += w * G[size_t(i * Dv + c)];
              }
            }
            add(c0, c1);
          }
        }
      }
      store_rows(dq, b, h, features_backward(p, qx, fq, dfq, p.Lq));
    }
    store_rows(dk, b, hk, features_backward(p, kx, fk, dfk, p.Lk));
    store_rows(dv, b, hk, dvv);
  });
}

}  // namespace sattn::sparse
