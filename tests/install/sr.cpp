// sattn::sr: a PNG round trip and a bicubic resize (libsattn_sr.a needs libpng and libjpeg: sattnConfig.cmake finds
// them).
#include <sattn/sr.hpp>

#include <iostream>

int main() {
  sattn::sr::Image img(3, 5, 3);
  for (size_t i = 0; i < img.data.size(); ++i) img.data[i] = uint8_t(17 * i);
  const std::vector<uint8_t> png = sattn::sr::encode_png(img);
  const bool round_trip = sattn::sr::decode_image(png.data(), png.size(), "round trip").data == img.data;
  const sattn::sr::Image big = sattn::sr::imresize(img, 2.0);
  std::cout << "sr: PNG " << png.size() << " bytes, resized to " << big.height << "x" << big.width << "\n";
  return round_trip && big.height == 6 && big.width == 10 ? 0 : 1;
}
