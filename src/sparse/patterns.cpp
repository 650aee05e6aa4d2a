// The fixed sparse patterns: element predicates and block masks (see include/sattn/patterns.hpp).
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <set>

#include "sattn/error.hpp"
#include "sattn/random.hpp"
#include "sparse/pattern_node.hpp"

namespace sattn::sparse {

// ---- detail helpers -----------------------------------------------------------------------------------------

namespace detail {

int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

std::vector<int32_t> block_aligned_bounds(int64_t lq, int64_t off, int64_t blk, int64_t block) {
  std::vector<int32_t> bounds;
  int64_t start = 0;
  for (int64_t i = 1; i <= lq; ++i)
    if (i == lq || floor_mod(i + off, blk) == 0 || i - start == block) {
      bounds.push_back(int32_t(i));
      start = i;
    }
  if (lq == 0) bounds.push_back(0);
  return bounds;
}

int64_t align_offset(Alignment al, int64_t len_q, int64_t len_k) {
  return al == Alignment::kTopLeft ? 0 : len_k - len_q;
}

std::string alignment_suffix(Alignment al) { return al == Alignment::kTopLeft ? ", alignment='top_left'" : ""; }

void check_len32(int64_t len, const char* name) {
  check(len >= 0 && len < (int64_t(1) << 31), ErrorKind::kInvalidArgument, name,
        ": sparse patterns support lengths below 2^31, got ", len);
}

void check_depth(const char* what, const Pattern::Node& node) {
  check(node.depth <= kMaxPatternDepth, ErrorKind::kInvalidArgument, what, ": expected patterns nested at most ",
        kMaxPatternDepth, " deep, got ", node.depth);
}

void check_alignment(const char* pattern, Alignment al) {
  check(al == Alignment::kTopLeft || al == Alignment::kBottomRight, ErrorKind::kInvalidArgument, pattern,
        ": alignment: expected Causal::kTopLeft or Causal::kBottomRight, got ",
        al == Causal::kNone ? "Causal::kNone" : "a value outside the enum");
}

void check_param(const char* pattern, const char* name, int64_t value, int64_t lo, int64_t hi, const char* note) {
  check(value >= lo && value <= hi, ErrorKind::kInvalidArgument, pattern, ": expected ", name, " in ", lo, "..", hi,
        note, ", got ", value);
}

void emit_range(std::vector<KeyRange>& out, int64_t lo, int64_t hi, bool full, int64_t block) {
  for (int64_t s = lo; s < hi; s += block) {
    const int64_t e = std::min(hi, s + block);
    out.push_back({int32_t(s), int32_t(e), uint8_t(full ? 1 : 0)});
  }
}

std::vector<KeyRange> merge_ranges(const std::vector<KeyRange>& a, const std::vector<KeyRange>& b, char op,
                                   int64_t block) {
  // Sweep over all boundaries; each elementary segment gets (covered, full) from a and from b.
  std::vector<int32_t> pts;
  for (const auto& r : a) pts.insert(pts.end(), {r.begin, r.end});
  for (const auto& r : b) pts.insert(pts.end(), {r.begin, r.end});
  std::sort(pts.begin(), pts.end());
  pts.erase(std::unique(pts.begin(), pts.end()), pts.end());
  std::vector<KeyRange> out;
  size_t ia = 0, ib = 0;
  int64_t run_lo = -1, run_hi = -1;
  bool run_full = false;
  auto flush = [&]() {
    if (run_lo >= 0) emit_range(out, run_lo, run_hi, run_full, block);
    run_lo = -1;
  };
  for (size_t p = 0; p + 1 < pts.size(); ++p) {
    const int32_t s = pts[p], e = pts[p + 1];
    while (ia < a.size() && a[ia].end <= s) ++ia;
    while (ib < b.size() && b[ib].end <= s) ++ib;
    const bool ca = ia < a.size() && a[ia].begin <= s, cb = ib < b.size() && b[ib].begin <= s;
    const bool fa = ca && a[ia].full, fb = cb && b[ib].full;
    const bool covered = op == '|' ? (ca || cb) : (ca && cb);
    const bool full = op == '|' ? (fa || fb) : (fa && fb);
    if (!covered) {
      flush();
      continue;
    }
    if (run_lo >= 0 && run_hi == s && run_full == full) {
      run_hi = e;
    } else {
      flush();
      run_lo = s;
      run_hi = e;
      run_full = full;
    }
  }
  flush();
  return out;
}

std::vector<int32_t> grid_bounds(int64_t len_q, int64_t block) {
  std::vector<int32_t> b;
  for (int64_t q = block; q < len_q; q += block) b.push_back(int32_t(q));
  b.push_back(int32_t(len_q));
  return b;
}

}  // namespace detail

using namespace detail;  // the pattern helpers of pattern_node.hpp

// ---- Node defaults ----------------------------------------------------------------------------------------------

void Pattern::Node::key_hull(int64_t, int64_t, int64_t, int64_t, int64_t len_k, int64_t& k0, int64_t& k1) const {
  k0 = 0;
  k1 = len_k;
}

void Pattern::Node::ranges_for(int64_t h, int64_t q0, int64_t q1, int64_t len_q, int64_t len_k, int64_t block,
                               std::vector<KeyRange>& out) const {
  int64_t k0, k1;
  key_hull(h, q0, q1, len_q, len_k, k0, k1);
  k0 = std::max<int64_t>(k0, 0);
  k1 = std::min(k1, len_k);
  for (int64_t s = k0; s < k1; s += block) {
    const int64_t e = std::min(k1, s + block);
    int64_t count = 0;
    for (int64_t i = q0; i < q1; ++i)
      for (int64_t j = s; j < e; ++j) count += allowed(h, i, j, len_q, len_k) ? 1 : 0;
    if (count == 0) continue;
    const bool full = count == (q1 - q0) * (e - s);
    if (!out.empty() && out.back().end == s && bool(out.back().full) == full && e - out.back().begin <= block)
      out.back().end = int32_t(e);
    else out.push_back({int32_t(s), int32_t(e), uint8_t(full)});
  }
}

BlockMask Pattern::Node::block_mask(int64_t len_q, int64_t len_k, int64_t heads, int64_t block) const {
  const int64_t slots = head_dependent() ? heads : 1;
  return detail::build_identity_layout(len_q, len_k, slots, detail::grid_bounds(len_q, block),
                                       [&](int64_t s, int64_t q0, int64_t q1, std::vector<KeyRange>& out) {
                                         ranges_for(s, q0, q1, len_q, len_k, block, out);
                                       });
}

// ---- BlockMask ------------------------------------------------------------------------------------------------

int64_t BlockMask::computed_pairs(int64_t s) const {
  int64_t total = 0;
  const int64_t nqb = num_q_blocks();
  for (int64_t qb = 0; qb < nqb; ++qb) {
    const int64_t m = q_block_start[qb + 1] - q_block_start[qb];
    for (int64_t r = row_ptr[s * nqb + qb]; r < row_ptr[s * nqb + qb + 1]; ++r)
      total += (ranges[r].q_last(m) - ranges[r].q_first(m)) * (ranges[r].end - ranges[r].begin);
  }
  return total;
}

int64_t BlockMask::partial_pairs(int64_t s) const {
  int64_t total = 0;
  const int64_t nqb = num_q_blocks();
  for (int64_t qb = 0; qb < nqb; ++qb) {
    const int64_t m = q_block_start[qb + 1] - q_block_start[qb];
    for (int64_t r = row_ptr[s * nqb + qb]; r < row_ptr[s * nqb + qb + 1]; ++r)
      if (!ranges[r].full) total += (ranges[r].q_last(m) - ranges[r].q_first(m)) * (ranges[r].end - ranges[r].begin);
  }
  return total;
}

void BlockMask::validate() const {
  auto bad = [](const std::string& what) {
    fail(ErrorKind::kInvalidArgument, "block_mask: inconsistent structure (", what, ")");
  };
  if (q_block_start.empty() || q_block_start.front() != 0 || q_block_start.back() != len_q) bad("query blocks");
  for (size_t i = 0; i + 1 < q_block_start.size(); ++i)
    if (q_block_start[i] >= q_block_start[i + 1]) bad("empty or unsorted query block");
  if (!q_perm.empty() && int64_t(q_perm.size()) != len_q) bad("q_perm size");
  if (!k_perm.empty() && int64_t(k_perm.size()) != len_k) bad("k_perm size");
  for (const auto* perm : {&q_perm, &k_perm}) {
    if (perm->empty()) continue;
    std::vector<uint8_t> seen(perm->size(), 0);
    for (int32_t x : *perm) {
      if (x < 0 || size_t(x) >= perm->size() || seen[size_t(x)]) bad("q_perm/k_perm is not a permutation");
      seen[size_t(x)] = 1;
    }
  }
  if (heads < 1 || int64_t(row_ptr.size()) != heads * num_q_blocks() + 1) bad("row_ptr size");
  if (row_ptr.back() != int64_t(ranges.size())) bad("row_ptr end");
  const int64_t nqb = num_q_blocks();
  for (size_t r = 0; r + 1 < row_ptr.size(); ++r) {
    int32_t prev = std::numeric_limits<int32_t>::min();
    const int64_t qb = int64_t(r) % std::max<int64_t>(1, nqb), m = q_block_start[qb + 1] - q_block_start[qb];
    for (int64_t x = row_ptr[r]; x < row_ptr[r + 1]; ++x) {
      const KeyRange& k = ranges[x];
      if (k.begin < 0 || k.end > len_k || k.begin >= k.end || k.begin < prev) bad("key range");
      if ((k.q_lo != 0 || k.q_hi != 0) && (k.full || k.q_first(m) >= k.q_last(m))) bad("query rows of a key range");
      prev = k.end;
    }
  }
}

// ---- Pattern --------------------------------------------------------------------------------------------------

const Pattern::Node& Pattern::node() const {
  check(node_ != nullptr, ErrorKind::kInvalidArgument, "pattern: expected a pattern, got an empty Pattern");
  return *node_;
}

bool Pattern::allowed(int64_t, int64_t h, int64_t i, int64_t j, int64_t len_q, int64_t len_k) const {
  if (node().contains_adaptive())  // (the message is built only on failure: this runs once per pair)
    fail(ErrorKind::kInvalidArgument, "pattern ", repr(),
         ": a content-adaptive pattern has no fixed element predicate");
  return node().allowed(h, i, j, len_q, len_k);
}

void Pattern::check_lengths(int64_t len_q, int64_t len_k) const {
  if (node().contains_adaptive())
    fail(ErrorKind::kInvalidArgument, "pattern ", repr(),
         ": a content-adaptive pattern has no fixed mask (run it through sparse_attention and use the returned "
         "indices)");
  check_len32(len_q, "Lq");
  check_len32(len_k, "Lk");
  node().check_lengths(len_q, len_k);
}

BlockMask Pattern::block_mask(int64_t len_q, int64_t len_k, int64_t heads, int64_t block) const {
  check(heads >= 1, ErrorKind::kInvalidArgument, "heads: expected >= 1, got ", heads);
  check(block >= 1 && block <= (1 << 16), ErrorKind::kInvalidArgument, "block: expected 1..65536, got ", block);
  check_lengths(len_q, len_k);
  return node().block_mask(len_q, len_k, heads, block);
}

Tensor Pattern::dense_mask(int64_t len_q, int64_t len_k, int64_t heads) const {
  check_lengths(len_q, len_k);
  check(heads >= 1, ErrorKind::kInvalidArgument, "heads: expected >= 1, got ", heads);
  const int64_t slots = head_dependent() ? heads : 1;
  Tensor t(DType::kBool, {slots, len_q, len_k});
  auto* d = t.data<uint8_t>();
  for (int64_t h = 0; h < slots; ++h)
    for (int64_t i = 0; i < len_q; ++i)
      for (int64_t j = 0; j < len_k; ++j) d[(h * len_q + i) * len_k + j] = node().allowed(h, i, j, len_q, len_k);
  return t;
}

bool Pattern::head_dependent() const { return node().head_dependent(); }
std::string Pattern::repr() const { return node().repr(); }

// ---- Full, union / intersection ------------------------------------------------------------------------------

namespace {

struct FullNode final : Pattern::Node {
  std::string repr() const override { return "Full()"; }
  bool allowed(int64_t, int64_t, int64_t, int64_t, int64_t) const override { return true; }
  void ranges_for(int64_t, int64_t, int64_t, int64_t, int64_t lk, int64_t block,
                  std::vector<KeyRange>& out) const override {
    detail::emit_range(out, 0, lk, true, block);
  }
};

// ---- Union / intersection ------------------------------------------------------------------------------------

// A union or intersection. A chain of the same operator on the left (((a | b) | c) | d, what `a | b | c | d` and
// repeated `p = p | x` build) can be as long as memory allows: it is walked and freed with loops, never by
// recursion; every other link adds 1 to the depth (kMaxPatternDepth), which bounds the recursion.
struct CombineNode final : Pattern::Node {
  Pattern a, b;
  char op;                   // '|' or '&'
  const CombineNode* chain;  // a's node when it is a CombineNode with the same operator, else null
  bool any_head_dependent, any_adaptive, has_window2d;
  int64_t w2d_width = 0, w2d_window = 0;  // the first WindowAttention2D's, left to right

