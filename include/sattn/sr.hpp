// Super-resolution: MATLAB-compatible bicubic resize, BasicSR metrics and the SattnSR model (C++ inference of
// sr/train/model.py; op-by-op spec in sr/README.md). The image type and its PNG/JPEG I/O: sattn/image.hpp.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sattn/image.hpp"
#include "sattn/problem.hpp"
#include "sattn/tensor.hpp"

namespace sattn::sr {

// MATLAB imresize(img, scale, 'bicubic') on doubles, exactly as sr/train/imresize.py: output index x (1-based)
// samples u = x/scale + 0.5(1 - 1/scale); Keys cubic a = -0.5, widened by 1/scale when shrinking
// (antialiasing); weights normalised; symmetric padding; height first, then width; one rounding to uint8
// (half away from zero, saturated). Output size ceil(h*scale) x ceil(w*scale) unless out_h/out_w > 0.
Image imresize(const Image& image, double scale, int64_t out_h = 0, int64_t out_w = 0);
// Same on a float64 plane [h, w] (row-major); returns the unrounded result.
std::vector<double> imresize_plane(const std::vector<double>& plane, int64_t h, int64_t w, double scale, int64_t out_h,
                                   int64_t out_w);
// HR cropped to a multiple of s, as BasicSR's mod_crop.
Image mod_crop(const Image& image, int s);
// LR = imresize(HR, 1/s); HR must be a multiple of s (throws kInvalidArgument otherwise).
Image downscale(const Image& hr, int s);
Image upscale_bicubic(const Image& lr, int s);

// BasicSR metrics on the unrounded float Y channel (BT.601: 16 + 65.481R + 128.553G + 24.966B on [0,1] RGB),
// `border` pixels cropped at each side. Images must be RGB of equal size. PSNR is +inf for identical images.
double psnr_y(const Image& a, const Image& b, int border);
// SSIM: 11x11 Gaussian (sigma 1.5), valid region only, C1 = (0.01*255)^2, C2 = (0.03*255)^2, mean over the map.
double ssim_y(const Image& a, const Image& b, int border);

enum class AttentionMode { kDense, kSparse };
AttentionMode parse_attention_mode(const std::string& text);  // "dense" | "sparse"
const char* to_string(AttentionMode mode);

// Where the window blocks of the model sit on a padded input (sattn viz --image draws them). Blocks are numbered
// in order over all groups; window n of a block is in partition order (row-major over the rolled image).
struct BlockGeometry {
  int64_t group = 0, index = 0;          // group, block inside the group
  int64_t window = 0, shift = 0;         // window size ws, cyclic shift (ws / 2 on odd blocks, else 0)
  int64_t windows_y = 0, windows_x = 0;  // windows per column / per row of the padded image
  int64_t offset = 0;                    // first entry of this block in routing_out / gates_out
  int64_t height = 0, width = 0;         // the padded image (H, W)
  int64_t num_windows() const { return windows_y * windows_x; }
  // The window containing padded-image pixel (y, x).
  int64_t window_of(int64_t y, int64_t x) const;
  // Padded-image pixel (y, x) of token l (row-major in the window) of window n: the roll by (-shift, -shift)
  // undone, so windows of shifted blocks wrap around the bottom/right border.
  void token_pixel(int64_t n, int64_t l, int64_t* y, int64_t* x) const;
};

// One window's attention, captured during a forward (UpscaleOptions::probe). The weights are computed from the
// block's input exactly as the routed path does (LayerNorm, qkv, cyclic-shift mask), also when the router skipped the
// window, so that a flat window's attention can be looked at too.
struct AttentionProbe {
  int64_t block = 0;   // global block index (0 .. num_blocks - 1)
  int64_t window = 0;  // window index in partition order of that block
  // filled by forward:
  Tensor weights;  // f32 [heads, L, L], L = ws^2, softmax over keys; 0 where the cyclic-shift mask forbids a pair
  Tensor allowed;  // bool [L, L], the cyclic-shift (Swin) mask (all true for windows that need none)
  bool routed = false;
  float gate = 0;
};

struct UpscaleOptions {
  AttentionMode mode = AttentionMode::kSparse;
  // Largest output (s*h x s*w pixels) upscale() and forward() accept; larger inputs are refused before the output
  // is allocated (sattn::Error kInvalidArgument).
  int64_t max_output_pixels = kDefaultMaxPixels;
  int num_threads = 0;  // 0 = SATTN_NUM_THREADS or all cores
  // Tiling (LR pixels): 0 = whole image at once. Tiles of tile x tile with `overlap` extra context on each side
  // (clipped at the image border, its origin aligned down to the window grid); only each tile's centre is kept.
  // overlap -1 = the model's receptive radius (receptive_radius()): then tiled == untiled, bit for bit.
  int64_t tile = 0;
  int64_t overlap = -1;
  // Routing fed from outside (parity with PyTorch): one byte per window, blocks in order, windows in partition
  // order (as the PyTorch `stats` list); sparse mode only, untiled only. Empty = decide here.
  const std::vector<uint8_t>* routing_in = nullptr;
  // If set: receives the routing decisions (same layout; untiled only) — 1 = routed.
  std::vector<uint8_t>* routing_out = nullptr;
  // If set: receives the router gates g (same layout as routing_out; untiled only).
  std::vector<float>* gates_out = nullptr;
  // If set (untiled only): receives the attention of one window of one block (see AttentionProbe).
  AttentionProbe* probe = nullptr;
  // Geometric self-ensemble ("x8", as EDSR+ and BasicSR): the model runs on the 8 flips/transposes of the input,
  // each output is mapped back and the 8 unclamped outputs are averaged before the one rounding to uint8. About
  // 8x the time, usually a little higher PSNR. upscale() only; not with routing_in/out, gates_out or probe.
  bool self_ensemble = false;
  // Called after each tile with (tiles done, tiles total).
  std::function<void(int64_t, int64_t)> progress;
  // Time each stage of the model (UpscaleStats::stages): where the time goes, and what the routing saves.
  bool profile = false;
  // kBF16: the matrix products take bf16-rounded operands with float32 accumulation, on a SIMD target with bf16
  // products (elsewhere float32 as kHighest): the window attention's Q·Kᵀ and P·V (AttentionOptions::
  // float32_precision), the 3x3 convolutions but the first (3 input channels), the pointwise convolutions, the qkv
  // and output projections and the MLP. The depthwise convolutions, router, LayerNorms, GELU and softmax stay float32.
  Float32Precision float32_precision = Float32Precision::kHighest;
};

// Wall time of one stage of the model's forward pass, summed over tiles, ensemble passes and calls with the same
// UpscaleStats. Block stages also count their windows (total and routed to attention).
struct SrStageTime {
  std::string name;  // e.g. "block 2 (8x8): attention windows"
  double seconds = 0;
  int64_t windows_total = 0, windows_routed = 0;
};

// Default tile size (LR pixels) of `sattn sr upscale` / `sr eval` and sattn.sr's upscale(tile=-1): 0 (the whole image
// at once) up to 512x512 pixels, else tiles of 256, so that memory stays bounded on large images.
int64_t auto_tile_size(int64_t height, int64_t width);

struct UpscaleStats {
  int64_t windows_total = 0, windows_routed = 0;
  int64_t tiles = 0;
  // With UpscaleOptions::profile: the stages in execution order: "head conv"; per block "conv path" (depthwise +
  // GELU + pointwise, every pixel), "router" (window statistics, gate; an AttentionProbe's window too, when one is
  // asked for) and "attention windows" (the routed windows: gather, LayerNorms, qkv, attention, projection, MLP,
  // scatter); per group "group tail"; "body tail conv + skip"; "upsample conv + shuffle"; "other" (input padding,
  // copies: the rest of the forward time).
  std::vector<SrStageTime> stages;
};

// Architecture (from the weights' "sattn_sr_config" metadata; see sr/train/export.py).
struct SrConfig {
  int scale = 2, dim = 0, heads = 0, head_dim = 0, mlp_hidden = 0, pad_multiple = 16;
  std::vector<std::vector<int>> groups;  // window size of each block, per group
  double layer_norm_eps = 1e-5, router_std_eps = 1e-6, route_threshold = 0.5;
  int64_t training_step = -1;
  int64_t num_blocks() const;
};

class SrModel {
 public:
  // Loads weights + architecture from a safetensors file (as written by sr/train/export.py). Validates the
  // config and every tensor's shape; throws sattn::Error(kIO) naming the file and the problem.
  static SrModel load(const std::string& path);
  static SrModel from_memory(const void* data, size_t size, const std::string& name);

