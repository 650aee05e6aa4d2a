#include "nn/ops.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <type_traits>

#include "core/threads.hpp"
#include "sattn/error.hpp"
#include "sattn/tensor.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace sattn::nn {

Buffer::~Buffer() { std::free(p_); }

float* Buffer::get(int64_t n) {
  if (n <= cap_) return p_;
  std::free(p_);
  p_ = nullptr;
  cap_ = 0;
  constexpr size_t kHuge = size_t(2) << 20;
  const size_t bytes = size_t(std::max<int64_t>(n, 1)) * sizeof(float);
  if (bytes >= kHuge) {
    const size_t rounded = (bytes + kHuge - 1) / kHuge * kHuge;
    p_ = static_cast<float*>(std::aligned_alloc(kHuge, rounded));
#ifdef MADV_HUGEPAGE
    if (p_) madvise(p_, rounded, MADV_HUGEPAGE);  // a hint: failure is harmless
#endif
  } else {
    p_ = static_cast<float*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
  }
  check(p_ != nullptr, ErrorKind::kOutOfMemory, "nn::Buffer: cannot allocate ", bytes, " bytes");
  cap_ = n;
  return p_;
}

WorkspaceVector<uint32_t> weight_pairs(const std::vector<float>& w, int64_t N) {
  const int64_t ld = padded_cols(N), K = int64_t(w.size()) / ld;
  check(K * ld == int64_t(w.size()), ErrorKind::kInternal, "weight_pairs: ", w.size(), " values are not rows of ", ld);
  if (K % 2 != 0) return {};
  WorkspaceVector<uint32_t> r(size_t(K / 2 * ld));
  for (int64_t k2 = 0; k2 < K / 2; ++k2)
    for (int64_t n = 0; n < ld; ++n)
      r[size_t(k2 * ld + n)] = uint32_t(float_to_bf16(w[size_t(2 * k2 * ld + n)])) |
                               uint32_t(float_to_bf16(w[size_t((2 * k2 + 1) * ld + n)])) << 16;
  return r;
}

namespace {
// gemm(m0, m1) over fixed blocks of rows, the blocks across threads.
constexpr int64_t kLinearBlock = 256;
template <class Gemm>
void linear_blocks(int64_t M, int threads, Gemm&& gemm) {
  parallel_for((M + kLinearBlock - 1) / kLinearBlock, threads, [&](int64_t b) {
    const int64_t m0 = b * kLinearBlock;
    gemm(m0, std::min(M, m0 + kLinearBlock));
  });
}
}  // namespace

void linear(const float* x, int64_t M, int64_t K, const float* W, const float* bias, int64_t N, float* y, int threads,
            const uint32_t* W2) {
  linear_blocks(M, threads, [&](int64_t m0, int64_t m1) {
    // The bias rows written first, then the products added. (The float32 GEMM starting from the bias row instead,
    // without this pass over y, measured no faster in the SR model: its stores then bring y's lines into the cache.)
    if (bias)
      for (int64_t m = m0; m < m1; ++m) std::memcpy(y + m * N, bias, size_t(N) * sizeof(float));
    else std::fill(y + m0 * N, y + m1 * N, 0.0f);
    gemm_acc(x + m0 * K, K, m1 - m0, K, W, padded_cols(N), N, y + m0 * N, N, W2);
  });
}

void linear(const uint16_t* x, int64_t M, int64_t K, const float* bias, int64_t N, float* y, int threads,
            const uint32_t* W2) {
  // The products start from the bias row (gemm_acc_segments_pairs's init; the same bits as bias rows written
  // first): y is only written, not first filled and then read back by the products.
  std::vector<float> zeros;
  if (!bias) zeros.assign(size_t(N), 0.0f);
  const float* init = bias ? bias : zeros.data();
  linear_blocks(M, threads, [&](int64_t m0, int64_t m1) {
    const uint16_t* a[1] = {x + m0 * K};
    const int64_t k[1] = {K};
    gemm_acc_segments_pairs(1, a, k, K, m1 - m0, W2, padded_cols(N), N, y + m0 * N, N, init);
  });
}

