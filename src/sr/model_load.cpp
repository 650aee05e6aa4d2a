// SattnSR weights: the safetensors file and its config (sr/train/export.py writes them), checked and re-laid out
// once for the kernels of model.cpp.
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

AttentionMode parse_attention_mode(const std::string& text) {
  if (text == "dense") return AttentionMode::kDense;
  if (text == "sparse") return AttentionMode::kSparse;
  fail(ErrorKind::kInvalidArgument, "attention: expected 'dense' or 'sparse', given '", text, "'");
}
const char* to_string(AttentionMode mode) { return mode == AttentionMode::kDense ? "dense" : "sparse"; }

int64_t SrConfig::num_blocks() const {
  int64_t n = 0;
  for (const auto& g : groups) n += int64_t(g.size());
  return n;
}

namespace {

const Tensor& get_w(const std::map<std::string, Tensor>& w, const std::string& name, const Shape& shape,
                    const std::string& file) {
  auto it = w.find(name);
  check(it != w.end(), ErrorKind::kIO, "SR weights '", file, "': missing tensor '", name, "'");
  check(it->second.shape() == shape, ErrorKind::kIO, "SR weights '", file, "': tensor '", name, "' has shape ",
        shape_text(it->second.shape()), ", expected ", shape_text(shape));
  return it->second;
}
std::vector<float> vec(const Tensor& t) { return std::vector<float>(t.data<float>(), t.data<float>() + t.numel()); }

SrConfig parse_config(const std::map<std::string, std::string>& meta, const std::string& file) {
  auto it = meta.find("sattn_sr_config");
  check(it != meta.end(), ErrorKind::kIO, "SR weights '", file,
        "': no 'sattn_sr_config' in the safetensors metadata (export with sr/train/export.py)");
  SrConfig c;
  try {
    const auto j = nlohmann::json::parse(it->second);
    check(j.value("format", std::string()) == "sattn-sr-v1", ErrorKind::kIO, "SR weights '", file,
          "': config format must be 'sattn-sr-v1', given '", j.value("format", std::string()), "'");
    c.scale = j.at("scale").get<int>();
    c.dim = j.at("dim").get<int>();
    c.heads = j.at("heads").get<int>();
    c.head_dim = j.at("head_dim").get<int>();
    c.mlp_hidden = j.at("mlp_hidden").get<int>();
    c.groups = j.at("groups").get<std::vector<std::vector<int>>>();
    c.pad_multiple = j.at("pad_multiple").get<int>();
    c.layer_norm_eps = j.value("layer_norm_eps", 1e-5);
    c.router_std_eps = j.value("router_std_eps", 1e-6);
    c.route_threshold = j.value("route_threshold", 0.5);
    c.training_step = j.value("training_step", int64_t(-1));
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorKind::kIO, "SR weights '", file, "': bad sattn_sr_config JSON (", e.what(), ")");
  }
  check(c.scale >= 1 && c.scale <= 8, ErrorKind::kIO, "SR weights '", file, "': scale must be 1..8, given ", c.scale);
  check(c.dim > 0 && c.dim <= 1024 && c.heads > 0 && c.head_dim * c.heads == c.dim, ErrorKind::kIO, "SR weights '",
        file, "': dim ", c.dim, " must equal heads ", c.heads, " x head_dim ", c.head_dim);
  check(c.mlp_hidden > 0 && c.mlp_hidden <= 8192, ErrorKind::kIO, "SR weights '", file, "': bad mlp_hidden ",
        c.mlp_hidden);
  check(!c.groups.empty(), ErrorKind::kIO, "SR weights '", file, "': no groups");
  int maxws = 0;
  for (const auto& g : c.groups) {
    check(!g.empty(), ErrorKind::kIO, "SR weights '", file, "': empty group");
    for (int ws : g) {
      check(ws >= 2 && ws <= 64 && ws % 2 == 0, ErrorKind::kIO, "SR weights '", file,
            "': window sizes must be even, 2..64, given ", ws);
      maxws = std::max(maxws, ws);
    }
  }
  check(c.route_threshold > 0 && c.route_threshold < 1, ErrorKind::kIO, "SR weights '", file,
        "': route_threshold must be in (0, 1), given ", c.route_threshold);
  check(c.pad_multiple >= maxws && c.pad_multiple <= 256, ErrorKind::kIO, "SR weights '", file, "': pad_multiple ",
        c.pad_multiple, " must be >= the largest window ", maxws);
  for (const auto& g : c.groups)
    for (int ws : g)
      check(c.pad_multiple % ws == 0, ErrorKind::kIO, "SR weights '", file, "': pad_multiple ", c.pad_multiple,
            " is not a multiple of window ", ws);
  return c;
}

}  // namespace

