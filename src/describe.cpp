// Validation of an attention call, once: the shape and dtype checks that describe_attention (4-D views) and
// describe_sdpa (PyTorch's layout, shapes only) share, so that each message exists in one place.
#include <algorithm>
#include <cmath>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "core/view_checks.hpp"
#include "sattn/attention.hpp"

namespace sattn {

void check_view(const TensorView& t, const char* name) {
  if (t.data == nullptr && t.numel() != 0) fail(ErrorKind::kInvalidArgument, name, ": null data pointer");
  if (t.strides.size() != t.shape.size())
    fail(ErrorKind::kInvalidArgument, name, ": ", t.strides.size(), " strides for shape ", shape_to_string(t.shape));
  for (size_t d = 0; d < t.shape.size(); ++d) {
    if (t.shape[d] < 0) fail(ErrorKind::kInvalidArgument, name, ": negative size in shape ", shape_to_string(t.shape));
    if (t.strides[d] < 0)
      fail(ErrorKind::kInvalidArgument, name, ": negative strides are not supported, got strides ",
           shape_to_string(t.strides));
  }
}

namespace {

// Whether the strides nest without overlap: sorted by stride, each stride clears the inner dims' extent.
// True for every permutation / padding / slicing of a dense layout; conservative for exotic interleavings.
bool non_overlapping(const TensorView& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims with size > 1
  for (size_t d = 0; d < t.shape.size(); ++d)
    if (t.shape[d] > 1) dims.emplace_back(t.strides[d], t.shape[d]);
  std::sort(dims.begin(), dims.end());
  int64_t extent = 1;  // elements spanned by the inner dims
  for (const auto& [stride, size] : dims) {
    if (stride < extent) return false;
    extent += stride * (size - 1);
  }
  return true;
}

}  // namespace

void check_output(const TensorView& t, const char* name, const Shape& expected, bool allow_half) {
  check_view(t, name);
  if (t.shape != expected)
    fail(ErrorKind::kInvalidArgument, name, ": expected shape ", shape_to_string(expected), ", got ",
         shape_to_string(t.shape));
  const bool ok = t.dtype == DType::kF32 || t.dtype == DType::kF64 ||
                  (allow_half && (t.dtype == DType::kBF16 || t.dtype == DType::kF16));
  check(ok, ErrorKind::kTypeError, name, ": expected a float32 or float64", allow_half ? " (or bfloat16/float16)" : "",
        " tensor, got ", to_string(t.dtype));
  for (size_t d = 0; d < t.shape.size(); ++d)
    check(t.strides[d] != 0 || t.shape[d] == 1, ErrorKind::kInvalidArgument, name,
          ": an output may not broadcast (stride 0 on dimension ", d, ")");
  if (!non_overlapping(t))
    fail(ErrorKind::kInvalidArgument, name, ": the strides ", shape_to_string(t.strides), " make elements of shape ",
         shape_to_string(t.shape),
         " overlap (or interleave); an output needs nested, non-overlapping strides (any permutation or padding of"
         " a dense layout)");
}

namespace {

// One argument by shape and dtype name (a view's, or a TensorSpec's).
struct Arg {
  const char* name;
  const Shape& shape;
  std::string_view dtype;
};

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType d :
       {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kBool, DType::kI32, DType::kI64, DType::kU8})
    if (name == to_string(d)) return d;
  return std::nullopt;
}

bool is_float_name(std::string_view name) {
  const std::optional<DType> d = parse_dtype(name);
  return d && is_floating(*d);
}

