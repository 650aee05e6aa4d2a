// Sparse attention patterns and block masks.
//
// A Pattern answers two questions:
//   - allowed(b, h, i, j, Lq, Lk): may query i attend to key j? (the element predicate; the oracle uses it)
//   - block_mask(Lq, Lk, heads): which tiles must the kernel visit? (built in O(number of blocks) for the
//     structured patterns, never by evaluating the predicate on all Lq x Lk pairs)
//
// Positions are 0-based. When Lq != Lk a query i is aligned to key position a = i + Lk - Lq (bottom-right,
// FlashAttention's convention) unless the pattern was built with Causal::kTopLeft (a = i, PyTorch's is_causal).
// Patterns are immutable values (a shared pointer to an immutable node); copying is cheap.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sattn/problem.hpp"
#include "sattn/tensor.hpp"

namespace sattn::sparse {

// How a pattern aligns query i with the keys when Lq != Lk: the one causal-alignment enum of the library
// (problem.hpp), Causal::kBottomRight (the patterns' default) or Causal::kTopLeft; Causal::kNone is refused.
using Alignment = Causal;

// One visited key range of a query block, in layout key order (see BlockMask::k_perm).
// full: every (query of the block, key of the range) pair is allowed, so the kernel applies no element mask.
// q_lo, q_hi: only the block's query rows [q_lo, q_hi) (offsets in the block; q_hi = 0: to the block's end) can
// have allowed keys in the range, so only they are computed (Neighborhood2D: the rows of a 2-D query tile whose
// row windows reach the key row). A range narrowed this way is never full. Kernels that ignore the narrowing stay
// correct (the element mask removes the other rows' pairs); they only compute more.
struct KeyRange {
  int32_t begin = 0, end = 0;
  uint8_t full = 0;
  uint16_t q_lo = 0, q_hi = 0;
  // The computed query rows [q_first(), q_last(m)) of a block of m queries.
  int64_t q_first(int64_t m) const { return q_lo < m ? int64_t(q_lo) : m; }
  int64_t q_last(int64_t m) const { return q_hi == 0 || q_hi > m ? m : int64_t(q_hi); }
};

// The work list of a sparse kernel.
//
// Queries and keys may be visited in a permuted "layout" order (q_perm / k_perm: layout position -> original
// index; empty = identity) so that a pattern's tiles stay dense (Dilated regroups by residue, the 2-D patterns
// by tile / window). Query block qb covers layout positions [q_block_start[qb], q_block_start[qb+1]). For head
// slot s (s = h when heads > 1, else 0) the ranges of query block qb are
// ranges[row_ptr[s * nqb + qb] .. row_ptr[s * nqb + qb + 1]), sorted and disjoint. Keys outside every range
// are never computed (the pattern guarantees they are not allowed).
struct BlockMask {
  int64_t len_q = 0, len_k = 0;
  int64_t heads = 1;  // 1 when the pattern does not depend on the head, else the number of query heads
  std::vector<int32_t> q_perm, k_perm;
  std::vector<int32_t> q_block_start;
  std::vector<int64_t> row_ptr;
  std::vector<KeyRange> ranges;

  int64_t num_q_blocks() const { return int64_t(q_block_start.size()) - 1; }
  int64_t slot(int64_t h) const { return heads == 1 ? 0 : h; }
  int32_t q_index(int64_t pos) const { return q_perm.empty() ? int32_t(pos) : q_perm[size_t(pos)]; }
  int32_t k_index(int64_t pos) const { return k_perm.empty() ? int32_t(pos) : k_perm[size_t(pos)]; }
  // Number of (query, key) pairs the kernel computes for one head slot `s`, and whose mask it evaluates.
  int64_t computed_pairs(int64_t s) const;
  int64_t partial_pairs(int64_t s) const;
  // Throws sattn::Error (kInternal) if the structure is inconsistent.
  void validate() const;
};

class Pattern {
 public:
  struct Node;  // the implementation (src/sparse/pattern_node.hpp)

  Pattern() = default;
  explicit Pattern(std::shared_ptr<const Node> node) : node_(std::move(node)) {}

  // Element predicate (original indices; b is accepted for FlexAttention-style signatures, no built-in
  // pattern depends on it).
  bool allowed(int64_t b, int64_t h, int64_t i, int64_t j, int64_t len_q, int64_t len_k) const;
  // Throws sattn::Error when the pattern cannot be applied to these lengths (e.g. 2-D grids need
  // Lq = Lk = height * width).
  void check_lengths(int64_t len_q, int64_t len_k) const;
  // The kernel's work list. `heads` = number of query heads (used by head-dependent patterns such as BigBird's
  // random blocks). `block` = the preferred query block / key range size.
  BlockMask block_mask(int64_t len_q, int64_t len_k, int64_t heads = 1, int64_t block = 64) const;
  // Dense boolean mask (True = may attend): [heads, Lq, Lk] if head_dependent(), else [1, Lq, Lk].
  Tensor dense_mask(int64_t len_q, int64_t len_k, int64_t heads = 1) const;
  bool head_dependent() const;
  // The constructor expression, e.g. "SlidingWindow(256, 256)"; Pattern::parse(repr()) gives an equal pattern.
  std::string repr() const;
  // Parses a pattern spec in the Python constructor syntax (see docs/sparse.md). Errors name the position.
  static Pattern parse(const std::string& spec);

  bool defined() const { return node_ != nullptr; }
  const Node& node() const;
  const std::shared_ptr<const Node>& node_ptr() const { return node_; }
  bool operator==(const Pattern& other) const { return repr() == other.repr(); }

