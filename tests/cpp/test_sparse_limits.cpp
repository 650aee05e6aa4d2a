// Bounded patterns and specs: constructor parameters out of 1..2^31-1 (or their documented range) are refused with
// a message naming the parameter, its range and the value; the largest accepted values give the exact masks; specs
// are at most kMaxSpecLength characters and kMaxPatternDepth deep; long unions are walked and freed without
// recursion; repr -> parse round-trips for random valid parameters of every pattern class.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/patterns.hpp"
#include "sattn/sparse.hpp"
#include "sparse/pattern_node.hpp"
#include "sparse_test_util.hpp"
#include "tools_test_util.hpp"

using namespace sattn;
using namespace sattn::sparse;

namespace {

constexpr int64_t kMax = kMaxPatternSize;
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// The message of the sattn::Error that `f` throws ("no error" if none); expects kInvalidArgument and one line.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    const std::string m = e.what();
    EXPECT_EQ(m.find('\n'), std::string::npos) << "one line: " << m;
    return m;
  }
  return "no error";
}

void expect_refused(const std::function<void()>& f, const std::vector<std::string>& needles) {
  const std::string m = error_of(f);
  for (const std::string& n : needles) EXPECT_NE(m.find(n), std::string::npos) << "'" << n << "' in: " << m;
}

std::string spec_error(const std::string& spec) {
  return error_of([&] { Pattern::parse(spec); });
}

// The dense mask of a fixed pattern against an expected predicate written out here, and the block mask against
// the dense mask: every allowed pair in exactly one range, full ranges hold only allowed pairs.
void expect_exact(const Pattern& p, int64_t lq, int64_t lk, int64_t heads,
                  const std::function<bool(int64_t, int64_t, int64_t)>& want) {
  SCOPED_TRACE(p.repr() + " Lq=" + std::to_string(lq) + " Lk=" + std::to_string(lk));
  const Tensor dm = p.dense_mask(lq, lk, heads);
  const int64_t slots = dm.size(0);
  for (int64_t h = 0; h < slots; ++h)
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j)
        ASSERT_EQ(bool(dm.data<uint8_t>()[(h * lq + i) * lk + j]), want(h, i, j))
            << "h=" << h << " i=" << i << " j=" << j;
  for (int64_t block : {1, 3, 64}) {
    const BlockMask m = p.block_mask(lq, lk, heads, block);
    ASSERT_NO_THROW(m.validate());
    std::vector<int> seen(size_t(slots * lq * lk), 0);
    const int64_t nqb = m.num_q_blocks();
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t qb = 0; qb < nqb; ++qb)
        for (int64_t r = m.row_ptr[s * nqb + qb]; r < m.row_ptr[s * nqb + qb + 1]; ++r)
          for (int64_t qp = m.q_block_start[qb]; qp < m.q_block_start[qb + 1]; ++qp)
            for (int64_t kp = m.ranges[r].begin; kp < m.ranges[r].end; ++kp) {
              const int64_t i = m.q_index(qp), j = m.k_index(kp);
              seen[size_t((s * lq + i) * lk + j)]++;
              ASSERT_TRUE(!m.ranges[r].full || want(s, i, j)) << "full range holds i=" << i << " j=" << j;
            }
    for (int64_t s = 0; s < slots; ++s)
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j)
          if (want(s, i, j)) {
            ASSERT_EQ(seen[size_t((s * lq + i) * lk + j)], 1) << "block " << block << " i=" << i << " j=" << j;
          }
  }
}

// Sparse attention under `p` against the reference with the expected mask (forward, fp32, 2e-5).
void expect_attention_matches(const Pattern& p, int64_t lq, int64_t lk,
                              const std::function<bool(int64_t, int64_t)>& want) {
  SCOPED_TRACE(p.repr());
  const Tensor q = sparse_test::randn({1, 1, lq, 8}, 1), k = sparse_test::randn({1, 1, lk, 8}, 2),
               v = sparse_test::randn({1, 1, lk, 8}, 3);
  Tensor out(DType::kF32, {1, 1, lq, 8}), lse(DType::kF32, {1, 1, lq});
  sparse_attention(q, k, v, p, {}, out, lse);
  Tensor mask(DType::kBool, {lq, lk});
  for (int64_t i = 0; i < lq; ++i)
    for (int64_t j = 0; j < lk; ++j) mask.data<uint8_t>()[i * lk + j] = want(i, j);
  AttentionOptions ro;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  ro.attn_mask = mask.view();
  const AttentionResult ref = attention(q, k, v, ro, true);
  EXPECT_LE(sparse_test::rel_err(out, ref.out), 2e-5);
  EXPECT_LE(sparse_test::rel_err(lse, ref.lse), 2e-5);
}

