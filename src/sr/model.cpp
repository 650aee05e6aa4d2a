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

#include "sr/model_internal.hpp"

namespace sattn::sr {

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
  // of the window attention and the GEMMs (convolutions, projections, MLP): UpscaleOptions::float32_precision
  Float32Precision precision = Float32Precision::kHighest;
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

// Cyclic shifted windows (Swin): the block rolls its input by (-s, -s) and cuts the rolled image into ws x ws
// windows, so the windows of the last window row/column hold pixels from opposite borders. Swin's mask keeps these
// apart: along each axis a rolled position is in region 0 (before the last window), 1 (in it, before the wrap) or
// 2 (after the wrap), and token i may attend to token j iff their regions agree on both axes. In image
// coordinates these are exactly the pairs the non-wrapping pattern WindowAttention2D(H, W, ws, s) allows (tested;
// docs/sparse.md, "Shifted windows"); the windows themselves differ (one rolled window, one router gate, holds
// pieces that the pattern keeps in separate groups).
inline int cyclic_shift_region(int64_t p, int64_t n, int64_t ws, int64_t s) {
  return p < n - ws ? 0 : (p < n - s ? 1 : 2);
}

// The mask [L, L] (1 = may attend) of window n = (wy, wx) of an H x W image under a cyclic shift by s.
void cyclic_shift_mask(int64_t wy, int64_t wx, int64_t H, int64_t W, int64_t ws, int64_t s, uint8_t* m) {
  const int64_t L = ws * ws;
  std::vector<int> lab(static_cast<size_t>(L));
  for (int64_t l = 0; l < L; ++l)
    lab[size_t(l)] =
        3 * cyclic_shift_region(wy * ws + l / ws, H, ws, s) + cyclic_shift_region(wx * ws + l % ws, W, ws, s);
  for (int64_t qi = 0; qi < L; ++qi)
    for (int64_t kj = 0; kj < L; ++kj) m[qi * L + kj] = lab[size_t(qi)] == lab[size_t(kj)];
}

void probe_window(const BlockW& b, const BlockCtx& cx, const float* y, int64_t n, const std::vector<float>& gate,
                  bool routed, AttentionProbe* probe);

// The windows of a block over y [H, W, C]: window n = (n / nwx, n % nwx) of ws x ws tokens, after the cyclic roll
// by (-s, -s) (s = 0: unshifted).
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
  // The cyclic-shift mask: a window needs one iff it touches the last window row/column of a shifted block.
  bool needs_mask(int64_t n) const { return s > 0 && (n / nwx == nwy - 1 || n % nwx == nwx - 1); }
};

// Tokens per chunk of routed windows: a chunk's activations (tokens, LayerNorm, qkv, attention, MLP hidden: about
// 1.5 KiB per token at C 40) stay in a core's L2 between its steps. 256 ran the x2 model on a 256x256 crop 2.5-5 %
// faster than 1024 (one window of 16x16, four of 8x8; docs/sr_cpp.md), in both precisions, sparse and dense.
constexpr int64_t kChunkTokens = 256;

