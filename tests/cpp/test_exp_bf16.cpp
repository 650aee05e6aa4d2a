// ExpForBf16 (simd/exp_bf16.inc) against std::exp in double: relative error, the exact zeros below -88,
// NaN, e^0 = 1 and the largest argument, on CPUs with AVX-512 (skipped elsewhere, with the reason).
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#include "simd/exp_bf16.inc"

__attribute__((target("avx512f"))) void exp_all(const std::vector<float>& x, std::vector<float>& y) {
  y.resize(x.size());
  for (size_t i = 0; i < x.size(); i += 16) {
    float in[16] = {}, out[16];
    for (size_t l = 0; l < 16 && i + l < x.size(); ++l) in[l] = x[i + l];
    _mm512_storeu_ps(out, ExpForBf16(_mm512_loadu_ps(in)));
    for (size_t l = 0; l < 16 && i + l < x.size(); ++l) y[i + l] = out[l];
  }
}

TEST(ExpForBf16, WithinItsErrorBoundAndExactWhereItSaysSo) {
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "this CPU has no AVX-512F: ExpForBf16 is not run here";
  std::vector<float> x;
  for (int i = 0; i <= 800000; ++i) x.push_back(-87.f + 175.f * float(i) / 800000.f);  // (-88, 88]
  for (float v : {0.f, -0.f, 1e-30f, -1e-30f, 0.3465f, -0.3466f, 8.f, 88.f, -87.9f}) x.push_back(v);
  std::vector<float> y;
  exp_all(x, y);
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_TRUE(std::isfinite(y[i])) << x[i];
    worst = std::max(worst, std::fabs(double(y[i]) / std::exp(double(x[i])) - 1.0));
  }
  EXPECT_LT(worst, 3.5e-6);
  std::printf("ExpForBf16: worst relative error %.3g on (-87, 88]\n", worst);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> edge = {0.f, -88.f, -88.5f, -100.f, -1e30f, -inf, nan, -nan};
  exp_all(edge, y);
  EXPECT_EQ(y[0], 1.f);                                             // the row max's P is exactly 1
  for (size_t i = 1; i <= 5; ++i) EXPECT_EQ(y[i], 0.f) << edge[i];  // masked keys: exactly 0
  EXPECT_TRUE(std::isnan(y[6]) && std::isnan(y[7]));                // a NaN score keeps its row NaN
}
#else
TEST(ExpForBf16, WithinItsErrorBoundAndExactWhereItSaysSo) { GTEST_SKIP() << "not an x86-64 GCC build"; }
#endif

}  // namespace
