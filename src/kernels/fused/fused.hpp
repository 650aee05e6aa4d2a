// The fused (FlashAttention-style) CPU kernel: shared plain-data parameters between the dispatching code
// (fused_kernel.cpp) and the per-ISA tile loops (fused_simd.cpp, compiled once per SIMD target by Highway).
//
// Layout idea (see docs/fused.md): inside a tile, QUERIES live in the SIMD lanes. Scores are computed as
// S^T[key, query] = K · (scale·Q)^T, so the online softmax of a query is a lane-wise (vertical) operation, and
// K and V are read in their natural row-major layout with scalar broadcasts — no packing of K/V for f32 inputs
// with a unit last stride, any head dimension D without padding.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "sattn/problem.hpp"
#include "sattn/random.hpp"
#include "sattn/tensor.hpp"

namespace sattn::fused {

// Lq up to this runs the keys-in-lanes decode kernel (DecodeRows), whatever the dtype: bf16 products need K and V
// packed into pairs first, which costs a one-query call more than it saves (4x at Lk 512, Zen 4).
constexpr int64_t kDecodeRows = 4;

// A strided 4-D view [b, h, i, d] as raw pointer + element strides.
struct View4 {
  const void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t sb = 0, sh = 0, sl = 0, sd = 0;
};
struct OutView4 {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int64_t sb = 0, sh = 0, sl = 0, sd = 0;
};

struct Params {
  int64_t B = 0, Hq = 0, Hkv = 0, Lq = 0, Lk = 0, D = 0, Dv = 0, group = 1;
  View4 q, k, v;
  float scale = 1.f;
  // Causal: key j allowed for query i iff j <= i + causal_offset (when causal).
  bool causal = false;
  int64_t causal_offset = 0;
  // attn_mask as 4-D strides (0 where broadcast); kind none/bool/additive.
  MaskKind mask = MaskKind::kNone;
  View4 mask_view;  // [b, h, i, j] with sd = stride of j
  // Key padding: bool (true = padding) or lengths.
  const uint8_t* kp = nullptr;
  int64_t kp_sb = 0, kp_sk = 0;
  const int64_t* key_len = nullptr;  // [B] or nullptr
  // Dropout, keyed by global positions: query row i is q_pos0 + pos_stride·i, key j is k_pos0 + pos_stride·j.
  double dropout_p = 0.0;
  uint64_t seed = 0;
  int64_t q_pos0 = 0, k_pos0 = 0, pos_stride = 1;
  bool keep(int64_t b, int64_t h, int64_t i, int64_t j) const {
    return dropout_keep(seed, dropout_p, uint32_t(b), uint32_t(h), uint32_t(q_pos0 + pos_stride * i),
                        uint32_t(k_pos0 + pos_stride * j));
  }
  // Tiles: Br queries (multiple of 16) x Bc keys.
  int64_t Br = 64, Bc = 64;
  // The float32 forward's V^T per key block (ForwardOps::pack_vt, where a kv head's V is read by several query
  // blocks): [B·Hkv][num_k_blocks()][Dv][Bc], zero past Lk, so that O^T += V^T P^T reads its left operand along rows
  // (broadcasts from V's rows, one row per key, made it the slower of the two products); nullptr: V's rows in place.
  const float* vt_blocks = nullptr;

  // Decode: keys split into chunks of kv_chunk (a multiple of Bc; 0 = no split) whose partial results
  // part_o [B·Hq·Lq, nchunks, Dv] (normalised), part_max and part_sum [B·Hq·Lq, nchunks] (the chunk's row max m
  // and l = Σ e^(s − m), kept apart: a float lse = m + log l cannot carry log l when |m| is huge) are merged in
  // chunk order.
  int64_t kv_chunk = 0;
  // GQA decode (group > 1, group·Lq <= 4): one forward task per (b, kv head, chunk) computes the rows of all the
  // group's query heads together, so K/V are read once per group. Results equal the per-head computation.
  bool decode_group = false;
  float* part_o = nullptr;
  float* part_max = nullptr;
  float* part_sum = nullptr;
  int64_t num_kv_chunks() const { return kv_chunk > 0 ? (Lk + kv_chunk - 1) / kv_chunk : 1; }

