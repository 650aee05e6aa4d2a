// The inner tile operations of the block-sparse engine (sparse_engine.hpp), kept in a few small functions on
// contiguous fp32 tiles so that they can be swapped for hand-written SIMD micro-kernels. Plain loops that GCC
// vectorises at -O3 (the innermost loop always runs over a contiguous, unit-stride dimension).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace sattn::sparse::tiles {

// S[m x n] (row stride n) = scale * Q[m x d] (row stride d) · Kt[d x n] (row stride ldk; Kt = Kᵀ of the chunk).
inline void qk(const float* __restrict q, int64_t m, int64_t d, const float* __restrict kt, int64_t ldk, int64_t n,
               float scale, float* __restrict s) {
  int64_t i = 0;
  for (; i + 4 <= m; i += 4) {
    float* s0 = s + i * n;
    float* s1 = s0 + n;
    float* s2 = s1 + n;
    float* s3 = s2 + n;
    for (int64_t j = 0; j < n; ++j) s0[j] = s1[j] = s2[j] = s3[j] = 0.0f;
    for (int64_t c = 0; c < d; ++c) {
      const float a0 = q[(i + 0) * d + c], a1 = q[(i + 1) * d + c], a2 = q[(i + 2) * d + c], a3 = q[(i + 3) * d + c];
      const float* kr = kt + c * ldk;
      for (int64_t j = 0; j < n; ++j) {
        const float kv = kr[j];
        s0[j] += a0 * kv;
        s1[j] += a1 * kv;
        s2[j] += a2 * kv;
        s3[j] += a3 * kv;
      }
    }
  }
  for (; i < m; ++i) {
    float* s0 = s + i * n;
    for (int64_t j = 0; j < n; ++j) s0[j] = 0.0f;
    for (int64_t c = 0; c < d; ++c) {
      const float a0 = q[i * d + c];
      const float* kr = kt + c * ldk;
      for (int64_t j = 0; j < n; ++j) s0[j] += a0 * kr[j];
    }
  }
  if (scale != 1.0f)
    for (int64_t x = 0; x < m * n; ++x) s[x] *= scale;
}

// Online softmax (FlashAttention): for each row, new max M' = max(M, max_j s_j); the accumulator and the running
// sum are rescaled by exp(M - M'); s is replaced by P = exp(s - M'). Rows whose max stays -inf get P = 0.
inline void softmax_update(float* __restrict s, int64_t m, int64_t n, float* __restrict row_max,
                           float* __restrict row_sum, float* __restrict acc, int64_t dv) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * n;
    float mx = row_max[i];
    for (int64_t j = 0; j < n; ++j) mx = si[j] > mx ? si[j] : mx;
    if (mx == kNegInf) {
      for (int64_t j = 0; j < n; ++j) si[j] = 0.0f;
      continue;
    }
    const float alpha = std::exp(row_max[i] - mx);  // 0 when the old max was -inf
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float p = std::exp(si[j] - mx);
      si[j] = p;
      sum += p;
    }
    if (alpha != 1.0f) {
      float* ai = acc + i * dv;
      for (int64_t c = 0; c < dv; ++c) ai[c] *= alpha;
    }
    row_sum[i] = row_sum[i] * alpha + sum;
    row_max[i] = mx;
  }
}

// acc[m x dv] += alpha * P[m x n] · V[n x dv] (V row stride ldv).
inline void pv(const float* __restrict p, int64_t m, int64_t n, const float* __restrict v, int64_t ldv, int64_t dv,
               float alpha, float* __restrict acc) {
  for (int64_t i = 0; i < m; ++i) {
    float* ai = acc + i * dv;
    const float* pi = p + i * n;
    for (int64_t j = 0; j < n; ++j) {
      const float w = alpha * pi[j];
      if (w == 0.0f) continue;
      const float* vj = v + j * ldv;
      for (int64_t c = 0; c < dv; ++c) ai[c] += w * vj[c];
    }
  }
}

// out[n x d] += alpha * Aᵀ · X, A [m x n], X [m x d] (row stride ldx): dK = scale·dSᵀQ, dV = Pᵀ·dO.
inline void atx(const float* __restrict a, int64_t m, int64_t n, const float* __restrict x, int64_t ldx, int64_t d,
                float alpha, float* __restrict out) {
  for (int64_t i = 0; i < m; ++i) {
    const float* ai = a + i * n;
    const float* xi = x + i * ldx;
    for (int64_t j = 0; j < n; ++j) {
      const float w = alpha * ai[j];
      if (w == 0.0f) continue;
      float* oj = out + j * d;
      for (int64_t c = 0; c < d; ++c) oj[c] += w * xi[c];
    }
  }
}

// Softmax backward on a tile: dS = P ⊙ (dP - delta_i) (P and dP [m x n], in place into dp).
inline void softmax_backward(const float* __restrict p, float* __restrict dp, int64_t m, int64_t n,
                             const float* __restrict delta) {
  for (int64_t i = 0; i < m; ++i) {
    const float di = delta[i];
    for (int64_t j = 0; j < n; ++j) dp[i * n + j] = p[i * n + j] * (dp[i * n + j] - di);
  }
}

// P = exp(S - lse_i) for a tile whose rows have a final log-sum-exp (rows with lse = -inf get 0).
inline void probabilities(float* __restrict s, int64_t m, int64_t n, const float* __restrict lse) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * n;
    if (lse[i] == kNegInf) {
      for (int64_t j = 0; j < n; ++j) si[j] = 0.0f;
      continue;
    }
    for (int64_t j = 0; j < n; ++j) si[j] = std::exp(si[j] - lse[i]);
  }
}

// dst[d x n] (row stride ldd) = src[n rows x d] (row stride lds) transposed.
inline void transpose_rows(const float* __restrict src, int64_t lds, int64_t n, int64_t d, float* __restrict dst,
                           int64_t ldd) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t c = 0; c < d; ++c) dst[c * ldd + j] = src[j * lds + c];
}

}  // namespace sattn::sparse::tiles
