// The implementation side of sattn::sparse::Pattern: one node class per pattern kind.
#pragma once

#include <string>
#include <vector>

#include "sattn/patterns.hpp"

namespace sattn::sparse {

struct Pattern::Node {
  virtual ~Node() = default;
  // Nesting depth of the tree under this node (see kMaxPatternDepth); every walk of a tree recurses at most this
  // deep.
  int depth = 1;
  virtual std::string repr() const = 0;
  // 0 for a leaf pattern; 1 for '&'; 2 for '|' (Python precedence: & binds tighter than |).
  virtual int precedence() const { return 0; }
  virtual bool head_dependent() const { return false; }
  // Content-adaptive nodes (TopK, BlockTopK, ReLUAttention, MixedAttention) and whether a tree contains one.
  virtual bool adaptive() const { return false; }
  virtual bool contains_adaptive() const { return adaptive(); }
  virtual void check_lengths(int64_t /*len_q*/, int64_t /*len_k*/) const {}
  // WindowAttention2D (possibly inside a union/intersection): its grid width and window, for the relative-position
  // bias table.
  virtual bool window2d(int64_t& /*width*/, int64_t& /*window*/) const { return false; }
  // Fast path of the kernel's mask inside partial ranges: when the allowed keys of query i (original index) among
  // the layout key positions [kp0, kp1) of one range piece of THIS pattern's own block mask are exactly
  // [lo, hi) ∩ [kp0, kp1), set lo/hi and return true (false: the kernel evaluates allowed() per pair).
  virtual bool layout_interval(int64_t /*h*/, int64_t /*i*/, int64_t /*kp0*/, int64_t /*kp1*/, int64_t /*len_q*/,
                               int64_t /*len_k*/, int64_t& /*lo*/, int64_t& /*hi*/) const {
    return false;
  }
  virtual bool allowed(int64_t h, int64_t i, int64_t j, int64_t len_q, int64_t len_k) const = 0;
  // Key ranges (identity key order, sorted, disjoint, each at most `block` long) for the queries [q0, q1) in
  // identity order, head h. Exact where cheap; a partial range may only be listed if it can hold allowed pairs.
  // The default scans the key hull with the predicate (O(hull * (q1 - q0))); structured patterns override.
  virtual void ranges_for(int64_t h, int64_t q0, int64_t q1, int64_t len_q, int64_t len_k, int64_t block,
                          std::vector<KeyRange>& out) const;
  // Keys [k0, k1) that can be allowed for queries [q0, q1) (for the default ranges_for).
  virtual void key_hull(int64_t h, int64_t q0, int64_t q1, int64_t len_q, int64_t len_k, int64_t& k0,
                        int64_t& k1) const;
  // The kernel's block mask. The default: identity layout, query blocks of `block`, ranges from ranges_for.
  virtual BlockMask block_mask(int64_t len_q, int64_t len_k, int64_t heads, int64_t block) const;
};

// Content-adaptive patterns (see patterns.hpp); run by src/sparse/adaptive.cpp.
struct AdaptiveNode final : Pattern::Node {
  enum Kind { kTopK, kBlockTopK, kReLU, kMixed } kind = kTopK;
  int64_t k = 0, block = 0, k_blocks = 0;
  bool local = true, causal = false;
  double power = 2.0;
  int normalize = 0;  // 0 none, 1 sum, 2 length
  double logit_softmax = 0.0, logit_relu = 0.0;
  std::string repr() const override;
  bool adaptive() const override { return true; }
  bool allowed(int64_t, int64_t, int64_t, int64_t, int64_t) const override;
};

// Splits `p` into its content-adaptive node (or null) and its fixed part (undefined Pattern if none); throws when
// an adaptive pattern is combined other than by a top-level '&' with a fixed pattern.
void split_adaptive(const Pattern& p, const AdaptiveNode*& adaptive, Pattern& fixed);

namespace detail {
// Throws sattn::Error (kInvalidArgument) "<pattern>: expected <name> in <lo>..<hi><note>, got <value>" unless
// lo <= value <= hi.
void check_param(const char* pattern, const char* name, int64_t value, int64_t lo, int64_t hi = kMaxPatternSize,
                 const char* note = "");
// Appends [lo, hi) split into pieces of at most `block` keys (nothing when lo >= hi).
void emit_range(std::vector<KeyRange>& out, int64_t lo, int64_t hi, bool full, int64_t block);
// Union (op '|') or intersection (op '&') of two sorted disjoint range lists, re-split to `block`.
std::vector<KeyRange> merge_ranges(const std::vector<KeyRange>& a, const std::vector<KeyRange>& b, char op,
                                   int64_t block);
// Builds an identity-layout block mask whose query blocks end at the given boundaries (sorted, last = Lq).
template <typename RangesFn>
BlockMask build_identity_layout(int64_t len_q, int64_t len_k, int64_t heads, const std::vector<int32_t>& bounds,
                                RangesFn&& ranges_fn) {
  BlockMask m;
  m.len_q = len_q;
  m.len_k = len_k;
  m.heads = heads;
  m.q_block_start.push_back(0);
  for (int32_t b : bounds) m.q_block_start.push_back(b);
  const int64_t nqb = m.num_q_blocks();
  m.row_ptr.push_back(0);
  for (int64_t s = 0; s < heads; ++s)
    for (int64_t qb = 0; qb < nqb; ++qb) {
      ranges_fn(s, int64_t(m.q_block_start[qb]), int64_t(m.q_block_start[qb + 1]), m.ranges);
      m.row_ptr.push_back(int64_t(m.ranges.size()));
    }
  return m;
}
// Query-block boundaries every `block` queries.
std::vector<int32_t> grid_bounds(int64_t len_q, int64_t block);
// Floor division and modulo (b > 0).
int64_t floor_div(int64_t a, int64_t b);
int64_t floor_mod(int64_t a, int64_t b);
// Ends of the query blocks: at most `block` queries each, and a block also ends wherever the aligned query index
// i + off crosses a multiple of the pattern's block `blk`, so that every visited tile is full.
std::vector<int32_t> block_aligned_bounds(int64_t lq, int64_t off, int64_t blk, int64_t block);
// The aligned position of query 0: 0 (top-left) or Lk - Lq (bottom-right).
int64_t align_offset(Alignment al, int64_t len_q, int64_t len_k);
// ", alignment='top_left'" for a top-left pattern's repr, else "".
std::string alignment_suffix(Alignment al);
// Throws unless 0 <= len < 2^31.
void check_len32(int64_t len, const char* name);
// Throws unless the node nests at most kMaxPatternDepth deep.
void check_depth(const char* what, const Pattern::Node& node);
// Patterns align top-left or bottom-right; Causal::kNone is not an alignment.
void check_alignment(const char* pattern, Alignment al);
}  // namespace detail

}  // namespace sattn::sparse
