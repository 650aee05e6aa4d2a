// AttentionProblem: one plain descriptor of an attention call — shapes, dtypes, masks, options —
// separate from the data pointers. Built (and validated) once at the API boundary by
// describe_attention(); every kernel's supports()/forward()/backward() reads only this and views.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "sattn/tensor.hpp"

namespace sattn {

// Causal masking and how a query row is aligned with the keys when Lq != Lk.
enum class Causal : uint8_t {
  kNone,
  kTopLeft,      // PyTorch's is_causal: key j allowed for query i iff j <= i
  kBottomRight,  // FlashAttention >= 2.1: key j allowed iff j <= i + Lk - Lq
};
const char* to_string(Causal causal);
// Parses "none", "top_left"/"top-left", "bottom_right"/"bottom-right" (throws sattn::Error otherwise).
Causal parse_causal(const std::string& text, const char* argument_name = "causal");

// How float32 values may enter the fused kernel's matrix products (PyTorch's torch.set_float32_matmul_precision:
// kHighest is its "highest", kHigh its "high", kBF16 its "medium").
// kHighest keeps float32 accuracy everywhere. kHigh lets the amx SIMD target take each float32 q, k and v value (and
// dO in the backward) as the sum of two bfloat16 parts (the value rounded to bf16, then the rest rounded to bf16;
// about 16 significant bits, 2^-17 relative) and P (backward: P' and dS) in two parts, every product summing three
// part products on the AMX tiles (the two rounding errors' product dropped, as "bfloat16x3") with float32 sums; the
// two-pass backward (a mask's gradient past the memory limit) takes the parts in S and dP only. Elsewhere (other
// targets, decode, inputs holding an infinity, a NaN or a value past bf16's range) it keeps float32 accuracy. kBF16
// allows rounding them to bfloat16 where the CPU has bf16 products (the avx512bf16 and amx SIMD targets): float32
// q/k/v/dO, the softmax probabilities P of the forward's P·V and the backward's P' and dS are then rounded to bf16
// (2^-9 relative each) with float32 sums — faster, less accurate. Elsewhere (other targets, float16 inputs, the
// reference kernel) it changes nothing. bf16 inputs on those targets round P, P' and dS once whenever out (forward) or
// dq, dk and dv (backward) are stored in bf16, as FlashAttention does, and keep float32 accuracy in the products
// otherwise.
enum class Float32Precision : uint8_t { kHighest, kBF16, kHigh };
const char* to_string(Float32Precision precision);
// Parses "highest", "high" or "bf16" (throws sattn::Error naming `argument_name` otherwise).
Float32Precision parse_float32_precision(const std::string& text, const char* argument_name = "float32_precision");

enum class MaskKind : uint8_t { kNone, kBool, kAdditive };
enum class KeyPaddingKind : uint8_t { kNone, kBool, kLengths };

// Options of one attention call. Masks are views; an empty view (data == nullptr) means "absent".
struct AttentionOptions {
  // Boolean with True = may attend (PyTorch SDPA), or float (f32/f64/bf16/f16) additive.
  // Broadcastable to [B, Hq, Lq, Lk] (numpy rules, right-aligned; 2-D [Lq, Lk] is common).
  // A key is masked only by False or by an additive -inf; a finite bias never masks.
  TensorView attn_mask;
  // Bool [B, Lk] with True = padding (nn.MultiheadAttention's key_padding_mask).
  TensorView key_padding_mask;
  // Int32/int64 [B]: keys j >= key_lengths[b] are padding (j the global position, see query_offset; a length past
  // the last key leaves every key valid). Exclusive with key_padding_mask.
  TensorView key_lengths;
  Causal causal = Causal::kNone;  // intersected with attn_mask when both are given
  std::optional<double> scale;    // default 1/sqrt(D)
  double dropout_p = 0.0;         // in [0, 1); keep(b,h,i,j) = philox(seed; b,h,i,j), see random.hpp
  uint64_t seed = 0;
  // Global positions, for a call on one shard of a longer sequence (sequence/context parallelism, sattn::dist):
  // local query row i sits at global position query_offset + position_stride·i, local key j at
  // key_offset + position_stride·j. Causal masking (top-left on the global positions), dropout's (i, j) and
  // key_lengths (then global lengths: key j is padding iff its global position >= key_lengths[b]) use them.
  // Defaults: the call is the whole sequence. Any other value needs causal kNone or kTopLeft.
  int64_t query_offset = 0, key_offset = 0;
  int64_t position_stride = 1;

