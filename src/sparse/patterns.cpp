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

namespace {

int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
int64_t floor_mod(int64_t a, int64_t b) { return a - floor_div(a, b) * b; }

// Ends of the query blocks: at most `block` queries each, and a block also ends wherever the aligned query index
// i + off crosses a multiple of the pattern's block `blk`, so that every visited tile is full.
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

}  // namespace

// ---- detail helpers -----------------------------------------------------------------------------------------

namespace detail {

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
    else
      out.push_back({int32_t(s), int32_t(e), uint8_t(full)});
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
    fail(ErrorKind::kInvalidArgument, "pattern ", repr(), ": a content-adaptive pattern has no fixed element predicate");
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

// ---- SlidingWindow --------------------------------------------------------------------------------------------

namespace {

struct SlidingWindowNode final : Pattern::Node {
  int64_t left, right;
  Alignment al;
  SlidingWindowNode(int64_t l, int64_t r, Alignment a) : left(l), right(r), al(a) {}
  std::string repr() const override {
    return sattn::message::concat("SlidingWindow(", left, ", ", right, alignment_suffix(al), ")");
  }
  bool allowed(int64_t, int64_t i, int64_t j, int64_t lq, int64_t lk) const override {
    const int64_t a = i + align_offset(al, lq, lk);
    return (left < 0 || j >= a - left) && (right < 0 || j <= a + right);
  }
  bool layout_interval(int64_t, int64_t i, int64_t, int64_t, int64_t lq, int64_t lk, int64_t& lo,
                       int64_t& hi) const override {
    const int64_t a = i + align_offset(al, lq, lk);
    lo = left < 0 ? 0 : a - left;
    hi = right < 0 ? lk : a + right + 1;
    return true;
  }
  // Allowed keys of aligned query a: [lo(a), hi(a)] (inclusive, clipped), both non-decreasing in a.
  int64_t lo(int64_t a) const { return left < 0 ? 0 : std::max<int64_t>(0, a - left); }
  int64_t hi(int64_t a, int64_t lk) const { return right < 0 ? lk - 1 : std::min(lk - 1, a + right); }
  void ranges_for(int64_t, int64_t q0, int64_t q1, int64_t lq, int64_t lk, int64_t block,
                  std::vector<KeyRange>& out) const override {
    const int64_t off = align_offset(al, lq, lk), a0 = q0 + off, a1 = q1 - 1 + off;
    const int64_t u0 = lo(a0), u1 = hi(a1, lk);  // union of the rows' intervals
    if (u0 > u1) return;
    const int64_t f0 = lo(a1), f1 = hi(a0, lk);  // intersection: keys allowed for every row
    if (f0 > f1) {
      detail::emit_range(out, u0, u1 + 1, false, block);
      return;
    }
    detail::emit_range(out, u0, f0, false, block);
    detail::emit_range(out, f0, f1 + 1, true, block);
    detail::emit_range(out, f1 + 1, u1 + 1, false, block);
  }
};

// ---- Dilated ----------------------------------------------------------------------------------------------------

struct DilatedNode final : Pattern::Node {
  int64_t window, dilation;
  Alignment al;
  DilatedNode(int64_t w, int64_t d, Alignment a) : window(w), dilation(d), al(a) {}
  std::string repr() const override {
    return sattn::message::concat("Dilated(", window, ", ", dilation, alignment_suffix(al), ")");
  }
  bool allowed(int64_t, int64_t i, int64_t j, int64_t lq, int64_t lk) const override {
    const int64_t diff = i + align_offset(al, lq, lk) - j;
    return std::abs(diff) <= window * dilation && floor_mod(diff, dilation) == 0;
  }
  // In the residue layout (see block_mask): residue r's keys sit at [key_start(r), key_start(r) + key_count(r)).
  int64_t key_start(int64_t r, int64_t lk) const { return r * (lk / dilation) + std::min(r, lk % dilation); }
  int64_t key_count(int64_t r, int64_t lk) const { return lk / dilation + (r < lk % dilation ? 1 : 0); }
  bool layout_interval(int64_t, int64_t i, int64_t, int64_t, int64_t lq, int64_t lk, int64_t& lo,
                       int64_t& hi) const override {
    const int64_t d = dilation, a = i + align_offset(al, lq, lk), r = floor_mod(a, d), c = floor_div(a, d);
    const int64_t start = key_start(r, lk), count = key_count(r, lk);
    lo = start + std::max<int64_t>(0, c - window);
    hi = start + std::min(count, c + window + 1);
    if (hi < lo) hi = lo;
    return true;
  }
  void key_hull(int64_t, int64_t q0, int64_t q1, int64_t lq, int64_t lk, int64_t& k0, int64_t& k1) const override {
    const int64_t off = align_offset(al, lq, lk);
    k0 = q0 + off - window * dilation;
    k1 = q1 - 1 + off + window * dilation + 1;
  }
  // Layout: queries and keys grouped by residue r = position mod dilation (queries by their aligned position);
  // inside residue r, compressed positions a' = floor(a / d), j' = floor(j / d) and the pattern is the sliding
  // window |a' - j'| <= window, so every tile is dense.
  BlockMask block_mask(int64_t lq, int64_t lk, int64_t, int64_t block) const override {
    const int64_t d = dilation, off = align_offset(al, lq, lk);
    BlockMask m;
    m.len_q = lq;
    m.len_k = lk;
    m.heads = 1;
    for (int64_t r = 0; r < std::min(d, lk); ++r)
      for (int64_t j = r; j < lk; j += d) m.k_perm.push_back(int32_t(j));
    // The residues that hold queries, ascending: all of them when d <= Lq, else the Lq distinct ones of the
    // queries (so the work stays O(Lq + Lk) for any dilation).
    std::vector<int64_t> residues;
    if (d <= lq) {
      residues.resize(size_t(d));
      std::iota(residues.begin(), residues.end(), int64_t(0));
    } else {
      for (int64_t i = 0; i < lq; ++i) residues.push_back(floor_mod(i + off, d));
      std::sort(residues.begin(), residues.end());
    }
    m.q_block_start.push_back(0);
    m.row_ptr.push_back(0);
    for (int64_t r : residues) {
      // Queries with floor_mod(i + off, d) == r, in increasing order.
      const int64_t first = floor_mod(r - off, d);
      const int64_t group_begin = int64_t(m.q_perm.size());
      for (int64_t i = first; i < lq; i += d) m.q_perm.push_back(int32_t(i));
      const int64_t group_end = int64_t(m.q_perm.size());
      const int64_t nk = key_count(r, lk);
      for (int64_t p0 = group_begin; p0 < group_end; p0 += block) {
        const int64_t p1 = std::min(group_end, p0 + block);
        const int64_t c0 = floor_div(m.q_perm[p0] + off, d), c1 = floor_div(m.q_perm[p1 - 1] + off, d);
        // Sliding window (window, window) over compressed keys [0, nk).
        const int64_t u0 = std::max<int64_t>(0, c0 - window), u1 = std::min(nk - 1, c1 + window);
        const int64_t f0 = std::max<int64_t>(0, c1 - window), f1 = std::min(nk - 1, c0 + window);
        const int64_t base = key_start(r, lk);
        if (u0 <= u1) {
          if (f0 > f1) {
            detail::emit_range(m.ranges, base + u0, base + u1 + 1, false, block);
          } else {
            detail::emit_range(m.ranges, base + u0, base + f0, false, block);
            detail::emit_range(m.ranges, base + f0, base + f1 + 1, true, block);
            detail::emit_range(m.ranges, base + f1 + 1, base + u1 + 1, false, block);
          }
        }
        m.q_block_start.push_back(int32_t(p1));
        m.row_ptr.push_back(int64_t(m.ranges.size()));
      }
    }
    if (lq == 0) m.q_block_start = {0};
    return m;
  }
};

// ---- BlockLocal -----------------------------------------------------------------------------------------------

struct BlockLocalNode final : Pattern::Node {
  int64_t blk;
  Alignment al;
  BlockLocalNode(int64_t b, Alignment a) : blk(b), al(a) {}
  std::string repr() const override { return sattn::message::concat("BlockLocal(", blk, alignment_suffix(al), ")"); }
  bool allowed(int64_t, int64_t i, int64_t j, int64_t lq, int64_t lk) const override {
    return floor_div(i + align_offset(al, lq, lk), blk) == floor_div(j, blk);
  }
  void ranges_for(int64_t, int64_t q0, int64_t q1, int64_t lq, int64_t lk, int64_t block,
                  std::vector<KeyRange>& out) const override {
    const int64_t off = align_offset(al, lq, lk);
    const int64_t t0 = floor_div(q0 + off, blk), t1 = floor_div(q1 - 1 + off, blk);
    for (int64_t t = t0; t <= t1; ++t) {
      const int64_t lo = std::max<int64_t>(0, t * blk), hi = std::min(lk, (t + 1) * blk);
      detail::emit_range(out, lo, hi, t0 == t1, block);
    }
  }
  // Query blocks end where the pattern's blocks end, so every visited tile is full.
  BlockMask block_mask(int64_t lq, int64_t lk, int64_t, int64_t block) const override {
    const int64_t off = align_offset(al, lq, lk);
    const std::vector<int32_t> bounds = block_aligned_bounds(lq, off, blk, block);
    return detail::build_identity_layout(lq, lk, 1, bounds,
                                         [&](int64_t s, int64_t q0, int64_t q1, std::vector<KeyRange>& out) {
                                           ranges_for(s, q0, q1, lq, lk, block, out);
                                         });
  }
};

// ---- GlobalTokens ------------------------------------------------------------------------------------------

struct GlobalTokensNode final : Pattern::Node {
  std::vector<int64_t> indices;  // sorted, unique
  Pattern base;
  Alignment al;
  GlobalTokensNode(std::vector<int64_t> idx, Pattern b, Alignment a) : indices(std::move(idx)), base(std::move(b)), al(a) {
    depth = base.node().depth + 1;
  }
  std::string repr() const override {
    std::string s = "GlobalTokens([";
    for (size_t x = 0; x < indices.size(); ++x) s += (x ? ", " : "") + std::to_string(indices[x]);
    return s + "], " + base.repr() + alignment_suffix(al) + ")";
  }
  bool head_dependent() const override { return base.head_dependent(); }
  bool contains_adaptive() const override { return base.node().contains_adaptive(); }
  bool window2d(int64_t& w, int64_t& win) const override { return base.node().window2d(w, win); }
  void check_lengths(int64_t lq, int64_t lk) const override { base.node().check_lengths(lq, lk); }
  bool is_global(int64_t pos) const { return std::binary_search(indices.begin(), indices.end(), pos); }
  bool allowed(int64_t h, int64_t i, int64_t j, int64_t lq, int64_t lk) const override {
    return is_global(i + align_offset(al, lq, lk)) || is_global(j) || base.node().allowed(h, i, j, lq, lk);
  }
  void ranges_for(int64_t h, int64_t q0, int64_t q1, int64_t lq, int64_t lk, int64_t block,
                  std::vector<KeyRange>& out) const override {
    std::vector<KeyRange> b;
    base.node().ranges_for(h, q0, q1, lq, lk, block, b);
    const int64_t off = align_offset(al, lq, lk);
    const auto lo = std::lower_bound(indices.begin(), indices.end(), q0 + off);
    const auto hi = std::lower_bound(indices.begin(), indices.end(), q1 + off);
    const int64_t n_global_q = hi - lo;
    // Global keys are allowed for every query (full); global queries allow every key.
    std::vector<KeyRange> g;
    for (int64_t j : indices)
      if (j < lk) detail::emit_range(g, j, j + 1, true, block);
    auto merged = detail::merge_ranges(b, g, '|', block);
    if (n_global_q > 0) {
      std::vector<KeyRange> all;
      detail::emit_range(all, 0, lk, n_global_q == q1 - q0, block);
      merged = detail::merge_ranges(merged, all, '|', block);
    }
    out.insert(out.end(), merged.begin(), merged.end());
  }
  // Global queries get query blocks of their own, so that the other blocks keep the base's structure.
  BlockMask block_mask(int64_t lq, int64_t lk, int64_t heads, int64_t block) const override {
    const int64_t off = align_offset(al, lq, lk);
    std::vector<int32_t> bounds;
    int64_t start = 0;
    for (int64_t i = 1; i <= lq; ++i)
      if (i == lq || i - start == block || floor_mod(i, block) == 0 || is_global(i + off) != is_global(i - 1 + off)) {
        bounds.push_back(int32_t(i));
        start = i;
      }
    if (lq == 0) bounds.push_back(0);
    const int64_t slots = head_dependent() ? heads : 1;
    return detail::build_identity_layout(lq, lk, slots, bounds,
                                         [&](int64_t s, int64_t q0, int64_t q1, std::vector<KeyRange>& out) {
                                           ranges_for(s, q0, q1, lq, lk, block, out);
                                         });
  }
};

// ---- BigBird ----------------------------------------------------------------------------------------------------

struct BigBirdNode final : Pattern::Node {
  int64_t blk, window_blocks, global_blocks, random_blocks;
  uint64_t seed;
  Alignment al;
  BigBirdNode(int64_t b, int64_t w, int64_t g, int64_t r, uint64_t s, Alignment a)
      : blk(b), window_blocks(w), global_blocks(g), random_blocks(r), seed(s), al(a) {}
  std::string repr() const override {
    return sattn::message::concat("BigBird(", blk, ", ", window_blocks, ", ", global_blocks, ", ", random_blocks,
                                  seed != 0 ? sattn::message::concat(", seed=", seed) : std::string(),
                                  alignment_suffix(al), ")");
  }
  bool head_dependent() const override { return random_blocks > 0; }
  int64_t win_lo(int64_t qb) const { return qb - window_blocks / 2; }
  int64_t win_hi(int64_t qb) const { return qb + (window_blocks - 1) / 2; }
  bool is_candidate(int64_t qb, int64_t kb) const {
    return kb >= global_blocks && (kb < win_lo(qb) || kb > win_hi(qb));
  }
  // Sorted key blocks of query block qb for head h (all blocks when qb is global).
  std::vector<int64_t> key_blocks(int64_t h, int64_t qb, int64_t nkb) const {
    std::vector<int64_t> kbs;
    if (qb >= 0 && qb < global_blocks) {
      for (int64_t kb = 0; kb < nkb; ++kb) kbs.push_back(kb);
      return kbs;
    }
    for (int64_t kb = 0; kb < std::min(global_blocks, nkb); ++kb) kbs.push_back(kb);
    for (int64_t kb = std::max<int64_t>(win_lo(qb), 0); kb <= std::min(win_hi(qb), nkb - 1); ++kb) kbs.push_back(kb);
    if (random_blocks > 0) {
      // Random blocks: a pure function of (seed, head, qb). Few candidates: a seeded partial Fisher-Yates over
      // the list; many: rejection sampling (acceptance > 3/4).
      const std::array<uint32_t, 2> key = {uint32_t(seed), uint32_t(seed >> 32)};
      auto draw = [&](uint32_t step) {
        return philox4x32_10({step, uint32_t(qb), uint32_t(h), 0xB16B1Du}, key)[0];
      };
      std::vector<int64_t> picks;
      if (nkb <= 4 * (random_blocks + window_blocks + global_blocks)) {
        std::vector<int64_t> cand;
        for (int64_t kb = 0; kb < nkb; ++kb)
          if (is_candidate(qb, kb)) cand.push_back(kb);
        const int64_t n = std::min<int64_t>(random_blocks, int64_t(cand.size()));
        for (int64_t x = 0; x < n; ++x) {
          const int64_t y = x + int64_t(draw(uint32_t(x)) % uint32_t(cand.size() - x));
          std::swap(cand[x], cand[y]);
          picks.push_back(cand[x]);
        }
      } else {
        uint32_t step = 0;
        while (int64_t(picks.size()) < random_blocks) {
          const int64_t kb = int64_t(draw(step++) % uint32_t(nkb));
          if (is_candidate(qb, kb) && std::find(picks.begin(), picks.end(), kb) == picks.end()) picks.push_back(kb);
        }
      }
      kbs.insert(kbs.end(), picks.begin(), picks.end());
    }
    std::sort(kbs.begin(), kbs.end());
    kbs.erase(std::unique(kbs.begin(), kbs.end()), kbs.end());
    return kbs;
  }
  bool allowed(int64_t h, int64_t i, int64_t j, int64_t lq, int64_t lk) const override {
    const int64_t qb = floor_div(i + align_offset(al, lq, lk), blk), kb = j / blk;
    if ((qb >= 0 && qb < global_blocks) || kb < global_blocks) return true;
    if (kb >= win_lo(qb) && kb <= win_hi(qb)) return true;
    const auto kbs = key_blocks(h, qb, (lk + blk - 1) / blk);
    return std::binary_search(kbs.begin(), kbs.end(), kb);
  }
  void ranges_for(int64_t h, int64_t q0, int64_t q1, int64_t lq, int64_t lk, int64_t block,
                  std::vector<KeyRange>& out) const override {
    const int64_t off = align_offset(al, lq, lk), nkb = (lk + blk - 1) / blk;
    const int64_t t0 = floor_div(q0 + off, blk), t1 = floor_div(q1 - 1 + off, blk);
    std::vector<KeyRange> acc;
    for (int64_t t = t0; t <= t1; ++t) {
      std::vector<KeyRange> one;
      for (int64_t kb : key_blocks(h, t, nkb)) detail::emit_range(one, kb * blk, std::min(lk, (kb + 1) * blk), true, block);
      acc = t == t0 ? one : detail::merge_ranges(acc, one, '|', block);
    }
    if (t0 != t1)  // rows of different pattern blocks: only the global keys are allowed for all of them
      for (auto& r : acc) r.full = r.end <= global_blocks * blk;
    out.insert(out.end(), acc.begin(), acc.end());
  }
  BlockMask block_mask(int64_t lq, int64_t lk, int64_t heads, int64_t block) const override {
    const int64_t off = align_offset(al, lq, lk);
    const std::vector<int32_t> bounds = block_aligned_bounds(lq, off, blk, block);
    const int64_t slots = head_dependent() ? heads : 1;
    return detail::build_identity_layout(lq, lk, slots, bounds,
                                         [&](int64_t s, int64_t q0, int64_t q1, std::vector<KeyRange>& out) {
                                           ranges_for(s, q0, q1, lq, lk, block, out);
                                         });
  }
};

// ---- 2-D grids ---------------------------------------------------------------------------------------------

void check_grid(const char* name, int64_t height, int64_t width, int64_t lq, int64_t lk) {
  check(lq == height * width && lk == height * width, ErrorKind::kInvalidArgument, name,
        ": expected Lq = Lk = height * width = ", height * width, ", got Lq = ", lq, ", Lk = ", lk);
}

struct Neighborhood2DNode final : Pattern::Node {
  int64_t height, width, kernel, dilation;
  bool causal;
  Neighborhood2DNode(int64_t h, int64_t w, int64_t k, int64_t d, bool c)
      : height(h), width(w), kernel(k), dilation(d), causal(c) {}
  std::string repr() const override {
    std::string s = sattn::message::concat("Neighborhood2D(", height, ", ", width, ", ", kernel);
    if (dilation != 1) s += sattn::message::concat(", dilation=", dilation);
    if (causal) s += ", causal=True";
    return s + ")";
  }
  void check_lengths(int64_t lq, int64_t lk) const override { check_grid("Neighborhood2D", height, width, lq, lk); }
  // Positions of residue r along an axis of length n.
  int64_t sub_len(int64_t n, int64_t r) const { return (n - r + dilation - 1) / dilation; }
  // NATTEN's window along one axis, in sub-grid coordinates: [start, end] for index x of a sub-axis of length n.
  void window(int64_t x, int64_t n, int64_t& start, int64_t& end) const {
    if (causal) {
      start = std::max<int64_t>(0, x - kernel + 1);
      end = x;
    } else {
      start = std::clamp<int64_t>(x - kernel / 2, 0, n - kernel);
      end = start + kernel - 1;
    }
  }
  bool axis_allows(int64_t x, int64_t y, int64_t n) const {
    if (x % dilation != y % dilation) return false;
    const int64_t r = x % dilation;
    int64_t s, e;
    window(x / dilation, sub_len(n, r), s, e);
    return y / dilation >= s && y / dilation <= e;
  }
  bool allowed(int64_t, int64_t i, int64_t j, int64_t, int64_t) const override {
    return axis_allows(i / width, j / width, height) && axis_allows(i % width, j % width, width);
  }
  // In the sub-grid layout (see block_mask) every range piece lies inside one key row of one sub-grid.
  bool layout_interval(int64_t, int64_t i, int64_t kp0, int64_t, int64_t, int64_t, int64_t& lo,
                       int64_t& hi) const override {
    const int64_t d = dilation;
    if (d == 1) {  // the common case, once per (query row, partial segment): 32-bit arithmetic, no calls
      const int32_t w = int32_t(width), kr = int32_t(kp0) / w, r = int32_t(i) / w, c = int32_t(i) - r * w;
      const int32_t k = int32_t(kernel);
      int32_t rs, re, cs, ce;
      if (causal) {
        rs = std::max(0, r - k + 1), re = r, cs = std::max(0, c - k + 1), ce = c;
      } else {
        rs = std::clamp(r - k / 2, 0, int32_t(height) - k), re = rs + k - 1;
        cs = std::clamp(c - k / 2, 0, w - k), ce = cs + k - 1;
      }
      lo = hi = kp0;
      if (kr < rs || kr > re) return true;
      lo = int64_t(kr) * w + cs;
      hi = int64_t(kr) * w + ce + 1;
      return true;
    }
    int64_t base = 0, dr = 0, dc = 0, nr = 0, nc = 0;
    for (dr = 0; dr < d; ++dr) {
      for (dc = 0; dc < d; ++dc) {
        nr = sub_len(height, dr);
        nc = sub_len(width, dc);
        if (kp0 < base + nr * nc) break;
        base += nr * nc;
      }
      if (dc < d) break;
    }
    const int64_t kr = (kp0 - base) / nc, r = i / width, c = i % width;
    lo = hi = kp0;
    if (r % d != dr || c % d != dc) return true;  // another sub-grid: nothing allowed
    int64_t rs, re, cs, ce;
    window(r / d, nr, rs, re);
    if (kr < rs || kr > re) return true;
    window(c / d, nc, cs, ce);
    lo = base + kr * nc + cs;
    hi = base + kr * nc + ce + 1;
    return true;
  }
  void key_hull(int64_t, int64_t q0, int64_t q1, int64_t, int64_t lk, int64_t& k0, int64_t& k1) const override {
    const int64_t reach = kernel * dilation;
    k0 = std::max<int64_t>(0, (q0 / width - reach) * width);
    k1 = std::min(lk, ((q1 - 1) / width + reach + 1) * width);
  }
  // Layout: the d x d sub-grids one after another; keys row-major inside a sub-grid, queries in tiles of
  // th x tw. A tile visits, for each key row its rows' windows reach, one column segment (split into the
  // part every column's window contains, which is full when the row is in every row's window, and the rest).
  BlockMask block_mask(int64_t lq, int64_t lk, int64_t, int64_t block) const override {
    const int64_t d = dilation;
    // Query tiles of th x tw with th * tw = block: tw is the smallest width >= 2 whose key row segments
    // (tw + kernel - 1 columns) are a multiple of 8 keys, so that every chunk fills whole 8-lane vectors of the tile
    // operations (keys are in lanes; a ragged end runs scalar) and the column waste (tw + kernel - 1) / kernel stays
    // small (kernel 7: 2 x 32 tiles, 8 columns, 1.14); the rows cost nothing extra since each key row is computed
    // only for the tile rows that reach it (see the grouping below).
    int64_t tw = 2;
    while ((tw + kernel - 1) % 8 != 0) ++tw;
    tw = std::max<int64_t>(1, std::min(tw, block));
    const int64_t th = std::max<int64_t>(1, block / tw);
    BlockMask m;
    m.len_q = lq;
    m.len_k = lk;
    m.q_block_start.push_back(0);
    m.row_ptr.push_back(0);
    std::vector<int64_t> kbase, scratch_a, scratch_b, scratch_c, scratch_d, scratch_e;
    const int64_t key_cost = 4, chunk_cost = 300;  // in computed pairs (measured: flat around these)
    for (int64_t dr = 0; dr < d; ++dr)
      for (int64_t dc = 0; dc < d; ++dc) {
        kbase.push_back(int64_t(m.k_perm.size()));
        for (int64_t y = dr; y < height; y += d)
          for (int64_t x = dc; x < width; x += d) m.k_perm.push_back(int32_t(y * width + x));
      }
    for (int64_t dr = 0; dr < d; ++dr)
      for (int64_t dc = 0; dc < d; ++dc) {
        const int64_t nr = sub_len(height, dr), nc = sub_len(width, dc), base = kbase[dr * d + dc];
        for (int64_t r0 = 0; r0 < nr; r0 += th)
          for (int64_t c0 = 0; c0 < nc; c0 += tw) {
            const int64_t r1 = std::min(nr, r0 + th), c1 = std::min(nc, c0 + tw);
            for (int64_t r = r0; r < r1; ++r)
              for (int64_t c = c0; c < c1; ++c) m.q_perm.push_back(int32_t((dr + r * d) * width + dc + c * d));
            int64_t rs0, re0, rs1, re1, cs0, ce0, cs1, ce1;
            window(r0, nr, rs0, re0);
            window(r1 - 1, nr, rs1, re1);
            window(c0, nc, cs0, ce0);
            window(c1 - 1, nc, cs1, ce1);
            // Key rows [rs0, re1] (the union of the tile rows' windows), rows in every window [rs1, re0]; same
            // for columns. Key row kr is reached only by the tile rows [qa[kr], qz[kr]] (windows are monotone).
            const int64_t nkr = re1 - rs0 + 1, ncol = ce1 - cs0 + 1, cw = c1 - c0;
            std::vector<int64_t>& qa = scratch_a;
            std::vector<int64_t>& qz = scratch_b;
            qa.assign(size_t(nkr), r1);
            qz.assign(size_t(nkr), r0 - 1);
            for (int64_t r = r0; r < r1; ++r) {
              int64_t rs, re;
              window(r, nr, rs, re);
              for (int64_t kr = rs; kr <= re; ++kr) {
                qa[size_t(kr - rs0)] = std::min(qa[size_t(kr - rs0)], r);
                qz[size_t(kr - rs0)] = std::max(qz[size_t(kr - rs0)], r);
              }
            }
            // Widens a run of tile rows [a, z] inside the tile until it holds a multiple of 4 queries (the tile
            // operations' row blocking: a ragged rest runs slower than computing a masked extra row).
            auto align_rows = [&](int64_t& a, int64_t& z) {
              while (((z - a + 1) * cw) % 4 != 0 && (z + 1 < r1 || a > r0)) {
                if (z + 1 < r1) ++z;
                else --a;
              }
            };
            // Group consecutive key rows into groups computed for the union of their rows' tile rows: a small
            // dynamic programme over the key rows with cost = computed pairs + key_cost per key + chunk_cost per
            // chunk of `block` keys, so that rows reached by few tile rows are not computed for the whole tile and
            // the engine's chunks stay large enough to amortise their per-chunk work. (A group holds at most 128
            // keys' worth of rows: larger ones never pay, and the programme stays linear in the tile's rows.)
            const int64_t max_group_rows = std::max<int64_t>(1, 128 / ncol);
            std::vector<int64_t>& best = scratch_c;
            std::vector<int64_t>& cut = scratch_d;
            best.assign(size_t(nkr + 1), 0);
            cut.assign(size_t(nkr + 1), 0);
            for (int64_t e = 1; e <= nkr; ++e) {
              best[size_t(e)] = std::numeric_limits<int64_t>::max();
              int64_t lo = r1, hi = r0 - 1;
              for (int64_t g = e - 1; g >= std::max<int64_t>(0, e - max_group_rows); --g) {
                lo = std::min(lo, qa[size_t(g)]);
                hi = std::max(hi, qz[size_t(g)]);
                int64_t a = lo, z = hi;
                align_rows(a, z);
                const int64_t n = (e - g) * ncol, rows = std::max<int64_t>(0, z - a + 1);
                const int64_t cost = best[size_t(g)] + rows * cw * n + key_cost * n + chunk_cost * ((n + block - 1) / block);
                if (cost < best[size_t(e)]) best[size_t(e)] = cost, cut[size_t(e)] = g;
              }
            }
            std::vector<int64_t>& groups = scratch_e;
            groups.clear();
            for (int64_t e = nkr; e > 0; e = cut[size_t(e)]) groups.push_back(e);
            std::reverse(groups.begin(), groups.end());
            int64_t g0 = 0;
            for (int64_t g1 : groups) {
              int64_t lo = r1, hi = r0 - 1;
              for (int64_t x = g0; x < g1; ++x) lo = std::min(lo, qa[size_t(x)]), hi = std::max(hi, qz[size_t(x)]);
              align_rows(lo, hi);
              const bool all_rows = lo <= r0 && hi >= r1 - 1;
              const uint16_t ql = all_rows ? 0 : uint16_t((lo - r0) * cw), qh = all_rows ? 0 : uint16_t((hi - r0 + 1) * cw);
              const size_t first = m.ranges.size();
              for (int64_t kr = rs0 + g0; kr < rs0 + g1; ++kr) {
                if (!all_rows && lo > hi) continue;  // (cannot happen: every key row is reached)
                const bool row_full = all_rows && kr >= rs1 && kr <= re0;
                const int64_t rowbase = base + kr * nc;
                // (a full middle shorter than 32 keys is not worth two more segments per row: each segment costs a
                // copy per chunk and an interval per query row, a partial one costs one interval per query row)
                if (cs1 > ce0 || !row_full || ce0 - cs1 + 1 < 32) {
                  detail::emit_range(m.ranges, rowbase + cs0, rowbase + ce1 + 1, false, block);
                } else {
                  detail::emit_range(m.ranges, rowbase + cs0, rowbase + cs1, false, block);
                  detail::emit_range(m.ranges, rowbase + cs1, rowbase + ce0 + 1, true, block);
                  detail::emit_range(m.ranges, rowbase + ce0 + 1, rowbase + ce1 + 1, false, block);
                }
              }
              for (size_t x = first; x < m.ranges.size(); ++x) m.ranges[x].q_lo = ql, m.ranges[x].q_hi = qh;
              g0 = g1;
            }
            m.q_block_start.push_back(int32_t(m.q_perm.size()));
            m.row_ptr.push_back(int64_t(m.ranges.size()));
          }
      }
    if (d == 1) m.k_perm.clear();  // one sub-grid: keys in their own order (k and v are read in place, not packed)
    return m;
  }
};

struct WindowAttention2DNode final : Pattern::Node {
  int64_t height, width, win, shift;
  WindowAttention2DNode(int64_t h, int64_t w, int64_t win_, int64_t s) : height(h), width(w), win(win_), shift(s) {}
  std::string repr() const override {
    std::string s = sattn::message::concat("WindowAttention2D(", height, ", ", width, ", ", win);
    if (shift != 0) s += sattn::message::concat(", shift=", shift);
    return s + ")";
  }
  void check_lengths(int64_t lq, int64_t lk) const override {
    check_grid("WindowAttention2D", height, width, lq, lk);
  }
  bool window2d(int64_t& w, int64_t& win_) const override {
    w = width;
    win_ = win;
    return true;
  }
  int64_t group(int64_t x) const { return shift == 0 ? x / win : (x < shift ? 0 : (x - shift) / win + 1); }
  // Group boundaries along an axis of length n: [0, s), [s, s+w), ..., [n-w+s, n).
  std::vector<int64_t> bounds(int64_t n) const {
    std::vector<int64_t> b = {0};
    for (int64_t x = shift == 0 ? win : shift; x < n; x += win) b.push_back(x);
    b.push_back(n);
    return b;
  }
  bool allowed(int64_t, int64_t i, int64_t j, int64_t, int64_t) const override {
    return group(i / width) == group(j / width) && group(i % width) == group(j % width);
  }
  void key_hull(int64_t, int64_t q0, int64_t q1, int64_t, int64_t lk, int64_t& k0, int64_t& k1) const override {
    k0 = std::max<int64_t>(0, (q0 / width - win) * width);
    k1 = std::min(lk, ((q1 - 1) / width + win + 1) * width);
  }
  // Layout: tokens grouped window by window (Swin's window partition); each window attends to itself: full tiles.
  BlockMask block_mask(int64_t lq, int64_t lk, int64_t, int64_t block) const override {
    BlockMask m;
    m.len_q = lq;
    m.len_k = lk;
    m.q_block_start.push_back(0);
    m.row_ptr.push_back(0);
    const auto rb = bounds(height), cb = bounds(width);
    for (size_t gr = 0; gr + 1 < rb.size(); ++gr)
      for (size_t gc = 0; gc + 1 < cb.size(); ++gc) {
        const int64_t start = int64_t(m.q_perm.size());
        for (int64_t r = rb[gr]; r < rb[gr + 1]; ++r)
          for (int64_t c = cb[gc]; c < cb[gc + 1]; ++c) m.q_perm.push_back(int32_t(r * width + c));
        const int64_t end = int64_t(m.q_perm.size());
        for (int64_t p = start; p < end; p += block) {
          detail::emit_range(m.ranges, start, end, true, block);
          m.q_block_start.push_back(int32_t(std::min(end, p + block)));
          m.row_ptr.push_back(int64_t(m.ranges.size()));
        }
      }
    m.k_perm = m.q_perm;
    return m;
  }
};

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
  char op;  // '|' or '&'
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

using detail::check_param;

void check_depth(const char* what, const Pattern::Node& node) {
  check(node.depth <= kMaxPatternDepth, ErrorKind::kInvalidArgument, what, ": expected patterns nested at most ",
        kMaxPatternDepth, " deep, got ", node.depth);
}

// Patterns align top-left or bottom-right; Causal::kNone is not an alignment.
void check_alignment(const char* pattern, Alignment al) {
  check(al == Alignment::kTopLeft || al == Alignment::kBottomRight, ErrorKind::kInvalidArgument, pattern,
        ": alignment: expected Causal::kTopLeft or Causal::kBottomRight, got ", to_string(al));
}

std::shared_ptr<const Pattern::Node> sliding_window_node(int64_t left, int64_t right, Alignment al) {
  check_alignment("SlidingWindow", al);
  check_param("SlidingWindow", "left", left, -1, kMaxPatternSize, " (-1 = unbounded)");
  check_param("SlidingWindow", "right", right, -1, kMaxPatternSize, " (-1 = unbounded)");
  return std::make_shared<SlidingWindowNode>(left, right, al);
}

std::shared_ptr<const Pattern::Node> dilated_node(int64_t window, int64_t dilation, Alignment al) {
  check_alignment("Dilated", al);
  check_param("Dilated", "window", window, 0);
  check_param("Dilated", "dilation", dilation, 1);
  return std::make_shared<DilatedNode>(window, dilation, al);
}

std::shared_ptr<const Pattern::Node> block_local_node(int64_t block, Alignment al) {
  check_alignment("BlockLocal", al);
  check_param("BlockLocal", "block", block, 1);
  return std::make_shared<BlockLocalNode>(block, al);
}

std::shared_ptr<const Pattern::Node> global_tokens_node(std::vector<int64_t> indices, const Pattern& base,
                                                        Alignment al) {
  check_alignment("GlobalTokens", al);
  for (int64_t x : indices) check_param("GlobalTokens", "indices", x, 0);
  std::sort(indices.begin(), indices.end());
  indices.erase(std::unique(indices.begin(), indices.end()), indices.end());
  check(base.defined(), ErrorKind::kInvalidArgument, "GlobalTokens: expected a base pattern");
  check(!base.node().contains_adaptive(), ErrorKind::kInvalidArgument,
        "GlobalTokens: the base must be a fixed pattern, got ", [&] { return base.repr(); });
  auto node = std::make_shared<GlobalTokensNode>(std::move(indices), base, al);
  check_depth("GlobalTokens", *node);
  return node;
}

std::shared_ptr<const Pattern::Node> big_bird_node(int64_t block, int64_t window_blocks, int64_t global_blocks,
                                                   int64_t random_blocks, uint64_t seed, Alignment al) {
  check_alignment("BigBird", al);
  check_param("BigBird", "block", block, 1);
  check_param("BigBird", "window_blocks", window_blocks, 0);
  check_param("BigBird", "global_blocks", global_blocks, 0);
  check_param("BigBird", "random_blocks", random_blocks, 0);
  return std::make_shared<BigBirdNode>(block, window_blocks, global_blocks, random_blocks, seed, al);
}

// The grid of the 2-D patterns: Lq = Lk = height * width must stay below 2^31.
void check_grid_size(const char* pattern, int64_t height, int64_t width) {
  check_param(pattern, "height", height, 1);
  check_param(pattern, "width", width, 1);
  check(height <= kMaxPatternSize / width, ErrorKind::kInvalidArgument, pattern, ": expected height * width <= ",
        kMaxPatternSize, ", got ", height * width, " (height = ", height, ", width = ", width, ")");
}

std::shared_ptr<const Pattern::Node> neighborhood_2d_node(int64_t height, int64_t width, int64_t kernel,
                                                          int64_t dilation, bool causal) {
  check_grid_size("Neighborhood2D", height, width);
  check_param("Neighborhood2D", "kernel", kernel, 1);
  check(kernel % 2 == 1, ErrorKind::kInvalidArgument, "Neighborhood2D: expected an odd kernel, got ", kernel);
  check_param("Neighborhood2D", "dilation", dilation, 1);
  check(height >= kernel * dilation && width >= kernel * dilation, ErrorKind::kInvalidArgument,
        "Neighborhood2D: expected height and width >= kernel * dilation = ", kernel * dilation, ", got height = ",
        height, ", width = ", width);
  return std::make_shared<Neighborhood2DNode>(height, width, kernel, dilation, causal);
}

std::shared_ptr<const Pattern::Node> window_attention_2d_node(int64_t height, int64_t width, int64_t window,
                                                              int64_t shift) {
  check_grid_size("WindowAttention2D", height, width);
  check_param("WindowAttention2D", "window", window, 1);
  check(height % window == 0 && width % window == 0, ErrorKind::kInvalidArgument,
        "WindowAttention2D: expected height and width to be positive multiples of window = ", window,
        ", got height = ", height, ", width = ", width);
  check_param("WindowAttention2D", "shift", shift, 0, window - 1);
  return std::make_shared<WindowAttention2DNode>(height, width, window, shift);
}

std::shared_ptr<const Pattern::Node> combine_node(const Pattern& a, const Pattern& b, char op) {
  const char* what = op == '|' ? "pattern |" : "pattern &";
  check(a.defined() && b.defined(), ErrorKind::kInvalidArgument, what, ": both operands must be patterns");
  auto node = std::make_shared<CombineNode>(a, b, op);
  check_depth(what, *node);
  return node;
}

}  // namespace

SlidingWindow::SlidingWindow(int64_t left, int64_t right, Alignment alignment)
    : Pattern(sliding_window_node(left, right, alignment)) {}

Dilated::Dilated(int64_t window, int64_t dilation, Alignment alignment)
    : Pattern(dilated_node(window, dilation, alignment)) {}

BlockLocal::BlockLocal(int64_t block, Alignment alignment) : Pattern(block_local_node(block, alignment)) {}

GlobalTokens::GlobalTokens(std::vector<int64_t> indices, const Pattern& base, Alignment alignment)
    : Pattern(global_tokens_node(std::move(indices), base, alignment)) {}

BigBird::BigBird(int64_t block, int64_t window_blocks, int64_t global_blocks, int64_t random_blocks, uint64_t seed,
                 Alignment alignment)
    : Pattern(big_bird_node(block, window_blocks, global_blocks, random_blocks, seed, alignment)) {}

Neighborhood2D::Neighborhood2D(int64_t height, int64_t width, int64_t kernel, int64_t dilation, bool causal)
    : Pattern(neighborhood_2d_node(height, width, kernel, dilation, causal)) {}

WindowAttention2D::WindowAttention2D(int64_t height, int64_t width, int64_t window, int64_t shift)
    : Pattern(window_attention_2d_node(height, width, window, shift)) {}

Full::Full() : Pattern(std::make_shared<FullNode>()) {}

Pattern operator|(const Pattern& a, const Pattern& b) { return Pattern(combine_node(a, b, '|')); }
Pattern operator&(const Pattern& a, const Pattern& b) { return Pattern(combine_node(a, b, '&')); }

// ---- dense -> block mask ----------------------------------------------------------------------------------------

BlockMask block_mask_from_dense(const TensorView& mask, int64_t block_q, int64_t block_k) {
  check(mask.dtype == DType::kBool, ErrorKind::kTypeError, "mask: expected bool (True = may attend), got ",
        to_string(mask.dtype));
  check(mask.dim() == 2 || mask.dim() == 3, ErrorKind::kInvalidArgument, "mask: expected [Lq, Lk] or [H, Lq, Lk], got ",
        shape_to_string(mask.shape));
  check(block_q >= 1 && block_k >= 1, ErrorKind::kInvalidArgument, "block: expected >= 1, got ", block_q, ", ",
        block_k);
  const int64_t off = mask.dim() - 2;
  const int64_t heads = mask.dim() == 3 ? mask.shape[0] : 1, lq = mask.shape[off], lk = mask.shape[off + 1];
  check(heads >= 1 && lq >= 1 && lk >= 1, ErrorKind::kInvalidArgument, "mask: zero-size dimension in ",
        shape_to_string(mask.shape));
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
