#include "sattn/merge.hpp"

#include <cmath>
#include <limits>

#include "sattn/error.hpp"

namespace sattn {
namespace {

void check_float(const TensorView& t, const char* name) {
  check(t.dtype == DType::kF32 || t.dtype == DType::kF64, ErrorKind::kTypeError, name,
        ": expected float32 or float64, got ", to_string(t.dtype));
  check(t.data != nullptr || t.numel() == 0, ErrorKind::kInvalidArgument, name, ": null data pointer");
  check(t.strides.size() == t.shape.size(), ErrorKind::kInvalidArgument, name, ": strides do not match the shape");
}

// Advances a multi-index over `shape`; returns false after the last element.
bool next_index(std::vector<int64_t>& idx, const Shape& shape) {
  for (size_t d = idx.size(); d-- > 0;) {
    if (++idx[d] < shape[d]) return true;
    idx[d] = 0;
  }
  return false;
}

}  // namespace

void merge_attention_partials(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                              const TensorView& out, const TensorView& lse) {
  check(!outs.empty(), ErrorKind::kInvalidArgument, "outs: expected at least one partial result, got none");
  check(outs.size() == lses.size(), ErrorKind::kInvalidArgument, "lses: expected one lse per partial output (",
        outs.size(), "), got ", lses.size());
  const Shape& oshape = outs[0].shape;
  check(oshape.size() >= 1, ErrorKind::kInvalidArgument, "outs[0]: expected shape [..., Dv], got ", shape_text(oshape));
  const Shape lshape(oshape.begin(), oshape.end() - 1);
  for (size_t c = 0; c < outs.size(); ++c) {
    check_float(outs[c], "outs");
    check_float(lses[c], "lses");
    check(outs[c].shape == oshape, ErrorKind::kInvalidArgument, "outs[", c, "]: expected shape ", shape_text(oshape),
          " (that of outs[0]), got ", shape_text(outs[c].shape));
    check(lses[c].shape == lshape, ErrorKind::kInvalidArgument, "lses[", c, "]: expected shape ", shape_text(lshape),
          " (outs[0] without its last dimension), got ", shape_text(lses[c].shape));
  }
  check_float(out, "out");
  check_float(lse, "lse");
  check(out.shape == oshape, ErrorKind::kInvalidArgument, "out: expected shape ", shape_text(oshape), ", got ",
        shape_text(out.shape));
  check(lse.shape == lshape, ErrorKind::kInvalidArgument, "lse: expected shape ", shape_text(lshape), ", got ",
        shape_text(lse.shape));
  if (numel(oshape) == 0) return;
  const int64_t Dv = oshape.back();
  const size_t C = outs.size();
  std::vector<double> w(C), acc(static_cast<size_t>(Dv));
  std::vector<int64_t> idx(lshape.size(), 0), full(oshape.size(), 0);
  do {
    double m = -HUGE_VAL;
    bool nan = false;  // a partial of a NaN row (lse NaN) makes the merged row NaN
    for (size_t c = 0; c < C; ++c) {
      const double l = lses[c].get(idx.data());
      m = std::max(m, l), nan |= std::isnan(l);
    }
    constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
    std::fill(acc.begin(), acc.end(), nan ? kNaN : 0.0);
    double s = nan ? kNaN : 0.0;
    if (m != -HUGE_VAL && !nan) {
      for (size_t c = 0; c < C; ++c) {
        const double l = lses[c].get(idx.data());
        w[c] = l == -HUGE_VAL ? 0.0 : std::exp(l - m);  // ignored when -inf
        s += w[c];
      }
      std::copy(idx.begin(), idx.end(), full.begin());
      for (size_t c = 0; c < C; ++c) {
        if (w[c] == 0.0) continue;
        for (int64_t x = 0; x < Dv; ++x) {
          full.back() = x;
          acc[size_t(x)] += w[c] / s * outs[c].get(full.data());
        }
      }
    }
    std::copy(idx.begin(), idx.end(), full.begin());
    for (int64_t x = 0; x < Dv; ++x) {
      full.back() = x;
      out.set(full.data(), acc[size_t(x)]);
    }
    lse.set(idx.data(), m == -HUGE_VAL && !nan ? -HUGE_VAL : m + std::log(s));
  } while (!lshape.empty() && next_index(idx, lshape));
}

MergedAttention merge_attention_partials(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses) {
  check(!outs.empty(), ErrorKind::kInvalidArgument, "outs: expected at least one partial result, got none");
  check(!outs[0].shape.empty(), ErrorKind::kInvalidArgument, "outs[0]: expected shape [..., Dv], got a scalar");
  const DType dt = outs[0].dtype == DType::kF64 ? DType::kF64 : DType::kF32;
  MergedAttention r;
  r.out = Tensor(dt, outs[0].shape);
  r.lse = Tensor(dt, Shape(outs[0].shape.begin(), outs[0].shape.end() - 1));
  merge_attention_partials(outs, lses, r.out.view(), r.lse.view());
  return r;
}

}  // namespace sattn
