// The reference kernel against the independent fp64 oracle (oracle.hpp): the pairwise forward sweep,
// a backward sweep, finite differences, dropout, fully masked rows, determinism and thread safety.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "oracle.hpp"
#include "sattn/attention.hpp"
#include "sattn/random.hpp"

namespace st = sattn::testing;
using sattn::AttentionOptions;
using sattn::Causal;
using sattn::DType;
using sattn::Tensor;

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}
}  // namespace

// ---- the sweep ---------------------------------------------------------------------------------------------

TEST(OracleHarness, PairwiseListCoversTheFactors) {
  const auto configs = st::pairwise_configs();
  // Every value of every factor appears, L = 1000 appears on both sides, and the list stays small.
  EXPECT_LT(configs.size(), 90u);
  auto has = [&](auto pred) { return std::any_of(configs.begin(), configs.end(), pred); };
  for (int64_t L : {1, 7, 64, 129, 1000}) {
    EXPECT_TRUE(has([&](const st::Config& c) { return c.len_q == L && c.len_k != L; })) << "Lq=" << L;
    EXPECT_TRUE(has([&](const st::Config& c) { return c.len_k == L && c.len_q != L; })) << "Lk=" << L;
  }
  for (int m = 0; m < st::kMaskCaseCount; ++m)
    for (Causal causal : {Causal::kNone, Causal::kTopLeft, Causal::kBottomRight})
      EXPECT_TRUE(has([&](const st::Config& c) { return int(c.mask) == m && c.causal == causal; }))
          << st::to_string(st::MaskCase(m)) << " " << sattn::to_string(causal);
  EXPECT_TRUE(has([](const st::Config& c) { return c.head_dim != c.head_dim_v && c.strided; }));
  EXPECT_TRUE(has([](const st::Config& c) { return c.heads_q == 8 && c.heads_kv == 1 && c.batch == 3; }));
  double total = 0;
  for (const auto& c : configs) total += c.cost();
  EXPECT_LT(total, 4e8) << "the sweep got too expensive";
}

TEST(OracleHarness, FullyMaskedConfigsHaveFullyMaskedRows) {
  for (const auto& c : st::pairwise_configs()) {
    if (!c.fully_masked) continue;
    const st::Problem p = st::make_problem(c);
    EXPECT_GT(st::naive_forward(p).fully_masked_rows, 0) << c.name();
  }
}

TEST(OracleHarness, NanConfigsHaveNanRows) {
  for (const auto& c : st::nan_row_configs()) EXPECT_GT(st::naive_forward(st::make_problem(c)).nan_rows, 0) << c.name();
}

TEST(OracleHarness, CompareHelperIsRelativeAndStrictOnNonFinite) {
  EXPECT_TRUE(st::all_close({1.0, 2.0}, {1.0, 2.0 + 1e-6}, 1e-6, "x"));
  EXPECT_FALSE(st::all_close({1.0, 2.0}, {1.0, 2.0 + 3e-6}, 1e-6, "x"));
  EXPECT_TRUE(st::all_close({1000.0}, {1000.0 + 5e-4}, 1e-6, "x"));  // relative to ||ref|| = 1000
  EXPECT_FALSE(st::all_close({1000.0}, {1000.0 + 2e-3}, 1e-6, "x"));
  EXPECT_TRUE(st::all_close({-kInf, 0.5}, {-kInf, 0.5}, 1e-6, "x"));
  EXPECT_FALSE(st::all_close({-1e30, 0.5}, {-kInf, 0.5}, 1e-6, "x"));
  EXPECT_FALSE(st::all_close({std::nan(""), 0.5}, {0.0, 0.5}, 1e-6, "x"));
  EXPECT_FALSE(st::all_close({0.0, 0.5}, {std::nan(""), 0.5}, 1e-6, "x"));
  EXPECT_FALSE(st::all_close({-kInf, 0.5}, {std::nan(""), 0.5}, 1e-6, "x"));
  EXPECT_TRUE(st::all_close({std::nan(""), 0.5}, {std::nan(""), 0.5}, 1e-6, "x"));
  EXPECT_FALSE(st::all_close({1.0}, {1.0, 2.0}, 1e-6, "x"));
}

