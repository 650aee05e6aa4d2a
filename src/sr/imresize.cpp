// MATLAB-compatible bicubic imresize (as sr/train/imresize.py) and the BasicSR Y-channel PSNR / SSIM
// (as sr/train/metrics.py), all in double precision.
#include <cmath>
#include <limits>

#include "sattn/error.hpp"
#include "sattn/sr.hpp"

namespace sattn::sr {
namespace {

// Keys cubic kernel, a = -0.5 (MATLAB's 'bicubic').
double cubic(double x) {
  const double ax = std::fabs(x), ax2 = ax * ax, ax3 = ax2 * ax;
  if (ax <= 1) return 1.5 * ax3 - 2.5 * ax2 + 1.0;
  if (ax <= 2) return -0.5 * ax3 + 2.5 * ax2 - 4.0 * ax + 2.0;
  return 0.0;
}

// MATLAB contributions(): for each output index, `taps` (source index, weight) pairs.
struct Contrib {
  int64_t taps = 0;
  std::vector<int64_t> index;  // [out_len * taps], 0-based, symmetric padding applied
  std::vector<double> weight;  // [out_len * taps], normalised
};

Contrib contributions(int64_t in_len, int64_t out_len, double scale) {
  double kernel_width = 4.0;
  const bool shrink = scale < 1;
  if (shrink) kernel_width /= scale;
  Contrib c;
  c.taps = int64_t(std::ceil(kernel_width)) + 2;
  c.index.resize(size_t(out_len * c.taps));
  c.weight.resize(size_t(out_len * c.taps));
  for (int64_t o = 0; o < out_len; ++o) {
    const double x = double(o + 1);
    const double u = x / scale + 0.5 * (1.0 - 1.0 / scale);  // input coordinate, 1-based
    const double left = std::floor(u - kernel_width / 2.0);
    double sum = 0;
    for (int64_t t = 0; t < c.taps; ++t) {
      const double idx = left + double(t);
      const double d = u - idx;
      const double w = shrink ? scale * cubic(d * scale) : cubic(d);
      c.weight[size_t(o * c.taps + t)] = w;
      sum += w;
      // symmetric padding: MATLAB aux = [1..n, n..1], index (idx - 1) mod 2n
      int64_t m = (int64_t(idx) - 1) % (2 * in_len);
      if (m < 0) m += 2 * in_len;
      c.index[size_t(o * c.taps + t)] = m < in_len ? m : 2 * in_len - 1 - m;
    }
    for (int64_t t = 0; t < c.taps; ++t) c.weight[size_t(o * c.taps + t)] /= sum;
  }
  return c;
}

// Resizes a [h, w, ch] double image (interleaved): height first, then width.
std::vector<double> resize_hw(const std::vector<double>& a, int64_t h, int64_t w, int64_t ch, double scale, int64_t oh,
                              int64_t ow) {
  const Contrib ch_ = contributions(h, oh, scale), cw = contributions(w, ow, scale);
  std::vector<double> t(size_t(oh * w * ch), 0.0);
  for (int64_t y = 0; y < oh; ++y)
    for (int64_t k = 0; k < ch_.taps; ++k) {
      const double wt = ch_.weight[size_t(y * ch_.taps + k)];
      const double* src = &a[size_t(ch_.index[size_t(y * ch_.taps + k)] * w * ch)];
      double* dst = &t[size_t(y * w * ch)];
      for (int64_t i = 0; i < w * ch; ++i) dst[i] += wt * src[i];
    }
  std::vector<double> out(size_t(oh * ow * ch), 0.0);
  for (int64_t y = 0; y < oh; ++y)
    for (int64_t x = 0; x < ow; ++x) {
      double* dst = &out[size_t((y * ow + x) * ch)];
      for (int64_t k = 0; k < cw.taps; ++k) {
        const double wt = cw.weight[size_t(x * cw.taps + k)];
        const double* src = &t[size_t((y * w + cw.index[size_t(x * cw.taps + k)]) * ch)];
        for (int64_t c = 0; c < ch; ++c) dst[c] += wt * src[c];
      }
    }
  return out;
}

void check_resize_args(int64_t h, int64_t w, double scale, int64_t& oh, int64_t& ow) {
  check(h > 0 && w > 0, ErrorKind::kInvalidArgument, "imresize: image must be non-empty, given ", w, "x", h);
  check(std::isfinite(scale) && scale > 0, ErrorKind::kInvalidArgument, "imresize: scale must be > 0, given ", scale);
  if (oh <= 0) oh = int64_t(std::ceil(double(h) * scale - 1e-9));
  if (ow <= 0) ow = int64_t(std::ceil(double(w) * scale - 1e-9));
  check(oh > 0 && ow > 0 && double(oh) * double(ow) <= double(int64_t(1) << 31), ErrorKind::kInvalidArgument,
        "imresize: output size ", ow, "x", oh, " must be between 1 and 2^31 pixels");
}

}  // namespace

std::vector<double> imresize_plane(const std::vector<double>& plane, int64_t h, int64_t w, double scale, int64_t out_h,
                                   int64_t out_w) {
  check(plane.size() == size_t(h * w), ErrorKind::kInvalidArgument, "imresize_plane: plane size ", plane.size(),
        " != h*w = ", h * w);
  check_resize_args(h, w, scale, out_h, out_w);
  return resize_hw(plane, h, w, 1, scale, out_h, out_w);
}

Image imresize(const Image& image, double scale, int64_t out_h, int64_t out_w) {
  check_resize_args(image.height, image.width, scale, out_h, out_w);
  const std::vector<double> a(image.data.begin(), image.data.end());
  const std::vector<double> r = resize_hw(a, image.height, image.width, image.channels, scale, out_h, out_w);
  Image out(out_h, out_w, image.channels);
  for (size_t i = 0; i < r.size(); ++i) {
    const double v = std::floor(r[i] + 0.5);  // MATLAB uint8(): round half away from zero (v >= -0.5 here)...
    out.data[i] = uint8_t(v < 0 ? 0 : (v > 255 ? 255 : v));  // ... and saturate
  }
  return out;
}

Image mod_crop(const Image& image, int s) {
  check(s >= 1, ErrorKind::kInvalidArgument, "mod_crop: scale must be >= 1, given ", s);
  const int64_t h = image.height - image.height % s, w = image.width - image.width % s;
  Image out(h, w, image.channels);
  out.source_channels = image.source_channels;
  for (int64_t y = 0; y < h; ++y)
    std::copy_n(&image.data[size_t(y * image.width * image.channels)], size_t(w * image.channels),
                &out.data[size_t(y * w * image.channels)]);
  return out;
}

Image downscale(const Image& hr, int s) {
  check(s >= 1, ErrorKind::kInvalidArgument, "downscale: scale must be >= 1, given ", s);
  check(hr.height % s == 0 && hr.width % s == 0, ErrorKind::kInvalidArgument, "downscale: image size ", hr.width, "x",
        hr.height, " must be a multiple of the scale ", s, " (crop it first)");
  check(hr.height >= s && hr.width >= s, ErrorKind::kInvalidArgument, "downscale: image ", hr.width, "x", hr.height,
        " smaller than the scale ", s);
  return imresize(hr, 1.0 / s);
}

Image upscale_bicubic(const Image& lr, int s) {
  check(s >= 1, ErrorKind::kInvalidArgument, "upscale_bicubic: scale must be >= 1, given ", s);
  return imresize(lr, double(s), lr.height * s, lr.width * s);
}

// ---- metrics ----------------------------------------------------------------------------------------------
namespace {

std::vector<double> y_channel(const Image& im, int border, int64_t& h, int64_t& w) {
  h = im.height - 2 * border;
  w = im.width - 2 * border;
  std::vector<double> y(size_t(h * w));
  for (int64_t i = 0; i < h; ++i)
    for (int64_t j = 0; j < w; ++j) {
      const double r = im.at(i + border, j + border, 0) / 255.0, g = im.at(i + border, j + border, 1) / 255.0,
                   b = im.at(i + border, j + border, 2) / 255.0;
      y[size_t(i * w + j)] = 16.0 + r * 65.481 + g * 128.553 + b * 24.966;
    }
  return y;
}

void check_pair(const Image& a, const Image& b, int border, const char* fn) {
  check(a.channels == 3 && b.channels == 3, ErrorKind::kInvalidArgument, fn, ": images must be RGB, given ", a.channels,
        " and ", b.channels, " channels");
  check(a.height == b.height && a.width == b.width, ErrorKind::kInvalidArgument, fn, ": image sizes differ: ", a.width,
        "x", a.height, " vs ", b.width, "x", b.height);
  check(border >= 0 && a.height > 2 * border && a.width > 2 * border, ErrorKind::kInvalidArgument, fn, ": border ",
        border, " leaves nothing of a ", a.width, "x", a.height, " image");
}

}  // namespace

double psnr_y(const Image& a, const Image& b, int border) {
  check_pair(a, b, border, "psnr_y");
  int64_t h, w;
  const std::vector<double> y1 = y_channel(a, border, h, w), y2 = y_channel(b, border, h, w);
  double se = 0;
  for (size_t i = 0; i < y1.size(); ++i) se += (y1[i] - y2[i]) * (y1[i] - y2[i]);
  const double mse = se / double(y1.size());
  if (mse == 0) return std::numeric_limits<double>::infinity();
  return 10.0 * std::log10(255.0 * 255.0 / mse);
}

double ssim_y(const Image& a, const Image& b, int border) {
  check_pair(a, b, border, "ssim_y");
  int64_t h, w;
  const std::vector<double> y1 = y_channel(a, border, h, w), y2 = y_channel(b, border, h, w);
  check(h >= 11 && w >= 11, ErrorKind::kInvalidArgument, "ssim_y: need at least 11x11 pixels after the border, given ",
        w, "x", h);
  double g[11], gs = 0;
  for (int i = 0; i < 11; ++i) gs += (g[i] = std::exp(-(i - 5.0) * (i - 5.0) / (2 * 1.5 * 1.5)));
  for (double& v : g) v /= gs;
  const int64_t oh = h - 10, ow = w - 10;
  // Separable valid filtering of the five maps (x, y, x², y², xy): rows first, then columns.
  auto filter = [&](auto value) {
    std::vector<double> t(size_t(h * ow)), out(size_t(oh * ow));
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < ow; ++j) {
        double s = 0;
        for (int k = 0; k < 11; ++k) s += g[k] * value(size_t(i * w + j + k));
        t[size_t(i * ow + j)] = s;
      }
    for (int64_t i = 0; i < oh; ++i)
      for (int64_t j = 0; j < ow; ++j) {
        double s = 0;
        for (int k = 0; k < 11; ++k) s += g[k] * t[size_t((i + k) * ow + j)];
        out[size_t(i * ow + j)] = s;
      }
    return out;
  };
  const auto mu1 = filter([&](size_t i) { return y1[i]; }), mu2 = filter([&](size_t i) { return y2[i]; });
  const auto e11 = filter([&](size_t i) { return y1[i] * y1[i]; }),
             e22 = filter([&](size_t i) { return y2[i] * y2[i]; });
  const auto e12 = filter([&](size_t i) { return y1[i] * y2[i]; });
  const double c1 = (0.01 * 255) * (0.01 * 255), c2 = (0.03 * 255) * (0.03 * 255);
  double sum = 0;
  for (size_t i = 0; i < mu1.size(); ++i) {
    const double s1 = e11[i] - mu1[i] * mu1[i], s2 = e22[i] - mu2[i] * mu2[i], s12 = e12[i] - mu1[i] * mu2[i];
    sum += ((2 * mu1[i] * mu2[i] + c1) * (2 * s12 + c2)) / ((mu1[i] * mu1[i] + mu2[i] * mu2[i] + c1) * (s1 + s2 + c2));
  }
  return sum / double(mu1.size());
}

}  // namespace sattn::sr
