// Native part of sattn.scaled_dot_product_attention & co. The user-facing functions (argument checking,
// PyTorch's leading-dimension forms, enable_gqa, half-precision handling) live in python/sattn/_attention.py;
// these private entry points take 4-D numpy arrays [B, H, L, E], wrap them as strided TensorViews without
// copying, allocate the outputs with numpy, and run the library with the GIL released.
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <string>
#include <utility>

#include "bind_common.hpp"
#include "bindings.hpp"
#include "core/memory.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/simd.hpp"

namespace pyb = pybind11;

namespace sattn::py {

namespace {

// The options every private entry point takes, in one place (after the arrays).
AttentionOptions make_options(const TensorView& attn_mask, const TensorView& key_padding_mask,
                              const TensorView& key_lengths, const std::string& causal, std::optional<double> scale,
                              double dropout_p, uint64_t seed, const std::optional<std::string>& kernel, bool strict,
                              const pyb::object& num_threads, const std::string& float32_precision) {
  AttentionOptions o;
  o.float32_precision = parse_float32_precision(float32_precision);
  o.attn_mask = attn_mask;
  o.key_padding_mask = key_padding_mask;
  o.key_lengths = key_lengths;
  o.causal = parse_causal(causal, "causal_alignment");
  o.scale = scale;
  o.dropout_p = dropout_p;
  o.seed = seed;
  o.kernel = kernel.value_or("");
  o.strict = strict;
  o.num_threads = resolve_python_threads(num_threads);
  return o;
}

// (query_offset, key_offset, position_stride): a shard's global positions (AttentionOptions).
using Positions = std::tuple<int64_t, int64_t, int64_t>;
void set_positions(AttentionOptions& o, const Positions& p) {
  o.query_offset = std::get<0>(p);
  o.key_offset = std::get<1>(p);
  o.position_stride = std::get<2>(p);
}

pyb::tuple forward(const pyb::object& q_obj, const pyb::object& k_obj, const pyb::object& v_obj,
                   const pyb::object& mask_obj, const pyb::object& kpm_obj, const pyb::object& len_obj,
                   const std::string& causal, std::optional<double> scale, double dropout_p, uint64_t seed,
                   const std::optional<std::string>& kernel, bool strict, const pyb::object& num_threads, bool need_lse,
                   bool need_weights, const std::string& float32_precision, const Positions& positions) {
  ArrayKeeper keep;
  const TensorView q = view_of(q_obj, "query", keep), k = view_of(k_obj, "key", keep),
                   v = view_of(v_obj, "value", keep);
  AttentionOptions o = make_options(view_of(mask_obj, "attn_mask", keep), view_of(kpm_obj, "key_padding_mask", keep),
                                    view_of(len_obj, "key_lengths", keep), causal, scale, dropout_p, seed, kernel,
                                    strict, num_threads, float32_precision);
  set_positions(o, positions);
  // Validate before allocating anything (sizes come from the validated problem).
  const AttentionProblem p = describe_attention(q, k, v, o);
  const DType dt = stats_dtype(q);
  AttentionOutputs outs;
  pyb::object out = new_array(result_dtype(q), {p.batch, p.heads_q, p.len_q, p.head_dim_v}, &outs.out);
  pyb::object lse = pyb::none(), weights = pyb::none();
  if (need_lse) lse = new_array(dt, {p.batch, p.heads_q, p.len_q}, &outs.lse);
  if (need_weights) {
    // The same limit as the reference kernel's, checked before numpy allocates.
    const double bytes = p.score_matrix_bytes(dtype_size(dt)), limit = double(memory_limit_bytes(o.memory_limit_bytes));
    check(bytes <= limit, ErrorKind::kOutOfMemory,
          "attention weights: [B, Hq, Lq, Lk] = ", shape_text({p.batch, p.heads_q, p.len_q, p.len_k}), " needs ",
          bytes / (1 << 20), " MiB, over the memory limit of ", limit / (1 << 20),
          " MiB (default: half of physical memory)");
    weights = new_array(dt, {p.batch, p.heads_q, p.len_q, p.len_k}, &outs.weights);
  }
  KernelInfo info;
  {
    pyb::gil_scoped_release release;  // no Python object is touched below
    scaled_dot_product_attention(q, k, v, o, outs, &info);
  }
  return pyb::make_tuple(out, lse, weights, info.kernel);
}

pyb::tuple backward(const pyb::object& dout_obj, const pyb::object& q_obj, const pyb::object& k_obj,
                    const pyb::object& v_obj, const pyb::object& out_obj, const pyb::object& lse_obj,
                    const pyb::object& mask_obj, const pyb::object& kpm_obj, const pyb::object& len_obj,
                    const std::string& causal, std::optional<double> scale, double dropout_p, uint64_t seed,
                    const std::optional<std::string>& kernel, bool strict, const pyb::object& num_threads,
                    bool need_dmask, const std::string& float32_precision, const Positions& positions) {
  ArrayKeeper keep;
  const TensorView dout = view_of(dout_obj, "dout", keep), q = view_of(q_obj, "query", keep),
                   k = view_of(k_obj, "key", keep), v = view_of(v_obj, "value", keep),
                   out = view_of(out_obj, "out", keep), lse = view_of(lse_obj, "lse", keep);
  AttentionOptions o = make_options(view_of(mask_obj, "attn_mask", keep), view_of(kpm_obj, "key_padding_mask", keep),
                                    view_of(len_obj, "key_lengths", keep), causal, scale, dropout_p, seed, kernel,
                                    strict, num_threads, float32_precision);
  set_positions(o, positions);
  const AttentionOutputs fwd{out, lse, {}};
  const AttentionProblem p = describe_attention(q, k, v, o, &fwd);
  const DType dt = result_dtype(q);
  AttentionGrads g;
  pyb::object dq = new_array(dt, q.shape, &g.dq), dk = new_array(dt, k.shape, &g.dk),
              dv = new_array(dt, v.shape, &g.dv);
  pyb::object dmask = pyb::none();
  if (need_dmask && p.mask == MaskKind::kAdditive) dmask = new_array(stats_dtype(q), p.mask_shape, &g.dmask);
  KernelInfo info;
  {
    pyb::gil_scoped_release release;
    scaled_dot_product_attention_backward(dout, q, k, v, out, lse, o, g, &info);
  }
  return pyb::make_tuple(dq, dk, dv, dmask, info.kernel);
}

pyb::tuple explain(const pyb::object& q_obj, const pyb::object& k_obj, const pyb::object& v_obj,
                   const pyb::object& mask_obj, const pyb::object& kpm_obj, const pyb::object& len_obj,
                   const std::string& causal, std::optional<double> scale, double dropout_p, uint64_t seed,
                   bool is_backward, bool need_lse, bool need_weights, bool need_dmask,
                   const std::string& float32_precision) {
  ArrayKeeper keep;
  const TensorView q = view_of(q_obj, "query", keep), k = view_of(k_obj, "key", keep),
                   v = view_of(v_obj, "value", keep);
  const AttentionOptions o =
      make_options(view_of(mask_obj, "attn_mask", keep), view_of(kpm_obj, "key_padding_mask", keep),
                   view_of(len_obj, "key_lengths", keep), causal, scale, dropout_p, seed, std::nullopt, false,
                   pyb::none(), float32_precision);
  AttentionProblem p = describe_attention(q, k, v, o);
  p.backward = is_backward;
  p.need_lse = need_lse || is_backward;
  p.need_weights = need_weights && !is_backward;
  p.need_dmask = is_backward && need_dmask && p.mask == MaskKind::kAdditive;
  pyb::list kernels;
  for (const auto& [name, why] : explain_kernels(p))
    kernels.append(pyb::make_tuple(name, why.empty() ? pyb::object(pyb::none()) : pyb::object(pyb::str(why))));
  pyb::list targets;
  for (const auto& [name, why] : explain_simd_targets(p, o.float32_precision))
    targets.append(pyb::make_tuple(name, why.empty() ? pyb::object(pyb::none()) : pyb::object(pyb::str(why))));
  return pyb::make_tuple(p.to_string(), kernels, targets);
}

// (shape, dtype name) or None -> a TensorSpec.
std::optional<TensorSpec> spec_of(const pyb::object& obj) {
  if (obj.is_none()) return std::nullopt;
  const auto [shape, dtype] = obj.cast<std::pair<Shape, std::string>>();
  return TensorSpec{shape, dtype};
}

pyb::dict describe(const pyb::object& q, const pyb::object& k, const pyb::object& v, const pyb::object& attn_mask,
                   const pyb::object& key_padding_mask, const pyb::object& key_lengths, const std::string& causal,
                   std::optional<double> scale, double dropout_p, bool enable_gqa) {
  SdpaSpec c;
  c.query = *spec_of(q);
  c.key = *spec_of(k);
  c.value = *spec_of(v);
  c.attn_mask = spec_of(attn_mask);
  c.key_padding_mask = spec_of(key_padding_mask);
  c.key_lengths = spec_of(key_lengths);
  c.enable_gqa = enable_gqa;
  c.causal = parse_causal(causal, "causal_alignment");
  c.scale = scale;
  c.dropout_p = dropout_p;
  const SdpaDescription d = describe_sdpa(c);
  const AttentionProblem& p = d.problem;
  pyb::dict r;
  r["batch_dims"] = pyb::tuple(pyb::cast(d.batch_dims));
  r["batch"] = p.batch;
  r["heads_q"] = p.heads_q;
  r["heads_kv"] = p.heads_kv;
  r["len_q"] = p.len_q;
  r["len_k"] = p.len_k;
  r["head_dim"] = p.head_dim;
  r["head_dim_v"] = p.head_dim_v;
  r["scale"] = p.scale;
  r["problem"] = p.to_string();
  return r;
}

}  // namespace

void bind_attention(pyb::module_& m) {
  using pyb::arg;
  m.def("_forward", &forward, arg("query"), arg("key"), arg("value"), arg("attn_mask"), arg("key_padding_mask"),
        arg("key_lengths"), arg("causal"), arg("scale"), arg("dropout_p"), arg("seed"), arg("kernel"), arg("strict"),
        arg("num_threads"), arg("need_lse"), arg("need_weights"), arg("float32_precision") = "highest",
        arg("positions") = Positions{0, 0, 1},
        "Private: 4-D forward. Returns (out, lse or None, weights or None, kernel name).");
  m.def("_backward", &backward, arg("dout"), arg("query"), arg("key"), arg("value"), arg("out"), arg("lse"),
        arg("attn_mask"), arg("key_padding_mask"), arg("key_lengths"), arg("causal"), arg("scale"), arg("dropout_p"),
        arg("seed"), arg("kernel"), arg("strict"), arg("num_threads"), arg("need_dmask"),
        arg("float32_precision") = "highest", arg("positions") = Positions{0, 0, 1},
        "Private: 4-D backward. Returns (dq, dk, dv, dmask or None, kernel name).");
  m.def("_explain", &explain, arg("query"), arg("key"), arg("value"), arg("attn_mask"), arg("key_padding_mask"),
        arg("key_lengths"), arg("causal"), arg("scale"), arg("dropout_p"), arg("seed"), arg("backward"),
        arg("need_lse"), arg("need_weights"), arg("need_dmask"), arg("float32_precision") = "highest",
        "Private: (problem description, [(kernel, None if eligible else why not)] in registry order, [(SIMD target,\n"
        "None if the fused kernel would run its build else why not)] widest first).");
  m.def(
      "_describe", &describe, arg("query"), arg("key"), arg("value"), arg("attn_mask"), arg("key_padding_mask"),
      arg("key_lengths"), arg("causal"), arg("scale"), arg("dropout_p"), arg("enable_gqa"),
      "Private: validates a call of PyTorch's layout given by (shape, dtype name) pairs (None = absent); returns its\n"
      "4-D problem's sizes as a dict. The checks and messages are describe_attention's.");
}

}  // namespace sattn::py