  // Execution.
  std::string kernel;              // "" = choose automatically; else a registry name; env SATTN_KERNEL
  bool strict = false;             // error instead of falling back to the O(L^2) reference; env SATTN_STRICT=1
  int num_threads = 0;             // 0 = SATTN_NUM_THREADS, else the hardware's; see threads.hpp
  bool accumulate_fp64 = false;    // reference kernel: accumulate in double even for fp32 inputs
  int64_t memory_limit_bytes = 0;  // L×L buffers: the reference refuses above it, the fused backward avoids its own
                                   // (docs/semantics.md); 0 = half of physical memory
  Float32Precision float32_precision = Float32Precision::kHighest;  // see Float32Precision
};

// The validated description of a call. Sizes follow the names used in the docs:
// q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv], out [B, Hq, Lq, Dv].
struct AttentionProblem {
  int64_t batch = 0, heads_q = 0, heads_kv = 0, len_q = 0, len_k = 0, head_dim = 0, head_dim_v = 0;
  DType dtype_q = DType::kF32, dtype_kv = DType::kF32, dtype_out = DType::kF32;
  MaskKind mask = MaskKind::kNone;
  DType mask_dtype = DType::kBool;
  Shape mask_shape;    // the mask's own shape (for dmask)
  Shape mask_strides;  // 4-D strides broadcast to [B, Hq, Lq, Lk]; 0 on broadcast dims
  KeyPaddingKind key_padding = KeyPaddingKind::kNone;
  Causal causal = Causal::kNone;
  double scale = 0.0;
  double dropout_p = 0.0;
  uint64_t seed = 0;
  int64_t query_offset = 0, key_offset = 0, position_stride = 1;  // see AttentionOptions
  bool need_lse = false, need_weights = false;
  bool backward = false, need_dmask = false;

  int64_t group_size() const { return heads_q / heads_kv; }  // query heads per kv head
  bool has_dropout() const { return dropout_p > 0.0; }
  bool has_positions() const { return query_offset != 0 || key_offset != 0 || position_stride != 1; }
  int64_t query_position(int64_t i) const { return query_offset + position_stride * i; }
  int64_t key_position(int64_t j) const { return key_offset + position_stride * j; }
  // Causality in local indices: key j is allowed for query i iff j <= i + causal_diagonal() (when causal).
  int64_t causal_diagonal() const {
    if (causal == Causal::kBottomRight) return len_k - len_q;
    const int64_t d = query_offset - key_offset;  // floor((qo - ko) / stride): q_pos(i) >= k_pos(j)
    return d >= 0 ? d / position_stride : -((-d + position_stride - 1) / position_stride);
  }
  // The same rule on the positions themselves (what the reference kernel reads).
  bool causal_allows(int64_t i, int64_t j) const {
    if (causal == Causal::kBottomRight) return j <= i + len_k - len_q;
    return causal == Causal::kNone || key_position(j) <= query_position(i);
  }
  // Bytes of one [B, Hq, Lq, Lk] buffer of `elem` bytes (the materialised score matrix).
  double score_matrix_bytes(size_t elem) const { return double(batch) * heads_q * len_q * len_k * elem; }
  std::string to_string() const;  // e.g. "B=1 Hq=8 Hkv=2 Lq=7 Lk=129 D=64 Dv=64 f32 mask=bool causal=bottom_right"
};

}  // namespace sattn