// The reference through the same one-line sweep that other kernels use: float32 inputs (forward + backward).
SATTN_ORACLE_SWEEP(ReferenceF32, "reference", DType::kF32);

// And with float64 inputs (tolerance 1e-10), plus float32 computed with accumulate_fp64 (one final rounding).
class ReferenceF64Sweep : public ::testing::TestWithParam<st::Config> {};

TEST_P(ReferenceF64Sweep, ForwardAndBackwardMatchNaive) {
  st::CheckOptions co;
  {
    SCOPED_TRACE("float64 inputs");
    const st::Problem p = st::make_problem(GetParam(), DType::kF64);
    EXPECT_TRUE(st::check_forward(p, co));
    EXPECT_TRUE(st::check_backward(p, co));
  }
  {
    SCOPED_TRACE("float32 inputs, accumulate_fp64");
    st::Problem p = st::make_problem(GetParam(), DType::kF32, 5);
    p.options.accumulate_fp64 = true;
    co.tol = 1e-6;
    EXPECT_TRUE(st::check_forward(p, co));
  }
}

INSTANTIATE_TEST_SUITE_P(Pairwise, ReferenceF64Sweep, ::testing::ValuesIn(st::pairwise_backward_configs()),
                         st::ConfigName());

// ---- backward vs finite differences -------------------------------------------------------------------------

namespace {

// L(q, k, v, mask) = sum(dout * naive_out(q, k, v, mask)) for a problem whose values are edited in place.
double loss(const st::Problem& p, const std::vector<double>& dout) {
  const auto out = st::naive_forward(p).out;
  double s = 0.0;
  for (size_t n = 0; n < out.size(); ++n) s += out[n] * dout[n];
  return s;
}

struct Grads {
  std::vector<double> dq, dk, dv, dmask;
};

// The library's gradients (reference kernel, f64) for `p` and `dout`.
Grads library_grads(const st::Problem& p, const std::vector<double>& dout_values) {
  Tensor out(DType::kF64, p.out_shape()), lse(DType::kF64, p.lse_shape()), dout(DType::kF64, p.out_shape());
  std::copy(dout_values.begin(), dout_values.end(), dout.data<double>());
  Tensor dq(DType::kF64, p.q.shape), dk(DType::kF64, p.k.shape), dv(DType::kF64, p.v.shape), dmask;
  sattn::AttentionGrads grads{dq, dk, dv, {}};
  if (st::is_additive(p.config.mask)) dmask = Tensor(DType::kF64, p.mask_shape), grads.dmask = dmask;
  AttentionOptions o = p.options;
  o.kernel = "reference";
  sattn::scaled_dot_product_attention(p.q, p.k, p.v, o, {out, lse, {}});
  sattn::scaled_dot_product_attention_backward(dout, p.q, p.k, p.v, out, lse, o, grads);
  Grads g{st::to_doubles(dq), st::to_doubles(dk), st::to_doubles(dv), {}};
  if (dmask.defined()) g.dmask = st::to_doubles(dmask);
  return g;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (size_t n = 0; n < a.size(); ++n)
    if (std::isfinite(a[n]) && std::isfinite(b[n])) s += a[n] * b[n];
  return s;
}

// Central difference of the loss along u (one direction per tensor; the others 0). -inf mask entries stay
// -inf under perturbation, which is exactly right: they are not differentiable inputs.
double directional_fd(st::Problem p, const std::vector<double>& dout, int which, const std::vector<double>& u,
                      double eps) {
  auto& x = which == 0 ? p.qd : which == 1 ? p.kd : which == 2 ? p.vd : p.mask_own;
  const std::vector<double> x0 = x;
  for (size_t n = 0; n < x.size(); ++n) x[n] = x0[n] + eps * u[n];
  const double plus = loss(p, dout);
  for (size_t n = 0; n < x.size(); ++n) x[n] = x0[n] - eps * u[n];
  const double minus = loss(p, dout);
  return (plus - minus) / (2 * eps);
}

void check_directional(const st::Config& c, int directions) {
  const st::Problem p = st::make_problem(c, DType::kF64, 11);
  const auto dout = st::random_normal(size_t(sattn::numel(p.out_shape())), 12);
  const Grads lib = library_grads(p, dout);
  const st::NaiveGrads naive = st::naive_backward(p, dout);
  const int tensors = st::is_additive(c.mask) ? 4 : 3;
  for (int which = 0; which < tensors; ++which) {
    const auto& g_lib = which == 0 ? lib.dq : which == 1 ? lib.dk : which == 2 ? lib.dv : lib.dmask;
    const auto& g_naive = which == 0 ? naive.dq : which == 1 ? naive.dk : which == 2 ? naive.dv : naive.dmask;
    for (int d = 0; d < directions; ++d) {
      const auto u = st::random_normal(g_lib.size(), 100 + 10 * which + d);
      const double fd = directional_fd(p, dout, which, u, 1e-5);
      const char* name[] = {"dq", "dk", "dv", "dmask"};
      EXPECT_NEAR(dot(g_lib, u), fd, 1e-6 * std::max(1.0, std::abs(fd)))
          << name[which] << " along direction " << d << " [" << c.name() << "]";
      EXPECT_NEAR(dot(g_naive, u), fd, 1e-6 * std::max(1.0, std::abs(fd)))
          << "naive " << name[which] << " along direction " << d << " [" << c.name() << "]";
    }
  }
}

}  // namespace