std::string repeat(const std::string& s, int64_t n) {
  std::string r;
  r.reserve(size_t(n) * s.size());
  for (int64_t x = 0; x < n; ++x) r += s;
  return r;
}

}  // namespace

TEST(PatternLimits, ParametersOutOfRangeNameTheParameterTheRangeAndTheValue) {
  // The overflowing constructor checks: each of these was accepted (and hung, grew to gigabytes or gave zeros).
  expect_refused([] { Neighborhood2D(4, 4, 3, 3074457345618258603); },
                 {"Neighborhood2D", "dilation", "1..2147483647", "3074457345618258603"});
  expect_refused([] { BigBird(1, 0, 0, 2305843009213693952); },
                 {"BigBird", "random_blocks", "0..2147483647", "2305843009213693952"});
  expect_refused([] { SlidingWindow(1, kI64Max); },
                 {"SlidingWindow", "right", "-1..2147483647", "9223372036854775807"});
  expect_refused([] { SlidingWindow(kI64Max, kI64Max); }, {"left", "9223372036854775807"});
  expect_refused([] { BigBird(kI64Max, 1, 0, 0); }, {"BigBird", "block", "1..2147483647"});
  expect_refused([] { Dilated(7277124529082131342, 4); },
                 {"Dilated", "window", "0..2147483647", "7277124529082131342"});
  // Every bounded parameter, one past each end of its range.
  expect_refused([] { SlidingWindow(-2, 0); }, {"left", "-1..2147483647", "got -2"});
  expect_refused([] { SlidingWindow(0, kMax + 1); }, {"right", "got 2147483648"});
  expect_refused([] { Dilated(-1, 1); }, {"window", "got -1"});
  expect_refused([] { Dilated(1, 0); }, {"dilation", "1..2147483647", "got 0"});
  expect_refused([] { Dilated(1, kMax + 1); }, {"dilation", "got 2147483648"});
  expect_refused([] { BlockLocal(0); }, {"BlockLocal", "block", "1..2147483647", "got 0"});
  expect_refused([] { BlockLocal(kMax + 1); }, {"block", "got 2147483648"});
  expect_refused(
      [] {
        GlobalTokens({0, kMax + 1}, Full());
      },
      {"GlobalTokens", "indices", "0..2147483647", "got 2147483648"});
  expect_refused([] { GlobalTokens({-1}, Full()); }, {"indices", "got -1"});
  expect_refused([] { BigBird(8, kMax + 1, 0, 0); }, {"window_blocks", "0..2147483647"});
  expect_refused([] { BigBird(8, 0, -1, 0); }, {"global_blocks", "got -1"});
  expect_refused([] { BigBird(8, 0, 0, kMax + 1); }, {"random_blocks", "got 2147483648"});
  expect_refused([] { Neighborhood2D(0, 8, 3); }, {"height", "1..2147483647", "got 0"});
  expect_refused([] { Neighborhood2D(8, kMax + 1, 3); }, {"width", "got 2147483648"});
  expect_refused([] { Neighborhood2D(65536, 65536, 3); }, {"height * width <= 2147483647", "4294967296"});
  expect_refused([] { Neighborhood2D(8, 8, kMax + 2); }, {"kernel", "got 2147483649"});
  expect_refused([] { Neighborhood2D(8, 8, 4); }, {"odd kernel", "got 4"});
  expect_refused([] { Neighborhood2D(8, 8, 3, 3); }, {"kernel * dilation = 9"});
  expect_refused([] { WindowAttention2D(kI64Max, 2, 1); }, {"WindowAttention2D", "height", "got 9223372036854775807"});
  expect_refused([] { WindowAttention2D(8, 8, 0); }, {"window", "1..2147483647", "got 0"});
  expect_refused([] { WindowAttention2D(8, 8, 4, 4); }, {"shift", "0..3", "got 4"});
  expect_refused([] { TopK(kMax + 1); }, {"TopK", "k", "1..2147483647", "got 2147483648"});
  expect_refused([] { BlockTopK(0, 1); }, {"BlockTopK", "block", "got 0"});
  expect_refused([] { BlockTopK(8, kI64Max); }, {"k_blocks", "got 9223372036854775807"});
  // The same through a spec: the constructor's message, at the pattern's position, on one line.
  const std::string m = spec_error("Full() | BigBird(1, 0, 0, 2305843009213693952)");
  EXPECT_NE(m.find("random_blocks"), std::string::npos) << m;
  EXPECT_NE(m.find("at position 9"), std::string::npos) << m;
}

