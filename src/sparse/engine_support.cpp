// Non-template parts of the block-sparse engine: validation, packing into fp32 layout order, stores, threads.
#include "sattn/attention.hpp"
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "core/env.hpp"
#include "core/threads.hpp"
#include "sattn/error.hpp"
#include "sparse/engine.hpp"

namespace sattn::sparse::detail {

namespace {

void check_input(const TensorView& t, const char* name, const char* layout) {
  check(t.data != nullptr, ErrorKind::kInvalidArgument, name, ": required");
  check(t.dim() == 4, ErrorKind::kInvalidArgument, name, ": expected a 4-D tensor ", layout, ", got shape ",
        shape_text(t.shape));
  check(t.strides.size() == 4, ErrorKind::kInvalidArgument, name, ": expected 4 strides, got ", t.strides.size());
  check(is_floating(t.dtype), ErrorKind::kTypeError, name, ": expected float32, float64, bfloat16 or float16, got ",
        to_string(t.dtype));
  for (int d = 0; d < 4; ++d) {
    check(t.shape[d] > 0, ErrorKind::kInvalidArgument, name, ": zero-size dimension in shape ", shape_text(t.shape),
          " (expected ", layout, ")");
    check(t.strides[d] >= 0, ErrorKind::kInvalidArgument, name, ": negative strides are not supported");
  }
}

inline float load(const void* base, DType dt, int64_t off) {
  switch (dt) {
    case DType::kF32: return static_cast<const float*>(base)[off];
    case DType::kF64: return float(static_cast<const double*>(base)[off]);
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[off]);
    case DType::kF16: return fp16_to_float(static_cast<const uint16_t*>(base)[off]);
    default: return 0.0f;
  }
}

// n elements of a row of t from element offset `off` (element stride `step`) as floats: bf16 and float32 rows of
// unit stride in a loop the compiler vectorises, anything else element by element.
void row_to_float(const TensorView& t, int64_t off, int64_t step, int64_t n, float* dst) {
  if (step == 1 && t.dtype == DType::kF32) {
    std::memcpy(dst, static_cast<const float*>(t.data) + off, size_t(n) * sizeof(float));
  } else if (step == 1 && t.dtype == DType::kBF16) {
    const uint16_t* s = static_cast<const uint16_t*>(t.data) + off;
    for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_float(s[d]);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = load(t.data, t.dtype, off + d * step);
  }
}

// out[(b, h, pos, :)] = t[b, h, perm[pos], :] in fp32: a view of t when it is fp32, contiguous and perm is the
// identity (no copy: large inputs are not copied, and no fresh pages are touched), else a packed copy, one task per
// (b, h) on up to `threads` threads.
void pack4(const TensorView& t, const std::vector<int32_t>& perm, FloatBuf& buf, int threads) {
  const int64_t B = t.shape[0], H = t.shape[1], L = t.shape[2], D = t.shape[3];
  buf.n = size_t(B * H * L * D);
  if (t.dtype == DType::kF32 && perm.empty() && t.strides[3] == 1 && (L == 1 || t.strides[2] == D) &&
      (H == 1 || t.strides[1] == L * D) && (B == 1 || t.strides[0] == H * L * D)) {
    buf.own.clear();
    buf.ptr = static_cast<const float*>(t.data);
    return;
  }
  WorkspaceVector<float>& out = buf.own;
  out.resize(buf.n);
  buf.ptr = out.data();
  parallel_for(B * H, threads, [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    for (int64_t pos = 0; pos < L; ++pos) {
      const int64_t src = b * t.strides[0] + h * t.strides[1] + int64_t(perm.empty() ? pos : perm[pos]) * t.strides[2];
      row_to_float(t, src, t.strides[3], D, &out[size_t((bh * L + pos) * D)]);
    }
  });
}

void check_output_view(const TensorView& t, const char* name, const Shape& expected) {
  check(t.shape == expected, ErrorKind::kInvalidArgument, name, ": expected shape ", shape_text(expected), ", got ",
        shape_text(t.shape));
  check(t.strides.size() == t.shape.size(), ErrorKind::kInvalidArgument, name, ": strides do not match the shape");
  check(is_floating(t.dtype), ErrorKind::kTypeError, name, ": expected a float tensor, got ", to_string(t.dtype));
  for (size_t d = 0; d < t.shape.size(); ++d)
    check(t.strides[d] > 0 || t.shape[d] == 1, ErrorKind::kInvalidArgument, name,
          ": an output may not broadcast (stride 0 on dimension ", d, ")");
}

}  // namespace

