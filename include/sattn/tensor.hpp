// Tensors: a non-owning strided view (TensorView) and an owning dense tensor (Tensor).
//
// Strides are in elements, not bytes (as in PyTorch). Views may be non-contiguous and may
// broadcast (stride 0). Kernels take views; the CLI, the nn layers and tests use Tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "sattn/error.hpp"

namespace sattn {

enum class DType : uint8_t { kF32, kF64, kBF16, kF16, kBool, kI32, kI64, kU8 };

const char* to_string(DType dtype);
size_t dtype_size(DType dtype);
bool is_floating(DType dtype);

using Shape = std::vector<int64_t>;
std::string shape_to_string(const Shape& shape);
// A shape in an error message ("[2, 3]"), written only when check/fail builds the message: check() evaluates its
// arguments whether or not the check fails, so it takes shape_text(s) rather than shape_to_string(s).
struct ShapeText {
  const Shape& shape;
};
inline ShapeText shape_text(const Shape& shape) { return {shape}; }
std::ostream& operator<<(std::ostream& os, const ShapeText& text);

// Row-major (C-order) strides for `shape`.
Shape contiguous_strides(const Shape& shape);
int64_t numel(const Shape& shape);
// Whether the row-major strides of `shape` (a 0 dimension counted as 1) stay within 2^52 elements. The file
// readers refuse other shapes, empty ones included, so that no stride or offset computed from them overflows.
bool strides_fit(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  Shape shape;
  Shape strides;  // in elements; may be 0 (broadcast) or negative is NOT allowed

  TensorView() = default;
  TensorView(void* data_, DType dtype_, Shape shape_, Shape strides_ = {});

  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  int64_t size(int64_t i) const { return shape[i < 0 ? i + dim() : i]; }
  int64_t stride(int64_t i) const { return strides[i < 0 ? i + dim() : i]; }
  int64_t numel() const { return sattn::numel(shape); }
  bool is_contiguous() const;
  bool empty() const { return data == nullptr && shape.empty(); }

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }

  // Reads element at `index` (a full multi-index) converted to double. Slow; for tests and tools.
  double get(std::initializer_list<int64_t> index) const;
  double get(const int64_t* index) const;
  void set(const int64_t* index, double value) const;
};

// Owning, dense, row-major tensor.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);                 // zero-initialised
  static Tensor from_view(const TensorView& view);  // dense copy, same dtype
  Tensor to(DType dtype) const;                     // converting dense copy

  TensorView view() const { return TensorView(buffer_.get(), dtype_, shape_, contiguous_strides(shape_)); }
  operator TensorView() const { return view(); }  // NOLINT: cheap, intended

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t i) const { return shape_[i < 0 ? i + dim() : i]; }
  int64_t numel() const { return sattn::numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool defined() const { return buffer_ != nullptr || (!shape_.empty() && numel() == 0); }

  void* data() const { return buffer_.get(); }
  template <typename T>
  T* data() const {
    return static_cast<T*>(static_cast<void*>(buffer_.get()));
  }

  Tensor reshape(Shape shape) const;  // shares storage

 private:
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::shared_ptr<unsigned char[]> buffer_;
};

// Element conversions for the half-precision types (round to nearest even). The bf16 pair is inline: the kernels
// convert element by element where they pack or load bf16 operands.
inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return uint16_t(u >> 16);
}
float fp16_to_float(uint16_t bits);
uint16_t float_to_fp16(float value);

}  // namespace sattn
