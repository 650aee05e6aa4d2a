// Image decoding (libpng, libjpeg-turbo): every PNG layout to 8-bit RGB with known pixels, JPEG colour spaces,
// corrupt, truncated and crafted files as clear errors, and the pixel limit checked from the header. The inputs are
// made here with libjpeg's and libpng's encoders.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>  // before jpeglib.h
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <jpeglib.h>
#include <png.h>
#include <zlib.h>

#include "sattn/error.hpp"
#include "sattn/sr.hpp"

namespace {

using sattn::ErrorKind;
using sattn::sr::Image;
using Bytes = std::vector<uint8_t>;

std::string temp_path(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("sattn_decode_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return (dir / name).string();
}

std::string write_temp(const std::string& name, const Bytes& bytes) {
  const std::string p = temp_path(name);
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return p;
}

Bytes random_bytes(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  Bytes b(n);
  for (auto& v : b) v = uint8_t(rng() % 256);
  return b;
}

// libjpeg's encoder: components 1 (gray), 3 (RGB) or 4 (CMYK, with Adobe's marker); `scans` replaces the default
// scan script (a progressive one when `progressive`).
Bytes encode_jpeg(const Bytes& pixels, int w, int h, int components, int quality = 90, bool progressive = false,
                  const std::vector<jpeg_scan_info>& scans = {}) {
  jpeg_compress_struct c;
  jpeg_error_mgr err;
  c.err = jpeg_std_error(&err);
  jpeg_create_compress(&c);
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  jpeg_mem_dest(&c, &buf, &size);
  c.image_width = JDIMENSION(w);
  c.image_height = JDIMENSION(h);
  c.input_components = components;
  c.in_color_space = components == 1 ? JCS_GRAYSCALE : components == 3 ? JCS_RGB : JCS_CMYK;
  jpeg_set_defaults(&c);
  jpeg_set_quality(&c, quality, TRUE);
  if (progressive) jpeg_simple_progression(&c);
  if (!scans.empty()) {
    c.scan_info = scans.data();
    c.num_scans = int(scans.size());
  }
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(pixels.data()) + size_t(c.next_scanline) * size_t(w * components);
    jpeg_write_scanlines(&c, &row, 1);
  }
  jpeg_finish_compress(&c);
  Bytes out(buf, buf + size);
  jpeg_destroy_compress(&c);
  std::free(buf);
  return out;
}

// The same picture with the frame header (SOF0) declaring width x height: a file that claims a huge image.
Bytes with_jpeg_size(Bytes jpeg, int width, int height) {
  for (size_t i = 2; i + 8 < jpeg.size(); ++i)
    if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xC0) {
      jpeg[i + 5] = uint8_t(height >> 8), jpeg[i + 6] = uint8_t(height);
      jpeg[i + 7] = uint8_t(width >> 8), jpeg[i + 8] = uint8_t(width);
      return jpeg;
    }
  ADD_FAILURE() << "no SOF0 marker";
  return jpeg;
}

struct PngSpec {
  int width = 0, height = 0, depth = 8, color = PNG_COLOR_TYPE_RGB;
  bool interlaced = false;
  std::vector<png_color> palette;
  Bytes trns;  // palette alphas
  int compression = -1;
};

PngSpec png_spec(int width, int height, int depth, int color) {
  PngSpec s;
  s.width = width, s.height = height, s.depth = depth, s.color = color;
  return s;
}

void png_append(png_structp png, png_bytep data, size_t n) {
  auto* out = static_cast<Bytes*>(png_get_io_ptr(png));
  out->insert(out->end(), data, data + n);
}