TEST(PatternLimits, LargestAcceptedParametersGiveExactMasks) {
  for (auto [lq, lk] : std::vector<std::pair<int64_t, int64_t>>{{12, 12}, {7, 13}, {13, 7}}) {
    const int64_t off = lk - lq;  // bottom-right: query i sits at key position a = i + off
    expect_exact(SlidingWindow(1, kMax), lq, lk, 1, [&](int64_t, int64_t i, int64_t j) { return j >= i + off - 1; });
    expect_exact(SlidingWindow(kMax, kMax), lq, lk, 1, [](int64_t, int64_t, int64_t) { return true; });
    expect_exact(SlidingWindow(kMax, 0, Alignment::kTopLeft), lq, lk, 1,
                 [](int64_t, int64_t i, int64_t j) { return j <= i; });
    // One block as large as allowed: every aligned position >= 0 is in block 0 (negative ones in block -1).
    expect_exact(BigBird(kMax, 1, 0, 0), lq, lk, 1, [&](int64_t, int64_t i, int64_t) { return i + off >= 0; });
    expect_exact(BlockLocal(kMax), lq, lk, 1, [&](int64_t, int64_t i, int64_t) { return i + off >= 0; });
    // window * dilation beyond every length: the residue classes alone decide.
    expect_exact(Dilated(kMax, 4) & BlockLocal(8), lq, lk, 1, [&](int64_t, int64_t i, int64_t j) {
      const int64_t a = i + off;
      return (a - j) % 4 == 0 && std::floor(double(a) / 8) == std::floor(double(j) / 8);
    });
    // A dilation beyond every length: only the aligned diagonal.
    expect_exact(Dilated(kMax, kMax), lq, lk, 1, [&](int64_t, int64_t i, int64_t j) { return j == i + off; });
    expect_exact(Dilated(3, kMax, Alignment::kTopLeft), lq, lk, 1,
                 [](int64_t, int64_t i, int64_t j) { return j == i; });
    // More random blocks than there are: every key block (all candidates drawn).
    expect_exact(BigBird(1, 0, 0, kMax, ~uint64_t(0)), lq, lk, 3, [](int64_t, int64_t, int64_t) { return true; });
    expect_exact(BigBird(2, 1, kMax, 0), lq, lk, 1, [](int64_t, int64_t, int64_t) { return true; });
    expect_exact(GlobalTokens({kMax}, SlidingWindow(0, 0)), lq, lk, 1,
                 [&](int64_t, int64_t i, int64_t j) { return j == i + off; });
  }
  expect_attention_matches(SlidingWindow(1, kMax), 20, 20, [](int64_t i, int64_t j) { return j >= i - 1; });
  expect_attention_matches(Dilated(kMax, 4) & BlockLocal(8), 24, 24,
                           [](int64_t i, int64_t j) { return (i - j) % 4 == 0 && i / 8 == j / 8; });
  expect_attention_matches(BigBird(kMax, 1, 0, 0), 16, 16, [](int64_t, int64_t) { return true; });
  // A dilation of 2^31 - 1 costs the lengths, not the dilation: each query is its residue's only one.
  const BlockMask m = Dilated(kMax, kMax).block_mask(4096, 4096, 1, 64);
  EXPECT_EQ(m.num_q_blocks(), 4096);
  EXPECT_EQ(m.computed_pairs(0), 4096);
}