TEST(ReferenceBackward, FullJacobianOfTinyProblemsMatchesFiniteDifferences) {
  // Every partial derivative, for a few tiny problems with GQA, Lq != Lk, causal alignment, masks.
  std::vector<st::Config> tiny;
  {
    st::Config c;
    c.batch = 2, c.heads_q = 2, c.heads_kv = 1, c.len_q = 3, c.len_k = 4, c.head_dim = 3, c.head_dim_v = 2;
    c.mask = st::MaskCase::kAdd4D;
    c.causal = Causal::kBottomRight;
    tiny.push_back(c);
    c.mask = st::MaskCase::kAddHeadKeys, c.causal = Causal::kTopLeft, c.strided = true, c.dropout_p = 0.2;
    c.key_padding = sattn::KeyPaddingKind::kLengths;
    tiny.push_back(c);
    c.mask = st::MaskCase::kBool2D, c.fully_masked = true, c.len_q = 5, c.len_k = 2, c.causal = Causal::kNone;
    c.key_padding = sattn::KeyPaddingKind::kNone;
    tiny.push_back(c);
  }
  for (const auto& c : tiny) {
    const st::Problem p = st::make_problem(c, DType::kF64, 21);
    const auto dout = st::random_normal(size_t(sattn::numel(p.out_shape())), 22);
    const Grads lib = library_grads(p, dout);
    const int tensors = st::is_additive(c.mask) ? 4 : 3;
    for (int which = 0; which < tensors; ++which) {
      const auto& g = which == 0 ? lib.dq : which == 1 ? lib.dk : which == 2 ? lib.dv : lib.dmask;
      for (size_t n = 0; n < g.size(); ++n) {
        std::vector<double> e(g.size(), 0.0);
        e[n] = 1.0;
        const double fd = directional_fd(p, dout, which, e, 1e-6);
        if (which == 3 && p.mask_own[n] == -kInf) {
          EXPECT_EQ(g[n], 0.0) << "dmask at a -inf entry";
          continue;
        }
        EXPECT_NEAR(g[n], fd, 1e-7 * std::max(1.0, std::abs(fd)))
            << "tensor " << which << " index " << n << " [" << c.name() << "]";
      }
    }
  }
}

class ReferenceFiniteDifferences : public ::testing::TestWithParam<st::Config> {};

TEST_P(ReferenceFiniteDifferences, RandomDirections) { check_directional(GetParam(), 2); }

