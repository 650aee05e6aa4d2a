// The internal kernel interface and the registry.
//
// Each kernel answers supports(problem, &why); the registry tries them in order (reference last) and runs
// the first eligible one. A caller can force a kernel by name (option or SATTN_KERNEL) and can forbid the
// silent fall-back to the O(L^2) reference (option or SATTN_STRICT=1).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "sattn/attention.hpp"

namespace sattn {

// Masks normalised for kernels. Polarity here is always "allowed" / "padding" as documented below.
struct MaskData {
  // attn_mask as a 4-D view [B, Hq, Lq, Lk] with 0 strides on broadcast dims (bool: true = may attend;
  // f32/f64: additive). data == nullptr when absent.
  TensorView attn_mask;
  // key padding, true = padding: element (b, j) at key_padding[b * kp_stride_b + j * kp_stride_k]. nullptr if absent.
  const uint8_t* key_padding = nullptr;
  int64_t kp_stride_b = 0, kp_stride_k = 0;
  // key lengths per batch entry (empty when absent): keys j >= key_lengths[b] are padding.
  std::vector<int64_t> key_lengths;

  bool key_is_padding(int64_t b, int64_t j) const {
    if (key_padding && key_padding[b * kp_stride_b + j * kp_stride_k]) return true;
    return !key_lengths.empty() && j >= key_lengths[b];
  }
  // Value of the 4-D mask at (b, h, i, j) as double (1/0 for bool).
  double mask_value(int64_t b, int64_t h, int64_t i, int64_t j) const {
    const int64_t idx[4] = {b, h, i, j};
    return attn_mask.get(idx);
  }
};

// Whether causality allows key j for query i (Lq, Lk: the problem's lengths).
inline bool causal_allows(Causal causal, int64_t i, int64_t j, int64_t len_q, int64_t len_k) {
  switch (causal) {
    case Causal::kNone: return true;
    case Causal::kTopLeft: return j <= i;
    case Causal::kBottomRight: return j <= i + len_k - len_q;
  }
  return true;
}

struct ForwardArgs {
  const AttentionProblem& problem;
  const AttentionOptions& options;
  TensorView q, k, v;
  MaskData masks;
  AttentionOutputs outputs;
  int num_threads = 1;
};

struct BackwardArgs {
  const AttentionProblem& problem;
  const AttentionOptions& options;
  TensorView dout, q, k, v, out, lse;
  MaskData masks;
  AttentionGrads grads;
  int num_threads = 1;
};

struct KernelEntry {
  const char* name;
  // problem.backward tells which pass is asked for. Sets *why when it returns false.
  bool (*supports)(const AttentionProblem& problem, std::string* why);
  void (*forward)(const ForwardArgs& args);
  void (*backward)(const BackwardArgs& args);
};

// The kernels, one function each; registry order is in src/kernels/registry.cpp.
KernelEntry fused_kernel();  // kernels/fused/fused_kernel.cpp
KernelEntry reference_kernel();

const std::vector<KernelEntry>& registered_kernels();

// Builds the normalised masks for a described problem.
MaskData make_mask_data(const AttentionProblem& problem, const AttentionOptions& options);

}  // namespace sattn
