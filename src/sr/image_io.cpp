// PNG/JPEG decoding (stb_image) and PNG writing (stb_image_write), with the header checked before decoding.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>

#include "io/writers.hpp"
#include "sattn/error.hpp"
#include "sattn/sr.hpp"
#include "stb_image.h"
#include "stb_image_write.h"

namespace sattn::sr {
namespace {

bool is_png(const unsigned char* p, size_t n) {
  static const unsigned char sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  return n >= 8 && std::memcmp(p, sig, 8) == 0;
}
bool is_jpeg(const unsigned char* p, size_t n) { return n >= 3 && p[0] == 0xFF && p[1] == 0xD8 && p[2] == 0xFF; }

// A baseline/progressive JPEG ends with the EOI marker FF D9 (possibly followed by padding); stb_image decodes
// truncated scans silently (filling grey), so truncation is detected here.
bool jpeg_has_eoi(const unsigned char* p, size_t n) {
  const size_t start = n > 4096 ? n - 4096 : 2;
  for (size_t i = n; i-- > start + 1;)
    if (p[i - 1] == 0xFF && p[i] == 0xD9) return true;
  return false;
}

}  // namespace

Image decode_image(const void* data, size_t size, const std::string& name, int64_t max_pixels) {
  const auto* p = static_cast<const unsigned char*>(data);
  check(size > 0, ErrorKind::kIO, "image '", name, "': empty file");
  const bool png = is_png(p, size), jpeg = is_jpeg(p, size);
  check(png || jpeg, ErrorKind::kIO, "image '", name, "': unsupported format (expected PNG or JPEG by signature)");
  check(size <= size_t(INT32_MAX), ErrorKind::kIO, "image '", name, "': file too large (", size, " bytes)");
  int w = 0, h = 0, c = 0;
  if (!stbi_info_from_memory(p, int(size), &w, &h, &c))
    fail(ErrorKind::kIO, "image '", name, "': corrupt ", png ? "PNG" : "JPEG", " header (", stbi_failure_reason(),
         ")");
  check(w > 0 && h > 0, ErrorKind::kIO, "image '", name, "': invalid size ", w, "x", h);
  check(int64_t(w) * int64_t(h) <= max_pixels, ErrorKind::kIO, "image '", name, "': ", w, "x", h, " = ",
        int64_t(w) * h, " pixels is over the limit of ", max_pixels, " pixels");
  check(c >= 1 && c <= 4, ErrorKind::kIO, "image '", name, "': unsupported channel count ", c);
  if (jpeg)
    check(jpeg_has_eoi(p, size), ErrorKind::kIO, "image '", name, "': truncated JPEG (no end-of-image marker)");
  int w2 = 0, h2 = 0, c2 = 0;
  std::unique_ptr<unsigned char, void (*)(void*)> pix(stbi_load_from_memory(p, int(size), &w2, &h2, &c2, 0),
                                                      stbi_image_free);
  if (!pix)
    fail(ErrorKind::kIO, "image '", name, "': corrupt or truncated ", png ? "PNG" : "JPEG", " data (",
         stbi_failure_reason(), ")");
  check(w2 == w && h2 == h && c2 == c, ErrorKind::kIO, "image '", name, "': header and data disagree");
  Image img(h, w, 3);
  img.source_channels = c;
  const unsigned char* s = pix.get();
  const size_t n = size_t(w) * size_t(h);
  for (size_t i = 0; i < n; ++i) {
    const unsigned char* px = s + i * size_t(c);
    uint8_t* o = img.data.data() + i * 3;
    if (c >= 3) {
      o[0] = px[0], o[1] = px[1], o[2] = px[2];
    } else {
      o[0] = o[1] = o[2] = px[0];  // gray (+alpha): replicated to RGB, alpha dropped
    }
  }
  return img;
}

Image read_image(const std::string& path, int64_t max_pixels) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  check(bool(f), ErrorKind::kIO, "image '", path, "': cannot open (", std::strerror(errno), ")");
  const std::streamoff n = f.tellg();
  check(n >= 0, ErrorKind::kIO, "image '", path, "': cannot read (not a regular file?)");
  check(n <= std::streamoff(INT32_MAX), ErrorKind::kIO, "image '", path, "': file too large (", int64_t(n),
        " bytes)");
  std::vector<unsigned char> buf(static_cast<size_t>(n));
  f.seekg(0);
  if (n > 0) f.read(reinterpret_cast<char*>(buf.data()), n);
  check(bool(f), ErrorKind::kIO, "image '", path, "': read error");
  return decode_image(buf.data(), buf.size(), path, max_pixels);
}

std::vector<uint8_t> encode_png(const Image& image) {
  check(image.channels == 1 || image.channels == 3, ErrorKind::kInvalidArgument,
        "write_png: image channels must be 1 or 3, given ", image.channels);
  check(image.height > 0 && image.width > 0 && image.width <= INT32_MAX / 4 && image.height <= INT32_MAX,
        ErrorKind::kInvalidArgument, "write_png: invalid image size ", image.width, "x", image.height);
  check(image.data.size() == size_t(image.height * image.width * image.channels), ErrorKind::kInvalidArgument,
        "write_png: image data size ", image.data.size(), " does not match ", image.width, "x", image.height, "x",
        image.channels);
  std::vector<uint8_t> bytes;
  const auto append = [](void* context, void* data, int size) {
    auto* out = static_cast<std::vector<uint8_t>*>(context);
    out->insert(out->end(), static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + size);
  };
  const int ok = stbi_write_png_to_func(append, &bytes, int(image.width), int(image.height), int(image.channels),
                                        image.data.data(), int(image.width * image.channels));
  check(ok != 0 && !bytes.empty(), ErrorKind::kInternal, "write_png: PNG encoding failed for a ", image.width, "x",
        image.height, " image");
  return bytes;
}

void write_png(io::OutputFile& out, const Image& image) {
  const std::vector<uint8_t> png = encode_png(image);
  out.write(png.data(), png.size());
}

void write_png(const std::string& path, const Image& image) {
  io::OutputFile out(path);
  write_png(out, image);
  out.commit();
}

}  // namespace sattn::sr
