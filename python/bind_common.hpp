// Helpers shared by the Python binding files (numpy <-> TensorView, thread count, exceptions).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

#include "sattn/tensor.hpp"

namespace sattn::py {

// num_threads argument of a Python call: None -> the module default (set_num_threads, 0 = library default),
// else a positive int (TypeError / ValueError otherwise).
int resolve_python_threads(const pybind11::object& num_threads);
int default_num_threads();

// Keeps the numpy arrays behind views alive (and any copies made to obtain a viewable layout).
struct ArrayKeeper {
  std::vector<pybind11::array> arrays;
};

// numpy dtype -> sattn DType (TypeError naming `name` for anything else; bfloat16 = ml_dtypes.bfloat16).
DType dtype_of(const pybind11::dtype& dt, const char* name);

// A view of a torch.Tensor without a copy and without torch's headers: its data_ptr(), dtype, shape and stride()
// (PyTorch strides are in elements, never negative). CPU tensors only (UnsupportedError naming the device).
// The caller keeps the tensor alive while the view is used. `obj` None -> an empty view (absent).
TensorView torch_view(const pybind11::handle& obj, const char* name);

// A zero-copy view of a numpy array: numpy's byte strides become element strides. Arrays whose layout a
// TensorView cannot express (negative or non-multiple-of-itemsize strides, misaligned data) are first copied
// to C order. `obj` None -> an empty view (absent).
TensorView view_of(const pybind11::object& obj, const char* name, ArrayKeeper& keeper);

// A freshly allocated C-order numpy array and a view of it (for outputs).
pybind11::array new_array(DType dtype, const Shape& shape, TensorView* view);

// The numpy dtype of a sattn dtype (bfloat16: ml_dtypes.bfloat16, a DTypeError when ml_dtypes is missing).
pybind11::dtype numpy_dtype(DType dtype);

// A numpy array (anything numpy.asarray accepts) kept alive together with a TensorView of it.
struct NumpyView {
  pybind11::array array;
  TensorView view;
};
NumpyView numpy_view(const pybind11::handle& obj, const char* name);

// A numpy array sharing the tensor's storage (no copy); the array keeps the storage alive.
pybind11::array to_numpy(const Tensor& t);

}  // namespace sattn::py