// Content-adaptive patterns with the largest k, block or k_blocks run in the memory of their lengths and give the
// results of the equivalent small parameters (k >= Lk keeps every key; one block covers every position).
TEST(PatternLimits, LargestAdaptiveParametersMatchTheirSmallEquivalents) {
  const int64_t L = 24, D = 8;
  const Tensor q = sparse_test::randn({1, 2, L, D}, 11), k = sparse_test::randn({1, 2, L, D}, 12),
               v = sparse_test::randn({1, 2, L, D}, 13), dout = sparse_test::randn({1, 2, L, D}, 14);
  struct Run {
    Tensor out, lse, dq, dk, dv;
  };
  auto run = [&](const Pattern& p) {
    SCOPED_TRACE(p.repr());
    Run r{Tensor(DType::kF32, {1, 2, L, D}), Tensor(DType::kF32, {1, 2, L}), Tensor(DType::kF32, q.shape()),
          Tensor(DType::kF32, k.shape()), Tensor(DType::kF32, v.shape())};
    sparse_attention(q, k, v, p, {}, r.out, r.lse);
    sparse_attention_backward(dout, q, k, v, r.out, r.lse, p, {}, {r.dq.view(), r.dk.view(), r.dv.view(), {}, {}, {}});
    return r;
  };
  auto expect_same = [&](const Pattern& big, const Pattern& small) {
    SCOPED_TRACE(big.repr() + " vs " + small.repr());
    const Run a = run(big), b = run(small);
    EXPECT_EQ(sparse_test::rel_err(a.out, b.out), 0.0);
    EXPECT_EQ(sparse_test::rel_err(a.lse, b.lse), 0.0);
    EXPECT_EQ(sparse_test::rel_err(a.dq, b.dq), 0.0);
    EXPECT_EQ(sparse_test::rel_err(a.dk, b.dk), 0.0);
    EXPECT_EQ(sparse_test::rel_err(a.dv, b.dv), 0.0);
  };
  expect_same(TopK(kMax), TopK(L));
  expect_same(TopK(kMax) & SlidingWindow(3, 3), TopK(L) & SlidingWindow(3, 3));
  expect_same(BlockTopK(kMax, 1), BlockTopK(L, 1));
  expect_same(BlockTopK(kMax, 1, true, true), BlockTopK(L, 1, true, true));
  expect_same(BlockTopK(kMax, 2) & SlidingWindow(-1, 0), BlockTopK(L, 2) & SlidingWindow(-1, 0));
  expect_same(BlockTopK(4, kMax), BlockTopK(4, L / 4));
  expect_same(BlockTopK(4, kMax, false, true) & SlidingWindow(8, 0),
              BlockTopK(4, L / 4, false, true) & SlidingWindow(8, 0));
  // The indices of k_blocks beyond the number of key blocks: the same blocks, then -1.
  Tensor wide(DType::kI64, {1, 2, L / 4, 100}), narrow(DType::kI64, {1, 2, L / 4, L / 4});
  Tensor out(DType::kF32, {1, 2, L, D});
  sparse_attention(q, k, v, BlockTopK(4, 100), {}, out, {}, wide);
  sparse_attention(q, k, v, BlockTopK(4, L / 4), {}, out, {}, narrow);
  for (int64_t row = 0; row < 2 * (L / 4); ++row)
    for (int64_t y = 0; y < 100; ++y)
      ASSERT_EQ(wide.data<int64_t>()[row * 100 + y], y < L / 4 ? narrow.data<int64_t>()[row * (L / 4) + y] : -1)
          << "row " << row << " column " << y;
}

TEST(PatternLimits, SpecsAreAtMost65536CharactersAndNestAtMost256Deep) {
  // A 10^6-term union used to parse and then overflow the stack when freed: now refused before parsing.
  const std::string huge = "Full()" + repeat(" | Full()", 999999);
  std::string m = spec_error(huge);
  EXPECT_NE(m.find("at most 65536 characters, got 8999997"), std::string::npos) << m.substr(0, 200);
  // The longest spec parses, and round-trips.
  std::string longest = "SlidingWindow(1, 1)" + repeat(" | SlidingWindow(1, 1)", (65536 - 19) / 22);
  longest += std::string(kMaxSpecLength - longest.size(), ' ');
  ASSERT_EQ(longest.size(), kMaxSpecLength);
  const Pattern p = Pattern::parse(longest);
  EXPECT_EQ(Pattern::parse(p.repr()), p);
  EXPECT_TRUE(p.allowed(0, 0, 5, 4, 9, 9));
  EXPECT_FALSE(p.allowed(0, 0, 5, 7, 9, 9));
  // 20 000 nested parentheses crashed `sattn sparse`: refused at the 257th level.
  m = spec_error(std::string(20000, '(') + "Full()" + std::string(20000, ')'));
  EXPECT_NE(m.find("nested at most 256 deep"), std::string::npos) << m;
  EXPECT_NE(m.find("at position 256"), std::string::npos) << m;
  EXPECT_NO_THROW(Pattern::parse(std::string(256, '(') + "Full()" + std::string(256, ')')));
  // Nested pattern arguments count too.
  auto nested_global = [](int n) { return repeat("GlobalTokens([0], ", n) + "Full()" + std::string(size_t(n), ')'); };
  EXPECT_NO_THROW(Pattern::parse(nested_global(255)));
  m = spec_error(nested_global(300));
  EXPECT_NE(m.find("nested at most 256 deep"), std::string::npos) << m;
  // A tree built in code is held to the same depth; its repr parses back.
  Pattern g = Full();
  for (int x = 1; x < kMaxPatternDepth; ++x) g = GlobalTokens({x}, g);
  EXPECT_EQ(Pattern::parse(g.repr()), g);
  expect_refused([&] { GlobalTokens({0}, g); }, {"GlobalTokens", "nested at most 256 deep, got 257"});
}

