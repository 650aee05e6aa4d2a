// Matrix products on AMX tiles (TMUL, tdpbf16ps) over bf16 pairs, for the amx builds of the fused kernel, the sparse
// tiles and the nn GEMMs, and the tile instructions they use behind a small interface so that the same product code
// runs on a software model of the tiles (tests/cpp/test_amx_tiles.cpp) on machines without AMX.
//
// A tile is 16 rows of 64 bytes. tdpbf16ps C, A, B adds, for every element of the float32 tile C [16 x 16],
//   C[m][n] += Σ_k A.lo[m][k]·B.lo[k][n] + A.hi[m][k]·B.hi[k][n]
// where A [16 x 16] and B [16 x 16] are 32-bit words holding two bf16 each (lo in the low half): A's rows run along
// the summed dimension, B's rows are pairs of rows of the right-hand matrix (the layout vdpbf16ps takes too).
// The hardware treats bf16 denormals as zero and rounds each addition to float32.
//
// The tiles are configured (palette 1) by TileConfigScope: for the duration of a fused-kernel task all 16 x 64 bytes
// (gemm_pairs), for one call of gemm_segments_pairs with its operands summing a chunk of up to 16 pairs (and once
// more for its last column block, where C's last column tile is partial, with that tile as wide as C's columns);
// other partial tiles (rows, columns or summed pairs past the matrix) go through zero-padded staging buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace sattn::simd::amx {

inline constexpr int kTileRows = 16;  // rows of a tile, and words (pairs or floats) per row

// The 64-byte tile configuration of ldtilecfg, palette 1, tiles 0..7 all 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = kTileRows;
  }
  // Tiles 0..3 (accumulators) 16 x 16 floats, the left operands 4 and 5 16 rows of `pairs` words, the right
  // operands 6 and 7 `pairs` rows of 16 words: products that sum `pairs` (1..16) pairs per instruction.
  static TileConfig for_sum_chunk(int pairs) {
    TileConfig c;
    for (int t = 4; t < 6; ++t) c.colsb[t] = uint16_t(4 * pairs);
    for (int t = 6; t < 8; ++t) c.rows[t] = uint8_t(pairs);
    return c;
  }
  // for_sum_chunk with column tile j (accumulators j and 2 + j, right operand 6 + j) `cols` floats wide (1..16):
  // a last, partial column tile of C read and written in place.
  static TileConfig for_sum_chunk(int pairs, int j, int cols) {
    TileConfig c = for_sum_chunk(pairs);
    c.colsb[j] = c.colsb[2 + j] = c.colsb[6 + j] = uint16_t(4 * cols);
    return c;
  }
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

#if defined(__x86_64__) && defined(__GNUC__)
// The tile instructions, by tile number (the assembler needs the register name). The asm statements name memory
// as clobbered so that the compiler keeps the stores to staging buffers before a load and rereads after a store.
#define SATTN_AMX_TILE_REG(t) "%%tmm" #t
struct HardwareTiles {
  static void configure(const TileConfig& c) { __asm__ volatile("ldtilecfg (%0)" ::"r"(&c) : "memory"); }
  static void release() { __asm__ volatile("tilerelease" ::: "memory"); }
  template <int t>
  static void zero();
  template <int t>
  static void load(const void* base, int64_t stride_bytes);
  template <int t>
  static void store(void* base, int64_t stride_bytes);
  template <int c, int a, int b>
  static void dot();  // tile c += tile a · tile b (tdpbf16ps)
};
#define SATTN_AMX_TILE_OPS(t)                                                                                \
  template <>                                                                                                \
  inline void HardwareTiles::zero<t>() {                                                                     \
    __asm__ volatile("tilezero " SATTN_AMX_TILE_REG(t)::: "memory");                                         \
  }                                                                                                          \
  template <>                                                                                                \
  inline void HardwareTiles::load<t>(const void* base, int64_t stride) {                                     \
    __asm__ volatile("tileloadd (%0,%1,1), " SATTN_AMX_TILE_REG(t)::"r"(base), "r"(stride) : "memory");      \
  }                                                                                                          \
  template <>                                                                                                \
  inline void HardwareTiles::store<t>(void* base, int64_t stride) {                                          \
    __asm__ volatile("tilestored " SATTN_AMX_TILE_REG(t) ", (%0,%1,1)" ::"r"(base), "r"(stride) : "memory"); \
  }
