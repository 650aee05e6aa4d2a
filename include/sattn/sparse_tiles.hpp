// The inner tile operations of the block-sparse engine (sparse_engine.hpp): a few functions on contiguous fp32
// tiles, the boundary where SIMD micro-kernels plug in. The implementations (src/sparse/tiles_simd.cpp) are
// register-blocked Highway micro-kernels compiled for AVX-512, AVX2+FMA and a portable baseline, chosen at run time
// (SATTN_SPARSE_ISA=avx2 or base caps the choice), so the library runs on any x86-64 CPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

// "avx512", "avx2+fma" or "base": the build of these functions in use.
const char* isa();

// The builds this CPU can run, widest first (the last is "base").
std::vector<std::string> available_isas();

// Switches to the build named (as listed by available_isas; "avx2" names "avx2+fma") for tests and benchmarks;
// false (and no change) if this CPU cannot run it. Not to be called while tile operations run on other threads.
bool set_isa(const std::string& name);

// dst[d x n] (row stride ldd) = src[n rows x d] (row stride lds) transposed.
void transpose_rows(const float* src, int64_t lds, int64_t n, int64_t d, float* dst, int64_t ldd);

}  // namespace sattn::sparse::tiles