namespace {
std::vector<st::Config> fd_configs() {
  // Small members of the backward sweep (finite differences cost 2 naive forwards per direction), without the
  // huge-bias masks: a bias of -1e30 swallows the scores and any perturbation, so the differences are 0 where the
  // analytic gradient (of the softmax at the rounded, equal scores) is not.
  std::vector<st::Config> out;
  for (const auto& c : st::pairwise_backward_configs())
    if (c.cost() <= 2e5 && c.mask != st::MaskCase::kAddHuge2D && c.mask != st::MaskCase::kAddMinB1QK) out.push_back(c);
  return out;
}
}  // namespace

INSTANTIATE_TEST_SUITE_P(Pairwise, ReferenceFiniteDifferences, ::testing::ValuesIn(fd_configs()), st::ConfigName());

TEST(ReferenceBackward, DmaskIsReducedToEveryBroadcastShape) {
  // dmask of a broadcast mask equals the full [B, Hq, Lq, Lk] dS summed over the broadcast dimensions.
  st::Config c;
  c.batch = 2, c.heads_q = 4, c.heads_kv = 2, c.len_q = 5, c.len_k = 6, c.head_dim = 4, c.head_dim_v = 3;
  c.mask = st::MaskCase::kAdd4D;
  const st::Problem full = st::make_problem(c, DType::kF64, 31);
  const auto dout = st::random_normal(size_t(sattn::numel(full.out_shape())), 32);
  const auto full_grad = library_grads(full, dout).dmask;  // [B, Hq, Lq, Lk]
  ASSERT_EQ(full_grad.size(), size_t(2 * 4 * 5 * 6));
  // Broadcast shapes: the same finite values as the full mask wherever they coincide are not needed; instead
  // build a broadcast mask and compare with the full gradient of its expansion.
  for (const sattn::Shape& shape : std::vector<sattn::Shape>{{5, 6}, {4, 1, 6}, {2, 1, 1, 6}, {6}, {2, 4, 5, 1}, {1}}) {
    st::Problem p = full;
    p.mask_shape = shape;
    p.mask_own = st::random_normal(size_t(sattn::numel(shape)), 33);
    p.mask_store = Tensor(DType::kF64, shape);
    std::copy(p.mask_own.begin(), p.mask_own.end(), p.mask_store.data<double>());
    p.options.attn_mask = p.mask_store;
    // The expanded problem: the same values materialised to [B, Hq, Lq, Lk].
    st::Problem e = full;
    e.mask_shape = {2, 4, 5, 6};
    e.mask_store = Tensor(DType::kF64, e.mask_shape);
    e.mask_own.assign(2 * 4 * 5 * 6, 0.0);
    const int64_t off = 4 - int64_t(shape.size());
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t i = 0; i < 5; ++i)
          for (int64_t j = 0; j < 6; ++j) {
            const int64_t fi[4] = {b, h, i, j};
            int64_t o = 0, stride = 1;
            for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
              if (shape[d] != 1) o += fi[off + d] * stride;
              stride *= shape[d];
            }
            e.mask_own[size_t(((b * 4 + h) * 5 + i) * 6 + j)] = p.mask_own[size_t(o)];
          }
    std::copy(e.mask_own.begin(), e.mask_own.end(), e.mask_store.data<double>());
    e.options.attn_mask = e.mask_store;
    const auto g_full = library_grads(e, dout).dmask;
    std::vector<double> reduced(p.mask_own.size(), 0.0);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t h = 0; h < 4; ++h)
        for (int64_t i = 0; i < 5; ++i)
          for (int64_t j = 0; j < 6; ++j) {
            const int64_t fi[4] = {b, h, i, j};
            int64_t o = 0, stride = 1;
            for (int64_t d = int64_t(shape.size()) - 1; d >= 0; --d) {
              if (shape[d] != 1) o += fi[off + d] * stride;
              stride *= shape[d];
            }
            reduced[size_t(o)] += g_full[size_t(((b * 4 + h) * 5 + i) * 6 + j)];
          }
    const auto g = library_grads(p, dout).dmask;
    EXPECT_TRUE(st::all_close(g, reduced, 1e-12, "dmask " + sattn::shape_to_string(shape)));
    // And the directional derivative along the broadcast mask's own coordinates.
    const auto u = st::random_normal(g.size(), 34);
    const double fd = directional_fd(p, dout, 3, u, 1e-5);
    EXPECT_NEAR(dot(g, u), fd, 1e-6 * std::max(1.0, std::abs(fd))) << sattn::shape_to_string(shape);
  }
}

