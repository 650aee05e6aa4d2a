// How a Highway component plugs into the one target table (simd/target.hpp). Include it in the HWY_ONCE part of
// a file compiled with <hwy/foreach_target.h>, after HWY_TARGETS is known, and list the component's builds:
//
//   #define SATTN_MY_OPS(NS) MyOps{&NS::Fn1, &NS::Fn2}
//   const simd::Build<MyOps> kBuilds[] = {SATTN_SIMD_BUILDS(SATTN_MY_OPS)};
//   const MyOps& ops() { return simd::pick(kBuilds).ops; }
//
// SATTN_SIMD_BUILDS expands to one {target, MAKE(namespace)} entry per target this file was compiled for, widest
// first; pick() returns the widest build no wider than the selected target. A target written with intrinsics
// instead of Highway is one more entry in such a list.
#pragma once

#include <cstddef>

#include <hwy/highway.h>

#include "simd/target.hpp"

namespace sattn::simd {

template <class Ops>
struct Build {
  Target target;
  Ops ops;
};

// The widest of `builds` (widest first, the last one portable) no wider than the selected target.
template <class Ops, size_t N>
const Build<Ops>& pick(const Build<Ops> (&builds)[N]) {
  const int selected_rank = int(selected());
  for (const Build<Ops>& b : builds)
    if (int(b.target) >= selected_rank) return b;
  return builds[N - 1];
}

}  // namespace sattn::simd

#if HWY_TARGETS & HWY_AVX3
#define SATTN_SIMD_BUILD_AVX512(MAKE) {::sattn::simd::Target::kAvx512, MAKE(N_AVX3)},
#else
#define SATTN_SIMD_BUILD_AVX512(MAKE)
#endif
#if HWY_TARGETS & HWY_AVX2
#define SATTN_SIMD_BUILD_AVX2(MAKE) {::sattn::simd::Target::kAvx2, MAKE(N_AVX2)},
#else
#define SATTN_SIMD_BUILD_AVX2(MAKE)
#endif
#if HWY_TARGETS & HWY_SSE4
#define SATTN_SIMD_BUILD_SSE4(MAKE) {::sattn::simd::Target::kSse4, MAKE(N_SSE4)},
#else
#define SATTN_SIMD_BUILD_SSE4(MAKE)
#endif
#if HWY_TARGETS & HWY_EMU128
#define SATTN_SIMD_BUILD_PORTABLE(MAKE) {::sattn::simd::Target::kPortable, MAKE(N_EMU128)},
#elif HWY_TARGETS & HWY_SCALAR
#define SATTN_SIMD_BUILD_PORTABLE(MAKE) {::sattn::simd::Target::kPortable, MAKE(N_SCALAR)},
#else
#error "sattn needs Highway's portable target (EMU128 or SCALAR) in every SIMD component"
#endif
#define SATTN_SIMD_BUILDS(MAKE) \
  SATTN_SIMD_BUILD_AVX512(MAKE) SATTN_SIMD_BUILD_AVX2(MAKE) SATTN_SIMD_BUILD_SSE4(MAKE) SATTN_SIMD_BUILD_PORTABLE(MAKE)

// The Highway targets the SIMD components are compiled for, to be defined before <hwy/foreach_target.h>:
// simd/hwy_targets.hpp.
