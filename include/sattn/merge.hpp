// Merging attention computed over disjoint sets of keys (split-K decode, ring and chunked attention).
#pragma once

#include <vector>

#include "sattn/tensor.hpp"

namespace sattn {

// Given C partial results of the same queries over disjoint key sets — outs[c] [..., Dv] (normalised within
// their own keys) and lses[c] [...] (their log-sum-exps; outs[c] and lses[c] share the leading shape) — returns
// the attention over the union of the keys:
//   lse = log sum_c exp(lse_c),   out = sum_c exp(lse_c - lse) out_c.
// Partials with lse = -inf (no allowed key) are ignored; rows where every partial is -inf get out = 0,
// lse = -inf; a partial with lse = NaN (its scores held a NaN) makes the row's out and lse NaN. The sum runs in
// the order c = 0, 1, ... (deterministic). Inputs f32/f64, any strides; out and lse are caller-allocated with the
// shapes of outs[0] and lses[0] (f32/f64).
void merge_attention_partials(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                              const TensorView& out, const TensorView& lse);

struct MergedAttention {
  Tensor out, lse;  // dtype of outs[0] (f32 or f64)
};
MergedAttention merge_attention_partials(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses);

}  // namespace sattn