 private:
  std::shared_ptr<const Node> node_;
};

// Limits of the pattern constructors and specs. Sizes, windows, dilations, block sizes and block counts lie in
// 1..kMaxPatternSize (windows and block counts also 0 where a pattern allows it; window sides also -1 =
// unbounded); seeds are any uint64. Pattern trees nest at most kMaxPatternDepth deep: a leaf has depth 1,
// GlobalTokens adds 1 to its base's, and | and & add 1 to their operands' except along a chain of the same
// operator on the left (a | b | c | ... has depth 2 however long). A spec has at most kMaxSpecLength characters.
// Out of range: sattn::Error (kInvalidArgument) naming the parameter, its range and the value.
inline constexpr int64_t kMaxPatternSize = (int64_t(1) << 31) - 1;
inline constexpr int kMaxPatternDepth = 256;
inline constexpr size_t kMaxSpecLength = 65536;

// Unions and intersections of patterns.
Pattern operator|(const Pattern& a, const Pattern& b);
Pattern operator&(const Pattern& a, const Pattern& b);

// key j allowed for (aligned) query a iff a - left <= j <= a + right; -1 = unbounded on that side; right = 0 is causal.
class SlidingWindow : public Pattern {
 public:
  SlidingWindow(int64_t left, int64_t right, Alignment alignment = Alignment::kBottomRight);
};
// allowed iff |a - j| <= window * dilation and (a - j) mod dilation == 0.
class Dilated : public Pattern {
 public:
  Dilated(int64_t window, int64_t dilation, Alignment alignment = Alignment::kBottomRight);
};
// allowed iff floor(a / block) == floor(j / block).
class BlockLocal : public Pattern {
 public:
  explicit BlockLocal(int64_t block, Alignment alignment = Alignment::kBottomRight);
};
// base, plus: a global (aligned) query position a in `indices` sees every key, and every query sees the key
// positions in `indices` (Longformer).
class GlobalTokens : public Pattern {
 public:
  GlobalTokens(std::vector<int64_t> indices, const Pattern& base, Alignment alignment = Alignment::kBottomRight);
};
// BigBird's block pattern on blocks of `block` positions (query block qb = floor(a / block), key block kb):
// window: qb - floor(w/2) <= kb <= qb + floor((w-1)/2); the first `global_blocks` blocks are global (as queries
// and as keys); each other query block gets `random_blocks` further key blocks, drawn without replacement from
// the blocks outside its window and the global ones, a pure function of (seed, head, qb).
class BigBird : public Pattern {
 public:
  BigBird(int64_t block, int64_t window_blocks, int64_t global_blocks, int64_t random_blocks, uint64_t seed = 0,
          Alignment alignment = Alignment::kBottomRight);
};
// NATTEN neighborhood attention on a height x width grid (row-major tokens; Lq = Lk = height * width).
class Neighborhood2D : public Pattern {
 public:
  Neighborhood2D(int64_t height, int64_t width, int64_t kernel, int64_t dilation = 1, bool causal = false);
};
// Window attention on a height x width grid, with shifted, non-wrapping windows for shift > 0: groups per axis
// [0, s), [s, s+w), ..., [H-w+s, H) (the first and last groups partial; nothing wraps around the border). The
// pairs it allows are those of Swin's cyclic shift with its mask (docs/sparse.md, "Shifted windows").
class WindowAttention2D : public Pattern {
 public:
  WindowAttention2D(int64_t height, int64_t width, int64_t window, int64_t shift = 0);
};
// All pairs (dense attention through the sparse engine; useful for composition and tests).
class Full : public Pattern {
 public:
  Full();
};

// ---- Content-adaptive patterns (the selection depends on q and k; routing gets no gradient) --------------------
// They run through sparse_attention (sparse.hpp), alone or intersected with a fixed pattern (`TopK(16) & F`,
// which restricts the candidates to F's allowed pairs). allowed()/block_mask()/dense_mask() throw for them; the
// selection the kernel made is returned as indices instead (see selection_mask in sparse.hpp).

// Each query keeps its k largest scores (ties to the lower key index); softmax over those.
class TopK : public Pattern {
 public:
  explicit TopK(int64_t k);
};
// Per query block (aligned positions a = i + Lk - Lq, blocks of `block`) and query head: block score =
// mean(q of the block)·mean(valid k of the key block); key blocks with no allowed pair are not candidates; `local`
// always chooses the query's own block (counting toward k_blocks); `causal`: key blocks after the query block are
// not candidates and the diagonal block is causal inside (j <= a). Ties to the lower block index.
class BlockTopK : public Pattern {
 public:
  BlockTopK(int64_t block, int64_t k_blocks, bool local = true, bool causal = false);
};
// weights relu(s)^power (s = scale q·k) over the allowed keys; normalize "none", "sum" (divide by the row sum,
// 0 for an all-zero row) or "length" (divide by the number of allowed keys).
class ReLUAttention : public Pattern {
 public:
  explicit ReLUAttention(double power = 2.0, const std::string& normalize = "none");
};
// w = softmax(logits); weights w1 softmax(s) + w2 relu(s)^2 (AST, CVPR 2024); the backward returns d(logits).
class MixedAttention : public Pattern {
 public:
  explicit MixedAttention(double logit_softmax = 0.0, double logit_relu = 0.0);
};

// FlexAttention's create_block_mask: a dense bool mask (True = may attend) [Lq, Lk] or [H, Lq, Lk] (H = 1 or
// the number of query heads) to a block mask with query blocks of block_q and key ranges of block_k.
BlockMask block_mask_from_dense(const TensorView& mask, int64_t block_q = 64, int64_t block_k = 64);

}  // namespace sattn::sparse
