// Helpers shared by the Python binding files: numpy arrays <-> TensorView/Tensor (the one set, with one copy rule),
// torch tensors -> TensorView, the thread count.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "sattn/error.hpp"
#include "sattn/tensor.hpp"

namespace sattn::py {

// num_threads argument of a Python call: None -> the module default (set_num_threads, 0 = library default),
// else a positive int (TypeError / ValueError otherwise).
int resolve_python_threads(const pybind11::object& num_threads);
int default_num_threads();

// ---- numpy arrays <-> sattn, one copy rule ---------------------------------------------------------------------
// Inputs are viewed, not copied: a numpy array becomes a TensorView of its own memory (numpy's byte strides as
// element strides) whenever a TensorView can express its layout; one that it cannot (negative strides, strides not
// a multiple of the item size, misaligned data) is copied once, to C order (numpy.ascontiguousarray), and viewed.
// view_of takes numpy arrays only (TypeError naming the argument otherwise); numpy_view first applies
// numpy.asarray. A binding that needs data of its own (a Tensor or an sr::Image kept past the call) copies from
// such a view. Outputs are not copied either: new_array allocates the C-order array a kernel writes into, and
// to_numpy hands a Tensor's storage or a std::vector to numpy, which keeps it alive.

// Keeps the numpy arrays behind views alive (and any copies made to obtain a viewable layout).
struct ArrayKeeper {
  std::vector<pybind11::array> arrays;
};

// numpy dtype -> sattn DType (TypeError naming `name` for anything else; bfloat16 = ml_dtypes.bfloat16).
DType dtype_of(const pybind11::dtype& dt, const char* name);

// The numpy dtype of a sattn dtype (bfloat16: ml_dtypes.bfloat16, a DTypeError when ml_dtypes is missing).
pybind11::dtype numpy_dtype(DType dtype);

// A view of a numpy array, under the copy rule above; `obj` None -> an empty view (absent).
TensorView view_of(const pybind11::object& obj, const char* name, ArrayKeeper& keeper);

// A numpy array (anything numpy.asarray accepts) kept alive together with a TensorView of it.
struct NumpyView {
  pybind11::array array;
  TensorView view;
};
NumpyView numpy_view(const pybind11::handle& obj, const char* name);
// Same, with None -> an empty view (an absent optional argument).
NumpyView optional_numpy_view(const pybind11::object& obj, const char* name);
// A {str: array} dict as views by name; errors name the entry as what['name'].
std::map<std::string, NumpyView> numpy_views(const pybind11::dict& d, const char* what);

// The dtypes of attention outputs, from the query's: out and the gradients keep a floating dtype (half precision
// included: the kernels read and write it natively; float32 otherwise); lse, weights and other statistics are
// float32, float64 for float64 inputs.
DType result_dtype(const TensorView& q);
DType stats_dtype(const TensorView& q);

// A freshly allocated C-order numpy array and, if `view` is given, a view of it (for outputs).
pybind11::array new_array(DType dtype, const Shape& shape, TensorView* view = nullptr);

// A numpy array sharing the tensor's storage (no copy); the array keeps the storage alive.
pybind11::array to_numpy(const Tensor& t);
// Same, typed (a signature and its stub then name the dtype); T must be the tensor's element type.
template <typename T>
pybind11::array_t<T> to_numpy_of(const Tensor& t) {
  check(dtype_of(pybind11::dtype::of<T>(), "to_numpy_of") == t.dtype(), ErrorKind::kInternal,
        "to_numpy_of: the tensor is ", to_string(t.dtype()));
  return pybind11::reinterpret_borrow<pybind11::array_t<T>>(to_numpy(t));
}
// A C-order numpy array of `shape` (default: 1-D) that takes over `data` (no copy); the array keeps it alive.
template <typename T>
pybind11::array_t<T> to_numpy(std::vector<T> data, std::vector<pybind11::ssize_t> shape = {}) {
  if (shape.empty()) shape = {pybind11::ssize_t(data.size())};
  auto* keep = new std::vector<T>(std::move(data));
  const pybind11::capsule owner(keep, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return pybind11::array_t<T>(shape, keep->data(), owner);
}

// ---- torch tensors -------------------------------------------------------------------------------------------
// A view of a torch.Tensor without a copy and without torch's headers: its data_ptr(), dtype, shape and stride()
// (PyTorch strides are in elements, never negative). CPU tensors only (UnsupportedError naming the device).
// The caller keeps the tensor alive while the view is used. `obj` None -> an empty view (absent).
TensorView torch_view(const pybind11::handle& obj, const char* name);

}  // namespace sattn::py
