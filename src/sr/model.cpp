// SattnSR inference (sr/train/model.py; op-by-op spec in sr/README.md), channels-last float32.
// The window attention goes through sattn::scaled_dot_product_attention.
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

struct BlockW {
  int ws = 8;
  bool shifted = false;
  std::vector<float> dw, dw_b, pw, pw_b, router_w;  // dw [9][C], pw [C][C] (in-major)
  float router_b = 0;
  std::vector<float> n1_w, n1_b, qkv, qkv_b, proj, proj_b, n2_w, n2_b, fc1, fc1_b, fc2, fc2_b;
};
struct GroupW {
  std::vector<BlockW> blocks;
  std::vector<float> dw, dw_b, pw, pw_b;
};

}  // namespace

struct SrModel::Prepared {
  std::vector<float> head, head_b, body_tail, body_tail_b, up, up_b;
  std::vector<GroupW> groups;
};

namespace {

const Tensor& get_w(const std::map<std::string, Tensor>& w, const std::string& name, const Shape& shape,
                    const std::string& file) {
  auto it = w.find(name);
  check(it != w.end(), ErrorKind::kIO, "SR weights '", file, "': missing tensor '", name, "'");
  check(it->second.shape() == shape, ErrorKind::kIO, "SR weights '", file, "': tensor '", name, "' has shape ",
        shape_to_string(it->second.shape()), ", expected ", shape_to_string(shape));
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
    check(t.dtype() == DType::kF32, ErrorKind::kIO, "SR weights '", name, "': tensor '", k,
          "' must be F32, given ", to_string(t.dtype()));
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
  P->body_tail = nn::conv3x3_weight_hwc(W("body_tail.weight", {C, C, 3, 3}).data<float>(), C, C);
  P->body_tail_b = vec(W("body_tail.bias", {C}));
  P->up = nn::conv3x3_weight_hwc(W("up.weight", {3 * s2, C, 3, 3}).data<float>(), 3 * s2, C);
  P->up_b = vec(W("up.bias", {3 * s2}));
  size_t expected = 6;
  for (size_t g = 0; g < c.groups.size(); ++g) {
    GroupW gw;
    const std::string gp = "groups." + std::to_string(g) + ".";
    gw.dw = nn::depthwise_weight_hwc(W(gp + "dw.weight", {C, 1, 3, 3}).data<float>(), C);
    gw.dw_b = vec(W(gp + "dw.bias", {C}));
    gw.pw = nn::transpose_weight(W(gp + "pw.weight", {C, C, 1, 1}).data<float>(), C, C);
    gw.pw_b = vec(W(gp + "pw.bias", {C}));
    expected += 4;
    for (size_t b = 0; b < c.groups[g].size(); ++b) {
      BlockW bw;
      const std::string bp = gp + "blocks." + std::to_string(b) + ".";
      bw.ws = c.groups[g][b];
      bw.shifted = b % 2 == 1;
      bw.dw = nn::depthwise_weight_hwc(W(bp + "dw.weight", {C, 1, 3, 3}).data<float>(), C);
      bw.dw_b = vec(W(bp + "dw.bias", {C}));
      bw.pw = nn::transpose_weight(W(bp + "pw.weight", {C, C, 1, 1}).data<float>(), C, C);
      bw.pw_b = vec(W(bp + "pw.bias", {C}));
      bw.router_w = vec(W(bp + "router.weight", {1, 2 * C}));
      bw.router_b = W(bp + "router.bias", {1}).data<float>()[0];
      bw.n1_w = vec(W(bp + "norm1.weight", {C}));
      bw.n1_b = vec(W(bp + "norm1.bias", {C}));
      bw.qkv = nn::transpose_weight(W(bp + "qkv.weight", {3 * C, C}).data<float>(), 3 * C, C);
      bw.qkv_b = vec(W(bp + "qkv.bias", {3 * C}));
      bw.proj = nn::transpose_weight(W(bp + "proj.weight", {C, C}).data<float>(), C, C);
      bw.proj_b = vec(W(bp + "proj.bias", {C}));
      bw.n2_w = vec(W(bp + "norm2.weight", {C}));
      bw.n2_b = vec(W(bp + "norm2.bias", {C}));
      bw.fc1 = nn::transpose_weight(W(bp + "fc1.weight", {hid, C}).data<float>(), hid, C);
      bw.fc1_b = vec(W(bp + "fc1.bias", {hid}));
      bw.fc2 = nn::transpose_weight(W(bp + "fc2.weight", {C, hid}).data<float>(), C, hid);
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

// ---- forward -----------------------------------------------------------------------------------------------
namespace {

// Stage timer for UpscaleOptions::profile. Stage i of a forward pass (in order) adds to stats->stages[i]: the time
// from start() to mark(). Time outside start()..mark() goes to "other" in finish(). Off (no-op) without stats.
class StageClock {
 public:
  using Clock = std::chrono::steady_clock;
  StageClock(UpscaleStats* stats, bool on) : st_(on ? stats : nullptr) {}
  void start() {
    if (st_) t_ = Clock::now();
  }
  // name() is called only when profiling (names are formatted lazily)
  template <typename Name>
  void mark(Name&& name, int64_t windows_total = 0, int64_t windows_routed = 0) {
    if (!st_) return;
    const auto now = Clock::now();
    SrStageTime& s = stage(name());
    const double dt = std::chrono::duration<double>(now - t_).count();
    s.seconds += dt;
    s.windows_total += windows_total;
    s.windows_routed += windows_routed;
    timed_ += dt;
    t_ = now;
  }
  void finish() {
    if (!st_) return;
    stage("other").seconds += std::max(0.0, std::chrono::duration<double>(Clock::now() - t0_).count() - timed_);
  }

 private:
  SrStageTime& stage(const std::string& name) {
    // the same model gives the same stage list every pass: accumulate by position; a different list starts over
    if (next_ >= st_->stages.size() || st_->stages[next_].name != name) {
      st_->stages.resize(next_);
      st_->stages.push_back(SrStageTime{name});
    }
    return st_->stages[next_++];
  }
  UpscaleStats* st_;
  size_t next_ = 0;
  double timed_ = 0;
  Clock::time_point t0_ = Clock::now(), t_ = t0_;
};

struct BlockCtx {
  int64_t H, W, C, heads, hd, hid;
  float ln_eps, std_eps, threshold;
  int threads;
  AttentionProbe* probe = nullptr;  // set for the probed block only (UpscaleOptions::probe)
  StageClock* clock = nullptr;
  int64_t block_index = 0;
};

// out[m, c] = in[m, c] + bias[c] for m < M; in and out must not overlap.
inline void add_row_bias(const float* in, int64_t M, int64_t C, const float* __restrict bias, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* __restrict i = in + m * C;
    float* __restrict o = out + m * C;
    for (int64_t c = 0; c < C; ++c) o[c] = i[c] + bias[c];
  }
}

// Swin region label of a (rolled) position along one axis: 0, 1 or 2.
inline int region(int64_t p, int64_t n, int64_t ws, int64_t s) { return p < n - ws ? 0 : (p < n - s ? 1 : 2); }

void probe_window(const BlockW& b, const BlockCtx& cx, const float* y, int64_t n, const std::vector<float>& gate,
                  bool routed, AttentionProbe* probe);

// The windows of a block over y [H, W, C]: window n = (n / nwx, n % nwx) of ws x ws tokens, after the cyclic roll
// by (-s, -s).
struct WindowGrid {
  float* y;
  int64_t H, W, C, ws, s, L, nwy, nwx, nW;
  // row_runs(ly, wy, wx, f): the runs of window row ly of window (wy, wx) as f(l, pixel pointer, count), `count`
  // consecutive tokens l.. that are consecutive pixels: token (ly, lx) is pixel ((wy·ws + ly + s) mod H,
  // (wx·ws + lx + s) mod W) of y; a window row is one run, or two where the roll wraps it around the edge.
  template <typename F>
  void row_runs(int64_t ly, int64_t wy, int64_t wx, F&& f) const {
    const int64_t px0 = wx * ws + s, first = std::min(ws, W - px0);  // tokens before the wrap (px0 < W always)
    float* row = y + ((wy * ws + ly + s) % H) * W * C;
    f(ly * ws, row + px0 * C, first);
    if (first < ws) f(ly * ws + first, row, ws - first);
  }
  // f(l, pixel pointer, count) for the tokens of window n in order
  template <typename F>
  void for_each_run(int64_t n, F&& f) const {
    for (int64_t ly = 0; ly < ws; ++ly) row_runs(ly, n / nwx, n % nwx, f);
  }
  // Swin mask: a window needs one iff it touches the last window row/column of a shifted block.
  bool needs_mask(int64_t n) const { return s > 0 && (n / nwx == nwy - 1 || n % nwx == nwx - 1); }
};

// Per-thread scratch of a chunk of routed windows, reused across chunks and blocks.
struct WindowScratch {
  std::vector<float> xw, a, qkv, o, t, h, qb, ob;
  std::vector<uint8_t> mask;
};

// Router: per window mean / population std over tokens, per channel (two passes, as the PyTorch model), and the
// gate sigmoid(router(mean, std)) into gate[nW]. One task per row of windows, streaming its ws image rows
// (memory-bound otherwise); the second pass reads them from cache. Each window still sums its tokens in order, so
// the result does not depend on the traversal.
void route_windows(const BlockW& b, const BlockCtx& cx, const WindowGrid& wg, float* gate) {
  const int64_t C = wg.C, L = wg.L, nwx = wg.nwx;
  parallel_for(wg.nwy, cx.threads, [&](int64_t wy) {
    thread_local std::vector<float> stat;
    stat.assign(size_t(2 * nwx * C), 0.0f);
    float* __restrict means = stat.data();
    float* __restrict vars = stat.data() + nwx * C;
    // per_window(wx, pixel pointer, count) over the runs of the row of windows, image row by image row
    auto rows = [&](auto&& per_window) {
      for (int64_t ly = 0; ly < wg.ws; ++ly)
        for (int64_t wx = 0; wx < nwx; ++wx)
          wg.row_runs(ly, wy, wx, [&](int64_t, const float* p, int64_t count) { per_window(wx, p, count); });
    };
    rows([&](int64_t wx, const float* p, int64_t count) { nn::add_rows(p, count, C, means + wx * C); });
    for (int64_t i = 0; i < nwx * C; ++i) means[i] /= float(L);
    rows([&](int64_t wx, const float* p, int64_t count) {
      nn::add_squared_deviations(p, count, C, means + wx * C, vars + wx * C);
    });
    for (int64_t wx = 0; wx < nwx; ++wx) {
      float logit = b.router_b;
      for (int64_t c = 0; c < C; ++c) {
        const float sd = std::sqrt(vars[wx * C + c] / float(L) + cx.std_eps);
        logit += b.router_w[size_t(c)] * means[wx * C + c] + b.router_w[size_t(C + c)] * sd;
      }
      gate[size_t(wy * nwx + wx)] = 1.0f / (1.0f + std::exp(-logit));
    }
  });
}

// Attention of the chunk's windows `list` (indices into the chunk; windows[i] is the window index of chunk entry
// i): q, k, v read from sc.qkv [nw, L, 3C], the result written to sc.o [nw, L, C]; with_mask: the Swin mask.
void attend_windows(const BlockCtx& cx, const WindowGrid& wg, const int64_t* windows,
                    const std::vector<int64_t>& list, bool with_mask, WindowScratch& sc) {
  if (list.empty()) return;
  const int64_t L = wg.L, C = wg.C, ws = wg.ws, s = wg.s, nwx = wg.nwx, heads = cx.heads, hd = cx.hd;
  const int64_t nb = int64_t(list.size());
  // a contiguous run of the chunk's windows is read/written in place, otherwise gathered
  const bool run = list.back() - list.front() == nb - 1;
  const float* qsrc = sc.qkv.data() + list.front() * L * 3 * C;
  float* odst = sc.o.data() + list.front() * L * C;
  if (!run) {
    sc.qb.resize(size_t(nb * L * 3 * C));
    sc.ob.resize(size_t(nb * L * C));
    for (int64_t j = 0; j < nb; ++j)
      std::memcpy(&sc.qb[size_t(j * L * 3 * C)], &sc.qkv[size_t(list[size_t(j)] * L * 3 * C)],
                  size_t(L * 3 * C) * sizeof(float));
    qsrc = sc.qb.data();
    odst = sc.ob.data();
  }
  // qkv channel index = which*C + head*hd + d, token-major: q [nb, heads, L, hd] strided
  const Shape shape{nb, heads, L, hd}, strides{L * 3 * C, hd, 3 * C, 1};
  float* qp = const_cast<float*>(qsrc);
  TensorView q(qp, DType::kF32, shape, strides), k(qp + C, DType::kF32, shape, strides),
      v(qp + 2 * C, DType::kF32, shape, strides);
  TensorView out(odst, DType::kF32, shape, Shape{L * C, hd, C, 1});
  AttentionOptions opt;
  opt.num_threads = 1;
  if (with_mask) {
    sc.mask.resize(size_t(nb * L * L));
    std::vector<int> lab(static_cast<size_t>(L));
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t n = windows[list[size_t(j)]], wy = n / nwx, wx = n % nwx;
      for (int64_t l = 0; l < L; ++l)
        lab[size_t(l)] = 3 * region(wy * ws + l / ws, wg.H, ws, s) + region(wx * ws + l % ws, wg.W, ws, s);
      uint8_t* m = &sc.mask[size_t(j * L * L)];
      for (int64_t qi = 0; qi < L; ++qi)
        for (int64_t kj = 0; kj < L; ++kj) m[qi * L + kj] = lab[size_t(qi)] == lab[size_t(kj)];
    }
    opt.attn_mask = TensorView(sc.mask.data(), DType::kBool, Shape{nb, 1, L, L});
  }
  scaled_dot_product_attention(q, k, v, opt, AttentionOutputs{out, {}, {}});
  if (!run)
    for (int64_t j = 0; j < nb; ++j)
      std::memcpy(&sc.o[size_t(list[size_t(j)] * L * C)], &sc.ob[size_t(j * L * C)], size_t(L * C) * sizeof(float));
}

// The rest of the block for the chunk's nw windows (window indices windows[0..nw)), from sc.xw (tokens) and sc.o
// (attention): projection, MLP and the gated update scattered back to the (un-rolled) pixels of y.
void mlp_and_scatter(const BlockW& b, const BlockCtx& cx, const WindowGrid& wg, const int64_t* windows, int64_t nw,
                     const float* gate, WindowScratch& sc) {
  const int64_t L = wg.L, C = wg.C, M = nw * L, hid = cx.hid;
  // t = xw + proj_b + o·Wproj; a = LN2(t); h = gelu(fc1(a)); o = t + fc2_b + h·Wfc2 (= t + mlp(t))
  add_row_bias(sc.xw.data(), M, C, b.proj_b.data(), sc.t.data());
  nn::gemm_acc(sc.o.data(), C, M, C, b.proj.data(), nn::padded_cols(C), C, sc.t.data(), C);
  nn::layer_norm(sc.t.data(), M, C, b.n2_w.data(), b.n2_b.data(), cx.ln_eps, sc.a.data());
  nn::linear(sc.a.data(), M, C, b.fc1.data(), b.fc1_b.data(), hid, sc.h.data(), 1);
  nn::gelu_inplace(sc.h.data(), M * hid);
  add_row_bias(sc.t.data(), M, C, b.fc2_b.data(), sc.o.data());
  nn::gemm_acc(sc.h.data(), hid, M, hid, b.fc2.data(), nn::padded_cols(C), C, sc.o.data(), C);
  // xw += g * (t + mlp - xw), scattered back to the (un-rolled) pixels
  for (int64_t i = 0; i < nw; ++i) {
    const int64_t n = windows[i];
    const float g = gate[size_t(n)];
    const float* xi = sc.xw.data() + i * L * C;
    const float* oi = sc.o.data() + i * L * C;
    wg.for_each_run(n, [&](int64_t l, float* __restrict p, int64_t count) {
      const float* __restrict xl = xi + l * C;
      const float* __restrict ol = oi + l * C;
      for (int64_t j = 0; j < count * C; ++j) p[j] = xl[j] + g * (ol[j] - xl[j]);
    });
  }
}

// One chunk of routed windows (window indices windows[0..nw)), serial: gather, LayerNorm 1, qkv, attention (windows
// without a mask in one call, masked windows in another), then MLP and scatter.
void run_window_chunk(const BlockW& b, const BlockCtx& cx, const WindowGrid& wg, const int64_t* windows, int64_t nw,
                      const float* gate) {
  const int64_t L = wg.L, C = wg.C, M = nw * L, hid = cx.hid;
  thread_local WindowScratch sc;
  sc.xw.resize(size_t(M * C));
  sc.a.resize(size_t(M * C));
  sc.qkv.resize(size_t(M * 3 * C));
  sc.o.resize(size_t(M * C));
  sc.t.resize(size_t(M * C));
  sc.h.resize(size_t(M * hid));
  for (int64_t i = 0; i < nw; ++i) {
    float* dst = sc.xw.data() + i * L * C;
    wg.for_each_run(windows[i], [&](int64_t l, const float* p, int64_t count) {
      std::memcpy(dst + l * C, p, size_t(count * C) * sizeof(float));
    });
  }
  nn::layer_norm(sc.xw.data(), M, C, b.n1_w.data(), b.n1_b.data(), cx.ln_eps, sc.a.data());
  nn::linear(sc.a.data(), M, C, b.qkv.data(), b.qkv_b.data(), 3 * C, sc.qkv.data(), 1);
  std::vector<int64_t> plain, masked;
  for (int64_t i = 0; i < nw; ++i) (wg.needs_mask(windows[i]) ? masked : plain).push_back(i);
  attend_windows(cx, wg, windows, plain, false, sc);
  attend_windows(cx, wg, windows, masked, true, sc);
  mlp_and_scatter(b, cx, wg, windows, nw, gate, sc);
}

// One window block: y [H, W, C] = block(src) (src == y: in place); the routing decisions of its nW windows go to
// routed_out / gates_out when given. Route (conv path and router), attend the routed windows, MLP and scatter.
void run_block(const BlockW& b, const BlockCtx& cx, const float* src, float* y, bool dense,
               const uint8_t* routing_in, uint8_t* routed_out, float* gates_out, int64_t* n_routed) {
  const int64_t H = cx.H, W = cx.W, C = cx.C;
  const int64_t ws = b.ws, s = b.shifted ? ws / 2 : 0, L = ws * ws;
  const int64_t nwy = H / ws, nwx = W / ws, nW = nwy * nwx;
  const WindowGrid wg{y, H, W, C, ws, s, L, nwy, nwx, nW};
  const auto stage_name = [&](const char* what) {
    return [&cx, ws, what] {
      return "block " + std::to_string(cx.block_index) + " (" + std::to_string(ws) + "x" + std::to_string(ws) +
             "): " + what;
    };
  };
  cx.clock->start();
  // 1. cheap path: y = src + pw(gelu(dw(src))), one fused pass per row (src = y but for a group's first block)
  nn::dw_act_pw_hwc(src, H, W, C, b.dw.data(), b.dw_b.data(), true, b.pw.data(), b.pw_b.data(), src, y,
                    cx.threads);
  cx.clock->mark(stage_name("conv path"));
  // 2-5. router
  std::vector<float> gate(static_cast<size_t>(nW));
  route_windows(b, cx, wg, gate.data());
  std::vector<int64_t> routed;
  for (int64_t n = 0; n < nW; ++n) {
    bool r = dense ? true : (routing_in ? routing_in[n] != 0 : gate[size_t(n)] > cx.threshold);
    if (routed_out) routed_out[n] = uint8_t(r);
    if (gates_out) gates_out[n] = gate[size_t(n)];
    if (r) routed.push_back(n);
  }
  *n_routed += int64_t(routed.size());
  if (cx.probe) {
    const int64_t n = cx.probe->window;
    probe_window(b, cx, y, n, gate, std::binary_search(routed.begin(), routed.end(), n), cx.probe);
  }
  cx.clock->mark(stage_name("router"));
  // 6. routed windows, in chunks of ~1024 tokens (each chunk serial inside; chunks in parallel). Results do not
  // depend on the chunking: every GEMM row and every attention window is computed the same way wherever it sits.
  const int64_t per_chunk = std::max<int64_t>(1, 1024 / L);
  const int64_t nchunks = (int64_t(routed.size()) + per_chunk - 1) / per_chunk;
  parallel_for(nchunks, cx.threads, [&](int64_t ch) {
    const int64_t i0 = ch * per_chunk, i1 = std::min<int64_t>(int64_t(routed.size()), i0 + per_chunk);
    run_window_chunk(b, cx, wg, routed.data() + i0, i1 - i0, gate.data());
  });
  cx.clock->mark(stage_name("attention windows"), nW, int64_t(routed.size()));
}

// The attention weights of window n of block b, from the block input y (before the block's routed update), as the
// routed path computes them: tokens gathered after the roll, LayerNorm 1, qkv, the Swin mask where needed, and
// scaled_dot_product_attention (need_weights). Runs only for an inspection probe, never on the normal path.
void probe_window(const BlockW& b, const BlockCtx& cx, const float* y, int64_t n, const std::vector<float>& gate,
                  bool routed, AttentionProbe* probe) {
  const int64_t H = cx.H, W = cx.W, C = cx.C, ws = b.ws, s = b.shifted ? ws / 2 : 0, L = ws * ws;
  const int64_t nwx = W / ws, wy = n / nwx, wx = n % nwx, heads = cx.heads, hd = cx.hd;
  std::vector<float> xw(size_t(L * C)), a(size_t(L * C)), qkv(size_t(L * 3 * C));
  for (int64_t l = 0; l < L; ++l) {
    const int64_t py = (wy * ws + l / ws + s) % H, px = (wx * ws + l % ws + s) % W;
    std::memcpy(&xw[size_t(l * C)], y + (py * W + px) * C, size_t(C) * sizeof(float));
  }
  nn::layer_norm(xw.data(), L, C, b.n1_w.data(), b.n1_b.data(), cx.ln_eps, a.data());
  nn::linear(a.data(), L, C, b.qkv.data(), b.qkv_b.data(), 3 * C, qkv.data(), 1);
  const Shape shape{1, heads, L, hd}, strides{L * 3 * C, hd, 3 * C, 1};
  TensorView q(qkv.data(), DType::kF32, shape, strides), k(qkv.data() + C, DType::kF32, shape, strides),
      v(qkv.data() + 2 * C, DType::kF32, shape, strides);
  Tensor out(DType::kF32, {1, heads, L, hd});
  probe->weights = Tensor(DType::kF32, {heads, L, L});
  probe->allowed = Tensor(DType::kBool, {L, L});
  uint8_t* m = probe->allowed.data<uint8_t>();
  std::vector<int> lab(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l)
    lab[size_t(l)] = 3 * region(wy * ws + l / ws, H, ws, s) + region(wx * ws + l % ws, W, ws, s);
  for (int64_t qi = 0; qi < L; ++qi)
    for (int64_t kj = 0; kj < L; ++kj) m[qi * L + kj] = lab[size_t(qi)] == lab[size_t(kj)];
  AttentionOptions opt;
  opt.num_threads = 1;
  opt.attn_mask = TensorView(m, DType::kBool, Shape{1, 1, L, L});
  scaled_dot_product_attention(q, k, v, opt,
                               AttentionOutputs{out.view(), {}, TensorView(probe->weights.data<float>(), DType::kF32,
                                                                           Shape{1, heads, L, L})});
  probe->routed = routed;
  probe->gate = gate[size_t(n)];
}

// Refuses, before anything is allocated, an output of more than options.max_output_pixels.
void check_output_pixels(int64_t h, int64_t w, int64_t s, const UpscaleOptions& options, const char* fn) {
  check(options.max_output_pixels >= 1, ErrorKind::kInvalidArgument, fn, ": max_output_pixels must be >= 1, given ",
        options.max_output_pixels);
  const int64_t n = output_pixels(h, w, s);
  check(n <= options.max_output_pixels, ErrorKind::kInvalidArgument, fn, ": a ", w, "x", h, " input at x", s,
        " makes ", n, " output pixels, over max_output_pixels = ", options.max_output_pixels);
}

}  // namespace

Tensor SrModel::forward(const Tensor& x, const UpscaleOptions& options, UpscaleStats* stats) const {
  Tensor out;
  float* o = nullptr;
  int64_t n = 0, ow = 0;
  forward_impl(x, options, stats, [&](int64_t oh, int64_t width) {
    out = Tensor(DType::kF32, {3, oh, width});
    o = out.data<float>(), n = oh * width, ow = width;
  }, [&](int64_t y, const float* r, const float* g, const float* b) {
    std::memcpy(o + y * ow, r, size_t(ow) * sizeof(float));
    std::memcpy(o + n + y * ow, g, size_t(ow) * sizeof(float));
    std::memcpy(o + 2 * n + y * ow, b, size_t(ow) * sizeof(float));
  });
  return out;
}

void SrModel::forward_impl(const Tensor& x, const UpscaleOptions& options, UpscaleStats* stats,
                           const std::function<void(int64_t, int64_t)>& begin, const RowEmit& emit) const {
  const SrConfig& c = config_;
  const Prepared& P = *prepared_;
  check(x.dtype() == DType::kF32 && x.dim() == 3 && x.size(0) == 3, ErrorKind::kInvalidArgument,
        "SrModel::forward: x must be f32 [3, h, w], given ", to_string(x.dtype()), " ", shape_to_string(x.shape()));
  const int64_t h = x.size(1), w = x.size(2), pm = c.pad_multiple;
  const int64_t ph = (pm - h % pm) % pm, pw = (pm - w % pm) % pm;
  check(h > ph && w > pw && h > 0 && w > 0, ErrorKind::kInvalidArgument, "SrModel::forward: image ", w, "x", h,
        " too small for the reflect padding to a multiple of ", pm, " (each side must exceed its padding; ",
        "at least ", pm / 2 + 1, " px always works)");
  check_output_pixels(h, w, c.scale, options, "SrModel::forward");
  const int64_t H = h + ph, W = w + pw, C = c.dim, s = c.scale, s2 = s * s;
  const int threads = resolve_num_threads(options.num_threads);
  const bool dense = options.mode == AttentionMode::kDense;
  StageClock clock(stats, options.profile);
  // routing bookkeeping
  int64_t total_windows = 0;
  for (const auto& g : c.groups)
    for (int ws : g) total_windows += (H / ws) * (W / ws);
  if (options.routing_in) {
    check(!dense, ErrorKind::kInvalidArgument, "routing decisions fed from outside need --attention sparse");
    check(int64_t(options.routing_in->size()) == total_windows, ErrorKind::kInvalidArgument,
          "routing decisions: expected ", total_windows, " values (windows of all blocks for a ", W, "x", H,
          " padded input), given ", options.routing_in->size());
  }
  if (options.probe) {
    const std::vector<BlockGeometry> geo = block_geometry(h, w);
    const int64_t nb = int64_t(geo.size()), pb = options.probe->block;
    check(pb >= 0 && pb < nb, ErrorKind::kInvalidArgument, "attention probe: block must be in [0, ", nb,
          "), given ", pb);
    const int64_t nw = geo[size_t(pb)].num_windows(), pw = options.probe->window;
    check(pw >= 0 && pw < nw, ErrorKind::kInvalidArgument, "attention probe: window of block ", pb,
          " must be in [0, ", nw, ") for a ", W, "x", H, " padded input, given ", pw);
  }
  if (options.routing_out) options.routing_out->assign(size_t(total_windows), 0);
  if (options.gates_out) options.gates_out->assign(size_t(total_windows), 0.0f);
  // 1. reflect pad (bottom/right, edge not repeated), HWC
  // full-map buffers, per thread and reused across calls (and tiles): fresh multi-MB allocations page-fault
  struct Workspace {
    nn::Buffer xp, feat, y, y_in, u;
  };
  thread_local Workspace ws;
  float* xp = ws.xp.get(H * W * 3);
  const float* xs = x.data<float>();
  for (int64_t i = 0; i < H; ++i)
    for (int64_t j = 0; j < W; ++j) {
      const int64_t si = i < h ? i : 2 * (h - 1) - i, sj = j < w ? j : 2 * (w - 1) - j;
      for (int64_t ch = 0; ch < 3; ++ch) xp[(i * W + j) * 3 + ch] = xs[(ch * h + si) * w + sj];
    }
  // 2. head
  const int64_t HWC = H * W * C;
  float *feat = ws.feat.get(HWC), *y = ws.y.get(HWC), *y_in = ws.y_in.get(HWC);
  clock.start();
  nn::conv3x3_hwc(xp, H, W, 3, P.head.data(), P.head_b.data(), C, feat, threads);
  clock.mark([] { return std::string("head conv"); });
  BlockCtx cx{H, W, C, c.heads, c.head_dim, c.mlp_hidden, float(c.layer_norm_eps), float(c.router_std_eps),
              float(c.route_threshold), threads};
  cx.clock = &clock;
  int64_t offset = 0, routed = 0, block_index = 0, group_index = 0;
  // No copies of the full map: a group reads its input `gin` (kept for the group's residual) and writes its blocks'
  // stream to the other buffer `cur`; y and y_in alternate as group outputs, feat (the first group's input and the
  // body skip) is never written.
  const float* gin = feat;
  float* cur = y;
  for (const GroupW& g : P.groups) {
    const float* x = gin;  // the next block's input
    for (const BlockW& b : g.blocks) {
      cx.probe = options.probe && options.probe->block == block_index ? options.probe : nullptr;
      cx.block_index = block_index;
      const int64_t nW = (H / b.ws) * (W / b.ws);
      run_block(b, cx, x, cur, dense, options.routing_in ? options.routing_in->data() + offset : nullptr,
                options.routing_out ? options.routing_out->data() + offset : nullptr,
                options.gates_out ? options.gates_out->data() + offset : nullptr, &routed);
      x = cur;
      offset += nW;
      ++block_index;
    }
    // group tail: cur = gin + pw(dw(x))
    clock.start();
    nn::dw_act_pw_hwc(x, H, W, C, g.dw.data(), g.dw_b.data(), false, g.pw.data(), g.pw_b.data(), gin, cur, threads);
    clock.mark([group_index] { return "group " + std::to_string(group_index) + " tail"; });
    ++group_index;
    gin = cur;
    cur = cur == y ? y_in : y;
  }
  // 4. body tail + feat
  // (buffers reused: t = the body tail's output in `cur`, the buffer the last group did not write; then the up
  // conv's output u in the last group's output when it fits)
  float* body = cur == y ? y_in : y;  // == gin, writable
  float* t = cur;
  clock.start();
  nn::conv3x3_hwc(body, H, W, C, P.body_tail.data(), P.body_tail_b.data(), C, t, threads, feat);
  clock.mark([] { return std::string("body tail conv + skip"); });
  clock.start();
  float* u = 3 * s2 <= C ? body : ws.u.get(H * W * 3 * s2);
  // 5. up conv, then per LR row: its s output rows (pixel shuffle + nearest residual, cropped), handed to emit
  nn::conv3x3_hwc(t, H, W, C, P.up.data(), P.up_b.data(), 3 * s2, u, threads);
  begin(h * s, w * s);
  const int64_t ow = w * s;
  parallel_for(h, threads, [&](int64_t i) {
    thread_local std::vector<float> rows;  // [channel][a][ow]: output rows i·s + a
    rows.resize(size_t(3 * s * ow));
    for (int64_t ch = 0; ch < 3; ++ch)
      for (int64_t j = 0; j < w; ++j) {
        const float* up = u + (i * W + j) * 3 * s2 + ch * s2;
        const float res = xp[(i * W + j) * 3 + ch];
        for (int64_t a = 0; a < s; ++a)
          for (int64_t bb = 0; bb < s; ++bb) rows[size_t((ch * s + a) * ow + j * s + bb)] = up[a * s + bb] + res;
      }
    for (int64_t a = 0; a < s; ++a)
      emit(i * s + a, &rows[size_t(a * ow)], &rows[size_t((s + a) * ow)], &rows[size_t((2 * s + a) * ow)]);
  });
  clock.mark([] { return std::string("upsample conv + shuffle"); });
  clock.finish();
  if (stats) {
    stats->windows_total += total_windows;
    stats->windows_routed += routed;
  }
}

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
        "tensor_to_image: f32 [3, h, w] expected, given ", shape_to_string(chw.shape()));
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
  check(lr.channels == 3, ErrorKind::kInvalidArgument, "upscale: RGB image expected, given ", lr.channels,
        " channels");
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
    forward_impl(image_to_tensor_mt(lr, threads), options, stats, [](int64_t, int64_t) {},
                 [&](int64_t y, const float* r, const float* g, const float* b) {
                   sink(y, int64_t(0), w * s, r, g, b);
                 });
    if (stats) stats->tiles += 1;
    if (options.progress) options.progress(1, 1);
    return;
  }
  check(options.tile >= 16, ErrorKind::kInvalidArgument, "upscale: tile must be >= 16 LR pixels (or 0 = untiled), given ",
        options.tile);
  check(options.overlap >= -1, ErrorKind::kInvalidArgument, "upscale: overlap must be >= 0 (or -1 = auto), given ",
        options.overlap);
  check(!options.routing_in && !options.routing_out && !options.gates_out && !options.probe,
        ErrorKind::kInvalidArgument,
        "upscale: routing input/output needs an untiled run (tile 0)");
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
      forward_impl(image_to_tensor_mt(crop, threads), options, stats, [](int64_t, int64_t) {},
                   [&](int64_t yy, const float* r, const float* g, const float* b) {
                     const int64_t i = cy0 * s + yy, off = (x0 - cx0) * s;
                     if (i >= y0 * s && i < y1 * s) sink(i, x0 * s, (x1 - x0) * s, r + off, g + off, b + off);
                   });
      if (stats) stats->tiles += 1;
      if (options.progress) options.progress(++done, total);
    }
}

}  // namespace sattn::sr