AttentionProblem describe_inputs(const TensorView& q, const TensorView& k, const TensorView& v, const EngineOptions& o,
                                 bool enable_gqa) {
  AttentionOptions options;
  options.scale = o.scale;
  options.key_padding_mask = o.key_padding_mask;
  options.key_lengths = o.key_lengths;
  AttentionProblem problem = describe_attention(q, k, v, options);
  check(enable_gqa || problem.heads_q == problem.heads_kv, ErrorKind::kInvalidArgument, "key: Hq = ", problem.heads_q,
        " differs from Hkv = ", problem.heads_kv, "; pass enable_gqa=True for grouped-query attention");
  return problem;
}

namespace {

// key_valid [B, Lk] (1 = a key that is not padding) and key_invalid_prefix in the mask's layout order, from the key
// padding the problem was described with (validated there).
void pack_key_padding(Packed& p, const BlockMask& mask, const EngineOptions& o) {
  const int64_t B = p.B(), Lk = p.Lk();
  p.key_valid.assign(size_t(B * Lk), 1);
  if (p.problem.key_padding == KeyPaddingKind::kBool) {
    const TensorView& m = o.key_padding_mask;
    const auto* d = static_cast<const uint8_t*>(m.data);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t x = 0; x < Lk; ++x)
        p.key_valid[size_t(b * Lk + x)] = d[b * m.strides[0] + mask.k_index(x) * m.strides[1]] ? 0 : 1;
  } else {
    const TensorView& m = o.key_lengths;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t len = m.dtype == DType::kI32 ? static_cast<const int32_t*>(m.data)[b * m.strides[0]]
                                                 : static_cast<const int64_t*>(m.data)[b * m.strides[0]];
      for (int64_t x = 0; x < Lk; ++x) p.key_valid[size_t(b * Lk + x)] = mask.k_index(x) < len ? 1 : 0;
    }
  }
  p.key_invalid_prefix.assign(size_t(B * (Lk + 1)), 0);
  for (int64_t b = 0; b < B; ++b) {
    int32_t* pre = &p.key_invalid_prefix[size_t(b * (Lk + 1))];
    for (int64_t x = 0; x < Lk; ++x) pre[x + 1] = pre[x] + (p.key_valid[size_t(b * Lk + x)] ? 0 : 1);
  }
}

}  // namespace

Packed pack_inputs(const AttentionProblem& problem, const TensorView& q, const TensorView& k, const TensorView& v,
                   const BlockMask& mask, const EngineOptions& o) {
  Packed p;
  p.problem = problem;
  check(mask.len_q == p.Lq() && mask.len_k == p.Lk(), ErrorKind::kInvalidArgument,
        "block_mask: built for Lq = ", mask.len_q, ", Lk = ", mask.len_k, ", but the inputs have Lq = ", p.Lq(),
        ", Lk = ", p.Lk());
  check(mask.heads == 1 || mask.heads == p.Hq(), ErrorKind::kInvalidArgument, "block_mask: has ", mask.heads,
        " heads, expected 1 or Hq = ", p.Hq());
  mask.validate();
  p.scale = float(problem.scale);
  p.threads = resolve_num_threads(o.num_threads);
  if (problem.key_padding != KeyPaddingKind::kNone) pack_key_padding(p, mask, o);
  pack4(q, mask.q_perm, p.q, p.threads);
  pack4(k, mask.k_perm, p.k, p.threads);
  pack4(v, mask.k_perm, p.v, p.threads);
  return p;
}

void check_outputs(const Packed& p, const TensorView& out, const TensorView& lse) {
  check(out.data != nullptr, ErrorKind::kInvalidArgument, "out: required");
  check_output_view(out, "out", {p.B(), p.Hq(), p.Lq(), p.Dv()});
  if (lse.data) check_output_view(lse, "lse", {p.B(), p.Hq(), p.Lq()});
}

void check_grads(const Packed&, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& dq,
                 const TensorView& dk, const TensorView& dv) {
  check(dq.data && dk.data && dv.data, ErrorKind::kInvalidArgument, "dq/dk/dv: all three are required");
  check_output_view(dq, "dq", q.shape);
  check_output_view(dk, "dk", k.shape);
  check_output_view(dv, "dv", v.shape);
}

