// The public attention entry points: validate once, describe, choose a kernel, run it.
#include "sattn/attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/env.hpp"
#include "core/memory.hpp"
#include "core/threads.hpp"
#include "kernels/kernel.hpp"

namespace sattn {

std::string AttentionProblem::to_string() const {
  std::string s = message::concat("B=", batch, " Hq=", heads_q, " Hkv=", heads_kv, " Lq=", len_q, " Lk=", len_k,
                                  " D=", head_dim, " Dv=", head_dim_v, " ", sattn::to_string(dtype_q));
  if (mask == MaskKind::kBool) s += " mask=bool" + shape_to_string(mask_shape);
  if (mask == MaskKind::kAdditive) s += " mask=additive" + shape_to_string(mask_shape);
  if (key_padding == KeyPaddingKind::kBool) s += " key_padding=bool";
  if (key_padding == KeyPaddingKind::kLengths) s += " key_padding=lengths";
  if (causal != Causal::kNone) s += std::string(" causal=") + sattn::to_string(causal);
  if (dropout_p > 0) s += message::concat(" dropout=", dropout_p);
  if (backward) s += " backward";
  return s;
}

namespace {

void check_view(const TensorView& t, const char* name) {
  check(t.data != nullptr || t.numel() == 0, ErrorKind::kInvalidArgument, name, ": null data pointer");
  check(t.strides.size() == t.shape.size(), ErrorKind::kInvalidArgument, name, ": ", t.strides.size(),
        " strides for shape ", shape_to_string(t.shape));
  for (size_t d = 0; d < t.shape.size(); ++d) {
    check(t.shape[d] >= 0, ErrorKind::kInvalidArgument, name, ": negative size in shape ", shape_to_string(t.shape));
    check(t.strides[d] >= 0, ErrorKind::kInvalidArgument, name, ": negative strides are not supported, got strides ",
          shape_to_string(t.strides));
  }
}

void check_attention_input(const TensorView& t, const char* name, const char* layout) {
  check_view(t, name);
  check(t.dim() == 4, ErrorKind::kInvalidArgument, name, ": expected a 4-D tensor ", layout, ", got shape ",
        shape_to_string(t.shape));
  check(is_floating(t.dtype), ErrorKind::kTypeError, name, ": expected float32, float64, bfloat16 or float16, got ",
        to_string(t.dtype));
  for (int d = 0; d < 4; ++d)
    check(t.shape[d] > 0, ErrorKind::kInvalidArgument, name, ": zero-size dimension in shape ",
          shape_to_string(t.shape), " (expected ", layout, " with every size >= 1)");
}

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

void check_output(const TensorView& t, const char* name, const Shape& expected, bool allow_half) {
  check_view(t, name);
  check(t.shape == expected, ErrorKind::kInvalidArgument, name, ": expected shape ", shape_to_string(expected),
        ", got ", shape_to_string(t.shape));
  const bool ok = t.dtype == DType::kF32 || t.dtype == DType::kF64 ||
                  (allow_half && (t.dtype == DType::kBF16 || t.dtype == DType::kF16));
  check(ok, ErrorKind::kTypeError, name, ": expected a float32 or float64", allow_half ? " (or bfloat16/float16)" : "",
        " tensor, got ", to_string(t.dtype));
  for (size_t d = 0; d < t.shape.size(); ++d)
    check(t.strides[d] != 0 || t.shape[d] == 1, ErrorKind::kInvalidArgument, name,
          ": an output may not broadcast (stride 0 on dimension ", d, ")");
  check(non_overlapping(t), ErrorKind::kInvalidArgument, name, ": the strides ", shape_to_string(t.strides),
        " make elements of shape ", shape_to_string(t.shape),
        " overlap (or interleave); an output needs nested, non-overlapping strides (any permutation or padding of"
        " a dense layout)");
}

}  // namespace

AttentionProblem describe_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const AttentionOptions& o, const AttentionOutputs* outputs) {
  check_attention_input(q, "query", "[B, Hq, Lq, D]");
  check_attention_input(k, "key", "[B, Hkv, Lk, D]");
  check_attention_input(v, "value", "[B, Hkv, Lk, Dv]");
  check(k.dtype == q.dtype && v.dtype == q.dtype, ErrorKind::kTypeError, "key/value: expected the dtype of query (",
        to_string(q.dtype), "), got key ", to_string(k.dtype), " and value ", to_string(v.dtype));
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
  check(k.shape[0] == p.batch && v.shape[0] == p.batch, ErrorKind::kInvalidArgument, "key/value: expected batch size ",
        p.batch, " (from query), got key ", shape_to_string(k.shape), " and value ", shape_to_string(v.shape));
  check(k.shape[3] == p.head_dim, ErrorKind::kInvalidArgument, "key: expected head dim D = ", p.head_dim,
        " (from query ", shape_to_string(q.shape), "), got ", shape_to_string(k.shape));
  check(v.shape[1] == p.heads_kv && v.shape[2] == p.len_k, ErrorKind::kInvalidArgument,
        "value: expected [B, Hkv, Lk, Dv] with Hkv = ", p.heads_kv, " and Lk = ", p.len_k, " (from key ",
        shape_to_string(k.shape), "), got ", shape_to_string(v.shape));
  check(p.heads_q % p.heads_kv == 0, ErrorKind::kInvalidArgument, "key: query heads Hq = ", p.heads_q,
        " must be a multiple of key/value heads Hkv = ", p.heads_kv);

  // Scale, dropout.
  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(double(p.head_dim));
  check(std::isfinite(p.scale), ErrorKind::kInvalidArgument, "scale: expected a finite number, got ", p.scale);
  check(o.dropout_p >= 0.0 && o.dropout_p < 1.0, ErrorKind::kInvalidArgument,
        "dropout_p: expected a probability in [0, 1), got ", o.dropout_p);
  p.dropout_p = o.dropout_p;
  p.seed = o.seed;
  check(o.num_threads >= 0, ErrorKind::kInvalidArgument,
        "num_threads: expected 0 (automatic) or a positive count, got ", o.num_threads);
  check(o.memory_limit_bytes >= 0, ErrorKind::kInvalidArgument,
        "memory_limit_bytes: expected 0 (half of physical memory) or a positive byte count, got ",
        o.memory_limit_bytes);
  p.causal = o.causal;

  // attn_mask: bool (True = may attend) or additive float, broadcastable to [B, Hq, Lq, Lk].
  if (o.attn_mask.data != nullptr) {
    const TensorView& m = o.attn_mask;
    check_view(m, "attn_mask");
    check(m.dtype == DType::kBool || m.dtype == DType::kF32 || m.dtype == DType::kF64, ErrorKind::kTypeError,
          "attn_mask: expected bool (True = may attend) or float32/float64 (additive), got ", to_string(m.dtype));
    const Shape target = {p.batch, p.heads_q, p.len_q, p.len_k};
    check(m.dim() <= 4, ErrorKind::kInvalidArgument,
          "attn_mask: expected at most 4 dimensions "
          "broadcastable to ",
          shape_to_string(target), ", got shape ", shape_to_string(m.shape));
    p.mask_strides.assign(4, 0);
    const int64_t off = 4 - m.dim();
    for (int64_t d = 0; d < m.dim(); ++d) {
      const int64_t want = target[off + d];
      check(m.shape[d] == want || m.shape[d] == 1, ErrorKind::kInvalidArgument, "attn_mask: shape ",
            shape_to_string(m.shape), " does not broadcast to ", shape_to_string(target), " [B, Hq, Lq, Lk]");
      p.mask_strides[off + d] = m.shape[d] == 1 ? 0 : m.strides[d];
    }
    p.mask = m.dtype == DType::kBool ? MaskKind::kBool : MaskKind::kAdditive;
    p.mask_dtype = m.dtype;
    p.mask_shape = m.shape;
  }

  // Key padding: bool [B, Lk] (True = padding) or lengths [B].
  const bool has_kpm = o.key_padding_mask.data != nullptr, has_len = o.key_lengths.data != nullptr;
  check(!(has_kpm && has_len), ErrorKind::kInvalidArgument,
        "key_padding_mask/key_lengths: give one or the other, not both");
  if (has_kpm) {
    const TensorView& m = o.key_padding_mask;
    check_view(m, "key_padding_mask");
    check(m.dtype == DType::kBool, ErrorKind::kTypeError, "key_padding_mask: expected bool (True = padding), got ",
          to_string(m.dtype));
    check(m.shape == Shape{p.batch, p.len_k}, ErrorKind::kInvalidArgument,
          "key_padding_mask: expected shape [B, Lk] = ", shape_to_string({p.batch, p.len_k}), ", got ",
          shape_to_string(m.shape));
    p.key_padding = KeyPaddingKind::kBool;
  }
  if (has_len) {
    const TensorView& m = o.key_lengths;
    check_view(m, "key_lengths");
    check(m.dtype == DType::kI32 || m.dtype == DType::kI64, ErrorKind::kTypeError,
          "key_lengths: expected int32 or int64, got ", to_string(m.dtype));
    check(m.shape == Shape{p.batch}, ErrorKind::kInvalidArgument, "key_lengths: expected shape [B] = [", p.batch,
          "], got ", shape_to_string(m.shape));
    for (int64_t b = 0; b < p.batch; ++b) {
      const double len = m.get({b});
      check(len >= 0 && len <= double(p.len_k), ErrorKind::kInvalidArgument, "key_lengths[", b,
            "]: expected a length in [0, Lk = ", p.len_k, "], got ", int64_t(len));
    }
    p.key_padding = KeyPaddingKind::kLengths;
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

MaskData make_mask_data(const AttentionProblem& p, const AttentionOptions& o) {
  MaskData md;
  if (p.mask != MaskKind::kNone)
    md.attn_mask =
        TensorView(o.attn_mask.data, o.attn_mask.dtype, {p.batch, p.heads_q, p.len_q, p.len_k}, p.mask_strides);
  if (p.key_padding == KeyPaddingKind::kBool) {
    md.key_padding = static_cast<const uint8_t*>(o.key_padding_mask.data);
    md.kp_stride_b = o.key_padding_mask.strides[0];
    md.kp_stride_k = o.key_padding_mask.strides[1];
  } else if (p.key_padding == KeyPaddingKind::kLengths) {
    md.key_lengths.resize(p.batch);
    for (int64_t b = 0; b < p.batch; ++b) md.key_lengths[b] = int64_t(o.key_lengths.get({b}));
  }
  return md;
}

namespace {

// Picks the kernel for `p` and records the choice in `info`.
const KernelEntry& choose_kernel(const AttentionProblem& p, const AttentionOptions& o, KernelInfo* info) {
  std::string forced = o.kernel;
  if (forced.empty()) forced = env::get("SATTN_KERNEL").value_or("");
  const bool strict = o.strict || env::get_flag("SATTN_STRICT");
  const auto& kernels = registered_kernels();
  KernelInfo local;
  KernelInfo& inf = info ? *info : local;
  inf = {};
  if (!forced.empty() && forced != "auto") {
    for (const auto& k : kernels) {
      if (forced != k.name) continue;
      std::string why;
      check(k.supports(p, &why), ErrorKind::kUnsupported, "kernel: '", forced, "' does not support this problem (",
            p.to_string(), "): ", why);
      inf.kernel = k.name;
      return k;
    }
    std::string names;
    for (const auto& k : kernels) names += std::string(names.empty() ? "" : ", ") + k.name;
    fail(ErrorKind::kInvalidArgument, "kernel: unknown kernel '", forced, "'; expected one of: auto, ", names);
  }
  for (const auto& k : kernels) {
    std::string why;
    if (k.supports(p, &why)) {
      if (strict && std::string(k.name) == "reference") {
        std::string reasons;
        for (const auto& [n, w] : inf.rejected) reasons += message::concat("\n  ", n, ": ", w);
        fail(ErrorKind::kUnsupported, "strict mode (SATTN_STRICT / strict=True): no fast kernel supports ",
             p.to_string(), ", and falling back to the O(L^2) reference is forbidden", reasons);
      }
      inf.kernel = k.name;
      return k;
    }
    inf.rejected.emplace_back(k.name, why.empty() ? "not supported" : why);
  }
  fail(ErrorKind::kInternal, "no kernel supports ", p.to_string());
}

}  // namespace

void scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const AttentionOptions& options, const AttentionOutputs& outputs, KernelInfo* info) {
  AttentionProblem p = describe_attention(q, k, v, options, &outputs);
  const KernelEntry& kernel = choose_kernel(p, options, info);
  ForwardArgs args{p, options, q, k, v, make_mask_data(p, options), outputs, resolve_num_threads(options.num_threads)};
  kernel.forward(args);
}

void scaled_dot_product_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                           const TensorView& v, const TensorView& out, const TensorView& lse,
                                           const AttentionOptions& options, const AttentionGrads& grads,
                                           KernelInfo* info) {
  AttentionOutputs fwd_outputs{out, lse, {}};
  check(out.data != nullptr, ErrorKind::kInvalidArgument, "out: the forward output is required for the backward");
  check(lse.data != nullptr, ErrorKind::kInvalidArgument, "lse: the forward log-sum-exp is required for the backward");
  AttentionProblem p = describe_attention(q, k, v, options, &fwd_outputs);
  p.backward = true;
  const Shape out_shape = {p.batch, p.heads_q, p.len_q, p.head_dim_v};
  check_view(dout, "dout");
  check(dout.shape == out_shape, ErrorKind::kInvalidArgument, "dout: expected shape ", shape_to_string(out_shape),
        ", got ", shape_to_string(dout.shape));
  check(is_floating(dout.dtype), ErrorKind::kTypeError, "dout: expected a float tensor, got ", to_string(dout.dtype));
  check(grads.dq.data && grads.dk.data && grads.dv.data, ErrorKind::kInvalidArgument,
        "dq/dk/dv: all three are required");
  check_output(grads.dq, "dq", q.shape, true);
  check_output(grads.dk, "dk", k.shape, true);
  check_output(grads.dv, "dv", v.shape, true);
  if (grads.dmask.data) {
    check(p.mask == MaskKind::kAdditive, ErrorKind::kInvalidArgument,
          "dmask: only a float (additive) attn_mask has a gradient");
    check_output(grads.dmask, "dmask", p.mask_shape, false);
    p.need_dmask = true;
  }
  const KernelEntry& kernel = choose_kernel(p, options, info);
  check(kernel.backward != nullptr, ErrorKind::kUnsupported, "kernel '", kernel.name, "' has no backward");
  BackwardArgs args{
      p, options, dout, q, k, v, out, lse, make_mask_data(p, options), grads, resolve_num_threads(options.num_threads)};
  kernel.backward(args);
}

