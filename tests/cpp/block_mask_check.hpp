// The invariants of a fixed pattern's block mask, checked pair by pair against its element predicate (used by the
// pattern tests and the pattern-spec fuzz target).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sattn/error.hpp"
#include "sattn/patterns.hpp"

namespace sattn::sparse {

// Checks p.block_mask(lq, lk, heads, block): the structure validates; the permutations are permutations; every
// allowed pair is covered exactly once; full ranges hold only allowed pairs; narrowed ranges are never full;
// with `exact`, every partial range holds at least one allowed pair. Returns "" when all hold, else the first
// violation.
inline std::string block_mask_mismatch(const Pattern& p, int64_t lq, int64_t lk, int64_t heads, int64_t block,
                                       bool exact) {
  using sattn::message::concat;
  const std::string where = concat(p.repr(), " Lq=", lq, " Lk=", lk, " heads=", heads, " block=", block, ": ");
  BlockMask m;
  try {
    m = p.block_mask(lq, lk, heads, block);
    m.validate();
  } catch (const Error& e) {
    return where + e.what();
  }
  if (m.len_q != lq || m.len_k != lk) return concat(where, "the mask is for Lq=", m.len_q, " Lk=", m.len_k);
  if (m.heads != (p.head_dependent() ? heads : 1)) return concat(where, "heads = ", m.heads);
  std::vector<int> seen_q(size_t(lq), 0), seen_k(size_t(lk), 0);
  for (int64_t x = 0; x < lq; ++x) seen_q[size_t(m.q_index(x))]++;
  for (int64_t x = 0; x < lk; ++x) seen_k[size_t(m.k_index(x))]++;
  for (int v : seen_q)
    if (v != 1) return where + "q_perm is not a permutation";
  for (int v : seen_k)
    if (v != 1) return where + "k_perm is not a permutation";
  const int64_t nqb = m.num_q_blocks();
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t s = m.slot(h);
    std::vector<uint8_t> covered(size_t(lq * lk), 0);
    for (int64_t qb = 0; qb < nqb; ++qb)
      for (int64_t r = m.row_ptr[s * nqb + qb]; r < m.row_ptr[s * nqb + qb + 1]; ++r) {
        const KeyRange& kr = m.ranges[r];
        // Only the range's query rows [q_first, q_last) are computed (narrowed ranges are never full).
        const int64_t mb = m.q_block_start[qb + 1] - m.q_block_start[qb];
        if (kr.q_first(mb) >= kr.q_last(mb)) return concat(where, "empty query rows in a range of qb=", qb);
        if ((kr.q_first(mb) > 0 || kr.q_last(mb) < mb) && kr.full) return concat(where, "narrowed range is full");
        int64_t allowed = 0;
        for (int64_t qp = m.q_block_start[qb] + kr.q_first(mb); qp < m.q_block_start[qb] + kr.q_last(mb); ++qp)
          for (int64_t kp = kr.begin; kp < kr.end; ++kp) {
            const int64_t i = m.q_index(qp), j = m.k_index(kp);
            if (covered[i * lk + j]) return concat(where, "pair covered twice: h=", h, " i=", i, " j=", j);
            covered[i * lk + j] = 1;
            const bool a = p.allowed(0, h, i, j, lq, lk);
            allowed += a;
            if (kr.full && !a) return concat(where, "full range holds a masked pair: h=", h, " i=", i, " j=", j);
          }
        if (exact && allowed == 0) return concat(where, "partial range without an allowed pair, qb=", qb);
      }
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j)
        if (p.allowed(0, h, i, j, lq, lk) && !covered[i * lk + j])
          return concat(where, "allowed pair not visited: h=", h, " i=", i, " j=", j);
  }
  return "";
}

}  // namespace sattn::sparse
