// Start-up cost of Highway's shared library. libhwy 1.0.x calibrates the timer of its nanobenchmark in a load-time
// initialiser: hwy::platform::TimerResolution() takes the mode of 256 x 256 serialised timer reads, about 5 ms of
// every process on a VM, before main() and whether or not anything benchmarks. sattn never calls Highway's
// nanobenchmark. The initialiser calls the function through libhwy's PLT, so this definition in the executable is
// the one it gets (as an executable's malloc is libc's): the minimum of 256 back-to-back fenced reads instead.
// Only for the Highway versions known to do this, on x86-64 (where their timer is the time-stamp counter).
#include <hwy/highway.h>
#include <hwy/nanobenchmark.h>

#if HWY_MAJOR == 1 && HWY_MINOR == 0 && defined(__x86_64__) && defined(__linux__)
#include <x86intrin.h>

#include <algorithm>
#include <cstdint>

namespace hwy::platform {

uint64_t TimerResolution() {
  uint64_t best = UINT64_MAX;
  for (int i = 0; i < 256; ++i) {
    _mm_lfence();  // as Highway's timer: fenced reads of the time-stamp counter
    const uint64_t t0 = __rdtsc();
    _mm_lfence();
    const uint64_t t1 = __rdtsc();
    _mm_lfence();
    best = std::min(best, t1 - t0);
  }
  return std::max<uint64_t>(best, 1);
}

}  // namespace hwy::platform

#endif