SATTN_AMX_TILE_OPS(0)
SATTN_AMX_TILE_OPS(1)
SATTN_AMX_TILE_OPS(2)
SATTN_AMX_TILE_OPS(3)
SATTN_AMX_TILE_OPS(4)
SATTN_AMX_TILE_OPS(5)
SATTN_AMX_TILE_OPS(6)
SATTN_AMX_TILE_OPS(7)
#undef SATTN_AMX_TILE_OPS
// AT&T operand order: tdpbf16ps b, a, c computes c += a · b.
#define SATTN_AMX_DOT(c, a, b)                                                                                  \
  template <>                                                                                                   \
  inline void HardwareTiles::dot<c, a, b>() {                                                                   \
    __asm__ volatile("tdpbf16ps " SATTN_AMX_TILE_REG(b) ", " SATTN_AMX_TILE_REG(a) ", " SATTN_AMX_TILE_REG(c):: \
                         : "memory");                                                                           \
  }
SATTN_AMX_DOT(0, 4, 6)
SATTN_AMX_DOT(1, 4, 7)
SATTN_AMX_DOT(2, 5, 6)
SATTN_AMX_DOT(3, 5, 7)
#undef SATTN_AMX_DOT
#undef SATTN_AMX_TILE_REG
#endif

// Loads the configuration on construction and releases the tiles on destruction (the tile state belongs to the
// thread; another library in the process may configure them differently between two tasks).
template <class Tiles>
class TileConfigScope {
 public:
  explicit TileConfigScope(bool active, const TileConfig& config = TileConfig{}) : active_(active) {
    if (active_) Tiles::configure(config);
  }
  ~TileConfigScope() {
    if (active_) Tiles::release();
  }
  TileConfigScope(const TileConfigScope&) = delete;
  TileConfigScope& operator=(const TileConfigScope&) = delete;

 private:
  bool active_;
};