TEST(PatternLimits, LongUnionsAreWalkedAndFreedWithoutRecursion) {
  const Pattern w = SlidingWindow(1, 1), d = Dilated(1, 5);
  {
    Pattern u = w;  // a 10^6-term union, as `p = p | x` builds it
    for (int x = 1; x < 1000000; ++x) u = u | (x % 2 ? d : w);
    EXPECT_TRUE(u.allowed(0, 0, 10, 5, 16, 16));
    EXPECT_FALSE(u.allowed(0, 0, 10, 4, 16, 16));
    EXPECT_EQ(u.node().depth, 2);
    Pattern v = u & w;  // and something on top of it
    EXPECT_TRUE(v.allowed(0, 0, 10, 9, 16, 16));
  }  // freed here without recursing along the chain
  {
    Pattern u = w;  // 1000 terms: the exact masks
    for (int x = 1; x < 1000; ++x) u = u | (x % 2 ? d : w);
    expect_exact(u, 40, 40, 1,
                 [](int64_t, int64_t i, int64_t j) { return std::abs(i - j) <= 1 || std::abs(i - j) == 5; });
  }
  {
    Pattern u = w;  // 200 000 terms: repr
    for (int x = 1; x < 200000; ++x) u = u | (x % 2 ? d : w);
    const std::string r = u.repr();
    EXPECT_EQ(r.size(), 100000 * 19 + 100000 * 13 + 199999 * 3);
    EXPECT_EQ(r.substr(0, 38), "SlidingWindow(1, 1) | Dilated(1, 5) | ");
  }
  {
    Pattern u = w;  // & chains too
    for (int x = 1; x < 300000; ++x) u = u & w;
    EXPECT_TRUE(u.allowed(0, 0, 3, 4, 8, 8));
    EXPECT_FALSE(u.allowed(0, 0, 3, 5, 8, 8));
  }
  // A chain of the same operator on the right nests: refused past the depth limit.
  Pattern r = w;
  for (int x = 1; x < kMaxPatternDepth; ++x) r = w | r;
  EXPECT_EQ(r.node().depth, kMaxPatternDepth);
  EXPECT_EQ(Pattern::parse(r.repr()), r);
  expect_refused([&] { w | r; }, {"pattern |", "nested at most 256 deep, got 257"});
  // Alternating operators on the left nest as well.
  Pattern alt = w;
  for (int x = 1; x < kMaxPatternDepth; ++x) alt = x % 2 ? (alt | d) : (alt & w);
  EXPECT_EQ(Pattern::parse(alt.repr()), alt);
  expect_refused([&] { alt& w; }, {"pattern &", "nested at most 256 deep, got 257"});
}