static void build_model(SafetensorsFile f, const std::string& name, SrConfig* cfg_out,
                        std::map<std::string, Tensor>* w_out) {
  *cfg_out = parse_config(f.metadata, name);
  for (auto& [k, t] : f.tensors) {
    check(t.dtype() == DType::kF32, ErrorKind::kIO, "SR weights '", name, "': tensor '", k, "' must be F32, given ",
          to_string(t.dtype()));
  }
  *w_out = std::move(f.tensors);
}

SrModel SrModel::from_memory(const void* data, size_t size, const std::string& name) {
  SrModel m;
  build_model(parse_safetensors(data, size, name), name, &m.config_, &m.weights_);
  m.name_ = name;
  m.prepare();
  return m;
}

SrModel SrModel::load(const std::string& path) {
  SrModel m;
  build_model(read_safetensors(path), path, &m.config_, &m.weights_);
  m.name_ = path;
  m.prepare();
  return m;
}

int64_t SrModel::receptive_radius() const {
  // every 3x3 convolution widens the dependency by 1 px, every window block by ws - 1 (a token depends on the
  // whole window: attention and the router's mean/std): head, per block dw, per group dw, body tail, up
  int64_t r = 3;
  for (const auto& g : config_.groups) {
    r += 1;
    for (int ws : g) r += 1 + (ws - 1);
  }
  return r;
}

void SrModel::padded_size(int64_t h, int64_t w, int64_t* H, int64_t* W) const {
  const int64_t pm = config_.pad_multiple;
  *H = h + (pm - h % pm) % pm;
  *W = w + (pm - w % pm) % pm;
}

std::vector<BlockGeometry> SrModel::block_geometry(int64_t h, int64_t w) const {
  int64_t H = 0, W = 0;
  padded_size(h, w, &H, &W);
  std::vector<BlockGeometry> out;
  int64_t offset = 0;
  for (size_t g = 0; g < config_.groups.size(); ++g)
    for (size_t b = 0; b < config_.groups[g].size(); ++b) {
      BlockGeometry bg;
      bg.group = int64_t(g), bg.index = int64_t(b);
      bg.window = config_.groups[g][b];
      bg.shift = b % 2 == 1 ? bg.window / 2 : 0;
      bg.windows_y = H / bg.window, bg.windows_x = W / bg.window;
      bg.offset = offset;
      bg.height = H, bg.width = W;
      offset += bg.num_windows();
      out.push_back(bg);
    }
  return out;
}

int64_t BlockGeometry::window_of(int64_t y, int64_t x) const {
  // the block rolls by (-shift, -shift): pixel p sits at rolled position (p - shift) mod size
  const int64_t ry = ((y - shift) % height + height) % height, rx = ((x - shift) % width + width) % width;
  return (ry / window) * windows_x + rx / window;
}

void BlockGeometry::token_pixel(int64_t n, int64_t l, int64_t* y, int64_t* x) const {
  *y = ((n / windows_x) * window + l / window + shift) % height;
  *x = ((n % windows_x) * window + l % window + shift) % width;
}

int64_t SrModel::num_parameters() const {
  int64_t n = 0;
  for (const auto& [k, t] : weights_) n += t.numel();
  return n;
}

