// What counts as a finding in the fuzz targets, shared by all of them.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <typeinfo>

#include "sattn/error.hpp"
#include "sattn/tensor.hpp"

namespace sattn::fuzz {

// Reports a finding and aborts; libFuzzer then saves the input (crash-*) and stops.
template <typename... Args>
[[noreturn]] void finding(const Args&... args) {
  std::fprintf(stderr, "fuzz finding: %s\n", sattn::message::concat(args...).c_str());
  std::abort();
}

// Runs `f`: true when it returns, false when it throws sattn::Error (bad input refused with a clear error). Any
// other exception (std::bad_alloc, std::length_error, ...) is a finding.
template <typename F>
bool accepted(F&& f) {
  try {
    f();
    return true;
  } catch (const Error&) {
    return false;
  } catch (const std::exception& e) {
    finding("an exception other than sattn::Error escaped: ", typeid(e).name(), ": ", e.what());
  } catch (...) {
    finding("a non-standard exception escaped");
  }
}

// Reads every byte (ASan checks each read); the empty asm keeps the reads from being optimised away.
inline void read_all(const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  unsigned sum = 0;
  for (size_t i = 0; i < size; ++i) sum += bytes[i];
  asm volatile("" : : "r"(sum));
}

// An accepted tensor: its view spans exactly its bytes in C order, every byte is readable, bools are 0 or 1.
inline void check_tensor(const Tensor& t, const std::string& what) {
  const TensorView v = t.view();
  if (!v.is_contiguous() || size_t(v.numel()) * dtype_size(t.dtype()) != t.nbytes())
    finding(what, ": the view of shape ", shape_to_string(t.shape()), " does not span its ", t.nbytes(), " bytes");
  read_all(t.data(), t.nbytes());
  if (t.dtype() == DType::kBool)
    for (int64_t i = 0; i < t.numel(); ++i)
      if (t.data<uint8_t>()[i] > 1) finding(what, ": bool byte ", int(t.data<uint8_t>()[i]), " at ", i);
}

}  // namespace sattn::fuzz
