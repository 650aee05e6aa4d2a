// Python bindings of the fused-kernel area: packed variable-length attention (FlashAttention's varlen API).
//   sattn.flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
//                           scale=None, return_lse=False) -> out [total_q, Hq, Dv] (, lse [Hq, total_q])
//   sattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
//                                    max_seqlen_k, causal=False, scale=None) -> (dq, dk, dv)
// Inputs: numpy float32/float64/float16 (or ml_dtypes.bfloat16) arrays, any strides; outputs float32
// (float64 for float64 inputs). The GIL is released while the kernels run.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings.hpp"
#include "sattn/varlen.hpp"

namespace sattn::py {
namespace {
namespace pyb = pybind11;

DType dtype_of(const pyb::array& a, const char* name) {
  const pyb::dtype dt = a.dtype();
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  if (kind == 'f' && size == 4) return DType::kF32;
  if (kind == 'f' && size == 8) return DType::kF64;
  if (kind == 'f' && size == 2) return DType::kF16;
  if (kind == 'b') return DType::kBool;
  if (kind == 'i' && size == 4) return DType::kI32;
  if (kind == 'i' && size == 8) return DType::kI64;
  if (size == 2 && dt.attr("name").cast<std::string>() == "bfloat16") return DType::kBF16;  // ml_dtypes.bfloat16
  throw Error(ErrorKind::kTypeError, detail::concat(name, ": unsupported dtype ", dt.attr("name").cast<std::string>()));
}

TensorView view_of(const pyb::array& a, const char* name) {
  const DType dt = dtype_of(a, name);
  Shape shape, strides;
  for (pyb::ssize_t d = 0; d < a.ndim(); ++d) {
    shape.push_back(a.shape(d));
    const auto st = a.strides(d);
    check(st >= 0 && st % a.itemsize() == 0, ErrorKind::kInvalidArgument, name,
          ": negative or unaligned strides are not supported (got ", st, " bytes)");
    strides.push_back(st / a.itemsize());
  }
  return TensorView(const_cast<void*>(a.data()), dt, shape, strides);
}

pyb::array_t<float> new_f32(const Shape& s) { return pyb::array_t<float>(std::vector<pyb::ssize_t>(s.begin(), s.end())); }
pyb::array_t<double> new_f64(const Shape& s) {
  return pyb::array_t<double>(std::vector<pyb::ssize_t>(s.begin(), s.end()));
}
pyb::array new_out(DType dt, const Shape& s) {
  if (dt == DType::kF64) return new_f64(s);
  return new_f32(s);
}
TensorView out_view(pyb::array& a) { return view_of(a, "out"); }

[[noreturn]] void rethrow(const Error& e) {
  switch (e.kind()) {
    case ErrorKind::kTypeError: throw pyb::type_error(e.what());
    case ErrorKind::kOutOfMemory: throw std::bad_alloc();
    case ErrorKind::kUnsupported: PyErr_SetString(PyExc_NotImplementedError, e.what()); throw pyb::error_already_set();
    default: throw pyb::value_error(e.what());
  }
}

VarlenOptions options(bool causal, std::optional<double> scale) {
  VarlenOptions o;
  o.causal = causal;
  o.scale = scale;
  return o;
}

pyb::object varlen(const pyb::array& q, const pyb::array& k, const pyb::array& v, const pyb::array& cu_q,
                   const pyb::array& cu_k, int64_t max_q, int64_t max_k, bool causal, std::optional<double> scale,
                   bool return_lse) {
  try {
    const TensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
    const TensorView cq = view_of(cu_q, "cu_seqlens_q"), ck = view_of(cu_k, "cu_seqlens_k");
    check(qv.dim() == 3 && vv.dim() == 3, ErrorKind::kInvalidArgument,
          "q/v: expected 3-D arrays [total, H, D], got shapes ", shape_to_string(qv.shape), " and ",
          shape_to_string(vv.shape));
    const DType odt = qv.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    pyb::array out = new_out(odt, {qv.shape[0], qv.shape[1], vv.shape[2]});
    pyb::array lse = new_out(odt, {qv.shape[1], qv.shape[0]});
    const TensorView ov = out_view(out), lv = view_of(lse, "lse");
    {
      pyb::gil_scoped_release release;
      flash_attn_varlen(qv, kv, vv, cq, ck, max_q, max_k, options(causal, scale), ov, lv);
    }
    if (return_lse) return pyb::make_tuple(out, lse);
    return out;
  } catch (const Error& e) {
    rethrow(e);
  }
}

pyb::tuple varlen_backward(const pyb::array& dout, const pyb::array& q, const pyb::array& k, const pyb::array& v,
                           const pyb::array& out, const pyb::array& lse, const pyb::array& cu_q, const pyb::array& cu_k,
                           int64_t max_q, int64_t max_k, bool causal, std::optional<double> scale) {
  try {
    const TensorView qv = view_of(q, "q"), kv = view_of(k, "k"), vv = view_of(v, "v");
    const TensorView dov = view_of(dout, "dout"), ov = view_of(out, "out"), lv = view_of(lse, "lse");
    const TensorView cq = view_of(cu_q, "cu_seqlens_q"), ck = view_of(cu_k, "cu_seqlens_k");
    const DType odt = qv.dtype == DType::kF64 ? DType::kF64 : DType::kF32;
    pyb::array dq = new_out(odt, qv.shape), dk = new_out(odt, kv.shape), dv = new_out(odt, vv.shape);
    const TensorView dqv = view_of(dq, "dq"), dkv = view_of(dk, "dk"), dvv = view_of(dv, "dv");
    {
      pyb::gil_scoped_release release;
      flash_attn_varlen_backward(dov, qv, kv, vv, ov, lv, cq, ck, max_q, max_k, options(causal, scale), dqv, dkv, dvv);
    }
    return pyb::make_tuple(dq, dk, dv);
  } catch (const Error& e) {
    rethrow(e);
  }
}

}  // namespace

void bind_fused(pybind11::module_& m) {
  using namespace pybind11::literals;
  m.def("flash_attn_varlen", &varlen, "q"_a, "k"_a, "v"_a, "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a,
        "max_seqlen_k"_a, "causal"_a = false, "scale"_a = pybind11::none(), "return_lse"_a = false,
        "Attention over packed variable-length sequences (FlashAttention's varlen convention; causal is "
        "bottom-right within each sequence). q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; "
        "returns out [total_q, Hq, Dv] and, with return_lse=True, (out, lse [Hq, total_q]).");
  m.def("flash_attn_varlen_backward", &varlen_backward, "dout"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a,
        "cu_seqlens_q"_a, "cu_seqlens_k"_a, "max_seqlen_q"_a, "max_seqlen_k"_a, "causal"_a = false,
        "scale"_a = pybind11::none(), "Gradients (dq, dk, dv) of flash_attn_varlen from its out and lse.");
}

}  // namespace sattn::py
