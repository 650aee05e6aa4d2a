#include <gtest/gtest.h>

#include "sattn/attention.hpp"

TEST(Smoke, ReferenceRuns) {
  sattn::Tensor q(sattn::DType::kF32, {1, 1, 3, 4});
  auto r = sattn::attention(q, q, q, {}, true, true);
  EXPECT_EQ(r.info.kernel, "reference");
}
