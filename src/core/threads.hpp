// Threads: OpenMP with an explicit thread count per call.
//
// Count: the per-call option if > 0, else SATTN_NUM_THREADS, else the number of online cores.
// No oversubscription: inside an active OpenMP parallel region (a caller's, or ours) work runs on
// the calling thread only. Work is always split into the same items whatever the count, and each
// item is computed the same way, so results are bitwise identical for any number of threads.
#pragma once

#include <omp.h>

#include <cstdint>

namespace sattn {

int hardware_threads();
int resolve_num_threads(int requested);  // never < 1

// Runs f(i) for i in [0, n) on up to `threads` threads (dynamic schedule: items may differ in cost).
template <typename F>
void parallel_for(int64_t n, int threads, F&& f) {
  if (n <= 0) return;
  if (threads <= 1 || n == 1 || omp_in_parallel()) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  const int t = int(n < threads ? n : threads);
#pragma omp parallel for num_threads(t) schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) f(i);
}

// Runs f(thread_index, thread_count) once on each of up to `threads` threads.
template <typename F>
void parallel_region(int threads, F&& f) {
  if (threads <= 1 || omp_in_parallel()) {
    f(0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  f(omp_get_thread_num(), omp_get_num_threads());
}

}  // namespace sattn
