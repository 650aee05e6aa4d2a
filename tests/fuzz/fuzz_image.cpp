// Image decoder (sattn::sr::decode_image): any bytes give an image or sattn::Error. An accepted image has the
// pixels it says, no more than the limit, and the limit is enforced: one pixel less refuses the same input.
// The PNG and JPEG libraries come from Debian, uninstrumented: this checks sattn's use of them (limits, error
// paths, buffer sizes); the libraries themselves are fuzzed upstream (OSS-Fuzz).
// The PNG encoder (sattn's own, over zlib) gets every small accepted image, in colour and as gray, at a level taken
// from the input: its file must decode to the same pixels.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz_check.hpp"
#include "sattn/image.hpp"

namespace {
// Small enough that one input decodes fast.
constexpr int64_t kMaxPixels = int64_t(1) << 20;
// Images re-encoded (several bands of rows from ~44 K RGB pixels on).
constexpr int64_t kMaxEncodedPixels = int64_t(1) << 17;
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using sattn::fuzz::accepted;
  using sattn::fuzz::finding;
  sattn::sr::Image image;
  if (!accepted([&] { image = sattn::sr::decode_image(data, size, "fuzz.img", kMaxPixels); })) return 0;
  const int64_t pixels = image.height * image.width;
  if (image.height < 1 || image.width < 1 || pixels > kMaxPixels || (image.channels != 1 && image.channels != 3) ||
      image.data.size() != size_t(pixels * image.channels))
    finding("decoded ", image.height, "x", image.width, "x", image.channels, " with ", image.data.size(),
            " bytes (limit ", kMaxPixels, " pixels)");
  sattn::fuzz::read_all(image.data.data(), image.data.size());
  if (accepted([&] { sattn::sr::decode_image(data, size, "fuzz.img", pixels - 1); }))
    finding("a ", image.height, "x", image.width, " image was decoded under a limit of ", pixels - 1, " pixels");
  if (pixels <= kMaxEncodedPixels) {
    const int level = int(size % 10);
    sattn::sr::Image gray = image;
    gray.channels = 1;
    gray.data.resize(size_t(pixels));
    for (int64_t p = 0; p < pixels; ++p) gray.data[size_t(p)] = image.data[size_t(p * image.channels)];
    for (const sattn::sr::Image* im : {&image, &gray}) {
      const std::vector<uint8_t> png = sattn::sr::encode_png(*im, level, 1);
      const sattn::sr::Image back = sattn::sr::decode_image(png.data(), png.size(), "encoded.png", kMaxPixels);
      bool same = back.height == im->height && back.width == im->width && back.channels == 3;
      for (int64_t p = 0; same && p < pixels; ++p)
        for (int c = 0; c < 3; ++c) {
          const int64_t from = p * im->channels + (im->channels == 3 ? c : 0);  // gray: replicated on decoding
          same = same && back.data[size_t(p * 3 + c)] == im->data[size_t(from)];
        }
      if (!same)
        finding("encode_png (level ", level, ", ", im->channels, " channel(s)) of a ", im->height, "x", im->width,
                " image did not decode to its pixels");
    }
  }
  return 0;
}