// libpng's encoder; `row(y, buffer)` fills row y in the PNG's own packing (big-endian 16-bit samples, packed
// sub-byte samples), so that huge images stream through one row.
template <typename RowFn>
Bytes encode_png_with_libpng(const PngSpec& s, RowFn row) {
  Bytes out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_set_write_fn(png, &out, png_append, nullptr);
  png_set_IHDR(png, info, png_uint_32(s.width), png_uint_32(s.height), s.depth, s.color,
               s.interlaced ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!s.palette.empty()) png_set_PLTE(png, info, s.palette.data(), int(s.palette.size()));
  if (!s.trns.empty()) png_set_tRNS(png, info, s.trns.data(), int(s.trns.size()), nullptr);
  if (s.compression >= 0) {
    png_set_compression_level(png, s.compression);
    png_set_filter(png, 0, PNG_FILTER_NONE);
  }
  png_write_info(png, info);
  Bytes buffer(png_get_rowbytes(png, info));
  const int passes = s.interlaced ? png_set_interlace_handling(png) : 1;
  for (int pass = 0; pass < passes; ++pass)
    for (int y = 0; y < s.height; ++y) {
      row(y, buffer.data());
      png_write_row(png, buffer.data());
    }
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

Bytes encode_png_rows(const PngSpec& s, const Bytes& packed) {
  const size_t stride = packed.size() / size_t(s.height);
  return encode_png_with_libpng(s, [&](int y, uint8_t* b) { std::copy_n(&packed[size_t(y) * stride], stride, b); });
}

// Expects decoding to throw sattn::Error(kIO) naming `name`, with `needle` in the message; returns the message.
std::string decode_error(const Bytes& bytes, const std::string& name, const std::string& needle,
                         int64_t max_pixels = sattn::sr::kDefaultMaxPixels, int scale = 1) {
  try {
    sattn::sr::decode_image(bytes.data(), bytes.size(), name, max_pixels, scale);
    ADD_FAILURE() << "no error for " << name << " (expected: " << needle << ")";
    return "";
  } catch (const sattn::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kIO) << m;
    EXPECT_NE(m.find("'" + name + "'"), std::string::npos) << m;
    EXPECT_NE(m.find(needle), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    return m;
  }
}

Image decode(const Bytes& bytes) { return sattn::sr::decode_image(bytes.data(), bytes.size(), "mem"); }

// ---- PNG ------------------------------------------------------------------------------------------------------

TEST(SrImageDecode, PngLayoutsBecomeRgbWithTheExpectedPixels) {
  const int w = 7, h = 5;
  auto expect_rgb = [&](const Image& im, auto want, int source_channels, const std::string& what) {
    ASSERT_EQ(im.width, w) << what;
    ASSERT_EQ(im.height, h) << what;
    ASSERT_EQ(im.channels, 3) << what;
    EXPECT_EQ(im.source_channels, source_channels) << what;
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        for (int c = 0; c < 3; ++c) ASSERT_EQ(im.at(y, x, c), want(y, x, c)) << what << " at " << y << "," << x;
  };
  // 16-bit RGB and RGBA: the high byte of each sample; alpha dropped
  for (const bool alpha : {false, true}) {
    const int ch = alpha ? 4 : 3;
    const Bytes raw = random_bytes(size_t(w * h * ch * 2), 1);
    const Bytes png = encode_png_rows(png_spec(w, h, 16, alpha ? PNG_COLOR_TYPE_RGBA : PNG_COLOR_TYPE_RGB), raw);
    expect_rgb(
        decode(png), [&](int y, int x, int c) { return raw[size_t(((y * w + x) * ch + c) * 2)]; }, ch,
        alpha ? "16-bit RGBA" : "16-bit RGB");
  }
  // 8-bit RGBA and gray + alpha; interlaced (Adam7) RGB
  {
    const Bytes raw = random_bytes(size_t(w * h * 4), 2);
    expect_rgb(
        decode(encode_png_rows(png_spec(w, h, 8, PNG_COLOR_TYPE_RGBA), raw)),
        [&](int y, int x, int c) { return raw[size_t((y * w + x) * 4 + c)]; }, 4, "RGBA");
    const Bytes gray_alpha(raw.begin(), raw.begin() + w * h * 2);
    expect_rgb(
        decode(encode_png_rows(png_spec(w, h, 8, PNG_COLOR_TYPE_GRAY_ALPHA), gray_alpha)),
        [&](int y, int x, int) { return raw[size_t((y * w + x) * 2)]; }, 2, "gray + alpha");
    const Bytes rgb = random_bytes(size_t(w * h * 3), 3);
    PngSpec adam7 = png_spec(w, h, 8, PNG_COLOR_TYPE_RGB);
    adam7.interlaced = true;
    expect_rgb(
        decode(encode_png_rows(adam7, rgb)), [&](int y, int x, int c) { return rgb[size_t((y * w + x) * 3 + c)]; }, 3,
        "interlaced RGB");
  }
  // gray of 1, 2 and 4 bits: v * 255 / (2^depth - 1); packed most significant bits first
  for (const int depth : {1, 2, 4}) {
    const int per_byte = 8 / depth, stride = (w + per_byte - 1) / per_byte, maxv = (1 << depth) - 1;
    const Bytes values = random_bytes(size_t(w * h), unsigned(4 + depth));
    Bytes packed(size_t(stride * h), 0);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        packed[size_t(y * stride + x / per_byte)] |=
            uint8_t((values[size_t(y * w + x)] & maxv) << (8 - depth * (x % per_byte + 1)));
    expect_rgb(
        decode(encode_png_rows(png_spec(w, h, depth, PNG_COLOR_TYPE_GRAY), packed)),
        [&](int y, int x, int) { return (values[size_t(y * w + x)] & maxv) * 255 / maxv; }, 1,
        "gray " + std::to_string(depth) + "-bit");
  }
  // a 4-bit palette with transparency: the palette's colours, alpha dropped
  {
    PngSpec pal = png_spec(w, h, 4, PNG_COLOR_TYPE_PALETTE);
    const Bytes colours = random_bytes(16 * 3, 8);
    for (size_t i = 0; i < 16; ++i) pal.palette.push_back({colours[3 * i], colours[3 * i + 1], colours[3 * i + 2]});
    pal.trns = random_bytes(16, 9);
    const Bytes index = random_bytes(size_t(w * h), 10);
    const int stride = (w + 1) / 2;
    Bytes packed(size_t(stride * h), 0);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        packed[size_t(y * stride + x / 2)] |= uint8_t((index[size_t(y * w + x)] & 15) << (x % 2 ? 0 : 4));
    expect_rgb(
        decode(encode_png_rows(pal, packed)),
        [&](int y, int x, int c) { return colours[size_t(3 * (index[size_t(y * w + x)] & 15) + c)]; }, 4,
        "palette + tRNS");
  }
}

TEST(SrImageDecode, CorruptPngIsAnErrorNamingTheFile) {
  const Bytes good = encode_png_rows(png_spec(9, 6, 8, PNG_COLOR_TYPE_RGB), random_bytes(9 * 6 * 3, 11));
  // a flipped bit in the compressed pixels
  Bytes flipped = good;
  const std::string tag = "IDAT";
  const size_t idat = size_t(std::search(good.begin(), good.end(), tag.begin(), tag.end()) - good.begin());
  flipped[idat + 10] ^= 0x10;
  decode_error(flipped, "flipped.png", "corrupt or truncated PNG");
  // cut anywhere, even just before IEND
  for (const size_t n : {size_t(20), size_t(40), good.size() / 2, good.size() - 12, good.size() - 1})
    decode_error(Bytes(good.begin(), good.begin() + long(n)), "cut.png", "PNG");
  // the signature alone
  decode_error(Bytes(good.begin(), good.begin() + 8), "sig.png", "PNG");
}

// ---- JPEG -----------------------------------------------------------------------------------------------------

Bytes gradient(int w, int h, int ch) {
  Bytes px(size_t(w * h * ch));
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x)
      for (int c = 0; c < ch; ++c) px[size_t((y * w + x) * ch + c)] = uint8_t(3 * x + 2 * y + 30 * c);  // < 256
  return px;
}

