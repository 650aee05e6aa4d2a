#include "cli/bench_timing.hpp"

#include <dlfcn.h>

#include <chrono>
#include <ctime>
#include <mutex>
#include <random>

namespace sattn::cli {

namespace {
bool g_thread_clock = false;

// The CBLAS, opened at first use (only the benchmark commands need it): the library CMake found, else the usual
// Debian sonames. The enum values are CBLAS's own (cblas.h).
struct Blas {
  using Sgemm = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a, int lda,
                         const float* b, int ldb, float beta, float* c, int ldc);
  static constexpr int kRowMajor = 101, kNoTrans = 111;
  Sgemm sgemm = nullptr;
  void (*set_num_threads)(int) = nullptr;  // OpenBLAS only
  char* (*core_name)() = nullptr;          // OpenBLAS only
};

const Blas& blas() {
  static Blas b;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* names[] = {
#ifdef SATTN_BLAS_LIBRARY
        SATTN_BLAS_LIBRARY,
#endif
        "libopenblas.so.0", "libcblas.so.3", "libblas.so.3"};
    for (const char* name : names) {
      void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (!lib) continue;
      if (auto f = reinterpret_cast<Blas::Sgemm>(dlsym(lib, "cblas_sgemm"))) {
        b.sgemm = f;
        b.set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(lib, "openblas_set_num_threads"));
        b.core_name = reinterpret_cast<char* (*)()>(dlsym(lib, "openblas_get_corename"));
        return;  // kept open for the process
      }
      dlclose(lib);
    }
  });
  return b;
}
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
  const Blas& b = blas();
  if (n <= 0 || !b.sgemm) return 0.0;
  if (b.set_num_threads) b.set_num_threads(threads);  // the same thread count as the kernels
  std::vector<float> a(size_t(n * n)), w(size_t(n * n)), c(size_t(n * n));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto& x : a) x = u(rng);
  for (auto& x : w) x = u(rng);
  const int ni = int(n);
  const double s = median_seconds(reps, [&] {
    b.sgemm(Blas::kRowMajor, Blas::kNoTrans, Blas::kNoTrans, ni, ni, ni, 1.f, a.data(), ni, w.data(), ni, 0.f, c.data(),
            ni);
  });
  return 2.0 * double(n) * double(n) * double(n) / (s * 1e9);
}

std::string blas_core() {
  const Blas& b = blas();
  const char* name = b.core_name ? b.core_name() : nullptr;
  return name ? name : "";
}

}  // namespace sattn::cli