// query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev): dtypes, ranks, sizes, heads.
// `enable_gqa` false: Hq != Hkv is refused (PyTorch's enable_gqa=False); the 4-D C++ API always allows it.
void check_qkv(const Arg& q, const Arg& k, const Arg& v, bool enable_gqa) {
  for (const Arg* a : {&q, &k, &v})
    if (!is_float_name(a->dtype))
      fail(ErrorKind::kTypeError, a->name, ": expected float32, float64, bfloat16 or float16, got ", a->dtype);
  if (k.dtype != q.dtype || v.dtype != q.dtype)
    fail(ErrorKind::kTypeError, "key/value: expected the dtype of query (", q.dtype, "), got key ", k.dtype,
         " and value ", v.dtype);
  const size_t n = q.shape.size();
  if (n < 2)
    fail(ErrorKind::kInvalidArgument, "query: expected at least 2 dimensions (..., Hq, Lq, E), got shape ",
         shape_to_string(q.shape));
  for (const Arg* a : {&k, &v})
    if (a->shape.size() != n)
      fail(ErrorKind::kInvalidArgument, a->name, ": expected ", n, " dimensions like query ", shape_to_string(q.shape),
           ", got shape ", shape_to_string(a->shape));
  for (const auto& [a, layout] :
       {std::pair{&q, "(..., Hq, Lq, E)"}, std::pair{&k, "(..., Hkv, Lk, E)"}, std::pair{&v, "(..., Hkv, Lk, Ev)"}})
    if (std::find(a->shape.begin(), a->shape.end(), 0) != a->shape.end())
      fail(ErrorKind::kInvalidArgument, a->name, ": zero-size dimension in shape ", shape_to_string(a->shape),
           " (expected ", layout, " with every size >= 1)");
  const auto lead = [&](const Shape& s) { return n >= 3 && !std::equal(s.begin(), s.end() - 3, q.shape.begin()); };
  if (lead(k.shape) || lead(v.shape))
    fail(
        ErrorKind::kInvalidArgument, "key/value: expected the batch dimensions ",
        [&] { return shape_to_string(Shape(q.shape.begin(), q.shape.end() - std::min<size_t>(n, 3))); }, " of query ",
        shape_to_string(q.shape), ", got key ", shape_to_string(k.shape), " and value ", shape_to_string(v.shape));
  if (k.shape[n - 1] != q.shape[n - 1])
    fail(ErrorKind::kInvalidArgument, "key: expected embedding size E = ", q.shape[n - 1], " (from query ",
         shape_to_string(q.shape), "), got shape ", shape_to_string(k.shape));
  if (!std::equal(v.shape.begin(), v.shape.end() - 1, k.shape.begin()))
    fail(
        ErrorKind::kInvalidArgument, "value: expected shape ",
        [&] {
          Shape want = k.shape;
          want.back() = v.shape.back();
          return shape_to_string(want);
        },
        " (..., Hkv, Lk, Ev) to match key ", shape_to_string(k.shape), ", got ", shape_to_string(v.shape));
  if (n >= 3) {
    const int64_t hq = q.shape[n - 3], hkv = k.shape[n - 3];
    if (hq != hkv && !enable_gqa)
      fail(ErrorKind::kInvalidArgument, "key/value: query has Hq = ", hq,
           " heads (dimension -3) but key/value have Hkv = ", hkv,
           "; pass enable_gqa=True for grouped-query attention (as PyTorch 2.5)");
    if (hq % hkv != 0)
      fail(ErrorKind::kInvalidArgument, "key/value: query heads Hq = ", hq,
           " must be a multiple of key/value heads Hkv = ", hkv, " (grouped-query attention)");
  }
}

// scale and dropout_p, into the problem (which has head_dim).
void check_scalars(std::optional<double> scale, double dropout_p, AttentionProblem& p) {
  p.scale = scale ? *scale : 1.0 / std::sqrt(double(p.head_dim));
  if (!std::isfinite(p.scale)) fail(ErrorKind::kInvalidArgument, "scale: expected a finite number, got ", p.scale);
  if (!(dropout_p >= 0.0 && dropout_p < 1.0))
    fail(ErrorKind::kInvalidArgument, "dropout_p: expected a probability in [0, 1), got ", dropout_p);
  p.dropout_p = dropout_p;
}

// attn_mask: bool (True = may attend) or float (additive: float32, float64, bfloat16, float16), broadcastable
// (right-aligned, numpy rules) to the weights' shape (..., Hq, Lq, Lk).
void check_mask(const Arg& m, const Shape& weights, AttentionProblem& p) {
  const std::optional<DType> d = parse_dtype(m.dtype);
  if (!d || !(*d == DType::kBool || is_floating(*d)))
    fail(ErrorKind::kTypeError,
         "attn_mask: expected bool (True = may attend) or float32/float64/bfloat16/float16 (additive), got ", m.dtype);
  bool ok = m.shape.size() <= weights.size();
  for (size_t i = 1; ok && i <= m.shape.size(); ++i) {
    const int64_t a = m.shape[m.shape.size() - i], b = weights[weights.size() - i];
    ok = a == 1 || a == b;
  }
  if (!ok)
    fail(ErrorKind::kInvalidArgument, "attn_mask: shape ", shape_to_string(m.shape),
         " does not broadcast to the attention weights' shape ", shape_to_string(weights), " (..., Hq, Lq, Lk)");
  p.mask = *d == DType::kBool ? MaskKind::kBool : MaskKind::kAdditive;
  p.mask_dtype = *d;
  p.mask_shape = m.shape;
}

