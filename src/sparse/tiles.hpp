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

// ---- bf16 products (vdpbf16ps: the avx512bf16 build; the amx build: kq_pairs and pv_pairs on AMX tiles) ---------
// For bf16 inputs whose output is bf16 as well: S from bf16 pairs with float32 sums, P rounded to bf16 once for P·V
// (FlashAttention's convention, as the fused kernel's). Operands hold bf16 values exactly in float32, packed as
// 32-bit words of two bf16 along the summed dimension. Only where has_bf16_products() is true.
bool has_bf16_products();

// S^T [n x m] (row stride lds) = scale * K2 · Q2^T: K2 [n x d2] words (row stride d2: pairs along D), Q2T [d2 x m]
// words (row stride ldq; each row readable to m rounded up to 16 words).
void kq_pairs(const uint32_t* k2, int64_t n, int64_t d2, const uint32_t* q2t, int64_t ldq, int64_t m, float scale,
              float* st, int64_t lds);

// acc [m x dv] (row stride dv) += P · V: P [m x n] floats (row stride n), rounded to bf16 here into p2 (m rows of
// ⌈n/2⌉ words, pack_pairs_along_rows); V2 [⌈n/2⌉ x dv] words from pack_pairs_across_rows (row stride ldv, readable to
// dv rounded up to 16 words).
void pv_pairs(const float* p, int64_t m, int64_t n, const uint32_t* v2, int64_t ldv, int64_t dv, uint32_t* p2,
              float* acc);

// Rows [n x width] of floats (row stride lds) rounded to bf16 as pairs along the row: out[r·ldo + y] = (x[r, 2y],
// x[r, 2y+1]) for y < ⌈width/2⌉ (ldo >= that; an odd width's last word ends in 0).
void pack_pairs_along_rows(const float* rows, int64_t lds, int64_t n, int64_t width, uint32_t* out, int64_t ldo);

// Rows [n x width] of floats (row stride lds) rounded to bf16 as words of two rows: out[y·ldo + x] =
// (rows[2y][x], rows[2y+1][x]), the second half 0 past row n; ldo a multiple of 16 >= width, words past width 0.
void pack_pairs_across_rows(const float* rows, int64_t lds, int64_t n, int64_t width, uint32_t* out, int64_t ldo);

// out [n x d] (row stride ldo) += alpha * Aᵀ · X (dV = Pᵀ·dO, dK = scale·dSᵀ·Q on bf16 pairs): A [m x n] floats (row
// stride n), rounded to bf16 here into a2 (⌈m/2⌉ rows of n rounded up to 16 words, pairs across A's rows); X2
// [⌈m/2⌉ x ldx] words from pack_pairs_across_rows of X's m rows (ldx >= d rounded up to 16).
void atx_pairs(const float* a, int64_t m, int64_t n, const uint32_t* x2, int64_t ldx, int64_t d, float alpha,
               uint32_t* a2, float* out, int64_t ldo);

// The SIMD target of the build of these functions in use ("avx512bf16", "avx512", "avx2", "sse4" or "portable").
const char* simd_build();

// dst[d x n] (row stride ldd) = src[n rows x d] (row stride lds) transposed.
void transpose_rows(const float* src, int64_t lds, int64_t n, int64_t d, float* dst, int64_t ldd);

}  // namespace sattn::sparse::tiles