namespace detail {

// Tile numbers: accumulators C(i, j) = 2i + j, left operands A(i) = 4 + i, right operands B(j) = 6 + j.
template <class Tiles, int i>
void load_a(const uint32_t* p, int64_t ld) {
  Tiles::template load<4 + i>(p, ld * 4);
}
template <class Tiles, int j>
void load_b(const uint32_t* p, int64_t ld) {
  Tiles::template load<6 + j>(p, ld * 4);
}

// Rows [m0, m0 + 16) x pairs [k0, k0 + 16) of A into a 16 x 16 buffer, zero past M and K2; with odd K the high
// half of pair K2 − 1 is zeroed (it holds an element past the sum).
inline void stage_a(const uint32_t* A, int64_t lda, int64_t m0, int64_t M, int64_t k0, int64_t K2, bool odd_k,
                    uint32_t* out) {
  const int64_t n = std::min<int64_t>(kTileRows, K2 - k0);  // words of the chunk inside the sum
  for (int r = 0; r < kTileRows; ++r) {
    uint32_t* o = out + r * kTileRows;
    const bool live = m0 + r < M;
    if (live) std::copy_n(A + (m0 + r) * lda + k0, n, o);
    std::fill(o + (live ? n : 0), o + kTileRows, 0u);
    if (live && odd_k && k0 + n == K2) o[n - 1] &= 0xFFFFu;
  }
}

// Pair rows [k0, k0 + 16) x columns [n0, n0 + 16) of B, zero past K2 (and the high half of pair K2 − 1 with odd K).
inline void stage_b(const uint32_t* B, int64_t ldb, int64_t n0, int64_t k0, int64_t K2, bool odd_k, uint32_t* out) {
  for (int r = 0; r < kTileRows; ++r) {
    uint32_t* o = out + r * kTileRows;
    const int64_t k = k0 + r;
    if (k >= K2) {
      std::fill(o, o + kTileRows, 0u);
      continue;
    }
    std::copy_n(B + k * ldb + n0, kTileRows, o);
    if (odd_k && k == K2 - 1)
      for (int c = 0; c < kTileRows; ++c) o[c] &= 0xFFFFu;
  }
}

// Rows x columns (each <= 16) of C into a zeroed 16 x 16 tile buffer, and back.
inline void stage_c_in(const float* C, int64_t ldc, int rows, int cols, float* out) {
  std::fill(out, out + kTileRows * kTileRows, 0.f);
  for (int r = 0; r < rows; ++r) std::copy(C + r * ldc, C + r * ldc + cols, out + r * kTileRows);
}
inline void stage_c_out(const float* in, int rows, int cols, float* C, int64_t ldc) {
  for (int r = 0; r < rows; ++r) std::copy(in + r * kTileRows, in + r * kTileRows + cols, C + r * ldc);
}
// C = mul · T (+ C with acc) over rows x columns, T a stored 16 x 16 accumulator tile.
inline void store_scaled(const float* t, int64_t rows, int cols, float mul, bool acc, float* C, int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    for (int x = 0; x < cols; ++x) {
      const float v = mul * t[r * kTileRows + x];
      C[r * ldc + x] = acc ? C[r * ldc + x] + v : v;
    }
}

// f(i, j) (as integral constants) for the MB x NB accumulator tiles of a block, in the order C(0,0), C(0,1),
// C(1,0), C(1,1).
using I0 = std::integral_constant<int, 0>;
using I1 = std::integral_constant<int, 1>;
template <int MB, int NB, class F>
void for_each_tile(F&& f) {
  f(I0{}, I0{});
  if constexpr (NB > 1) f(I0{}, I1{});
  if constexpr (MB > 1) f(I1{}, I0{});
  if constexpr (MB > 1 && NB > 1) f(I1{}, I1{});
}

template <class Tiles, int i, int j>
void dot() {
  Tiles::template dot<2 * i + j, 4 + i, 6 + j>();
}

// The common case of block: 2 x 2 whole tiles, K2 a multiple of 16, no staging and no second parts, the
// accumulators straight from and to C, in a loop of nothing but the tile instructions. (Through the general loop, with
// its staging branches, lambdas and calls, the bf16 forward ran 1–4 % slower: docs/fused.md.)
template <class Tiles, bool kAcc>
__attribute__((always_inline)) inline void whole_block(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                                                       float* C, int64_t ldc, int64_t m0, int64_t n0, int64_t K2) {
  constexpr int64_t T = kTileRows;
  float* c = C + m0 * ldc + n0;
  const uint32_t *a = A + m0 * lda, *b = B + n0;
  const int64_t sa = lda * 4, sb = ldb * 4, sc = ldc * 4;
  if constexpr (kAcc) {
    Tiles::template load<0>(c, sc), Tiles::template load<1>(c + T, sc);
    Tiles::template load<2>(c + T * ldc, sc), Tiles::template load<3>(c + T * ldc + T, sc);
  } else {
    Tiles::template zero<0>(), Tiles::template zero<1>(), Tiles::template zero<2>(), Tiles::template zero<3>();
  }
  for (int64_t k0 = 0; k0 < K2; k0 += T) {
    Tiles::template load<4>(a + k0, sa), Tiles::template load<5>(a + T * lda + k0, sa);
    Tiles::template load<6>(b + k0 * ldb, sb), Tiles::template load<7>(b + k0 * ldb + T, sb);
    dot<Tiles, 0, 0>(), dot<Tiles, 0, 1>(), dot<Tiles, 1, 0>(), dot<Tiles, 1, 1>();
  }
  Tiles::template store<0>(c, sc), Tiles::template store<1>(c + T, sc);
  Tiles::template store<2>(c + T * ldc, sc), Tiles::template store<3>(c + T * ldc + T, sc);
}

// One block of MB x NB accumulator tiles: rows [m0, m0 + 16·MB) ∩ [0, M), columns [n0, n0 + 16·NB).
template <class Tiles, int MB, int NB, bool kAcc, bool kSplit, bool kSplitA, bool kLoLo>
void block(const uint32_t* A, int64_t lda, int64_t alo, const uint32_t* B, int64_t ldb, int64_t lo, float* C,
           int64_t ldc, int64_t M, int64_t m0, int64_t n0, int64_t K, float mul) {
  const int64_t K2 = (K + 1) / 2;
  const bool odd_k = K % 2 != 0;
  bool full[2];
  for (int i = 0; i < 2; ++i) full[i] = m0 + kTileRows * (i + 1) <= M;
  // With mul 1 the accumulators go straight to C (full rows), with kAcc starting from C itself; otherwise they
  // start from zero and are combined with C after, through a staging buffer.
  const bool direct = mul == 1.f;
  if constexpr (MB == 2 && NB == 2 && !kSplit && !kSplitA)
    if (direct && full[1] && !odd_k && K2 % kTileRows == 0)
      return whole_block<Tiles, kAcc>(A, lda, B, ldb, C, ldc, m0, n0, K2);
  alignas(64) uint32_t a_stage[2][kTileRows * kTileRows];
  alignas(64) uint32_t b_stage[2][kTileRows * kTileRows];
  alignas(64) float c_stage[kTileRows * kTileRows];

  auto init = [&](auto ic, auto jc) {
    constexpr int i = decltype(ic)::value, j = decltype(jc)::value;
    if (kAcc && direct && full[i])
      Tiles::template load<2 * i + j>(C + (m0 + kTileRows * i) * ldc + n0 + kTileRows * j, ldc * 4);
    else Tiles::template zero<2 * i + j>();
  };
  auto finish = [&](auto ic, auto jc) {
    constexpr int i = decltype(ic)::value, j = decltype(jc)::value;
    float* c = C + (m0 + kTileRows * i) * ldc + n0 + kTileRows * j;
    if (direct && full[i]) return Tiles::template store<2 * i + j>(c, ldc * 4);
    Tiles::template store<2 * i + j>(c_stage, kTileRows * 4);
    store_scaled(c_stage, std::min<int64_t>(kTileRows, M - (m0 + kTileRows * i)), kTileRows, mul, kAcc, c, ldc);
  };
  for_each_tile<MB, NB>(init);

  for (int64_t k0 = 0; k0 < K2; k0 += kTileRows) {
    // A chunk is loaded in place when it lies inside the matrix and holds no element past an odd K.
    const bool k_whole = k0 + kTileRows < K2 || (k0 + kTileRows == K2 && !odd_k);
    auto load_a_tile = [&](auto ic, const uint32_t* a) {
      constexpr int i = decltype(ic)::value;
      const int64_t m = m0 + kTileRows * i;
      if (full[i] && k_whole) return load_a<Tiles, i>(a + m * lda + k0, lda);
      stage_a(a, lda, m, M, k0, K2, odd_k, a_stage[i]);
      load_a<Tiles, i>(a_stage[i], kTileRows);
    };
    auto load_b_tile = [&](auto jc, const uint32_t* b) {
      constexpr int j = decltype(jc)::value;
      const int64_t n = n0 + kTileRows * j;
      if (k_whole) return load_b<Tiles, j>(b + k0 * ldb + n, ldb);
      stage_b(b, ldb, n, k0, K2, odd_k, b_stage[j]);
      load_b<Tiles, j>(b_stage[j], kTileRows);
    };
    auto dots = [] {
      for_each_tile<MB, NB>([](auto ic, auto jc) { dot<Tiles, decltype(ic)::value, decltype(jc)::value>(); });
    };
    constexpr int kParts = kSplit ? 2 : 1;
    for (int apart = 0; apart < (kSplitA ? 2 : 1); ++apart) {
      const uint32_t* a = A + apart * alo;
      load_a_tile(I0{}, a);
      if constexpr (MB > 1) load_a_tile(I1{}, a);
      // The second part of A takes B's parts in reverse order: the last one loaded is still in its tiles.
      for (int part = 0; part < kParts; ++part) {
        const int bpart = apart == 0 ? part : kParts - 1 - part;
        if (!kLoLo && apart == 1 && bpart == 1) continue;  // (B's second part is not loaded again either)
        if (apart == 0 || part > 0) {
          const uint32_t* b = B + bpart * lo;
          load_b_tile(I0{}, b);
          if constexpr (NB > 1) load_b_tile(I1{}, b);
        }
        dots();
      }
    }
  }

  for_each_tile<MB, NB>(finish);
}

}  // namespace detail

