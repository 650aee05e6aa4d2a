// sattn::sparse: a sliding window through sparse_attention, checked against the window's first row (one key).
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
  std::cout << "sparse: " << window.repr() << " row 0 " << (ok ? "= v[0]" : "wrong") << "\n";
  return ok ? 0 : 1;
}