double max_abs_diff(const Image& im, const Bytes& want_rgb) {
  double err = 0;
  for (size_t i = 0; i < want_rgb.size(); ++i) err = std::max(err, std::fabs(double(im.data[i]) - want_rgb[i]));
  return err;
}

TEST(SrImageDecode, JpegRgbGrayProgressiveAndCmyk) {
  const int w = 40, h = 32;
  const Bytes rgb = gradient(w, h, 3);
  for (const bool progressive : {false, true}) {
    const Image im = decode(encode_jpeg(rgb, w, h, 3, 95, progressive));
    ASSERT_EQ(im.width, w);
    ASSERT_EQ(im.height, h);
    EXPECT_EQ(im.source_channels, 3);
    EXPECT_LT(max_abs_diff(im, rgb), 24) << "progressive " << progressive;  // lossy, but the same picture
  }
  const Bytes gray = gradient(w, h, 1);
  const Image g = decode(encode_jpeg(gray, w, h, 1, 95));
  EXPECT_EQ(g.source_channels, 1);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      ASSERT_EQ(g.at(y, x, 0), g.at(y, x, 1));
      ASSERT_EQ(g.at(y, x, 0), g.at(y, x, 2));
      ASSERT_NEAR(g.at(y, x, 0), gray[size_t(y * w + x)], 8);
    }
  // CMYK as Adobe stores it (255 = no ink): R = C K / 255
  Bytes cmyk(size_t(w * h * 4));
  for (size_t i = 0; i < cmyk.size(); i += 4) cmyk[i] = 200, cmyk[i + 1] = 100, cmyk[i + 2] = 50, cmyk[i + 3] = 128;
  const Image k = decode(encode_jpeg(cmyk, w, h, 4, 100));
  EXPECT_EQ(k.source_channels, 4);
  const Bytes want_k = [&] {
    Bytes b;
    for (int i = 0; i < w * h; ++i) b.insert(b.end(), {100, 50, 25});
    return b;
  }();
  EXPECT_LE(max_abs_diff(k, want_k), 2);
}

