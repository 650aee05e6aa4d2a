#include "sattn/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <limits>
#include <ostream>

namespace sattn {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kTypeError: return "type error";
    case ErrorKind::kOutOfMemory: return "out of memory";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kIO: return "I/O error";
    case ErrorKind::kInternal: return "internal error";
  }
  return "error";
}

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "float32";
    case DType::kF64: return "float64";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kBool: return "bool";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
  }
  return "?";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64: return 8;
    case DType::kF32:
    case DType::kI32: return 4;
    case DType::kBF16:
    case DType::kF16: return 2;
    case DType::kBool:
    case DType::kU8: return 1;
  }
  return 1;
}

bool is_floating(DType dtype) {
  return dtype == DType::kF32 || dtype == DType::kF64 || dtype == DType::kBF16 || dtype == DType::kF16;
}

std::string shape_to_string(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::ostream& operator<<(std::ostream& os, const ShapeText& text) {
  os << '[';
  for (size_t i = 0; i < text.shape.size(); ++i) os << (i ? ", " : "") << text.shape[i];
  return os << ']';
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
  return strides;
}

bool strides_fit(const Shape& shape) {
  uint64_t extent = 1;
  for (int64_t d : shape)
    if (d < 0 || __builtin_mul_overflow(extent, uint64_t(d > 0 ? d : 1), &extent) || extent > (uint64_t(1) << 52))
      return false;
  return true;
}

int64_t numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

TensorView::TensorView(void* data_, DType dtype_, Shape shape_, Shape strides_)
    : data(data_), dtype(dtype_), shape(std::move(shape_)), strides(std::move(strides_)) {
  if (strides.empty()) strides = contiguous_strides(shape);
  check(strides.size() == shape.size(), ErrorKind::kInvalidArgument, "TensorView: ", strides.size(),
        " strides given for a shape of rank ", shape.size());
}

// Dense and row-major: each dimension of size > 1 has a contiguous tensor's stride. A size-1 dimension's stride is
// never used to address an element (the bindings set it to 0), so it does not matter.
bool TensorView::is_contiguous() const {
  if (numel() <= 1) return true;
  int64_t expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

// ---- half precision ------------------------------------------------------------------------------------
float fp16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_fp16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (u >= 0x477ff000u) return sign | 0x7c00u;  // overflow (>= 65520) -> inf
  if (u < 0x38800000u) {                        // subnormal or zero in fp16
    if (u < 0x33000000u) return sign;           // < 2^-25 rounds to zero
    const uint32_t exp = u >> 23, mant = (u & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1u))) ++half;
    return sign | uint16_t(half);
  }
  uint32_t h = ((u >> 13) - ((127 - 15) << 10));
  const uint32_t rem = u & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | uint16_t(h);
}

// ---- element access (slow path) ----------------------------------------------------------------------------
namespace {
double load(const void* p, DType dt) {
  switch (dt) {
    case DType::kF32: return *static_cast<const float*>(p);
    case DType::kF64: return *static_cast<const double*>(p);
    case DType::kBF16: return bf16_to_float(*static_cast<const uint16_t*>(p));
    case DType::kF16: return fp16_to_float(*static_cast<const uint16_t*>(p));
    case DType::kBool: return *static_cast<const uint8_t*>(p) ? 1.0 : 0.0;
    case DType::kU8: return *static_cast<const uint8_t*>(p);
    case DType::kI32: return *static_cast<const int32_t*>(p);
    case DType::kI64: return double(*static_cast<const int64_t*>(p));
  }
  return 0;
}
void store(void* p, DType dt, double v) {
  switch (dt) {
    case DType::kF32: *static_cast<float*>(p) = float(v); break;
    case DType::kF64: *static_cast<double*>(p) = v; break;
    case DType::kBF16: *static_cast<uint16_t*>(p) = float_to_bf16(float(v)); break;
    case DType::kF16: *static_cast<uint16_t*>(p) = float_to_fp16(float(v)); break;
    case DType::kBool: *static_cast<uint8_t*>(p) = v != 0.0; break;
    case DType::kU8: *static_cast<uint8_t*>(p) = uint8_t(v); break;
    case DType::kI32: *static_cast<int32_t*>(p) = int32_t(v); break;
    case DType::kI64: *static_cast<int64_t*>(p) = int64_t(v); break;
  }
}
}  // namespace

