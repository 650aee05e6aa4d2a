// Native part of sattn.torch (python/sattn/torch.py): the bodies of its torch.library operators. Each entry point
// takes torch.Tensor objects for its inputs AND its outputs (allocated by the operator in Python, so they are
// torch tensors of the right dtype), wraps them as strided TensorViews without copying (torch_view: data_ptr,
// dtype, shape, stride), and runs the library with the GIL released. Validation is the library's own.
// The SDPA entry points return the name of the kernel that ran.
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bind_common.hpp"
#include "bindings.hpp"
#include "sattn/attention.hpp"
#include "sattn/sparse.hpp"
#include "sattn/varlen.hpp"

namespace sattn::py {
namespace {

namespace pyb = pybind11;
using Obj = const pyb::object&;

AttentionOptions sdpa_options(Obj attn_mask, Obj key_padding_mask, const std::string& causal,
                              std::optional<double> scale, double dropout_p, uint64_t seed, int num_threads,
                              const std::string& float32_precision) {
  AttentionOptions o;
  o.float32_precision = parse_float32_precision(float32_precision);
  o.attn_mask = torch_view(attn_mask, "attn_mask");
  o.key_padding_mask = torch_view(key_padding_mask, "key_padding_mask");
  o.causal = parse_causal(causal, "causal_alignment");
  o.scale = scale;
  o.dropout_p = dropout_p;
  o.seed = seed;
  o.num_threads = num_threads;
  return o;
}

std::string sdpa_forward(Obj q, Obj k, Obj v, Obj attn_mask, Obj key_padding_mask, const std::string& causal,
                         std::optional<double> scale, double dropout_p, uint64_t seed, int num_threads, Obj out,
                         Obj lse, const std::string& float32_precision) {
  const AttentionOptions o =
      sdpa_options(attn_mask, key_padding_mask, causal, scale, dropout_p, seed, num_threads, float32_precision);
  const TensorView qv = torch_view(q, "query"), kv = torch_view(k, "key"), vv = torch_view(v, "value");
  const AttentionOutputs outs{torch_view(out, "out"), torch_view(lse, "lse"), {}};
  KernelInfo info;
  {
    pyb::gil_scoped_release release;
    scaled_dot_product_attention(qv, kv, vv, o, outs, &info);
  }
  return info.kernel;
}

std::string sdpa_backward(Obj dout, Obj q, Obj k, Obj v, Obj out, Obj lse, Obj attn_mask, Obj key_padding_mask,
                          const std::string& causal, std::optional<double> scale, double dropout_p, uint64_t seed,
                          int num_threads, Obj dq, Obj dk, Obj dv, Obj dmask, const std::string& float32_precision) {
  const AttentionOptions o =
      sdpa_options(attn_mask, key_padding_mask, causal, scale, dropout_p, seed, num_threads, float32_precision);
  const TensorView dov = torch_view(dout, "grad_out"), qv = torch_view(q, "query"), kv = torch_view(k, "key"),
                   vv = torch_view(v, "value"), ov = torch_view(out, "out"), lv = torch_view(lse, "lse");
  const AttentionGrads g{torch_view(dq, "dq"), torch_view(dk, "dk"), torch_view(dv, "dv"), torch_view(dmask, "dmask")};
  KernelInfo info;
  {
    pyb::gil_scoped_release release;
    scaled_dot_product_attention_backward(dov, qv, kv, vv, ov, lv, o, g, &info);
  }
  return info.kernel;
}

sparse::SparseOptions sparse_options(std::optional<double> scale, bool enable_gqa, Obj key_padding_mask, int64_t block,
                                     const std::optional<std::vector<float>>& alibi_slopes, double softcap, Obj bias,
                                     Obj rel_pos_bias, int num_threads) {
  sparse::SparseOptions o;
  o.scale = scale;
  o.enable_gqa = enable_gqa;
  o.key_padding_mask = torch_view(key_padding_mask, "key_padding_mask");
  o.block = block;
  if (alibi_slopes) o.alibi_slopes = *alibi_slopes;
  o.softcap = softcap;
  o.bias = torch_view(bias, "bias");
  o.rel_pos_bias = torch_view(rel_pos_bias, "rel_pos_bias");
  o.num_threads = num_threads;
  return o;
}

void sparse_forward(Obj q, Obj k, Obj v, const std::string& pattern, std::optional<double> scale, bool enable_gqa,
                    Obj key_padding_mask, int64_t block, const std::optional<std::vector<float>>& alibi_slopes,
                    double softcap, Obj bias, Obj rel_pos_bias, int num_threads, Obj out, Obj lse, Obj indices,
                    const std::string& float32_precision) {
  const sparse::Pattern p = sparse::Pattern::parse(pattern);
  sparse::SparseOptions o = sparse_options(scale, enable_gqa, key_padding_mask, block, alibi_slopes, softcap, bias,
                                           rel_pos_bias, num_threads);
  o.float32_precision = parse_float32_precision(float32_precision);
  const TensorView qv = torch_view(q, "query"), kv = torch_view(k, "key"), vv = torch_view(v, "value"),
                   ov = torch_view(out, "out"), lv = torch_view(lse, "lse"), iv = torch_view(indices, "indices");
  pyb::gil_scoped_release release;
  sparse::sparse_attention(qv, kv, vv, p, o, ov, lv, iv);
}

void sparse_backward(Obj dout, Obj q, Obj k, Obj v, Obj out, Obj lse, const std::string& pattern,
                     std::optional<double> scale, bool enable_gqa, Obj key_padding_mask, int64_t block,
                     const std::optional<std::vector<float>>& alibi_slopes, double softcap, Obj bias, Obj rel_pos_bias,
                     int num_threads, Obj indices, Obj dq, Obj dk, Obj dv, Obj dbias, Obj drel_pos_bias,
                     const std::string& float32_precision) {
  const sparse::Pattern p = sparse::Pattern::parse(pattern);
  sparse::SparseOptions o = sparse_options(scale, enable_gqa, key_padding_mask, block, alibi_slopes, softcap, bias,
                                           rel_pos_bias, num_threads);
  o.float32_precision = parse_float32_precision(float32_precision);
  const TensorView dov = torch_view(dout, "grad_out"), qv = torch_view(q, "query"), kv = torch_view(k, "key"),
                   vv = torch_view(v, "value"), ov = torch_view(out, "out"), lv = torch_view(lse, "lse"),
                   iv = torch_view(indices, "indices");
  const sparse::SparseGrads g{torch_view(dq, "dq"),
                              torch_view(dk, "dk"),
                              torch_view(dv, "dv"),
                              torch_view(dbias, "dbias"),
                              torch_view(drel_pos_bias, "drel_pos_bias"),
                              {}};
  pyb::gil_scoped_release release;
  sparse::sparse_attention_backward(dov, qv, kv, vv, ov, lv, p, o, g, iv);
}

VarlenOptions varlen_options(bool causal, std::optional<double> scale, int num_threads,
                             const std::string& float32_precision) {
  VarlenOptions o;
  o.causal = causal;
  o.scale = scale;
  o.num_threads = num_threads;
  o.float32_precision = parse_float32_precision(float32_precision);
  return o;
}

void varlen_forward(Obj q, Obj k, Obj v, Obj cu_q, Obj cu_k, int64_t max_q, int64_t max_k, bool causal,
                    std::optional<double> scale, int num_threads, Obj out, Obj lse,
                    const std::string& float32_precision) {
  const TensorView qv = torch_view(q, "q"), kv = torch_view(k, "k"), vv = torch_view(v, "v"),
                   cq = torch_view(cu_q, "cu_seqlens_q"), ck = torch_view(cu_k, "cu_seqlens_k"),
                   ov = torch_view(out, "out"), lv = torch_view(lse, "lse");
  pyb::gil_scoped_release release;
  flash_attn_varlen(qv, kv, vv, cq, ck, max_q, max_k, varlen_options(causal, scale, num_threads, float32_precision), ov,
                    lv);
}

void varlen_backward(Obj dout, Obj q, Obj k, Obj v, Obj out, Obj lse, Obj cu_q, Obj cu_k, int64_t max_q, int64_t max_k,
                     bool causal, std::optional<double> scale, int num_threads, Obj dq, Obj dk, Obj dv,
                     const std::string& float32_precision) {
  const TensorView dov = torch_view(dout, "grad_out"), qv = torch_view(q, "q"), kv = torch_view(k, "k"),
                   vv = torch_view(v, "v"), ov = torch_view(out, "out"), lv = torch_view(lse, "lse"),
                   cq = torch_view(cu_q, "cu_seqlens_q"), ck = torch_view(cu_k, "cu_seqlens_k"),
                   dqv = torch_view(dq, "dq"), dkv = torch_view(dk, "dk"), dvv = torch_view(dv, "dv");
  pyb::gil_scoped_release release;
  flash_attn_varlen_backward(dov, qv, kv, vv, ov, lv, cq, ck, max_q, max_k,
                             varlen_options(causal, scale, num_threads, float32_precision), dqv, dkv, dvv);
}

// Shape of the `indices` output of a sparse pattern ([] when it selects nothing), for the operator's fake kernel.
std::vector<int64_t> sparse_selection_shape(const std::string& pattern, int64_t batch, int64_t heads_q, int64_t len_q,
                                            int64_t len_k) {
  return sparse::selection_shape(sparse::Pattern::parse(pattern), batch, heads_q, len_q, len_k);
}

}  // namespace

void bind_torch(pyb::module_& m) {
  using pyb::arg;
  m.def("_torch_sdpa_forward", &sdpa_forward, arg("query"), arg("key"), arg("value"), arg("attn_mask"),
        arg("key_padding_mask"), arg("causal"), arg("scale"), arg("dropout_p"), arg("seed"), arg("num_threads"),
        arg("out"), arg("lse"), arg("float32_precision") = "highest",
        "Private (sattn.torch): 4-D SDPA forward into out/lse; returns the kernel name.");
  m.def("_torch_sdpa_backward", &sdpa_backward, arg("grad_out"), arg("query"), arg("key"), arg("value"), arg("out"),
        arg("lse"), arg("attn_mask"), arg("key_padding_mask"), arg("causal"), arg("scale"), arg("dropout_p"),
        arg("seed"), arg("num_threads"), arg("dq"), arg("dk"), arg("dv"), arg("dmask"),
        arg("float32_precision") = "highest",
        "Private (sattn.torch): 4-D SDPA backward into dq/dk/dv (and dmask); returns the kernel name.");
  m.def("_torch_sparse_forward", &sparse_forward, arg("query"), arg("key"), arg("value"), arg("pattern"), arg("scale"),
        arg("enable_gqa"), arg("key_padding_mask"), arg("block"), arg("alibi_slopes"), arg("softcap"), arg("bias"),
        arg("rel_pos_bias"), arg("num_threads"), arg("out"), arg("lse"), arg("indices"),
        arg("float32_precision") = "highest",
        "Private (sattn.torch): sparse attention forward into out/lse (and indices).");
  m.def("_torch_sparse_backward", &sparse_backward, arg("grad_out"), arg("query"), arg("key"), arg("value"), arg("out"),
        arg("lse"), arg("pattern"), arg("scale"), arg("enable_gqa"), arg("key_padding_mask"), arg("block"),
        arg("alibi_slopes"), arg("softcap"), arg("bias"), arg("rel_pos_bias"), arg("num_threads"), arg("indices"),
        arg("dq"), arg("dk"), arg("dv"), arg("dbias"), arg("drel_pos_bias"), arg("float32_precision") = "highest",
        "Private (sattn.torch): sparse attention backward into dq/dk/dv (and dbias, drel_pos_bias).");
  m.def("_torch_sparse_selection_shape", &sparse_selection_shape, arg("pattern"), arg("batch"), arg("heads_q"),
        arg("len_q"), arg("len_k"), "Private (sattn.torch): shape of a sparse pattern's indices output.");
  m.def("_torch_varlen_forward", &varlen_forward, arg("q"), arg("k"), arg("v"), arg("cu_seqlens_q"),
        arg("cu_seqlens_k"), arg("max_seqlen_q"), arg("max_seqlen_k"), arg("causal"), arg("scale"), arg("num_threads"),
        arg("out"), arg("lse"), arg("float32_precision") = "highest",
        "Private (sattn.torch): packed variable-length forward into out/lse.");
  m.def("_torch_varlen_backward", &varlen_backward, arg("grad_out"), arg("q"), arg("k"), arg("v"), arg("out"),
        arg("lse"), arg("cu_seqlens_q"), arg("cu_seqlens_k"), arg("max_seqlen_q"), arg("max_seqlen_k"), arg("causal"),
        arg("scale"), arg("num_threads"), arg("dq"), arg("dk"), arg("dv"), arg("float32_precision") = "highest",
        "Private (sattn.torch): packed variable-length backward into dq/dk/dv.");
}

}  // namespace sattn::py
