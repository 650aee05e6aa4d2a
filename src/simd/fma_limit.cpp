// simd::fma_limit (simd/fma_limit.hpp): the float32 FMA rate of the selected build, per Highway target of the one
// table (simd/hwy_targets.hpp).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/fma_limit.cpp"
#include "simd/hwy_targets.hpp"
#include <hwy/foreach_target.h>  // must come before highway.h

#include <hwy/highway.h>

#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace sattn::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// `steps` rounds of kChains independent a = a·m + c chains (each FMA waits only for its own chain's previous one,
// so the FMA units, not their latency, set the pace: 12 chains cover 2 units × 5 cycles). Returns the lanes per
// vector; the chains' sum goes to *sink so that no chain can be dropped.
HWY_NOINLINE int64_t FmaChains(int64_t steps, float* sink) {
  using DF = hn::ScalableTag<float>;
  const DF d;
  const auto m = hn::Set(d, 0.999999f), c = hn::Set(d, 1e-7f);
  auto a0 = hn::Set(d, 0.f), a1 = hn::Set(d, 1.f), a2 = hn::Set(d, 2.f), a3 = hn::Set(d, 3.f);
  auto a4 = hn::Set(d, 4.f), a5 = hn::Set(d, 5.f), a6 = hn::Set(d, 6.f), a7 = hn::Set(d, 7.f);
  auto a8 = hn::Set(d, 8.f), a9 = hn::Set(d, 9.f), a10 = hn::Set(d, 10.f), a11 = hn::Set(d, 11.f);
  for (int64_t s = 0; s < steps; ++s) {
    a0 = hn::MulAdd(a0, m, c), a1 = hn::MulAdd(a1, m, c), a2 = hn::MulAdd(a2, m, c), a3 = hn::MulAdd(a3, m, c);
    a4 = hn::MulAdd(a4, m, c), a5 = hn::MulAdd(a5, m, c), a6 = hn::MulAdd(a6, m, c), a7 = hn::MulAdd(a7, m, c);
    a8 = hn::MulAdd(a8, m, c), a9 = hn::MulAdd(a9, m, c), a10 = hn::MulAdd(a10, m, c), a11 = hn::MulAdd(a11, m, c);
  }
  const auto sum =
      hn::Add(hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), hn::Add(hn::Add(a4, a5), hn::Add(a6, a7))),
              hn::Add(hn::Add(a8, a9), hn::Add(a10, a11)));
  *sink = hn::GetLane(sum);
  return int64_t(hn::Lanes(d));
}

#if HWY_TARGET == HWY_AVX3 && HWY_ARCH_X86_64 && defined(__GNUC__)
// `steps` rounds of 16 independent vdpbf16ps chains (a += x.lo·y.lo + x.hi·y.hi in each float32 lane: 4 flops per
// lane), the AVX512-BF16 dot products of the avx512bf16 build; 16 chains cover 2 units × 8 cycles. Returns the
// float32 lanes per vector (16).
__attribute__((target(HWY_TARGET_STR_AVX3 ",avx512bf16"))) HWY_NOINLINE int64_t DotBf16Chains(int64_t steps,
                                                                                              float* sink) {
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3A833A83), y = (__m512bh)_mm512_set1_epi32(0x3F803F80);
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_ps(float(i));
  for (int64_t s = 0; s < steps; ++s) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbf16_ps(a[i], x, y);
  }
  __m512 sum = a[0];
  for (int i = 1; i < 16; ++i) sum = _mm512_add_ps(sum, a[i]);
  *sink = _mm512_reduce_add_ps(sum);
  return 16;
}
#endif

}  // namespace HWY_NAMESPACE
}  // namespace sattn::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "core/threads.hpp"
#include "sattn/error.hpp"
#include "simd/dispatch.hpp"
#include "simd/fma_limit.hpp"

namespace sattn::simd {
namespace {
constexpr int kFmaChains = 12;  // FmaChains' chain count
using ChainsFn = int64_t (*)(int64_t, float*);
#define SATTN_FMA_CHAINS(NS) &NS::FmaChains
const Build<ChainsFn> kBuilds[] = {SATTN_SIMD_BUILDS(SATTN_FMA_CHAINS)};
// The vdpbf16ps chains where this file has an AVX-512 build (null elsewhere).
#if (HWY_TARGETS & HWY_AVX3) && HWY_ARCH_X86_64 && defined(__GNUC__)
ChainsFn dot_bf16_chains() { return &N_AVX3::DotBf16Chains; }
#else
ChainsFn dot_bf16_chains() { return nullptr; }
#endif

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The flops per second of `chains` (flops_per_lane per lane and step) on `threads` threads at once, each for about
// `seconds` after a short warm-up: all threads' flops over the span from the first thread's start to the last one's
// end (a sum of per-thread rates would count time-sliced threads, oversubscribed, as parallel).
double measure_gflops(ChainsFn chains, double flops_per_lane, int threads, double seconds) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> flops(size_t(threads), 0.0);
  std::vector<Clock::time_point> starts(static_cast<size_t>(threads)), ends(static_cast<size_t>(threads));
  std::atomic<int> started{0};  // after the region: the number of threads that ran
  parallel_region(threads, [&](int index, int count) {
    float sink = 0;
    // Warm-up (clock ramp, first-touch of the code), then steps sized from it to take about `seconds`.
    int64_t steps = 1 << 16;
    auto t0 = Clock::now();
    chains(steps, &sink);
    while (seconds_since(t0) < 0.02) steps *= 2, t0 = Clock::now(), chains(steps, &sink);
    steps = std::max<int64_t>(steps, int64_t(double(steps) * seconds / std::max(seconds_since(t0), 1e-6)));
    // All threads start timing after every one has warmed up.
    started.fetch_add(1);
    while (started.load() < count) {
    }
    starts[size_t(index)] = Clock::now();
    const int64_t lanes = chains(steps, &sink);
    ends[size_t(index)] = Clock::now();
    flops[size_t(index)] = flops_per_lane * double(lanes) * double(steps);
  });
  const int ran = started.load();
  const auto first = *std::min_element(starts.begin(), starts.begin() + ran);
  const auto last = *std::max_element(ends.begin(), ends.begin() + ran);
  double total = 0;
  for (int i = 0; i < ran; ++i) total += flops[size_t(i)];
  return total / std::chrono::duration<double>(last - first).count() / 1e9;
}
}  // namespace

FmaLimit fma_limit(int threads, double seconds) {
  check(threads >= 1, ErrorKind::kInvalidArgument, "fma_limit: threads must be >= 1, got ", threads);
  check(seconds > 0 && seconds <= 60, ErrorKind::kInvalidArgument, "fma_limit: seconds must be in (0, 60], got ",
        seconds);
  const Build<ChainsFn>& build = pick(kBuilds);
  FmaLimit r;
  r.build = name(build.target);
  // Highway's portable build emulates its vectors in plain loops that the compiler vectorises as it sees fit, so a
  // kernel of that build may run faster than its FMA chains: no limit to report.
  if (build.target == Target::kPortable) return r;
  r.gflops = measure_gflops(build.ops, 2.0 * kFmaChains, threads, seconds);
  // (a selected amx or avx512bf16 target is one this CPU runs, vdpbf16ps included)
  const Target sel = selected();
  if (const ChainsFn dot = dot_bf16_chains(); dot && (sel == Target::kAmx || sel == Target::kAvx512Bf16))
    r.bf16_dot_gflops = measure_gflops(dot, 4.0 * 16, threads, seconds);
  return r;
}

}  // namespace sattn::simd
#endif  // HWY_ONCE
