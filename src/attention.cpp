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
#include "core/view_checks.hpp"
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
  if (has_positions())
    s +=
        message::concat(" positions=", query_offset, "+", position_stride, "i,", key_offset, "+", position_stride, "j");
  if (backward) s += " backward";
  return s;
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
    for (int64_t b = 0; b < p.batch; ++b) {
      // Global lengths of a shard become local ones: key j is padding iff key_position(j) >= length.
      const int64_t over = int64_t(o.key_lengths.get({b})) - p.key_offset;
      const int64_t local = over <= 0 ? 0 : (over + p.position_stride - 1) / p.position_stride;
      md.key_lengths[b] = std::min(local, p.len_k);
    }
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
  check(dout.shape == out_shape, ErrorKind::kInvalidArgument, "dout: expected shape ", shape_text(out_shape), ", got ",
        shape_text(dout.shape));
  check(is_floating(dout.dtype), ErrorKind::kTypeError, "dout: expected a float tensor, got ", to_string(dout.dtype));
  check(grads.dq.data && grads.dk.data && grads.dv.data, ErrorKind::kInvalidArgument,
        "dq/dk/dv: all three are required");
  check_output(grads.dq, "dq", q.shape, true);
  check_output(grads.dk, "dk", k.shape, true);
  check_output(grads.dv, "dv", v.shape, true);
  if (grads.dmask.data) {
    check(p.mask == MaskKind::kAdditive, ErrorKind::kInvalidArgument,
          "dmask: only a float (additive) attn_mask has a gradient");
    check_output(grads.dmask, "dmask", p.mask_shape, true);
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
          "weights: the attention weights [B, Hq, Lq, Lk] = ", shape_text({p.batch, p.heads_q, p.len_q, p.len_k}),
          " need ", bytes / (1 << 20), " MiB, over the memory limit of ", limit / (1 << 20),
          " MiB (AttentionOptions::memory_limit_bytes; default half of physical memory)");
    r.weights = Tensor(out_dtype, {p.batch, p.heads_q, p.len_q, p.len_k});
    outs.weights = r.weights.view();
  }
  scaled_dot_product_attention(q, k, v, options, outs, &r.info);
  return r;
}

}  // namespace sattn
