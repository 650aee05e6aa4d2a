// File formats: NumPy .npy (read/write).
#pragma once

#include <cstddef>
#include <string>

#include "sattn/tensor.hpp"

namespace sattn {

// Reads a .npy file (format 1.0/2.0/3.0; little-endian or byte-order-free dtypes
// <f4 <f8 <f2 |b1 <i4 <i8 |u1; C or Fortran order). Throws sattn::Error(kIO) naming the file and the problem.
Tensor read_npy(const std::string& path);
// Same, from the bytes of a whole .npy file in memory; `name` is used in error messages.
Tensor parse_npy(const void* data, size_t size, const std::string& name = "<memory>");
// Writes `tensor` (any strides) as a C-order .npy file, format 1.0, replacing a regular file atomically
// (docs/reliability.md). Throws sattn::Error(kIO) naming the file when it cannot be written; the old file is then
// untouched.
void write_npy(const std::string& path, const TensorView& tensor);

}  // namespace sattn
