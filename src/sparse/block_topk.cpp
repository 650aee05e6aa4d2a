// BlockTopK(block, k_blocks): per query block, the k_blocks key blocks whose mean keys score best against the
// block's mean query (block_select: score -> select -> rescore near the cut in fp64), then attention to those blocks.
#include "sparse/adaptive_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <vector>

#include <hwy/aligned_allocator.h>

#include "sparse/tiles.hpp"

namespace sattn::sparse {

namespace {
struct BlockSelection {
  BlockMask mask;               // heads = Hq, identity layout, query blocks = aligned blocks
  int64_t nqb = 0, width = 0;   // min(k_blocks, number of key blocks) (at least 1): no more can be chosen
  std::vector<int64_t> chosen;  // [Hq, nqb, width], -1 fill
  const int64_t* row(int64_t h, int64_t qb) const { return &chosen[size_t((h * nqb + qb) * width)]; }
  // The y-th chosen key block of (h, qb) as the indices output reports it ([..., k_blocks], -1 fill).
  int64_t index(int64_t h, int64_t qb, int64_t y) const { return y < width ? row(h, qb)[y] : -1; }
};

std::vector<int32_t> aligned_bounds(int64_t lq, int64_t off, int64_t block) {
  std::vector<int32_t> bounds;
  for (int64_t i = 1; i <= lq; ++i)
    if (i == lq || ((i + off) % block + block) % block == 0) bounds.push_back(int32_t(i));
  return bounds;
}

int64_t floor_div(int64_t x, int64_t y) { return x >= 0 ? x / y : -((-x + y - 1) / y); }

// fp64 block score qm · km: four independent sums in a fixed order (deterministic; the order the selection is
// defined with).
inline double block_score64(const double* qm, const double* km, int64_t D) {
  double s4[4] = {0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 4 <= D; d += 4)
    for (int u = 0; u < 4; ++u) s4[u] += qm[d + u] * km[d + u];
  for (; d < D; ++d) s4[0] += qm[d] * km[d];
  return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}

// The shape of one batch entry's selection: aligned query blocks (bounds, with qbounds = {0, bounds...}) against
// key blocks of a.block positions. The problem's sizes are read from p.
struct SelectGeometry {
  const AdaptiveNode& a;
  const Pattern& fixed;
  const detail::Packed& p;
  int64_t b, off, blk, nkb, nqb, KB;
  const std::vector<int32_t>& qbounds;
};

// Key-block means over valid keys of one batch entry, per kv head (fp64), their fp32 transposes and norms.
struct KeyBlockMeans {
  std::vector<double> kmean;      // [Hkv, nkb, D]
  std::vector<int64_t> kvalid;    // [nkb] valid keys per block
  std::vector<float> kmt;         // [Hkv, D, nkb]
  std::vector<double> knorm_max;  // [Hkv] largest norm of a block mean with a valid key
};

// The chosen blocks as given (indices [Hq, nqb, k_blocks], -1 = none): sorted, duplicates dropped.
void select_given(const SelectGeometry& g, const int64_t* given, BlockSelection& sel) {
  const AdaptiveNode& a = g.a;
  for (int64_t h = 0; h < g.p.Hq(); ++h)
    for (int64_t qb = 0; qb < g.nqb; ++qb) {
      std::vector<int64_t> picks;
      for (int64_t x = 0; x < a.k_blocks; ++x) {
        const int64_t kb = given[(h * g.nqb + qb) * a.k_blocks + x];
        check(kb >= -1 && kb < g.nkb, ErrorKind::kInvalidArgument, "indices: key block ", kb, " out of range");
        if (kb >= 0) picks.push_back(kb);
      }
      std::sort(picks.begin(), picks.end());
      picks.erase(std::unique(picks.begin(), picks.end()), picks.end());  // (so at most `width` of them)
      std::copy(picks.begin(), picks.end(), &sel.chosen[size_t((h * g.nqb + qb) * g.KB)]);
    }
}

KeyBlockMeans key_block_means(const SelectGeometry& g) {
  const detail::Packed& p = g.p;
  const int64_t b = g.b, lk = p.Lk(), blk = g.blk, nkb = g.nkb, D = p.D();
  KeyBlockMeans km;
  km.kmean.assign(static_cast<size_t>(p.Hkv() * nkb * D), 0.0);
  km.kvalid.assign(static_cast<size_t>(nkb), 0);
  std::vector<double>& kmean = km.kmean;
  for (int64_t j = 0; j < lk; ++j)
    if (p.key_valid.empty() || p.key_valid[size_t(b * lk + j)]) km.kvalid[size_t(j / blk)]++;
  // Sums per (kv head, run of 16 key blocks) in parallel; each block's sum is in key order for any thread count.
  constexpr int64_t kSumBlocks = 16;
  const int64_t sum_runs = (nkb + kSumBlocks - 1) / kSumBlocks;
  auto sum_keys = [&](int64_t it) {
    const int64_t hk = it / sum_runs, j_lo = (it % sum_runs) * kSumBlocks * blk;
    const int64_t j_hi = std::min(lk, j_lo + kSumBlocks * blk);
    for (int64_t j = j_lo; j < j_hi; ++j) {
      if (!(p.key_valid.empty() || p.key_valid[size_t(b * lk + j)])) continue;
      const float* kr = &p.k[size_t(((b * p.Hkv() + hk) * lk + j) * D)];
      double* m = &kmean[size_t((hk * nkb + j / blk) * D)];
      for (int64_t d = 0; d < D; ++d) m[d] += kr[d];
    }
  };
  detail::parallel(p.Hkv() * sum_runs, p.threads, sum_keys);
  km.kmt.resize(static_cast<size_t>(p.Hkv() * D * nkb));
  km.knorm_max.assign(static_cast<size_t>(p.Hkv()), 0.0);
  for (int64_t hk = 0; hk < p.Hkv(); ++hk)
    for (int64_t kb = 0; kb < nkb; ++kb) {
      double* m = &kmean[size_t((hk * nkb + kb) * D)];
      double n2 = 0;
      for (int64_t d = 0; d < D; ++d) {
        if (km.kvalid[size_t(kb)] > 0) m[d] /= double(km.kvalid[size_t(kb)]);
        km.kmt[size_t((hk * D + d) * nkb + kb)] = float(m[d]);
        n2 += m[d] * m[d];
      }
      if (km.kvalid[size_t(kb)] > 0) km.knorm_max[size_t(hk)] = std::max(km.knorm_max[size_t(hk)], std::sqrt(n2));
    }
  return km;
}

// The fixed pattern's key ranges per (head, query block), gathered serially (Pattern nodes need not be
// thread-safe). Empty without a fixed pattern.
std::vector<std::vector<KeyRange>> fixed_key_ranges(const SelectGeometry& g) {
  std::vector<std::vector<KeyRange>> franges;
  if (!g.fixed.defined()) return franges;
  franges.resize(size_t(g.p.Hq() * g.nqb));
  for (int64_t h = 0; h < g.p.Hq(); ++h)
    for (int64_t qb = 0; qb < g.nqb; ++qb)
      g.fixed.node().ranges_for(g.fixed.head_dependent() ? h : 0, g.qbounds[size_t(qb)], g.qbounds[size_t(qb + 1)],
                                g.p.Lq(), g.p.Lk(), g.blk, franges[size_t(h * g.nqb + qb)]);
  return franges;
}

// Query-block means of head h, blocks [c0, c0 + rows): fp64 into qm [rows x D] and their fp32 copies into qmf.
void query_block_means(const SelectGeometry& g, int64_t h, int64_t c0, int64_t rows, double* qm, float* qmf) {
  const int64_t D = g.p.D(), Lq = g.p.Lq(), Hq = g.p.Hq();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t q0 = g.qbounds[size_t(c0 + r)], q1 = g.qbounds[size_t(c0 + r + 1)];
    double* m = &qm[size_t(r * D)];
    for (int64_t i = q0; i < q1; ++i) {
      const float* qr = &g.p.q[size_t(((g.b * Hq + h) * Lq + i) * D)];
      for (int64_t d = 0; d < D; ++d) m[d] += qr[d];
    }
    for (int64_t d = 0; d < D; ++d) {
      m[d] /= double(q1 - q0);
      qmf[size_t(r * D + d)] = float(m[d]);
    }
  }
}

// One query block's selection: the candidates it may choose from and where its picks go.
struct RowChoice {
  int64_t t = 0;       // the key block of the query block's first position (its own block)
  int64_t kb_end = 0;  // candidates are key blocks < kb_end
  bool own = false;    // the own block is picked first (local)
  bool every_block_usable = false;
  const uint8_t* cand = nullptr;  // [nkb] allowed by the fixed pattern (unused when every_block_usable)
  const int64_t* kvalid = nullptr;
  const float* sr = nullptr;  // fp32 block scores [nkb]
  int64_t* ch = nullptr;      // the picks, sorted at the end
  int64_t npick = 0;
  bool usable(int64_t kb) const {
    return (every_block_usable || (cand[size_t(kb)] && kvalid[size_t(kb)] > 0)) && !(own && kb == t);
  }
};

// Ranking of fp32 block scores: higher score first, ties to the lower block (a closure type, inlined into the sort).
constexpr auto better32 = [](const std::pair<float, int32_t>& x, const std::pair<float, int32_t>& y) {
  return x.first > y.first || (x.first == y.first && x.second < y.second);
};

// Pass 1: the need-th best fp32 score by a streaming threshold (a buffer of 4·need, cut to its best need when
// full): O(nkb) compares, a few small nth_elements. Leaves the surviving candidates in scored; returns the number
// of usable blocks and whether all their scores are finite.
int64_t threshold_pass(const RowChoice& rc, int64_t need, std::vector<std::pair<float, int32_t>>& scored,
                       bool& all_finite) {
  const float* sr = rc.sr;
  const int64_t kb_end = rc.kb_end, t = rc.t;
  const bool own = rc.own;
  int64_t n_usable = 0;
  float thr = -std::numeric_limits<float>::infinity();
  auto offer = [&](float x, int64_t kb) {
    scored.emplace_back(x, int32_t(kb));
    if (int64_t(scored.size()) == 4 * need) {
      std::nth_element(scored.begin(), scored.begin() + (need - 1), scored.end(), better32);
      scored.resize(size_t(need));
      thr = scored.back().first;
    }
  };
  if (rc.every_block_usable) {
    // No fixed pattern and no padding: every block before kb_end but the own one is a candidate. Runs of
    // 16 scores: their maximum (NaN-free: std::max keeps the first operand) and finiteness in one
    // branch-free pass; a run is scanned only when its maximum passes the threshold.
    n_usable = kb_end - (own ? 1 : 0);
    for (int64_t c0 = 0; c0 < kb_end; c0 += 16) {
      const int64_t c1 = std::min(kb_end, c0 + 16);
      float mx = -std::numeric_limits<float>::infinity();
      bool fin = true;
      for (int64_t kb = c0; kb < c1; ++kb) {
        mx = std::max(mx, sr[kb]);
        fin &= sr[kb] - sr[kb] == 0.0f;
      }
      all_finite &= fin;
      if (mx > thr)
        for (int64_t kb = c0; kb < c1; ++kb)
          if (sr[kb] > thr && !(own && kb == t)) offer(sr[kb], kb);
    }
  } else {
    for (int64_t kb = 0; kb < kb_end; ++kb) {
      if (!rc.usable(kb)) continue;
      ++n_usable;
      const float x = sr[kb];
      all_finite &= std::isfinite(x);
      if (x > thr) offer(x, kb);
    }
  }
  return n_usable;
}

// Pass 2: with cut the need-th best fp32 score, every block below cut - 2E is below all `need` blocks at or above
// the cut in fp64 too; the others (about `need`) are rescored in fp64 (query-block mean m against the key-block
// means kmean of the kv head) and ranked exactly (higher score, ties to the lower block).
void rescore_pass(RowChoice& rc, int64_t need, std::vector<std::pair<float, int32_t>>& scored, bool all_finite,
                  const double* m, const double* kmean, double knorm_max, int64_t D,
                  std::vector<std::pair<double, int64_t>>& exact) {
  const float* sr = rc.sr;
  const int64_t kb_end = rc.kb_end;
  // (A non-finite score, possible only for huge inputs, sends the row to the exact fp64 ranking of all.)
  all_finite &= int64_t(scored.size()) >= need;
  float cut = 0.0f;
  if (all_finite) {
    std::nth_element(scored.begin(), scored.begin() + (need - 1), scored.end(), better32);
    cut = scored[size_t(need - 1)].first;
  }
  double n2 = 0;
  for (int64_t d = 0; d < D; ++d) n2 += m[d] * m[d];
  // |fp32 score - fp64 score| <= E: products of D fp32-rounded terms, FMA sums (<= (D + 3)·2^-24·|qm|·|km|).
  const double E = double(D + 4) * 0x1p-23 * std::sqrt(n2) * knorm_max;
  const bool finite = all_finite && std::isfinite(E);
  exact.clear();
  const double bound = double(cut) - 2.0 * E;
  for (int64_t c0 = 0; c0 < kb_end; c0 += 16) {  // runs of 16 whose maximum is below the bound are skipped
    const int64_t c1 = std::min(kb_end, c0 + 16);
    if (finite) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t kb = c0; kb < c1; ++kb) mx = std::max(mx, sr[kb]);
      if (double(mx) < bound) continue;
    }
    for (int64_t kb = c0; kb < c1; ++kb)
      if (rc.usable(kb) && (!finite || double(sr[kb]) >= bound))
        exact.emplace_back(-block_score64(m, &kmean[size_t(kb * D)], D), kb);
  }
  const size_t cutn = std::min(exact.size(), size_t(need));
  std::nth_element(exact.begin(), exact.begin() + std::ptrdiff_t(cutn - 1), exact.end());
  for (size_t x = 0; x < cutn; ++x) rc.ch[rc.npick++] = exact[x].second;
}

