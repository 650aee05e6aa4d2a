// Content-adaptive attention kernels (TopK, BlockTopK, ReLUAttention, MixedAttention); internal.
#pragma once

#include <string>

#include "sattn/sparse.hpp"
#include "sparse/engine.hpp"
#include "sparse/pattern_node.hpp"

namespace sattn::sparse {

// Shortest decimal that reads back to exactly x (with a '.0' for integral values), for reprs.
std::string format_double(double x);

// `fixed` (may be undefined) restricts the candidates. indices: int64, see adaptive_indices_shape.
// problem: detail::describe_inputs(q, k, v, o, o.enable_gqa).
void adaptive_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& q,
                      const TensorView& k, const TensorView& v, const SparseOptions& o, const TensorView& out,
                      const TensorView& lse, const TensorView& indices);
void adaptive_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                       const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& lse, const SparseOptions& o, const SparseGrads& g,
                       const TensorView& indices);
// TopK: [B, Hq, Lq, k] key indices; BlockTopK: [B, Hq, nqb, k_blocks] key-block indices; else {} (none).
Shape adaptive_indices_shape(const AdaptiveNode& a, int64_t B, int64_t hq, int64_t lq, int64_t lk);

}  // namespace sattn::sparse
