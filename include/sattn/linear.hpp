// Linear attention (kernelised): out_i = φ(q_i)ᵀ(Σ_j φ(k_j) v_jᵀ) / φ(q_i)ᵀ(Σ_j φ(k_j)), O(L·F·Dv) instead of O(L²).
//
// Shapes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] (any strides, float dtypes), out [B, Hq, Lq, Dv].
// Feature maps φ:
//   "elu":    φ(x) = elu(x) + 1 (Katharopoulos et al. 2020), F = D.
//   "favor+": Performer's positive random features on x̃ = x·D^(-1/4): φ(x) = m^(-1/2) exp(ω x̃ - |x̃|²/2), F = m rows of
//             ω [m, D] block-orthogonal (Gaussian QR per block of D rows) with χ(D)-distributed row norms, seeded;
//             default m = floor(D ln D). Stabilised by subtracting, per query row, the max of ω x̃ over the features
//             and, for keys, one max over all keys and features (never per prefix); both cancel in the ratio.
// causal: key j is used by query i iff j <= i (requires Lq == Lk); computed with chunked prefix sums.
// fp32 matrix products (the sparse tile operations), float64 for the long sums; deterministic; parallel over
// (batch, head).
#pragma once

#include <cstdint>
#include <string>

#include "sattn/tensor.hpp"

namespace sattn::sparse {

struct LinearOptions {
  std::string feature_map = "elu";  // "elu" or "favor+"
  int64_t num_features = 0;         // favor+: m (0 = floor(D ln D)); ignored for elu
  bool causal = false;
  uint64_t seed = 0;  // favor+ projection
  bool enable_gqa = true;
  int num_threads = 0;
};

void linear_attention(const TensorView& q, const TensorView& k, const TensorView& v, const LinearOptions& options,
                      const TensorView& out);

void linear_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                               const LinearOptions& options, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv);

// The FAVOR+ projection ω [m, D] (float64) used for (D, m, seed).
Tensor favor_projection(int64_t head_dim, int64_t num_features, uint64_t seed);

}  // namespace sattn::sparse
