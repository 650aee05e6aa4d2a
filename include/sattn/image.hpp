// The one 8-bit image type of sattn (sr::Image) and its file I/O: PNG/JPEG decoding, PNG encoding. The SR model
// (sattn/sr.hpp) reads and writes it; the drawing code behind `sattn viz` draws on it (RGB images).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sattn::sr {

// An 8-bit image, row-major and interleaved (HWC): channel c of pixel (y, x) is data[(y * width + x) * channels + c],
// (0, 0) the top-left pixel; channels 1 (gray) or 3 (RGB). Sizes are given as (height, width[, channels]) everywhere,
// as this constructor takes them (viz::canvas too).
struct Image {
  int64_t height = 0, width = 0, channels = 3;
  std::vector<uint8_t> data;  // size height * width * channels
  int source_channels = 0;    // channels stored in the file (1 gray, 2 gray+alpha, 3 RGB, 4 RGBA); 0 if made here

  Image() = default;
  Image(int64_t h, int64_t w, int64_t c) : height(h), width(w), channels(c), data(size_t(h * w * c), 0) {}
  uint8_t& at(int64_t y, int64_t x, int64_t c) { return data[size_t((y * width + x) * channels + c)]; }
  uint8_t at(int64_t y, int64_t x, int64_t c) const { return data[size_t((y * width + x) * channels + c)]; }
};

// Default limit on the pixels an image may make: width * height * scale^2 of an upscale's output (a 3840 x 2160
// input at x4, 132.7 M pixels, fits), or width * height of a decoded file.
inline constexpr int64_t kDefaultMaxPixels = int64_t(1) << 27;
// height * width * scale^2, the pixels these limits count; INT64_MAX when that overflows.
int64_t output_pixels(int64_t height, int64_t width, int64_t scale);

// Reads a PNG (libpng) or JPEG (libjpeg-turbo) file as 8-bit RGB: gray (and gray+alpha) is replicated to RGB,
// alpha dropped, 16-bit PNG reduced to its high byte, palettes expanded, CMYK JPEG converted (R = C K / 255).
// `max_pixels` limits width * height * scale^2 (the output of an upscale by `scale`; scale 1: the image itself),
// checked from the header before any pixel buffer is allocated. Throws sattn::Error(kIO) naming the file and the
// problem: missing/unreadable, unsupported format (anything but PNG/JPEG), corrupt or truncated data (libjpeg-turbo's
// corrupt-data warnings included), a progressive JPEG of more than 500 scans, or over the limit.
Image read_image(const std::string& path, int64_t max_pixels = kDefaultMaxPixels, int scale = 1);
// Same, from the bytes of a file in memory; `name` is used in error messages. The decoders' errors never abort the
// process: they come back as sattn::Error, whatever the bytes.
Image decode_image(const void* data, size_t size, const std::string& name, int64_t max_pixels = kDefaultMaxPixels,
                   int scale = 1);

// zlib level of the PNG encoder: 0 (stored) to 9 (smallest). The default is OpenCV's, 1 (fastest with compression):
// it wrote 512x512 photos 1.4-4x faster than level 6 (libpng's own default), at sizes within 5 % of it.
inline constexpr int kDefaultPngCompression = 1;

// 8-bit PNG of an image with 1 or 3 channels, in memory: per row the filter libpng would choose (none at level 0),
// zlib at compression_level, bands of ~128 KiB of rows compressed on up to num_threads threads (0 = SATTN_NUM_THREADS
// or all cores; the bytes do not depend on it). Throws kInvalidArgument for a compression_level outside 0..9 or a
// negative num_threads.
std::vector<uint8_t> encode_png(const Image& image, int compression_level = kDefaultPngCompression,
                                int num_threads = 0);
// Same from interleaved pixels: height rows of width * channels bytes.
std::vector<uint8_t> encode_png(const uint8_t* pixels, int64_t height, int64_t width, int64_t channels,
                                int compression_level = kDefaultPngCompression, int num_threads = 0);
// encode_png, written to `path`, replacing a regular file atomically (docs/reliability.md). Throws sattn::Error(kIO)
// naming the file when it cannot be written; the old file is then untouched.
void write_png(const std::string& path, const Image& image, int compression_level = kDefaultPngCompression,
               int num_threads = 0);

}  // namespace sattn::sr
