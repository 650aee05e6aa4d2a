// Patterns: block masks agree with the element predicate; specs parse and round-trip; bad specs name the position.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "block_mask_check.hpp"
#include "sattn/error.hpp"
#include "sattn/patterns.hpp"

using namespace sattn;
using namespace sattn::sparse;

namespace {

struct Case {
  std::string spec;
  int64_t lq, lk;
};

std::vector<Case> pattern_cases() {
  std::vector<Case> c;
  for (auto [lq, lk] : std::vector<std::pair<int64_t, int64_t>>{
           {37, 37}, {20, 45}, {45, 20}, {64, 64}, {65, 130}, {1, 50}, {130, 65}}) {
    for (const char* s : {"SlidingWindow(3, 2)",
                          "SlidingWindow(-1, 0)",
                          "SlidingWindow(5, -1)",
                          "SlidingWindow(-1, -1)",
                          "SlidingWindow(0, 0)",
                          "SlidingWindow(2, 7, alignment='top_left')",
                          "Dilated(3, 2)",
                          "Dilated(2, 3, alignment='top_left')",
                          "Dilated(1, 5)",
                          "BlockLocal(5)",
                          "BlockLocal(16)",
                          "BlockLocal(7, alignment='top_left')",
                          "GlobalTokens([0, 7], SlidingWindow(2, 2))",
                          "GlobalTokens([3], BlockLocal(8), alignment='top_left')",
                          "BigBird(8, 3, 1, 2, seed=3)",
                          "BigBird(5, 3, 0, 1, seed=11, alignment='top_left')",
                          "BigBird(4, 1, 2, 0)",
                          "SlidingWindow(4, 0) | Dilated(2, 3)",
                          "SlidingWindow(-1, 0) & BlockLocal(8)",
                          "Full()",
                          "(SlidingWindow(1, 1) | BlockLocal(6)) & SlidingWindow(-1, 0)",
                          "BigBird(8, 3, 1, 1, seed=5) | SlidingWindow(2, 2)"})
      c.push_back({s, lq, lk});
  }
  for (auto [s, n] : std::vector<std::pair<const char*, int64_t>>{
           {"Neighborhood2D(9, 11, 3)", 99},
           {"Neighborhood2D(12, 13, 5, dilation=2)", 156},
           {"Neighborhood2D(10, 9, 3, causal=True)", 90},
           {"Neighborhood2D(14, 12, 3, dilation=2, causal=True)", 168},
           {"Neighborhood2D(7, 7, 7)", 49},
           {"Neighborhood2D(21, 16, 5, dilation=3)", 336},
           {"Neighborhood2D(37, 22, 7)", 814},
           {"Neighborhood2D(35, 18, 7, causal=True)", 630},
           {"Neighborhood2D(34, 30, 5, dilation=2)", 1020},
           {"WindowAttention2D(8, 12, 4)", 96},
           {"WindowAttention2D(8, 12, 4, shift=2)", 96},
           {"WindowAttention2D(6, 6, 3, shift=1)", 36},
           {"Neighborhood2D(9, 11, 3) | GlobalTokens([0], SlidingWindow(1, 1))", 99},
           {"WindowAttention2D(8, 8, 4, shift=2) & SlidingWindow(-1, 0)", 64}})
    c.push_back({s, n, n});
  return c;
}

}  // namespace

TEST(SparsePatterns, BlockMaskAgreesWithPredicate) {
  for (const Case& c : pattern_cases()) {
    const Pattern p = Pattern::parse(c.spec);
    const bool exact = c.spec.find('&') == std::string::npos;
    for (int64_t block : {16, 64, 7}) EXPECT_EQ(block_mask_mismatch(p, c.lq, c.lk, 3, block, exact), "");
  }
}

