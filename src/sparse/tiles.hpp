// The inner tile operations of the block-sparse engine (sparse/engine.hpp): a few functions on contiguous fp32
// tiles, the boundary where SIMD micro-kernels plug in. The implementations (src/sparse/tiles_simd.cpp) are
// register-blocked Highway micro-kernels compiled for AVX-512, AVX2+FMA, SSE4 and a portable baseline, chosen at run
// time with every other SIMD component (SATTN_SIMD, sattn::set_simd_target in simd.hpp), so the library runs on any
// x86-64 CPU.
#pragma once

#include <cstdint>

namespace sattn::sparse::tiles {

// S[m x n] (row stride n) = scale * Q[m x d] (row stride d) · Kt[d x n] (row stride ldk; Kt = Kᵀ of the chunk).
void qk(const float* q, int64_t m, int64_t d, const float* kt, int64_t ldk, int64_t n, float scale, float* s);

// Online softmax (FlashAttention): for each row, new max M' = max(M, max_j s_j); the accumulator [m x dv] and the
// running sum are rescaled by exp(M - M'); s is replaced by P = exp(s - M'). Rows whose max stays -inf get P = 0.
void softmax_update(float* s, int64_t m, int64_t n, float* row_max, float* row_sum, float* acc, int64_t dv);

// acc[m x dv] += alpha * P[m x n] · V[n x dv] (V row stride ldv).
void pv(const float* p, int64_t m, int64_t n, const float* v, int64_t ldv, int64_t dv, float alpha, float* acc);

// out[n x d] += alpha * Aᵀ · X, A [m x n], X [m x d] (row stride ldx): dK = scale·dSᵀQ, dV = Pᵀ·dO.
void atx(const float* a, int64_t m, int64_t n, const float* x, int64_t ldx, int64_t d, float alpha, float* out);

// Softmax backward on a tile: dS = P ⊙ (dP - delta_i) (P and dP [m x n], in place into dp).
void softmax_backward(const float* p, float* dp, int64_t m, int64_t n, const float* delta);

// P = exp(S - lse_i) in place for a tile whose rows have a final log-sum-exp (rows with lse = -inf get 0).
void probabilities(float* s, int64_t m, int64_t n, const float* lse);

// The SIMD target of the build of these functions in use ("avx512", "avx2", "sse4" or "portable").
const char* simd_build();

// dst[d x n] (row stride ldd) = src[n rows x d] (row stride lds) transposed.
void transpose_rows(const float* src, int64_t lds, int64_t n, int64_t d, float* dst, int64_t ldd);

}  // namespace sattn::sparse::tiles