// key_padding_mask bool (..., Lk) with True = padding, or key_lengths int (...): the shapes and dtypes.
void check_key_padding(const Arg* kpm, const Arg* lengths, const Shape& batch_dims, int64_t len_k,
                       AttentionProblem& p) {
  if (kpm && lengths)
    fail(ErrorKind::kInvalidArgument, "key_padding_mask/key_lengths: give one or the other, not both");
  if (kpm) {
    if (kpm->dtype != "bool")
      fail(ErrorKind::kTypeError, "key_padding_mask: expected bool (True = padding), got ", kpm->dtype,
           "; for per-batch lengths use key_lengths");
    if (kpm->shape.size() != batch_dims.size() + 1 || kpm->shape.back() != len_k ||
        !std::equal(batch_dims.begin(), batch_dims.end(), kpm->shape.begin()))
      fail(
          ErrorKind::kInvalidArgument, "key_padding_mask: expected shape ",
          [&] {
            Shape want = batch_dims;
            want.push_back(len_k);
            return shape_to_string(want);
          },
          " (query's batch dimensions, Lk), got ", shape_to_string(kpm->shape));
    p.key_padding = KeyPaddingKind::kBool;
  }
  if (lengths) {
    if (lengths->dtype != "int32" && lengths->dtype != "int64")
      fail(ErrorKind::kTypeError, "key_lengths: expected an integer array (int32 or int64: the valid keys per batch ",
           "entry), got ", lengths->dtype);
    if (lengths->shape != batch_dims)
      fail(ErrorKind::kInvalidArgument, "key_lengths: expected shape ", shape_to_string(batch_dims),
           " (query's batch dimensions), got ", shape_to_string(lengths->shape));
    p.key_padding = KeyPaddingKind::kLengths;
  }
}

void check_attention_input(const TensorView& t, const char* name, const char* layout) {
  check_view(t, name);
  if (t.dim() != 4)
    fail(ErrorKind::kInvalidArgument, name, ": expected a 4-D tensor ", layout, ", got shape ",
         shape_to_string(t.shape));
}

// query_offset, key_offset, position_stride: the global positions of a shard (dropout keys them as 32-bit words).
constexpr int64_t kMaxPosition = (int64_t(1) << 32) - 1;
void check_positions(const AttentionOptions& o, AttentionProblem& p) {
  check(o.query_offset >= 0, ErrorKind::kInvalidArgument, "query_offset: expected a position >= 0, got ",
        o.query_offset);
  check(o.key_offset >= 0, ErrorKind::kInvalidArgument, "key_offset: expected a position >= 0, got ", o.key_offset);
  check(o.position_stride >= 1, ErrorKind::kInvalidArgument, "position_stride: expected >= 1, got ", o.position_stride);
  p.query_offset = o.query_offset;
  p.key_offset = o.key_offset;
  p.position_stride = o.position_stride;
  if (!p.has_positions()) return;
  const auto last = [&](int64_t offset, int64_t len) {
    return double(offset) + double(o.position_stride) * double(std::max<int64_t>(len - 1, 0));
  };
  check(last(o.query_offset, p.len_q) <= double(kMaxPosition), ErrorKind::kInvalidArgument,
        "query_offset/position_stride: the last query's global position must be below 2^32, got query_offset = ",
        o.query_offset, ", position_stride = ", o.position_stride, ", Lq = ", p.len_q);
  check(last(o.key_offset, p.len_k) <= double(kMaxPosition), ErrorKind::kInvalidArgument,
        "key_offset/position_stride: the last key's global position must be below 2^32, got key_offset = ",
        o.key_offset, ", position_stride = ", o.position_stride, ", Lk = ", p.len_k);
  check(o.causal != Causal::kBottomRight, ErrorKind::kInvalidArgument,
        "causal: bottom_right is defined by the local lengths; with query_offset/key_offset/position_stride use "
        "top_left on the global positions (bottom-right alignment is query_offset = key_offset + Lk - Lq)");
}

}  // namespace

