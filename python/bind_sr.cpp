// Python: sattn.sr — the SattnSR model (load, upscale, forward with routing, stage profile) and the BasicSR
// protocol pieces (MATLAB bicubic, Y-PSNR / SSIM, image files). Images are numpy uint8 [H, W, 3] RGB (or [H, W]
// gray, replicated to RGB, as the files are); see include/sattn/sr.hpp.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind_common.hpp"
#include "bindings.hpp"
#include "sattn/error.hpp"
#include "sattn/sr.hpp"

namespace sattn::py {
namespace {

namespace pyb = pybind11;

// uint8 [H, W, 3] / [H, W, 1] / [H, W] (anything numpy makes such an array of) -> an RGB sr::Image (gray
// replicated), copied from the array's view (bind_common.hpp). Other dtypes are refused, not cast: a float image in
// [0, 1] cast to uint8 would be silent garbage.
sr::Image image_from_numpy(const pyb::object& obj, const char* name) {
  const pyb::array a = pyb::array::ensure(obj);
  check(bool(a), ErrorKind::kTypeError, name, ": expected a numpy uint8 array [H, W, 3] or [H, W], given ",
        std::string(pyb::str(pyb::type::of(obj))));
  check(a.dtype().kind() == 'u' && a.dtype().itemsize() == 1, ErrorKind::kTypeError, name,
        ": expected dtype uint8 (8-bit RGB [H, W, 3] or gray [H, W]), given ", std::string(pyb::str(a.dtype())));
  const NumpyView nv = numpy_view(a, name);
  const TensorView& v = nv.view;
  const bool gray = v.dim() == 2 || (v.dim() == 3 && v.shape[2] == 1);
  check(gray || (v.dim() == 3 && v.shape[2] == 3), ErrorKind::kInvalidArgument, name,
        ": expected shape [H, W, 3] (RGB) or [H, W] (gray), given ", shape_text(v.shape));
  check(v.shape[0] > 0 && v.shape[1] > 0, ErrorKind::kInvalidArgument, name, ": empty image ", shape_text(v.shape));
  const int64_t h = v.shape[0], w = v.shape[1];
  sr::Image im(h, w, 3);
  const auto* p = static_cast<const uint8_t*>(v.data);
  if (!gray && v.is_contiguous()) {
    std::memcpy(im.data.data(), p, im.data.size());
    return im;
  }
  const int64_t sy = v.strides[0], sx = v.strides[1], sc = gray ? 0 : v.strides[2];
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x)
      for (int64_t c = 0; c < 3; ++c) im.at(y, x, c) = p[y * sy + x * sx + c * sc];
  return im;
}

// An image as uint8 [H, W, 3] ([H, W] for gray), handing its pixels to numpy without a copy.
pyb::array_t<uint8_t> image_to_numpy(sr::Image im) {
  std::vector<pyb::ssize_t> shape{im.height, im.width};
  if (im.channels != 1) shape.push_back(im.channels);
  return to_numpy(std::move(im.data), std::move(shape));
}

pyb::dict stats_to_dict(const sr::UpscaleStats& st) {
  pyb::list stages;
  for (const auto& s : st.stages) {
    pyb::dict d;
    d["name"] = s.name;
    d["seconds"] = s.seconds;
    d["windows_total"] = s.windows_total;
    d["windows_routed"] = s.windows_routed;
    stages.append(d);
  }
  pyb::dict d;
  d["windows_total"] = st.windows_total;
  d["windows_routed"] = st.windows_routed;
  d["tiles"] = st.tiles;
  d["stages"] = stages;
  return d;
}

sr::UpscaleOptions options(const std::string& attention, const pyb::object& num_threads) {
  sr::UpscaleOptions o;
  o.mode = sr::parse_attention_mode(attention);
  o.num_threads = resolve_python_threads(num_threads);
  return o;
}

pyb::object upscale_py(const sr::SrModel& m, const pyb::object& image, const std::string& attention,
                       const pyb::object& num_threads, int64_t tile, int64_t overlap, bool self_ensemble, bool profile,
                       bool return_stats, int64_t max_output_pixels, const std::string& float32_precision) {
  const sr::Image lr = image_from_numpy(image, "image");
  sr::UpscaleOptions o = options(attention, num_threads);
  o.float32_precision = parse_float32_precision(float32_precision, "float32_precision");
  check(tile >= -1, ErrorKind::kInvalidArgument, "tile: expected -1 (auto), 0 (whole image) or >= 16, given ", tile);
  o.tile = tile >= 0 ? tile : sr::auto_tile_size(lr.height, lr.width);
  o.overlap = overlap;
  o.self_ensemble = self_ensemble;
  o.profile = profile;
  o.max_output_pixels = max_output_pixels;
  sr::UpscaleStats st;
  sr::Image out;
  {
    pyb::gil_scoped_release release;
    out = m.upscale(lr, o, &st);
  }
  if (!return_stats) return image_to_numpy(std::move(out));
  return pyb::make_tuple(image_to_numpy(std::move(out)), stats_to_dict(st));
}

pyb::object forward_py(const sr::SrModel& m, const pyb::object& x, const std::string& attention,
                       const pyb::object& num_threads, const pyb::object& routing_in, bool return_routing) {
  ArrayKeeper keeper;
  const TensorView xv = view_of(x, "x", keeper);
  check(xv.dtype == DType::kF32, ErrorKind::kTypeError, "x: expected float32 [3, h, w] in [0, 1], given ",
        to_string(xv.dtype));
  check(xv.dim() == 3 && xv.size(0) == 3, ErrorKind::kInvalidArgument, "x: expected shape [3, h, w], given ",
        shape_text(xv.shape));
  const Tensor xt = Tensor::from_view(xv);
  sr::UpscaleOptions o = options(attention, num_threads);
  std::vector<uint8_t> rin, rout;
  std::vector<float> gates;
  if (!routing_in.is_none()) {
    const TensorView rv = view_of(routing_in, "routing_in", keeper);
    check(rv.dim() == 1 && (rv.dtype == DType::kU8 || rv.dtype == DType::kBool), ErrorKind::kInvalidArgument,
          "routing_in: expected a 1-D uint8 or bool array (one value per window), given ", to_string(rv.dtype), " ",
          shape_text(rv.shape));
    const Tensor r = Tensor::from_view(rv);
    const auto* rp = static_cast<const uint8_t*>(r.data());  // uint8 or bool: one byte per window
    rin.assign(rp, rp + r.numel());
    o.routing_in = &rin;
  }
  if (return_routing) {
    o.routing_out = &rout;
    o.gates_out = &gates;
  }
  Tensor y;
  {
    pyb::gil_scoped_release release;
    y = m.forward(xt, o);
  }
  pyb::array ya = to_numpy(y);
  if (!return_routing) return ya;
  return pyb::make_tuple(ya, to_numpy(std::move(rout)), to_numpy(std::move(gates)));
}

pyb::dict config_dict(const sr::SrConfig& c) {
  pyb::dict d;
  d["scale"] = c.scale;
  d["dim"] = c.dim;
  d["heads"] = c.heads;
  d["head_dim"] = c.head_dim;
  d["mlp_hidden"] = c.mlp_hidden;
  d["pad_multiple"] = c.pad_multiple;
  d["groups"] = c.groups;
  d["layer_norm_eps"] = c.layer_norm_eps;
  d["router_std_eps"] = c.router_std_eps;
  d["route_threshold"] = c.route_threshold;
  d["training_step"] = c.training_step;
  return d;
}

void check_scale_arg(int s, const char* fn) {
  check(s >= 1 && s <= 16, ErrorKind::kInvalidArgument, fn, ": scale must be an integer in [1, 16], given ", s);
}

}  // namespace