TEST(SrImageDecode, TruncatedOrCutJpegIsAnError) {
  const Bytes jpeg = encode_jpeg(gradient(40, 32, 3), 40, 32, 3, 95);
  for (const double frac : {0.05, 0.3, 0.7, 0.95, 0.999}) {
    const Bytes cut(jpeg.begin(), jpeg.begin() + long(double(jpeg.size()) * frac));
    decode_error(cut, "cut.jpg", frac < 0.1 ? "JPEG" : "truncated");
  }
}

// A Huffman table whose 16 code counts sum to 4080 (> 256 symbols): a decoder without that check writes past its
// tables.
TEST(SrImageDecode, HuffmanTableWithTooManyCodesIsAClearError) {
  Bytes f = {0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x43, 0x00};  // SOI, DQT: table 0, all ones
  f.insert(f.end(), 64, 1);
  f.insert(f.end(), {0xFF, 0xC0, 0x00, 0x0B, 0x08, 0x00, 0x08, 0x00, 0x08, 0x01, 0x01, 0x11, 0x00});  // SOF0 8x8 gray
  f.insert(f.end(), {0xFF, 0xC4, 0x00, 0x53, 0x00});  // DHT, 81 bytes: DC table 0
  f.insert(f.end(), 16, 0xFF);                        // code counts: 16 x 255
  for (int i = 0; i < 64; ++i) f.push_back(uint8_t(i));
  f.insert(f.end(), {0xFF, 0xD9});
  ASSERT_EQ(f.size(), 171u);
  const std::string p = write_temp("huffman.jpg", f);
  try {
    sattn::sr::read_image(p);
    ADD_FAILURE() << "no error";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIO);
    const std::string m = e.what();
    EXPECT_NE(m.find(p), std::string::npos) << m;
    EXPECT_NE(m.find("Huffman table"), std::string::npos) << m;
  }
}

// 501+ scans: a small file that would decode for minutes at a large size.
TEST(SrImageDecode, ProgressiveJpegOfTooManyScansIsRefused) {
  // DC first, then every AC coefficient alone by successive approximation: 1 + 63 x 10 = 631 valid scans
  std::vector<jpeg_scan_info> scans{{1, {0}, 0, 0, 0, 0}};
  for (int k = 1; k < 64; ++k) {
    scans.push_back({1, {0}, k, k, 0, 9});
    for (int al = 8; al >= 0; --al) scans.push_back({1, {0}, k, k, al + 1, al});
  }
  const Bytes many = encode_jpeg(gradient(16, 16, 1), 16, 16, 1, 90, false, scans);
  decode_error(many, "scans.jpg", "more than 500 scans");
  // the first 500 of them decode (a valid, if incomplete, progression)
  scans.resize(500);
  EXPECT_EQ(decode(encode_jpeg(gradient(16, 16, 1), 16, 16, 1, 90, false, scans)).width, 16);
}