TEST(PatternLimits, ReprRoundTripsForRandomValidParameters) {
  std::mt19937_64 gen(20240521);
  // Log-uniform in lo..hi with the ends themselves often.
  auto pick = [&](int64_t lo, int64_t hi) -> int64_t {
    const uint64_t c = gen() % 8;
    if (c == 0) return lo;
    if (c == 1) return hi;
    const int bits = 1 + int(gen() % 31);
    const int64_t span = hi - lo;
    return lo + int64_t(gen() % uint64_t(std::min<int64_t>(span, (int64_t(1) << bits) - 1) + 1));
  };
  auto pick_double = [&]() {
    const double x = std::ldexp(double(gen() >> 11) / double(uint64_t(1) << 53), int(gen() % 40) - 20);
    return gen() % 2 ? x : -x;
  };
  auto align = [&]() { return gen() % 2 ? Alignment::kTopLeft : Alignment::kBottomRight; };
  const std::vector<std::function<Pattern()>> makers = {
      [&] { return SlidingWindow(pick(-1, kMax), pick(-1, kMax), align()); },
      [&] { return Dilated(pick(0, kMax), pick(1, kMax), align()); },
      [&] { return BlockLocal(pick(1, kMax), align()); },
      [&] { return BigBird(pick(1, kMax), pick(0, kMax), pick(0, kMax), pick(0, kMax), gen(), align()); },
      [&] { return BigBird(pick(1, kMax), pick(0, kMax), pick(0, kMax), pick(0, kMax), gen() | (uint64_t(1) << 63)); },
      [&] {
        const int64_t height = pick(1, 46340), width = pick(1, kMax / height);
        const int64_t side = std::min(height, width), kernel = 1 + 2 * pick(0, (side - 1) / 2);
        return Neighborhood2D(height, width, kernel, pick(1, side / kernel), gen() % 2);
      },
      [&] {
        const int64_t window = pick(1, 46340), height = window * pick(1, kMax / window / window);
        const int64_t width = window * pick(1, kMax / height / window);
        return WindowAttention2D(height, width, window, pick(0, window - 1));
      },
      [&] { return Pattern(Full()); },
      [&] { return TopK(pick(1, kMax)); },
      [&] { return BlockTopK(pick(1, kMax), pick(1, kMax), gen() % 2, gen() % 2); },
      [&] { return ReLUAttention(1.0 + std::abs(pick_double()), gen() % 2 ? "sum" : "length"); },
      [&] { return MixedAttention(pick_double(), pick_double()); },
  };
  const size_t n_fixed = 8;  // makers[0..8) are fixed patterns (they compose)
  for (int round = 0; round < 400; ++round) {
    const Pattern p = makers[size_t(round) % makers.size()]();
    const std::string r = p.repr();
    ASSERT_NO_THROW(EXPECT_EQ(Pattern::parse(r).repr(), r)) << r;
    // Compositions of fixed patterns: unions, intersections, GlobalTokens.
    Pattern c = makers[gen() % n_fixed]();
    for (int x = 0, n = int(gen() % 5); x < n; ++x) {
      const Pattern e = makers[gen() % n_fixed]();
      switch (gen() % 4) {
        case 0: c = c | e; break;
        case 1: c = e & c; break;
        case 2: c = GlobalTokens({pick(0, kMax), pick(0, kMax)}, c, align()); break;
        default: c = e | (c & e); break;
      }
    }
    const std::string rc = c.repr();
    ASSERT_NO_THROW(EXPECT_EQ(Pattern::parse(rc).repr(), rc)) << rc;
  }
  // BigBird seeds >= 2^63 (their repr used to be refused by the parser).
  for (uint64_t seed : {uint64_t(1) << 63, ~uint64_t(0), uint64_t(12345678901234567890u)}) {
    const Pattern b = BigBird(8, 3, 1, 2, seed);
    EXPECT_EQ(Pattern::parse(b.repr()), b) << b.repr();
    EXPECT_EQ(b.repr(), "BigBird(8, 3, 1, 2, seed=" + std::to_string(seed) + ")");
  }
}