AttentionResult attention(const TensorView& q, const TensorView& k, const TensorView& v,
                          const AttentionOptions& options, bool need_lse, bool need_weights) {
  // Describe first so that bad inputs fail before anything is allocated.
  const AttentionProblem p = describe_attention(q, k, v, options);
  const DType out_dtype = q.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  AttentionResult r;
  r.out = Tensor(out_dtype, {p.batch, p.heads_q, p.len_q, p.head_dim_v});
  AttentionOutputs outs{r.out.view(), {}, {}};
  if (need_lse) {
    r.lse = Tensor(out_dtype, {p.batch, p.heads_q, p.len_q});
    outs.lse = r.lse.view();
  }
  if (need_weights) {
    // Refuse before allocating (and touching) a weights tensor that the memory limit would not allow.
    const double bytes = p.score_matrix_bytes(dtype_size(out_dtype));
    const double limit = double(memory_limit_bytes(options.memory_limit_bytes));
    check(bytes <= limit, ErrorKind::kOutOfMemory,
          "weights: the attention weights [B, Hq, Lq, Lk] = ", shape_to_string({p.batch, p.heads_q, p.len_q, p.len_k}),
          " need ", bytes / (1 << 20), " MiB, over the memory limit of ", limit / (1 << 20),
          " MiB (AttentionOptions::memory_limit_bytes; default half of physical memory)");
    r.weights = Tensor(out_dtype, {p.batch, p.heads_q, p.len_q, p.len_k});
    outs.weights = r.weights.view();
  }
  scaled_dot_product_attention(q, k, v, options, outs, &r.info);
  return r;
}

}  // namespace sattn