// Selection of head h's query blocks [c0, c0 + rows): block scores (one fp32 product of query-block means and
// key-block means), then per query block its candidates, pass 1 (select) and pass 2 (rescore).
void select_chunk(const SelectGeometry& g, const KeyBlockMeans& km, const std::vector<std::vector<KeyRange>>& franges,
                  int64_t h, int64_t c0, int64_t rows, BlockSelection& sel) {
  const AdaptiveNode& a = g.a;
  const int64_t D = g.p.D(), nkb = g.nkb, blk = g.blk, hk = h / g.p.group();
  const bool every_block_usable = !g.fixed.defined() && g.p.key_valid.empty();
  thread_local std::vector<double> qm;
  thread_local std::vector<float> qmf, s;
  thread_local std::vector<uint8_t> cand;
  thread_local std::vector<std::pair<float, int32_t>> scored;
  thread_local std::vector<std::pair<double, int64_t>> exact;
  qm.assign(size_t(rows * D), 0.0);
  qmf.resize(size_t(rows * D));
  s.resize(size_t(rows * nkb));
  query_block_means(g, h, c0, rows, qm.data(), qmf.data());
  tiles::qk(qmf.data(), rows, D, &km.kmt[size_t(hk * D * nkb)], nkb, nkb, 1.0f, s.data());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qb = c0 + r, q0 = g.qbounds[size_t(qb)], t = floor_div(q0 + g.off, blk);
    // Candidates: key blocks with a valid key, allowed by the fixed pattern, not after the query block if causal.
    if (!every_block_usable) cand.assign(size_t(nkb), g.fixed.defined() ? 0 : 1);
    if (g.fixed.defined())
      for (const auto& fr : franges[size_t(h * g.nqb + qb)])
        for (int64_t kb = fr.begin / blk; kb * blk < fr.end; ++kb) cand[size_t(kb)] = 1;
    RowChoice rc;
    rc.t = t;
    rc.kb_end = a.causal ? std::min(nkb, t + 1) : nkb;
    rc.every_block_usable = every_block_usable;
    rc.cand = cand.data();
    rc.kvalid = km.kvalid.data();
    rc.sr = &s[size_t(r * nkb)];
    rc.ch = &sel.chosen[size_t((h * g.nqb + qb) * g.KB)];
    rc.own =
        a.local && t >= 0 && t < rc.kb_end && (every_block_usable || (cand[size_t(t)] && km.kvalid[size_t(t)] > 0));
    if (rc.own) rc.ch[rc.npick++] = t;
    const int64_t need = g.KB - rc.npick;
    int64_t n_usable = 0;
    bool all_finite = true;
    scored.clear();
    if (need > 0) n_usable = threshold_pass(rc, need, scored, all_finite);
    if (need > 0 && n_usable <= need) {
      for (int64_t kb = 0; kb < rc.kb_end; ++kb)
        if (rc.usable(kb)) rc.ch[rc.npick++] = kb;
    } else if (need > 0) {
      rescore_pass(rc, need, scored, all_finite, &qm[size_t(r * D)], &km.kmean[size_t(hk * nkb * D)],
                   km.knorm_max[size_t(hk)], D, exact);
    }
    std::sort(rc.ch, rc.ch + rc.npick);
  }
}

