// sattn::sparse: a sliding window through sparse_attention, and the same window as a mask function (flex_attention),
// checked against the window's first row (one key) and against each other.
#include <sattn/sparse.hpp>

#include <iostream>

#include "common.hpp"

int main() {
  const sattn::Tensor q = example_q();
  sattn::Tensor out(sattn::DType::kF32, {1, 2, 16, 8}), lse(sattn::DType::kF32, {1, 2, 16});
  const sattn::sparse::SlidingWindow window(4, 0);
  sattn::sparse::sparse_attention(q, q, q, window, {}, out, lse);
  // Row 0 sees key 0 only: its output is v[0].
  bool ok = true;
  for (int d = 0; d < 8; ++d) ok = ok && std::abs(out.data<float>()[d] - q.data<float>()[d]) < 1e-6f;
  // The window as a function on a block mask whose ranges are all partial.
  sattn::sparse::BlockMask mask = window.block_mask(16, 16, 2, 4);
  for (auto& r : mask.ranges) r.full = 0;
  sattn::Tensor fout(sattn::DType::kF32, {1, 2, 16, 8});
  const auto in_window = [](int64_t, int64_t, int64_t i, int64_t j) { return j <= i && j >= i - 4; };
  sattn::sparse::flex_attention(q, q, q, mask, in_window, {}, fout);
  for (int64_t n = 0; n < out.numel(); ++n) ok = ok && std::abs(fout.data<float>()[n] - out.data<float>()[n]) < 1e-6f;
  std::cout << "sparse: " << window.repr() << (ok ? " and flex_attention agree" : " wrong") << "\n";
  return ok ? 0 : 1;
}
