// Drawing on RGB images, colour maps, text (a small stroke font) and base64.
#include <algorithm>
#include <array>
#include <cmath>

#include "sattn/error.hpp"
#include "viz/viz.hpp"

namespace sattn::viz {

namespace {
void check_rgb(const sr::Image& image, const char* fn) {
  check(image.channels == 3 && image.data.size() == size_t(image.height * image.width * 3), ErrorKind::kInvalidArgument,
        fn, ": expected an RGB image (3 channels), given ", image.height, "x", image.width, "x", image.channels,
        " with ", image.data.size(), " bytes");
}

bool inside(const sr::Image& image, int x, int y) { return x >= 0 && y >= 0 && x < image.width && y < image.height; }

// pixel / set_pixel without the RGB check, for loops over an image already checked.
Rgb get_rgb(const sr::Image& image, int x, int y) {
  if (!inside(image, x, y)) return kWhite;
  const uint8_t* d = image.data.data() + (int64_t(y) * image.width + x) * 3;
  return {d[0], d[1], d[2]};
}

void put_rgb(sr::Image& image, int x, int y, Rgb c) {
  if (!inside(image, x, y)) return;
  uint8_t* d = image.data.data() + (int64_t(y) * image.width + x) * 3;
  d[0] = c.r;
  d[1] = c.g;
  d[2] = c.b;
}
}  // namespace

sr::Image canvas(int height, int width, Rgb fill) {
  check(width > 0 && height > 0 && int64_t(width) * height <= (int64_t(1) << 28), ErrorKind::kInvalidArgument,
        "image: expected a size between 1x1 and 2^28 pixels, got ", width, "x", height);
  sr::Image image(height, width, 3);
  for (size_t p = 0; p < image.data.size(); p += 3) {
    image.data[p] = fill.r;
    image.data[p + 1] = fill.g;
    image.data[p + 2] = fill.b;
  }
  return image;
}

Rgb pixel(const sr::Image& image, int x, int y) {
  check_rgb(image, "pixel");
  return get_rgb(image, x, y);
}

void set_pixel(sr::Image& image, int x, int y, Rgb c) {
  check_rgb(image, "set_pixel");
  put_rgb(image, x, y, c);
}

void fill_rect(sr::Image& image, int x, int y, int w, int h, Rgb c) {
  check_rgb(image, "fill_rect");
  const int x0 = std::max(x, 0), y0 = std::max(y, 0);
  const int x1 = int(std::min<int64_t>(int64_t(x) + w, image.width));
  const int y1 = int(std::min<int64_t>(int64_t(y) + h, image.height));
  for (int yy = y0; yy < y1; ++yy)
    for (int xx = x0; xx < x1; ++xx) put_rgb(image, xx, yy, c);
}

void draw_rect(sr::Image& image, int x, int y, int w, int h, Rgb c) {
  fill_rect(image, x, y, w, 1, c);
  fill_rect(image, x, y + h - 1, w, 1, c);
  fill_rect(image, x, y, 1, h, c);
  fill_rect(image, x + w - 1, y, 1, h, c);
}

void draw_line(sr::Image& image, double x0, double y0, double x1, double y1, Rgb c, double width) {
  // Stamps a square of side `width` every half pixel along the segment (no anti-aliasing; plots are simple).
  const double len = std::hypot(x1 - x0, y1 - y0);
  const int steps = std::max(1, int(std::ceil(len * 2)));
  const int half = std::max(0, int(std::round(width / 2 - 0.5)));
  const int side = 2 * half + 1;
  for (int s = 0; s <= steps; ++s) {
    const double t = double(s) / steps;
    const int x = int(std::lround(x0 + t * (x1 - x0))), y = int(std::lround(y0 + t * (y1 - y0)));
    fill_rect(image, x - half, y - half, side, side, c);
  }
}

void fill_circle(sr::Image& image, double cx, double cy, double r, Rgb c) {
  for (int y = int(std::floor(cy - r)); y <= int(std::ceil(cy + r)); ++y)
    for (int x = int(std::floor(cx - r)); x <= int(std::ceil(cx + r)); ++x)
      if ((x - cx) * (x - cx) + (y - cy) * (y - cy) <= r * r) set_pixel(image, x, y, c);
}

void blit(sr::Image& image, const sr::Image& src, int x, int y) {
  check_rgb(image, "blit");
  check_rgb(src, "blit");
  for (int yy = 0; yy < int(src.height); ++yy)
    for (int xx = 0; xx < int(src.width); ++xx) put_rgb(image, x + xx, y + yy, get_rgb(src, xx, yy));
}

sr::Image rotated_ccw(const sr::Image& image) {
  check_rgb(image, "rotated_ccw");
  const int h = int(image.height), w = int(image.width);
  sr::Image out = canvas(w, h);
  // Pixel (x, y) goes to (y, W - 1 - x).
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) put_rgb(out, y, w - 1 - x, get_rgb(image, x, y));
  return out;
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
// The stroke font of stb_easy_font 1.1 (Sean Barrett, public domain): per printable ASCII character its advance
// (low 4 bits; bit 4 moves the glyph one pixel down) and where its horizontal and vertical segments start in
// kHSeg / kVSeg (a character's segments end where the next character's begin). A segment byte holds its length
// in bits 0-2 (0: none), in bit 3 a one-pixel step right taken before it, and its row in bits 4-7.
struct Glyph {
  uint8_t advance, h_seg, v_seg;
};
constexpr Glyph kGlyphs[96] = {
    {6, 0, 0},      {3, 0, 0},      {5, 1, 1},      {7, 1, 4},      {7, 3, 7},      {7, 6, 12},     {7, 8, 19},
    {4, 16, 21},    {4, 17, 22},    {4, 19, 23},    {23, 21, 24},   {23, 22, 31},   {20, 23, 34},   {22, 23, 36},
    {19, 24, 36},   {21, 25, 36},   {6, 25, 39},    {6, 27, 43},    {6, 28, 45},    {6, 30, 49},    {6, 33, 53},
    {6, 34, 57},    {6, 40, 58},    {6, 46, 59},    {6, 47, 62},    {6, 55, 64},    {19, 57, 68},   {20, 59, 68},
    {21, 61, 69},   {22, 66, 69},   {21, 68, 69},   {7, 73, 69},    {9, 75, 74},    {6, 78, 81},    {6, 80, 85},
    {6, 83, 90},    {6, 85, 91},    {6, 87, 95},    {6, 90, 96},    {7, 92, 97},    {6, 96, 102},   {5, 97, 106},
    {6, 99, 107},   {6, 100, 110},  {6, 100, 115},  {7, 101, 116},  {6, 101, 121},  {6, 101, 125},  {6, 102, 129},
    {7, 103, 133},  {6, 104, 140},  {6, 105, 145},  {7, 107, 149},  {6, 108, 151},  {7, 109, 155},  {7, 109, 160},
    {7, 109, 165},  {7, 118, 167},  {6, 118, 172},  {4, 120, 176},  {6, 122, 177},  {4, 122, 181},  {23, 124, 182},
    {22, 129, 182}, {4, 130, 182},  {22, 131, 183}, {6, 133, 187},  {22, 135, 191}, {6, 137, 192},  {22, 139, 196},
    {6, 144, 197},  {22, 147, 198}, {6, 150, 202},  {19, 151, 206}, {21, 152, 207}, {6, 155, 209},  {3, 160, 210},
    {23, 160, 211}, {22, 164, 216}, {22, 165, 220}, {22, 167, 224}, {22, 169, 228}, {21, 171, 232}, {21, 173, 233},
    {5, 178, 233},  {22, 179, 234}, {23, 180, 238}, {23, 180, 243}, {23, 180, 248}, {22, 189, 248}, {22, 191, 252},
    {5, 196, 252},  {3, 203, 252},  {5, 203, 253},  {22, 210, 253}, {0, 214, 253},
};
constexpr uint8_t kHSeg[214] = {
    97, 37, 69,  84,  28,  51,  2,  18, 10,  49,  98, 41, 65,  25, 81, 105, 33, 9,  97, 1,  97, 37, 37,  36,
    81, 10, 98,  107, 3,   100, 3,  99, 58,  51,  4,  99, 58,  8,  73, 81,  10, 50, 98, 8,  73, 81, 4,   10,
    50, 98, 8,   25,  33,  65,  81, 10, 50,  17,  65, 97, 25,  33, 25, 49,  9,  65, 20, 68, 1,  65, 25,  49,
    41, 11, 105, 13,  101, 76,  10, 50, 10,  50,  98, 11, 99,  10, 98, 11,  50, 99, 11, 50, 11, 99, 8,   57,
    58, 3,  99,  99,  107, 10,  10, 11, 10,  99,  11, 5,  100, 41, 65, 57,  41, 65, 9,  17, 81, 97, 3,   107,
    9,  97, 1,   97,  33,  25,  9,  25, 41,  100, 41, 26, 82,  42, 98, 27,  83, 42, 98, 26, 51, 82, 8,   41,
    35, 8,  10,  26,  82,  114, 42, 1,  114, 8,   9,  73, 57,  81, 41, 97,  18, 8,  8,  25, 26, 26, 82,  26,
    82, 26, 82,  41,  25,  33,  82, 26, 49,  73,  35, 90, 17,  81, 41, 65,  57, 41, 65, 25, 81, 90, 114, 20,
    84, 73, 57,  41,  49,  25,  33, 65, 81,  9,   97, 1,  97,  25, 33, 65,  81, 57, 33, 25, 41, 25,
};
constexpr uint8_t kVSeg[253] = {
    4,  2,  8,  10, 15,  8,  15, 33, 8,  15, 8,  73, 82, 73,  57, 41, 82, 10, 82, 18, 66, 10, 21,  29,  1,   65,
    27, 8,  27, 9,  65,  8,  10, 50, 97, 74, 66, 42, 10, 21,  57, 41, 29, 25, 14, 81, 73, 57, 26,  8,   8,   26,
    66, 3,  8,  8,  15,  19, 21, 90, 58, 26, 18, 66, 18, 105, 89, 28, 74, 17, 8,  73, 57, 26, 21,  8,   42,  41,
    42, 8,  28, 22, 8,   8,  30, 7,  8,  8,  26, 66, 21, 7,   8,  8,  29, 7,  7,  21, 8,  8,  8,   59,  7,   8,
    8,  15, 29, 8,  8,   14, 7,  57, 43, 10, 82, 7,  7,  25,  42, 25, 15, 7,  25, 41, 15, 21, 105, 105, 29,  7,
    57, 57, 26, 21, 105, 73, 97, 89, 28, 97, 7,  57, 58, 26,  82, 18, 57, 57, 74, 8,  30, 6,  8,   8,   14,  3,
    58, 90, 58, 11, 7,   74, 43, 74, 15, 2,  82, 2,  42, 75,  42, 10, 67, 57, 41, 10, 7,  2,  42,  74,  106, 15,
    2,  35, 8,  8,  29,  7,  8,  8,  59, 35, 51, 8,  8,  15,  35, 30, 35, 8,  8,  30, 7,  8,  8,   60,  36,  8,
    45, 7,  7,  36, 8,   43, 8,  44, 21, 8,  8,  44, 35, 8,   8,  43, 23, 8,  8,  43, 35, 8,  8,   31,  21,  15,
    20, 8,  8,  28, 18,  58, 89, 58, 26, 21, 89, 73, 89, 29,  20, 8,  8,  30, 7,
};

std::string printable(const std::string& text) {
  std::string s = text;
  for (char& c : s)
    if (c < 32 || c > 126) c = '?';
  return s;
}

void draw_segments(sr::Image& image, int x, int y, const uint8_t* segments, int count, bool vertical, Rgb colour,
                   int scale) {
  int dx = 0;
  for (int i = 0; i < count; ++i) {
    const int length = segments[i] & 7, row = segments[i] >> 4;
    dx += (segments[i] >> 3) & 1;
    if (length == 0) continue;
    fill_rect(image, x + dx * scale, y + row * scale, (vertical ? 1 : length) * scale, (vertical ? length : 1) * scale,
              colour);
  }
}
}  // namespace

