// File format: safetensors (https://huggingface.co/docs/safetensors), read and write.
//
// Layout: 8-byte little-endian header length N, N bytes of UTF-8 JSON
//   {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}},
// then the byte buffer; offsets are relative to the buffer start, data is little-endian, C order.
// Supported dtypes: F32 F64 F16 BF16 I64 I32 BOOL U8.
#pragma once

#include <map>
#include <string>

#include "sattn/tensor.hpp"

namespace sattn {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;        // name -> dense tensor (dtype as stored)
  std::map<std::string, std::string> metadata;  // the optional "__metadata__" string map
};

// Reads a whole safetensors file. Validates everything before trusting it: header length within the
// file (and <= 100 MB), valid JSON object, known dtypes, non-negative shapes, offsets inside the buffer,
// byte size == numel(shape) * dtype size, no overlapping tensors, no holes and no trailing bytes
// (as the reference implementation). Any problem throws sattn::Error(kIO) naming the file and the problem.
SafetensorsFile read_safetensors(const std::string& path);

// Same, from bytes in memory; `name` is used in error messages.
SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& name = "<memory>");

// Writes `tensors` (any strides; dtypes as above) in name order, header padded with spaces to 8 bytes.
// A regular file is replaced atomically (docs/reliability.md). Throws sattn::Error(kIO) naming the file when it
// cannot be written; the old file is then untouched.
void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// "F32", "BF16", ... for a DType, and the inverse (throws kIO on an unknown name).
const char* safetensors_dtype_name(DType dtype);

}  // namespace sattn