// ---- dropout ---------------------------------------------------------------------------------------------------

TEST(ReferenceDropout, KeepRuleScalingAndRate) {
  st::Config c;
  c.batch = 2, c.heads_q = 2, c.heads_kv = 2, c.len_q = 64, c.len_k = 80, c.head_dim = 16, c.head_dim_v = 8;
  c.causal = Causal::kBottomRight;
  const st::Problem p = st::make_problem(c, DType::kF32);
  const double drop = 0.3;
  AttentionOptions o0 = p.options, o1 = p.options;
  o1.dropout_p = drop;
  o1.seed = 1234;
  const auto r0 = sattn::attention(p.q, p.k, p.v, o0, true, true);
  const auto r1 = sattn::attention(p.q, p.k, p.v, o1, true, true);
  // lse does not depend on dropout.
  EXPECT_TRUE(st::all_close(r1.lse, st::to_doubles(r0.lse), 0.0, "lse"));
  int64_t allowed = 0, kept = 0;
  const float* w0 = r0.weights.data<float>();
  const float* w1 = r1.weights.data<float>();
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t i = 0; i < 64; ++i)
        for (int64_t j = 0; j < 80; ++j) {
          const size_t n = size_t(((b * 2 + h) * 64 + i) * 80 + j);
          if (w0[n] == 0.0f) {
            EXPECT_EQ(w1[n], 0.0f);
            continue;
          }
          ++allowed;
          const bool keep = sattn::dropout_keep(1234, drop, uint32_t(b), uint32_t(h), uint32_t(i), uint32_t(j));
          kept += keep;
          if (keep) EXPECT_NEAR(w1[n], w0[n] / (1 - drop), 1e-6 * (w0[n] / (1 - drop)) + 1e-9);
          else EXPECT_EQ(w1[n], 0.0f);
        }
  const double rate = double(kept) / double(allowed);
  const double sigma = std::sqrt(drop * (1 - drop) / double(allowed));
  EXPECT_NEAR(rate, 1 - drop, 5 * sigma) << allowed << " allowed weights";
  // The output is the dropped weights times v (checked by the oracle sweep); a different seed drops others.
  AttentionOptions o2 = o1;
  o2.seed = 1235;
  const auto r2 = sattn::attention(p.q, p.k, p.v, o2, false, true);
  EXPECT_FALSE(same_bits(r1.weights, r2.weights));
  const auto r1b = sattn::attention(p.q, p.k, p.v, o1, false, true);
  EXPECT_TRUE(same_bits(r1.weights, r1b.weights));
}

TEST(ReferenceDropout, PhiloxKeepRateAndIndependenceOfCoordinates) {
  for (double drop : {0.1, 0.5, 0.9}) {
    int64_t kept = 0, n = 0;
    for (uint32_t h = 0; h < 4; ++h)
      for (uint32_t i = 0; i < 100; ++i)
        for (uint32_t j = 0; j < 100; ++j, ++n) kept += sattn::dropout_keep(7, drop, 1, h, i, j);
    const double sigma = std::sqrt(drop * (1 - drop) / double(n));
    EXPECT_NEAR(double(kept) / double(n), 1 - drop, 5 * sigma) << "p=" << drop;
  }
  // Swapping coordinates changes the decision stream (the counter is (b, h, i, j), not a sum).
  int64_t differ = 0;
  for (uint32_t i = 0; i < 200; ++i)
    differ += sattn::dropout_keep(7, 0.5, 0, 0, i, i + 1) != sattn::dropout_keep(7, 0.5, 0, 0, i + 1, i);
  EXPECT_GT(differ, 50);
  // p = 0 keeps everything.
  for (uint32_t j = 0; j < 1000; ++j) EXPECT_TRUE(sattn::dropout_keep(9, 0.0, 0, 0, 0, j));
}

// ---- fully masked rows -----------------------------------------------------------------------------------------

