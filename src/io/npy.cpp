// NumPy .npy reader and writer (https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html).
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sstream>

#include "io/writers.hpp"
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

// What the start of a .npy file says: the dtype, shape and order of the data and where the data starts.
struct Header {
  DType dtype = DType::kF32;
  Shape shape;
  bool fortran = false;
  size_t data_start = 0;
};

// The header dict is at most 1 MiB.
constexpr size_t kMaxHeaderBytes = size_t(1) << 20;

// Where the header dict lies, from the magic string, version and length fields at the start of the file (its
// first 12 bytes, or all of a shorter file).
struct DictRange {
  size_t start = 0, length = 0;
};
DictRange dict_range(const std::string& path, const char* bytes, size_t size) {
  if (size < 8 || std::memcmp(bytes, "\x93NUMPY", 6) != 0) bad(path, "not a .npy file (bad magic)");
  const auto* b = reinterpret_cast<const unsigned char*>(bytes);
  const int major = b[6];
  DictRange r;
  if (major == 1) {
    r.start = 10;
    if (size < r.start) bad(path, "truncated header");
    r.length = b[8] | (size_t(b[9]) << 8);
  } else if (major == 2 || major == 3) {
    r.start = 12;
    if (size < r.start) bad(path, "truncated header");
    r.length = b[8] | (size_t(b[9]) << 8) | (size_t(b[10]) << 16) | (size_t(b[11]) << 24);
  } else {
    bad(path, "unsupported format version " + std::to_string(major));
  }
  if (r.length > kMaxHeaderBytes) bad(path, "header too long");
  return r;
}

// Parses the header from the first `size` bytes of a .npy file (at least up to the data, or the whole file).
Header parse_header(const std::string& path, const char* bytes, size_t size) {
  const DictRange r = dict_range(path, bytes, size);
  if (size - r.start < r.length) bad(path, "truncated header");
  const std::string header(bytes + r.start, r.length);
  Header h;
  h.data_start = r.start + r.length;
  h.dtype = parse_descr(path, dict_value(path, header, "descr"));
  const std::string order = dict_value(path, header, "fortran_order");
  if (order.rfind("True", 0) == 0) h.fortran = true;
  else if (order.rfind("False", 0) == 0) h.fortran = false;
  else bad(path, "bad fortran_order '" + order + "'");
  std::stringstream ss(dict_value(path, header, "shape"));
  std::string item;
  while (std::getline(ss, item, ',')) {
    size_t a = item.find_first_not_of(" "), e = item.find_last_not_of(" L");
    if (a == std::string::npos) continue;
    const std::string num = item.substr(a, e - a + 1);
    char* end = nullptr;
    const long long v = std::strtoll(num.c_str(), &end, 10);
    if (num.empty() || *end != '\0' || v < 0 || v > (1LL << 40)) bad(path, "bad shape entry '" + num + "'");
    h.shape.push_back(v);
  }
  if (h.shape.size() > 32) bad(path, "too many dimensions (" + std::to_string(h.shape.size()) + ")");
  // Even an empty array must have strides that fit in int64.
  if (!strides_fit(h.shape)) bad(path, "shape " + shape_to_string(h.shape) + " is too large (its strides exceed 2^52)");
  return h;
}

// Checks the payload size against the bytes after the header before anything is allocated (no absurd
// allocations from a bad header).
void check_data_size(const std::string& path, const Header& h, double available) {
  double total = double(dtype_size(h.dtype));
  for (int64_t d : h.shape) total *= double(d);
  if (total > available) {
    std::ostringstream os;
    os << "truncated data: shape " << shape_to_string(h.shape) << " of " << to_string(h.dtype) << " needs " << total
       << " bytes, the file has " << available;
    bad(path, os.str());
  }
}

// The tensor as numpy means it, from `t` holding the file's data bytes.
Tensor finish(Tensor t, const Header& h) {
  if (h.dtype == DType::kBool)
    for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = t.data<uint8_t>()[i] != 0;
  if (h.fortran && h.shape.size() > 1) {
    // Reinterpret as the reversed shape in C order, then transpose into C order.
    Shape rev(h.shape.rbegin(), h.shape.rend());
    Shape rev_strides = contiguous_strides(rev);
    Shape strides(rev_strides.rbegin(), rev_strides.rend());
    t = Tensor::from_view(TensorView(t.data(), h.dtype, h.shape, strides));
  }
  return t;
}

}  // namespace

Tensor parse_npy(const void* data, size_t size, const std::string& name) {
  const char* bytes = static_cast<const char*>(data);
  const Header h = parse_header(name, bytes, size);
  check_data_size(name, h, double(size - h.data_start));
  Tensor t(h.dtype, h.shape);
  if (t.nbytes()) std::memcpy(t.data(), bytes + h.data_start, t.nbytes());
  return finish(std::move(t), h);
}

Tensor read_npy(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) bad(path, "cannot open for reading");
  // The fixed fields first, then the header they announce (the data is read once, into the tensor).
  std::string preamble(12, '\0');
  f.read(preamble.data(), std::streamsize(preamble.size()));
  const DictRange r = dict_range(path, preamble.data(), size_t(f.gcount()));
  preamble.resize(r.start + r.length);
  f.clear();
  f.seekg(0);
  f.read(preamble.data(), std::streamsize(preamble.size()));
  preamble.resize(size_t(f.gcount()));
  const Header h = parse_header(path, preamble.data(), preamble.size());
  f.clear();
  f.seekg(0, std::ios::end);
  check_data_size(path, h, double(f.tellg()) - double(h.data_start));
  f.seekg(std::streamoff(h.data_start));
  Tensor t(h.dtype, h.shape);
  if (t.nbytes() && !f.read(static_cast<char*>(t.data()), std::streamsize(t.nbytes()))) bad(path, "truncated data");
  return finish(std::move(t), h);
}

void write_npy(io::OutputFile& out, const TensorView& tensor) {
  check(tensor.dtype != DType::kBF16, ErrorKind::kTypeError, "write_npy: bfloat16 has no .npy dtype; convert first");
  const Tensor dense = Tensor::from_view(tensor);
  std::string shape = "(";
  for (size_t i = 0; i < dense.shape().size(); ++i) shape += std::to_string(dense.shape()[i]) + ", ";
  if (dense.shape().size() > 1) shape.resize(shape.size() - 2);
  else if (dense.shape().size() == 1) shape.resize(shape.size() - 1);
  shape += ")";
  std::string header =
      std::string("{'descr': '") + descr_of(dense.dtype()) + "', 'fortran_order': False, 'shape': " + shape + ", }";
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  const uint16_t len = uint16_t(header.size());
  const char lb[2] = {char(len & 0xff), char(len >> 8)};
  out.write(std::string("\x93NUMPY\x01\x00", 8) + std::string(lb, 2) + header);
  out.write(dense.data(), dense.nbytes());
}

void write_npy(const std::string& path, const TensorView& tensor) {
  io::write_file(path, [&](io::OutputFile& out) { write_npy(out, tensor); });
}

}  // namespace sattn