namespace {
bool has_nan(const float* x, size_t n) {
  unsigned nan = 0;  // no branch: the scan vectorises
  for (size_t i = 0; i < n; ++i) nan |= unsigned(x[i] != x[i]);
  return nan != 0;
}

// Zeroes the rows [rows x width] of buf that hold a NaN (copying buf first when it is a view of the caller's
// tensor); returns which rows they were (empty when none, found by one scan of buf).
std::vector<uint8_t> zero_nan_rows(FloatBuf& buf, int64_t rows, int64_t width) {
  if (!has_nan(buf.ptr, buf.n)) return {};
  if (buf.own.empty()) {
    buf.own.assign(buf.ptr, buf.ptr + buf.n);
    buf.ptr = buf.own.data();
  }
  std::vector<uint8_t> nan(size_t(rows), 0);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = &buf.own[size_t(r * width)];
    if (has_nan(row, size_t(width))) {
      nan[size_t(r)] = 1;
      std::fill_n(row, width, 0.0f);
    }
  }
  return nan;
}
}  // namespace

void pack_backward(Packed& p, const BlockMask& mask, const TensorView& dout, const TensorView& out,
                   const TensorView& lse) {
  check_input(dout, "dout", "[B, Hq, Lq, Dv]");
  check_input(out, "out", "[B, Hq, Lq, Dv]");
  const int64_t B = p.B(), Hq = p.Hq(), Lq = p.Lq(), Dv = p.Dv();
  const Shape os = {B, Hq, Lq, Dv};
  check(dout.shape == os, ErrorKind::kInvalidArgument, "dout: expected shape ", shape_text(os), ", got ",
        shape_text(dout.shape));
  check(out.shape == os, ErrorKind::kInvalidArgument, "out: expected shape ", shape_text(os), ", got ",
        shape_text(out.shape));
  check(lse.data != nullptr, ErrorKind::kInvalidArgument, "lse: the forward log-sum-exp is required for the backward");
  check(lse.shape == Shape{B, Hq, Lq} && lse.strides.size() == 3, ErrorKind::kInvalidArgument, "lse: expected shape ",
        shape_text({B, Hq, Lq}), ", got ", shape_text(lse.shape));
  check(is_floating(lse.dtype), ErrorKind::kTypeError, "lse: expected a float tensor, got ", to_string(lse.dtype));
  pack4(dout, mask.q_perm, p.dout, p.threads);
  p.lse.resize(size_t(B * Hq * Lq));
  p.delta.resize(p.lse.size());
  // out is read in place (it is only needed for delta): no packed copy. One task per (b, h).
  parallel_for(B * Hq, p.threads, [&](int64_t bh) {
    const int64_t b = bh / Hq, h = bh % Hq;
    std::vector<float> orow(static_cast<size_t>(Dv));
    for (int64_t pos = 0; pos < Lq; ++pos) {
      const size_t r = size_t(bh * Lq + pos);
      const int64_t i = mask.q_index(pos);
      p.lse[r] = load(lse.data, lse.dtype, b * lse.strides[0] + h * lse.strides[1] + i * lse.strides[2]);
      row_to_float(out, b * out.strides[0] + h * out.strides[1] + i * out.strides[2], out.strides[3], Dv, orow.data());
      const float* dr = &p.dout[r * size_t(Dv)];
      double acc = 0;  // delta_i = dO_i · O_i
      for (int64_t c = 0; c < Dv; ++c) acc += double(dr[c]) * orow[size_t(c)];
      p.delta[r] = float(acc);
    }
  });
  // NaN rows (lse NaN, or a NaN in q): tiles::probabilities gives them P = NaN at every allowed key and 0 at the
  // masked ones, and delta = 0, so that dS = P · (dP - delta) is 0 at the masked keys. The q and k rows holding a
  // NaN are zeroed in the packed copies, since the tile products multiply masked entries too (0 · NaN would carry
  // the NaN across the mask): a NaN then reaches the gradients only through the NaN rows' allowed keys.
  const std::vector<uint8_t> nan_q = zero_nan_rows(p.q, B * Hq * Lq, p.D());
  zero_nan_rows(p.k, B * p.Hkv() * p.Lk(), p.D());
  for (size_t r = 0; r < p.lse.size(); ++r)
    if (std::isnan(p.lse[r]) || (!nan_q.empty() && nan_q[r])) {
      p.lse[r] = std::numeric_limits<float>::quiet_NaN();
      p.delta[r] = 0.0f;
    }
}