  const SrConfig& config() const { return config_; }
  const std::string& name() const { return name_; }  // the file (or "embedded:<file>") it was loaded from
  int scale() const { return config_.scale; }
  int64_t num_parameters() const;
  // Pixels (LR) beyond which an input pixel cannot influence an output pixel: sum over blocks of (window - 1)
  // plus one per 3x3 convolution (70 for the default configuration).
  int64_t receptive_radius() const;
  // Padded size (H, W) of an h x w input (reflect-padded bottom/right to a multiple of pad_multiple) and the
  // geometry of every block on it, in block order.
  void padded_size(int64_t h, int64_t w, int64_t* H, int64_t* W) const;
  std::vector<BlockGeometry> block_geometry(int64_t h, int64_t w) const;

  // x: f32 [3, h, w] RGB in [0, 1] (h, w > pad_multiple / 2... the reflect pad needs h, w > pad amount).
  // Returns the unclamped model output f32 [3, s*h, s*w] (the PyTorch model's forward), untiled.
  Tensor forward(const Tensor& x, const UpscaleOptions& options, UpscaleStats* stats = nullptr) const;
  // uint8 RGB in, uint8 RGB out (clamp to [0, 1], floor(255 v + 0.5)); tiled when options.tile > 0.
  Image upscale(const Image& lr, const UpscaleOptions& options, UpscaleStats* stats = nullptr) const;

 private:
  // forward() without the output tensor: begin(out_h, out_w) once, then emit(y, r, g, b) for every output row y
  // (the three channels' out_w values; from several threads, each row once), so that upscale() rounds rows as they
  // come instead of writing and re-reading a 12 MB float image.
  using RowEmit = std::function<void(int64_t y, const float* r, const float* g, const float* b)>;
  void forward_impl(const Tensor& x, const UpscaleOptions& options, UpscaleStats* stats,
                    const std::function<void(int64_t, int64_t)>& begin, const RowEmit& emit) const;
  // upscale() without the rounding: sink(y, x0, count, r, g, b) receives every unclamped output value once, as
  // runs of output row y, columns [x0, x0 + count), one pointer per channel (from several threads, for distinct
  // pixels).
  template <typename Sink>
  void upscale_values(const Image& lr, const UpscaleOptions& options, UpscaleStats* stats, Sink&& sink) const;
  SrConfig config_;
  std::map<std::string, Tensor> weights_;  // f32, PyTorch state_dict names
  std::string name_;
  struct Prepared;  // re-laid-out weights
  std::shared_ptr<const Prepared> prepared_;
  void prepare();
};

// Float [3, h, w] in [0, 1] from an 8-bit RGB image, and back (clamp, floor(255 v + 0.5)).
Tensor image_to_tensor(const Image& image);
Image tensor_to_image(const Tensor& chw);

}  // namespace sattn::sr
