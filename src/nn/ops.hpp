// Generic float32 building blocks for channels-last (HWC / [tokens, C]) inference: small GEMM, linear,
// 3x3 convolution (dense and depthwise) without im2col, layer norm, exact GELU. Internal header.
//
// Weight layouts are "input-major" (re-laid out once from PyTorch's [out, in, ...]): the innermost loops run
// over output channels, contiguous in memory, so they vectorise.
#pragma once

#include <cstdint>
#include <vector>

namespace sattn::nn {

// C[m, :] += A[m, :] · W for m < M: A [M, K] (row stride lda), W [K, N] row-major, C [M, N] (row stride ldc).
void gemm_acc(const float* A, int64_t lda, int64_t M, int64_t K, const float* W, int64_t N, float* C,
              int64_t ldc);

// y[m, :] = bias + x[m, :] · W; x [M, K] contiguous, W [K, N] (= PyTorch weight [N, K] transposed), y [M, N].
// Rows split across `threads` in fixed blocks (bitwise identical for any thread count).
void linear(const float* x, int64_t M, int64_t K, const float* W, const float* bias, int64_t N, float* y,
            int threads);

// 3x3 convolution, padding 1 (zeros), stride 1, HWC: in [H, W, Cin], W9 [9 taps (ky*3+kx)][Cin][Cout],
// bias [Cout] (may be null), out [H, W, Cout] (overwritten). PyTorch Conv2d semantics (cross-correlation).
void conv3x3_hwc(const float* in, int64_t H, int64_t W, int64_t Cin, const float* W9, const float* bias,
                 int64_t Cout, float* out, int threads);

// Depthwise 3x3 (groups = C), padding 1: in/out [H, W, C], Wd [9][C], bias [C]. out must not alias in.
void depthwise3x3_hwc(const float* in, int64_t H, int64_t W, int64_t C, const float* Wd, const float* bias,
                      float* out, int threads);

// Layer norm over the last dim (biased variance, eps inside the sqrt), affine: x, y [M, C] (may alias).
void layer_norm(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps, float* y);

// GELU 0.5 x (1 + erf(x / sqrt 2)) (the exact, erf form), in place; erf by a float32 rational approximation
// within 4.2e-7 of the true erf (PyTorch's erff is within ~1e-7).
void gelu_inplace(float* x, int64_t n);

// Re-layouts: PyTorch conv weight [Cout, Cin, 3, 3] -> [9][Cin][Cout]; depthwise [C, 1, 3, 3] -> [9][C];
// linear / 1x1 conv [N, K(,1,1)] -> [K][N].
std::vector<float> conv3x3_weight_hwc(const float* w, int64_t Cout, int64_t Cin);
std::vector<float> depthwise_weight_hwc(const float* w, int64_t C);
std::vector<float> transpose_weight(const float* w, int64_t N, int64_t K);

}  // namespace sattn::nn
