// Exact scaled-dot-product attention: forward, backward, attention weights.
//
//   out[b,h,i,:] = sum_j P[b,h,i,j] v[b,h/g,j,:],   P = dropout(softmax_j(scale * q·k + bias)),
//   g = Hq / Hkv (GQA/MQA: query head h reads kv head h / g).
//
// Shapes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (any strides), out [B, Hq, Lq, Dv],
// lse [B, Hq, Lq], weights [B, Hq, Lq, Lk]. Outputs are caller-allocated views.
// A row with no allowed key gets out = 0, weights = 0, lse = -inf and zero gradients (never NaN).
#pragma once

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

}  // namespace sattn
