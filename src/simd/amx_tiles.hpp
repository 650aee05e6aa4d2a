// Matrix products on AMX tiles (TMUL, tdpbf16ps) over bf16 pairs, for the fused kernel's amx build, and the
// tile instructions they use behind a small interface so that the same product code runs on a software model of
// the tiles (tests/cpp/test_amx_tiles.cpp) on machines without AMX.
//
// A tile is 16 rows of 64 bytes. tdpbf16ps C, A, B adds, for every element of the float32 tile C [16 x 16],
//   C[m][n] += Σ_k A.lo[m][k]·B.lo[k][n] + A.hi[m][k]·B.hi[k][n]
// where A [16 x 16] and B [16 x 16] are 32-bit words holding two bf16 each (lo in the low half): A's rows run along
// the summed dimension, B's rows are pairs of rows of the right-hand matrix (the layout vdpbf16ps takes too).
// The hardware treats bf16 denormals as zero and rounds each addition to float32.
//
// Every tile here is 16 x 64 bytes (one configuration, palette 1), loaded by TileConfigScope for the duration of
// a task; partial tiles (rows, columns or summed pairs past the matrix) go through zero-padded staging buffers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

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
  explicit TileConfigScope(bool active) : active_(active) {
    if (active_) Tiles::configure(TileConfig{});
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
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < kTileRows; ++c) {
      const int64_t m = m0 + r, k = k0 + c;
      uint32_t w = m < M && k < K2 ? A[m * lda + k] : 0u;
      if (odd_k && k == K2 - 1) w &= 0xFFFFu;
      out[r * kTileRows + c] = w;
    }
}

// Pair rows [k0, k0 + 16) x columns [n0, n0 + 16) of B, zero past K2 (and the high half of pair K2 − 1 with odd K).
inline void stage_b(const uint32_t* B, int64_t ldb, int64_t n0, int64_t k0, int64_t K2, bool odd_k, uint32_t* out) {
  for (int r = 0; r < kTileRows; ++r)
    for (int c = 0; c < kTileRows; ++c) {
      const int64_t k = k0 + r;
      uint32_t w = k < K2 ? B[k * ldb + n0 + c] : 0u;
      if (odd_k && k == K2 - 1) w &= 0xFFFFu;
      out[r * kTileRows + c] = w;
    }
}

template <class Tiles, int i, int j>
void dot() {
  Tiles::template dot<2 * i + j, 4 + i, 6 + j>();
}