// C[M x N] = mul · A2 B2 (kAcc: C += mul · A2 B2), summed over K bf16 elements held as K2 = ⌈K/2⌉ pairs:
// - A2 [M x K2] words, row m at A + m·lda (rows run along the sum: keys for K, dimensions for V^T);
// - B2 [K2 x N] words, pair row k at B + k·ldb; kSplit adds a second right-hand matrix `lo` words after B (the
//   rounding errors of a float32 operand split into two bf16);
// - kSplitA adds a second left-hand matrix `alo` words after A, multiplied by B (and B's second part) alike;
//   !kLoLo drops the product of the two second parts (three products: the two rounding errors' product, 2^-18
//   relative for float32 operands split into two bf16, is below what the split itself leaves out);
// - N a multiple of 16; C rows ldc floats apart.
// With odd K the high halves of pair K2 − 1 (elements past the sum) do not reach C, whatever they hold.
// mul 1 stores the accumulators straight into C (full rows of 16); any other factor goes through a staging
// buffer and scalar code, so callers with a factor to apply on every element do better to apply it themselves.
// The tiles must be configured (TileConfigScope).
template <class Tiles, bool kAcc, bool kSplit, bool kSplitA = false, bool kLoLo = true>
struct PairsProduct {
  const uint32_t* A;
  int64_t lda;
  const uint32_t* B;
  int64_t ldb, lo;
  float* C;
  int64_t ldc, M, N, K;
  float mul;
  int64_t alo = 0;