  // bf16 products (the amx and avx512bf16 builds, bf16 inputs): K and V rounded to bf16 once, in 32-bit words of two
  // bf16 each, the pairs that vdpbf16ps multiplies and adds: k_pairs [B·Hkv][Lk][k_pair_stride()] holds (k[j, 2x], k[j,
  // 2x+1]) and v_pairs [B·Hkv][Lk2][Dv] holds (v[2y, x], v[2y + 1, x]), D2 = ⌈D/2⌉, Lk2 = ⌈Lk/2⌉, zero past D and Lk.
  // The forward tiles then compute S = Q K^T and O += P V with bf16 pairs and float32 sums; nullptr: float32 products.
  uint32_t* k_pairs = nullptr;
  uint32_t* v_pairs = nullptr;
  // P·V takes P rounded to bf16 once (Float32Precision::kBF16, or bf16 inputs with a bf16 out), else as two bf16 parts
  bool round_p = false;
  // Each input value as two bf16 on the amx tiles (the forward of float16 inputs, and of float32 ones under
  // Float32Precision::kHigh): K and V are packed twice, the rounded values (k_pairs, v_pairs) and the remainders
  // k_lo_words / v_lo_words after them, and Q likewise per task; every product then sums the part products, each
  // exact in float32. Every float16 is the sum of its two parts exactly (its 11 significant bits are the 8 of its
  // bf16 rounding and at most 3 more), so its four part products are as accurate as the float32 ones; a float32 value
  // is within 2^-17 of its two (relative), and its products drop the product of the two rounding errors (three part
  // products, 2^-18 relative). Inputs holding an infinity (inf · 0 between parts would make a NaN), or
  // float32 ones holding a NaN or a value that rounds past bf16's largest, do not take this path.
  // The backward takes it for float32 inputs under kHigh (dO checked too): its S^T = K Q^T and dP^T = V dO^T on the
  // parts (k_pairs and v_row_pairs with their lo parts k_lo_words and v_lo_words on, the Q^T and dO^T pairs with theirs
  // after the hi rows of each tile: pair_parts()), and its other three products too where split_grads.
  bool split_bf16 = false;
  int64_t k_lo_words = 0, v_lo_words = 0;
  int64_t pair_parts() const { return split_bf16 ? 2 : 1; }
  int64_t d_pairs() const { return (D + 1) / 2; }
  // Words per row of k_pairs and rows of the Q^T pairs: d_pairs(), on the amx tiles (but split_bf16) rounded up
  // to 16 with zero words (tile_pair_stride), so that S^T = K Q^T loads whole tiles where D is not a multiple of 32
  // (one tile product sums up to 16 pairs: the padding adds no product, and saves staging every partial tile).
  int64_t k_pair_stride() const { return tile_pair_stride(d_pairs()); }
  int64_t tile_pair_stride(int64_t pairs) const { return amx_tiles && !split_bf16 ? pad16(pairs) : pairs; }
  int64_t dv_pairs() const { return (Dv + 1) / 2; }
  // Words per row of the backward's v_row_pairs and rows of its dO^T pairs, padded as k_pair_stride() is (the
  // backward's k_pairs and Q^T pairs take k_pair_stride() too): dP^T = V dO^T loads whole tiles.
  int64_t dv_pair_stride() const { return tile_pair_stride(dv_pairs()); }
  int64_t lk_pairs() const { return (Lk + 1) / 2; }
  // The backward's bf16 products (S^T = K Q^T and dP^T = V dO^T; the other three take float32 operands and stay
  // float32): k_pairs as above with the rows that hold a NaN zeroed, v_row_pairs [B·Hkv][Lk][dv_pair_stride()]
  // holds (v[j, 2x], v[j, 2x+1]); per query block t, pk_qp [k_pair_stride() x Br] and pk_dop [dv_pair_stride() x Br]
  // words: Q^T (unscaled) and dO^T in pairs along D and Dv (pad words and rows zero).
  uint32_t* v_row_pairs = nullptr;
  uint32_t *pk_qp = nullptr, *pk_dop = nullptr;
  // dO^T is packed too (pk_dop): dO bf16, or rounding allowed. Where these query tiles live: pk_one_block below.
  bool dout_pairs = false;
  // round_grads: the one-pass backward's other three products on bf16 pairs too, with P' and dS rounded to bf16
  // once, as FlashAttention does (Float32Precision::kBF16, or bf16 inputs whose dq, dk and dv are stored in bf16,
  // whose own rounding is of the same size): dV += P'^T dO and dK += scale dS^T Q take P'^T and dS^T in pairs along
  // the queries and pk_qrp [Br/2 x pad16(D)], pk_dorp [Br/2 x pad16(Dv)] words per query block t: Q (unscaled) and
  // dO in pairs along the queries (q[2y, x], q[2y + 1, x]); dQ^T += K^T dS^T takes kt_pairs [B·Hkv][Lk2][D] words
  // (k[2y, x], k[2y + 1, x]) (rows that hold a NaN zeroed, zero past Lk) and dS^T in pairs along the keys.
  // split_grads (split_bf16 in the one-pass backward): the same three products on the amx tiles with every operand
  // as two bf16 parts instead (three part products each), to float32's range and about 16 significant bits: P'^T and
  // dS^T split, pk_qrp and pk_dorp with their lo rows after the hi ones of each tile, kt_pairs with its lo parts
  // kt_lo_words on.
  bool round_grads = false, split_grads = false;
  bool grad_pairs() const { return round_grads || split_grads; }
  uint32_t* kt_pairs = nullptr;
  int64_t kt_lo_words = 0;
  uint32_t *pk_qrp = nullptr, *pk_dorp = nullptr;
  // The amx build: those bf16 products on AMX tiles (tdpbf16ps, simd/amx_tiles.hpp) instead of vdpbf16ps. Its tiles
  // take the left operand with rows along the sum, so the forward's v_pairs hold V^T per slab of pv_keys() keys,
  // kPvTiles key blocks (the forward sums their P into O^T in one product: ForwardKeysAmx):
  // [B·Hkv][num_pv_slabs][vt_rows][pv_keys/2] words, pair y of dimension x at (y / S2)·vt_rows·S2 + x·S2 + y % S2
  // with S2 = pv_keys/2, zero past Lk and Dv. (A tile's 16 rows are then S2 words apart; rows of a whole [Dv][Lk2]
  // V^T would be Lk2 words apart, a multiple of 4 KiB at long lengths, and all fall into the same L1 set.) vt_rows,
  // Dv rounded up to 16, is also the forward's rows of O^T: O^T += V^T P^T runs on whole tiles, the pad rows zero.
  bool amx_tiles = false;
  static constexpr int64_t kPvTiles = 4;
  // (No longer than the keys rounded up to a key block: short keys would pack, zero and read slabs of mostly padding.)
  int64_t pv_keys() const { return amx_tiles ? std::min(kPvTiles * Bc, (Lk + Bc - 1) / Bc * Bc) : Bc; }
  int64_t num_pv_slabs() const { return (Lk + pv_keys() - 1) / pv_keys(); }
  // The forward's tasks on the amx build's bf16 products and on the float32 products (set by the driver where the
  // keys are longer than one pass, from the problem only): each takes q_blocks_per_task query blocks of one head,
  // and goes over the keys in passes of key_pass keys (a multiple of pv_keys() for the bf16 products, of Bc for the
  // float32 ones), every block of the task taking its turn on a pass, so that the pass's K and V (or their pairs)
  // are read from L2 by all of them. Each block computes what it computes alone: its key blocks (and P·V slabs) end
  // at the same keys.
  static constexpr int64_t kMaxQBlocksPerTask = 4;
  int64_t q_blocks_per_task = 1, key_pass = 0;
  int64_t num_q_tasks() const { return (num_q_blocks() + q_blocks_per_task - 1) / q_blocks_per_task; }
  // Forward task (b * Hq + h) * num_q_tasks + qt: query blocks [qb0, qb0 + count) of (b, h).
  struct QueryTask {
    int64_t b, h, qb0, count;
  };
  QueryTask query_task(int64_t task) const {
    const int64_t nqt = num_q_tasks(), bh = task / nqt, qb0 = task % nqt * q_blocks_per_task;
    return {bh / Hq, bh % Hq, qb0, std::min(q_blocks_per_task, num_q_blocks() - qb0)};
  }
  // Words of v_pairs per (b, kv head).
  int64_t vt_rows() const { return amx_tiles ? (Dv + 15) / 16 * 16 : Dv; }
  int64_t v_pairs_head_words() const {
    return amx_tiles ? num_pv_slabs() * (pv_keys() / 2) * vt_rows() : lk_pairs() * Dv;
  }
  // Words of kt_pairs per (b, kv head); the amx build holds K^T per key block as it holds V^T: [num_k_blocks][D]
  // [Bc/2], and computes all five backward products on tiles.
  int64_t kt_pairs_head_words() const { return amx_tiles ? num_k_blocks() * (Bc / 2) * D : lk_pairs() * D; }

