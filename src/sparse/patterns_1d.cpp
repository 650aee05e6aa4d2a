// The 1-D fixed patterns: SlidingWindow, Dilated, BlockLocal, GlobalTokens, BigBird (element predicates and block
// masks; see include/sattn/patterns.hpp).
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <set>

#include "sattn/error.hpp"
#include "sattn/random.hpp"
#include "sparse/pattern_node.hpp"

namespace sattn::sparse {

using namespace detail;  // the pattern helpers of pattern_node.hpp

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
  GlobalTokensNode(std::vector<int64_t> idx, Pattern b, Alignment a)
      : indices(std::move(idx)), base(std::move(b)), al(a) {
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
      auto draw = [&](uint32_t step) { return philox4x32_10({step, uint32_t(qb), uint32_t(h), 0xB16B1Du}, key)[0]; };
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
      for (int64_t kb : key_blocks(h, t, nkb))
        detail::emit_range(one, kb * blk, std::min(lk, (kb + 1) * blk), true, block);
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

}  // namespace

// ---- constructors -------------------------------------------------------------------------------------------------

namespace {

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

}  // namespace sattn::sparse
