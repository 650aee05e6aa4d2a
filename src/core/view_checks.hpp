// Checks of caller-given views shared by the attention entry points (src/describe.cpp defines them).
#pragma once

#include "sattn/tensor.hpp"

namespace sattn {

// A view's data pointer (non-null unless empty), stride count and non-negative sizes and strides.
void check_view(const TensorView& t, const char* name);
// An output view: `expected` shape, float32/float64 (or bfloat16/float16 with allow_half), no broadcast and no
// overlapping elements.
void check_output(const TensorView& t, const char* name, const Shape& expected, bool allow_half);

}  // namespace sattn