TEST(ReferenceFullyMasked, ZeroOutputZeroWeightsMinusInfLseZeroGradsNeverNaN) {
  // Batch 0: a 4-D additive mask with row (b=0, h=0, i=4) all -inf;
  // batch 1: key length 0 (every row masked); bottom-right causal with Lq > Lk masks the first rows.
  const int64_t B = 2, H = 2, Lq = 6, Lk = 4, D = 5, Dv = 3;
  Tensor q(DType::kF32, {B, H, Lq, D}), k(DType::kF32, {B, 1, Lk, D}), v(DType::kF32, {B, 1, Lk, Dv});
  const auto rq = st::random_normal(size_t(q.numel()), 1), rk = st::random_normal(size_t(k.numel()), 2),
             rv = st::random_normal(size_t(v.numel()), 3);
  for (int64_t n = 0; n < q.numel(); ++n) q.data<float>()[n] = float(rq[size_t(n)]);
  for (int64_t n = 0; n < k.numel(); ++n) k.data<float>()[n] = float(rk[size_t(n)]);
  for (int64_t n = 0; n < v.numel(); ++n) v.data<float>()[n] = float(rv[size_t(n)]);
  Tensor mask(DType::kF32, {B, H, Lq, Lk});
  for (int64_t j = 0; j < Lk; ++j) mask.data<float>()[(0 * Lq + 4) * Lk + j] = -std::numeric_limits<float>::infinity();
  Tensor lengths(DType::kI32, {B});
  lengths.data<int32_t>()[0] = 4;
  lengths.data<int32_t>()[1] = 0;
  AttentionOptions o;
  o.attn_mask = mask;
  o.key_lengths = lengths;
  o.causal = Causal::kBottomRight;  // rows i < Lq - Lk = 2 see no key
  o.dropout_p = 0.25;
  const auto r = sattn::attention(q, k, v, o, true, true);
  auto fully_masked = [&](int64_t b, int64_t h, int64_t i) { return b == 1 || i < 2 || (b == 0 && h == 0 && i == 4); };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        const float lse = r.lse.data<float>()[(b * H + h) * Lq + i];
        EXPECT_FALSE(std::isnan(lse));
        if (!fully_masked(b, h, i)) {
          EXPECT_TRUE(std::isfinite(lse)) << b << h << i;
          continue;
        }
        EXPECT_EQ(lse, -std::numeric_limits<float>::infinity()) << b << h << i;
        for (int64_t d = 0; d < Dv; ++d) EXPECT_EQ(r.out.data<float>()[((b * H + h) * Lq + i) * Dv + d], 0.0f);
        for (int64_t j = 0; j < Lk; ++j) EXPECT_EQ(r.weights.data<float>()[((b * H + h) * Lq + i) * Lk + j], 0.0f);
      }
  // Backward: zero gradients from masked rows; every gradient finite; batch 1 gets all-zero dk/dv.
  Tensor dout(DType::kF32, {B, H, Lq, Dv});
  for (int64_t n = 0; n < dout.numel(); ++n) dout.data<float>()[n] = 1.0f + 0.1f * float(n % 7);
  Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape()),
      dmask(DType::kF32, mask.shape());
  sattn::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, o, {dq, dk, dv, dmask});
  for (const Tensor* t : {&dq, &dk, &dv, &dmask})
    for (int64_t n = 0; n < t->numel(); ++n) ASSERT_TRUE(std::isfinite(t->data<float>()[n]));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i)
        if (fully_masked(b, h, i)) {
          for (int64_t d = 0; d < D; ++d) EXPECT_EQ(dq.data<float>()[((b * H + h) * Lq + i) * D + d], 0.0f);
          for (int64_t j = 0; j < Lk; ++j) EXPECT_EQ(dmask.data<float>()[((b * H + h) * Lq + i) * Lk + j], 0.0f);
        }
  for (int64_t n = Lk * D; n < 2 * Lk * D; ++n) EXPECT_EQ(dk.data<float>()[n], 0.0f);
  for (int64_t n = Lk * Dv; n < 2 * Lk * Dv; ++n) EXPECT_EQ(dv.data<float>()[n], 0.0f);
  // Something did flow through the allowed rows.
  double sum = 0;
  for (int64_t n = 0; n < Lk * Dv; ++n) sum += std::abs(dv.data<float>()[n]);
  EXPECT_GT(sum, 0.0);
}