// ---- the pixel limit ------------------------------------------------------------------------------------------

TEST(SrImageDecode, OutputPixelLimitIsCheckedFromTheHeader) {
  const auto t0 = std::chrono::steady_clock::now();
  // a JPEG header that declares 11000 x 11000 (121 M pixels) in under a kilobyte
  const Bytes small = encode_jpeg(gradient(16, 16, 3), 16, 16, 3, 75);
  const Bytes huge = with_jpeg_size(small, 11000, 11000);
  EXPECT_LT(huge.size(), 1000u);
  const std::string p = write_temp("huge.jpg", huge);
  for (const int scale : {2, 4}) {
    try {
      sattn::sr::read_image(p, sattn::sr::kDefaultMaxPixels, scale);
      ADD_FAILURE() << "no error at x" << scale;
    } catch (const sattn::Error& e) {
      const std::string m = e.what(), n = std::to_string(int64_t(121000000) * scale * scale);
      EXPECT_EQ(e.kind(), ErrorKind::kIO) << m;
      EXPECT_NE(m.find(p), std::string::npos) << m;
      EXPECT_NE(m.find("11000x11000 at x" + std::to_string(scale) + " = " + n + " output pixels"), std::string::npos)
          << m;
      EXPECT_NE(m.find("over the limit of 134217728"), std::string::npos) << m;
    }
  }
  decode_error(huge, "huge.jpg", "11000x11000 = 121000000 pixels is over the limit of 120999999", 120999999);
  // a PNG bomb: 11000 x 11000 black 1-bit gray, all its data in a few kilobytes, 363 MB once decoded to RGB
  PngSpec bomb = png_spec(11000, 11000, 1, PNG_COLOR_TYPE_GRAY);
  bomb.compression = 9;
  const Bytes png = encode_png_with_libpng(bomb, [](int, uint8_t* row) { std::fill_n(row, 1375, 0); });
  EXPECT_LT(png.size(), 100000u);
  for (const int scale : {2, 4}) decode_error(png, "bomb.png", "output pixels is over the limit", 1 << 27, scale);
  decode_error(png, "bomb.png", "over the limit", 120999999);
  // the limit is inclusive: 4096 x 2048 at x4 is exactly 2^27 (then the missing data is the error)
  const std::string fits =
      decode_error(with_jpeg_size(small, 4096, 2048), "fits.jpg", "truncated", sattn::sr::kDefaultMaxPixels, 4);
  EXPECT_EQ(fits.find("limit"), std::string::npos) << fits;
  decode_error(with_jpeg_size(small, 4097, 2048), "over.jpg", "over the limit", sattn::sr::kDefaultMaxPixels, 4);
  // refused from the header: nothing of the 363 MB was decoded
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 20.0);
}

TEST(SrImageDecode, OutputPixelsSaturates) {
  EXPECT_EQ(sattn::sr::output_pixels(2160, 3840, 4), int64_t(132710400));
  EXPECT_EQ(sattn::sr::output_pixels(int64_t(1) << 40, int64_t(1) << 40, 2), INT64_MAX);
  EXPECT_EQ(sattn::sr::output_pixels(int64_t(1) << 30, int64_t(1) << 30, int64_t(1) << 20), INT64_MAX);
}

