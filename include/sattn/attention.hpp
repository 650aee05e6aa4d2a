// Exact scaled-dot-product attention: forward, backward, attention weights.
//
//   out[b,h,i,:] = sum_j P[b,h,i,j] v[b,h/g,j,:],   P = dropout(softmax_j(scale * q·k + bias)),
//   g = Hq / Hkv (GQA/MQA: query head h reads kv head h / g).
//
// Shapes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (any strides), out [B, Hq, Lq, Dv],
// lse [B, Hq, Lq], weights [B, Hq, Lq, Lk]. Outputs are caller-allocated views.
// A row with no allowed key gets out = 0, weights = 0, lse = -inf and zero gradients (never NaN).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sattn/problem.hpp"
#include "sattn/tensor.hpp"

namespace sattn {

// Which kernel ran, and why faster ones did not.
struct KernelInfo {
  std::string kernel;                                         // name of the kernel that ran
  std::vector<std::pair<std::string, std::string>> rejected;  // (kernel, why not eligible), in registry order
};

struct AttentionOutputs {
  TensorView out;      // required: [B, Hq, Lq, Dv], f32/f64 (bf16/f16 where a kernel supports it)
  TensorView lse;      // optional: [B, Hq, Lq], f32 or f64; natural-log log-sum-exp of the scaled, masked scores
  TensorView weights;  // optional: [B, Hq, Lq, Lk], after dropout (as PyTorch's MHA returns them)
};

struct AttentionGrads {
  TensorView dq, dk, dv;  // required: same shapes as q, k, v
  TensorView dmask;       // optional, only for a float attn_mask: the gradient reduced to the mask's own shape
};

// Validates everything and describes the call. Throws sattn::Error naming the argument.
AttentionProblem describe_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const AttentionOptions& options, const AttentionOutputs* outputs = nullptr);

// An argument known by its shape and dtype only, before any data exists. `dtype` is a name: sattn's are "float32",
// "float64", "bfloat16", "float16", "bool", "int32", "int64" and "uint8"; any other (numpy's "int16", "<U3") is
// refused by the checks, with a message naming it.
struct TensorSpec {
  Shape shape;
  std::string dtype;
};

// A call in the layout of torch.nn.functional.scaled_dot_product_attention, by shapes only: query (..., Hq, Lq, E),
// key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev), at least 2-D, the leading (batch) dimensions equal; attn_mask
// broadcastable (numpy rules) to the weights (..., Hq, Lq, Lk); key_padding_mask bool (..., Lk) with True = padding,
// or integer key_lengths (...). Hq != Hkv needs enable_gqa (as PyTorch 2.5).
struct SdpaSpec {
  TensorSpec query, key, value;
  std::optional<TensorSpec> attn_mask, key_padding_mask, key_lengths;
  bool enable_gqa = false;
  Causal causal = Causal::kNone;
  std::optional<double> scale;
  double dropout_p = 0.0;
};

// How such a call maps onto the 4-D API: the leading dimensions fold into B (2-D and 3-D inputs get B = 1, and
// 2-D ones H = 1).
struct SdpaDescription {
  AttentionProblem problem;  // of the 4-D call (mask_shape is the mask's own; mask_strides is empty: no data)
  Shape batch_dims;          // query's leading dimensions, folded into problem.batch
};

// The validation of describe_attention (same checks, same messages) for a call given by shapes: what a language
// binding runs before any data exists (e.g. PyTorch's fake tensors under torch.compile). Throws sattn::Error.
SdpaDescription describe_sdpa(const SdpaSpec& call);

void scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const AttentionOptions& options, const AttentionOutputs& outputs,
                                  KernelInfo* info = nullptr);

// FlashAttention-style backward from the saved output and log-sum-exp of the forward pass.
void scaled_dot_product_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                           const TensorView& v, const TensorView& out, const TensorView& lse,
                                           const AttentionOptions& options, const AttentionGrads& grads,
                                           KernelInfo* info = nullptr);

// Allocating conveniences (dense row-major results, dtype of q for out, f32 or f64 for lse).
struct AttentionResult {
  Tensor out, lse, weights;
  KernelInfo info;
};
AttentionResult attention(const TensorView& q, const TensorView& k, const TensorView& v,
                          const AttentionOptions& options = {}, bool need_lse = false, bool need_weights = false);

// Names of the registered kernels, in the order the registry tries them (reference last).
std::vector<std::string> kernel_names();
// For each registered kernel, whether it supports `problem` and, if not, why.
std::vector<std::pair<std::string, std::string>> explain_kernels(const AttentionProblem& problem);

// Large scratch arrays of the kernels (4 MiB and more: packed tiles, partial gradients, dense copies) are kept after
// a call, in a cache of at most 8 freed blocks and SATTN_WORKSPACE_CACHE_MB MiB (default 1024; 0 disables it), so
// that the next call does not fault in fresh pages. The bytes held there now, and a way to give them back.
int64_t workspace_cache_bytes();
void empty_workspace_cache();

}  // namespace sattn
