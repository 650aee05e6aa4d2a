// The float32 exp of the softmaxes (simd/exp.inc) against std::exp in double, on every build this CPU runs:
// relative error, exact zeros at and below -88, NaN kept, e^0 = 1, finite at 88, Exp<true> equal to Exp<false>
// where x <= 0, and ExpN (several vectors interleaved) bitwise equal to Exp.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "test_exp.cpp"
#include "simd/hwy_targets.hpp"
#include <hwy/foreach_target.h>  // must come before highway.h

#include <hwy/highway.h>

#include <cstddef>

HWY_BEFORE_NAMESPACE();
namespace sattn_test_exp {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

#include "simd/exp.inc"  // Exp<kNoUpper>(d, x), ExpN<kNoUpper, kN>(d, x)

// y[i] = Exp<kNoUpper>(x[i]), i < n; n a multiple of 16 (the widest vector).
template <bool kNoUpper>
void ExpAll(const float* x, float* y, size_t n) {
  const hn::ScalableTag<float> d;
  for (size_t i = 0; i < n; i += hn::Lanes(d)) hn::StoreU(Exp<kNoUpper>(d, hn::LoadU(d, x + i)), d, y + i);
}
void ExpAnySign(const float* x, float* y, size_t n) { ExpAll<false>(x, y, n); }
void ExpNonPositive(const float* x, float* y, size_t n) { ExpAll<true>(x, y, n); }

// The same through ExpN, four vectors at a time (the rest one at a time); n a multiple of 16.
template <bool kNoUpper>
void ExpAllFour(const float* x, float* y, size_t n) {
  const hn::ScalableTag<float> d;
  const size_t N = hn::Lanes(d);
  size_t i = 0;
  for (; i + 4 * N <= n; i += 4 * N) {
    hn::Vec<decltype(d)> v[4];
    for (size_t u = 0; u < 4; ++u) v[u] = hn::LoadU(d, x + i + u * N);
    ExpN<kNoUpper>(d, v);
    for (size_t u = 0; u < 4; ++u) hn::StoreU(v[u], d, y + i + u * N);
  }
  for (; i < n; i += N) hn::StoreU(Exp<kNoUpper>(d, hn::LoadU(d, x + i)), d, y + i);
}
void ExpFourAnySign(const float* x, float* y, size_t n) { ExpAllFour<false>(x, y, n); }
void ExpFourNonPositive(const float* x, float* y, size_t n) { ExpAllFour<true>(x, y, n); }

}  // namespace HWY_NAMESPACE
}  // namespace sattn_test_exp
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "simd/dispatch.hpp"
#include "simd/target.hpp"

namespace sattn_test_exp {
namespace {

using ExpFn = void (*)(const float*, float*, size_t);
struct ExpOps {
  ExpFn any_sign, non_positive, four_any_sign, four_non_positive;
};
#define SATTN_TEST_EXP_OPS(NS) \
  ExpOps { &NS::ExpAnySign, &NS::ExpNonPositive, &NS::ExpFourAnySign, &NS::ExpFourNonPositive }
const sattn::simd::Build<ExpOps> kBuilds[] = {SATTN_SIMD_BUILDS(SATTN_TEST_EXP_OPS)};

std::vector<float> Padded(std::vector<float> x) {
  x.resize((x.size() + 15) / 16 * 16, 0.f);
  return x;
}

std::vector<float> Apply(ExpFn f, const std::vector<float>& x) {
  std::vector<float> y(x.size());
  f(x.data(), y.data(), x.size());
  return y;
}

TEST(Exp, WithinItsErrorBoundOnEveryBuild) {
  std::vector<float> x;
  for (int i = 0; i <= 2000000; ++i) x.push_back(-87.f + 175.f * float(i) / 2000000.f);  // [-87, 88]
  for (int i = 0; i <= 200000; ++i) x.push_back(-1.f + 2.f * float(i) / 200000.f);       // densely around 0
  for (float v : {0.f, -0.f, 1e-30f, -1e-30f, 0.3465736f, -0.3465736f, 0.3465737f, -0.3465737f, 88.f, -87.f})
    x.push_back(v);
  x = Padded(x);
  int runs = 0;
  for (const auto& build : kBuilds) {
    if (!sattn::simd::cpu_runs(build.target)) continue;
    ++runs;
    const std::string name = sattn::simd::name(build.target);
    const std::vector<float> y = Apply(build.ops.any_sign, x), y0 = Apply(build.ops.non_positive, x);
    double worst = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_TRUE(std::isfinite(y[i])) << name << ": x = " << x[i];
      worst = std::max(worst, std::fabs(double(y[i]) / std::exp(double(x[i])) - 1.0));
      if (x[i] <= 0) {
        ASSERT_EQ(y0[i], y[i]) << name << ": Exp<true> differs from Exp<false> at x = " << x[i];
      }
    }
    EXPECT_LT(worst, 1.9e-7) << name;
    std::printf("Exp (%s): worst relative error %.3g on [-87, 88]\n", name.c_str(), worst);
  }
  EXPECT_GE(runs, 1) << "the portable build runs everywhere";
}

TEST(Exp, ExactZerosOneAndNanOnEveryBuild) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = Padded({0.f, -0.f, -88.f, -88.5f, -100.f, -1e30f, -inf, nan, -nan});
  for (const auto& build : kBuilds) {
    if (!sattn::simd::cpu_runs(build.target)) continue;
    const std::string name = sattn::simd::name(build.target);
    for (ExpFn f : {build.ops.any_sign, build.ops.non_positive}) {
      const std::vector<float> y = Apply(f, x);
      EXPECT_EQ(y[0], 1.f) << name;
      EXPECT_EQ(y[1], 1.f) << name;
      for (int i = 2; i <= 6; ++i) {
        EXPECT_EQ(y[i], 0.f) << name << ": x = " << x[i];
        EXPECT_FALSE(std::signbit(y[i])) << name << ": x = " << x[i];
      }
      EXPECT_TRUE(std::isnan(y[7])) << name;
      EXPECT_TRUE(std::isnan(y[8])) << name;
    }
  }
}

TEST(Exp, InterleavedEqualsOneAtATimeOnEveryBuild) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x;
  for (int i = 0; i <= 400000; ++i) x.push_back(-100.f + 200.f * float(i) / 400000.f);  // both clamps included
  for (float v : {0.f, -0.f, -88.f, 88.f, -inf, inf, nan, 1e-30f, -1e-30f}) x.push_back(v);
  x = Padded(x);
  for (const auto& build : kBuilds) {
    if (!sattn::simd::cpu_runs(build.target)) continue;
    const std::string name = sattn::simd::name(build.target);
    const std::vector<float> one = Apply(build.ops.any_sign, x), four = Apply(build.ops.four_any_sign, x);
    const std::vector<float> one0 = Apply(build.ops.non_positive, x), four0 = Apply(build.ops.four_non_positive, x);
    for (size_t i = 0; i < x.size(); ++i) {
      ASSERT_EQ(std::memcmp(&one[i], &four[i], sizeof(float)), 0) << name << ": x = " << x[i];
      ASSERT_EQ(std::memcmp(&one0[i], &four0[i], sizeof(float)), 0) << name << ": x = " << x[i] << " (x <= 0 form)";
    }
  }
}

}  // namespace
}  // namespace sattn_test_exp
#endif  // HWY_ONCE
