// `sattn demo`: the main job — super-resolution ×2 of a scene drawn here in code (no image files): the HR scene is
// bicubic-downscaled (MATLAB imresize), then upscaled by bicubic, by the embedded SattnSR model with dense window
// attention and with content-routed sparse attention; prints Y-PSNR/SSIM (BasicSR protocol), the routed share and
// dense vs sparse time, and writes a side-by-side PNG. Without embedded/source-tree x2 weights it says so and runs
// the attention demo instead.
// `sattn demo --attention`: attention on generated inputs with the registry's chosen kernel, checked against the
// reference in float64, with timing. Exit 0 when the check passes, 1 when it fails, 2 on bad options.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <vector>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "cli/sr_weights.hpp"
#include "io/writers.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/sr.hpp"
#include "sr/png_writer.hpp"
#include "viz/viz.hpp"

namespace sattn::cli {
namespace {

struct DemoArgs {
  int64_t batch = 1, heads = 8, heads_kv = 0, len = 1024, dim = 64;
  std::string causal = "none", kernel;
  int threads = 0, repeat = 3;
  uint64_t seed = 0;
  double tol = 1e-4;
  // the SR demo
  bool attention = false;
  std::string out = "sattn_demo.png", weights;
  int64_t size = 256;
};

// Deterministic N(0, 1) values (SplitMix64 + Box-Muller).
void fill_normal(Tensor& t, uint64_t seed) {
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return double((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
  };
  float* p = t.data<float>();
  for (int64_t n = 0; n < t.numel(); ++n) {
    const double u1 = 1.0 - next(), u2 = next();
    p[n] = float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }
}

int run_demo(const DemoArgs& a) {
  const int64_t hkv = a.heads_kv > 0 ? a.heads_kv : a.heads;
  Tensor q(DType::kF32, {a.batch, a.heads, a.len, a.dim}), k(DType::kF32, {a.batch, hkv, a.len, a.dim}),
      v(DType::kF32, {a.batch, hkv, a.len, a.dim});
  fill_normal(q, a.seed * 3 + 1);
  fill_normal(k, a.seed * 3 + 2);
  fill_normal(v, a.seed * 3 + 3);
  AttentionOptions o;
  o.causal = parse_causal(a.causal, "--causal");
  o.kernel = a.kernel;
  o.num_threads = a.threads;
  describe_attention(q, k, v, o);  // bad sizes fail here, before any work

  // The registry's choice, timed (median of --repeat runs).
  std::vector<double> ms;
  AttentionResult r;
  for (int rep = 0; rep < std::max(1, a.repeat); ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    r = attention(q, k, v, o, true, false);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];

  // The oracle: the reference kernel accumulating in float64.
  AttentionOptions ro = o;
  ro.kernel = "reference";
  ro.accumulate_fp64 = true;
  const Tensor qd = q.to(DType::kF64), kd = k.to(DType::kF64), vd = v.to(DType::kF64);
  const auto t0 = std::chrono::steady_clock::now();
  const AttentionResult ref = attention(qd, kd, vd, ro, true, false);
  const double ref_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  double max_err = 0.0, ref_norm = 0.0;
  bool finite = true;
  for (int64_t n = 0; n < ref.out.numel(); ++n) {
    const double x = r.out.data<float>()[n], y = ref.out.data<double>()[n];
    finite = finite && std::isfinite(x);
    max_err = std::max(max_err, std::abs(x - y));
    ref_norm = std::max(ref_norm, std::abs(y));
  }
  double lse_err = 0.0;
  for (int64_t n = 0; n < ref.lse.numel(); ++n)
    lse_err = std::max(lse_err, std::abs(double(r.lse.data<float>()[n]) - ref.lse.data<double>()[n]));
  const double bound = a.tol * std::max(1.0, ref_norm);
  const bool ok = finite && max_err <= bound;

  const double flops = 4.0 * double(a.batch) * double(a.heads) * double(a.len) * double(a.len) * double(a.dim) *
                       (o.causal == Causal::kNone ? 1.0 : 0.5);
  std::printf("sattn demo: attention on generated inputs, B=%lld Hq=%lld Hkv=%lld L=%lld D=%lld float32, causal=%s\n",
              (long long)a.batch, (long long)a.heads, (long long)hkv, (long long)a.len, (long long)a.dim,
              to_string(o.causal));
  std::printf("kernel:     %s\n", r.info.kernel.c_str());
  for (const auto& [name, why] : r.info.rejected) std::printf("  (not %s: %s)\n", name.c_str(), why.c_str());
  std::printf("time:       %.2f ms median of %zu runs (%.2f GFLOP/s); fp64 reference %.2f ms\n", median, ms.size(),
              flops / (median * 1e6), ref_ms);
  std::printf("max error:  out %.3g (bound %.3g = %.1g * max(1, |ref|max %.3g)), lse %.3g vs float64 reference\n",
              max_err, bound, a.tol, ref_norm, lse_err);
  std::printf("check:      %s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

// ---- the SR demo ---------------------------------------------------------------------------------------------

struct Colour {
  double r, g, b;
};
Colour mix(Colour a, Colour b, double t) {
  return {a.r + (b.r - a.r) * t, a.g + (b.g - a.g) * t, a.b + (b.b - a.b) * t};
}
double smoothstep(double e0, double e1, double x) {
  const double t = std::clamp((x - e0) / (e1 - e0), 0.0, 1.0);
  return t * t * (3 - 2 * t);
}

// The scene at (u, v) in [0, 1)^2 (u right, v down), colour in [0, 255]: an evening sky gradient with a moon (flat),
// a building with a grid of windows (repeated edges), concentric rings and diagonal stripes (texture), a flat
// lawn with a gentle gradient. Sizes are relative, so every --size draws the same picture.
Colour scene(double u, double v) {
  // evening sky: dark and smooth (the learned router leaves dark flat windows on the cheap path)
  Colour c = mix(Colour{12, 16, 48}, Colour{45, 40, 78}, smoothstep(0.0, 0.72, v));
  // moon: disc with a soft halo
  const double ds = std::hypot(u - 0.16, v - 0.14);
  c = mix(c, Colour{250, 230, 150}, 0.35 * (1 - smoothstep(0.06, 0.14, ds)));
  if (ds < 0.06) c = {255, 236, 160};
  // lawn: everything below the horizon
  if (v > 0.72) c = mix(Colour{50, 80, 40}, Colour{30, 55, 30}, smoothstep(0.72, 1.0, v));
  // building: walls with a 5 x 6 grid of windows, a flat roof line
  if (u > 0.30 && u < 0.62 && v > 0.26 && v < 0.80) {
    c = {180, 160, 140};
    const double cu = (u - 0.33) / 0.052, cv = (v - 0.30) / 0.075;  // window cells
    const double fu = cu - std::floor(cu), fv = cv - std::floor(cv);
    if (cu >= 0 && cu < 5 && cv >= 0 && cv < 6 && fu < 0.6 && fv < 0.62)
      c = (int(cu) + int(cv)) % 3 == 0 ? Colour{240, 220, 120} : Colour{40, 55, 80};
  }
  if (u > 0.29 && u < 0.63 && v > 0.24 && v < 0.26) c = {90, 70, 60};
  // rings: concentric cosine rings fading out at their rim (a texture of all orientations)
  const double dr = std::hypot(u - 0.82, v - 0.24);
  if (dr < 0.15) {
    const double t = 0.5 + 0.5 * std::cos(2 * M_PI * dr / 0.028);
    c = mix(c, mix(Colour{30, 30, 60}, Colour{235, 235, 245}, t), 1 - smoothstep(0.13, 0.15, dr));
  }
  // stripes: a diagonal awning-like panel
  if (u > 0.68 && u < 0.97 && v > 0.50 && v < 0.70) {
    const double t = 0.5 + 0.5 * std::cos(2 * M_PI * (u + 0.6 * v) / 0.035);
    c = mix(Colour{200, 50, 40}, Colour{245, 240, 230}, smoothstep(0.35, 0.65, t));
  }
  return c;
}

// HR scene (size x size): the analytic part supersampled 4 x 4 per pixel, then a sign with text on the lawn.
sr::Image draw_scene(int64_t size) {
  sr::Image im(size, size, 3);
  const int ss = 4;
  for (int64_t y = 0; y < size; ++y)
    for (int64_t x = 0; x < size; ++x) {
      Colour acc{0, 0, 0};
      for (int sy = 0; sy < ss; ++sy)
        for (int sx = 0; sx < ss; ++sx) {
          const Colour c =
              scene((double(x) + (sx + 0.5) / ss) / double(size), (double(y) + (sy + 0.5) / ss) / double(size));
          acc = {acc.r + c.r, acc.g + c.g, acc.b + c.b};
        }
      const double n = ss * ss;
      im.at(y, x, 0) = uint8_t(std::lround(std::clamp(acc.r / n, 0.0, 255.0)));
      im.at(y, x, 1) = uint8_t(std::lround(std::clamp(acc.g / n, 0.0, 255.0)));
      im.at(y, x, 2) = uint8_t(std::lround(std::clamp(acc.b / n, 0.0, 255.0)));
    }
  // A white sign with dark text (sharp, pixel-aligned strokes: the hardest edges of the scene).
  const int ts = size >= 192 ? 2 : 1;
  const std::string line1 = "SATTN x2", line2 = "sparse attn";
  const int pad = 3 * ts, tw = std::max(viz::text_width(line1, ts), viz::text_width(line2, ts));
  const int th = 2 * viz::text_height(ts) + 3 * ts;
  sr::Image sign = viz::canvas(th + 2 * pad, tw + 2 * pad, viz::Rgb{245, 245, 240});
  viz::draw_rect(sign, 0, 0, int(sign.width), int(sign.height), viz::Rgb{60, 60, 60});
  viz::draw_text(sign, pad, pad, line1, viz::Rgb{20, 20, 30}, ts);
  viz::draw_text(sign, pad, pad + viz::text_height(ts) + 3 * ts, line2, viz::Rgb{150, 30, 30}, ts);
  viz::blit(im, sign, int(0.04 * double(size)), int(0.80 * double(size)));
  return im;
}

sr::Image nearest_upscale(const sr::Image& lr, int s) {
  sr::Image out(lr.height * s, lr.width * s, lr.channels);
  for (int64_t y = 0; y < out.height; ++y)
    for (int64_t x = 0; x < out.width; ++x)
      for (int64_t c = 0; c < lr.channels; ++c) out.at(y, x, c) = lr.at(y / s, x / s, c);
  return out;
}

// Side by side, each panel with a label above: the PNG is 4 * S + 5 * gap wide, label + S + 2 * gap high.
sr::Image side_by_side(const std::vector<sr::Image>& panels, const std::vector<std::string>& labels) {
  const int gap = 8, s = int(panels[0].width), h = int(panels[0].height);
  const int ts = s >= 192 ? 2 : 1, band = viz::text_height(ts) + 2 * gap;
  sr::Image out = viz::canvas(band + h + gap, int(panels.size()) * (s + gap) + gap, viz::kWhite);
  for (size_t i = 0; i < panels.size(); ++i) {
    const int px = gap + int(i) * (s + gap);
    viz::draw_text(out, px, gap, labels[i], viz::kBlack, ts);
    viz::blit(out, panels[i], px, band);
  }
  return out;
}

// The x2 weights: --weights FILE, else the embedded ones, else the source tree's file; nullopt when none.
std::optional<sr::SrModel> demo_model(const std::string& weights) {
  return find_sr_model(weights, 2, "demo (an x2 upscale)");
}

int run_sr_demo(const DemoArgs& a, const sr::SrModel& model) {
  using Clock = std::chrono::steady_clock;
  const int s = 2;
  check(model.scale() == s, ErrorKind::kInvalidArgument, "demo: --weights: expected x2 weights, given x", model.scale(),
        " ('", model.name(), "')");
  io::OutputFile out(a.out, "demo: --out");  // before the work: an unwritable path fails at once
  const sr::Image hr = draw_scene(a.size);
  const sr::Image lr = sr::downscale(hr, s);
  const sr::Image bic = sr::upscale_bicubic(lr, s);

  // Untiled runs, the median time of --repeat runs per mode.
  auto timed = [&](sr::AttentionMode mode, sr::UpscaleStats& st, double& median_ms) {
    sr::UpscaleOptions o;
    o.mode = mode;
    o.num_threads = a.threads;
    std::vector<double> ms;
    sr::Image out;
    for (int r = 0; r < std::max(1, a.repeat); ++r) {
      st = {};
      const auto t0 = Clock::now();
      out = model.upscale(lr, o, &st);
      ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    median_ms = ms[ms.size() / 2];
    return out;
  };
  sr::UpscaleStats st_dense, st_sparse;
  double ms_dense = 0, ms_sparse = 0;
  const sr::Image dense = timed(sr::AttentionMode::kDense, st_dense, ms_dense);
  const sr::Image sparse = timed(sr::AttentionMode::kSparse, st_sparse, ms_sparse);

  const double p_bic = sr::psnr_y(bic, hr, s), p_dense = sr::psnr_y(dense, hr, s), p_sparse = sr::psnr_y(sparse, hr, s);
  const double s_bic = sr::ssim_y(bic, hr, s), s_dense = sr::ssim_y(dense, hr, s), s_sparse = sr::ssim_y(sparse, hr, s);
  const double routed =
      st_sparse.windows_total ? double(st_sparse.windows_routed) / double(st_sparse.windows_total) : 0;

  std::printf(
      "sattn demo: x2 super-resolution of a generated %lldx%lld scene (evening sky, building, rings, stripes, text)\n",
      (long long)hr.width, (long long)hr.height);
  std::printf("input:      %lldx%lld LR = MATLAB bicubic downscale of the HR scene\n", (long long)lr.width,
              (long long)lr.height);
  std::printf("model:      %s, %lld parameters\n", model.name().c_str(), (long long)model.num_parameters());
  std::printf("PSNR (Y):   bicubic %.2f dB | model dense %.2f dB | model sparse %.2f dB   (BasicSR protocol)\n", p_bic,
              p_dense, p_sparse);
  std::printf("SSIM (Y):   bicubic %.4f   | model dense %.4f   | model sparse %.4f\n", s_bic, s_dense, s_sparse);
  std::printf("routing:    %lld of %lld windows routed to attention (%.1f%%), the rest take the cheap path\n",
              (long long)st_sparse.windows_routed, (long long)st_sparse.windows_total, 100.0 * routed);
  std::printf("time:       dense %.1f ms | sparse %.1f ms (median of %d runs) -> sparse %.2fx faster\n", ms_dense,
              ms_sparse, std::max(1, a.repeat), ms_dense / std::max(ms_sparse, 1e-9));

  char b1[64], b2[64];
  std::snprintf(b1, sizeof b1, "bicubic %.2f dB", p_bic);
  std::snprintf(b2, sizeof b2, "sparse %.2f dB", p_sparse);
  const sr::Image png = side_by_side({nearest_upscale(lr, s), bic, sparse, hr}, {"LR (nearest)", b1, b2, "HR"});
  sr::write_png(out, png);
  out.commit();
  std::printf("wrote:      %s (%dx%d: LR nearest | bicubic | sparse model | HR)\n", a.out.c_str(), int(png.width),
              int(png.height));
  return 0;
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto a = std::make_shared<DemoArgs>();
  auto* cmd = app.add_subcommand(
      "demo",
      "The main job: x2 super-resolution of a generated scene with the embedded SattnSR model (bicubic vs "
      "dense vs sparse attention: PSNR, routed windows, time) and a side-by-side PNG. With --attention: run "
      "attention on generated inputs with the automatically chosen kernel, check it against the float64 "
      "reference and print the error, the kernel and the timing (exit 1 if the check fails)");
  const auto positive = CLI::Range(int64_t(1), int64_t(1) << 30);
  // SR demo options
  cmd->add_option("--out", a->out, "SR demo: the side-by-side PNG to write")->capture_default_str();
  cmd->add_option("--size", a->size, "SR demo: side of the generated HR scene in pixels (even; LR is half)")
      ->check(CLI::Range(int64_t(64), int64_t(2048)))
      ->capture_default_str();
  cmd->add_option("--weights", a->weights, "SR demo: x2 safetensors weights (default: embedded / sr/weights/)");
  cmd->add_flag("--attention", a->attention, "Run the attention demo (the options below) instead of the SR demo");
  // attention demo options
  std::vector<CLI::Option*> attention_only;
  attention_only.push_back(
      cmd->add_option("--batch", a->batch, "Attention: batch size B")->check(positive)->default_str("1"));
  attention_only.push_back(
      cmd->add_option("--heads", a->heads, "Attention: query heads Hq")->check(positive)->default_str("8"));
  attention_only.push_back(
      cmd->add_option("--kv-heads", a->heads_kv, "Attention: key/value heads Hkv (default Hq; must divide Hq)")
          ->check(positive));
  attention_only.push_back(
      cmd->add_option("--len", a->len, "Attention: sequence length L (Lq = Lk)")->check(positive)->default_str("1024"));
  attention_only.push_back(
      cmd->add_option("--dim", a->dim, "Attention: head dimension D (= Dv)")->check(positive)->default_str("64"));
  attention_only.push_back(cmd->add_option("--causal", a->causal, "Attention: none, top-left or bottom-right")
                               ->check(CLI::IsMember({"none", "top-left", "bottom-right", "top_left", "bottom_right"}))
                               ->default_str("none"));
  attention_only.push_back(
      cmd->add_option("--kernel", a->kernel, "Attention: force a kernel by name (default: the registry's choice)"));
  attention_only.push_back(cmd->add_option("--seed", a->seed, "Attention: seed of the generated inputs")
                               ->check(seed_range())
                               ->default_str("0"));
  attention_only.push_back(
      cmd->add_option("--tol", a->tol, "Attention: relative tolerance: max|out - ref| <= tol * max(1, max|ref|)")
          ->check(CLI::Range(1e-15, 1.0))
          ->default_str("1e-4"));
  // both
  cmd->add_option("--threads", a->threads, "Threads (0 = SATTN_NUM_THREADS or all cores)")
      ->check(thread_range())
      ->default_str("0");
  cmd->add_option("--repeat", a->repeat, "Timed runs (the median is reported)")
      ->check(CLI::Range(1, 1000))
      ->default_str("3");
  cmd->callback([a, attention_only] {
    int code = 0;
    if (a->attention) {
      code = run_demo(*a);
    } else {
      for (const CLI::Option* o : attention_only)
        check(o->count() == 0, ErrorKind::kInvalidArgument, "demo: ", o->get_name(),
              " is an option of the attention demo: add --attention (the default demo is super-resolution)");
      check(a->size % 2 == 0, ErrorKind::kInvalidArgument, "demo: --size: expected an even number, given ", a->size);
      if (const auto model = demo_model(a->weights)) {
        code = run_sr_demo(*a, *model);
      } else {
        std::printf(
            "sattn demo: no x2 SR weights (none embedded at build time and %s does not exist): running the "
            "attention demo instead (see sr/README.md to train and export the weights)\n\n",
            source_tree_sr_weights(2).c_str());
        code = run_demo(*a);
      }
    }
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace sattn::cli