void layer_norm_linear(const float* x, int64_t M, int64_t C, const float* gamma, const float* beta, float eps,
                       const float* W, const float* bias, int64_t N, float* y, const uint32_t* W2) {
  if (pairs_run(W2, C)) {
    thread_local WorkspaceVector<uint16_t> a2;
    a2.resize(size_t(M * C));
    layer_norm_to_bf16(x, M, C, gamma, beta, eps, a2.data());
    return linear(a2.data(), M, C, bias, N, y, 1, W2);
  }
  thread_local Buffer a_buf;
  float* a = a_buf.get(M * C);
  layer_norm(x, M, C, gamma, beta, eps, a);
  linear(a, M, C, W, bias, N, y, 1, W2);
}

void gelu_gemm_acc(float* h, int64_t M, int64_t K, const float* W, int64_t N, float* C, int64_t ldc,
                   const uint32_t* W2) {
  if (pairs_run(W2, K)) {
    thread_local WorkspaceVector<uint16_t> h2;
    h2.resize(size_t(M * K + 1));
    gelu_to_bf16(h, M * K, h2.data());
    const uint16_t* a[1] = {h2.data()};
    const int64_t k[1] = {K};
    return gemm_acc_segments_pairs(1, a, k, K, M, W2, padded_cols(N), N, C, ldc);
  }
  gelu_inplace(h, M * K);
  gemm_acc(h, K, M, K, W, padded_cols(N), N, C, ldc, W2);
}

namespace {
// Runs f(y, above, centre, below) for every row y of in [H, W, C]: three zero-padded rows [W+2, C] (input rows
// y-1, y, y+1; zeros outside the image) for the 3x3 convolutions, without a padded copy of the whole input (a
// memory-bound pass as costly as a depthwise convolution). The rows are split into contiguous bands, four per
// thread, handed out dynamically (one static band per thread left a whole convolution waiting for the slower of
// the two vCPUs); a band's thread keeps its rows y-1, y, y+1 in a 3-row ring, and row y+1 enters the ring before
// f(y, ...) runs, so f may overwrite row y of `in` (in-place convolutions, same row size). The two rows bordering
// a band belong to a neighbour band, which may overwrite them first, so they are copied beforehand. f is called
// once per row, with the same rows whatever the split (results do not depend on the thread count). T = float: the
// rows as they are; T = uint16_t: rounded to bf16 as they enter the ring (round_to_bf16; C even), the A operand of
// the bf16 products, each row rounded once.
template <typename T, typename F>
void for_each_padded_row(const float* in, int64_t H, int64_t W, int64_t C, int threads, F&& f) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>);
  const int64_t rowc = W * C, rowp = (W + 2) * C;
  const int64_t nb = threads <= 1 ? 1 : std::max<int64_t>(1, std::min<int64_t>(4 * int64_t(threads), H));
  auto band = [&](int64_t b) { return std::pair<int64_t, int64_t>{H * b / nb, H * (b + 1) / nb}; };
  thread_local Buffer edge_buf;
  float* edge = edge_buf.get(2 * nb * rowc);  // [band][above, below][W*C]
  for (int64_t b = 0; b < nb; ++b) {
    const auto [y0, y1] = band(b);
    if (y0 > 0) std::memcpy(edge + (2 * b) * rowc, in + (y0 - 1) * rowc, size_t(rowc) * sizeof(float));
    if (y1 < H) std::memcpy(edge + (2 * b + 1) * rowc, in + y1 * rowc, size_t(rowc) * sizeof(float));
  }
  parallel_for(nb, threads, [&](int64_t b) {
    thread_local Buffer ring_buf;
    T* ring = reinterpret_cast<T*>(ring_buf.get((3 * rowp * int64_t(sizeof(T)) + 3) / 4));
    // Plain variables, not a structured binding: clang before 16 cannot capture those in the lambdas below.
    const int64_t y0 = band(b).first, y1 = band(b).second;
    auto slot = [&](int64_t r) { return ring + ((r + 3) % 3) * rowp; };
    auto load = [&](int64_t r) {  // padded input row r into its ring slot
      T* d = slot(r);
      std::fill(d, d + C, T(0));
      std::fill(d + (W + 1) * C, d + rowp, T(0));
      if (r < 0 || r >= H) {
        std::fill(d + C, d + (W + 1) * C, T(0));
        return;
      }
      const float* src = r == y0 - 1 ? edge + (2 * b) * rowc : r == y1 ? edge + (2 * b + 1) * rowc : in + r * rowc;
      if constexpr (std::is_same_v<T, float>) std::memcpy(d + C, src, size_t(rowc) * sizeof(float));
      else round_to_bf16(src, rowc, d + C);
    };
    load(y0 - 1);
    load(y0);
    for (int64_t y = y0; y < y1; ++y) {
      load(y + 1);
      f(y, static_cast<const T*>(slot(y - 1)), static_cast<const T*>(slot(y)), static_cast<const T*>(slot(y + 1)));
    }
  });
}