// The block mask of a selection: each query block's chosen key blocks (full but where the fixed pattern or the
// causal diagonal needs the mask).
BlockMask selection_mask(const SelectGeometry& g, const std::vector<int32_t>& bounds, const BlockSelection& sel) {
  const int64_t blk = g.blk, lk = g.p.Lk();
  return detail::build_identity_layout(
      g.p.Lq(), lk, g.p.Hq(), bounds, [&](int64_t h, int64_t q0, int64_t, std::vector<KeyRange>& out) {
        const int64_t qb = std::lower_bound(g.qbounds.begin(), g.qbounds.end(), int32_t(q0)) - g.qbounds.begin();
        const int64_t t = floor_div(q0 + g.off, blk);
        const int64_t* ch = &sel.chosen[size_t((h * g.nqb + qb) * g.KB)];
        for (int64_t x = 0; x < g.KB && ch[x] >= 0; ++x)
          detail::emit_range(out, ch[x] * blk, std::min(lk, (ch[x] + 1) * blk),
                             !g.fixed.defined() && !(g.a.causal && ch[x] == t), blk);
      });
}

// Selection for batch entry b (q, k: 4-D views of that entry, [1, H, L, D]); `given` (optional) = [Hq, nqb, kb].
// Block means are computed once (fp64, O(L·D)); all block scores of a head are one fp32 matrix product
// (query-block means x key-block means, tiles::qk), and each query block picks its best candidates with a
// streaming threshold on the fp32 scores; candidates within the fp32 error bound of the cut are rescored in fp64,
// so the selection is exactly the fp64 top-k (higher score, ties to the lower block). with_mask = false leaves
// sel.mask empty (the direct forward reads only sel.chosen).
BlockSelection block_select(const AdaptiveNode& a, const Pattern& fixed, const detail::Packed& p, int64_t b,
                            const int64_t* given, bool with_mask = true) {
  const int64_t lq = p.Lq(), lk = p.Lk(), off = lk - lq, blk = a.block, nkb = (lk + blk - 1) / blk;
  const std::vector<int32_t> bounds = aligned_bounds(lq, off, blk);
  const int64_t nqb = int64_t(bounds.size()), KB = std::max<int64_t>(1, std::min(a.k_blocks, nkb));
  BlockSelection sel;
  sel.nqb = nqb;
  sel.width = KB;
  sel.chosen.assign(size_t(p.Hq() * nqb * KB), -1);
  const std::vector<int32_t> qbounds = [&] {
    std::vector<int32_t> x = {0};
    x.insert(x.end(), bounds.begin(), bounds.end());
    return x;
  }();
  const SelectGeometry g{a, fixed, p, b, off, blk, nkb, nqb, KB, qbounds};
  if (given) {
    select_given(g, given, sel);
  } else {
    const KeyBlockMeans km = key_block_means(g);
    const std::vector<std::vector<KeyRange>> franges = fixed_key_ranges(g);
    constexpr int64_t kRows = 32;  // query blocks per work item (scores: kRows x nkb floats)
    const int64_t chunks = (nqb + kRows - 1) / kRows;
    auto item = [&](int64_t it) {
      const int64_t h = it / chunks, c0 = (it % chunks) * kRows;
      select_chunk(g, km, franges, h, c0, std::min(kRows, nqb - c0), sel);
    };
    detail::parallel(p.Hq() * chunks, p.threads, item);
  }
  if (with_mask) sel.mask = selection_mask(g, bounds, sel);
  return sel;
}