void bind_sr(pybind11::module_& top) {
  namespace pyb = pybind11;
  using namespace pyb::literals;
  pyb::module_ m = top.def_submodule("sr", "SattnSR super-resolution and the BasicSR evaluation protocol");
  pyb::class_<sr::SrModel>(m, "SrModel",
                           "The SattnSR model (C++ inference of sr/train/model.py) from a safetensors file written by "
                           "sr/train/export.py, e.g. sr/weights/sattn_sr_x2.safetensors.")
      .def(pyb::init([](const std::string& path) { return sr::SrModel::load(path); }), "path"_a)
      .def_property_readonly("scale", &sr::SrModel::scale)
      .def_property_readonly("name", &sr::SrModel::name)
      .def_property_readonly("config", [](const sr::SrModel& m) { return config_dict(m.config()); })
      .def_property_readonly("num_parameters", &sr::SrModel::num_parameters)
      .def_property_readonly("receptive_radius", &sr::SrModel::receptive_radius)
      .def("upscale", &upscale_py, "image"_a, pyb::kw_only(), "attention"_a = "sparse", "num_threads"_a = pyb::none(),
           "tile"_a = -1, "overlap"_a = -1, "self_ensemble"_a = false, "profile"_a = false, "return_stats"_a = false,
           "max_output_pixels"_a = sr::kDefaultMaxPixels, "float32_precision"_a = "highest",
           "Upscale uint8 RGB [H, W, 3] (or gray [H, W], replicated) to uint8 [s*H, s*W, 3].\n"
           "attention: 'sparse' (routed windows only, the default) or 'dense' (every window). tile: LR tile size\n"
           "(-1 = whole image up to 512x512, else 256, as the CLI; 0 = whole image; >= 16), overlap: context per\n"
           "side (-1 = the receptive radius: tiled == untiled).\n"
           "self_ensemble: x8 flips/transposes averaged. return_stats=True returns (image, stats): windows_total,\n"
           "windows_routed, tiles and, with profile=True, 'stages' [{name, seconds, windows_total, windows_routed}].\n"
           "max_output_pixels: larger outputs (s*H * s*W pixels) are refused (ValueError) before any work.\n"
           "float32_precision: 'highest', or 'bf16': the matrix products (the window attention's Q·Kᵀ and P·V,\n"
           "the convolutions but the first, the projections and the MLP) on bf16-rounded operands with float32 sums\n"
           "where the CPU has bf16 products (the CLI's --precision bf16).")
      .def("forward", &forward_py, "x"_a, pyb::kw_only(), "attention"_a = "sparse", "num_threads"_a = pyb::none(),
           "routing_in"_a = pyb::none(), "return_routing"_a = false,
           "The model's unclamped output float32 [3, s*h, s*w] for float32 x [3, h, w] in [0, 1] (the PyTorch\n"
           "forward; untiled). routing_in: one uint8/bool per window (blocks in order, windows in partition order,\n"
           "as the PyTorch stats list) used instead of the router's decisions (sparse only).\n"
           "return_routing=True returns (y, routing uint8 [n], gates float32 [n]).");
  m.def(
      "read_image", [](const std::string& path) { return image_to_numpy(sr::read_image(path)); }, "path"_a,
      "PNG or JPEG file -> uint8 RGB [H, W, 3] (gray replicated, alpha dropped); clear errors for corrupt,\n"
      "truncated or unsupported files.");
  m.def(
      "write_png",
      [](const std::string& path, const pyb::object& image, int compression_level, const pyb::object& num_threads) {
        sr::write_png(path, image_from_numpy(image, "image"), compression_level, resolve_python_threads(num_threads));
      },
      "path"_a, "image"_a, pyb::kw_only(), "compression_level"_a = sr::kDefaultPngCompression,
      "num_threads"_a = pyb::none(),
      "uint8 RGB [H, W, 3] (or gray [H, W], written as RGB) -> 8-bit PNG, replacing `path` atomically.\n"
      "compression_level: zlib level 0 (stored) .. 9 (smallest); 1 (the default, as OpenCV's) is the fastest\n"
      "that compresses. num_threads: threads compressing bands of rows (None = SATTN_NUM_THREADS or all cores;\n"
      "the file's bytes do not depend on it).");
  m.def(
      "downscale",
      [](const pyb::object& hr, int scale) {
        check_scale_arg(scale, "downscale");
        return image_to_numpy(sr::downscale(sr::mod_crop(image_from_numpy(hr, "hr"), scale), scale));
      },
      "hr"_a, "scale"_a,
      "BasicSR's LR: HR cropped to a multiple of scale, then MATLAB imresize(HR, 1/scale, 'bicubic').");
  m.def(
      "mod_crop",
      [](const pyb::object& img, int scale) {
        check_scale_arg(scale, "mod_crop");
        return image_to_numpy(sr::mod_crop(image_from_numpy(img, "image"), scale));
      },
      "image"_a, "scale"_a, "The image cropped (bottom/right) to a multiple of scale.");
  m.def(
      "upscale_bicubic",
      [](const pyb::object& lr, int scale) {
        check_scale_arg(scale, "upscale_bicubic");
        return image_to_numpy(sr::upscale_bicubic(image_from_numpy(lr, "lr"), scale));
      },
      "lr"_a, "scale"_a, "MATLAB imresize(LR, scale, 'bicubic'): the bicubic baseline.");
  m.def(
      "psnr_y",
      [](const pyb::object& a, const pyb::object& b, int border) {
        return sr::psnr_y(image_from_numpy(a, "a"), image_from_numpy(b, "b"), border);
      },
      "a"_a, "b"_a, "border"_a,
      "BasicSR Y-PSNR (BT.601 Y of [0, 1] RGB in the 0-255 range, unrounded), border pixels cropped per side.");
  m.def(
      "ssim_y",
      [](const pyb::object& a, const pyb::object& b, int border) {
        return sr::ssim_y(image_from_numpy(a, "a"), image_from_numpy(b, "b"), border);
      },
      "a"_a, "b"_a, "border"_a, "BasicSR SSIM on the same Y (11x11 Gaussian, sigma 1.5, valid region).");
}

}  // namespace sattn::py