TEST(PatternLimits, SpecArgumentsThatAreNotInRangeIntegersAreNamed) {
  std::string m = spec_error("SlidingWindow(nan, 1)");
  EXPECT_NE(m.find("argument 'left': expected an integer, got nan at position 14"), std::string::npos) << m;
  m = spec_error("SlidingWindow(1, -inf)");
  EXPECT_NE(m.find("argument 'right': expected an integer, got -inf"), std::string::npos) << m;
  m = spec_error("BlockLocal(block=2.5)");
  EXPECT_NE(m.find("argument 'block': expected an integer, got 2.5"), std::string::npos) << m;
  m = spec_error("ReLUAttention(power=nan)");
  EXPECT_NE(m.find("power"), std::string::npos) << m;
  EXPECT_NE(m.find("nan"), std::string::npos) << m;
  m = spec_error("ReLUAttention(power=Infinity)");
  EXPECT_NE(m.find("power"), std::string::npos) << m;
  m = spec_error("MixedAttention(logits=(nan, 0))");
  EXPECT_NE(m.find("finite logits"), std::string::npos) << m;
  m = spec_error("MixedAttention(logits=(1" + std::string(400, '0') + ", 0))");  // beyond the double range
  EXPECT_NE(m.find("finite logits, got (inf, 0)"), std::string::npos) << m;
  m = spec_error("ReLUAttention(power=1" + std::string(400, '0') + ")");
  EXPECT_NE(m.find("expected power >= 1, got inf"), std::string::npos) << m;
  m = spec_error("ReLUAttention(power=1e400)");
  EXPECT_NE(m.find("number '1e400' is out of the range of a double"), std::string::npos) << m;
  m = spec_error("SlidingWindow(1, 99999999999999999999)");
  EXPECT_NE(m.find("argument 'right': expected an integer in -9223372036854775808..9223372036854775807, got "
                   "99999999999999999999"),
            std::string::npos)
      << m;
  m = spec_error("SlidingWindow(1, 9223372036854775807)");
  EXPECT_NE(m.find("SlidingWindow: expected right in -1..2147483647 (-1 = unbounded), got 9223372036854775807"),
            std::string::npos)
      << m;
  m = spec_error("GlobalTokens([1, 9223372036854775808], Full())");
  EXPECT_NE(m.find("64-bit integer in the list, got 9223372036854775808"), std::string::npos) << m;
  // Seeds: any uint64, nothing else (a negative seed used to wrap around silently).
  m = spec_error("BigBird(8, 1, 1, 1, seed=-1)");
  EXPECT_NE(m.find("argument 'seed': expected an integer in 0..18446744073709551615, got -1"), std::string::npos) << m;
  m = spec_error("BigBird(8, 1, 1, 1, seed=18446744073709551616)");
  EXPECT_NE(m.find("got 18446744073709551616"), std::string::npos) << m;
  EXPECT_EQ(Pattern::parse("BigBird(8, 1, 1, 1, seed=18446744073709551615)"), BigBird(8, 1, 1, 1, ~uint64_t(0)));
  m = spec_error("SlidingWindow(-9223372036854775808, 0)");
  EXPECT_NE(m.find("expected left in -1..2147483647 (-1 = unbounded), got -9223372036854775808"), std::string::npos)
      << m;
}

TEST(PatternLimits, CheckBuildsItsMessageOnlyOnFailure) {
  int calls = 0;
  auto part = [&] {
    ++calls;
    return std::string("costly");
  };
  check(true, ErrorKind::kInvalidArgument, "x: ", part);
  EXPECT_EQ(calls, 0);
  try {
    check(false, ErrorKind::kInvalidArgument, "x: ", part, " ", 3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "x: costly 3");
  }
  EXPECT_EQ(calls, 1);
}

TEST(PatternLimits, CliRefusesDeepAndLongSpecsOnOneLine) {
  using namespace sattn::testing_tools;
  ASSERT_TRUE(have_binary()) << "SATTN_BINARY_DIR/sattn not found";
  const std::string dir = temp_dir("spec_limits");
  for (const char* n : {"q", "k", "v"}) write_npy(dir + "/" + n + ".npy", randn({1, 1, 8, 4}, 7));
  const std::string deep = std::string(20000, '(') + "Full()" + std::string(20000, ')');
  RunResult r = run_sattn("sparse --q q.npy --k k.npy --v v.npy --out o.npy --pattern '" + deep + "'", dir);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err.rfind("sattn: error: pattern spec: expected patterns nested at most 256 deep at position 256", 0), 0u)
      << r.err.substr(0, 300);
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line";
  r = run_sattn("sparse --q q.npy --k k.npy --v v.npy --out o.npy --pattern 'SlidingWindow(nan, 1)'", dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "sattn: error: pattern spec: argument 'left': expected an integer, got nan at position 14 "
            "(near \"nan, 1)\")\n");
  r = run_sattn("sparse --q q.npy --k k.npy --v v.npy --out o.npy --pattern 'SlidingWindow(1, 9223372036854775807)'",
                dir);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("expected right in -1..2147483647"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line";
  r = run_sattn("sparse --q q.npy --k k.npy --v v.npy --out o.npy --pattern 'SlidingWindow(1, 2147483647)'", dir);
  EXPECT_EQ(r.code, 0) << r.err;
}