// Depthwise weights [9][C] + bias [C] tiled to a period P = lcm(C, 16) (a multiple of every SIMD lane count):
// [10][P], the bias (or zeros) last, as depthwise_row_3 reads them.
std::vector<float> tile_depthwise(const float* Wd, const float* bias, int64_t C, int64_t* period) {
  const int64_t P = std::lcm<int64_t>(C, 16);
  std::vector<float> t(size_t(10 * P));
  for (int64_t k = 0; k < 10; ++k)
    for (int64_t i = 0; i < P; ++i) t[size_t(k * P + i)] = k < 9 ? Wd[k * C + i % C] : (bias ? bias[i % C] : 0.0f);
  *period = P;
  return t;
}
}  // namespace

void conv3x3_hwc(const float* in, int64_t H, int64_t W, int64_t Cin, const float* W9, const float* bias, int64_t Cout,
                 float* out, int threads, const float* add, const uint32_t* W2) {
  // On a padded input row, the three taps of a kernel row are 3·Cin contiguous values starting at output pixel x:
  // one GEMM per output row with three K = 3·Cin segments (kernel rows), A rows overlapping (lda = Cin).
  const auto lo_in = reinterpret_cast<uintptr_t>(in), lo_out = reinterpret_cast<uintptr_t>(out);
  const bool overlap = lo_out < lo_in + sizeof(float) * uintptr_t(H * W * Cin) &&
                       lo_in < lo_out + sizeof(float) * uintptr_t(H * W * Cout);
  check(!overlap || (out == in && Cout == Cin), ErrorKind::kInternal,
        "conv3x3_hwc: out may alias in only exactly and with Cout == Cin (", Cout, " vs ", Cin, ")");
  const auto lo_add = reinterpret_cast<uintptr_t>(add);
  check(!add || lo_add >= lo_out + sizeof(float) * uintptr_t(H * W * Cout) ||
            lo_out >= lo_add + sizeof(float) * uintptr_t(H * W * Cout),
        ErrorKind::kInternal, "conv3x3_hwc: add must not overlap out");
  // One GEMM per output row: o = bias, o += the three kernel rows' products (A rows in float32 or, for the bf16
  // products, in bf16 as the ring rounded them; Cin even: every pixel starts a word), then o += add.
  // (The bf16 products start from the bias row itself, gemm_acc_segments_pairs's init: the same bits.)
  std::vector<float> zeros;
  if (!bias) zeros.assign(size_t(Cout), 0.0f);
  const float* init = bias ? bias : zeros.data();
  const auto row = [&](int64_t y, const auto* r0, const auto* r1, const auto* r2) {
    float* o = out + y * W * Cout;
    const int64_t k[3] = {3 * Cin, 3 * Cin, 3 * Cin};
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(r0)>>;
    const T* a[3] = {r0, r1, r2};
    if constexpr (std::is_same_v<T, uint16_t>) {
      gemm_acc_segments_pairs(3, a, k, Cin, W, W2, padded_cols(Cout), Cout, o, Cout, init);
    } else {
      for (int64_t x = 0; x < W; ++x)
        for (int64_t c = 0; c < Cout; ++c) o[x * Cout + c] = init[c];
      gemm_acc_segments(3, a, k, Cin, W, W9, padded_cols(Cout), Cout, o, Cout);
    }
    if (add) {
      const float* __restrict ad = add + y * W * Cout;
      float* __restrict oo = o;
      for (int64_t i = 0; i < W * Cout; ++i) oo[i] += ad[i];
    }
  };
  if (pairs_run(W2, Cin)) for_each_padded_row<uint16_t>(in, H, W, Cin, threads, row);
  else for_each_padded_row<float>(in, H, W, Cin, threads, row);
}

