// Image buffer, PNG output (stb_image_write, implementation from Debian's libstb.so), colour maps, text and base64.
#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "io/writers.hpp"
#include "sattn/error.hpp"
#include "sattn/viz.hpp"

// The implementation of stb_image_write lives in libstb (linked in CMake); only declarations are needed here.
#include <stb/stb_image_write.h>
// stb_easy_font is header-only with static functions (Debian does not precompile it).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#include <stb/stb_easy_font.h>
#pragma GCC diagnostic pop

namespace sattn::viz {

Image::Image(int width, int height, Rgb fill) : width_(width), height_(height) {
  check(width > 0 && height > 0 && int64_t(width) * height <= (int64_t(1) << 28), ErrorKind::kInvalidArgument,
        "image: expected a size between 1x1 and 2^28 pixels, got ", width, "x", height);
  pixels_.resize(size_t(width) * size_t(height) * 3);
  for (size_t p = 0; p < pixels_.size(); p += 3) {
    pixels_[p] = fill.r;
    pixels_[p + 1] = fill.g;
    pixels_[p + 2] = fill.b;
  }
}

Rgb Image::get(int x, int y) const {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return kWhite;
  const size_t p = (size_t(y) * size_t(width_) + size_t(x)) * 3;
  return {pixels_[p], pixels_[p + 1], pixels_[p + 2]};
}

void Image::set(int x, int y, Rgb c) {
  if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
  const size_t p = (size_t(y) * size_t(width_) + size_t(x)) * 3;
  pixels_[p] = c.r;
  pixels_[p + 1] = c.g;
  pixels_[p + 2] = c.b;
}

void Image::fill_rect(int x, int y, int w, int h, Rgb c) {
  const int x0 = std::max(x, 0), y0 = std::max(y, 0);
  const int x1 = std::min(x + w, width_), y1 = std::min(y + h, height_);
  for (int yy = y0; yy < y1; ++yy)
    for (int xx = x0; xx < x1; ++xx) set(xx, yy, c);
}

void Image::draw_rect(int x, int y, int w, int h, Rgb c) {
  fill_rect(x, y, w, 1, c);
  fill_rect(x, y + h - 1, w, 1, c);
  fill_rect(x, y, 1, h, c);
  fill_rect(x + w - 1, y, 1, h, c);
}

void Image::draw_line(double x0, double y0, double x1, double y1, Rgb c, double width) {
  // Stamps a square of side `width` every half pixel along the segment (no anti-aliasing; plots are simple).
  const double len = std::hypot(x1 - x0, y1 - y0);
  const int steps = std::max(1, int(std::ceil(len * 2)));
  const int half = std::max(0, int(std::round(width / 2 - 0.5)));
  const int side = 2 * half + 1;
  for (int s = 0; s <= steps; ++s) {
    const double t = double(s) / steps;
    const int x = int(std::lround(x0 + t * (x1 - x0))), y = int(std::lround(y0 + t * (y1 - y0)));
    fill_rect(x - half, y - half, side, side, c);
  }
}

void Image::fill_circle(double cx, double cy, double r, Rgb c) {
  for (int y = int(std::floor(cy - r)); y <= int(std::ceil(cy + r)); ++y)
    for (int x = int(std::floor(cx - r)); x <= int(std::ceil(cx + r)); ++x)
      if ((x - cx) * (x - cx) + (y - cy) * (y - cy) <= r * r) set(x, y, c);
}

void Image::blit(const Image& src, int x, int y) {
  for (int yy = 0; yy < src.height(); ++yy)
    for (int xx = 0; xx < src.width(); ++xx) set(x + xx, y + yy, src.get(xx, yy));
}

Image Image::rotated_ccw() const {
  Image out(height_, width_);
  // Pixel (x, y) goes to (y, W - 1 - x).
  for (int y = 0; y < height_; ++y)
    for (int x = 0; x < width_; ++x) out.set(y, width_ - 1 - x, get(x, y));
  return out;
}

// ---- PNG ---------------------------------------------------------------------------------------------------

namespace {
void append_bytes(void* context, void* data, int size) {
  auto* out = static_cast<std::vector<uint8_t>*>(context);
  const auto* p = static_cast<const uint8_t*>(data);
  out->insert(out->end(), p, p + size);
}
}  // namespace

std::vector<uint8_t> encode_png(const Image& image) {
  check(image.width() > 0 && image.height() > 0, ErrorKind::kInvalidArgument, "image: cannot encode an empty image");
  std::vector<uint8_t> bytes;
  const int ok = stbi_write_png_to_func(append_bytes, &bytes, image.width(), image.height(), 3,
                                        image.pixels().data(), image.width() * 3);
  check(ok != 0 && !bytes.empty(), ErrorKind::kInternal, "PNG encoding failed for a ", image.width(), "x",
        image.height(), " image");
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

// ---- colour maps -------------------------------------------------------------------------------------------

namespace {
// matplotlib's viridis and magma sampled at t = 0, 1/8, ..., 1 (perceptually uniform; linear in between).
constexpr std::array<Rgb, 9> kViridis = {{{68, 1, 84},
                                          {72, 40, 120},
                                          {62, 73, 137},
                                          {49, 104, 142},
                                          {38, 130, 142},
                                          {31, 158, 137},
                                          {53, 183, 121},
                                          {110, 206, 88},
                                          {253, 231, 37}}};
constexpr std::array<Rgb, 9> kMagma = {{{0, 0, 4},
                                        {28, 16, 68},
                                        {79, 18, 123},
                                        {129, 37, 129},
                                        {181, 54, 122},
                                        {229, 80, 100},
                                        {251, 135, 97},
                                        {254, 194, 135},
                                        {252, 253, 191}}};
}  // namespace

Colormap parse_colormap(const std::string& name) {
  if (name == "viridis") return Colormap::kViridis;
  if (name == "magma") return Colormap::kMagma;
  if (name == "gray" || name == "grey") return Colormap::kGray;
  fail(ErrorKind::kInvalidArgument, "colormap: expected 'viridis', 'magma' or 'gray', got '", name, "'");
}

const char* to_string(Colormap cmap) {
  switch (cmap) {
    case Colormap::kViridis: return "viridis";
    case Colormap::kMagma: return "magma";
    case Colormap::kGray: return "gray";
  }
  return "?";
}

Rgb colormap(Colormap cmap, double t) {
  if (std::isnan(t)) return kMaskedGrey;
  t = std::clamp(t, 0.0, 1.0);
  if (cmap == Colormap::kGray) {
    const auto v = uint8_t(std::lround(255 * t));
    return {v, v, v};
  }
  const auto& table = cmap == Colormap::kMagma ? kMagma : kViridis;
  const double pos = t * double(table.size() - 1);
  const size_t i = std::min(size_t(pos), table.size() - 2);
  const double f = pos - double(i);
  auto mix = [f](uint8_t a, uint8_t b) { return uint8_t(std::lround(a + f * (double(b) - double(a)))); };
  return {mix(table[i].r, table[i + 1].r), mix(table[i].g, table[i + 1].g), mix(table[i].b, table[i + 1].b)};
}

// ---- text --------------------------------------------------------------------------------------------------

namespace {
std::string printable(const std::string& text) {
  std::string s = text;
  for (char& c : s)
    if (c < 32 || c > 126) c = '?';
  return s;
}
}  // namespace

void draw_text(Image& image, int x, int y, const std::string& text, Rgb colour, int scale) {
  if (text.empty()) return;
  std::string s = printable(text);
  // ~270 bytes per character (the header's estimate); 16 bytes per vertex, 4 vertices per quad.
  std::vector<char> buffer(s.size() * 400 + 64);
  const int quads = stb_easy_font_print(0, 0, s.data(), nullptr, buffer.data(), int(buffer.size()));
  for (int q = 0; q < quads; ++q) {
    float v[4][2];
    for (int c = 0; c < 4; ++c) std::memcpy(v[c], buffer.data() + (size_t(q) * 4 + c) * 16, sizeof(float) * 2);
    const float qx0 = std::min({v[0][0], v[1][0], v[2][0], v[3][0]}), qx1 = std::max({v[0][0], v[1][0], v[2][0], v[3][0]});
    const float qy0 = std::min({v[0][1], v[1][1], v[2][1], v[3][1]}), qy1 = std::max({v[0][1], v[1][1], v[2][1], v[3][1]});
    const int px0 = x + int(std::lround(qx0 * scale)), px1 = x + int(std::lround(qx1 * scale));
    const int py0 = y + int(std::lround(qy0 * scale)), py1 = y + int(std::lround(qy1 * scale));
    image.fill_rect(px0, py0, std::max(px1 - px0, 1), std::max(py1 - py0, 1), colour);
  }
}

int text_width(const std::string& text, int scale) {
  if (text.empty()) return 0;
  std::string s = printable(text);
  return stb_easy_font_width(s.data()) * scale;
}

int text_height(int scale) { return 7 * scale; }

void draw_text_vertical(Image& image, int x, int y, const std::string& text, Rgb colour, int scale) {
  const int w = text_width(text, scale), h = text_height(scale) + 2 * scale;
  if (w <= 0) return;
  Image tmp(w, h, kWhite);
  draw_text(tmp, 0, 0, text, colour, scale);
  const Image rot = tmp.rotated_ccw();
  // Copy only the text pixels so that the background under the label is kept.
  for (int yy = 0; yy < rot.height(); ++yy)
    for (int xx = 0; xx < rot.width(); ++xx)
      if (rot.get(xx, yy) == colour) image.set(x + xx, y + yy, colour);
}

// ---- base64 / HTML -------------------------------------------------------------------------------------------

std::string base64_encode(const std::vector<uint8_t>& bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint32_t(bytes[i]) << 16) | (uint32_t(bytes[i + 1]) << 8) | bytes[i + 2];
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  if (i < bytes.size()) {  // 1 or 2 bytes left: pad with '='
    const bool two = i + 1 < bytes.size();
    const uint32_t v = (uint32_t(bytes[i]) << 16) | (two ? uint32_t(bytes[i + 1]) << 8 : 0u);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += two ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::string png_data_uri(const Image& image) { return "data:image/png;base64," + base64_encode(encode_png(image)); }

std::string html_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace sattn::viz
