// Helpers shared by the Python binding files: numpy arrays <-> TensorView/Tensor under one copy rule, torch tensor
// views (see bind_common.hpp).
#include "bind_common.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>

#include "sattn/error.hpp"

namespace pyb = pybind11;

namespace sattn::py {

DType dtype_of(const pyb::dtype& dt, const char* name) {
  check(dt.attr("isnative").cast<bool>(), ErrorKind::kTypeError, name, ": expected the machine's byte order, got ",
        std::string(pyb::str(dt.attr("str"))));
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  if (kind == 'f' && size == 4) return DType::kF32;
  if (kind == 'f' && size == 8) return DType::kF64;
  if (kind == 'f' && size == 2) return DType::kF16;
  if (kind == 'b' && size == 1) return DType::kBool;
  if (kind == 'i' && size == 4) return DType::kI32;
  if (kind == 'i' && size == 8) return DType::kI64;
  if (kind == 'u' && size == 1) return DType::kU8;
  const std::string type_name = pyb::str(dt.attr("name"));
  if (size == 2 && type_name == "bfloat16") return DType::kBF16;
  fail(ErrorKind::kTypeError, name, ": unsupported numpy dtype ", type_name);
}

pyb::dtype numpy_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32: return pyb::dtype::of<float>();
    case DType::kF64: return pyb::dtype::of<double>();
    case DType::kBool: return pyb::dtype::of<bool>();
    case DType::kI32: return pyb::dtype::of<int32_t>();
    case DType::kI64: return pyb::dtype::of<int64_t>();
    case DType::kU8: return pyb::dtype::of<uint8_t>();
    case DType::kF16: return pyb::dtype("float16");
    case DType::kBF16: {
      pyb::object ml_dtypes;
      try {
        ml_dtypes = pyb::module_::import("ml_dtypes");
      } catch (const pyb::error_already_set&) {
        fail(ErrorKind::kTypeError,
             "a bfloat16 result needs numpy's bfloat16 dtype from the ml_dtypes package, "
             "which is not installed (pip install ml_dtypes)");
      }
      return pyb::dtype::from_args(ml_dtypes.attr("bfloat16"));
    }
  }
  fail(ErrorKind::kTypeError, "numpy has no ", to_string(dtype), " dtype");
}

namespace {

// Attribute names as interned Python strings, made once: pybind11's attr("name") builds a str from the C string at
// each call, which showed in profiles of small sattn.torch calls (five reads for each of five or more tensors).
struct TorchNames {
  PyObject* is_cpu = PyUnicode_InternFromString("is_cpu");
  PyObject* dtype = PyUnicode_InternFromString("dtype");
  PyObject* data_ptr = PyUnicode_InternFromString("data_ptr");
  PyObject* shape = PyUnicode_InternFromString("shape");
  PyObject* stride = PyUnicode_InternFromString("stride");
};

const TorchNames& torch_names() {
  static const TorchNames names;  // kept for the interpreter's lifetime (never released)
  return names;
}

pyb::object checked(PyObject* result) {
  if (result == nullptr) throw pyb::error_already_set();
  return pyb::reinterpret_steal<pyb::object>(result);
}

// The int64 items of a tuple (torch.Size is one) returned by `what`.
void tuple_items(const pyb::object& tuple, const char* name, const char* what, Shape& items) {
  check(PyTuple_Check(tuple.ptr()) != 0, ErrorKind::kTypeError, name, ": its ", what, " is not a tuple");
  const Py_ssize_t n = PyTuple_GET_SIZE(tuple.ptr());
  items.resize(static_cast<size_t>(n));
  for (Py_ssize_t d = 0; d < n; ++d) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tuple.ptr(), d));
    if (v == -1 && PyErr_Occurred() != nullptr) throw pyb::error_already_set();
    items[static_cast<size_t>(d)] = v;
  }
}

}  // namespace

