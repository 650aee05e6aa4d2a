// A downstream C++ user: find_package(sattn) from an install tree, link sattn::sattn, run attention.
#include <sattn/attention.hpp>

#include <cmath>
#include <iostream>

int main() {
  sattn::Tensor q(sattn::DType::kF32, {1, 2, 16, 8});
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] = std::sin(float(i));
  const auto r = sattn::attention(q, q, q, {}, /*need_lse=*/true);
  std::cout << "kernel " << r.info.kernel << " out " << sattn::shape_to_string(r.out.shape()) << "\n";
  return r.out.shape() == sattn::Shape{1, 2, 16, 8} && std::isfinite(r.lse.data<float>()[0]) ? 0 : 1;
}