TEST(SparsePatterns, DenseMaskMatchesPredicateAndBlockMaskFromDense) {
  for (const Case& c : pattern_cases()) {
    const Pattern p = Pattern::parse(c.spec);
    const Tensor d = p.dense_mask(c.lq, c.lk, 2);
    ASSERT_EQ(d.size(0), p.head_dependent() ? 2 : 1);
    for (int64_t h = 0; h < d.size(0); ++h)
      for (int64_t i = 0; i < c.lq; ++i)
        for (int64_t j = 0; j < c.lk; ++j)
          ASSERT_EQ(bool(d.data<uint8_t>()[(h * c.lq + i) * c.lk + j]), p.allowed(0, h, i, j, c.lq, c.lk));
    // create_block_mask: full blocks exactly where every pair is allowed, absent exactly where none is.
    const BlockMask m = block_mask_from_dense(d.view(), 16, 8);
    ASSERT_NO_THROW(m.validate());
    const int64_t nqb = m.num_q_blocks();
    for (int64_t h = 0; h < m.heads; ++h)
      for (int64_t qb = 0; qb < nqb; ++qb) {
        std::vector<int> listed(size_t((c.lk + 7) / 8), -1);
        for (int64_t r = m.row_ptr[h * nqb + qb]; r < m.row_ptr[h * nqb + qb + 1]; ++r)
          listed[m.ranges[r].begin / 8] = m.ranges[r].full;
        for (int64_t kb = 0; kb * 8 < c.lk; ++kb) {
          int64_t n = 0, tot = 0;
          for (int64_t i = m.q_block_start[qb]; i < m.q_block_start[qb + 1]; ++i)
            for (int64_t j = kb * 8; j < std::min(c.lk, kb * 8 + 8); ++j, ++tot)
              n += d.data<uint8_t>()[(h * c.lq + i) * c.lk + j];
          ASSERT_EQ(listed[kb], n == 0 ? -1 : (n == tot ? 1 : 0));
        }
      }
  }
}

TEST(SparsePatterns, StructuredBlockMasksSkipWork) {
  // SlidingWindow(256, 256) at L = 8192: computed pairs within a block of the allowed ones, and mostly full.
  const Pattern sw = SlidingWindow(256, 256);
  const BlockMask m = sw.block_mask(8192, 8192, 1, 64);
  int64_t allowed = 0;
  for (int64_t i = 0; i < 8192; ++i) allowed += std::min<int64_t>(8191, i + 256) - std::max<int64_t>(0, i - 256) + 1;
  EXPECT_LE(double(m.computed_pairs(0)), 1.15 * double(allowed));
  EXPECT_LE(double(m.partial_pairs(0)), 0.25 * double(m.computed_pairs(0)));  // 2 * 64 / (513 + 63)
  // Dilated keeps tiles dense: computed pairs close to allowed ones.
  const BlockMask md = Dilated(64, 4).block_mask(4096, 4096, 1, 64);
  EXPECT_LE(double(md.computed_pairs(0)), 1.5 * 4096 * 129);  // (129 + 63) / 129
  // Neighborhood2D kernel 7 on 64 x 64: computed / allowed <= 3.
  const BlockMask mn = Neighborhood2D(64, 64, 7).block_mask(4096, 4096, 1, 64);
  EXPECT_LE(double(mn.computed_pairs(0)), 3.0 * 4096 * 49);
  // Swin windows: everything full, exactly the allowed pairs.
  const BlockMask mw = WindowAttention2D(32, 32, 8, 4).block_mask(1024, 1024, 1, 64);
  EXPECT_EQ(mw.partial_pairs(0), 0);
}

TEST(SparsePatterns, ReprRoundTrips) {
  for (const Case& c : pattern_cases()) {
    const Pattern p = Pattern::parse(c.spec);
    const Pattern q = Pattern::parse(p.repr());
    EXPECT_EQ(p.repr(), q.repr());
    EXPECT_EQ(p.repr(), c.spec) << "repr is the canonical spec";
  }
  const Pattern a = SlidingWindow(1, 2) | (BlockLocal(4) | Dilated(1, 2));
  EXPECT_EQ(a.repr(), "SlidingWindow(1, 2) | (BlockLocal(4) | Dilated(1, 2))");
  EXPECT_EQ(Pattern::parse(a.repr()).repr(), a.repr());
  const Pattern b = (SlidingWindow(1, 2) | BlockLocal(4)) & Dilated(1, 2);
  EXPECT_EQ(Pattern::parse(b.repr()).repr(), b.repr());
  EXPECT_EQ(Pattern::parse("  SlidingWindow( 256 ,256 ) ").repr(), "SlidingWindow(256, 256)");
  EXPECT_EQ(Pattern::parse("Neighborhood2D(64,64,7,dilation=2) | GlobalTokens([0],SlidingWindow(8,8))").repr(),
            "Neighborhood2D(64, 64, 7, dilation=2) | GlobalTokens([0], SlidingWindow(8, 8))");
  EXPECT_EQ(Pattern::parse("SlidingWindow(right=3, left=2)").repr(), "SlidingWindow(2, 3)");
}

