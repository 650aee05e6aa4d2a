// Content-adaptive attention: the entry points of TopK, BlockTopK, ReLUAttention and MixedAttention (see
// patterns.hpp / sparse.hpp), each algorithm in its own file (adaptive_common.hpp lists them).
#include "sparse/adaptive.hpp"

#include "sattn/error.hpp"
#include "sparse/adaptive_common.hpp"

namespace sattn::sparse {

void adaptive_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& q,
                      const TensorView& k, const TensorView& v, const SparseOptions& o, const TensorView& out,
                      const TensorView& lse, const TensorView& indices) {
  require_no_mods(o, a.repr().c_str());
  switch (a.kind) {
    case AdaptiveNode::kTopK: return topk_forward(problem, a, fixed, q, k, v, o, out, lse, indices);
    case AdaptiveNode::kBlockTopK: return blocktopk_forward(problem, a, fixed, q, k, v, o, out, lse, indices);
    case AdaptiveNode::kReLU:
    case AdaptiveNode::kMixed: return relu_mixed_forward(problem, a, fixed, q, k, v, o, out, lse, indices);
  }
}

void adaptive_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                       const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& lse, const SparseOptions& o, const SparseGrads& g,
                       const TensorView& indices) {
  require_no_mods(o, a.repr().c_str());
  switch (a.kind) {
    case AdaptiveNode::kTopK: return topk_backward(problem, a, fixed, dout, q, k, v, lse, o, g, indices);
    case AdaptiveNode::kBlockTopK: return blocktopk_backward(problem, a, fixed, dout, q, k, v, out, lse, o, g, indices);
    case AdaptiveNode::kReLU:
    case AdaptiveNode::kMixed: return relu_mixed_backward(problem, a, fixed, dout, q, k, v, o, g);
  }
}

Shape adaptive_indices_shape(const AdaptiveNode& a, int64_t B, int64_t hq, int64_t lq, int64_t lk) {
  if (a.kind == AdaptiveNode::kTopK) return {B, hq, lq, a.k};
  if (a.kind == AdaptiveNode::kBlockTopK) return {B, hq, blocktopk_num_query_blocks(a, lq, lk), a.k_blocks};
  return {};
}

}  // namespace sattn::sparse
