// Generic float32 building blocks for channels-last (HWC / [tokens, C]) inference: small GEMM, linear,
// 3x3 convolution (dense and depthwise) without im2col, layer norm, exact GELU. Internal header.
//
// Weight layouts are "input-major" (re-laid out once from PyTorch's [out, in, ...]): the innermost loops run
// over output channels, contiguous in memory, so they vectorise.
#pragma once

#include <cstdint>
#include <vector>

#include "core/workspace.hpp"

namespace sattn::nn {

// Float scratch that grows and never shrinks, contents unspecified after a grow; large buffers are 2 MiB-aligned
// with transparent huge pages requested (first touch of a multi-MB map otherwise costs one page fault per 4 KiB).
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  float* get(int64_t n);  // room for n floats
  float* data() const { return p_; }

 private:
  float* p_ = nullptr;
  int64_t cap_ = 0;
};

// The SIMD target of the build of these kernels in use (simd/target.hpp).
const char* simd_build();

// Row stride of the re-laid-out weights below ([K][padded_cols(N)], zeros past N): whole SIMD vectors of a
// weight row can be loaded without masks.
inline int64_t padded_cols(int64_t n) { return (n + 15) / 16 * 16; }

// bf16 products. The functions below that take `W2`, the bf16 pairs of their weight (weight_pairs; a weight of
// padded_cols(N) columns), multiply on bf16 operands with float32 sums when it is given and the SIMD target in use
// has bf16 products (has_bf16_products: vdpbf16ps on the avx512bf16 target, the AMX tiles on amx): the inputs are
// rounded to bf16 (nearest even, denormals to zero), each output element is one chain of pair products (amx: of tile
// products) in a fixed order, so results still do not depend on row batching or thread count. Otherwise (no W2, no
// bf16 products, an odd K) they use the float32 weight: bitwise the float32 results.
bool has_bf16_products();
// Whether a product with weight pairs W2 (may be null) summing K values runs on them: W2 given, K even,
// has_bf16_products(). The functions below taking W2 decide by it.
inline bool pairs_run(const uint32_t* W2, int64_t K) { return W2 && K % 2 == 0 && has_bf16_products(); }
// [K][padded_cols(N)] floats (K even) -> [K/2][padded_cols(N)] words: word (k2, n) holds W[2 k2][n] (low 16 bits)
// and W[2 k2 + 1][n] (high), rounded to bf16 (nearest even); empty when K is odd. In workspace memory (64-byte
// aligned): every row (padded_cols(N) words, a whole number of cache lines) starts a line, as the AMX tiles load
// rows fastest (a tile row split across two lines loads slower).
WorkspaceVector<uint32_t> weight_pairs(const std::vector<float>& w, int64_t N);
// x rounded to bf16 (nearest even, denormals to zero) into out[n]; out is 4-byte aligned with room for n rounded
// up to even (an odd n's pad half is written 0). Needs has_bf16_products().
void round_to_bf16(const float* x, int64_t n, uint16_t* out);
// gelu_inplace's values, and layer_norm's rows [M, C], rounded to bf16 into out / y as round_to_bf16 rounds them
// (bitwise), without the float32 values in memory: the A operand of a GEMM on the bf16 products. gelu_to_bf16 writes
// an odd n's pad half 0. Need has_bf16_products().
void gelu_to_bf16(const float* x, int64_t n, uint16_t* out);
void layer_norm_to_bf16(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps,
                        uint16_t* y);
// gemm_acc_segments on bf16 rows A_s (row stride lda, even; K[s] even) and W2 [sum K / 2][ldw >= padded_cols(N)]
// words. With `init` (a row of N floats), every row of C starts from it instead of from C (C only written): the
// same bits as C set to init rows first. Needs has_bf16_products().
void gemm_acc_segments_pairs(int nseg, const uint16_t* const* A, const int64_t* K, int64_t lda, int64_t M,
                             const uint32_t* W2, int64_t ldw, int64_t N, float* C, int64_t ldc,
                             const float* init = nullptr);

// C[m, :] += A[m, :] · W for m < M: A [M, K] (row stride lda), W [K, N] (row stride ldw >= N), C [M, N] (row
// stride ldc). Fastest with ldw >= padded_cols(N) (readable padding).
void gemm_acc(const float* A, int64_t lda, int64_t M, int64_t K, const float* W, int64_t ldw, int64_t N, float* C,
              int64_t ldc, const uint32_t* W2 = nullptr);

// C[m, :] += sum_s A_s[m, :K[s]] · W_s for m < M, W = [W_0; W_1; ...] stacked ([sum K, N] row-major), A_s row
// stride lda (rows may overlap), W row stride ldw >= N, C row stride ldc; nseg <= 16. Each C element is one FMA
// chain in a fixed order (segments, then k ascending) whatever its position: results do not depend on how rows
// are batched.
void gemm_acc_segments(int nseg, const float* const* A, const int64_t* K, int64_t lda, int64_t M, const float* W,
                       int64_t ldw, int64_t N, float* C, int64_t ldc);