  // Blocks of up to 32 x 32 of C, rows [32·(i / nbn), +32) x columns [32·(i % nbn), +32).
  int64_t num_blocks() const { return (M + 31) / 32 * ((N + 31) / 32); }
  void run_block(int64_t i) const {
    constexpr int64_t T = kTileRows;
    const int64_t nbn = (N + 2 * T - 1) / (2 * T), m0 = i / nbn * 2 * T, n0 = i % nbn * 2 * T;
    const bool two_rows = M - m0 > T, two_cols = N - n0 > T;
    using detail::block;
    if (two_rows && two_cols)
      block<Tiles, 2, 2, kAcc, kSplit, kSplitA, kLoLo>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
    else if (two_rows)
      block<Tiles, 2, 1, kAcc, kSplit, kSplitA, kLoLo>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
    else if (two_cols)
      block<Tiles, 1, 2, kAcc, kSplit, kSplitA, kLoLo>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
    else block<Tiles, 1, 1, kAcc, kSplit, kSplitA, kLoLo>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
  }
  void run() const {
    for (int64_t i = 0; i < num_blocks(); ++i) run_block(i);
  }
};

// The whole product at once; PairsProduct runs the same blocks one at a time, so that a caller can interleave
// them with vector work (the tiles compute while the vector units run, in out-of-order execution).
template <class Tiles, bool kAcc, bool kSplit, bool kSplitA = false, bool kLoLo = true>
void gemm_pairs(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t lo, float* C, int64_t ldc,
                int64_t M, int64_t N, int64_t K, float mul, int64_t alo = 0) {
  PairsProduct<Tiles, kAcc, kSplit, kSplitA, kLoLo>{A, lda, B, ldb, lo, C, ldc, M, N, K, mul, alo}.run();
}

