// The fused kernel's registry entry and drivers: eligibility, parameters, the task split over threads.
// The tile loops themselves are in fused_simd.cpp (one copy per SIMD target).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "core/memory.hpp"
#include "core/threads.hpp"
#include "core/workspace.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/kernel.hpp"

namespace sattn {
namespace fused {
namespace {

// The forward's tasks where the problem allows: query tiles low enough for this many (make_params), query blocks
// grouped (Params::q_blocks_per_task) only down to it.
constexpr int64_t kMinTasks = 8;

int64_t env_tile(const char* name, int64_t fallback) {
  const int64_t v = env::get_integer(name, 16, 1024, fallback);
  check(v % 16 == 0, ErrorKind::kInvalidArgument, name, ": expected a multiple of 16 in [16, 1024], got ", v);
  return v;
}

}  // namespace

// The query rows of a tile: at most `br`, in as few blocks as `br` allows, each of whole groups of `granule` rows
// and as even as that allows: with granule 8, Lq = 20 takes one block of 24 and Lq = 96 two of 48, where blocks of
// 64 would compute 64 and 128 rows (the work of a tile follows Br, not the rows in it). A row's result does not
// depend on Br, except through the bf16 products' lazy max and P·V batches, which follow the whole query block: by
// rounding there.
int64_t query_tile(int64_t len_q, int64_t br, int64_t granule) {
  if (len_q <= granule) return granule;
  const int64_t blocks = (len_q + br - 1) / br, rows = (len_q + blocks - 1) / blocks;
  return std::min(br, (rows + granule - 1) / granule * granule);
}

// The default query tile: query_tile with blocks of at most 64 rows, or, without causality, of at most 128 or 256
// where that computes at least 5 % fewer rows (Lq = 197, a ViT's tokens: one block of 208 rows instead of four of
// 64, 256 rows; Lq = 65: one of 80 instead of two of 48). Short sequences otherwise compute up to a third more rows
// than they have; long ones keep 64 (larger blocks of S^T and O^T fall out of the first-level cache), and so do
// causal calls, whose smaller blocks skip more of the keys past the diagonal. A larger block is taken only if the
// queries still make at least min_blocks blocks: the caller asks for 8 tasks in all, so that a call of few heads
// keeps tasks for several threads. (Not the thread count itself: with the bf16 products a row's result depends on
// its block by rounding, and results must not depend on the thread count.)
int64_t default_query_tile(int64_t len_q, bool causal, int64_t granule, int64_t min_blocks) {
  const auto blocks = [len_q](int64_t br) { return (len_q + br - 1) / br; };
  int64_t best = query_tile(len_q, 64, granule);
  if (causal) return best;
  for (const int64_t most : {128, 256}) {
    const int64_t br = query_tile(len_q, most, granule);
    if (20 * blocks(br) * br <= 19 * blocks(best) * best && blocks(br) >= min_blocks) best = br;
  }
  return best;
}

// Measured on the AMX Xeon (docs/fused.md): below these sizes the float32 products (exact: rounding is allowed,
// never required) were faster, forward and backward, whatever Lq; the bf16 products' fixed costs per query tile (Q^T
// packed in pairs, O^T transposed back, the online softmax's per-tile steps) outweigh their cheaper products there.
// float16 as two bf16 takes four tile products per product, and a D not a multiple of 16 a padded pair chunk.
bool bf16_products_pay(int64_t D, int64_t Lk, bool halves) {
  const int64_t work = D * Lk;
  const long long forced = env::get_integer("SATTN_FUSED_TILE_MIN_WORK", 0, 1LL << 40, -1);
  if (forced >= 0) return work >= forced;
  return halves ? D % 16 == 0 && work > 4096 : work >= 2048;
}

bool takes_bf16_products(DType dtype, Float32Precision precision) {
  return dtype == DType::kBF16 || (dtype == DType::kF32 && precision == Float32Precision::kBF16);
}

bool takes_split_bf16(DType dtype, Float32Precision precision) {
  return dtype == DType::kF16 || (dtype == DType::kF32 && precision == Float32Precision::kHigh);
}

namespace {

View4 view4(const TensorView& t) {
  View4 v;
  v.data = t.data;
  v.dtype = t.dtype;
  if (t.dim() == 4) {
    v.sb = t.strides[0], v.sh = t.strides[1], v.sl = t.strides[2], v.sd = t.strides[3];
  } else if (t.dim() == 3) {  // lse [B, H, L]
    v.sb = t.strides[0], v.sh = t.strides[1], v.sl = t.strides[2];
  }
  return v;
}
OutView4 out_view4(const TensorView& t) {
  const View4 v = view4(t);
  return {t.data, t.dtype, v.sb, v.sh, v.sl, v.sd};
}

Params make_params(const AttentionProblem& pr, const TensorView& q, const TensorView& k, const TensorView& v,
                   const MaskData& m) {
  Params p;
  p.B = pr.batch, p.Hq = pr.heads_q, p.Hkv = pr.heads_kv, p.Lq = pr.len_q, p.Lk = pr.len_k;
  p.D = pr.head_dim, p.Dv = pr.head_dim_v, p.group = pr.group_size();
  p.q = view4(q), p.k = view4(k), p.v = view4(v);
  p.scale = float(pr.scale);
  p.causal = pr.causal != Causal::kNone;
  p.causal_offset = pr.causal_diagonal();
  p.mask = pr.mask;
  if (pr.mask != MaskKind::kNone) p.mask_view = view4(m.attn_mask);
  p.kp = m.key_padding, p.kp_sb = m.kp_stride_b, p.kp_sk = m.kp_stride_k;
  p.key_len = m.key_lengths.empty() ? nullptr : m.key_lengths.data();
  p.dropout_p = pr.dropout_p, p.seed = pr.seed;
  p.q_pos0 = pr.query_offset, p.k_pos0 = pr.key_offset, p.pos_stride = pr.position_stride;
  static const int64_t br = env_tile("SATTN_FUSED_BR", 0), bc = env_tile("SATTN_FUSED_BC", 64);
  const int64_t granule = forward_ops().query_granule;
  const int64_t heads = std::max<int64_t>(1, p.B * p.Hq), min_blocks = (kMinTasks + heads - 1) / heads;
  p.Br = br > 0 ? query_tile(pr.len_q, br, granule) : default_query_tile(pr.len_q, p.causal, granule, min_blocks);
  p.Bc = bc;
  return p;
}

// Counts `bytes` of scratch in the workspace accounting (workspace_peak_bytes, `sattn bench`'s ws_MiB) while it lives.
struct CountedBytes {
  int64_t bytes;
  explicit CountedBytes(int64_t n) : bytes(n) { workspace_add(bytes); }
  ~CountedBytes() { workspace_add(-bytes); }
  CountedBytes(const CountedBytes&) = delete;
  CountedBytes& operator=(const CountedBytes&) = delete;
};

// A workspace array of n floats (workspace_array; `what` names it in the out-of-memory error), counted while it
// lives.
struct CountedFloats {
  WorkspacePtr<float> data;
  CountedBytes counted;
  CountedFloats(size_t n, const char* what)
      : data(workspace_array<float>(n, what)), counted(int64_t(n * sizeof(float))) {}
  float* get() const { return data.get(); }
};

// Runs f(task) for every task on up to `threads` threads; rethrows the first exception on the caller.
template <typename F>
void run_tasks(int64_t n, int threads, F&& f) {
  std::exception_ptr error;
  std::mutex mu;
  parallel_for(n, threads, [&](int64_t t) {
    try {
      f(t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!error) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

// A dense float32 copy of a float32 K or V view [B, H, L, width] whose rows are not back to back, owned here.
// Views of a fused qkv projection ([B, L, 3, H, D] permuted) have their key rows 3·H·D floats apart: one head's keys
// then span 3·H times the memory pages, and every query block that re-reads them misses the TLB (the forward took
// 1.4x as long at L = 4096, H = 4, D = 64 on an AMD EPYC). One copy per call reads K and V once. Views that
// broadcast over batch or heads (a zero stride) are left as they are, and so is any other dtype (converted per tile).
struct DenseRows {
  WorkspacePtr<float> data;
  std::optional<CountedBytes> counted;

  // halves: bf16 and float16 rows too (widened once here instead of once per tile that reads them).
  void make(View4& t, int64_t B, int64_t H, int64_t L, int64_t width, int threads, bool halves) {
    const bool broadcast = (B > 1 && t.sb == 0) || (H > 1 && t.sh == 0);
    const bool half = t.dtype == DType::kBF16 || t.dtype == DType::kF16;
    const bool wanted = half ? halves && t.sd == 1 : t.dtype == DType::kF32 && !(t.sd == 1 && t.sl == width);
    if (broadcast || !wanted) return;
    const size_t n = static_cast<size_t>(B * H * L * width);
    if (n == 0) return;
    data = workspace_array<float>(n, "fused attention: dense key/value rows");
    counted.emplace(int64_t(n * sizeof(float)));
    const View4 src = t;
    float* dst = data.get();
    const auto widen = forward_ops().widen_rows;
    run_tasks(B * H, threads, [&](int64_t bh) {
      const int64_t b = bh / H, h = bh % H;
      if (half) return widen(src, b, h, L, width, dst + bh * L * width);
      for (int64_t j = 0; j < L; ++j) {
        const float* row = static_cast<const float*>(src.data) + b * src.sb + h * src.sh + j * src.sl;
        float* out = dst + (bh * L + j) * width;
        if (src.sd == 1) std::memcpy(out, row, sizeof(float) * size_t(width));
        else
          for (int64_t x = 0; x < width; ++x) out[x] = row[x * src.sd];
      }
    });
    t = View4{dst, DType::kF32, H * L * width, L * width, width, 1};
  }
};

// p.k and p.v as dense float32 rows (DenseRows) where they are read more than once: once per query block and head
// of a GQA group. The forward (past decode) and the backward both start with it. halves: where the float32 products
// read bf16 or float16 K and V (not where the bf16 products take them as pairs), widened once per call.
struct DenseKV {
  DenseRows k, v;
  // with_v false: K only (the float32 forward transposes V into Params::vt_blocks from its rows in place).
  DenseKV(Params& p, int threads, bool halves, bool with_v = true) {
    if (p.num_q_blocks() == 1 && p.group == 1) return;
    k.make(p.k, p.B, p.Hkv, p.Lk, p.D, threads, halves);
    if (with_v) v.make(p.v, p.B, p.Hkv, p.Lk, p.Dv, threads, halves);
  }
};

// Marks the key blocks (b, kv head, key block of Bc keys) whose K rows hold a NaN; empty when there is none.
std::vector<uint8_t> nan_key_blocks(const TensorView& k, const Params& p, int threads) {
  const int64_t nkb = p.num_k_blocks();
  std::vector<uint8_t> marks(size_t(p.B * p.Hkv * nkb), 0), any(size_t(p.B * p.Hkv), 0);
  run_tasks(p.B * p.Hkv, threads, [&](int64_t bhk) {
    const int64_t b = bhk / p.Hkv, hk = bhk % p.Hkv;
    for (int64_t j = 0; j < p.Lk; ++j) {
      bool nan = false;
      const int64_t first = b * p.k.sb + hk * p.k.sh + j * p.k.sl;
      if (p.k.dtype == DType::kF32 && p.k.sd == 1) {
        // NaN: above the infinity's bits, sign cleared (an integer OR that the compiler vectorises)
        const float* row = static_cast<const float*>(p.k.data) + first;
        uint32_t any_nan = 0;
        for (int64_t x = 0; x < p.D; ++x) {
          uint32_t bits;
          std::memcpy(&bits, row + x, sizeof bits);
          any_nan |= uint32_t((bits & 0x7FFFFFFFu) > 0x7F800000u);
        }
        nan |= any_nan != 0;
      } else if ((p.k.dtype == DType::kBF16 || p.k.dtype == DType::kF16) && p.k.sd == 1) {
        // NaN: exponent all ones and a nonzero mantissa (above 0x7F80 in bf16, 0x7C00 in float16)
        const auto* row = static_cast<const uint16_t*>(p.k.data) + first;
        const uint16_t inf = p.k.dtype == DType::kBF16 ? 0x7F80u : 0x7C00u;
        uint16_t any_nan = 0;  // an integer OR that the compiler vectorises
        for (int64_t x = 0; x < p.D; ++x) any_nan |= uint16_t((row[x] & 0x7FFFu) > inf);
        nan |= any_nan != 0;
      } else {
        for (int64_t x = 0; x < p.D; ++x) {
          const int64_t idx[4] = {b, hk, j, x};
          nan |= std::isnan(k.get(idx));
        }
      }
      if (nan) marks[size_t(bhk * nkb + j / p.Bc)] = any[size_t(bhk)] = 1;
    }
  });
  if (std::find(any.begin(), any.end(), 1) == any.end()) marks.clear();
  return marks;
}

bool fused_supports(const AttentionProblem& p, std::string* why) {
  auto no = [&](const char* reason) {
    if (why) *why = reason;
    return false;
  };
  if (p.dtype_q == DType::kF64)
    return no("float64 inputs: the fused kernel computes in float32 (the reference accumulates in float64)");
  if (p.dtype_q != DType::kF32 && p.dtype_q != DType::kBF16 && p.dtype_q != DType::kF16)
    return no("unsupported input dtype");
  if (p.need_weights)
    return no("attention weights requested: the fused kernel never materialises the [B, Hq, Lq, Lk] weights");
  return true;
}

// Decode (few queries, many keys): the keys are split into chunks of this many keys (rounded up to whole key
// tiles) — a function of the problem only, never of the thread count — and the partials merged in chunk order.
constexpr int64_t kDecodeMaxQueries = 16, kDecodeChunk = 512;
// The amx forward's passes over the keys (Params::key_pass): slabs of P·V per pass.
constexpr int64_t kAmxKeyPassBlocks = 4;

// The float32 products' passes over the keys: whole key blocks of about 256 KiB of float32 K and V rows (256 keys at
// D = 128, 512 at 64), which the query blocks of a task then read from L2 (at L = 4096 a head's K and V take 4 MiB
// at D = 128, more than a core's L2). Found by measurement (docs/fused.md): 128 to 1024 keys ran alike.
int64_t float_key_pass(const Params& p) {
  const int64_t key_bytes = (p.D + p.Dv) * int64_t(sizeof(float));
  return std::max<int64_t>(1, (int64_t(256) << 10) / key_bytes / p.Bc) * p.Bc;
}

void decode_forward(const ForwardArgs& a, Params& p, const ForwardOps& o) {
  p.kv_chunk = (kDecodeChunk + p.Bc - 1) / p.Bc * p.Bc;
  const int64_t C = p.num_kv_chunks(), rows = p.B * p.Hq * p.Lq;
  std::vector<float> part_o(static_cast<size_t>(rows * C * p.Dv)), part_max(static_cast<size_t>(rows * C)),
      part_sum(static_cast<size_t>(rows * C));
  const int64_t bytes = int64_t((part_o.size() + part_max.size() + part_sum.size()) * sizeof(float));
  const CountedBytes counted(bytes);
  p.part_o = part_o.data(), p.part_max = part_max.data(), p.part_sum = part_sum.data();
  const int64_t n = (p.decode_group ? p.B * p.Hkv : p.B * p.Hq * p.num_q_blocks()) * C;
  run_tasks(n, a.num_threads, [&](int64_t t) { o.forward_task(p, t); });
  // The online softmax across chunks: m = max_c m_c, w_c = l_c e^(m_c − m), l = Σ_c w_c, out = Σ_c (w_c / l) out_c,
  // lse = m + log l (empty chunks have m_c = −inf, l_c = 0; a chunk with a NaN score has l_c = NaN: a NaN row).
  constexpr float kNegInf = -std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();
  run_tasks(p.B * p.Hq, a.num_threads, [&](int64_t bh) {
    std::vector<float> acc(static_cast<size_t>(p.Dv)), w(static_cast<size_t>(C));
    for (int64_t i = 0; i < p.Lq; ++i) {
      const int64_t row = bh * p.Lq + i;
      const float* mc = part_max.data() + row * C;
      const float* lc = part_sum.data() + row * C;
      float m = kNegInf;
      bool nan = false;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, mc[c]), nan |= std::isnan(lc[c]);
      std::fill(acc.begin(), acc.end(), nan ? kNaN : 0.f);
      float l = nan ? kNaN : 0.f;
      if (m != kNegInf && !nan) {
        for (int64_t c = 0; c < C; ++c) {
          w[size_t(c)] = mc[c] == kNegInf ? 0.f : lc[c] * std::exp(mc[c] - m);
          l += w[size_t(c)];
        }
        for (int64_t c = 0; c < C; ++c) {
          const float wc = w[size_t(c)] / l;
          if (wc == 0.f) continue;
          const float* po = part_o.data() + (row * C + c) * p.Dv;
          for (int64_t x = 0; x < p.Dv; ++x) acc[size_t(x)] += wc * po[x];
        }
      }
      const int64_t b = bh / p.Hq, h = bh % p.Hq;
      for (int64_t x = 0; x < p.Dv; ++x) {
        const int64_t idx[4] = {b, h, i, x};
        a.outputs.out.set(idx, acc[size_t(x)]);
      }
      if (a.outputs.lse.data) {
        const int64_t idx[3] = {b, h, i};
        a.outputs.lse.set(idx, m == kNegInf && !nan ? -HUGE_VAL : double(m + std::log(l)));
      }
    }
  });
}

// Whether a view holds a value that two bf16 parts cannot carry (Params::split_bf16): for float16 an infinity
// (+-inf: exponent all ones, mantissa zero; inf · 0 between the parts would make a NaN), for float32 also NaN and
// the finite values that round to bf16's infinity (magnitude bits from 0x7F7F8000 on). Tasks per (b, head), any order.
bool has_unsplittable(const View4& t, int64_t B, int64_t H, int64_t L, int64_t width, int threads) {
  std::atomic<bool> found{false};
  run_tasks(B * H, threads, [&](int64_t task) {
    const int64_t b = task / H, h = task % H;
    uint32_t bad = 0;  // an integer OR that the compiler vectorises
    const auto scan = [&](const auto* data, auto is_bad) {
      for (int64_t j = 0; j < L; ++j) {
        const auto* row = data + b * t.sb + h * t.sh + j * t.sl;
        if (t.sd == 1)
          for (int64_t x = 0; x < width; ++x) bad |= uint32_t(is_bad(row[x]));
        else
          for (int64_t x = 0; x < width; ++x) bad |= uint32_t(is_bad(row[x * t.sd]));
      }
    };
    if (t.dtype == DType::kF16)
      scan(static_cast<const uint16_t*>(t.data), [](uint16_t w) { return (w & 0x7FFFu) == 0x7C00u; });
    else scan(static_cast<const uint32_t*>(t.data), [](uint32_t w) { return (w & 0x7FFFFFFFu) >= 0x7F7F8000u; });
    if (bad) found = true;
  });
  return found;
}

// Whether q, k and v hold no value that two bf16 parts cannot carry (has_unsplittable).
bool qkv_splittable(const Params& p, int threads) {
  return !has_unsplittable(p.q, p.B, p.Hq, p.Lq, p.D, threads) &&
         !has_unsplittable(p.k, p.B, p.Hkv, p.Lk, p.D, threads) &&
         !has_unsplittable(p.v, p.B, p.Hkv, p.Lk, p.Dv, threads);
}

// A row of Lk bool flags (one byte each, `step` apart): the length of its run of `valid` flags from key 0 when every
// later flag is the other value, else -1 (a valid key after an invalid one).
int64_t valid_run(const uint8_t* row, int64_t step, int64_t len_k, bool valid) {
  int64_t n = 0;
  while (n < len_k && (row[n * step] != 0) == valid) ++n;
  for (int64_t j = n; j < len_k; ++j)
    if ((row[j * step] != 0) == valid) return -1;
  return n;
}

// Padding given as a mask, as key lengths, so that the tiles past a length are skipped instead of masked element by
// element: a bool key_padding_mask (True = padding) whose rows pad a run of keys at the end, or, with no key padding,
// a bool attn_mask that only pads keys — the same for every head and query, each batch row's allowed keys a run from
// key 0, as a transformer's padding mask [B, 1, 1, Lk]. Empty when the masks are not of that kind. O(B·Lk) reads.
std::vector<int64_t> padding_mask_lengths(const Params& p) {
  if (p.key_len) return {};
  const bool padding = p.kp && p.mask == MaskKind::kNone;
  const View4& m = p.mask_view;
  const bool mask = !p.kp && p.mask == MaskKind::kBool && (m.sh == 0 || p.Hq == 1) && (m.sl == 0 || p.Lq == 1);
  if (!padding && !mask) return {};
  std::vector<int64_t> lengths(static_cast<size_t>(p.B));
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t n = padding ? valid_run(p.kp + b * p.kp_sb, p.kp_sk, p.Lk, false)
                              : valid_run(static_cast<const uint8_t*>(m.data) + b * m.sb, m.sd, p.Lk, true);
    if (n < 0) return {};
    lengths[static_cast<size_t>(b)] = n;
  }
  return lengths;
}

// An output the call writes whole: huge pages for its first writes where it is large (advise_huge_pages). A bias's
// gradient [1, 8, 1024, 1024] in a fresh torch tensor took 8192 page faults, 10 ms of a 66 ms backward (Zen 4).
void advise_output(const TensorView& t) {
  if (t.data && t.is_contiguous()) advise_huge_pages(t.data, t.numel() * int64_t(dtype_size(t.dtype)));
}

// Params for the call, with padding given as a mask taken as key lengths (stored in `lengths`, which must outlive
// the Params).
Params call_params(const AttentionProblem& pr, const TensorView& q, const TensorView& k, const TensorView& v,
                   const MaskData& m, std::vector<int64_t>& lengths) {
  Params p = make_params(pr, q, k, v, m);
  lengths = padding_mask_lengths(p);
  if (!lengths.empty()) {
    p.mask = MaskKind::kNone;
    p.mask_view = {};
    p.kp = nullptr;
    p.key_len = lengths.data();
  }
  return p;
}

void fused_forward(const ForwardArgs& a) {
  advise_output(a.outputs.out);
  std::vector<int64_t> mask_lengths;
  Params p = call_params(a.problem, a.q, a.k, a.v, a.masks, mask_lengths);
  p.out = out_view4(a.outputs.out);
  if (a.outputs.lse.data) p.lse = out_view4(a.outputs.lse);
  const ForwardOps& o = forward_ops();
  p.decode_group = p.group > 1 && p.group * p.Lq <= 4;
  if (p.Lq <= kDecodeMaxQueries && p.Lk >= 2 * kDecodeChunk) return decode_forward(a, p, o);
  if (p.decode_group) {
    run_tasks(p.B * p.Hkv, a.num_threads, [&](int64_t t) { o.forward_task(p, t); });
    return;
  }
  p.amx_tiles = o.amx_tiles;
  // float16, and float32 under kHigh, as two bf16 each on the tiles, unless an input holds a value the parts cannot
  // carry
  p.split_bf16 = o.amx_tiles && takes_split_bf16(p.q.dtype, a.options.float32_precision) && p.Lq > kDecodeRows &&
                 bf16_products_pay(p.D, p.Lk, true) && qkv_splittable(p, a.num_threads);
  const bool bf16_products =
      o.pack_kv_pairs && p.Lq > kDecodeRows &&
      ((takes_bf16_products(p.q.dtype, a.options.float32_precision) && bf16_products_pay(p.D, p.Lk, false)) ||
       p.split_bf16);
  // The float32 products: V^T per key block (Params::vt_blocks) where a kv head's V is read by at least 4 query
  // blocks (the transposition reads and writes V once, in place of the dense copy a strided or half-precision V
  // would get; every reading block's P·V product then reads V^T along rows).
  const bool vt = !bf16_products && p.Lq > kDecodeRows && p.group * p.num_q_blocks() >= 4 && o.pack_vt;
  std::optional<DenseKV> dense_kv;  // the bf16 products read K and V once, into pairs: no dense copy first
  if (!bf16_products) dense_kv.emplace(p, a.num_threads, true, !vt);
  WorkspacePtr<float> vt_blocks;
  std::optional<CountedBytes> counted_vt;
  if (vt) {
    const int64_t blocks = p.B * p.Hkv * p.num_k_blocks(), n = blocks * p.Dv * p.Bc;
    vt_blocks = workspace_array<float>(size_t(n), "fused attention: V^T per key block");
    counted_vt.emplace(int64_t(n * sizeof(float)));
    run_tasks(blocks, a.num_threads, [&](int64_t t) { o.pack_vt(p, t, vt_blocks.get()); });
    p.vt_blocks = vt_blocks.get();
  }
  // bf16 products (a build that has them; bf16 inputs, or float32 ones when allowed): K and V as bf16 pairs, once.
  WorkspacePtr<uint32_t> kv_pairs;  // every word written by pack_kv_pairs (padding included)
  std::optional<CountedBytes> counted_pairs;
  // P rounded to bf16 once for P·V where rounding is allowed, or where the inputs and the output are bf16 (the
  // output's own rounding is of the same size); else as two bf16 parts, to float32 accuracy.
  p.round_p = !p.split_bf16 && (a.options.float32_precision == Float32Precision::kBF16 ||
                                (p.q.dtype == DType::kBF16 && p.out.dtype == DType::kBF16));
  if (bf16_products) {
    const int64_t k_words = p.B * p.Hkv * p.Lk * p.k_pair_stride(), v_words = p.B * p.Hkv * p.v_pairs_head_words();
    const int64_t parts = p.split_bf16 ? 2 : 1;  // the remainders after the rounded values
    kv_pairs = workspace_array<uint32_t>(size_t(parts * (k_words + v_words)), "fused attention: K and V as bf16 pairs");
    counted_pairs.emplace(int64_t(parts * (k_words + v_words) * sizeof(uint32_t)));
    p.k_pairs = kv_pairs.get(), p.v_pairs = p.k_pairs + parts * k_words;
    if (p.split_bf16) p.k_lo_words = k_words, p.v_lo_words = v_words;
    run_tasks(p.B * p.Hkv, a.num_threads, [&](int64_t t) { o.pack_kv_pairs(p, t); });
  }
  // Passes over long keys (Params::key_pass), functions of the problem only (every block computes the same whatever
  // the grouping), grouping query blocks down to at least kMinTasks tasks.
  const int64_t pass = bf16_products ? (p.amx_tiles ? kAmxKeyPassBlocks * p.pv_keys() : 0) : float_key_pass(p);
  if (pass > 0 && p.Lk > pass) {
    p.key_pass = pass;
    p.q_blocks_per_task = std::clamp<int64_t>(p.B * p.Hq * p.num_q_blocks() / kMinTasks, 1,
                                              std::min(Params::kMaxQBlocksPerTask, p.num_q_blocks()));
  }
  const int64_t n = p.B * p.Hq * p.num_q_tasks();
  // Causal: the last query blocks are the most expensive; start them first (order does not change results).
  const bool reverse = p.causal;
  run_tasks(n, a.num_threads, [&](int64_t t) { o.forward_task(p, reverse ? n - 1 - t : t); });
}

// Key blocks per task of the one-pass backward, from the problem's sizes only (never the thread count). Every key
// block in one group where their dK and dV accumulators take at most 1 MiB (they stay in a core's L2 while the
// query blocks pass; the tasks' parallelism then comes from query chunks, query_chunks). Otherwise enough groups for
// 32 tasks where the problem has them, at most 1 MiB of accumulators per group (more groups cost more partial dQ
// copies), and the partial dQ tiles (one float copy of dQ per group) within 256 MiB or 4 copies, whichever allows
// more.
int64_t kv_group_size(const Params& p) {
  const int64_t nkb = p.num_k_blocks();
  const int64_t block_bytes = p.Bc * (Params::pad16(p.D) + Params::pad16(p.Dv)) * int64_t(sizeof(float));
  const int64_t max_group = std::max<int64_t>(1, (int64_t(1024) << 10) / block_bytes);
  if (nkb <= max_group) return nkb;
  int64_t group = std::clamp<int64_t>(p.B * p.Hkv * nkb / 32, 1, max_group);
  const int64_t copy_bytes = p.B * p.Hq * p.num_q_blocks() * p.Br * p.D * int64_t(sizeof(float));
  const int64_t max_groups = std::max<int64_t>(4, (int64_t(256) << 20) / std::max<int64_t>(copy_bytes, 1));
  while ((nkb + group - 1) / group > max_groups) ++group;
  return std::min(group, nkb);
}

// Query chunks of the one-pass backward with one key group (Params::q_chunks), from the problem's sizes only:
// enough for 32 tasks where each chunk keeps at least 4 query blocks (each chunk adds a partial copy of dK and dV,
// summed by reduce_kv_task). Not with a mask's gradient, whose chunk sums and dS rows the tasks write.
int64_t query_chunks(const Params& p) {
  if (p.num_kv_groups() != 1) return 1;
  const int64_t heads = p.B * p.Hkv, items = p.group * p.num_q_blocks();
  return std::clamp<int64_t>((32 + heads - 1) / heads, 1, std::max<int64_t>(1, items / 4));
}

// Packs the query-side tiles of every query block (pack_q_task), then recomputes the row statistics of the blocks
// that need them (row_stats_task): the steps before the backward's products.
void prepare_query_blocks(const Params& p, const BackwardOps& o, int threads) {
  const int64_t nqt = p.B * p.Hq * p.num_q_blocks();
  run_tasks(nqt, threads, [&](int64_t t) { o.pack_q_task(p, t); });
  std::vector<int64_t> stats_blocks;
  for (int64_t t = 0; t < nqt; ++t)
    if (p.block_has_log_sum[size_t(t)]) stats_blocks.push_back(t);
  run_tasks(int64_t(stats_blocks.size()), threads, [&](int64_t x) { o.row_stats_task(p, stats_blocks[size_t(x)]); });
}

// The floats of the packed query tiles (Params::pk_qt, pk_dot, pk_qr, pk_dor) of `blocks` query blocks.
int64_t query_tile_floats(const Params& p, int64_t blocks) {
  return blocks * p.Br * (p.D + p.Dv + Params::pad16(p.D) + Params::pad16(p.Dv));
}

// Points the packed query tiles of p at `base`, laid out for `blocks` query blocks (query_tile_floats of them).
void place_query_tiles(Params& p, float* base, int64_t blocks) {
  p.pk_qt = base;
  p.pk_dot = p.pk_qt + blocks * p.D * p.Br;
  p.pk_qr = p.pk_dot + blocks * p.Dv * p.Br;
  p.pk_dor = p.pk_qr + blocks * p.Br * Params::pad16(p.D);
}

// The words of the bf16 query tiles (Params::pk_qp, pk_dop, pk_qrp, pk_dorp) of `blocks` query blocks: Q^T pairs,
// dO^T pairs (Params::dout_pairs) and, with round_grads or split_grads, the row pairs of Q and dO.
int64_t query_pair_words(const Params& p, int64_t blocks) {
  const int64_t rows = p.grad_pairs() ? p.pair_parts() * (p.Br / 2) * (Params::pad16(p.D) + Params::pad16(p.Dv)) : 0;
  return blocks * (p.pair_parts() * p.Br * (p.k_pair_stride() + (p.dout_pairs ? p.dv_pair_stride() : 0)) + rows);
}

// Points the bf16 query tiles of p at `base`, laid out for `blocks` query blocks (query_pair_words of them).
void place_query_pairs(Params& p, uint32_t* base, int64_t blocks) {
  p.pk_qp = base;
  uint32_t* next = p.pk_qp + blocks * p.pair_parts() * p.Br * p.k_pair_stride();
  if (p.dout_pairs) p.pk_dop = next, next += blocks * p.pair_parts() * p.Br * p.dv_pair_stride();
  if (p.grad_pairs()) {
    p.pk_qrp = next;
    p.pk_dorp = p.pk_qrp + blocks * p.pair_parts() * (p.Br / 2) * Params::pad16(p.D);
  }
}

// The backward's one pass over key groups and the sums of the partial dQ tiles (see Params). With one key group
// per (b, kv head) (kv_group_size), one task per (b, kv head, query chunk) packs a query block into buffers of its
// own, runs the block's tiles and writes its dQ at once (Params::pk_one_block), while the block is in its core's
// cache (packing every block first streamed all of them through memory twice, which cost short keys a good part of
// their time); then the chunks' partial dK and dV are summed (reduce_kv_task). Otherwise packing comes first, for
// all query blocks, and the groups' partial dQ are summed last.
void one_pass_backward(Params& p, const BackwardOps& o, int threads) {
  const int64_t ng = p.num_kv_groups(), nqb = p.num_q_blocks(), nqt = p.B * p.Hq * nqb, nc = p.num_dm_chunks();
  // Tasks: (batch chunk, kv head[, key group]), the chunk's batches in order (chunks of one batch without
  // dmask_part).
  const auto chunk_batches = [&p](int64_t c) { return std::pair(c * p.dm_chunk, std::min(p.B, (c + 1) * p.dm_chunk)); };
  if (ng == 1) {
    // one block's tiles, its dQ partial and, with bf16 products, its bf16 tiles (words of the same size as floats)
    const int64_t pair_words = p.k_pairs ? query_pair_words(p, 1) : 0;
    const int64_t floats = query_tile_floats(p, 1) + p.D * p.Br + pair_words;
    const int64_t qcs = p.q_chunks;  // > 1 only without dmask_part (nc = B)
    const CountedFloats kv_part(size_t(qcs > 1 ? p.B * p.Hkv * qcs * p.dkv_part_floats() : 0),
                                "fused attention backward: the partial dK and dV");
    p.dkv_part = kv_part.get();
    run_tasks(nc * p.Hkv * qcs, threads, [&](int64_t x) {
      const int64_t ch = x / qcs, qc = x % qcs, c = ch / p.Hkv, hk = ch % p.Hkv;
      Params tp = p;
      // 64-byte aligned: the tiles are loaded with aligned vector loads
      const ScratchPtr<float> own =
          scratch_array<float>(size_t(floats), "fused attention backward: a task's query tiles");
      const CountedBytes counted_own(floats * int64_t(sizeof(float)));
      tp.pk_one_block = true;
      place_query_tiles(tp, own.get(), 1);
      tp.dq_part = own.get() + query_tile_floats(p, 1);
      if (pair_words > 0) place_query_pairs(tp, reinterpret_cast<uint32_t*>(tp.dq_part + p.D * p.Br), 1);
      const auto [b0, b1] = chunk_batches(c);
      for (int64_t b = b0; b < b1; ++b) o.backward_kvq_task(tp, (b * p.Hkv + hk) * qcs + qc);
    });
    if (qcs > 1) run_tasks(p.B * p.Hkv, threads, [&](int64_t t) { o.reduce_kv_task(p, t); });
    return;
  }
  const CountedFloats part(size_t(nqt * ng * p.D * p.Br), "fused attention backward: the partial dQ tiles");
  p.dq_part = part.get();
  prepare_query_blocks(p, o, threads);
  run_tasks(nc * p.Hkv * ng, threads, [&](int64_t t) {
    const int64_t c = t / (p.Hkv * ng), hk = t / ng % p.Hkv, g = t % ng;
    const auto [b0, b1] = chunk_batches(c);
    for (int64_t b = b0; b < b1; ++b) o.backward_kvq_task(p, (b * p.Hkv + hk) * ng + g);
  });
  run_tasks(nqt, threads, [&](int64_t t) { o.reduce_dq_task(p, t); });
}

// The additive mask's gradient from the one-pass backward's dS (Params::dscores): each element of the mask the
// sum, in double and in (b, h, i, j) order, of the dS of the scores it was added to, stored in the mask's dtype.
// One task per row of the mask and run of up to 256 of its columns, so the sums do not depend on the thread count.
void store_mask_gradient(const Params& p, const int64_t (&m4)[4], size_t off, const TensorView& dmask, int threads) {
  const int64_t full[3] = {p.B, p.Hq, p.Lq};
  constexpr int64_t kRun = 256;
  const int64_t runs = (m4[3] + kRun - 1) / kRun;
  run_tasks(m4[0] * m4[1] * m4[2] * runs, threads, [&](int64_t task) {
    const int64_t r = task / runs, j0 = task % runs * kRun, j1 = std::min(m4[3], j0 + kRun);
    const int64_t idx[3] = {r / (m4[1] * m4[2]), r / m4[2] % m4[1], r % m4[2]};
    int64_t lo[3], hi[3];  // the (b, h, i) this mask row was added to: all of a broadcast dimension
    for (int x = 0; x < 3; ++x) {
      lo[x] = m4[x] == 1 ? 0 : idx[x];
      hi[x] = m4[x] == 1 ? full[x] : idx[x] + 1;
    }
    double acc[kRun];  // columns j0 … j1 − 1
    std::fill(acc, acc + (j1 - j0), 0.0);
    for (int64_t b = lo[0]; b < hi[0]; ++b)
      for (int64_t h = lo[1]; h < hi[1]; ++h)
        for (int64_t i = lo[2]; i < hi[2]; ++i) {
          const float* ds = p.dscores + ((b * p.Hq + h) * p.Lq + i) * p.Lk;
          if (m4[3] == 1) {  // a mask broadcast over the keys
            double row = 0.0;
            for (int64_t j = 0; j < p.Lk; ++j) row += double(ds[j]);
            acc[0] += row;
          } else {
            for (int64_t j = j0; j < j1; ++j) acc[j - j0] += double(ds[j]);
          }
        }
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t at[4] = {idx[0], idx[1], idx[2], j};
      dmask.set(at + off, acc[j - j0]);  // the mask's own dimensions, in its dtype
    }
  });
}

// Plans the one-pass backward's mask gradient as chunk sums (Params::dmask_part) for a mask [B or 1, Hq or 1, Lq,
// Lk] (as 4-D, m4): a mask shared by the batch is summed in chunks of up to 8 batches (fewer where there would be
// fewer than 64 tasks; up to 32 where the sums of smaller chunks would pass `limit`), each chunk's dS in float, the
// chunks in double. False (nothing set) for other shapes or when the sums would pass `limit` bytes.
bool plan_mask_chunks(Params& p, const int64_t (&m4)[4], double limit) {
  if (m4[2] != p.Lq || m4[3] != p.Lk || (m4[0] != 1 && m4[0] != p.B) || (m4[1] != 1 && m4[1] != p.Hq)) return false;
  const int64_t heads = m4[1] == p.Hq ? p.group : 1, lqp = p.num_q_blocks() * p.Br;
  const auto bytes = [&](int64_t chunk) {
    return double((p.B + chunk - 1) / chunk) * double(p.Hkv * heads * p.Lk * lqp) * sizeof(float);
  };
  int64_t chunk = 1;
  if (m4[0] != p.B) {
    const int64_t most = std::min<int64_t>(p.B, 32);
    chunk = std::clamp<int64_t>(p.B * p.Hkv * p.num_kv_groups() / 64, 1, std::min<int64_t>(p.B, 8));
    while (bytes(chunk) > limit && chunk < most) chunk = std::min(most, 2 * chunk);
  }
  if (bytes(chunk) > limit) return false;
  p.dm_chunk = chunk, p.dm_heads = heads, p.dm_lqp = lqp;
  return true;
}

// The largest buffer the one-pass backward takes for the mask's gradient (chunk sums or dS, and never more than the
// call's memory limit for L x L buffers); past it, the two-pass schedule, which sums dS into the mask's shape as it
// goes.
constexpr double kMaxScoreBytes = double(int64_t(256) << 20);
// From this size on, a mask gradient written directly goes around the caches (Params::stream_dscores): about the
// second-level cache of one core on current x86 (1 MiB on Zen 4, 2 MiB on Sapphire Rapids).
constexpr int64_t kStreamScoreBytes = int64_t(1) << 20;

// The backward's schedule and how it computes the additive mask's gradient (docs/fused.md).
enum class MaskGradient {
  kNone,       // one pass, no mask gradient wanted
  kDirect,     // one pass, dS written into the gradient (Params::dscores)
  kChunkSums,  // one pass, dS summed per chunk of batches (Params::dmask_part), then into the gradient
  kScores,     // one pass, dS into a buffer of every score (Params::dscores), then summed into the gradient
  kTwoPass,    // two passes
};

// One pass (setting p.kv_group, and p.dm_* for chunk sums) unless the mask's gradient would need a buffer past
// kMaxScoreBytes or the memory limit. SATTN_FUSED_BACKWARD=one_pass / two_pass forces a schedule (for tests and
// measurements).
MaskGradient plan_backward(Params& p, const AttentionProblem& pr, const TensorView& dmask, const int64_t (&m4)[4],
                           const AttentionOptions& options) {
  const std::string form = env::get("SATTN_FUSED_BACKWARD").value_or("auto");
  check(form == "auto" || form == "one_pass" || form == "two_pass", ErrorKind::kInvalidArgument,
        "SATTN_FUSED_BACKWARD: expected auto, one_pass or two_pass, got '", form, "'");
  if (form == "two_pass") return MaskGradient::kTwoPass;
  p.kv_group = kv_group_size(p);
  if (!pr.need_dmask) {
    p.q_chunks = query_chunks(p);
    return MaskGradient::kNone;
  }
  if (numel(pr.mask_shape) == p.B * p.Hq * p.Lq * p.Lk && dmask.dtype == DType::kF32 && dmask.is_contiguous())
    return MaskGradient::kDirect;
  const double limit =
      form == "one_pass" ? HUGE_VAL : std::min(kMaxScoreBytes, double(memory_limit_bytes(options.memory_limit_bytes)));
  if (plan_mask_chunks(p, m4, limit)) return MaskGradient::kChunkSums;
  if (pr.score_matrix_bytes(sizeof(float)) <= limit) return MaskGradient::kScores;
  p.kv_group = 0;
  return MaskGradient::kTwoPass;
}

// The mask's gradient from the chunk sums: element (mb, mh, i, j) the sum, in double, over the chunks of its batches
// (batch mb's alone when the mask has a batch dimension) and the kv heads of its heads, in that order; stored in the
// mask's dtype. One task per (mb, mh), so the sums do not depend on the thread count.
void store_mask_chunks(const Params& p, const int64_t (&m4)[4], size_t off, const TensorView& dmask, int threads) {
  const bool has_b = m4[0] == p.B && p.B > 1, has_h = m4[1] == p.Hq && p.Hq > 1;
  float* dense = dmask.dtype == DType::kF32 && dmask.is_contiguous() ? dmask.ptr<float>() : nullptr;
  run_tasks(m4[0] * m4[1], threads, [&](int64_t task) {
    const int64_t mb = task / m4[1], mh = task % m4[1];
    const int64_t c0 = has_b ? mb : 0, c1 = has_b ? mb + 1 : p.num_dm_chunks();
    const int64_t hk0 = has_h ? mh / p.group : 0, hk1 = has_h ? hk0 + 1 : p.Hkv;
    // Tiles of 64 rows x 16 columns of the gradient: the sums read runs of 64 floats of the chunks' rows (keys) and
    // the gradient's rows are written 16 floats (a cache line) at a time.
    constexpr int64_t kRows = 64, kCols = 16;
    double acc[kCols][kRows];
    for (int64_t i0 = 0; i0 < p.Lq; i0 += kRows)
      for (int64_t j0 = 0; j0 < p.Lk; j0 += kCols) {
        const int64_t ni = std::min(kRows, p.Lq - i0), nj = std::min(kCols, p.Lk - j0);
        for (int64_t jj = 0; jj < nj; ++jj) std::fill(acc[jj], acc[jj] + ni, 0.0);
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t hk = hk0; hk < hk1; ++hk) {
            const float* src = p.mask_part(c * p.dm_chunk, has_h ? mh : hk * p.group) + j0 * p.dm_lqp + i0;
            for (int64_t jj = 0; jj < nj; ++jj)
              for (int64_t ii = 0; ii < ni; ++ii) acc[jj][ii] += double(src[jj * p.dm_lqp + ii]);
          }
        for (int64_t ii = 0; ii < ni; ++ii)
          for (int64_t jj = 0; jj < nj; ++jj) {
            if (dense) {
              dense[((mb * m4[1] + mh) * p.Lq + i0 + ii) * p.Lk + j0 + jj] = float(acc[jj][ii]);
            } else {
              const int64_t at[4] = {mb, mh, i0 + ii, j0 + jj};
              dmask.set(at + off, acc[jj][ii]);  // the mask's own dimensions, in its dtype
            }
          }
      }
  });
}

// The two-pass schedule: dK and dV by key tile, then dQ (and, with mask_shape, the mask's gradient into dmask_out)
// by query tile, recomputing S and dP (7 tile products).
void two_pass_backward(Params& p, const BackwardOps& o, const Shape* mask_shape, const TensorView& dmask_out,
                       int threads) {
  prepare_query_blocks(p, o, threads);
  const int64_t nqb = p.num_q_blocks(), nqt = p.B * p.Hq * nqb;

  // Pass 1: dK, dV (one task per key block).
  run_tasks(p.B * p.Hkv * p.num_k_blocks(), threads, [&](int64_t t) { o.backward_kv_task(p, t); });

  // Pass 2: dQ and dmask. Tasks that add into the same dmask elements (mask broadcast over batch, heads or
  // queries) form one group run in a fixed order.
  if (!mask_shape) {
    run_tasks(nqt, threads, [&](int64_t t) { o.backward_q_task(p, t); });
    return;
  }
  const Shape& ms = *mask_shape;
  Shape st4(4, 0);
  {
    const Shape cs = contiguous_strides(ms);
    const int64_t off = 4 - int64_t(ms.size());
    for (int64_t x = 0; x < int64_t(ms.size()); ++x) st4[off + x] = ms[x] == 1 ? 0 : cs[x];
  }
  p.dm_sb = st4[0], p.dm_sh = st4[1], p.dm_sl = st4[2], p.dm_sj = st4[3];
  // A broadcast mask's elements sum many dS values: accumulated in double. Otherwise each element gets one
  // value and a float buffer holds it exactly.
  const bool broadcast = (p.dm_sb == 0 && p.B > 1) || (p.dm_sh == 0 && p.Hq > 1) || (p.dm_sl == 0 && p.Lq > 1) ||
                         (p.dm_sj == 0 && p.Lk > 1);
  std::vector<float> dmask;
  std::vector<double> dmask_sum;
  if (broadcast) {
    dmask_sum.assign(size_t(numel(ms)), 0.0);
    p.dmask_sum = dmask_sum.data();
  } else {
    dmask.assign(size_t(numel(ms)), 0.f);
    p.dmask = dmask.data();
  }
  const bool share_b = p.dm_sb == 0 && p.B > 1, share_h = p.dm_sh == 0 && p.Hq > 1, share_q = p.dm_sl == 0 && nqb > 1;
  const int64_t gb = share_b ? 1 : p.B, gh = share_h ? 1 : p.Hq, gq = share_q ? 1 : nqb;
  const int64_t inner_b = share_b ? p.B : 1, inner_h = share_h ? p.Hq : 1, inner_q = share_q ? nqb : 1;
  run_tasks(gb * gh * gq, threads, [&](int64_t g) {
    const int64_t bg = g / (gh * gq), hg = (g / gq) % gh, qg = g % gq;
    for (int64_t bi = 0; bi < inner_b; ++bi)
      for (int64_t hi = 0; hi < inner_h; ++hi)
        for (int64_t qi = 0; qi < inner_q; ++qi) {
          const int64_t b = share_b ? bi : bg, h = share_h ? hi : hg, qb = share_q ? qi : qg;
          o.backward_q_task(p, (b * p.Hq + h) * nqb + qb);
        }
  });
  // Store the reduced gradient in the mask's own shape.
  std::vector<int64_t> idx(ms.size(), 0);
  for (int64_t lin = 0; lin < numel(ms); ++lin) {
    dmask_out.set(idx.data(), broadcast ? dmask_sum[size_t(lin)] : double(dmask[size_t(lin)]));
    for (size_t x = idx.size(); x-- > 0;) {
      if (++idx[x] < ms[x]) break;
      idx[x] = 0;
    }
  }
}

// A half-precision mask gradient computed into a dense float32 staging copy, rounded into `dmask` (bf16 or float16):
// a vector at a time where dmask is contiguous, else element by element.
void store_staged_mask_gradient(const BackwardOps& o, const float* staging, const TensorView& dmask, int threads) {
  const int64_t n = dmask.numel();
  if (dmask.is_contiguous()) {
    constexpr int64_t kRun = int64_t(1) << 16;
    run_tasks((n + kRun - 1) / kRun, threads, [&](int64_t t) {
      const int64_t x0 = t * kRun;
      o.store_half(dmask.dtype, dmask.ptr<uint16_t>() + x0, staging + x0, std::min(kRun, n - x0));
    });
    return;
  }
  std::vector<int64_t> at(dmask.shape.size(), 0);
  for (int64_t x = 0; x < n; ++x) {  // in row-major order
    dmask.set(at.data(), staging[x]);
    for (size_t d = at.size(); d-- > 0;)
      if (++at[d] < dmask.shape[d]) break;
      else at[d] = 0;
  }
}

void fused_backward(const BackwardArgs& a) {
  const AttentionProblem& pr = a.problem;
  for (const TensorView* t : {&a.grads.dq, &a.grads.dk, &a.grads.dv, &a.grads.dmask}) advise_output(*t);
  std::vector<int64_t> mask_lengths;
  Params p = call_params(pr, a.q, a.k, a.v, a.masks, mask_lengths);
  p.dout = view4(a.dout), p.o = view4(a.out), p.lse_in = view4(a.lse);
  p.dq = out_view4(a.grads.dq), p.dk = out_view4(a.grads.dk), p.dv = out_view4(a.grads.dv);
  const BackwardOps& o = backward_ops();
  const int threads = a.num_threads;
  // float32 inputs and dO under kHigh: the products on the amx tiles with two bf16 parts per value
  // (Params::split_bf16 and split_grads), unless an input or dO holds a value the parts cannot carry
  p.split_bf16 = o.amx_tiles && a.options.float32_precision == Float32Precision::kHigh && p.q.dtype == DType::kF32 &&
                 p.dout.dtype == DType::kF32 && bf16_products_pay(p.D, p.Lk, true) && qkv_splittable(p, threads) &&
                 !has_unsplittable(p.dout, p.B, p.Hq, p.Lq, p.Dv, threads);
  const bool bf16_products =
      o.pack_kv_pairs &&
      ((takes_bf16_products(p.q.dtype, a.options.float32_precision) && bf16_products_pay(p.D, p.Lk, false)) ||
       p.split_bf16);
  const DenseKV dense_kv(p, threads, !bf16_products);

  // Row statistics: lse (+inf for rows without any allowed key, so that P = exp(s - lse) = 0); which query blocks
  // have a row whose lse cannot carry log l; the NaN rows (see Params). Di = rowsum(dO ∘ O) is filled in by
  // pack_q_task.
  const int64_t rows = p.B * p.Hq * p.Lq, nqb = p.num_q_blocks(), nqt = p.B * p.Hq * nqb;
  std::vector<float> lse_eff(static_cast<size_t>(rows)), delta(static_cast<size_t>(rows));
  std::vector<uint8_t> block_has_log_sum(static_cast<size_t>(nqt), 0), nan_row(static_cast<size_t>(rows), 0),
      block_has_nan_row(static_cast<size_t>(nqt), 0);
  const CountedBytes counted_rows(int64_t(2 * rows * sizeof(float)));
  run_tasks(p.B * p.Hq, threads, [&](int64_t bh) {
    const int64_t b = bh / p.Hq, h = bh % p.Hq;
    const float* lse32 = a.lse.dtype == DType::kF32 ? static_cast<const float*>(a.lse.data) : nullptr;
    for (int64_t i = 0; i < p.Lq; ++i) {
      const int64_t idx3[3] = {b, h, i};
      const double l = lse32 ? double(lse32[b * p.lse_in.sb + h * p.lse_in.sh + i * p.lse_in.sl]) : a.lse.get(idx3);
      if (std::isnan(l)) {
        lse_eff[size_t(bh * p.Lq + i)] = std::numeric_limits<float>::infinity();
        delta[size_t(bh * p.Lq + i)] = 0.f;
        nan_row[size_t(bh * p.Lq + i)] = block_has_nan_row[size_t(bh * nqb + i / p.Br)] = 1;
        continue;
      }
      const float le = l == -HUGE_VAL ? std::numeric_limits<float>::infinity() : float(l);
      lse_eff[size_t(bh * p.Lq + i)] = le;
      if (lse_needs_row_stats(le)) block_has_log_sum[size_t(bh * nqb + i / p.Br)] = 1;
    }
  });
  p.lse_eff = lse_eff.data();
  p.delta = delta.data();
  p.nan_row = nan_row.data();
  p.block_has_nan_row = block_has_nan_row.data();
  const std::vector<uint8_t> nan_keys = nan_key_blocks(a.k, p, threads);
  if (!nan_keys.empty()) p.nan_key_block = nan_keys.data();

  // Query-side tiles, packed once (O(B·Hq·Lq·(D+Dv)) floats, like the inputs), in the call's buffers unless every
  // task of the one-pass backward packs its own.
  const Shape& ms = pr.mask_shape;
  int64_t m4[4] = {1, 1, 1, 1};  // the mask as 4-D (its dimensions right-aligned)
  const size_t off = 4 - ms.size();
  for (size_t x = 0; x < ms.size(); ++x) m4[off + x] = ms[x];
  // A half-precision mask gradient is computed as float32, into a dense staging copy (so that the forms that write
  // float32 directly serve it too), and rounded into dmask at the end, a vector at a time; where the copy would pass
  // the call's memory limit, each form stores into dmask element by element.
  const TensorView& dmask_out = a.grads.dmask;
  const bool half_dmask =
      pr.need_dmask && (dmask_out.dtype == DType::kBF16 || dmask_out.dtype == DType::kF16) &&
      double(numel(pr.mask_shape)) * sizeof(float) <= double(memory_limit_bytes(a.options.memory_limit_bytes));
  const size_t staged = half_dmask ? size_t(numel(pr.mask_shape)) : 0;
  const CountedFloats staging(staged, "fused attention backward: the mask's gradient");
  const TensorView dm = half_dmask ? TensorView(staging.get(), DType::kF32, pr.mask_shape) : dmask_out;
  const MaskGradient mask_gradient = plan_backward(p, pr, dm, m4, a.options);
  const bool one_pass = mask_gradient != MaskGradient::kTwoPass;
  const bool tiles_per_task = one_pass && p.num_kv_groups() == 1;  // packed inside the tasks: one_pass_backward
  const size_t pk_n = tiles_per_task ? 0 : static_cast<size_t>(query_tile_floats(p, nqt));
  // 64-byte aligned: the tiles are loaded with aligned vector loads
  const CountedFloats packed(pk_n, "fused attention backward: the packed query tiles");
  if (!tiles_per_task) place_query_tiles(p, packed.get(), nqt);
  // bf16 products (a build that has them; bf16 inputs, or float32 ones when allowed): K, V and the query-side
  // tiles also as bf16 pairs; dO only when it is bf16 or may be rounded (else dP = V dO^T stays float32).
  WorkspaceVector<uint32_t> kv_pairs;  // zeroed by resize
  WorkspacePtr<uint32_t> q_pairs;      // read with aligned vector loads
  std::optional<CountedBytes> counted_pairs;
  if (bf16_products) {
    const bool bf16_precision = a.options.float32_precision == Float32Precision::kBF16;
    // All five products on bf16 pairs: P' and dS rounded once where rounding is allowed or the gradients are bf16
    // anyway (not with the mask's gradient), or in two parts each under kHigh; the two-pass schedule keeps float32
    // products for dV, dK and dQ.
    const bool bf16_grads = p.dq.dtype == DType::kBF16 && p.dk.dtype == DType::kBF16 && p.dv.dtype == DType::kBF16;
    p.round_grads = one_pass && !pr.need_dmask && !p.split_bf16 && (bf16_precision || bf16_grads);
    p.split_grads = one_pass && p.split_bf16;
    p.amx_tiles = o.amx_tiles;             // (before the pair strides, which it pads)
    const int64_t parts = p.pair_parts();  // split_bf16: the lo parts after the hi ones
    const int64_t k_words = p.B * p.Hkv * p.Lk * p.k_pair_stride(), v_words = p.B * p.Hkv * p.Lk * p.dv_pair_stride();
    const int64_t kt_words = p.grad_pairs() ? parts * p.B * p.Hkv * p.kt_pairs_head_words() : 0;
    p.dout_pairs = p.dout.dtype == DType::kBF16 || bf16_precision || p.round_grads || p.split_bf16;
    // the query blocks' bf16 tiles: the call's, or each task's own (one_pass_backward) where the float32 ones are
    const int64_t q_words = tiles_per_task ? 0 : query_pair_words(p, nqt);
    kv_pairs.resize(size_t(parts * (k_words + v_words) + kt_words));
    counted_pairs.emplace(int64_t((parts * (k_words + v_words) + kt_words + q_words) * sizeof(uint32_t)));
    q_pairs = workspace_array<uint32_t>(size_t(q_words), "fused attention backward: the packed bf16 query tiles");
    p.k_pairs = kv_pairs.data(), p.v_row_pairs = p.k_pairs + parts * k_words;
    if (p.split_bf16) p.k_lo_words = k_words, p.v_lo_words = v_words;
    if (p.grad_pairs()) p.kt_pairs = p.v_row_pairs + parts * v_words;
    if (p.split_grads) p.kt_lo_words = kt_words / 2;
    if (!tiles_per_task) place_query_pairs(p, q_pairs.get(), nqt);
    run_tasks(p.B * p.Hkv, threads, [&](int64_t t) { o.pack_kv_pairs(p, t); });
  }
  // Rows whose lse cannot carry log l (a huge bias on every key): the exact row max and log-sum, recomputed (after
  // packing) for the blocks that have such rows only.
  const bool any_log_sum = std::find(block_has_log_sum.begin(), block_has_log_sum.end(), 1) != block_has_log_sum.end();
  std::vector<float> row_log_sum(any_log_sum ? size_t(rows) : 0, 0.f);
  const int64_t log_sum_bytes = int64_t(row_log_sum.size() * sizeof(float));
  const CountedBytes counted_log_sum(log_sum_bytes);
  if (any_log_sum) p.row_log_sum = row_log_sum.data();
  p.block_has_log_sum = block_has_log_sum.data();

  // One pass over key groups (dK, dV and partial dQ; 5 tile products), then the partials summed per query block;
  // the mask's gradient as planned.
  switch (mask_gradient) {
    case MaskGradient::kNone: one_pass_backward(p, o, threads); break;
    case MaskGradient::kDirect:
      p.dscores = dm.ptr<float>();
      p.stream_dscores = !half_dmask && rows * p.Lk * int64_t(sizeof(float)) >= kStreamScoreBytes;
      one_pass_backward(p, o, threads);
      break;
    case MaskGradient::kChunkSums: {
      const size_t n = size_t(p.num_dm_chunks() * p.Hkv * p.dm_heads * p.Lk * p.dm_lqp);
      const CountedFloats sums(n, "fused attention backward: the mask gradient's sums");
      p.dmask_part = sums.get();
      one_pass_backward(p, o, threads);
      store_mask_chunks(p, m4, off, dm, threads);
      break;
    }
    case MaskGradient::kScores: {
      const size_t n = size_t(rows * p.Lk);
      const CountedFloats scores(n, "fused attention backward: the scores' gradient");
      p.dscores = scores.get();
      one_pass_backward(p, o, threads);
      store_mask_gradient(p, m4, off, dm, threads);
      break;
    }
    case MaskGradient::kTwoPass: two_pass_backward(p, o, pr.need_dmask ? &pr.mask_shape : nullptr, dm, threads); break;
  }
  if (half_dmask) store_staged_mask_gradient(o, staging.get(), dmask_out, threads);
}

}  // namespace
}  // namespace fused

KernelEntry fused_kernel() { return {"fused", fused::fused_supports, fused::fused_forward, fused::fused_backward}; }

}  // namespace sattn