// y[m, :] = bias + x[m, :] · W; x [M, K] contiguous, W [K][padded_cols(N)] (transpose_weight), y [M, N].
// Rows split across `threads` in fixed blocks (bitwise identical for any thread count).
void linear(const float* x, int64_t M, int64_t K, const float* W, const float* bias, int64_t N, float* y, int threads,
            const uint32_t* W2 = nullptr);
// linear on x already rounded to bf16 ([M, K] bf16, K even) with the weight's bf16 pairs W2 (weight_pairs): what
// the linear above computes from the float32 x with W2, bitwise. Needs has_bf16_products().
void linear(const uint16_t* x, int64_t M, int64_t K, const float* bias, int64_t N, float* y, int threads,
            const uint32_t* W2);
// y = linear(layer_norm(x)) on one thread: x [M, C], the LayerNorm's rows written straight in bf16 where W2's
// products run (pairs_run; layer_norm_to_bf16), else in float32; bitwise layer_norm then linear.
void layer_norm_linear(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps,
                       const float* W, const float* bias, int64_t N, float* y, const uint32_t* W2 = nullptr);
// C[m, :] += gelu(h[m, :]) · W for m < M: h [M, K] (gelu_inplace'd where W2's products do not run, else read only
// and its GELU written straight in bf16, gelu_to_bf16), W [K][padded_cols(N)]; bitwise gelu_inplace then gemm_acc.
void gelu_gemm_acc(float* h, int64_t M, int64_t K, const float* W, int64_t N, float* C, int64_t ldc,
                   const uint32_t* W2 = nullptr);

// 3x3 convolution, padding 1 (zeros), stride 1, HWC: in [H, W, Cin], W9 [9 taps (ky*3+kx)][Cin][padded_cols(Cout)]
// (conv3x3_weight_hwc), bias [Cout] (may be null), out [H, W, Cout] (overwritten; may be in itself when
// Cout == Cin, never partly overlap it). PyTorch Conv2d semantics (cross-correlation). With `add` [H, W, Cout]
// (not overlapping out), out = conv(in) + bias, then + add: the residual in the same pass over each row.
void conv3x3_hwc(const float* in, int64_t H, int64_t W, int64_t Cin, const float* W9, const float* bias, int64_t Cout,
                 float* out, int threads, const float* add = nullptr, const uint32_t* W2 = nullptr);

// Depthwise 3x3 (groups = C), padding 1: in/out [H, W, C], Wd [9][C], bias [C]; out may be in (in place).
void depthwise3x3_hwc(const float* in, int64_t H, int64_t W, int64_t C, const float* Wd, const float* bias, float* out,
                      int threads);

// out = res + pw_b + act(depthwise3x3(in) + dw_b) · PW per pixel (act = GELU when `gelu`, else identity):
// in/res/out [H, W, C], Wd [9][C], PW [C][padded_cols(C)] (transpose_weight); out may alias in and res.
void dw_act_pw_hwc(const float* in, int64_t H, int64_t W, int64_t C, const float* Wd, const float* dw_b, bool gelu,
                   const float* PW, const float* pw_b, const float* res, float* out, int threads,
                   const uint32_t* PW2 = nullptr);

// One output row of a depthwise 3x3 from three zero-padded input rows [W+2, C] (above, centre, below; anywhere in
// memory) into out [W, C]; Wt [10][period]: the 9 taps' weights then the bias, each tiled to `period` (a multiple
// of C and of 16).
void depthwise_row_3(const float* above, const float* centre, const float* below, int64_t W, int64_t C, const float* Wt,
                     int64_t period, float* out);

// Layer norm over the last dim (biased variance, eps inside the sqrt), affine: x, y [M, C] (may alias).
void layer_norm(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps, float* y);

// GELU 0.5 x (1 + erf(x / sqrt 2)) (the exact, erf form), in place; erf by a float32 rational approximation
// within 4.2e-7 of the true erf (PyTorch's erff is within ~1e-7).
void gelu_inplace(float* x, int64_t n);

// Per-channel sums over the pixels of p [count, C], in pixel order: acc[c] += sum_t p[t, c], and
// acc[c] += sum_t (p[t, c] - mean[c])^2 (the SR router's window mean and variance).
void add_rows(const float* p, int64_t count, int64_t C, float* acc);
void add_squared_deviations(const float* p, int64_t count, int64_t C, const float* mean, float* acc);

// Three float planes (R, G, B rows of n values) -> interleaved uint8 RGB [n, 3]: floor(255 clamp(v, 0, 1) + 0.5)
// exactly (NaN -> 0), the rounding of sr::tensor_to_image.
void planar_to_u8_rgb(const float* r, const float* g, const float* b, int64_t n, uint8_t* out);

// Re-layouts: PyTorch conv weight [Cout, Cin, 3, 3] -> [9][Cin][padded_cols(Cout)]; depthwise [C, 1, 3, 3] ->
// [9][C]; linear / 1x1 conv [N, K(,1,1)] -> [K][padded_cols(N)] (the layouts linear / conv3x3_hwc /
// dw_act_pw_hwc take).
std::vector<float> conv3x3_weight_hwc(const float* w, int64_t Cout, int64_t Cin);
std::vector<float> depthwise_weight_hwc(const float* w, int64_t C);
std::vector<float> transpose_weight(const float* w, int64_t N, int64_t K);

}  // namespace sattn::nn
