// Runtime choice of the tile operations: AVX2+FMA when the CPU has them, else the baseline build. The choice is
// made once per process, so results are deterministic for a given machine and any thread count.
// SATTN_SPARSE_ISA=base forces the baseline (for tests of the portable path).
#include "sattn/sparse_tiles.hpp"

#include <cstdlib>
#include <cstring>

namespace sattn::sparse::tiles {

#define SATTN_TILE_DECLS(ns)                                                                                  \
  namespace ns {                                                                                              \
  void qk(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, float*);                     \
  void softmax_update(float*, int64_t, int64_t, float*, float*, float*, int64_t);                             \
  void pv(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, float*);                     \
  void atx(const float*, int64_t, int64_t, const float*, int64_t, int64_t, float, float*);                    \
  void softmax_backward(const float*, float*, int64_t, int64_t, const float*);                                \
  void probabilities(float*, int64_t, int64_t, const float*);                                                 \
  void transpose_rows(const float*, int64_t, int64_t, int64_t, float*, int64_t);                              \
  }
SATTN_TILE_DECLS(avx2)
SATTN_TILE_DECLS(base)

namespace {
bool use_avx2() {
  static const bool value = [] {
    const char* env = std::getenv("SATTN_SPARSE_ISA");
    if (env && std::strcmp(env, "base") == 0) return false;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
  }();
  return value;
}
}  // namespace

const char* isa() { return use_avx2() ? "avx2+fma" : "base"; }

void qk(const float* q, int64_t m, int64_t d, const float* kt, int64_t ldk, int64_t n, float scale, float* s) {
  use_avx2() ? avx2::qk(q, m, d, kt, ldk, n, scale, s) : base::qk(q, m, d, kt, ldk, n, scale, s);
}
void softmax_update(float* s, int64_t m, int64_t n, float* row_max, float* row_sum, float* acc, int64_t dv) {
  use_avx2() ? avx2::softmax_update(s, m, n, row_max, row_sum, acc, dv)
             : base::softmax_update(s, m, n, row_max, row_sum, acc, dv);
}
void pv(const float* p, int64_t m, int64_t n, const float* v, int64_t ldv, int64_t dv, float alpha, float* acc) {
  use_avx2() ? avx2::pv(p, m, n, v, ldv, dv, alpha, acc) : base::pv(p, m, n, v, ldv, dv, alpha, acc);
}
void atx(const float* a, int64_t m, int64_t n, const float* x, int64_t ldx, int64_t d, float alpha, float* out) {
  use_avx2() ? avx2::atx(a, m, n, x, ldx, d, alpha, out) : base::atx(a, m, n, x, ldx, d, alpha, out);
}
void softmax_backward(const float* p, float* dp, int64_t m, int64_t n, const float* delta) {
  use_avx2() ? avx2::softmax_backward(p, dp, m, n, delta) : base::softmax_backward(p, dp, m, n, delta);
}
void probabilities(float* s, int64_t m, int64_t n, const float* lse) {
  use_avx2() ? avx2::probabilities(s, m, n, lse) : base::probabilities(s, m, n, lse);
}
void transpose_rows(const float* src, int64_t lds, int64_t n, int64_t d, float* dst, int64_t ldd) {
  use_avx2() ? avx2::transpose_rows(src, lds, n, d, dst, ldd) : base::transpose_rows(src, lds, n, d, dst, ldd);
}

}  // namespace sattn::sparse::tiles