void store_row(const TensorView& t, int64_t b, int64_t h, int64_t i, const float* src, int64_t n) {
  const int64_t off = b * t.strides[0] + h * t.strides[1] + i * t.strides[2], st = t.strides[3];
  switch (t.dtype) {
    case DType::kF32: {
      float* d = static_cast<float*>(t.data) + off;
      for (int64_t c = 0; c < n; ++c) d[c * st] = src[c];
      break;
    }
    case DType::kF64: {
      double* d = static_cast<double*>(t.data) + off;
      for (int64_t c = 0; c < n; ++c) d[c * st] = src[c];
      break;
    }
    case DType::kBF16: {
      uint16_t* d = static_cast<uint16_t*>(t.data) + off;
      for (int64_t c = 0; c < n; ++c) d[c * st] = float_to_bf16(src[c]);
      break;
    }
    case DType::kF16: {
      uint16_t* d = static_cast<uint16_t*>(t.data) + off;
      for (int64_t c = 0; c < n; ++c) d[c * st] = float_to_fp16(src[c]);
      break;
    }
    default: fail(ErrorKind::kInternal, "store_row: dtype");
  }
}

void store_value(const TensorView& t, int64_t b, int64_t h, int64_t i, float value) {
  const int64_t off = b * t.strides[0] + h * t.strides[1] + i * t.strides[2];
  switch (t.dtype) {
    case DType::kF32: static_cast<float*>(t.data)[off] = value; break;
    case DType::kF64: static_cast<double*>(t.data)[off] = value; break;
    case DType::kBF16: static_cast<uint16_t*>(t.data)[off] = float_to_bf16(value); break;
    case DType::kF16: static_cast<uint16_t*>(t.data)[off] = float_to_fp16(value); break;
    default: fail(ErrorKind::kInternal, "store_value: dtype");
  }
}

bool forward_takes_bf16_pairs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                              const EngineOptions& options) {
  const auto bf16 = [](const TensorView& t) { return t.dtype == DType::kBF16; };
  const auto takes = [](const TensorView& t) { return t.dtype == DType::kBF16 || t.dtype == DType::kF32; };
  const bool rounding = options.float32_precision == Float32Precision::kBF16 ||
                        (bf16(q) && bf16(k) && bf16(v) && out.dtype == DType::kBF16);
  return rounding && takes(q) && takes(k) && takes(v) && tiles::has_bf16_products();
}

bool backward_takes_bf16_pairs(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& dq,
                               const TensorView& dk, const TensorView& dv, const EngineOptions& options) {
  const auto bf16 = [](const TensorView& t) { return t.dtype == DType::kBF16; };
  const auto takes = [](const TensorView& t) { return t.dtype == DType::kBF16 || t.dtype == DType::kF32; };
  const bool rounding = options.float32_precision == Float32Precision::kBF16 ||
                        (bf16(q) && bf16(k) && bf16(v) && bf16(dq) && bf16(dk) && bf16(dv));
  return rounding && takes(q) && takes(k) && takes(v) && tiles::has_bf16_products();
}

WorkspaceVector<uint32_t> pairs_along_rows(const float* x, int64_t rows, int64_t width) {
  const int64_t W2 = (width + 1) / 2;
  WorkspaceVector<uint32_t> out(size_t(rows * W2));
  tiles::pack_pairs_along_rows(x, width, rows, width, out.data(), W2);
  return out;
}

void run_parallel(int64_t n, int threads, void* ctx, void (*fn)(void*, int64_t)) {
  parallel_for(n, threads, [&](int64_t i) { fn(ctx, i); });
}

