// Inputs shared by the consumers: q [1, 2, 16, 8] with a smooth pattern.
#pragma once

#include <sattn/tensor.hpp>

#include <cmath>

inline sattn::Tensor example_q() {
  sattn::Tensor q(sattn::DType::kF32, {1, 2, 16, 8});
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] = std::sin(float(i));
  return q;
}