// Patterns and the dense API share one causal-alignment enum; a pattern's default stays bottom-right (the dense
// is_causal's top-left is an explicit choice), and kNone is not an alignment.
TEST(SparsePatterns, AlignmentIsTheDenseCausalEnum) {
  static_assert(std::is_same_v<Alignment, Causal>);
  const Pattern causal = SlidingWindow(-1, 0);                      // bottom-right: Lq = 2, Lk = 4
  const Pattern top_left = SlidingWindow(-1, 0, Causal::kTopLeft);  // PyTorch's is_causal
  EXPECT_TRUE(causal.allowed(0, 0, 0, 2, 2, 4));
  EXPECT_FALSE(top_left.allowed(0, 0, 0, 2, 2, 4));
  EXPECT_TRUE(top_left.allowed(0, 0, 0, 0, 2, 4));
  EXPECT_EQ(top_left.repr(), "SlidingWindow(-1, 0, alignment='top_left')");
  for (const auto& make : std::vector<std::function<Pattern()>>{
           [] { return SlidingWindow(1, 1, Causal::kNone); }, [] { return Dilated(2, 2, Causal::kNone); },
           [] { return BlockLocal(4, Causal::kNone); },
           [] { return GlobalTokens({0}, SlidingWindow(1, 1), Causal::kNone); },
           [] { return BigBird(4, 1, 1, 1, 0, Causal::kNone); }}) {
    try {
      make();
      ADD_FAILURE() << "Causal::kNone accepted as an alignment";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("alignment: expected Causal::kTopLeft or Causal::kBottomRight"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(SparsePatterns, BadSpecsNameThePosition) {
  auto pos_of = [](const std::string& spec) -> std::string {
    try {
      Pattern::parse(spec);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      const std::string m = e.what();
      const auto at = m.find("at position ");
      if (at == std::string::npos) return "no position in: " + m;
      return m.substr(at + 12, m.find_first_not_of("0123456789", at + 12) - at - 12);
    }
    return "no error";
  };
  EXPECT_EQ(pos_of("SlidingWindow(256, 256"), "22");
  EXPECT_EQ(pos_of("SlidingWindo(1, 2)"), "0");
  EXPECT_EQ(pos_of("SlidingWindow(1, 2) | "), "22");
  EXPECT_EQ(pos_of("SlidingWindow(1, 2) $"), "20");
  EXPECT_EQ(pos_of("SlidingWindow(1, x=2)"), "19");
  EXPECT_EQ(pos_of("SlidingWindow(1)"), "0");
  EXPECT_EQ(pos_of("BlockLocal(0)"), "0");  // constructor error, at the name
  EXPECT_EQ(pos_of("Dilated(1, 2, alignment='middle')"), "24");
  EXPECT_EQ(pos_of("Neighborhood2D(8, 8, 4)"), "0");
  EXPECT_EQ(pos_of("GlobalTokens([0, 1.5], Full())"), "17");
  EXPECT_EQ(pos_of(""), "0");
  EXPECT_EQ(pos_of("Full() & (Full()"), "16");
  EXPECT_THROW(WindowAttention2D(10, 12, 4), Error);
  EXPECT_THROW(Neighborhood2D(10, 10, 5, 3), Error);
  EXPECT_THROW(Neighborhood2D(9, 9, 3).block_mask(80, 81), Error);
}