double TensorView::get(const int64_t* index) const {
  int64_t off = 0;
  for (int64_t d = 0; d < dim(); ++d) off += index[d] * strides[d];
  return load(static_cast<const char*>(data) + off * int64_t(dtype_size(dtype)), dtype);
}
double TensorView::get(std::initializer_list<int64_t> index) const {
  check(int64_t(index.size()) == dim(), ErrorKind::kInvalidArgument, "TensorView::get: index of rank ", index.size(),
        " for a tensor of rank ", dim());
  return get(index.begin());
}
void TensorView::set(const int64_t* index, double value) const {
  int64_t off = 0;
  for (int64_t d = 0; d < dim(); ++d) off += index[d] * strides[d];
  store(static_cast<char*>(data) + off * int64_t(dtype_size(dtype)), dtype, value);
}

// ---- owning tensor ---------------------------------------------------------------------------------------
namespace {
// Zeroed storage, 64-byte aligned (a cache line: whole-vector aligned loads and the kernels' non-temporal stores);
// 4 MiB and more is 2 MiB-aligned and advised for transparent huge pages (fewer TLB misses for kernels that read
// large tensors in scattered blocks, such as BlockTopK's key/value blocks). Null when out of memory.
std::shared_ptr<unsigned char[]> allocate_zeroed(size_t bytes) {
  constexpr size_t kHugeFrom = size_t(4) << 20, kHugePage = size_t(2) << 20, kLine = 64;
  const size_t align = bytes < kHugeFrom ? kLine : kHugePage;
  const size_t rounded = (std::max<size_t>(bytes, 1) + align - 1) / align * align;  // aligned_alloc wants a multiple
  auto* p = static_cast<unsigned char*>(std::aligned_alloc(align, rounded));
  if (!p) return nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // a hint: ignored where transparent huge pages are off
#endif
  std::memset(p, 0, bytes);
  return std::shared_ptr<unsigned char[]>(p, [](unsigned char* q) { std::free(q); });
}
}  // namespace

Tensor::Tensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  // Sizes multiplied with an overflow check: a shape read from a file must give an error, not a wrapped size.
  uint64_t elems = 1, bytes64 = 0;
  for (int64_t d : shape_) {
    check(d >= 0, ErrorKind::kInvalidArgument, "Tensor: negative dimension in shape ", shape_text(shape_));
    check(!__builtin_mul_overflow(elems, uint64_t(d), &elems), ErrorKind::kOutOfMemory, "Tensor: shape ",
          shape_text(shape_), " has more than 2^64 elements");
  }
  check(!__builtin_mul_overflow(elems, uint64_t(dtype_size(dtype)), &bytes64) && bytes64 < (uint64_t(1) << 62),
        ErrorKind::kOutOfMemory, "Tensor: cannot allocate ", to_string(dtype), shape_text(shape_),
        " (the size overflows)");
  const size_t bytes = nbytes();
  buffer_ = allocate_zeroed(bytes);
  check(buffer_ != nullptr, ErrorKind::kOutOfMemory, "Tensor: cannot allocate ", bytes, " bytes for ", to_string(dtype),
        shape_text(shape_));
}

namespace {
// Calls f(multi_index, linear_index) for every element of `shape` in row-major order.
template <typename F>
void for_each_index(const Shape& shape, F&& f) {
  const int64_t n = numel(shape);
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t lin = 0; lin < n; ++lin) {
    f(idx.data(), lin);
    for (size_t d = shape.size(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}
}  // namespace

Tensor Tensor::from_view(const TensorView& view) {
  Tensor t(view.dtype, view.shape);
  const size_t es = dtype_size(view.dtype);
  for_each_index(view.shape, [&](const int64_t* idx, int64_t lin) {
    int64_t off = 0;
    for (int64_t d = 0; d < view.dim(); ++d) off += idx[d] * view.strides[d];
    std::memcpy(t.data<char>() + lin * es, static_cast<const char*>(view.data) + off * int64_t(es), es);
  });
  return t;
}

Tensor Tensor::to(DType dtype) const {
  Tensor t(dtype, shape_);
  const size_t es_in = dtype_size(dtype_), es_out = dtype_size(dtype);
  const int64_t n = numel();
  for (int64_t i = 0; i < n; ++i) store(t.data<char>() + i * es_out, dtype, load(data<char>() + i * es_in, dtype_));
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  check(sattn::numel(shape) == numel(), ErrorKind::kInvalidArgument, "Tensor::reshape: cannot reshape ",
        shape_text(shape_), " to ", shape_text(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

}  // namespace sattn