// Per-thread scratch of a chunk of routed windows, reused across chunks and blocks.
struct WindowScratch {
  // cache-line aligned: rows of the GEMMs' tiles split fewer lines
  WorkspaceVector<float> xw, qkv, o, t, h;
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

// Attention of the chunk's windows i0 .. i1 - 1 (windows[i] is the window index of chunk entry i), in place: q, k,
// v read from sc.qkv [nw, L, 3C], the result written to sc.o [nw, L, C]; with_mask: the cyclic-shift mask.
void attend_windows(const BlockCtx& cx, const WindowGrid& wg, const int64_t* windows, int64_t i0, int64_t i1,
                    bool with_mask, WindowScratch& sc) {
  const int64_t L = wg.L, C = wg.C, ws = wg.ws, s = wg.s, nwx = wg.nwx, heads = cx.heads, hd = cx.hd;
  const int64_t nb = i1 - i0;
  // qkv channel index = which*C + head*hd + d, token-major: q [nb, heads, L, hd] strided
  const Shape shape{nb, heads, L, hd}, strides{L * 3 * C, hd, 3 * C, 1};
  float* qp = sc.qkv.data() + i0 * L * 3 * C;
  TensorView q(qp, DType::kF32, shape, strides), k(qp + C, DType::kF32, shape, strides),
      v(qp + 2 * C, DType::kF32, shape, strides);
  TensorView out(sc.o.data() + i0 * L * C, DType::kF32, shape, Shape{L * C, hd, C, 1});
  AttentionOptions opt;
  opt.num_threads = 1;
  opt.float32_precision = cx.precision;
  if (with_mask) {
    sc.mask.resize(size_t(nb * L * L));
    for (int64_t j = 0; j < nb; ++j) {
      const int64_t n = windows[i0 + j];
      cyclic_shift_mask(n / nwx, n % nwx, wg.H, wg.W, ws, s, &sc.mask[size_t(j * L * L)]);
    }
    opt.attn_mask = TensorView(sc.mask.data(), DType::kBool, Shape{nb, 1, L, L});
  }
  scaled_dot_product_attention(q, k, v, opt, AttentionOutputs{out, {}, {}});
}

// The rest of the block for the chunk's nw windows (window indices windows[0..nw)), from sc.xw (tokens) and sc.o
// (attention): projection, MLP and the gated update scattered back to the (un-rolled) pixels of y.
void mlp_and_scatter(const BlockW& b, const BlockCtx& cx, const WindowGrid& wg, const int64_t* windows, int64_t nw,
                     const float* gate, WindowScratch& sc) {
  const int64_t L = wg.L, C = wg.C, M = nw * L, hid = cx.hid;
  // t = xw + proj_b + o·Wproj; a = LN2(t); h = gelu(fc1(a)); o = t + fc2_b + h·Wfc2 (= t + mlp(t))
  add_row_bias(sc.xw.data(), M, C, b.proj_b.data(), sc.t.data());
  nn::gemm_acc(sc.o.data(), C, M, C, b.proj.data(), nn::padded_cols(C), C, sc.t.data(), C,
               b.proj.pairs_for(cx.precision));
  nn::layer_norm_linear(sc.t.data(), M, C, b.n2_w.data(), b.n2_b.data(), cx.ln_eps, b.fc1.data(), b.fc1_b.data(), hid,
                        sc.h.data(), b.fc1.pairs_for(cx.precision));
  add_row_bias(sc.t.data(), M, C, b.fc2_b.data(), sc.o.data());
  nn::gelu_gemm_acc(sc.h.data(), M, hid, b.fc2.data(), C, sc.o.data(), C, b.fc2.pairs_for(cx.precision));
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

// One chunk of routed windows (window indices windows[0..nw)), serial: gather, LayerNorm 1, qkv, attention, then
// MLP and scatter.
void run_window_chunk(const BlockW& b, const BlockCtx& cx, const WindowGrid& wg, const int64_t* windows, int64_t nw,
                      const float* gate) {
  const int64_t L = wg.L, C = wg.C, M = nw * L, hid = cx.hid;
  thread_local WindowScratch sc;
  sc.xw.resize(size_t(M * C));
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
  nn::layer_norm_linear(sc.xw.data(), M, C, b.n1_w.data(), b.n1_b.data(), cx.ln_eps, b.qkv.data(), b.qkv_b.data(),
                        3 * C, sc.qkv.data(), b.qkv.pairs_for(cx.precision));
  // one attention call per run of consecutive windows that all need the mask or all do not (in place, no copies)
  for (int64_t i0 = 0, i1; i0 < nw; i0 = i1) {
    const bool with_mask = wg.needs_mask(windows[i0]);
    for (i1 = i0 + 1; i1 < nw && wg.needs_mask(windows[i1]) == with_mask;) ++i1;
    attend_windows(cx, wg, windows, i0, i1, with_mask, sc);
  }
  mlp_and_scatter(b, cx, wg, windows, nw, gate, sc);
}

// One window block: y [H, W, C] = block(src) (src == y: in place); the routing decisions of its nW windows go to
// routed_out / gates_out when given. Route (conv path and router), attend the routed windows, MLP and scatter.
void run_block(const BlockW& b, const BlockCtx& cx, const float* src, float* y, bool dense, const uint8_t* routing_in,
               uint8_t* routed_out, float* gates_out, int64_t* n_routed) {
  const int64_t H = cx.H, W = cx.W, C = cx.C;
  const int64_t ws = b.ws, s = b.cyclic_shift ? ws / 2 : 0, L = ws * ws;
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
  nn::dw_act_pw_hwc(src, H, W, C, b.dw.data(), b.dw_b.data(), true, b.pw.data(), b.pw_b.data(), src, y, cx.threads,
                    b.pw.pairs_for(cx.precision));
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
  // 6. routed windows, in chunks of up to kChunkTokens tokens (each chunk serial inside; chunks in parallel), smaller
  // where few windows are routed, so that each thread gets ~8 chunks (a deep block routing a handful of 16x16 windows
  // would otherwise run them as one or two chunks, one thread idle). Results do not depend on the chunking: every
  // GEMM row and every attention window is computed the same way wherever it sits.
  const int64_t nr = int64_t(routed.size()), spread = 8 * int64_t(std::max(cx.threads, 1));
  const int64_t per_chunk = std::clamp<int64_t>((nr + spread - 1) / spread, 1, std::max<int64_t>(1, kChunkTokens / L));
  const int64_t nchunks = (nr + per_chunk - 1) / per_chunk;
  parallel_for(nchunks, cx.threads, [&](int64_t ch) {
    const int64_t i0 = ch * per_chunk, i1 = std::min(nr, i0 + per_chunk);
    run_window_chunk(b, cx, wg, routed.data() + i0, i1 - i0, gate.data());
  });
  cx.clock->mark(stage_name("attention windows"), nW, int64_t(routed.size()));
}

// The attention weights of window n of block b, from the block input y (before the block's routed update), as the
// routed path computes them: tokens gathered after the roll, LayerNorm 1, qkv, the cyclic-shift mask where needed, and
// scaled_dot_product_attention (need_weights). Runs only for an inspection probe, never on the normal path.
void probe_window(const BlockW& b, const BlockCtx& cx, const float* y, int64_t n, const std::vector<float>& gate,
                  bool routed, AttentionProbe* probe) {
  const int64_t H = cx.H, W = cx.W, C = cx.C, ws = b.ws, s = b.cyclic_shift ? ws / 2 : 0, L = ws * ws;
  const int64_t nwx = W / ws, wy = n / nwx, wx = n % nwx, heads = cx.heads, hd = cx.hd;
  std::vector<float> xw(size_t(L * C)), qkv(size_t(L * 3 * C));
  for (int64_t l = 0; l < L; ++l) {
    const int64_t py = (wy * ws + l / ws + s) % H, px = (wx * ws + l % ws + s) % W;
    std::memcpy(&xw[size_t(l * C)], y + (py * W + px) * C, size_t(C) * sizeof(float));
  }
  nn::layer_norm_linear(xw.data(), L, C, b.n1_w.data(), b.n1_b.data(), cx.ln_eps, b.qkv.data(), b.qkv_b.data(), 3 * C,
                        qkv.data(), b.qkv.pairs_for(cx.precision));
  const Shape shape{1, heads, L, hd}, strides{L * 3 * C, hd, 3 * C, 1};
  TensorView q(qkv.data(), DType::kF32, shape, strides), k(qkv.data() + C, DType::kF32, shape, strides),
      v(qkv.data() + 2 * C, DType::kF32, shape, strides);
  Tensor out(DType::kF32, {1, heads, L, hd});
  probe->weights = Tensor(DType::kF32, {heads, L, L});
  probe->allowed = Tensor(DType::kBool, {L, L});
  uint8_t* m = probe->allowed.data<uint8_t>();
  cyclic_shift_mask(wy, wx, H, W, ws, s, m);
  AttentionOptions opt;
  opt.num_threads = 1;
  opt.attn_mask = TensorView(m, DType::kBool, Shape{1, 1, L, L});
  scaled_dot_product_attention(
      q, k, v, opt,
      AttentionOutputs{out.view(), {}, TensorView(probe->weights.data<float>(), DType::kF32, Shape{1, heads, L, L})});
  probe->routed = routed;
  probe->gate = gate[size_t(n)];
}

}  // namespace

void check_output_pixels(int64_t h, int64_t w, int64_t s, const UpscaleOptions& options, const char* fn) {
  check(options.max_output_pixels >= 1, ErrorKind::kInvalidArgument, fn, ": max_output_pixels must be >= 1, given ",
        options.max_output_pixels);
  const int64_t n = output_pixels(h, w, s);
  check(n <= options.max_output_pixels, ErrorKind::kInvalidArgument, fn, ": a ", w, "x", h, " input at x", s, " makes ",
        n, " output pixels, over max_output_pixels = ", options.max_output_pixels);
}

Tensor SrModel::forward(const Tensor& x, const UpscaleOptions& options, UpscaleStats* stats) const {
  Tensor out;
  float* o = nullptr;
  int64_t n = 0, ow = 0;
  forward_impl(
      x, options, stats,
      [&](int64_t oh, int64_t width) {
        out = Tensor(DType::kF32, {3, oh, width});
        o = out.data<float>(), n = oh * width, ow = width;
      },
      [&](int64_t y, const float* r, const float* g, const float* b) {
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
        "SrModel::forward: x must be f32 [3, h, w], given ", to_string(x.dtype()), " ", shape_text(x.shape()));
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
    check(pb >= 0 && pb < nb, ErrorKind::kInvalidArgument, "attention probe: block must be in [0, ", nb, "), given ",
          pb);
    const int64_t nw = geo[size_t(pb)].num_windows(), pw = options.probe->window;
    check(pw >= 0 && pw < nw, ErrorKind::kInvalidArgument, "attention probe: window of block ", pb, " must be in [0, ",
          nw, ") for a ", W, "x", H, " padded input, given ", pw);
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
  BlockCtx cx{H,
              W,
              C,
              c.heads,
              c.head_dim,
              c.mlp_hidden,
              float(c.layer_norm_eps),
              float(c.router_std_eps),
              float(c.route_threshold),
              threads};
  cx.clock = &clock;
  cx.precision = options.float32_precision;
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
    nn::dw_act_pw_hwc(x, H, W, C, g.dw.data(), g.dw_b.data(), false, g.pw.data(), g.pw_b.data(), gin, cur, threads,
                      g.pw.pairs_for(cx.precision));
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
  nn::conv3x3_hwc(body, H, W, C, P.body_tail.data(), P.body_tail_b.data(), C, t, threads, feat,
                  P.body_tail.pairs_for(cx.precision));
  clock.mark([] { return std::string("body tail conv + skip"); });
  clock.start();
  float* u = 3 * s2 <= C ? body : ws.u.get(H * W * 3 * s2);
  // 5. up conv, then per LR row: its s output rows (pixel shuffle + nearest residual, cropped), handed to emit
  nn::conv3x3_hwc(t, H, W, C, P.up.data(), P.up_b.data(), 3 * s2, u, threads, nullptr, P.up.pairs_for(cx.precision));
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

}  // namespace sattn::sr