bool colour_query_blocks(const BlockMask& bm, int64_t batch_heads, std::vector<int64_t>& colour_start,
                         std::vector<int32_t>& runs, std::vector<int32_t>& run_ends) {
  const int64_t nqb = bm.num_q_blocks();
  // SATTN_SPARSE_BACKWARD=two_pass / one_pass forces a form (for tests and measurements).
  const std::string form = env::get("SATTN_SPARSE_BACKWARD").value_or("auto");
  check(form == "auto" || form == "one_pass" || form == "two_pass", ErrorKind::kInvalidArgument,
        "SATTN_SPARSE_BACKWARD: expected auto, one_pass or two_pass, got '", form, "'");
  if (form == "two_pass") return false;
  const bool force = form == "one_pass";
  // Key hull [lo, hi) of each query block over every head slot (empty blocks: lo = hi = 0).
  std::vector<int64_t> lo(size_t(nqb), INT64_MAX), hi(size_t(nqb), 0);
  for (int64_t s = 0; s < bm.heads; ++s)
    for (int64_t qb = 0; qb < nqb; ++qb)
      for (int64_t r = bm.row_ptr[s * nqb + qb]; r < bm.row_ptr[s * nqb + qb + 1]; ++r) {
        lo[size_t(qb)] = std::min<int64_t>(lo[size_t(qb)], bm.ranges[size_t(r)].begin);
        hi[size_t(qb)] = std::max<int64_t>(hi[size_t(qb)], bm.ranges[size_t(r)].end);
      }
  // Runs of consecutive query blocks, processed one after the other by one work item so that the keys (and key
  // gradients) they share stay in cache: a run grows while the union of its hulls stays within 1.25x the first
  // block's hull (Neighborhood2D: a row of tiles; sliding windows: a few blocks; disjoint windows: one block), and
  // to at most max(1, min(64, batch_heads * nqb / 64)) blocks so that a colour still holds many items.
  const int64_t max_run = std::max<int64_t>(1, std::min<int64_t>(64, batch_heads * nqb / 64));
  std::vector<int64_t> rlo, rhi;
  runs.clear();
  run_ends.clear();
  for (int64_t qb = 0; qb < nqb;) {
    int64_t a = lo[size_t(qb)], b = hi[size_t(qb)];
    const int64_t first_len = b == 0 && a == INT64_MAX ? 0 : b - a;
    int64_t e = qb + 1;
    while (e < nqb && e - qb < max_run && first_len > 0) {
      if (lo[size_t(e)] == INT64_MAX) break;
      const int64_t na = std::min(a, lo[size_t(e)]), nb = std::max(b, hi[size_t(e)]);
      if (4 * (nb - na) > 5 * first_len) break;
      a = na, b = nb, ++e;
    }
    if (a == INT64_MAX) a = b = 0;
    runs.push_back(int32_t(qb));
    run_ends.push_back(int32_t(e));
    rlo.push_back(a);
    rhi.push_back(b);
    qb = e;
  }
  const int64_t nr = int64_t(runs.size());
  std::vector<int32_t> order(static_cast<size_t>(nr));
  for (int64_t x = 0; x < nr; ++x) order[size_t(x)] = int32_t(x);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return rlo[size_t(x)] < rlo[size_t(y)]; });
  // First-fit on intervals sorted by their start: a colour takes a run iff every run it holds ends before the
  // run's hull starts (optimal for interval graphs). Too many colours (fewer than 8 blocks per colour on average,
  // e.g. global tokens whose keys every block reads): not worth it.
  const int64_t max_colours = force ? INT64_MAX : std::max<int64_t>(1, batch_heads * nqb / 8);
  std::vector<int64_t> colour_end;
  std::vector<int32_t> colour(static_cast<size_t>(nr), 0);
  for (int32_t x : order) {
    if (rhi[size_t(x)] == rlo[size_t(x)]) continue;  // no keys: colour 0, reserves nothing
    size_t c = 0;
    while (c < colour_end.size() && colour_end[c] > rlo[size_t(x)]) ++c;
    if (c == colour_end.size()) {
      if (int64_t(c) >= max_colours) return false;
      colour_end.push_back(0);
    }
    colour_end[c] = rhi[size_t(x)];
    colour[size_t(x)] = int32_t(c);
  }
  const size_t nc = std::max<size_t>(1, colour_end.size());
  colour_start.assign(nc + 1, 0);
  for (int64_t x = 0; x < nr; ++x) ++colour_start[size_t(colour[size_t(x)]) + 1];
  for (size_t c = 0; c < nc; ++c) colour_start[c + 1] += colour_start[c];
  std::vector<int32_t> rs(runs), re(run_ends);
  std::vector<int64_t> fill(colour_start.begin(), colour_start.end() - 1);
  for (int64_t x = 0; x < nr; ++x) {
    const size_t at = size_t(fill[size_t(colour[size_t(x)])]++);
    runs[at] = rs[size_t(x)];
    run_ends[at] = re[size_t(x)];
  }
  return true;
}

}  // namespace sattn::sparse::detail