struct BlockTopKMask {
  const Pattern::Node* fixed;
  bool causal;
  int64_t lq, lk;
  bool operator()(int64_t, int64_t h, int64_t i, int64_t j) const {
    return (!causal || j <= i + lk - lq) && (fixed == nullptr || fixed->allowed(h, i, j, lq, lk));
  }
};

// The problem of one batch entry's slices (slice_batch, batch_options): the call's problem with B = 1.
AttentionProblem batch_problem(const AttentionProblem& problem) {
  AttentionProblem one = problem;
  one.batch = 1;
  return one;
}

SparseOptions batch_options(const SparseOptions& o, int64_t b) {
  SparseOptions s = o;
  if (o.key_padding_mask.data) s.key_padding_mask = slice_batch(o.key_padding_mask, b);
  if (o.key_lengths.data) s.key_lengths = slice_batch(o.key_lengths, b);
  return s;
}

int64_t blocktopk_nqb(const AdaptiveNode& a, int64_t lq, int64_t lk) {
  return int64_t(aligned_bounds(lq, lk - lq, a.block).size());
}

void blocktopk_run(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed, const TensorView& q,
                   const TensorView& k, const TensorView& v, const SparseOptions& o, const TensorView& indices,
                   bool indices_given,
                   const std::function<void(int64_t, const BlockMask&, const SparseOptions&)>& run) {
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);
  const detail::Packed p = detail::pack_inputs(problem, q, k, v, ident, o);
  const int64_t nqb = blocktopk_nqb(a, lq, lk), KB = a.k_blocks;
  if (indices.data) check_indices(indices, {p.B(), p.Hq(), nqb, KB}, "[B, Hq, num_query_blocks, k_blocks]");
  for (int64_t b = 0; b < p.B(); ++b) {
    std::vector<int64_t> given;
    if (indices_given) {
      given.resize(size_t(p.Hq() * nqb * KB));
      for (int64_t h = 0; h < p.Hq(); ++h)
        for (int64_t x = 0; x < nqb; ++x)
          for (int64_t y = 0; y < KB; ++y) given[size_t((h * nqb + x) * KB + y)] = idx_at(indices, b, h, x, y);
    }
    const BlockSelection sel = block_select(a, fixed, p, b, indices_given ? given.data() : nullptr);
    if (indices.data && !indices_given)
      for (int64_t h = 0; h < p.Hq(); ++h)
        for (int64_t x = 0; x < nqb; ++x)
          for (int64_t y = 0; y < KB; ++y) idx_at(indices, b, h, x, y) = sel.index(h, x, y);
    run(b, sel.mask, batch_options(o, b));
  }
}

