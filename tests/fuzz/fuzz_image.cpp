// Image decoder (sattn::sr::decode_image): any bytes give an image or sattn::Error. An accepted image has the
// pixels it says, no more than the limit, and the limit is enforced: one pixel less refuses the same input.
// The PNG and JPEG libraries come from Debian, uninstrumented: this checks sattn's use of them (limits, error
// paths, buffer sizes); the libraries themselves are fuzzed upstream (OSS-Fuzz).
#include <cstddef>
#include <cstdint>

#include "fuzz_check.hpp"
#include "sattn/image.hpp"

namespace {
// Small enough that one input decodes fast.
constexpr int64_t kMaxPixels = int64_t(1) << 20;
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
  return 0;
}
