// Packed variable-length batches (FlashAttention's varlen convention): sequence s owns query rows
// [cu_seqlens_q[s], cu_seqlens_q[s+1]) and key rows [cu_seqlens_k[s], cu_seqlens_k[s+1]); no padding is stored or
// computed. Causal is bottom-right within each sequence (FlashAttention >= 2.1): key j allowed for query i iff
// j <= i + Lk_s - Lq_s (local positions).
#pragma once

#include <optional>

#include "sattn/attention.hpp"

namespace sattn {

struct VarlenOptions {
  bool causal = false;          // bottom-right within each sequence
  std::optional<double> scale;  // default 1/sqrt(D)
  std::string kernel;           // "" = automatic (fused for f32/bf16/f16)
  int num_threads = 0;          // 0 = SATTN_NUM_THREADS or the hardware's
  // kBF16: float32 inputs may take the bf16 products; kHigh: the amx target takes them as two bf16 each
  // (AttentionOptions::float32_precision)
  Float32Precision float32_precision = Float32Precision::kHighest;
};

// q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] (any strides, Hq a multiple of Hkv);
// cu_seqlens_q/k int32 or int64 [n + 1], starting at 0, non-decreasing, ending at total_q/total_k;
// max_seqlen_q/k >= every sequence's length. Writes out [total_q, Hq, Dv] and, when given, lse [Hq, total_q]
// (FlashAttention's layout; -inf for rows without any key). Throws sattn::Error naming the bad argument.
void flash_attn_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& cu_seqlens_q,
                       const TensorView& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                       const VarlenOptions& options, const TensorView& out, const TensorView& lse = {});

// Backward from the forward's out and lse: dq, dk, dv with the shapes of q, k, v.
void flash_attn_varlen_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                                const TensorView& out, const TensorView& lse, const TensorView& cu_seqlens_q,
                                const TensorView& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                                const VarlenOptions& options, const TensorView& dq, const TensorView& dk,
                                const TensorView& dv);

}  // namespace sattn
