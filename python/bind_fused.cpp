// Python bindings of the fused-kernel area: packed variable-length attention (FlashAttention's varlen API).
//   sattn.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
//                           scale=None, return_lse=False, float32_precision="highest")
//       -> out [total_q, Hq, Dv] (, lse [Hq, total_q])
//   sattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
//                                    max_seqlen_k, causal=False, scale=None, float32_precision="highest")
//       -> (dq, dk, dv)
// Inputs: numpy float32/float64/float16 (or ml_dtypes.bfloat16) arrays, any strides (no copy where a strided view
// can describe them); out and the gradients have the inputs' dtype, lse is float32 (float64 for float64 inputs).
// The GIL is released while the kernels run.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bind_common.hpp"
#include "bindings.hpp"
#include "sattn/varlen.hpp"

namespace sattn::py {
namespace {
namespace pyb = pybind11;

VarlenOptions options(bool causal, std::optional<double> scale, const std::string& float32_precision) {
  VarlenOptions o;
  o.causal = causal;
  o.scale = scale;
  o.float32_precision = parse_float32_precision(float32_precision);
  return o;
}

pyb::object varlen(const pyb::object& q, const pyb::object& k, const pyb::object& v, const pyb::object& cu_q,
                   const pyb::object& cu_k, int64_t max_q, int64_t max_k, bool causal, std::optional<double> scale,
                   bool return_lse, const std::string& float32_precision) {
  const VarlenOptions o = options(causal, scale, float32_precision);
  ArrayKeeper keep;
  const TensorView qv = view_of(q, "q", keep), kv = view_of(k, "k", keep), vv = view_of(v, "v", keep);
  const TensorView cq = view_of(cu_q, "cu_seqlens_q", keep), ck = view_of(cu_k, "cu_seqlens_k", keep);
  check(qv.dim() == 3 && vv.dim() == 3, ErrorKind::kInvalidArgument,
        "q/v: expected 3-D arrays [total, H, D], got shapes ", shape_text(qv.shape), " and ", shape_text(vv.shape));
  TensorView ov, lv;
  pyb::array out = new_array(qv.dtype, {qv.shape[0], qv.shape[1], vv.shape[2]}, &ov);
  pyb::array lse = new_array(stats_dtype(qv), {qv.shape[1], qv.shape[0]}, &lv);
  {
    pyb::gil_scoped_release release;
    flash_attn_varlen(qv, kv, vv, cq, ck, max_q, max_k, o, ov, lv);
  }
  if (return_lse) return pyb::make_tuple(out, lse);
  return out;
}

pyb::tuple varlen_backward(const pyb::object& dout, const pyb::object& q, const pyb::object& k, const pyb::object& v,
                           const pyb::object& out, const pyb::object& lse, const pyb::object& cu_q,
                           const pyb::object& cu_k, int64_t max_q, int64_t max_k, bool causal,
                           std::optional<double> scale, const std::string& float32_precision) {
  const VarlenOptions o = options(causal, scale, float32_precision);
  ArrayKeeper keep;
  const TensorView qv = view_of(q, "q", keep), kv = view_of(k, "k", keep), vv = view_of(v, "v", keep);
  const TensorView dov = view_of(dout, "dout", keep), ov = view_of(out, "out", keep), lv = view_of(lse, "lse", keep);
  const TensorView cq = view_of(cu_q, "cu_seqlens_q", keep), ck = view_of(cu_k, "cu_seqlens_k", keep);
  TensorView dqv, dkv, dvv;
  pyb::array dq = new_array(qv.dtype, qv.shape, &dqv), dk = new_array(kv.dtype, kv.shape, &dkv),
             dv = new_array(vv.dtype, vv.shape, &dvv);
  {
    pyb::gil_scoped_release release;
    flash_attn_varlen_backward(dov, qv, kv, vv, ov, lv, cq, ck, max_q, max_k, o, dqv, dkv, dvv);
  }
  return pyb::make_tuple(dq, dk, dv);
}

}  // namespace

void bind_fused(pybind11::module_& m) {
  using namespace pybind11::literals;
  m.def("flash_attn_varlen", &varlen, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a,
        "max_seqlen_k"_a, "causal"_a = false, "scale"_a = pybind11::none(), "return_lse"_a = false,
        "float32_precision"_a = "highest",
        "Attention over packed variable-length sequences (FlashAttention's varlen convention; causal is "
        "bottom-right within each sequence). q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; "
        "returns out [total_q, Hq, Dv] and, with return_lse=True, (out, lse [Hq, total_q]). "
        "float32_precision as in scaled_dot_product_attention ('highest', 'high' or 'bf16').");
  m.def("flash_attn_varlen_backward", &varlen_backward, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a,
        "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a, "max_seqlen_k"_a, "causal"_a = false,
        "scale"_a = pybind11::none(), "float32_precision"_a = "highest",
        "Gradients (dq, dk, dv) of flash_attn_varlen from its out and lse.");
}

}  // namespace sattn::py
