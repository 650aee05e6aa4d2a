// Helpers shared by the sparse-attention tests: seeded N(0, sd) fp32 tensors and the relative error the issue's
// tolerances are stated in.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "sattn/tensor.hpp"

namespace sattn::sparse_test {

inline Tensor randn(Shape shape, uint64_t seed, double sd = 1.0) {
  Tensor t(DType::kF32, std::move(shape));
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, float(sd));
  for (int64_t x = 0; x < t.numel(); ++x) t.data<float>()[x] = n(g);
  return t;
}

inline double value_at(const Tensor& t, int64_t x) {
  return t.dtype() == DType::kF64 ? t.data<double>()[x] : t.data<float>()[x];
}

// |got - ref|_inf / max(1, |ref|_inf) over fp32 or fp64 tensors; infinite entries (lse of an empty row) and NaN
// (a row whose scores hold a NaN) must agree exactly, else the error is infinite.
inline double rel_err(const Tensor& got, const Tensor& ref) {
  EXPECT_EQ(got.numel(), ref.numel());
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double e = 0, m = 0;
  for (int64_t x = 0; x < got.numel(); ++x) {
    const double a = value_at(got, x), b = value_at(ref, x);
    if (std::isinf(a) || std::isinf(b)) {
      if (a != b) return kInf;
      continue;
    }
    if (std::isnan(a) || std::isnan(b)) {
      if (std::isnan(a) != std::isnan(b)) return kInf;
      continue;
    }
    e = std::max(e, std::abs(a - b));
    m = std::max(m, std::abs(b));
  }
  return e / std::max(1.0, m);
}

}  // namespace sattn::sparse_test