  CombineNode(Pattern a_, Pattern b_, char o) : a(std::move(a_)), b(std::move(b_)), op(o) {
    const auto* left = dynamic_cast<const CombineNode*>(&a.node());
    chain = left && left->op == op ? left : nullptr;
    depth = std::max(chain ? a.node().depth : a.node().depth + 1, b.node().depth + 1);
    any_head_dependent = a.head_dependent() || b.head_dependent();
    any_adaptive = a.node().contains_adaptive() || b.node().contains_adaptive();
    has_window2d = a.node().window2d(w2d_width, w2d_window) || b.node().window2d(w2d_width, w2d_window);
  }
  ~CombineNode() override {
    // Frees the left operands one after the other: a CombineNode whose last owner is this chain gives up its own
    // left operand before it is freed, so no destructor recurses along the chain.
    Pattern next = std::move(a);
    while (next.defined() && next.node_ptr().use_count() == 1) {
      auto* left = const_cast<CombineNode*>(dynamic_cast<const CombineNode*>(&next.node()));
      if (!left) break;
      Pattern after = std::move(left->a);
      next = std::move(after);
    }
  }
  // The operands of the chain this node ends, left to right: a1 op a2 op ... op an.
  std::vector<const Pattern*> operands() const {
    std::vector<const Pattern*> v;
    const CombineNode* n = this;
    for (; n->chain; n = n->chain) v.push_back(&n->b);
    v.push_back(&n->b);
    v.push_back(&n->a);
    std::reverse(v.begin(), v.end());
    return v;
  }
  int precedence() const override { return op == '|' ? 2 : 1; }
  std::string repr() const override {
    const int p = precedence();
    const auto ops = operands();
    std::string s;
    for (size_t x = 0; x < ops.size(); ++x) {
      const int q = ops[x]->node().precedence();
      if (x > 0) s += op == '|' ? " | " : " & ";
      // (the first operand needs parentheses only for a looser operator; the others also for the same one)
      const bool parenthesize = x == 0 ? q > p : q >= p;
      if (parenthesize) s += '(';
      s += ops[x]->repr();
      if (parenthesize) s += ')';
    }
    return s;
  }
  bool head_dependent() const override { return any_head_dependent; }
  bool window2d(int64_t& w, int64_t& win) const override {
    if (has_window2d) w = w2d_width, win = w2d_window;
    return has_window2d;
  }
  bool contains_adaptive() const override { return any_adaptive; }
  void check_lengths(int64_t lq, int64_t lk) const override {
    for (const Pattern* x : operands()) x->node().check_lengths(lq, lk);
  }
  // Right to left along the chain, stopping at the first operand that decides (no allocation: this runs per pair).
  bool allowed(int64_t h, int64_t i, int64_t j, int64_t lq, int64_t lk) const override {
    const bool decides = op == '|';
    const CombineNode* n = this;
    for (; n->chain; n = n->chain)
      if (n->b.node().allowed(h, i, j, lq, lk) == decides) return decides;
    if (n->b.node().allowed(h, i, j, lq, lk) == decides) return decides;
    return n->a.node().allowed(h, i, j, lq, lk);
  }
  void ranges_for(int64_t h, int64_t q0, int64_t q1, int64_t lq, int64_t lk, int64_t block,
                  std::vector<KeyRange>& out) const override {
    const auto ops = operands();
    std::vector<KeyRange> acc, next;
    ops[0]->node().ranges_for(h, q0, q1, lq, lk, block, acc);
    for (size_t x = 1; x < ops.size(); ++x) {
      next.clear();
      ops[x]->node().ranges_for(h, q0, q1, lq, lk, block, next);
      acc = detail::merge_ranges(acc, next, op, block);
    }
    out.insert(out.end(), acc.begin(), acc.end());
  }
};

}  // namespace

// ---- constructors -------------------------------------------------------------------------------------------------

namespace {

std::shared_ptr<const Pattern::Node> combine_node(const Pattern& a, const Pattern& b, char op) {
  const char* what = op == '|' ? "pattern |" : "pattern &";
  check(a.defined() && b.defined(), ErrorKind::kInvalidArgument, what, ": both operands must be patterns");
  auto node = std::make_shared<CombineNode>(a, b, op);
  check_depth(what, *node);
  return node;
}

}  // namespace

Full::Full() : Pattern(std::make_shared<FullNode>()) {}

Pattern operator|(const Pattern& a, const Pattern& b) { return Pattern(combine_node(a, b, '|')); }
Pattern operator&(const Pattern& a, const Pattern& b) { return Pattern(combine_node(a, b, '&')); }

// ---- dense -> block mask ----------------------------------------------------------------------------------------

BlockMask block_mask_from_dense(const TensorView& mask, int64_t block_q, int64_t block_k) {
  check(mask.dtype == DType::kBool, ErrorKind::kTypeError, "mask: expected bool (True = may attend), got ",
        to_string(mask.dtype));
  check(mask.dim() == 2 || mask.dim() == 3, ErrorKind::kInvalidArgument, "mask: expected [Lq, Lk] or [H, Lq, Lk], got ",
        shape_text(mask.shape));
  check(block_q >= 1 && block_k >= 1, ErrorKind::kInvalidArgument, "block: expected >= 1, got ", block_q, ", ",
        block_k);
  const int64_t off = mask.dim() - 2;
  const int64_t heads = mask.dim() == 3 ? mask.shape[0] : 1, lq = mask.shape[off], lk = mask.shape[off + 1];
  check(heads >= 1 && lq >= 1 && lk >= 1, ErrorKind::kInvalidArgument, "mask: zero-size dimension in ",
        shape_text(mask.shape));
  check_len32(lq, "mask Lq");
  check_len32(lk, "mask Lk");
  const int64_t sh = mask.dim() == 3 ? mask.strides[0] : 0, si = mask.strides[off], sj = mask.strides[off + 1];
  const auto* d = static_cast<const uint8_t*>(mask.data);
  return detail::build_identity_layout(
      lq, lk, heads, detail::grid_bounds(lq, block_q),
      [&](int64_t h, int64_t q0, int64_t q1, std::vector<KeyRange>& out) {
        for (int64_t k0 = 0; k0 < lk; k0 += block_k) {
          const int64_t k1 = std::min(lk, k0 + block_k);
          int64_t count = 0;
          for (int64_t i = q0; i < q1; ++i)
            for (int64_t j = k0; j < k1; ++j) count += d[h * sh + i * si + j * sj] ? 1 : 0;
          if (count > 0) out.push_back({int32_t(k0), int32_t(k1), uint8_t(count == (q1 - q0) * (k1 - k0))});
        }
      });
}

}  // namespace sattn::sparse

namespace sattn::sparse {

void split_adaptive(const Pattern& p, const AdaptiveNode*& adaptive, Pattern& fixed) {
  adaptive = nullptr;
  fixed = Pattern();
  const Pattern::Node& n = p.node();
  if (!n.contains_adaptive()) {
    fixed = p;
    return;
  }
  if (const auto* a = dynamic_cast<const AdaptiveNode*>(&n)) {
    adaptive = a;
    return;
  }
  if (const auto* c = dynamic_cast<const CombineNode*>(&n); c && c->op == '&') {
    const bool la = c->a.node().contains_adaptive(), lb = c->b.node().contains_adaptive();
    const Pattern& ad = la ? c->a : c->b;
    if (la != lb) {
      if (const auto* a = dynamic_cast<const AdaptiveNode*>(&ad.node())) {
        adaptive = a;
        fixed = la ? c->b : c->a;
        return;
      }
    }
  }
  fail(ErrorKind::kInvalidArgument, "pattern ", p.repr(),
       ": a content-adaptive pattern (TopK, BlockTopK, ReLUAttention, MixedAttention) can only be used alone or "
       "intersected with fixed patterns ('adaptive & fixed')");
}

}  // namespace sattn::sparse