TEST(ReferenceFullyMasked, BoolMaskAllFalseAndAllPaddingKeys) {
  st::Config c;
  c.batch = 3, c.heads_q = 2, c.heads_kv = 2, c.len_q = 7, c.len_k = 9, c.head_dim = 8, c.head_dim_v = 4;
  c.mask = st::MaskCase::kBool2D;
  c.fully_masked = true;
  c.key_padding = sattn::KeyPaddingKind::kBool;
  st::Problem p = st::make_problem(c);
  // Every key of batch 2 is padding as well.
  for (int64_t j = 0; j < 9; ++j) p.kpm_store.data<uint8_t>()[2 * 9 + j] = 1, p.padding[size_t(2 * 9 + j)] = 1;
  EXPECT_GE(st::naive_forward(p).fully_masked_rows, 2 * 7 + 1);
  st::CheckOptions co;
  EXPECT_TRUE(st::check_forward(p, co));
  EXPECT_TRUE(st::check_backward(p, co));
}

// ---- determinism, threads, memory ---------------------------------------------------------------------------------

TEST(ReferenceThreads, BitwiseIdenticalFor1To3Threads) {
  st::Config c;
  c.batch = 3, c.heads_q = 8, c.heads_kv = 2, c.len_q = 33, c.len_k = 70, c.head_dim = 16, c.head_dim_v = 24;
  c.mask = st::MaskCase::kAdd4D;
  c.causal = Causal::kTopLeft;
  c.dropout_p = 0.1;
  c.strided = true;
  const st::Problem p = st::make_problem(c);
  std::vector<Tensor> results[3];
  for (int t = 1; t <= 3; ++t) {
    AttentionOptions o = p.options;
    o.num_threads = t;
    auto r = sattn::attention(p.q, p.k, p.v, o, true, true);
    Tensor dout(DType::kF32, r.out.shape());
    for (int64_t n = 0; n < dout.numel(); ++n) dout.data<float>()[n] = float(std::sin(0.1 * double(n)));
    Tensor dq(DType::kF32, p.q.shape), dk(DType::kF32, p.k.shape), dv(DType::kF32, p.v.shape),
        dm(DType::kF32, p.mask_shape);
    sattn::scaled_dot_product_attention_backward(dout, p.q, p.k, p.v, r.out, r.lse, o, {dq, dk, dv, dm});
    results[t - 1] = {r.out, r.lse, r.weights, dq, dk, dv, dm};
  }
  for (int t = 1; t < 3; ++t)
    for (size_t n = 0; n < results[0].size(); ++n)
      EXPECT_TRUE(same_bits(results[0][n], results[t][n])) << "result " << n << " with " << t + 1 << " threads";
}

TEST(ReferenceThreads, ConcurrentCallersGetTheirOwnResults) {
  // Several std::threads call forward + backward at once, each on its own problem, some with OpenMP threads.
  std::vector<st::Config> configs;
  for (const auto& c : st::pairwise_backward_configs())
    if (c.cost() < 2e5 && configs.size() < 6) configs.push_back(c);
  ASSERT_GE(configs.size(), 4u);
  std::vector<st::Problem> problems;
  std::vector<Tensor> expected;
  for (const auto& c : configs) {
    problems.push_back(st::make_problem(c));
    expected.push_back(
        sattn::attention(problems.back().q, problems.back().k, problems.back().v, problems.back().options, true, false)
            .out);
  }
  std::vector<int> failures(configs.size(), 0);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < configs.size(); ++t)
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 3; ++rep) {
        AttentionOptions o = problems[t].options;
        o.num_threads = 1 + int(t % 2);
        try {
          const auto r = sattn::attention(problems[t].q, problems[t].k, problems[t].v, o, true, false);
          if (!same_bits(r.out, expected[t])) ++failures[t];
          st::CheckOptions co;
          co.num_threads = o.num_threads;
          if (!st::check_backward(problems[t], co)) ++failures[t];
        } catch (...) {
          ++failures[t];
        }
      }
    });
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < configs.size(); ++t) EXPECT_EQ(failures[t], 0) << configs[t].name();
}

