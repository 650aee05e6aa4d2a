// The measured FMA limit (src/simd/fma_limit.cpp), the ceiling of `sattn bench`: which build runs under each target,
// a finite rate where there is one, none for the portable build, the vdpbf16ps limit under the bf16 targets only,
// and errors that name the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "sattn/error.hpp"
#include "scoped.hpp"
#include "simd/fma_limit.hpp"
#include "simd/target.hpp"

namespace {

using sattn::simd::Target;

TEST(FmaLimit, EveryTargetMeasuresItsOwnBuild) {
  for (const Target t : sattn::simd::available()) {
    const std::string name = sattn::simd::name(t);
    sattn::testing::ScopedSimdTarget scope(name);
    const sattn::simd::FmaLimit r = sattn::simd::fma_limit(1, 0.02);
    // The FMA limit is measured by the avx512 build under amx and avx512bf16 (their bf16 products are not FMAs).
    const std::string expected = t == Target::kAmx || t == Target::kAvx512Bf16 ? "avx512" : name;
    EXPECT_EQ(r.build, expected) << name;
    if (t == Target::kPortable) {
      EXPECT_EQ(r.gflops, 0.0) << "the portable build has no FMA limit to report";
    } else {
      EXPECT_TRUE(std::isfinite(r.gflops) && r.gflops > 0.1) << name << ": " << r.gflops;
    }
    // The vdpbf16ps limit: measured only under the targets whose bf16 products use them (available() lists those
    // only on a CPU with AVX512-BF16).
    if (t == Target::kAmx || t == Target::kAvx512Bf16) {
      EXPECT_TRUE(std::isfinite(r.bf16_dot_gflops) && r.bf16_dot_gflops > 0.1) << name << ": " << r.bf16_dot_gflops;
    } else {
      EXPECT_EQ(r.bf16_dot_gflops, 0.0) << name;
    }
  }
}

TEST(FmaLimit, BadArgumentsAreErrorsNamingThem) {
  for (const auto& [threads, seconds, what] :
       {std::tuple{0, 0.1, "threads"}, std::tuple{1, 0.0, "seconds"}, std::tuple{1, 61.0, "seconds"}}) {
    try {
      sattn::simd::fma_limit(threads, seconds);
      ADD_FAILURE() << "no error for threads " << threads << ", seconds " << seconds;
    } catch (const sattn::Error& e) {
      EXPECT_EQ(e.kind(), sattn::ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

}  // namespace