AttentionProblem describe_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const AttentionOptions& o, const AttentionOutputs* outputs) {
  check_attention_input(q, "query", "[B, Hq, Lq, D]");
  check_attention_input(k, "key", "[B, Hkv, Lk, D]");
  check_attention_input(v, "value", "[B, Hkv, Lk, Dv]");
  check_qkv({"query", q.shape, to_string(q.dtype)}, {"key", k.shape, to_string(k.dtype)},
            {"value", v.shape, to_string(v.dtype)}, /*enable_gqa=*/true);
  AttentionProblem p;
  p.batch = q.shape[0];
  p.heads_q = q.shape[1];
  p.len_q = q.shape[2];
  p.head_dim = q.shape[3];
  p.heads_kv = k.shape[1];
  p.len_k = k.shape[2];
  p.head_dim_v = v.shape[3];
  p.dtype_q = q.dtype;
  p.dtype_kv = k.dtype;
  check_scalars(o.scale, o.dropout_p, p);
  p.seed = o.seed;
  p.causal = o.causal;
  check_positions(o, p);
  check(o.num_threads >= 0, ErrorKind::kInvalidArgument,
        "num_threads: expected 0 (automatic) or a positive count, got ", o.num_threads);
  check(o.memory_limit_bytes >= 0, ErrorKind::kInvalidArgument,
        "memory_limit_bytes: expected 0 (half of physical memory) or a positive byte count, got ",
        o.memory_limit_bytes);

  if (o.attn_mask.data != nullptr) {
    const TensorView& m = o.attn_mask;
    check_view(m, "attn_mask");
    check_mask({"attn_mask", m.shape, to_string(m.dtype)}, {p.batch, p.heads_q, p.len_q, p.len_k}, p);
    p.mask_strides.assign(4, 0);  // broadcast to [B, Hq, Lq, Lk]: stride 0 on the dims the mask does not have
    const int64_t off = 4 - m.dim();
    for (int64_t d = 0; d < m.dim(); ++d) p.mask_strides[off + d] = m.shape[d] == 1 ? 0 : m.strides[d];
  }

  const bool has_kpm = o.key_padding_mask.data != nullptr, has_len = o.key_lengths.data != nullptr;
  if (has_kpm) check_view(o.key_padding_mask, "key_padding_mask");
  if (has_len) check_view(o.key_lengths, "key_lengths");
  const Arg kpm{"key_padding_mask", o.key_padding_mask.shape, to_string(o.key_padding_mask.dtype)};
  const Arg lengths{"key_lengths", o.key_lengths.shape, to_string(o.key_lengths.dtype)};
  check_key_padding(has_kpm ? &kpm : nullptr, has_len ? &lengths : nullptr, {p.batch}, p.len_k, p);
  if (has_len)
    for (int64_t b = 0; b < p.batch; ++b) {
      const double len = o.key_lengths.get({b});
      // Keys at (global) positions >= the length are padding; a length past the last key leaves them all valid,
      // as a shard of a longer sequence needs.
      if (!(len >= 0 && len <= double(kMaxPosition)))
        fail(ErrorKind::kInvalidArgument, "key_lengths[", b, "]: expected a length in [0, 2^32 - 1], got ",
             int64_t(len));
    }

  if (outputs) {
    check(outputs->out.data != nullptr, ErrorKind::kInvalidArgument, "out: required");
    check_output(outputs->out, "out", {p.batch, p.heads_q, p.len_q, p.head_dim_v}, true);
    p.dtype_out = outputs->out.dtype;
    if (outputs->lse.data) {
      check_output(outputs->lse, "lse", {p.batch, p.heads_q, p.len_q}, false);
      p.need_lse = true;
    }
    if (outputs->weights.data) {
      check_output(outputs->weights, "weights", {p.batch, p.heads_q, p.len_q, p.len_k}, false);
      p.need_weights = true;
    }
  }
  return p;
}

SdpaDescription describe_sdpa(const SdpaSpec& c) {
  check_qkv({"query", c.query.shape, c.query.dtype}, {"key", c.key.shape, c.key.dtype},
            {"value", c.value.shape, c.value.dtype}, c.enable_gqa);
  SdpaDescription d;
  AttentionProblem& p = d.problem;
  const Shape& q = c.query.shape;
  const size_t n = q.size();
  d.batch_dims.assign(q.begin(), q.end() - std::min<size_t>(n, 3));
  p.batch = numel(d.batch_dims);
  p.heads_q = n >= 3 ? q[n - 3] : 1;
  p.heads_kv = n >= 3 ? c.key.shape[n - 3] : 1;
  p.len_q = q[n - 2];
  p.len_k = c.key.shape[n - 2];
  p.head_dim = q[n - 1];
  p.head_dim_v = c.value.shape[n - 1];
  p.dtype_q = p.dtype_kv = p.dtype_out = *parse_dtype(c.query.dtype);
  check_scalars(c.scale, c.dropout_p, p);
  p.causal = c.causal;
  if (c.attn_mask) {
    Shape weights(q.begin(), q.end() - 1);
    weights.push_back(p.len_k);
    check_mask({"attn_mask", c.attn_mask->shape, c.attn_mask->dtype}, weights, p);
  }
  std::optional<Arg> kpm, lengths;
  if (c.key_padding_mask) kpm.emplace(Arg{"key_padding_mask", c.key_padding_mask->shape, c.key_padding_mask->dtype});
  if (c.key_lengths) lengths.emplace(Arg{"key_lengths", c.key_lengths->shape, c.key_lengths->dtype});
  check_key_padding(kpm ? &*kpm : nullptr, lengths ? &*lengths : nullptr, d.batch_dims, p.len_k, p);
  return d;
}

}  // namespace sattn
