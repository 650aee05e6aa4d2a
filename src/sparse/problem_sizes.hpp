// The sparse entries' hold on an AttentionProblem: the problem describe_attention built (and validated) for the
// call, with its sizes under the short names of the shapes in the docs: q [B, Hq, Lq, D], k [B, Hkv, Lk, D],
// v [B, Hkv, Lk, Dv]. The engine's Packed and linear attention's Problem derive from it and add only their own
// fields. The accessors read the problem; loops that need a size on every iteration copy it to a local first.
#pragma once

#include <cstdint>

#include "sattn/problem.hpp"

namespace sattn::sparse {

struct ProblemSizes {
  AttentionProblem problem;

  int64_t B() const { return problem.batch; }
  int64_t Hq() const { return problem.heads_q; }
  int64_t Hkv() const { return problem.heads_kv; }
  int64_t Lq() const { return problem.len_q; }
  int64_t Lk() const { return problem.len_k; }
  int64_t D() const { return problem.head_dim; }
  int64_t Dv() const { return problem.head_dim_v; }
  int64_t group() const { return problem.group_size(); }  // query heads per kv head
};

}  // namespace sattn::sparse
