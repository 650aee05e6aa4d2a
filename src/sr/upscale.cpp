// SattnSR on images: uint8 <-> float planes, the whole-image or tiled upscale (tiles with enough context that the
// result equals the untiled one), and the x8 self-ensemble.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "core/threads.hpp"
#include "nn/ops.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/safetensors.hpp"
#include "sattn/sr.hpp"

#include "sr/model_internal.hpp"

namespace sattn::sr {

namespace {
Tensor image_to_tensor_mt(const Image& image, int threads) {
  check(image.channels == 3, ErrorKind::kInvalidArgument, "image_to_tensor: RGB expected, given ", image.channels,
        " channels");
  Tensor t(DType::kF32, {3, image.height, image.width});
  float* p = t.data<float>();
  const int64_t n = image.height * image.width, w = image.width;
  parallel_for(image.height, threads, [&](int64_t y) {
    for (int64_t i = y * w; i < (y + 1) * w; ++i)
      for (int64_t c = 0; c < 3; ++c) p[c * n + i] = float(image.data[size_t(i * 3 + c)]) / 255.0f;
  });
  return t;
}

inline uint8_t to_u8(float v) {
  const double d = double(std::min(1.0f, std::max(0.0f, v)));  // clamp (NaN -> 0 via max)
  // floor(255 d + 0.5), exact in double; the argument is >= 0.5, so truncation is the floor (and, unlike a call
  // to floor() in this baseline-x86-64 translation unit, one instruction: 3 M of these per 1024x1024 output)
  return uint8_t(int32_t(d * 255.0 + 0.5));
}

Image tensor_to_image_mt(const Tensor& chw, int threads) {
  check(chw.dtype() == DType::kF32 && chw.dim() == 3 && chw.size(0) == 3, ErrorKind::kInvalidArgument,
        "tensor_to_image: f32 [3, h, w] expected, given ", shape_text(chw.shape()));
  const int64_t h = chw.size(1), w = chw.size(2), n = h * w;
  Image im(h, w, 3);
  const float* p = chw.data<float>();
  parallel_for(h, threads, [&](int64_t y) {
    nn::planar_to_u8_rgb(p + y * w, p + n + y * w, p + 2 * n + y * w, w, &im.data[size_t(y * w * 3)]);
  });
  return im;
}
}  // namespace

Tensor image_to_tensor(const Image& image) { return image_to_tensor_mt(image, 1); }
Image tensor_to_image(const Tensor& chw) { return tensor_to_image_mt(chw, 1); }

namespace {
// Dihedral transform t of a grid (bit 2: transpose, then bit 1: flip rows, then bit 0: flip columns): the source
// pixel (sy, sx) of pixel (y, x) of the transformed grid, whose size is th x tw.
inline void dihedral_source(int t, int64_t y, int64_t x, int64_t th, int64_t tw, int64_t* sy, int64_t* sx) {
  if (t & 1) x = tw - 1 - x;
  if (t & 2) y = th - 1 - y;
  if (t & 4) std::swap(y, x);
  *sy = y;
  *sx = x;
}
}  // namespace

int64_t auto_tile_size(int64_t height, int64_t width) { return height * width <= 512 * 512 ? 0 : 256; }

Image SrModel::upscale(const Image& lr, const UpscaleOptions& options, UpscaleStats* stats) const {
  check(lr.channels == 3, ErrorKind::kInvalidArgument, "upscale: RGB image expected, given ", lr.channels, " channels");
  const int64_t h = lr.height, w = lr.width, s = config_.scale, ow = w * s;
  check_output_pixels(h, w, s, options, "upscale");
  Image out(h * s, ow, 3);
  if (!options.self_ensemble) {
    upscale_values(lr, options, stats,
                   [&](int64_t y, int64_t x0, int64_t count, const float* r, const float* g, const float* b) {
                     nn::planar_to_u8_rgb(r, g, b, count, &out.data[size_t((y * ow + x0) * 3)]);
                   });
    return out;
  }
  check(!options.routing_in && !options.routing_out && !options.gates_out && !options.probe,
        ErrorKind::kInvalidArgument, "upscale: self_ensemble cannot take or return routing, gates or a probe");
  UpscaleOptions o = options;
  o.self_ensemble = false;
  std::vector<float> sum(out.data.size(), 0.0f);
  for (int t = 0; t < 8; ++t) {
    const int64_t th = t & 4 ? w : h, tw = t & 4 ? h : w;
    Image in(th, tw, 3);
    for (int64_t y = 0; y < th; ++y)
      for (int64_t x = 0; x < tw; ++x) {
        int64_t sy = 0, sx = 0;
        dihedral_source(t, y, x, th, tw, &sy, &sx);
        for (int64_t c = 0; c < 3; ++c) in.at(y, x, c) = lr.at(sy, sx, c);
      }
    if (options.progress)
      o.progress = [&, t](int64_t done, int64_t total) { options.progress(t * total + done, 8 * total); };
    // output pixels map one to one onto `sum`, so threads never share an element
    upscale_values(in, o, stats,
                   [&](int64_t y, int64_t x0, int64_t count, const float* r, const float* g, const float* b) {
                     for (int64_t j = 0; j < count; ++j) {
                       int64_t sy = 0, sx = 0;
                       dihedral_source(t, y, x0 + j, th * s, tw * s, &sy, &sx);
                       float* px = &sum[size_t((sy * ow + sx) * 3)];
                       px[0] += r[j], px[1] += g[j], px[2] += b[j];
                     }
                   });
  }
  const int threads = resolve_num_threads(options.num_threads);
  parallel_for(h * s, threads, [&](int64_t y) {
    for (int64_t i = y * ow * 3; i < (y + 1) * ow * 3; ++i) out.data[size_t(i)] = to_u8(sum[size_t(i)] * 0.125f);
  });
  return out;
}

template <typename Sink>
void SrModel::upscale_values(const Image& lr, const UpscaleOptions& options, UpscaleStats* stats, Sink&& sink) const {
  const int64_t h = lr.height, w = lr.width, s = config_.scale;
  if (options.tile <= 0 || (options.tile >= h && options.tile >= w)) {
    const int threads = resolve_num_threads(options.num_threads);
    forward_impl(
        image_to_tensor_mt(lr, threads), options, stats, [](int64_t, int64_t) {},
        [&](int64_t y, const float* r, const float* g, const float* b) { sink(y, int64_t(0), w * s, r, g, b); });
    if (stats) stats->tiles += 1;
    if (options.progress) options.progress(1, 1);
    return;
  }
  check(options.tile >= 16, ErrorKind::kInvalidArgument,
        "upscale: tile must be >= 16 LR pixels (or 0 = untiled), given ", options.tile);
  check(options.overlap >= -1, ErrorKind::kInvalidArgument, "upscale: overlap must be >= 0 (or -1 = auto), given ",
        options.overlap);
  check(!options.routing_in && !options.routing_out && !options.gates_out && !options.probe,
        ErrorKind::kInvalidArgument, "upscale: routing input/output needs an untiled run (tile 0)");
  const int64_t T = options.tile, O = options.overlap < 0 ? receptive_radius() : options.overlap;
  const int threads = resolve_num_threads(options.num_threads);
  const int64_t ty = (h + T - 1) / T, tx = (w + T - 1) / T, total = ty * tx;
  const int64_t pm = config_.pad_multiple, min_ctx = std::max<int64_t>(2 * pm, 32);
  int64_t done = 0;
  for (int64_t iy = 0; iy < ty; ++iy)
    for (int64_t ix = 0; ix < tx; ++ix) {
      const int64_t y0 = iy * T, y1 = std::min(h, y0 + T), x0 = ix * T, x1 = std::min(w, x0 + T);
      // context: overlap on each side, clipped, and at least min_ctx wide where the image allows
      int64_t cy0 = std::max<int64_t>(0, y0 - O), cy1 = std::min(h, y1 + O);
      int64_t cx0 = std::max<int64_t>(0, x0 - O), cx1 = std::min(w, x1 + O);
      if (cy1 - cy0 < std::min(h, min_ctx)) {
        cy1 = std::min(h, std::max(cy1, cy0 + min_ctx));
        cy0 = std::max<int64_t>(0, std::min(cy0, cy1 - min_ctx));
      }
      if (cx1 - cx0 < std::min(w, min_ctx)) {
        cx1 = std::min(w, std::max(cx1, cx0 + min_ctx));
        cx0 = std::max<int64_t>(0, std::min(cx0, cx1 - min_ctx));
      }
      // align the context origin to the window grid of the whole image (pad_multiple is a multiple of every
      // window size), so that the tile's windows are the image's windows
      cy0 -= cy0 % pm;
      cx0 -= cx0 % pm;
      Image crop(cy1 - cy0, cx1 - cx0, 3);
      for (int64_t i = cy0; i < cy1; ++i)
        std::memcpy(&crop.data[size_t((i - cy0) * crop.width * 3)], &lr.data[size_t((i * w + cx0) * 3)],
                    size_t(crop.width * 3));
      // the crop's output rows inside this tile's rows, columns [x0·s, x1·s)
      forward_impl(
          image_to_tensor_mt(crop, threads), options, stats, [](int64_t, int64_t) {},
          [&](int64_t yy, const float* r, const float* g, const float* b) {
            const int64_t i = cy0 * s + yy, off = (x0 - cx0) * s;
            if (i >= y0 * s && i < y1 * s) sink(i, x0 * s, (x1 - x0) * s, r + off, g + off, b + off);
          });
      if (stats) stats->tiles += 1;
      if (options.progress) options.progress(++done, total);
    }
}

}  // namespace sattn::sr
