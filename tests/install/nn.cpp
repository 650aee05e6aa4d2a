// sattn::nn: torch.nn.MultiheadAttention's forward, with the averaged attention weights.
#include <sattn/mha.hpp>

#include <iostream>

int main() {
  const sattn::nn::MultiheadAttention mha(16, 4);
  sattn::Tensor x(sattn::DType::kF32, {5, 2, 16});  // [L, N, E] (batch_first = false)
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = float(i % 7) / 7.0f;
  const auto [y, weights] = mha.forward(x, x, x);
  std::cout << "nn: out " << sattn::shape_to_string(y.shape()) << "\n";
  return y.shape() == sattn::Shape{5, 2, 16} && weights && weights->shape() == sattn::Shape{2, 5, 5} ? 0 : 1;
}