void depthwise3x3_hwc(const float* in, int64_t H, int64_t W, int64_t C, const float* Wd, const float* bias, float* out,
                      int threads) {
  int64_t P = 0;
  const std::vector<float> wt = tile_depthwise(Wd, bias, C, &P);
  for_each_padded_row<float>(in, H, W, C, threads, [&](int64_t y, const float* r0, const float* r1, const float* r2) {
    depthwise_row_3(r0, r1, r2, W, C, wt.data(), P, out + y * W * C);
  });
}

void dw_act_pw_hwc(const float* in, int64_t H, int64_t W, int64_t C, const float* Wd, const float* dw_b, bool gelu,
                   const float* PW, const float* pw_b, const float* res, float* out, int threads, const uint32_t* PW2) {
  int64_t P = 0;
  const std::vector<float> wt = tile_depthwise(Wd, dw_b, C, &P);
  const int64_t rowc = W * C;
  for_each_padded_row<float>(in, H, W, C, threads, [&](int64_t y, const float* r0, const float* r1, const float* r2) {
    thread_local Buffer t_buf;
    float* t = t_buf.get(rowc);
    depthwise_row_3(r0, r1, r2, W, C, wt.data(), P, t);
    float* o = out + y * rowc;
    const float* r = res + y * rowc;
    if (pw_b && o == r) {  // in place (the usual residual call): no aliasing question for the vectoriser
      for (int64_t x = 0; x < W; ++x) {
        float* __restrict ox = o + x * C;
        for (int64_t c = 0; c < C; ++c) ox[c] += pw_b[c];
      }
    } else if (pw_b) {
      for (int64_t x = 0; x < W; ++x) {
        float* __restrict ox = o + x * C;
        const float* __restrict rx = r + x * C;
        for (int64_t c = 0; c < C; ++c) ox[c] = rx[c] + pw_b[c];
      }
    } else if (o != r) {
      std::memmove(o, r, size_t(rowc) * sizeof(float));
    }
    if (gelu) gelu_gemm_acc(t, W, C, PW, C, o, C, PW2);
    else gemm_acc(t, C, W, C, PW, padded_cols(C), C, o, C, PW2);
  });
}

std::vector<float> conv3x3_weight_hwc(const float* w, int64_t Cout, int64_t Cin) {
  const int64_t ld = padded_cols(Cout);
  std::vector<float> r(size_t(9 * Cin * ld), 0.0f);
  for (int64_t o = 0; o < Cout; ++o)
    for (int64_t i = 0; i < Cin; ++i)
      for (int64_t t = 0; t < 9; ++t) r[size_t((t * Cin + i) * ld + o)] = w[(o * Cin + i) * 9 + t];
  return r;
}

std::vector<float> depthwise_weight_hwc(const float* w, int64_t C) {
  std::vector<float> r(size_t(9 * C));
  for (int64_t c = 0; c < C; ++c)
    for (int64_t t = 0; t < 9; ++t) r[size_t(t * C + c)] = w[c * 9 + t];
  return r;
}

std::vector<float> transpose_weight(const float* w, int64_t N, int64_t K) {
  const int64_t ld = padded_cols(N);
  std::vector<float> r(size_t(K * ld), 0.0f);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) r[size_t(k * ld + n)] = w[n * K + k];
  return r;
}

}  // namespace sattn::nn