// BlockTopK forward without a fixed pattern: one packing of the inputs, the selection, then per (head, query
// block) an online softmax over its chosen key blocks, with K pre-transposed once per (b, kv head) into key-block
// tiles [D x block] that tiles::qk reads in place and V read in place (the engine would gather, copy and transpose
// both for every query block). Masks as in
// BlockTopKMask: causal inside the diagonal block, key padding in blocks that have some.
void blocktopk_forward_direct(const AttentionProblem& problem, const AdaptiveNode& a, const TensorView& q,
                              const TensorView& k, const TensorView& v, const SparseOptions& o, const TensorView& out,
                              const TensorView& lse, const TensorView& indices) {
  const int64_t lq = problem.len_q, lk = problem.len_k;
  const BlockMask ident = Full().block_mask(lq, lk, 1, o.block);
  const detail::Packed p = detail::pack_inputs(problem, q, k, v, ident, o);
  detail::check_outputs(p, out, lse);
  const int64_t nqb = blocktopk_nqb(a, lq, lk), KB = a.k_blocks, blk = a.block, nkb = (lk + blk - 1) / blk;
  const int64_t D = p.D(), Dv = p.Dv(), group = p.group(), off = lk - lq;
  const int64_t bw = std::min(blk, lk);  // columns of a key block in memory (one block of Lk keys when blk > Lk)
  if (indices.data) check_indices(indices, {p.B(), p.Hq(), nqb, KB}, "[B, Hq, num_query_blocks, k_blocks]");
  // K of one (b, kv head) at a time as transposed key blocks [nkb][D][bw] (one head's worth of memory). On the bf16
  // products (forward_takes_bf16_pairs), S and P·V take them instead: K in pairs along D for the call, V of one
  // (b, kv head) in pairs across keys per key block [nkb][⌈bw/2⌉][Dvp], Q^T per block.
  const bool pairs = detail::forward_takes_bf16_pairs(q, k, v, out, o);
  const int64_t D2 = (D + 1) / 2, Dvp = (Dv + 15) / 16 * 16, bw2 = (bw + 1) / 2;
  WorkspaceVector<float> kt(pairs ? 0 : static_cast<size_t>(nkb * D * bw));
  const WorkspaceVector<uint32_t> k2 =
      pairs ? detail::pairs_along_rows(p.k.data(), p.B() * p.Hkv() * lk, D) : WorkspaceVector<uint32_t>();
  WorkspaceVector<uint32_t> v2(pairs ? static_cast<size_t>(nkb * bw2 * Dvp) : 0);
  std::vector<int32_t> qbounds = {0};
  for (int32_t x : aligned_bounds(lq, off, blk)) qbounds.push_back(x);
  for (int64_t b = 0; b < p.B(); ++b) {
    const BlockSelection sel = block_select(a, Pattern(), p, b, nullptr, false);
    if (indices.data)
      for (int64_t h = 0; h < p.Hq(); ++h)
        for (int64_t x = 0; x < nqb; ++x)
          for (int64_t y = 0; y < KB; ++y) idx_at(indices, b, h, x, y) = sel.index(h, x, y);
    for (int64_t hk = 0; hk < p.Hkv(); ++hk) {
      const int64_t bh = b * p.Hkv() + hk;
      auto pack = [&](int64_t kb) {
        const int64_t n = std::min(blk, lk - kb * blk);
        if (pairs)
          tiles::pack_pairs_across_rows(&p.v[size_t((bh * lk + kb * blk) * Dv)], Dv, n, Dv, &v2[size_t(kb * bw2 * Dvp)],
                                        Dvp);
        else tiles::transpose_rows(&p.k[size_t((bh * lk + kb * blk) * D)], D, n, D, &kt[size_t(kb * D * bw)], bw);
      };
      detail::parallel(nkb, p.threads, pack);
      auto item = [&](int64_t it) {
        const int64_t h = hk * group + it / nqb, qb = it % nqb;
        const int64_t q0 = qbounds[size_t(qb)], m = qbounds[size_t(qb + 1)] - q0, t = floor_div(q0 + off, blk);
        thread_local std::vector<float> s, st, acc, mx, sum;
        thread_local detail::PairScratch ps;
        s.resize(size_t(m * bw));
        acc.assign(size_t(m * Dv), 0.0f);
        mx.assign(size_t(m), kNegInf);
        sum.assign(size_t(m), 0.0f);
        const float* qt = &p.q[size_t(((b * p.Hq() + h) * lq + q0) * D)];
        if (pairs) {
          st.resize(size_t(m * bw));
          ps.ensure(m, D2, 0, bw);
          detail::pack_query_pairs(qt, m, D, ps);
        }
        const int64_t* ch = sel.row(h, qb);
        for (int64_t x = 0; x < sel.width && ch[x] >= 0; ++x) {
          const int64_t kb = ch[x], j0 = kb * blk, n = std::min(blk, lk - j0);
          const float* vb = &p.v[size_t((bh * lk + j0) * Dv)];
          if (pairs) {  // S^T [n x m] on the pairs, then S
            tiles::kq_pairs(&k2[size_t((bh * lk + j0) * D2)], n, D2, ps.q2t.data(), ps.ldq, m, p.scale, st.data(), m);
            tiles::transpose_rows(st.data(), m, n, m, s.data(), n);
          } else {
            tiles::qk(qt, m, D, &kt[size_t(kb * D * bw)], bw, n, p.scale, s.data());
          }
          if (a.causal && kb == t)  // key j allowed iff j <= i + off
            for (int64_t r = 0; r < m; ++r)
              for (int64_t c = std::max<int64_t>(0, q0 + r + off - j0 + 1); c < n; ++c) s[size_t(r * n + c)] = kNegInf;
          if (p.invalid_in(b, j0, j0 + n) > 0)
            for (int64_t c = 0; c < n; ++c)
              if (!p.key_valid[size_t(b * lk + j0 + c)])
                for (int64_t r = 0; r < m; ++r) s[size_t(r * n + c)] = kNegInf;
          tiles::softmax_update(s.data(), m, n, mx.data(), sum.data(), acc.data(), Dv);
          if (pairs) tiles::pv_pairs(s.data(), m, n, &v2[size_t(kb * bw2 * Dvp)], Dvp, Dv, ps.p2.data(), acc.data());
          else tiles::pv(s.data(), m, n, vb, Dv, Dv, 1.0f, acc.data());
        }
        for (int64_t r = 0; r < m; ++r) {
          float* ar = &acc[size_t(r * Dv)];
          const bool empty = sum[size_t(r)] == 0.0f;
          const float inv = empty ? 0.0f : 1.0f / sum[size_t(r)];
          for (int64_t c = 0; c < Dv; ++c) ar[c] *= inv;
          detail::store_row(out, b, h, q0 + r, ar, Dv);
          if (lse.data)
            detail::store_value(lse, b, h, q0 + r, empty ? kNegInf : mx[size_t(r)] + std::log(sum[size_t(r)]));
        }
      };
      detail::parallel(group * nqb, p.threads, item);
    }
  }
}

}  // namespace

