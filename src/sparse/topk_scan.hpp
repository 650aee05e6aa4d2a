// Streaming top-k scoring pass of TopK (used only by adaptive.cpp): scores of a query block against all keys of a
// head, computed with register-blocked SIMD tiles (Highway, chosen at run time from the one target table),
// each tile row compared against the row's running threshold so that only the few survivors are inserted.
#pragma once

#include <cstdint>

namespace sattn::sparse::topk {

// The SIMD target of the build in use (simd/target.hpp).
const char* simd_build();

// Keys per packed tile of the SIMD target in use.
int64_t tile_width();
// Packs keys [n x d] (row stride ldk_in) into tiles of tile_width() keys: out[t][c][l] = k[t·W + l][c], zero past n.
// out holds ceil(n / W) · W · d floats.
void pack_keys(const float* k, int64_t n, int64_t d, int64_t ld_in, float* out);

// Floats (and int32s) per row of the candidate buffers for k of n keys (min(8 k, n) candidates plus slack for
// vector stores).
int64_t row_stride(int64_t k, int64_t n);

// The streaming top-k of m query rows q [m x d] (row stride d) over keys [0, n) (packed by pack_keys), scores
// scale·q·k in fp32 (+ key_bias[j]: 0, or -inf for a padding key; null: none; when given it holds -inf up to the end
// of the last tile). Per row r a buffer (scores cs, key indices cj, at offset r·row_stride(k, n), ascending keys) and
// a threshold thr[r] (initially -inf, cnt[r] = 0): keys are visited in ascending order and a score strictly above
// the threshold is appended (an equal score loses to the kept, lower keys); a full buffer is cut to at least its
// best k and the threshold raised to a score that at least k kept ones beat. On return each row holds
// cnt[r] = min(k, usable keys) candidates, its top-k (higher score, ties to the lower index), in ascending key
// order. tmp: row_stride(k, n) floats.
void scan(const float* q, int64_t m, int64_t d, const float* kpacked, int64_t n, float scale, const float* key_bias,
          int64_t k, float* cs, int32_t* cj, int64_t* cnt, float* thr, float* tmp);

// o[0, dv) = sum over x < c of w[x] · v[j[x]·dv + (0, dv)] (the softmax-weighted kept value rows of one query).
void weighted_rows(const float* w, const int32_t* j, int64_t c, const float* v, int64_t dv, float* o);

}  // namespace sattn::sparse::topk
