// sattn::core alone: scaled dot-product attention with its log-sum-exp.
#include <sattn/attention.hpp>

#include <iostream>

#include "common.hpp"

int main() {
  const sattn::Tensor q = example_q();
  const auto r = sattn::attention(q, q, q, {}, /*need_lse=*/true);
  std::cout << "core: kernel " << r.info.kernel << " out " << sattn::shape_to_string(r.out.shape()) << "\n";
  return r.out.shape() == sattn::Shape{1, 2, 16, 8} && std::isfinite(r.lse.data<float>()[0]) ? 0 : 1;
}