namespace detail {

// One block of MB x NB accumulator tiles of gemm_segments_pairs: row tile i reads segment s at a[i][s] (rows lda[i]
// words apart) and has rows[i] rows of C, column tile j is cols[j] columns wide, from C at column n0, in tiles
// configured tile_cols[j] floats wide (16, or cols[j] for a last, partial column tile). The tiles start from the
// row init_row (at column n0, every tile row loading it: row stride 0) where given, else from C where from_c, else from
// zero, and C becomes alpha times them, plus C where accumulate and not from_c. Chunks of kc pairs; a last chunk of a
// segment shorter than kc, and the C of a partial row tile, go through zero-padded staging buffers.
template <class Tiles, int MB, int NB>
void segments_block(int nseg, const uint32_t* const (*a)[16], const int64_t* lda, const int* rows, const int64_t* K2,
                    const uint32_t* W2, int64_t ldw, int64_t n0, const int* cols, const int* tile_cols, int64_t kc,
                    float* C, int64_t ldc, bool accumulate, float alpha, const float* init_row) {
  alignas(64) float c_stage[2][2][kTileRows * kTileRows];
  alignas(64) uint32_t a_stage[2][kTileRows * kTileRows];
  alignas(64) uint32_t b_stage[2][kTileRows * kTileRows];
  const bool from_c = init_row || (accumulate && alpha == 1.f);
  auto direct = [&](int i, int j) { return rows[i] == kTileRows && cols[j] == tile_cols[j]; };
  auto c_at = [&](int i, int j) { return C + i * kTileRows * ldc + n0 + j * kTileRows; };
  auto init = [&](auto ic, auto jc) {
    constexpr int i = decltype(ic)::value, j = decltype(jc)::value;
    if (init_row) return Tiles::template load<2 * i + j>(init_row + n0 + j * kTileRows, 0);
    if (!from_c) return Tiles::template zero<2 * i + j>();
    if (direct(i, j)) return Tiles::template load<2 * i + j>(c_at(i, j), ldc * 4);
    stage_c_in(c_at(i, j), ldc, rows[i], cols[j], c_stage[i][j]);
    Tiles::template load<2 * i + j>(c_stage[i][j], kTileRows * 4);
  };
  auto finish = [&](auto ic, auto jc) {
    constexpr int i = decltype(ic)::value, j = decltype(jc)::value;
    if (direct(i, j) && alpha == 1.f && (from_c || !accumulate))
      return Tiles::template store<2 * i + j>(c_at(i, j), ldc * 4);
    Tiles::template store<2 * i + j>(c_stage[i][j], kTileRows * 4);
    if (from_c) return stage_c_out(c_stage[i][j], rows[i], cols[j], c_at(i, j), ldc);
    store_scaled(c_stage[i][j], rows[i], cols[j], alpha, accumulate, c_at(i, j), ldc);
  };
  const auto dots = [](auto ic, auto jc) { dot<Tiles, decltype(ic)::value, decltype(jc)::value>(); };
  for_each_tile<MB, NB>(init);
  const uint32_t* w = W2 + n0;
  for (int s = 0; s < nseg; ++s) {
    for (int64_t k0 = 0; k0 < K2[s]; k0 += kc) {
      if (k0 + kc <= K2[s]) {
        load_a<Tiles, 0>(a[0][s] + k0, lda[0]);
        if constexpr (MB > 1) load_a<Tiles, 1>(a[1][s] + k0, lda[1]);
        load_b<Tiles, 0>(w + k0 * ldw, ldw);
        if constexpr (NB > 1) load_b<Tiles, 1>(w + k0 * ldw + kTileRows, ldw);
      } else {  // a short last chunk (kc = 16): the kw pairs, zeros after them (16 rows of A: the tail's padded)
        for (int i = 0; i < MB; ++i) stage_a(a[i][s], lda[i], 0, kTileRows, k0, K2[s], false, a_stage[i]);
        for (int j = 0; j < NB; ++j) stage_b(w, ldw, j * kTileRows, k0, K2[s], false, b_stage[j]);
        load_a<Tiles, 0>(a_stage[0], kTileRows);
        if constexpr (MB > 1) load_a<Tiles, 1>(a_stage[1], kTileRows);
        load_b<Tiles, 0>(b_stage[0], kTileRows);
        if constexpr (NB > 1) load_b<Tiles, 1>(b_stage[1], kTileRows);
      }
      for_each_tile<MB, NB>(dots);
    }
    w += K2[s] * ldw;
  }
  for_each_tile<MB, NB>(finish);
}

}  // namespace detail