void SrModel::prepare() {
  const SrConfig& c = config_;
  const int64_t C = c.dim, s2 = int64_t(c.scale) * c.scale, hid = c.mlp_hidden;
  auto P = std::make_shared<Prepared>();
  auto W = [&](const std::string& n, const Shape& s) -> const Tensor& { return get_w(weights_, n, s, name_); };
  P->head = nn::conv3x3_weight_hwc(W("head.weight", {C, 3, 3, 3}).data<float>(), C, 3);
  P->head_b = vec(W("head.bias", {C}));
  P->body_tail = GemmWeight(nn::conv3x3_weight_hwc(W("body_tail.weight", {C, C, 3, 3}).data<float>(), C, C), C);
  P->body_tail_b = vec(W("body_tail.bias", {C}));
  P->up = GemmWeight(nn::conv3x3_weight_hwc(W("up.weight", {3 * s2, C, 3, 3}).data<float>(), 3 * s2, C), 3 * s2);
  P->up_b = vec(W("up.bias", {3 * s2}));
  size_t expected = 6;
  for (size_t g = 0; g < c.groups.size(); ++g) {
    GroupW gw;
    const std::string gp = "groups." + std::to_string(g) + ".";
    gw.dw = nn::depthwise_weight_hwc(W(gp + "dw.weight", {C, 1, 3, 3}).data<float>(), C);
    gw.dw_b = vec(W(gp + "dw.bias", {C}));
    gw.pw = GemmWeight(nn::transpose_weight(W(gp + "pw.weight", {C, C, 1, 1}).data<float>(), C, C), C);
    gw.pw_b = vec(W(gp + "pw.bias", {C}));
    expected += 4;
    for (size_t b = 0; b < c.groups[g].size(); ++b) {
      BlockW bw;
      const std::string bp = gp + "blocks." + std::to_string(b) + ".";
      bw.ws = c.groups[g][b];
      bw.cyclic_shift = b % 2 == 1;
      bw.dw = nn::depthwise_weight_hwc(W(bp + "dw.weight", {C, 1, 3, 3}).data<float>(), C);
      bw.dw_b = vec(W(bp + "dw.bias", {C}));
      bw.pw = GemmWeight(nn::transpose_weight(W(bp + "pw.weight", {C, C, 1, 1}).data<float>(), C, C), C);
      bw.pw_b = vec(W(bp + "pw.bias", {C}));
      bw.router_w = vec(W(bp + "router.weight", {1, 2 * C}));
      bw.router_b = W(bp + "router.bias", {1}).data<float>()[0];
      bw.n1_w = vec(W(bp + "norm1.weight", {C}));
      bw.n1_b = vec(W(bp + "norm1.bias", {C}));
      bw.qkv = GemmWeight(nn::transpose_weight(W(bp + "qkv.weight", {3 * C, C}).data<float>(), 3 * C, C), 3 * C);
      bw.qkv_b = vec(W(bp + "qkv.bias", {3 * C}));
      bw.proj = GemmWeight(nn::transpose_weight(W(bp + "proj.weight", {C, C}).data<float>(), C, C), C);
      bw.proj_b = vec(W(bp + "proj.bias", {C}));
      bw.n2_w = vec(W(bp + "norm2.weight", {C}));
      bw.n2_b = vec(W(bp + "norm2.bias", {C}));
      bw.fc1 = GemmWeight(nn::transpose_weight(W(bp + "fc1.weight", {hid, C}).data<float>(), hid, C), hid);
      bw.fc1_b = vec(W(bp + "fc1.bias", {hid}));
      bw.fc2 = GemmWeight(nn::transpose_weight(W(bp + "fc2.weight", {C, hid}).data<float>(), C, hid), C);
      bw.fc2_b = vec(W(bp + "fc2.bias", {C}));
      expected += 18;
      gw.blocks.push_back(std::move(bw));
    }
    P->groups.push_back(std::move(gw));
  }
  check(weights_.size() == expected, ErrorKind::kIO, "SR weights '", name_, "': ", weights_.size(),
        " tensors, expected ", expected, " for this architecture (unknown extra tensors?)");
  prepared_ = std::move(P);
}

}  // namespace sattn::sr