// One block of MB x NB accumulator tiles: rows [m0, m0 + 16·MB) ∩ [0, M), columns [n0, n0 + 16·NB).
template <class Tiles, int MB, int NB, bool kAcc, bool kSplit, bool kSplitA>
void block(const uint32_t* A, int64_t lda, int64_t alo, const uint32_t* B, int64_t ldb, int64_t lo, float* C,
           int64_t ldc, int64_t M, int64_t m0, int64_t n0, int64_t K, float mul) {
  const int64_t K2 = (K + 1) / 2;
  const bool odd_k = K % 2 != 0;
  bool full[2];
  for (int i = 0; i < 2; ++i) full[i] = m0 + kTileRows * (i + 1) <= M;
  // With mul 1 the accumulators go straight to C (full rows), with kAcc starting from C itself; otherwise they
  // start from zero and are combined with C after, through a staging buffer.
  const bool direct = mul == 1.f;
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
    const int64_t rows = std::min<int64_t>(kTileRows, M - (m0 + kTileRows * i));
    for (int64_t r = 0; r < rows; ++r)
      for (int x = 0; x < kTileRows; ++x) {
        const float v = mul * c_stage[r * kTileRows + x];
        c[r * ldc + x] = kAcc ? c[r * ldc + x] + v : v;
      }
  };
  using I0 = std::integral_constant<int, 0>;
  using I1 = std::integral_constant<int, 1>;
  init(I0{}, I0{});
  if constexpr (NB > 1) init(I0{}, I1{});
  if constexpr (MB > 1) init(I1{}, I0{});
  if constexpr (MB > 1 && NB > 1) init(I1{}, I1{});

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
    auto dots = [&] {
      dot<Tiles, 0, 0>();
      if constexpr (NB > 1) dot<Tiles, 0, 1>();
      if constexpr (MB > 1) dot<Tiles, 1, 0>();
      if constexpr (MB > 1 && NB > 1) dot<Tiles, 1, 1>();
    };
    constexpr int kParts = kSplit ? 2 : 1;
    for (int apart = 0; apart < (kSplitA ? 2 : 1); ++apart) {
      const uint32_t* a = A + apart * alo;
      load_a_tile(I0{}, a);
      if constexpr (MB > 1) load_a_tile(I1{}, a);
      // The second part of A takes B's parts in reverse order: the last one loaded is still in its tiles.
      for (int part = 0; part < kParts; ++part) {
        const int bpart = apart == 0 ? part : kParts - 1 - part;
        if (apart == 0 || part > 0) {
          const uint32_t* b = B + bpart * lo;
          load_b_tile(I0{}, b);
          if constexpr (NB > 1) load_b_tile(I1{}, b);
        }
        dots();
      }
    }
  }

  finish(I0{}, I0{});
  if constexpr (NB > 1) finish(I0{}, I1{});
  if constexpr (MB > 1) finish(I1{}, I0{});
  if constexpr (MB > 1 && NB > 1) finish(I1{}, I1{});
}

}  // namespace detail

// C[M x N] = mul · A2 B2 (kAcc: C += mul · A2 B2), summed over K bf16 elements held as K2 = ⌈K/2⌉ pairs:
// - A2 [M x K2] words, row m at A + m·lda (rows run along the sum: keys for K, dimensions for V^T);
// - B2 [K2 x N] words, pair row k at B + k·ldb; kSplit adds a second right-hand matrix `lo` words after B (the
//   rounding errors of a float32 operand split into two bf16);
// - kSplitA adds a second left-hand matrix `alo` words after A, multiplied by B (and B's second part) alike;
// - N a multiple of 16; C rows ldc floats apart.
// With odd K the high halves of pair K2 − 1 (elements past the sum) do not reach C, whatever they hold.
// mul 1 stores the accumulators straight into C (full rows of 16); any other factor goes through a staging
// buffer and scalar code, so callers with a factor to apply on every element do better to apply it themselves.
// The tiles must be configured (TileConfigScope).
template <class Tiles, bool kAcc, bool kSplit, bool kSplitA = false>
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
      block<Tiles, 2, 2, kAcc, kSplit, kSplitA>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
    else if (two_rows) block<Tiles, 2, 1, kAcc, kSplit, kSplitA>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
    else if (two_cols) block<Tiles, 1, 2, kAcc, kSplit, kSplitA>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
    else block<Tiles, 1, 1, kAcc, kSplit, kSplitA>(A, lda, alo, B, ldb, lo, C, ldc, M, m0, n0, K, mul);
  }
  void run() const {
    for (int64_t i = 0; i < num_blocks(); ++i) run_block(i);
  }
};

// The whole product at once; PairsProduct runs the same blocks one at a time, so that a caller can interleave
// them with vector work (the tiles compute while the vector units run, in out-of-order execution).
template <class Tiles, bool kAcc, bool kSplit, bool kSplitA = false>
void gemm_pairs(const uint32_t* A, int64_t lda, const uint32_t* B, int64_t ldb, int64_t lo, float* C, int64_t ldc,
                int64_t M, int64_t N, int64_t K, float mul, int64_t alo = 0) {
  PairsProduct<Tiles, kAcc, kSplit, kSplitA>{A, lda, B, ldb, lo, C, ldc, M, N, K, mul, alo}.run();
}

}  // namespace sattn::simd::amx
