#include "cli/bench_timing.hpp"

#include <dlfcn.h>

#include <chrono>
#include <ctime>
#include <random>

#ifdef SATTN_HAVE_CBLAS
#include <cblas.h>
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
#endif

namespace sattn::cli {

namespace {
bool g_thread_clock = false;
}  // namespace

void set_bench_thread_clock(bool thread_clock) { g_thread_clock = thread_clock; }

double bench_now_seconds() {
  if (g_thread_clock) {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double sgemm_gflops(int threads, int64_t n, int reps) {
  if (n <= 0) return 0.0;
#ifdef SATTN_HAVE_CBLAS
  if (openblas_set_num_threads) openblas_set_num_threads(threads);  // the same thread count as the kernels
  std::vector<float> a(size_t(n * n)), b(size_t(n * n)), c(size_t(n * n));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : a) x = u(rng);
  for (auto& x : b) x = u(rng);
  const double s = median_seconds(reps, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(n), int(n), 1.f, a.data(), int(n), b.data(),
                int(n), 0.f, c.data(), int(n));
  });
  return 2.0 * double(n) * double(n) * double(n) / (s * 1e9);
#else
  (void)threads, (void)reps;
  return 0.0;
#endif
}

std::string blas_core() {
  using CoreName = char* (*)();
  const auto f = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = f ? f() : nullptr;
  return name ? name : "";
}

}  // namespace sattn::cli
