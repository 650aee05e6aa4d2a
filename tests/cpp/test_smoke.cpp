#include <gtest/gtest.h>

#include "sattn/attention.hpp"

TEST(Smoke, ReferenceRuns) {
  sattn::Tensor q(sattn::DType::kF32, {1, 1, 3, 4});
  auto r = sattn::attention(q, q, q, {}, true, true);
  EXPECT_EQ(r.info.kernel, "reference");
}

// A shape whose size overflows is an error (kOutOfMemory), not a wrapped allocation.
TEST(Smoke, TensorSizeOverflowIsAnError) {
  const int64_t big = int64_t(1) << 40;
  for (const sattn::Shape& s : {sattn::Shape{big, big}, sattn::Shape{big, big, big}, sattn::Shape{int64_t(1) << 61}}) {
    try {
      sattn::Tensor t(sattn::DType::kF32, s);
      ADD_FAILURE() << "no error for " << sattn::shape_to_string(s);
    } catch (const sattn::Error& e) {
      EXPECT_EQ(e.kind(), sattn::ErrorKind::kOutOfMemory) << e.what();
    }
  }
  EXPECT_EQ(sattn::Tensor(sattn::DType::kF32, {0, big}).numel(), 0);
}

// A tensor's storage starts on a cache line (64 bytes; whole vectors aligned, the kernels' non-temporal stores),
// from 4 MiB on on a 2 MiB page, and is zeroed.
TEST(Smoke, TensorStorageIsCacheLineAlignedAndZeroed) {
  for (const int64_t n : {int64_t(0), int64_t(1), int64_t(3), int64_t(1000), int64_t(5) << 20}) {
    const sattn::Tensor t(sattn::DType::kU8, {n});
    const auto at = reinterpret_cast<uintptr_t>(t.data());
    EXPECT_EQ(at % 64, 0u) << n << " bytes";
    if (n >= int64_t(4) << 20) {
      EXPECT_EQ(at % (uintptr_t(2) << 20), 0u) << n << " bytes";
    }
    int64_t nonzero = 0;
    for (int64_t x = 0; x < n; ++x) nonzero += t.data<uint8_t>()[x] != 0;
    EXPECT_EQ(nonzero, 0) << n << " bytes";
  }
}

TEST(Smoke, ShapeTextWritesWhatShapeToStringReturns) {
  for (const sattn::Shape& s : {sattn::Shape{}, sattn::Shape{3}, sattn::Shape{2, 0, 41}})
    EXPECT_EQ(sattn::message::concat(sattn::shape_text(s)), sattn::shape_to_string(s));
  try {
    sattn::check(false, sattn::ErrorKind::kInvalidArgument, "x: shape ", sattn::shape_text({4, 5}));
    ADD_FAILURE() << "no error";
  } catch (const sattn::Error& e) {
    EXPECT_STREQ(e.what(), "x: shape [4, 5]");
  }
}

// Contiguity is the layout's: a size-1 dimension's stride addresses nothing, so it may be anything (the bindings set
// it to 0); any other dimension must have a dense row-major stride.
TEST(Smoke, ContiguityIgnoresTheStridesOfSizeOneDimensions) {
  float x[24] = {};
  using sattn::DType;
  using sattn::TensorView;
  EXPECT_TRUE(TensorView(x, DType::kF32, {2, 3, 4}).is_contiguous());
  EXPECT_TRUE(TensorView(x, DType::kF32, {1, 3, 1, 4}, {0, 4, 0, 1}).is_contiguous());
  EXPECT_TRUE(TensorView(x, DType::kF32, {1, 3, 1, 4}, {99, 4, 7, 1}).is_contiguous());
  EXPECT_FALSE(TensorView(x, DType::kF32, {2, 3, 4}, {12, 1, 3}).is_contiguous());  // transposed
  EXPECT_FALSE(TensorView(x, DType::kF32, {2, 3, 4}, {0, 4, 1}).is_contiguous());   // broadcast over a real dim
  EXPECT_FALSE(TensorView(x, DType::kF32, {3, 4}, {8, 1}).is_contiguous());         // rows apart
}