// Every zlib level gives the same pixels back; a higher level a smaller file on a smooth picture; a level outside
// 0..9 is refused, naming it, before any file is touched.
TEST(SrImageEncode, EveryCompressionLevelRoundTripsAndBadLevelsAreRefused) {
  Image im;
  im.height = 48, im.width = 40, im.channels = 3;
  im.data.resize(size_t(48 * 40 * 3));
  std::mt19937 rng(7);
  for (size_t i = 0; i < im.data.size(); ++i) im.data[i] = uint8_t((i / 3) % 40 * 5 + (i % 3) * 20 + rng() % 4);
  size_t stored = 0, smallest = 0;
  for (int level = 0; level <= 9; ++level) {
    const Bytes png = sattn::sr::encode_png(im, level);
    const Image back = sattn::sr::decode_image(png.data(), png.size(), "level.png");
    ASSERT_EQ(back.data, im.data) << "level " << level;
    if (level == 0) {
      stored = png.size();
      // stored rows are not filtered (filtering cannot shrink them): each row appears verbatim after filter byte 0
      // (the whole image fits one IDAT chunk and one stored block here)
      const size_t row = size_t(im.width * im.channels);
      for (int64_t y = 0; y < im.height; ++y) {
        Bytes needle{0};
        needle.insert(needle.end(), im.data.begin() + std::ptrdiff_t(size_t(y) * row),
                      im.data.begin() + std::ptrdiff_t(size_t(y + 1) * row));
        EXPECT_NE(std::search(png.begin(), png.end(), needle.begin(), needle.end()), png.end()) << "row " << y;
      }
    }
    if (level == 9) smallest = png.size();
  }
  EXPECT_GT(stored, im.data.size());  // stored blocks: the raw rows and their filter bytes
  EXPECT_LT(smallest, stored / 2);
  EXPECT_EQ(sattn::sr::encode_png(im), sattn::sr::encode_png(im, sattn::sr::kDefaultPngCompression));
  const std::string path = temp_path("untouched.png");
  std::filesystem::remove(path);
  for (int bad : {-1, 10}) {
    try {
      sattn::sr::write_png(path, im, bad);
      ADD_FAILURE() << "level " << bad << " accepted";
    } catch (const sattn::Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("compression_level must be in 0..9, given " + std::to_string(bad)),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

// libpng's own encoder at its defaults (adaptive filters) and `level`: the size the encoder should match.
size_t libpng_encoded_size(const Image& im, int level) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  size_t n = 0;
  png_set_write_fn(
      png, &n, [](png_structp p, png_bytep, size_t k) { *static_cast<size_t*>(png_get_io_ptr(p)) += k; },
      [](png_structp) {});
  png_set_compression_level(png, level);
  png_set_IHDR(png, info, png_uint_32(im.width), png_uint_32(im.height), 8,
               im.channels == 3 ? PNG_COLOR_TYPE_RGB : PNG_COLOR_TYPE_GRAY, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int64_t y = 0; y < im.height; ++y) png_write_row(png, im.data.data() + size_t(y * im.width * im.channels));
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return n;
}

// The chunks of a PNG (after the signature) as (type, data); their CRCs checked.
std::vector<std::pair<std::string, Bytes>> png_chunks(const Bytes& png) {
  std::vector<std::pair<std::string, Bytes>> out;
  auto u32 = [&](size_t at) {
    return uint32_t(png[at]) << 24 | uint32_t(png[at + 1]) << 16 | uint32_t(png[at + 2]) << 8 | png[at + 3];
  };
  for (size_t at = 8; at + 12 <= png.size();) {
    const size_t n = u32(at);
    EXPECT_LE(at + 12 + n, png.size());
    if (at + 12 + n > png.size()) break;
    EXPECT_EQ(u32(at + 8 + n), uint32_t(crc32(0, png.data() + at + 4, uInt(n + 4))));
    out.emplace_back(std::string(png.begin() + std::ptrdiff_t(at + 4), png.begin() + std::ptrdiff_t(at + 8)),
                     Bytes(png.begin() + std::ptrdiff_t(at + 8), png.begin() + std::ptrdiff_t(at + 8 + n)));
    at += 12 + n;
  }
  return out;
}

TEST(SrImageEncode, BandsMakeOneStreamWhateverTheThreadCount) {
  // Encoded in bands of ~128 KiB of rows, compressed in parallel and joined into one zlib stream. Shapes: one band,
  // several (RGB and gray, a last short band), rows longer than a band, a single column, a single pixel.
  struct Case {
    int64_t h, w, c;
  };
  for (const Case k :
       {Case{48, 40, 3}, Case{701, 300, 3}, Case{300, 1000, 1}, Case{3, 50000, 3}, Case{70000, 1, 1}, Case{1, 1, 3}}) {
    Image im;
    im.height = k.h, im.width = k.w, im.channels = int(k.c);
    im.data.resize(size_t(k.h * k.w * k.c));
    std::mt19937 rng(uint32_t(k.h * 31 + k.w));
    for (int64_t y = 0; y < k.h; ++y)  // smooth with noise: every filter type wins somewhere
      for (int64_t i = 0; i < k.w * k.c; ++i)
        im.data[size_t(y * k.w * k.c + i)] = uint8_t((y * 3 + i / k.c * 2 + i % k.c * 60) / 4 + rng() % 9);
    const std::string what = std::to_string(k.w) + "x" + std::to_string(k.h) + "x" + std::to_string(k.c);
    for (int level : {0, 1, 6, 9}) {
      const Bytes one = sattn::sr::encode_png(im, level, 1);
      for (int threads : {2, 3}) EXPECT_EQ(sattn::sr::encode_png(im, level, threads), one) << what << " " << threads;
      const Image back = sattn::sr::decode_image(one.data(), one.size(), "bands.png");
      ASSERT_EQ(back.height, k.h);
      ASSERT_EQ(back.width, k.w);
      for (int64_t p = 0; p < k.h * k.w; ++p)  // decode_image gives RGB
        ASSERT_EQ(back.data[size_t(p * 3 + 2)], im.data[size_t(p * k.c + k.c - 1)]) << what << " pixel " << p;
      // the IDAT data is one zlib stream (adler32 checked by zlib) of the filtered rows: [type 0..4, row bytes]
      const auto chunks = png_chunks(one);
      ASSERT_GE(chunks.size(), 3u);
      EXPECT_EQ(chunks.front().first, "IHDR");
      EXPECT_EQ(chunks.back().first, "IEND");
      Bytes zs;
      for (const auto& [type, data] : chunks)
        if (type == "IDAT") zs.insert(zs.end(), data.begin(), data.end());
      const int64_t stride = k.w * k.c + 1;
      Bytes raw(size_t(k.h * stride) + 1);
      uLongf raw_len = uLongf(raw.size());
      ASSERT_EQ(uncompress(raw.data(), &raw_len, zs.data(), uLong(zs.size())), Z_OK) << what << " level " << level;
      ASSERT_EQ(int64_t(raw_len), k.h * stride);
      for (int64_t y = 0; y < k.h; ++y) EXPECT_LE(raw[size_t(y * stride)], level == 0 ? 0 : 4) << "row " << y;
      // the filters and zlib strategy libpng would choose: within 1 % of libpng's own file (bands add a few bytes
      // each). Not checked for rows of under 16 bytes: the 1-pixel column comes out 1.2 % larger at level 1 (the
      // filter byte is half of each row there; not investigated further).
      if (level > 0 && k.w * k.c >= 16) {
        const double ours = double(one.size()), theirs = double(libpng_encoded_size(im, level));
        EXPECT_LT(std::abs(ours / theirs - 1), 0.01) << what << " level " << level << ": " << ours << " vs " << theirs;
      }
    }
  }
  Image im;
  im.height = im.width = 2, im.channels = 3;
  im.data.assign(12, 7);
  EXPECT_THROW(sattn::sr::encode_png(im, 1, -1), sattn::Error);
}

TEST(SrImageDecode, UnsupportedAndEmpty) {
  decode_error({}, "empty.png", "empty file");
  decode_error(Bytes(100, 0x42), "x.bin", "unsupported format");
  const std::string gif = "GIF89a";
  decode_error(Bytes(gif.begin(), gif.end()), "x.gif", "unsupported format");
  EXPECT_THROW(sattn::sr::decode_image("\xFF\xD8\xFF", 3, "x.jpg", 100, 0), sattn::Error);
}

}  // namespace
