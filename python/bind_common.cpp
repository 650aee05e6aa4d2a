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

TensorView torch_view(const pyb::handle& obj, const char* name) {
  if (obj.is_none()) return {};
  // Called for every tensor of every sattn.torch call: no string is made unless there is an error (Tensor.device's
  // type and str build them), and dtypes are torch's dtype objects, compared by identity.
  if (!obj.attr("is_cpu").cast<bool>()) {
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
  const pyb::object type = obj.attr("dtype");
  const auto* hit = std::find_if(kTypes.begin(), kTypes.end(), [&](const auto& t) { return type.ptr() == t.first; });
  if (hit == kTypes.end())
    fail(ErrorKind::kTypeError, name, ": unsupported tensor dtype ", std::string(pyb::str(type)));
  const DType dtype = hit->second;
  const auto data = obj.attr("data_ptr")().cast<uintptr_t>();
  const pyb::tuple sizes = obj.attr("shape"), steps = obj.attr("stride")();
  Shape shape, strides;
  for (size_t d = 0; d < sizes.size(); ++d) {
    shape.push_back(sizes[d].cast<int64_t>());
    strides.push_back(shape.back() == 1 ? 0 : steps[d].cast<int64_t>());
  }
  check(data % dtype_size(dtype) == 0 || numel(shape) == 0, ErrorKind::kInvalidArgument, name,
        ": the data is not aligned to its element size (", dtype_size(dtype), " bytes); pass a .contiguous() copy");
  return TensorView(reinterpret_cast<void*>(data), dtype, std::move(shape), std::move(strides));
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