  // Forward outputs.
  OutView4 out;  // [B, Hq, Lq, Dv]
  OutView4 lse;  // [B, Hq, Lq] (sd unused); data == nullptr when not wanted

  // Backward inputs/outputs.
  View4 dout, o;        // [B, Hq, Lq, Dv]
  View4 lse_in;         // [B, Hq, Lq]
  OutView4 dq, dk, dv;  // same shapes as q, k, v
  // The two-pass schedule's form of the additive mask's gradient, dense in the mask's own shape viewed as 4-D with
  // the strides below: a float buffer when every element receives one dS value, a double one when the mask is
  // broadcast (an element then sums up to B·Hq·Lq·Lk values). Exactly one of the two is set there when the gradient
  // is wanted.
  float* dmask = nullptr;
  double* dmask_sum = nullptr;
  int64_t dm_sb = 0, dm_sh = 0, dm_sl = 0, dm_sj = 0;
  // The one-pass backward's form of it: dS [B·Hq·Lq·Lk] of every score, written by the tasks (each element by one,
  // 0 where no tile is computed) and then summed into the mask's shape by the driver in a fixed order.
  float* dscores = nullptr;
  // dS goes to dscores with non-temporal stores (TransposeRows<true>): dscores is the caller's gradient (nothing
  // here reads it again) and larger than a core's second-level cache, so that its lines would only evict the tiles'.
  bool stream_dscores = false;
  // Or, for a mask [B or 1, Hq or 1, Lq, Lk] whose gradient is not written directly: partial sums of dS^T per chunk
  // of dm_chunk batches and kv head, in dmask_part [chunk][Hkv][dm_heads][Lk][dm_lqp] (keys along the rows, as the
  // tiles hold dS^T; dm_heads = group when the mask has heads, else 1; dm_lqp = Lq rounded up to Br). A task of the
  // one-pass backward covers one (chunk, kv head, key group), its batches in order: the first zeroes its part of the
  // chunk's sums and each adds its tiles into it; the driver then sums the chunks (and kv heads) in a fixed order.
  // dm_chunk depends on the problem only.
  float* dmask_part = nullptr;
  int64_t dm_chunk = 1, dm_heads = 1, dm_lqp = 0;
  int64_t num_dm_chunks() const { return (B + dm_chunk - 1) / dm_chunk; }
  float* mask_part(int64_t b, int64_t h) const {
    const int64_t hk = h / group, hm = dm_heads == 1 ? 0 : h % group;
    return dmask_part + (((b / dm_chunk) * Hkv + hk) * dm_heads + hm) * Lk * dm_lqp;
  }
  // Backward scratch shared by the passes (allocated by the driver): per (b, h, i) lse (+inf for empty rows)
  // and Di = rowsum(dO ∘ O). Rows whose float lse cannot carry log l (lse_needs_row_stats) get the row max m
  // in lse_eff and log l in row_log_sum, recomputed by row_stats_task, and P = exp((s − m) − log l); other rows
  // have row_log_sum 0. row_log_sum is nullptr when no row needs it; block_has_log_sum[t] (query block t, as
  // for the packed tiles) says whether block t has such a row.
  float* lse_eff = nullptr;
  float* delta = nullptr;
  float* row_log_sum = nullptr;
  const uint8_t* block_has_log_sum = nullptr;
  // NaN rows (lse NaN, or a NaN in q): as in the reference, their P and dS are NaN at every allowed key and 0 at
  // the others. The driver and pack_q_task mark them in nan_row [B·Hq·Lq] and block_has_nan_row (per query block
  // t) and give them lse_eff = +inf and Di = 0 (P = dS = 0); the tiles then set the allowed scores of those rows to
  // NaN, and pack_q_task zeroes their packed q. K rows with a NaN are zeroed in the products of the key blocks
  // marked in nan_key_block [(b·Hkv + hk)·num_k_blocks + kb] (nullptr when K has none): a NaN key then reaches
  // the gradients only through the rows that may attend to it, whose lse is NaN.
  uint8_t* nan_row = nullptr;
  uint8_t* block_has_nan_row = nullptr;
  const uint8_t* nan_key_block = nullptr;
  // Query-side tiles packed once per (b, h, q block) t = (b * Hq + h) * num_q_blocks + qb:
  // (scale Q)^T [D x Br], dO^T [Dv x Br], scale Q [Br x pad16(D)], dO [Br x pad16(Dv)]: in the call's buffers, one
  // tile per block, or, with pk_one_block (the one-pass backward with one key group), in a task's own buffers that
  // hold the one block it is computing (with its dQ partial), packed by backward_kvq_task itself. The bf16 pairs
  // (pk_qp, pk_dop, pk_qrp, pk_dorp) are placed the same way, in the call's buffers or in the task's.
  float *pk_qt = nullptr, *pk_dot = nullptr, *pk_qr = nullptr, *pk_dor = nullptr;
  bool pk_one_block = false;
  int64_t pk_slot(int64_t t) const { return pk_one_block ? 0 : t; }
  float* qt_tile(int64_t t) const { return pk_qt + pk_slot(t) * D * Br; }
  float* dot_tile(int64_t t) const { return pk_dot + pk_slot(t) * Dv * Br; }
  float* qr_tile(int64_t t) const { return pk_qr + pk_slot(t) * Br * pad16(D); }
  float* dor_tile(int64_t t) const { return pk_dor + pk_slot(t) * Br * pad16(Dv); }
  // (split_bf16: each holds its hi rows, then its lo rows)
  uint32_t* qp_tile(int64_t t) const { return pk_qp + pk_slot(t) * pair_parts() * k_pair_stride() * Br; }
  uint32_t* dop_tile(int64_t t) const { return pk_dop + pk_slot(t) * pair_parts() * dv_pair_stride() * Br; }
  uint32_t* qrp_tile(int64_t t) const { return pk_qrp + pk_slot(t) * pair_parts() * (Br / 2) * pad16(D); }
  uint32_t* dorp_tile(int64_t t) const { return pk_dorp + pk_slot(t) * pair_parts() * (Br / 2) * pad16(Dv); }
  float* dq_part_tile(int64_t t, int64_t g) const { return dq_part + (pk_slot(t) * num_kv_groups() + g) * D * Br; }
  // The one-pass backward (5 tile products instead of 7): a task covers kv_group consecutive key blocks of one
  // (b, kv head) and computes their dK, dV and, for every query block that sees them, a partial dQ^T [D x Br]
  // (unscaled) in dq_part [(b·Hq + h)·nqb + qb][g] (group g of key blocks); reduce_dq_task sums a block's
  // partials in g order. The groups depend on the problem only, so the results do not depend on the thread count.
  // kv_group 0: the two-pass schedule (dK/dV by key block, then dQ by query block).
  int64_t kv_group = 0;
  float* dq_part = nullptr;
  // With one key group (num_kv_groups() == 1) the (query head, query block) items of a kv head may be split into
  // q_chunks contiguous chunks, one task each (task = (b·Hkv + hk)·q_chunks + chunk), whose dK and dV are partial
  // sums in dkv_part [task][dK: Lk_blocks_rows() x pad16(D), then dV: Lk_blocks_rows() x pad16(Dv)], summed in
  // chunk order by reduce_kv_task. Like the groups, the chunks depend on the problem only.
  int64_t q_chunks = 1;
  float* dkv_part = nullptr;
  int64_t Lk_blocks_rows() const { return num_k_blocks() * Bc; }
  int64_t dkv_part_floats() const { return Lk_blocks_rows() * (pad16(D) + pad16(Dv)); }
  float* dkv_part_tile(int64_t task) const { return dkv_part + task * dkv_part_floats(); }
  int64_t num_kv_groups() const { return (num_k_blocks() + kv_group - 1) / kv_group; }
  // The first query block that can see key kb (causal: i >= kb - offset).
  int64_t first_q_block(int64_t kb) const { return causal ? std::max<int64_t>(0, (kb - causal_offset) / Br) : 0; }
  // Whether group g wrote a dQ partial for query block qb of batch b: its first key is not past key_len and,
  // causal, qb can see it.
  bool group_has_dq_part(int64_t b, int64_t g, int64_t qb) const {
    const int64_t kb = g * kv_group * Bc;
    return (!key_len || kb < key_len[b]) && qb >= first_q_block(kb);
  }

