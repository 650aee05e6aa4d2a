// Timing for the benchmark commands (bench, sparse-bench, ring, sr): one clock setting, the median of repeated runs,
// and the OpenBLAS SGEMM rate that their "% of SGEMM" columns divide by, measured in the same process.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace sattn::cli {

// --clock wall (default) or thread: the calling thread's CPU time (meaningful for 1-thread runs on a busy machine).
void set_bench_thread_clock(bool thread_clock);

// Seconds on the clock chosen by set_bench_thread_clock.
double bench_now_seconds();

// The median time in seconds of `reps` calls of f (after one warm-up call).
template <typename F>
double median_seconds(int reps, F&& f) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = bench_now_seconds();
    f();
    t.push_back(bench_now_seconds() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The median of v (the mean of the two middle values for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

// SGEMM GFLOP/s of an n x n x n product (2·n³ flops) on `threads` threads, the median of `reps` runs; 0 without a
// CBLAS or for n <= 0.
double sgemm_gflops(int threads, int64_t n = 2048, int reps = 3);

// OpenBLAS's kernel set (its core name), or "" for another BLAS / none (see fix_openblas_core in main.cpp).
std::string blas_core();

}  // namespace sattn::cli