int64_t blocktopk_num_query_blocks(const AdaptiveNode& a, int64_t lq, int64_t lk) { return blocktopk_nqb(a, lq, lk); }

void blocktopk_forward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                       const TensorView& q, const TensorView& k, const TensorView& v, const SparseOptions& o,
                       const TensorView& out, const TensorView& lse, const TensorView& indices) {
  if (!fixed.defined()) return blocktopk_forward_direct(problem, a, q, k, v, o, out, lse, indices);
  const AttentionProblem one = batch_problem(problem);
  const BlockTopKMask mask{&fixed.node(), a.causal, problem.len_q, problem.len_k};
  blocktopk_run(problem, a, fixed, q, k, v, o, indices, false,
                [&](int64_t b, const BlockMask& bm, const SparseOptions& ob) {
                  block_sparse_attention(one, slice_batch(q, b), slice_batch(k, b), slice_batch(v, b), bm, mask,
                                         NoScoreMod{}, ob, slice_batch(out, b), slice_batch(lse, b));
                });
}

void blocktopk_backward(const AttentionProblem& problem, const AdaptiveNode& a, const Pattern& fixed,
                        const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const SparseOptions& o, const SparseGrads& g,
                        const TensorView& indices) {
  const AttentionProblem one = batch_problem(problem);
  const BlockTopKMask mask{fixed.defined() ? &fixed.node() : nullptr, a.causal, problem.len_q, problem.len_k};
  blocktopk_run(problem, a, fixed, q, k, v, o, indices, indices.data != nullptr,
                [&](int64_t b, const BlockMask& bm, const SparseOptions& ob) {
                  block_sparse_attention_backward(one, slice_batch(dout, b), slice_batch(q, b), slice_batch(k, b),
                                                  slice_batch(v, b), slice_batch(out, b), slice_batch(lse, b), bm, mask,
                                                  NoScoreMod{}, ob, slice_batch(g.dq, b), slice_batch(g.dk, b),
                                                  slice_batch(g.dv, b));
                });
}

}  // namespace sattn::sparse