void draw_text(sr::Image& image, int x, int y, const std::string& text, Rgb colour, int scale) {
  for (const char ch : printable(text)) {
    const size_t c = size_t(ch - 32);  // printable: c + 1 <= 95
    const Glyph& g = kGlyphs[c];
    const int gy = y + (g.advance & 16 ? scale : 0);
    draw_segments(image, x, gy, kHSeg + g.h_seg, kGlyphs[c + 1].h_seg - g.h_seg, false, colour, scale);
    draw_segments(image, x, gy, kVSeg + g.v_seg, kGlyphs[c + 1].v_seg - g.v_seg, true, colour, scale);
    x += (g.advance & 15) * scale;
  }
}

int text_width(const std::string& text, int scale) {
  int width = 0;
  for (const char ch : printable(text)) width += kGlyphs[size_t(ch - 32)].advance & 15;
  return width * scale;
}

int text_height(int scale) { return 7 * scale; }

void draw_text_vertical(sr::Image& image, int x, int y, const std::string& text, Rgb colour, int scale) {
  const int w = text_width(text, scale), h = text_height(scale) + 2 * scale;
  if (w <= 0) return;
  sr::Image tmp = canvas(h, w, kWhite);
  draw_text(tmp, 0, 0, text, colour, scale);
  const sr::Image rot = rotated_ccw(tmp);
  // Copy only the text pixels so that the background under the label is kept.
  for (int yy = 0; yy < int(rot.height); ++yy)
    for (int xx = 0; xx < int(rot.width); ++xx)
      if (get_rgb(rot, xx, yy) == colour) set_pixel(image, x + xx, y + yy, colour);
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

std::string png_data_uri(const sr::Image& image) {
  return "data:image/png;base64," + base64_encode(sr::encode_png(image));
}

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