// C[m, :N] = (accumulate ? C[m, :N] : 0) + alpha · Σ_s A_s[m, :K2_s] · W2_s for m < M (nseg <= 16 segments), all
// in pairs of bf16 (32-bit words); with `init` (a row of N floats, accumulate and alpha 1), C[m, :N] = init +
// Σ_s ..., the same bits as C set to init rows first, without reading C:
// - A_s rows of K2_s words at A[s] + m·lda (rows may overlap: lda < K2_s);
// - W2 = [W2_0; W2_1; ...] stacked, [Σ K2_s] rows of ldw words, readable to N rounded up to 16 words;
// - C rows ldc floats apart; nothing past column N or row M is read or written.
// Each product instruction sums kc pairs: the largest kc <= 16 that divides every K2_s where that is 8 or more (the
// tiles are configured for it, TileConfig::for_sum_chunk, for the call), else 16 with each segment's last, shorter
// chunk staged. Every element of C is a fixed sequence of tile products (segments in order, chunks ascending),
// started from C where accumulate with alpha 1, whatever the row or column it is in: results do not depend on how
// rows are batched.
template <class Tiles>
void gemm_segments_pairs(int nseg, const uint32_t* const* A, const int64_t* K2, int64_t lda, int64_t M,
                         const uint32_t* W2, int64_t ldw, int64_t N, float* C, int64_t ldc, bool accumulate = true,
                         float alpha = 1.f, const float* init = nullptr) {
  constexpr int kMaxSeg = 16;
  constexpr int64_t T = kTileRows;
  int64_t g = 0, max_k2 = 0;
  for (int s = 0; s < nseg; ++s) {
    g = std::gcd(g, K2[s]);
    max_k2 = std::max(max_k2, K2[s]);
  }
  if (init && !(accumulate && alpha == 1.f))
    throw std::invalid_argument("gemm_segments_pairs: an init row needs accumulate and alpha 1");
  if (M <= 0 || N <= 0) return;
  if (g == 0) {  // nothing to add
    if (init)
      for (int64_t m = 0; m < M; ++m) std::copy(init, init + N, C + m * ldc);
    else if (!accumulate)
      for (int64_t m = 0; m < M; ++m) std::fill(C + m * ldc, C + m * ldc + N, 0.f);
    return;
  }
  int64_t kc = T;
  while (g % kc != 0) --kc;
  if (kc < T / 2) kc = T;
  // The rows of a last, partial row tile, zero-padded to 16 rows (a tile load reads 16 rows).
  const int64_t tail_m0 = M / T * T;
  const int tail_rows = int(M - tail_m0);
  thread_local std::vector<uint32_t> tail;
  const uint32_t* tail_a[kMaxSeg] = {};
  if (tail_rows > 0) {
    tail.assign(size_t(nseg * T * max_k2), 0u);
    for (int s = 0; s < nseg; ++s) {
      uint32_t* t = tail.data() + s * T * max_k2;
      for (int r = 0; r < tail_rows; ++r) std::copy_n(A[s] + (tail_m0 + r) * lda, K2[s], t + r * max_k2);
      tail_a[s] = t;
    }
  }
  // The column blocks of whole tiles, then the last block with a partial tile (N % 16 columns), its tile configured
  // that wide: C read and written in place rather than through staging buffers.
  const int64_t n_whole = N % T == 0 ? N : N / (2 * T) * (2 * T);
  const auto column_block = [&](int64_t n0, const int* tile_cols) {
    const int cols[2] = {int(std::min(T, N - n0)), int(std::clamp<int64_t>(N - n0 - T, 0, T))};
    for (int64_t m0 = 0; m0 < M; m0 += 2 * T) {
      const uint32_t* a[2][kMaxSeg];
      int64_t ld[2];
      int rows[2];
      for (int i = 0; i < 2; ++i) {
        const int64_t m = m0 + i * T;
        rows[i] = int(std::clamp<int64_t>(M - m, 0, T));
        const bool staged = m == tail_m0 && tail_rows > 0;
        ld[i] = staged ? max_k2 : lda;
        for (int s = 0; s < nseg; ++s) a[i][s] = staged ? tail_a[s] : rows[i] > 0 ? A[s] + m * lda : nullptr;
      }
      float* c = C + m0 * ldc;
      using detail::segments_block;
      if (rows[1] > 0 && cols[1] > 0)
        segments_block<Tiles, 2, 2>(nseg, a, ld, rows, K2, W2, ldw, n0, cols, tile_cols, kc, c, ldc, accumulate, alpha,
                                    init);
      else if (rows[1] > 0)
        segments_block<Tiles, 2, 1>(nseg, a, ld, rows, K2, W2, ldw, n0, cols, tile_cols, kc, c, ldc, accumulate, alpha,
                                    init);
      else if (cols[1] > 0)
        segments_block<Tiles, 1, 2>(nseg, a, ld, rows, K2, W2, ldw, n0, cols, tile_cols, kc, c, ldc, accumulate, alpha,
                                    init);
      else
        segments_block<Tiles, 1, 1>(nseg, a, ld, rows, K2, W2, ldw, n0, cols, tile_cols, kc, c, ldc, accumulate, alpha,
                                    init);
    }
  };
  if (n_whole > 0) {
    const TileConfigScope<Tiles> scope(true, TileConfig::for_sum_chunk(int(kc)));
    const int whole[2] = {int(T), int(T)};
    for (int64_t n0 = 0; n0 < n_whole; n0 += 2 * T) column_block(n0, whole);
  }
  if (n_whole < N) {
    const int j = N - n_whole > T ? 1 : 0, width = int(N % T);  // the partial tile: the block's first or second
    const TileConfigScope<Tiles> scope(true, TileConfig::for_sum_chunk(int(kc), j, width));
    const int tile_cols[2] = {j == 0 ? width : int(T), j == 1 ? width : int(T)};
    column_block(n_whole, tile_cols);
  }
}

}  // namespace sattn::simd::amx
