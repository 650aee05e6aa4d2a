// Sparse attention: a Pattern (patterns.hpp) run by the library's block-sparse engine — only the tiles the
// pattern's block mask lists are computed; forward and backward.
//
// Shapes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (any strides; f32, f64, bf16, f16; computed in
// fp32), out [B, Hq, Lq, Dv], lse [B, Hq, Lq]. Query head h reads kv head h / (Hq / Hkv).
// Key padding (bool [B, Lk], True = padding, or lengths [B]) is intersected with the pattern.
// A row with no allowed key has out = 0, lse = -inf and zero gradients.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "sattn/patterns.hpp"
#include "sattn/problem.hpp"  // Float32Precision
#include "sattn/tensor.hpp"

namespace sattn::sparse {

// Options common to every sparse entry.
struct EngineOptions {
  std::optional<double> scale;  // default 1/sqrt(D)
  TensorView key_padding_mask;  // bool [B, Lk], True = padding
  TensorView key_lengths;       // int32/int64 [B]: keys j >= key_lengths[b] are padding
  int num_threads = 0;          // 0 = SATTN_NUM_THREADS or the hardware's
  // kBF16: the forward and the backward may take the bf16 products (vdpbf16ps: q, k, v and dout rounded to bf16,
  // P and dS rounded once) for float32 inputs too, where the CPU has them, as bf16 inputs with a bf16 out (forward)
  // or bf16 gradients (backward) always do; score mods with parameters keep the backward on float32 products.
  // kHigh is kHighest here. docs/sparse.md.
  Float32Precision float32_precision = Float32Precision::kHighest;
};

// Score modifications of the pattern API, applied to s = scale * q·k in this order:
//   s = softcap > 0 ? softcap * tanh(s / softcap) : s
//   s += -alibi_slopes[h] * |a - j|          (a = i + Lk - Lq, the aligned query position)
//   s += bias[h or 0, i, j]                  (additive bias table; gradient in SparseGrads::dbias)
//   s += rel_pos_bias[(dr + w - 1)(2w - 1) + (dc + w - 1), h]   (WindowAttention2D only; d = query - key
//        coordinates; pairs farther apart than the window get no bias; gradient in SparseGrads::drel_pos_bias)
struct SparseOptions : EngineOptions {
  bool enable_gqa = true;           // false: Hq must equal Hkv (PyTorch's default)
  int64_t block = 64;               // query block / key range size of the pattern's block mask
  std::vector<float> alibi_slopes;  // empty, or one slope per query head
  double softcap = 0.0;             // 0 = off
  TensorView bias;                  // float32/float64 [Lq, Lk] or [Hb, Lq, Lk], Hb in {1, Hq}
  TensorView rel_pos_bias;          // float32/float64 [(2w-1)^2, Hq] (w = the WindowAttention2D window)
};

struct SparseGrads {
  TensorView dq, dk, dv;     // required, shapes of q, k, v
  TensorView dbias;          // optional: shape of options.bias (float32/float64)
  TensorView drel_pos_bias;  // optional: shape of options.rel_pos_bias
  TensorView dlogits;        // optional, MixedAttention: float [2], the gradient of its logits
};

// Geometric ALiBi slopes for `heads` heads: 2^(-8 (h + 1) / heads) (Press et al., for a power-of-two count).
std::vector<float> alibi_slopes(int64_t heads);

// indices (optional, int64; content-adaptive patterns only): the selection the kernel made —
//   TopK(k): [B, Hq, Lq, k] key indices, ascending, -1 where fewer than k keys are allowed;
//   BlockTopK: [B, Hq, num_query_blocks, k_blocks] key-block indices, ascending, -1 fill.
// For ReLUAttention, lse (if given) receives log of the row normaliser; for MixedAttention, the softmax part's lse.
void sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v, const Pattern& pattern,
                      const SparseOptions& options, const TensorView& out, const TensorView& lse = {},
                      const TensorView& indices = {});

// indices: the forward's selection (TopK/BlockTopK); recomputed from q and k when absent.
void sparse_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& lse, const Pattern& pattern,
                               const SparseOptions& options, const SparseGrads& grads, const TensorView& indices = {});

// Shape of the `indices` output for `pattern` ({} when it selects nothing).
Shape selection_shape(const Pattern& pattern, int64_t batch, int64_t heads_q, int64_t len_q, int64_t len_k);
// Whether `pattern` has parameters with a gradient of their own (MixedAttention's logits -> SparseGrads::dlogits).
bool has_logits(const Pattern& pattern);
// Dense bool mask [B, Hq, Lq, Lk] (True = selected) of a selection returned in `indices`.
Tensor selection_mask(const Pattern& pattern, const TensorView& indices, int64_t len_q, int64_t len_k);

// The same on an explicit block mask (e.g. from block_mask_from_dense); pairs inside partial ranges are
// checked against `dense_mask` (bool [Lq, Lk] or [H, Lq, Lk], True = may attend) when given, else allowed.
void block_sparse_attention(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
                            const TensorView& dense_mask, const SparseOptions& options, const TensorView& out,
                            const TensorView& lse = {});
void block_sparse_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& out, const TensorView& lse,
                                     const BlockMask& mask, const TensorView& dense_mask, const SparseOptions& options,
                                     const SparseGrads& grads);

// FlexAttention's mask_mod as a function: mask_mod(b, h, i, j) is true when query i of (batch b, query head h) may
// attend to key j. It is called only for pairs inside the partial ranges of `mask` (a full range is allowed as a
// whole), from several threads at once; score modifications come from `options` (alibi_slopes, softcap, bias,
// rel_pos_bias).
using MaskFunction = std::function<bool(int64_t b, int64_t h, int64_t i, int64_t j)>;
void flex_attention(const TensorView& q, const TensorView& k, const TensorView& v, const BlockMask& mask,
                    const MaskFunction& mask_mod, const SparseOptions& options, const TensorView& out,
                    const TensorView& lse = {});
void flex_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const BlockMask& mask,
                             const MaskFunction& mask_mod, const SparseOptions& options, const SparseGrads& grads);

}  // namespace sattn::sparse
