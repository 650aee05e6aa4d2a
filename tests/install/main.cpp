// A downstream C++ user: find_package(sattn) from an install tree, link sattn::sattn, run attention and a PNG round
// trip (libsattn.a needs libpng and libjpeg: sattnConfig.cmake finds them).
#include <sattn/attention.hpp>
#include <sattn/sr.hpp>

#include <cmath>
#include <iostream>

int main() {
  sattn::Tensor q(sattn::DType::kF32, {1, 2, 16, 8});
  for (int64_t i = 0; i < q.numel(); ++i) q.data<float>()[i] = std::sin(float(i));
  const auto r = sattn::attention(q, q, q, {}, /*need_lse=*/true);
  std::cout << "kernel " << r.info.kernel << " out " << sattn::shape_to_string(r.out.shape()) << "\n";
  sattn::sr::Image img(3, 5, 3);
  for (size_t i = 0; i < img.data.size(); ++i) img.data[i] = uint8_t(17 * i);
  const std::vector<uint8_t> png = sattn::sr::encode_png(img);
  const bool png_ok = sattn::sr::decode_image(png.data(), png.size(), "round trip").data == img.data;
  return r.out.shape() == sattn::Shape{1, 2, 16, 8} && std::isfinite(r.lse.data<float>()[0]) && png_ok ? 0 : 1;
}