TEST(ReferenceMemory, RefusesOverTheLimitNamingTheSize) {
  Tensor q(DType::kF32, {1, 2, 1000, 8}), k(DType::kF32, {1, 2, 1000, 8});
  AttentionOptions o;
  o.kernel = "reference";          // the limit guards the materialising kernel
  o.memory_limit_bytes = 4 << 20;  // 4 MiB; the scores need 2 * 1000 * 1000 * 5 bytes
  try {
    sattn::attention(q, k, k, o);
    FAIL() << "expected kOutOfMemory";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), sattn::ErrorKind::kOutOfMemory);
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[1, 2, 1000, 1000]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("MiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("memory_limit_bytes"), std::string::npos) << msg;
  }
  o.memory_limit_bytes = 64 << 20;
  EXPECT_NO_THROW(sattn::attention(q, k, k, o));
}

TEST(ReferenceMemory, DefaultLimitRefusesAnAbsurdProblemWithoutAllocating) {
  // 2^21 x 2^21 scores (17 TiB in f32) from 8 MiB inputs: refused, not killed.
  const int64_t L = int64_t(1) << 21;
  Tensor q(DType::kF32, {1, 1, L, 1});
  sattn::AttentionOptions ref;
  ref.kernel = "reference";  // the limit guards the materialising kernel; the fused one needs no L x L buffer
  for (bool weights : {false, true}) {
    try {
      sattn::attention(q, q, q, weights ? sattn::AttentionOptions{} : ref, false, weights);
      FAIL() << "expected kOutOfMemory";
    } catch (const sattn::Error& e) {
      EXPECT_EQ(e.kind(), sattn::ErrorKind::kOutOfMemory);
      EXPECT_NE(std::string(e.what()).find("[1, 1, 2097152, 2097152]"), std::string::npos) << e.what();
    }
  }
  // Backward is refused the same way.
  Tensor out(DType::kF32, {1, 1, L, 1}), lse(DType::kF32, {1, 1, L}), g1(DType::kF32, {1, 1, L, 1}),
      g2(DType::kF32, {1, 1, L, 1}), g3(DType::kF32, {1, 1, L, 1});
  try {
    sattn::scaled_dot_product_attention_backward(out, q, q, q, out, lse, ref, {g1, g2, g3, {}});
    FAIL() << "expected kOutOfMemory";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), sattn::ErrorKind::kOutOfMemory);
  }
}

// ---- half-precision inputs and outputs -------------------------------------------------------------------------

TEST(ReferenceHalf, Float16AndBfloat16InputsAreExactInTheOracle) {
  // The oracle sees exactly the rounded half values, and the reference computes in float32, so the float32
  // tolerance holds for float32 outputs; float16 / bfloat16 outputs add one rounding of the result.
  st::Config c;
  c.batch = 2, c.heads_q = 4, c.heads_kv = 2, c.len_q = 17, c.len_k = 33, c.head_dim = 16, c.head_dim_v = 8;
  c.mask = st::MaskCase::kAdd2D;
  c.causal = Causal::kBottomRight;
  c.strided = true;
  for (DType dt : {DType::kF16, DType::kBF16}) {
    const st::Problem p = st::make_problem(c, dt);
    st::CheckOptions co;
    co.tol = 2e-5;
    EXPECT_TRUE(st::check_forward(p, co)) << sattn::to_string(dt);
    // Half outputs: only `out` may be half; lse and weights stay float32.
    co.out_dtype = dt;
    co.tol = dt == DType::kF16 ? 1e-3 : 8e-3;  // one rounding: 2^-11 (f16) / 2^-8 (bf16) relative
    co.lse = co.weights = false;
    EXPECT_TRUE(st::check_forward(p, co)) << sattn::to_string(dt) << " out";
  }
}
