// numpy <-> sattn::TensorView / Tensor helpers for the bindings (header-only, used by bind_nn.cpp).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "sattn/tensor.hpp"

namespace sattn::py {

// The sattn dtype of a numpy dtype; throws sattn::Error(kTypeError) naming `what` if there is none.
inline DType dtype_from_numpy(const pybind11::dtype& dt, const char* what) {
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  if (kind == 'f' && size == 4) return DType::kF32;
  if (kind == 'f' && size == 8) return DType::kF64;
  if (kind == 'f' && size == 2) return DType::kF16;
  if (kind == 'b' && size == 1) return DType::kBool;
  if (kind == 'i' && size == 4) return DType::kI32;
  if (kind == 'i' && size == 8) return DType::kI64;
  if (kind == 'u' && size == 1) return DType::kU8;
  fail(ErrorKind::kTypeError, what, ": unsupported numpy dtype '",
       std::string(pybind11::str(static_cast<const pybind11::handle&>(dt))), "'");
}

inline pybind11::dtype numpy_dtype(DType dt) {
  switch (dt) {
    case DType::kF32: return pybind11::dtype("float32");
    case DType::kF64: return pybind11::dtype("float64");
    case DType::kF16: return pybind11::dtype("float16");
    case DType::kBool: return pybind11::dtype("bool");
    case DType::kI32: return pybind11::dtype("int32");
    case DType::kI64: return pybind11::dtype("int64");
    case DType::kU8: return pybind11::dtype("uint8");
    case DType::kBF16: break;
  }
  fail(ErrorKind::kTypeError, "numpy has no ", to_string(dt), " dtype");
}

// A numpy array kept alive together with a TensorView of it. Arrays whose strides are negative or not a
// multiple of the item size are copied to C order first (the only copy).
struct NumpyView {
  pybind11::array array;
  TensorView view;
};

inline NumpyView numpy_view(pybind11::handle obj, const char* what, bool native_byte_order = true) {
  pybind11::array a = pybind11::array::ensure(obj);
  if (!a) fail(ErrorKind::kTypeError, what, ": expected a numpy array (or something numpy.asarray accepts)");
  if (native_byte_order && a.dtype().byteorder() == '>')
    fail(ErrorKind::kTypeError, what, ": big-endian arrays are not supported");
  const DType dt = dtype_from_numpy(a.dtype(), what);
  const auto item = a.itemsize();
  bool ok = true;
  for (pybind11::ssize_t d = 0; d < a.ndim(); ++d)
    if (a.strides(d) < 0 || a.strides(d) % item != 0) ok = false;
  if (!ok) a = pybind11::array::ensure(a, pybind11::array::c_style);
  NumpyView nv{a, {}};
  Shape shape, strides;
  for (pybind11::ssize_t d = 0; d < a.ndim(); ++d) {
    shape.push_back(int64_t(a.shape(d)));
    strides.push_back(int64_t(a.strides(d) / item));
  }
  nv.view = TensorView(const_cast<void*>(a.data()), dt, shape, strides);
  return nv;
}

// A numpy array sharing the tensor's storage (no copy); the array keeps the storage alive.
inline pybind11::array to_numpy(const Tensor& t) {
  auto* keep = new Tensor(t);
  pybind11::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  std::vector<pybind11::ssize_t> shape(t.shape().begin(), t.shape().end()), strides;
  for (int64_t s : contiguous_strides(t.shape())) strides.push_back(pybind11::ssize_t(s * int64_t(dtype_size(t.dtype()))));
  return pybind11::array(numpy_dtype(t.dtype()), shape, strides, t.data(), owner);
}

}  // namespace sattn::py