TensorView torch_view(const pyb::handle& obj, const char* name) {
  if (obj.is_none()) return {};
  // Called for every tensor of every sattn.torch call: attributes are read through the C API with interned names, no
  // string is made unless there is an error (Tensor.device's type and str build them), and dtypes are torch's dtype
  // objects, compared by identity.
  const TorchNames& names = torch_names();
  if (checked(PyObject_GetAttr(obj.ptr(), names.is_cpu)).ptr() != Py_True) {
    fail(ErrorKind::kUnsupported, name, ": sattn runs on the CPU, got a tensor on device '",
         std::string(pyb::str(obj.attr("device"))), "'");
  }
  // torch's dtype objects live as long as the interpreter: one reference each is kept (released), so that no
  // destructor runs after Python has finalised.
  static const std::array<std::pair<PyObject*, DType>, 8> kTypes = [] {
    const pyb::module_ torch = pyb::module_::import("torch");
    const auto dtype = [&](const char* n, DType t) {
      return std::make_pair(pyb::object(torch.attr(n)).release().ptr(), t);
    };
    return std::array<std::pair<PyObject*, DType>, 8>{dtype("float32", DType::kF32),   dtype("float64", DType::kF64),
                                                      dtype("bfloat16", DType::kBF16), dtype("float16", DType::kF16),
                                                      dtype("bool", DType::kBool),     dtype("int32", DType::kI32),
                                                      dtype("int64", DType::kI64),     dtype("uint8", DType::kU8)};
  }();
  const pyb::object type = checked(PyObject_GetAttr(obj.ptr(), names.dtype));
  const auto* hit = std::find_if(kTypes.begin(), kTypes.end(), [&](const auto& t) { return type.ptr() == t.first; });
  if (hit == kTypes.end())
    fail(ErrorKind::kTypeError, name, ": unsupported tensor dtype ", std::string(pyb::str(type)));
  const DType dtype = hit->second;
  void* const data = PyLong_AsVoidPtr(checked(PyObject_CallMethodNoArgs(obj.ptr(), names.data_ptr)).ptr());
  if (data == nullptr && PyErr_Occurred() != nullptr) throw pyb::error_already_set();
  Shape shape, strides;
  tuple_items(checked(PyObject_GetAttr(obj.ptr(), names.shape)), name, "shape", shape);
  tuple_items(checked(PyObject_CallMethodNoArgs(obj.ptr(), names.stride)), name, "stride()", strides);
  check(strides.size() == shape.size(), ErrorKind::kInvalidArgument, name, ": stride() has ", strides.size(),
        " entries for ", shape.size(), " dimensions");
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) strides[d] = 0;
  }
  const auto address = reinterpret_cast<uintptr_t>(data);
  check(address % dtype_size(dtype) == 0 || numel(shape) == 0, ErrorKind::kInvalidArgument, name,
        ": the data is not aligned to its element size (", dtype_size(dtype), " bytes); pass a .contiguous() copy");
  return TensorView(data, dtype, std::move(shape), std::move(strides));
}

namespace {

// Whether a TensorView can describe `a` as it is (element strides, non-negative, aligned).
bool viewable(const pyb::array& a) {
  const auto item = a.itemsize();
  if (reinterpret_cast<uintptr_t>(a.data()) % uintptr_t(item) != 0) return false;
  for (pyb::ssize_t d = 0; d < a.ndim(); ++d) {
    if (a.shape(d) == 1) continue;  // the stride of a size-1 dimension is never used
    if (a.strides(d) < 0 || a.strides(d) % item != 0) return false;
  }
  return true;
}

}  // namespace

TensorView view_of(const pyb::object& obj, const char* name, ArrayKeeper& keeper) {
  if (obj.is_none()) return {};
  check(pyb::isinstance<pyb::array>(obj), ErrorKind::kTypeError, name, ": expected a numpy array, got ",
        std::string(pyb::str(pyb::type::of(obj).attr("__name__"))));
  pyb::array a = pyb::reinterpret_borrow<pyb::array>(obj);
  const DType dtype = dtype_of(a.dtype(), name);
  if (!viewable(a)) a = pyb::module_::import("numpy").attr("ascontiguousarray")(a).cast<pyb::array>();
  keeper.arrays.push_back(a);
  Shape shape(size_t(a.ndim())), strides(size_t(a.ndim()));
  for (pyb::ssize_t d = 0; d < a.ndim(); ++d) {
    shape[size_t(d)] = a.shape(d);
    strides[size_t(d)] = a.shape(d) == 1 ? 0 : a.strides(d) / a.itemsize();
  }
  return TensorView(const_cast<void*>(a.data()), dtype, std::move(shape), std::move(strides));
}

DType result_dtype(const TensorView& q) { return is_floating(q.dtype) ? q.dtype : DType::kF32; }
DType stats_dtype(const TensorView& q) { return q.dtype == DType::kF64 ? DType::kF64 : DType::kF32; }

pyb::array new_array(DType dtype, const Shape& shape, TensorView* view) {
  std::vector<pyb::ssize_t> dims(shape.begin(), shape.end());
  pyb::array a(numpy_dtype(dtype), dims);
  if (view) *view = TensorView(a.mutable_data(), dtype, shape, contiguous_strides(shape));
  return a;
}

NumpyView numpy_view(const pyb::handle& obj, const char* name) {
  pyb::object a = pyb::module_::import("numpy").attr("asarray")(obj);
  ArrayKeeper keeper;
  const TensorView view = view_of(a, name, keeper);
  return {keeper.arrays.back(), view};
}

NumpyView optional_numpy_view(const pyb::object& obj, const char* name) {
  if (obj.is_none()) return {pyb::array(), TensorView()};
  return numpy_view(obj, name);
}

std::map<std::string, NumpyView> numpy_views(const pyb::dict& d, const char* what) {
  std::map<std::string, NumpyView> out;
  for (const auto& [k, v] : d) {
    check(pyb::isinstance<pyb::str>(k), ErrorKind::kTypeError, what, ": keys must be str, got ",
          std::string(pyb::str(pyb::type::of(k))));
    const std::string name = k.cast<std::string>();
    out.emplace(name, numpy_view(v, (std::string(what) + "['" + name + "']").c_str()));
  }
  return out;
}

pyb::array to_numpy(const Tensor& t) {
  auto* keep = new Tensor(t);
  pyb::capsule owner(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  std::vector<pyb::ssize_t> shape(t.shape().begin(), t.shape().end()), strides;
  for (int64_t s : contiguous_strides(t.shape())) strides.push_back(pyb::ssize_t(s * int64_t(dtype_size(t.dtype()))));
  return pyb::array(numpy_dtype(t.dtype()), shape, strides, t.data(), owner);
}

}  // namespace sattn::py