  static int64_t pad16(int64_t x) { return (x + 15) / 16 * 16; }

  int64_t num_q_blocks() const { return (Lq + Br - 1) / Br; }
  // The end of the keys that query rows [i0, i0 + nq) of batch b may attend: key lengths and causality.
  int64_t key_end(int64_t b, int64_t i0, int64_t nq) const {
    int64_t kend = Lk;
    if (key_len) kend = std::min(kend, key_len[b]);
    if (causal) kend = std::min(kend, i0 + nq - 1 + causal_offset + 1);
    return kend;
  }
  int64_t num_k_blocks() const { return (Lk + Bc - 1) / Bc; }
};

// The query rows per tile (Params::Br) for len_q queries and tiles of at most br rows (a multiple of 16): whole
// groups of `granule` rows (ForwardOps::query_granule), the queries split into as few and as even blocks as br
// allows (fused_kernel.cpp).
int64_t query_tile(int64_t len_q, int64_t br, int64_t granule);
// Params::Br unless SATTN_FUSED_BR sets the most rows: query_tile with at most 64 rows, or, without causality, 128
// or 256 where that computes at least 5 % fewer rows in at least min_blocks blocks (fused_kernel.cpp).
int64_t default_query_tile(int64_t len_q, bool causal, int64_t granule, int64_t min_blocks = 1);

// One SIMD implementation of the tile loops: the forward's (fused_simd.cpp) and the backward's
// (fused_backward_simd.cpp).
struct ForwardOps {
  // Forward of one (b, h, q block[, key chunk]) task: task = ((b * Hq + h) * num_q_blocks + qb) * chunks + c
  // (with decode_group: (b * Hkv + hk) * chunks + c; with q_blocks_per_task > 1 (never with chunks):
  // (b * Hq + h) * num_q_tasks + qt, query blocks [qt · q_blocks_per_task, +q_blocks_per_task)).
  void (*forward_task)(const Params& p, int64_t task);
  // Builds with bf16 products (nullptr elsewhere): fills k_pairs and v_pairs of one (b, kv head) task.
  void (*pack_kv_pairs)(const Params& p, int64_t task);
  bool amx_tiles = false;  // the amx build (Params::amx_tiles)
  // Rows [0, L) x [0, width) of (b, h) of t (unit element stride) as dense float32 rows [L x width] at out.
  void (*widen_rows)(const View4& t, int64_t b, int64_t h, int64_t L, int64_t width, float* out) = nullptr;
  // Params::Br is a multiple of it (the rows of a tile are whole vectors of queries): the build's float lanes, at
  // least 8; 16 in the builds with bf16 products (their pairs and tiles take 16 queries at a time).
  int64_t query_granule = 16;
  // Params::vt_blocks of one key block: task = (b * Hkv + hk) * num_k_blocks + kb, written at out + task·Dv·Bc.
  void (*pack_vt)(const Params& p, int64_t task, float* out) = nullptr;
};
struct BackwardOps {
  // Backward pass 1 (dK, dV) of one (b, hkv, k block) task: task = (b * Hkv + hk) * num_k_blocks + kb.
  void (*backward_kv_task)(const Params& p, int64_t task);
  // Backward pass 2 (dQ and dmask rows) of one (b, h, q block) task, same numbering as forward.
  void (*backward_q_task)(const Params& p, int64_t task);
  // One-pass backward (kv_group > 0) of one (b, hkv, key group[, query chunk]) task: task = ((b * Hkv + hk) *
  // num_kv_groups + g) * q_chunks + chunk. With Params::pk_one_block it packs each query block (pack_q_task,
  // row_stats_task) before its tiles and writes its dQ (reduce_dq_task) after them.
  void (*backward_kvq_task)(const Params& p, int64_t task);
  // dQ of one (b, h, q block) task of the one-pass backward: the sum of its partials.
  void (*reduce_dq_task)(const Params& p, int64_t task);
  // dK and dV of one (b, kv head) of the one-pass backward with query chunks: the sum of their partials.
  void (*reduce_kv_task)(const Params& p, int64_t task);
  // Fills the packed query-side tiles of one (b, h, q block) task.
  void (*pack_q_task)(const Params& p, int64_t task);
  // Backward: recomputes the row max m and log l of the rows of one (b, h, q block) task whose lse needs it
  // (into lse_eff and row_log_sum); needs the packed tiles.
  void (*row_stats_task)(const Params& p, int64_t task);
  // n floats of src rounded to dt (kBF16 or kF16) at dst, a vector at a time where the target can (StoreHalf).
  void (*store_half)(DType dt, uint16_t* dst, const float* src, int64_t n);
  // Builds with bf16 products (nullptr elsewhere): fills k_pairs and v_row_pairs of one (b, kv head) task.
  void (*pack_kv_pairs)(const Params& p, int64_t task);
  bool amx_tiles = false;  // the amx build (Params::amx_tiles)
};

// Whether a backward row needs its row max m and log l recomputed: float keeps lse = m + log l only to within
// |lse|·2^-24, and every P = exp(s − lse) of the row inherits that error. From |lse| = 2^10 on it is at least
// 2^-14 (up to 6e-5 relative in each P); with a huge finite bias on every key (−1e30, or the float minimum as
// "masked") log l is lost entirely and P would sum to the number of keys.
inline bool lse_needs_row_stats(float lse) {
  const float magnitude = std::fabs(lse);
  return magnitude >= 1024.f && magnitude <= 3.4028234663852886e38f;  // finite: empty rows have lse_eff = +inf
}

// Whether the bf16 products pay for their fixed costs per query tile at head dim D and Lk keys: from D·Lk = 2048 on,
// and for float16 as two bf16 (`halves`, the amx forward) past 4096 with D a multiple of 16; below, the float32
// products run (fused_kernel.cpp, docs/fused.md). SATTN_FUSED_TILE_MIN_WORK sets the least D·Lk for both.
bool bf16_products_pay(int64_t D, int64_t Lk, bool halves);
// Whether inputs of `dtype` take the bf16 products of a build that has them: bf16 always (exact operands), float32
// when Float32Precision::kBF16 allows rounding them; float16 not (bf16 holds 3 bits fewer), except in the forward of
// the amx build, which takes each float16 value as two bf16 (Params::split_bf16, decided in fused_forward; so does
// float32 under Float32Precision::kHigh).
bool takes_bf16_products(DType dtype, Float32Precision precision);
// Whether inputs of `dtype` take the amx forward's tiles as two bf16 each (Params::split_bf16, where the keys are
// long enough and the values allow it): float16, and float32 under Float32Precision::kHigh.
bool takes_split_bf16(DType dtype, Float32Precision precision);

// The builds of the tile loops for the selected SIMD target (simd/target.hpp), and its target's name.
const ForwardOps& forward_ops();
const BackwardOps& backward_ops();
const char* simd_build();

// Workspace accounting (bytes currently held by fused kernels and the high-water mark since the last reset).
void workspace_add(int64_t bytes);
int64_t workspace_peak_bytes();
void workspace_reset_peak();

}  // namespace sattn::fused
