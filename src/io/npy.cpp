// NumPy .npy reader and writer (https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html).
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

#include "sattn/io.hpp"

namespace sattn {
namespace {

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  fail(ErrorKind::kIO, "npy file '", path, "': ", why);
}

DType parse_descr(const std::string& path, const std::string& d) {
  if (d == "<f4") return DType::kF32;
  if (d == "<f8") return DType::kF64;
  if (d == "<f2") return DType::kF16;
  if (d == "|b1") return DType::kBool;
  if (d == "<i4") return DType::kI32;
  if (d == "<i8") return DType::kI64;
  if (d == "|u1") return DType::kU8;
  bad(path, "unsupported dtype '" + d + "' (expected <f4, <f8, <f2, |b1, <i4, <i8 or |u1)");
}

const char* descr_of(DType t) {
  switch (t) {
    case DType::kF32: return "<f4";
    case DType::kF64: return "<f8";
    case DType::kF16: return "<f2";
    case DType::kBool: return "|b1";
    case DType::kI32: return "<i4";
    case DType::kI64: return "<i8";
    case DType::kU8: return "|u1";
    case DType::kBF16: return "<V2";  // numpy has no bfloat16; not writable below
  }
  return "";
}

// Extracts the value text of 'key' from the header dict (a Python literal).
std::string dict_value(const std::string& path, const std::string& header, const std::string& key) {
  const std::string k = "'" + key + "'";
  const size_t at = header.find(k);
  if (at == std::string::npos) bad(path, "header has no " + k + ": " + header);
  size_t p = header.find(':', at + k.size());
  if (p == std::string::npos) bad(path, "malformed header: " + header);
  ++p;
  while (p < header.size() && header[p] == ' ') ++p;
  if (p >= header.size()) bad(path, "malformed header: " + header);
  if (header[p] == '\'') {
    const size_t e = header.find('\'', p + 1);
    if (e == std::string::npos) bad(path, "malformed header: " + header);
    return header.substr(p + 1, e - p - 1);
  }
  if (header[p] == '(') {
    const size_t e = header.find(')', p);
    if (e == std::string::npos) bad(path, "malformed header: " + header);
    return header.substr(p + 1, e - p - 1);
  }
  size_t e = p;
  while (e < header.size() && header[e] != ',' && header[e] != '}') ++e;
  return header.substr(p, e - p);
}

}  // namespace

Tensor read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) bad(path, "cannot open for reading");
  char magic[8];
  if (!f.read(magic, 8) || std::memcmp(magic, "\x93NUMPY", 6) != 0) bad(path, "not a .npy file (bad magic)");
  const int major = static_cast<unsigned char>(magic[6]);
  uint32_t header_len = 0;
  if (major == 1) {
    unsigned char b[2];
    if (!f.read(reinterpret_cast<char*>(b), 2)) bad(path, "truncated header");
    header_len = b[0] | (uint32_t(b[1]) << 8);
  } else if (major == 2 || major == 3) {
    unsigned char b[4];
    if (!f.read(reinterpret_cast<char*>(b), 4)) bad(path, "truncated header");
    header_len = b[0] | (uint32_t(b[1]) << 8) | (uint32_t(b[2]) << 16) | (uint32_t(b[3]) << 24);
  } else {
    bad(path, "unsupported format version " + std::to_string(major));
  }
  if (header_len > (1u << 20)) bad(path, "header too long");
  std::string header(header_len, '\0');
  if (!f.read(header.data(), header_len)) bad(path, "truncated header");
  const DType dtype = parse_descr(path, dict_value(path, header, "descr"));
  const std::string order = dict_value(path, header, "fortran_order");
  bool fortran;
  if (order.rfind("True", 0) == 0) fortran = true;
  else if (order.rfind("False", 0) == 0) fortran = false;
  else bad(path, "bad fortran_order '" + order + "'");
  Shape shape;
  {
    std::stringstream ss(dict_value(path, header, "shape"));
    std::string item;
    while (std::getline(ss, item, ',')) {
      size_t a = item.find_first_not_of(" "), b = item.find_last_not_of(" L");
      if (a == std::string::npos) continue;
      const std::string num = item.substr(a, b - a + 1);
      char* end = nullptr;
      const long long v = std::strtoll(num.c_str(), &end, 10);
      if (num.empty() || *end != '\0' || v < 0 || v > (1LL << 40)) bad(path, "bad shape entry '" + num + "'");
      shape.push_back(v);
    }
  }
  if (shape.size() > 32) bad(path, "too many dimensions (" + std::to_string(shape.size()) + ")");
  double total = double(dtype_size(dtype));
  for (int64_t d : shape) total *= double(d);
  if (!strides_fit(shape)) bad(path, "shape " + shape_to_string(shape) + " is too large (its strides exceed 2^52)");
  // Check the payload size against the file before allocating (no absurd allocations from a bad header).
  const auto data_start = f.tellg();
  f.seekg(0, std::ios::end);
  const double available = double(f.tellg() - data_start);
  if (total > available) {
    std::ostringstream os;
    os << "truncated data: shape " << shape_to_string(shape) << " of " << to_string(dtype) << " needs " << total
       << " bytes, the file has " << available;
    bad(path, os.str());
  }
  f.seekg(data_start);
  Tensor t(dtype, shape);
  if (t.nbytes() && !f.read(static_cast<char*>(t.data()), std::streamsize(t.nbytes()))) bad(path, "truncated data");
  if (dtype == DType::kBool)
    for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = t.data<uint8_t>()[i] != 0;
  if (fortran && shape.size() > 1) {
    // Reinterpret as the reversed shape in C order, then transpose into C order.
    Shape rev(shape.rbegin(), shape.rend());
    Shape rev_strides = contiguous_strides(rev);
    Shape strides(rev_strides.rbegin(), rev_strides.rend());
    t = Tensor::from_view(TensorView(t.data(), dtype, shape, strides));
  }
  return t;
}

void write_npy(const std::string& path, const TensorView& tensor) {
  check(tensor.dtype != DType::kBF16, ErrorKind::kTypeError, "write_npy: bfloat16 has no .npy dtype; convert first");
  const Tensor dense = Tensor::from_view(tensor);
  std::string shape = "(";
  for (size_t i = 0; i < dense.shape().size(); ++i) shape += std::to_string(dense.shape()[i]) + ", ";
  if (dense.shape().size() > 1) shape.resize(shape.size() - 2);
  else if (dense.shape().size() == 1) shape.resize(shape.size() - 1);
  shape += ")";
  std::string header = std::string("{'descr': '") + descr_of(dense.dtype()) + "', 'fortran_order': False, 'shape': " +
                       shape + ", }";
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary);
  if (!f) fail(ErrorKind::kIO, "npy file '", path, "': cannot open for writing");
  const uint16_t len = uint16_t(header.size());
  f.write("\x93NUMPY\x01\x00", 8);
  const char lb[2] = {char(len & 0xff), char(len >> 8)};
  f.write(lb, 2);
  f.write(header.data(), std::streamsize(header.size()));
  f.write(static_cast<const char*>(dense.data()), std::streamsize(dense.nbytes()));
  if (!f) fail(ErrorKind::kIO, "npy file '", path, "': write failed");
}

}  // namespace sattn
