// The 2-D fixed patterns on an image grid of height x width tokens (L = height * width): NATTEN-style
// Neighborhood2D and Swin-style WindowAttention2D (element predicates and block masks; see patterns.hpp).
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

namespace {

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
                const int64_t cost =
                    best[size_t(g)] + rows * cw * n + key_cost * n + chunk_cost * ((n + block - 1) / block);
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
              const uint16_t ql = all_rows ? 0 : uint16_t((lo - r0) * cw),
                             qh = all_rows ? 0 : uint16_t((hi - r0 + 1) * cw);
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
  void check_lengths(int64_t lq, int64_t lk) const override { check_grid("WindowAttention2D", height, width, lq, lk); }
  bool window2d(int64_t& w, int64_t& win_) const override {
    w = width;
    win_ = win;
    return true;
  }
  int64_t group(int64_t x) const { return shift == 0 ? x / win : (x < shift ? 0 : (x - shift) / win + 1); }
  // Group boundaries along an axis of length n: [0, s), [s, s+w), ..., [n-w+s, n) (shifted, non-wrapping windows).
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

}  // namespace

// ---- constructors -------------------------------------------------------------------------------------------------

namespace {

// The grid of the 2-D patterns: Lq = Lk = height * width must stay below 2^31.
void check_grid_size(const char* pattern, int64_t height, int64_t width) {
  check_param(pattern, "height", height, 1);
  check_param(pattern, "width", width, 1);
  check(height <= kMaxPatternSize / width, ErrorKind::kInvalidArgument, pattern,
        ": expected height * width <= ", kMaxPatternSize, ", got ", height * width, " (height = ", height,
        ", width = ", width, ")");
}

std::shared_ptr<const Pattern::Node> neighborhood_2d_node(int64_t height, int64_t width, int64_t kernel,
                                                          int64_t dilation, bool causal) {
  check_grid_size("Neighborhood2D", height, width);
  check_param("Neighborhood2D", "kernel", kernel, 1);
  check(kernel % 2 == 1, ErrorKind::kInvalidArgument, "Neighborhood2D: expected an odd kernel, got ", kernel);
  check_param("Neighborhood2D", "dilation", dilation, 1);
  check(height >= kernel * dilation && width >= kernel * dilation, ErrorKind::kInvalidArgument,
        "Neighborhood2D: expected height and width >= kernel * dilation = ", kernel * dilation,
        ", got height = ", height, ", width = ", width);
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

}  // namespace

Neighborhood2D::Neighborhood2D(int64_t height, int64_t width, int64_t kernel, int64_t dilation, bool causal)
    : Pattern(neighborhood_2d_node(height, width, kernel, dilation, causal)) {}

WindowAttention2D::WindowAttention2D(int64_t height, int64_t width, int64_t window, int64_t shift)
    : Pattern(window_attention_2d_node(height, width, window, shift)) {}

}  // namespace sattn::sparse
