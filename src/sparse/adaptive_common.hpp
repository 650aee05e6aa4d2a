// The content-adaptive patterns' shared helpers and per-algorithm entry points: adaptive.cpp dispatches to
// topk.cpp (TopK), block_topk.cpp (BlockTopK) and relu_attention.cpp (ReLUAttention, MixedAttention). Internal.
#pragma once

#include <cstdint>
#include <limits>

#include "sattn/error.hpp"
#include "sparse/adaptive.hpp"

namespace sattn::sparse {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct FixedMask {
  const Pattern::Node* node;  // null: everything allowed
  int64_t lq, lk;
  bool operator()(int64_t, int64_t h, int64_t i, int64_t j) const {
    return node == nullptr || node->allowed(h, i, j, lq, lk);
  }
};

inline TensorView slice_batch(const TensorView& t, int64_t b) {
  if (!t.data) return t;
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + b * t.strides[0] * int64_t(dtype_size(t.dtype));
  s.shape[0] = 1;
  return s;
}

inline void check_indices(const TensorView& t, const Shape& shape, const char* what) {
  check(t.dtype == DType::kI64, ErrorKind::kTypeError, "indices: expected int64, got ", to_string(t.dtype));
  check(t.shape == shape && t.strides.size() == shape.size(), ErrorKind::kInvalidArgument, "indices: expected ", what,
        " ", shape_text(shape), ", got ", shape_text(t.shape));
}

inline int64_t& idx_at(const TensorView& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return static_cast<int64_t*>(t.data)[a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3]];
}

inline void require_no_mods(const SparseOptions& o, const char* what) {
  check(o.alibi_slopes.empty() && o.softcap == 0.0 && !o.bias.data && !o.rel_pos_bias.data, ErrorKind::kInvalidArgument,
        what,
        ": score mods (alibi_slopes, softcap, bias, rel_pos_bias) are not supported "
        "with content-adaptive patterns");
}

inline BlockMask fixed_block_mask(const Pattern& fixed, int64_t lq, int64_t lk, int64_t hq, int64_t block) {
  return fixed.defined() ? fixed.block_mask(lq, lk, hq, block) : Full().block_mask(lq, lk, hq, block);
}

// Every entry takes the call's problem, detail::describe_inputs(q, k, v, o, o.enable_gqa), and packs the inputs
// with it (each in the layout its algorithm needs).

// TopK(k): each query's k best keys (topk.cpp).
void topk_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& q,
                  const TensorView& k, const TensorView& v, const SparseOptions& o, const TensorView& out,
                  const TensorView& lse, const TensorView& indices);
void topk_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& dout,
                   const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& lse,
                   const SparseOptions& o, const SparseGrads& g, const TensorView& indices);

// BlockTopK(block, k_blocks): each query block's best key blocks (block_topk.cpp).
void blocktopk_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                       const TensorView& q, const TensorView& k, const TensorView& v, const SparseOptions& o,
                       const TensorView& out, const TensorView& lse, const TensorView& indices);
void blocktopk_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                        const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const SparseOptions& o, const SparseGrads& g,
                        const TensorView& indices);
// The number of query blocks of the selection (blocks aligned as the causal diagonal is).
int64_t blocktopk_num_query_blocks(const AdaptiveNode& a, int64_t lq, int64_t lk);

// ReLUAttention and MixedAttention (relu_attention.cpp).
void relu_mixed_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                        const TensorView& q, const TensorView& k, const TensorView& v, const SparseOptions& o,
                        const TensorView& out, const TensorView& lse, const TensorView& indices);
void relu_mixed_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                         const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                         const SparseOptions& o, const SparseGrads& g);

}  // namespace sattn::sparse
