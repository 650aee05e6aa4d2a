// `sattn sr upscale|downscale|eval`: super-resolution with the SattnSR model, MATLAB bicubic, BasicSR metrics.
#include <ctime>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/bench_timing.hpp"
#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "cli/sr_weights.hpp"
#include "io/writers.hpp"
#include "sr/png_writer.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/sr.hpp"

namespace sattn::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// --weights FILE, else the embedded weights, else the source tree's sr/weights/ file.
std::optional<sr::SrModel> load_model(const std::string& weights, int scale, bool required) {
  std::optional<sr::SrModel> m = find_sr_model(weights, scale, "sr: --scale");
  check(
      m || !required, ErrorKind::kIO, "sr: no weights for x", scale, ": ", [&] { return missing_sr_weights(scale); },
      " (train and export them, see sr/README.md, or pass --weights FILE)");
  return m;
}

void check_scale(int s) {
  check(s == 2 || s == 3 || s == 4, ErrorKind::kInvalidArgument, "--scale: expected 2, 3 or 4, given ", s);
}

void check_max_output_pixels(int64_t n) {
  check(n >= 1, ErrorKind::kInvalidArgument, "--max-output-pixels: expected >= 1, given ", n);
}

std::function<void(int64_t, int64_t)> progress_bar(const char* what) {
  if (!isatty(STDERR_FILENO)) return {};
  return [what](int64_t done, int64_t total) {
    const int width = 30, filled = int(width * done / std::max<int64_t>(total, 1));
    std::fprintf(stderr, "\r%s [%s%s] %lld/%lld", what, std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), (long long)done, (long long)total);
    if (done == total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

std::vector<uint8_t> read_routing(const std::string& path) {
  const Tensor t = read_npy(path);
  std::vector<uint8_t> r(size_t(t.numel()));
  const TensorView v = t.view();
  std::vector<int64_t> idx(size_t(t.dim()), 0);
  for (int64_t i = 0; i < t.numel(); ++i) {
    // flat C-order walk (the file's own dims are irrelevant: one value per window, blocks in order)
    int64_t rem = i;
    for (int64_t d = t.dim() - 1; d >= 0; --d) {
      idx[size_t(d)] = rem % t.size(d);
      rem /= t.size(d);
    }
    r[size_t(i)] = v.get(idx.data()) != 0.0;
  }
  return r;
}

struct UpscaleArgs {
  std::string in, out, weights, attention = "sparse", float_out, routing_in, routing_out, gates_out, precision = "fp32";
  int scale = 2, threads = 0, repeat = 1, png_compression = sr::kDefaultPngCompression;
  int64_t tile = -1, overlap = -1, max_output_pixels = sr::kDefaultMaxPixels;
  bool self_ensemble = false, profile = false;
};

// --png-compression of a command that writes a PNG (zlib level; sattn/image.hpp says why 1 is the default).
void add_png_compression_option(CLI::App* cmd, int& level) {
  cmd->add_option("--png-compression", level,
                  "zlib level of the output PNG: 0 (stored) to 9 (smallest); 1 is the fastest that compresses "
                  "(1.4-4x faster than libpng's usual 6 on 512x512 photos; the same pixels at every level)")
      ->check(CLI::Range(0, 9))
      ->capture_default_str();
}

// --precision of the SR commands: fp32, or bf16 (the model's matrix products on bf16 operands).
Float32Precision parse_sr_precision(const std::string& text) {
  check(text == "fp32" || text == "bf16", ErrorKind::kInvalidArgument, "--precision: expected fp32 or bf16, given '",
        text, "'");
  return text == "bf16" ? Float32Precision::kBF16 : Float32Precision::kHighest;
}

constexpr const char* kPrecisionHelp =
    "fp32, or bf16: the matrix products (the window attention's Q·Kᵀ and P·V, the convolutions but the first, the "
    "projections and the MLP) on bf16-rounded operands with float32 sums, on a CPU with bf16 products (AVX512-BF16, "
    "AMX; elsewhere the same as fp32); the depthwise convolutions, router, LayerNorms, GELU and softmax stay float32";

// --tile -1 (default): whole image up to 512x512 LR pixels, else tiles of 256.
int64_t auto_tile(int64_t tile, const sr::Image& lr) {
  if (tile >= 0) return tile;
  return sr::auto_tile_size(lr.height, lr.width);
}

// --profile: per stage, the median over the runs of its wall time (ms), its share of the stages' total and, for the
// attention stages, the windows routed; then the time per kind of stage.
void print_profile(const std::vector<std::vector<sr::SrStageTime>>& runs, double wall, const UpscaleArgs& a) {
  const std::vector<sr::SrStageTime>& last = runs.back();
  std::vector<double> med(last.size(), 0.0);
  for (size_t i = 0; i < last.size(); ++i) {
    std::vector<double> v;
    for (const auto& r : runs)
      if (i < r.size()) v.push_back(r[i].seconds);
    med[i] = median(std::move(v));
  }
  double total = 0;
  for (double m : med) total += m;
  std::printf(
      "profile: %s attention, %s, stage wall times in ms%s (sum %.1f ms; the run took %.1f ms)\n", a.attention.c_str(),
      a.threads > 0 ? (std::to_string(a.threads) + " thread(s)").c_str() : "default threads",
      runs.size() > 1 ? (", median of " + std::to_string(runs.size()) + " runs").c_str() : "", 1e3 * total, 1e3 * wall);
  std::printf("%-40s %9s %7s  %s\n", "stage", "ms", "share", "windows routed");
  std::map<std::string, double> kinds;  // "conv path", "router", "attention windows", "convs outside the blocks"
  for (size_t i = 0; i < last.size(); ++i) {
    const sr::SrStageTime& s = last[i];
    const size_t colon = s.name.rfind(": ");
    kinds[colon == std::string::npos ? (s.name == "other" ? "other" : "convs outside the blocks")
                                     : s.name.substr(colon + 2)] += med[i];
    std::printf("%-40s %9.2f %6.1f%%", s.name.c_str(), 1e3 * med[i], total > 0 ? 100.0 * med[i] / total : 0.0);
    if (s.windows_total > 0)
      std::printf("  %lld/%lld (%.1f%%)", (long long)s.windows_routed, (long long)s.windows_total,
                  100.0 * double(s.windows_routed) / double(s.windows_total));
    std::printf("\n");
  }
  std::printf("by kind:");
  for (const auto& [k, v] : kinds)
    std::printf("  %s %.1f ms (%.0f%%)", k.c_str(), 1e3 * v, total > 0 ? 100.0 * v / total : 0.0);
  std::printf("\n");
}

void run_upscale(const UpscaleArgs& a) {
  check_scale(a.scale);
  sr::UpscaleOptions opt;
  opt.mode = sr::parse_attention_mode(a.attention);
  opt.num_threads = a.threads;
  opt.float32_precision = parse_sr_precision(a.precision);
  check(
      !a.self_ensemble || (a.float_out.empty() && a.routing_in.empty() && a.routing_out.empty() && a.gates_out.empty()),
      ErrorKind::kInvalidArgument, "--self-ensemble: not with --float-out, --routing-in, --routing-out or --gates-out");
  check_max_output_pixels(a.max_output_pixels);
  opt.max_output_pixels = a.max_output_pixels;
  io::OutputFiles outputs;  // opened before the work: an unwritable output fails at once; OUT may be IN
  io::OutputFile& out_file = outputs.add(a.out, "OUT");
  io::OutputFile* float_file = a.float_out.empty() ? nullptr : &outputs.add(a.float_out, "--float-out");
  io::OutputFile* routing_file = a.routing_out.empty() ? nullptr : &outputs.add(a.routing_out, "--routing-out");
  io::OutputFile* gates_file = a.gates_out.empty() ? nullptr : &outputs.add(a.gates_out, "--gates-out");
  const sr::Image lr = sr::read_image(a.in, a.max_output_pixels, a.scale);
  opt.tile = auto_tile(a.tile, lr);
  opt.overlap = a.overlap;
  opt.self_ensemble = a.self_ensemble;
  const auto model = load_model(a.weights, a.scale, true);
  std::vector<uint8_t> rin, rout;
  std::vector<float> gout;
  if (!a.routing_in.empty()) {
    rin = read_routing(a.routing_in);
    opt.routing_in = &rin;
  }
  if (!a.routing_out.empty()) opt.routing_out = &rout;
  if (!a.gates_out.empty()) opt.gates_out = &gout;
  opt.progress = progress_bar("upscale");
  opt.profile = a.profile;
  check(a.repeat >= 1, ErrorKind::kInvalidArgument, "--repeat must be >= 1, given ", a.repeat);
  sr::UpscaleStats st;
  sr::Image out;
  std::vector<double> walls, cpus;                     // per run; the reported times are their medians
  std::vector<std::vector<sr::SrStageTime>> profiles;  // per run, with --profile
  for (int run = 0; run < a.repeat; ++run) {
    st = sr::UpscaleStats{};
    const auto t0 = Clock::now();
    const std::clock_t c0 = std::clock();  // process CPU time (all threads): meaningful on a loaded machine
    if (!a.float_out.empty()) {
      check(opt.tile == 0, ErrorKind::kInvalidArgument, "--float-out needs an untiled run (--tile 0)");
      const Tensor f = model->forward(sr::image_to_tensor(lr), opt, &st);
      st.tiles = 1;
      if (run + 1 == a.repeat) write_npy(*float_file, f);
      out = sr::tensor_to_image(f);
    } else {
      out = model->upscale(lr, opt, &st);
    }
    walls.push_back(seconds_since(t0));
    cpus.push_back(double(std::clock() - c0) / CLOCKS_PER_SEC);
    if (a.profile) profiles.push_back(st.stages);
  }
  const double secs = median(walls), cpu_secs = median(cpus);
  sr::write_png(out_file, out, a.png_compression, a.threads);
  if (routing_file) {
    Tensor t(DType::kU8, {int64_t(rout.size())});
    std::copy(rout.begin(), rout.end(), t.data<uint8_t>());
    write_npy(*routing_file, t);
  }
  if (gates_file) {
    Tensor t(DType::kF32, {int64_t(gout.size())});
    std::copy(gout.begin(), gout.end(), t.data<float>());
    write_npy(*gates_file, t);
  }
  outputs.commit();
  std::ostringstream summary;  // one write to the unbuffered stderr, not one per piece
  summary << "sr upscale: " << lr.width << "x" << lr.height << " -> " << out.width << "x" << out.height << " x"
          << a.scale << " " << a.attention << (a.precision == "bf16" ? " (bf16 products)" : "")
          << (a.self_ensemble ? " x8 self-ensemble" : "") << ", " << st.tiles << " tile(s), windows routed "
          << st.windows_routed << "/" << st.windows_total << ", weights " << model->name()
          << (a.repeat > 1 ? ", median of " + std::to_string(a.repeat) + " runs" : "") << ", cpu " << cpu_secs << " s, "
          << secs << " s\n";
  std::cerr << summary.str();
  if (a.profile) print_profile(profiles, secs, a);
}

struct EvalArgs {
  std::string data, weights, attention = "both", precision = "fp32";
  int scale = 2, threads = 0;
  int64_t tile = -1, limit = 0, max_output_pixels = sr::kDefaultMaxPixels;
  bool json = false, self_ensemble = false;
};

struct ModeResult {
  double psnr = 0, ssim = 0, seconds = 0;
  int64_t windows_total = 0, windows_routed = 0;
};

void run_eval(const EvalArgs& a) {
  check_scale(a.scale);
  const Float32Precision precision = parse_sr_precision(a.precision);
  check_max_output_pixels(a.max_output_pixels);
  check(fs::is_directory(a.data), ErrorKind::kIO, "--data: '", a.data, "' is not a directory");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(a.data)) {
    std::string ext = e.path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char c) { return char(std::tolower(c)); });
    if (e.is_regular_file() && (ext == ".png" || ext == ".jpg" || ext == ".jpeg")) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  if (a.limit > 0 && int64_t(files.size()) > a.limit) files.resize(size_t(a.limit));
  check(!files.empty(), ErrorKind::kIO, "--data: no PNG/JPEG images in '", a.data, "'");
  std::vector<std::string> modes{"bicubic"};
  const bool bicubic_only = a.attention == "bicubic";
  const auto model = bicubic_only ? std::nullopt : load_model(a.weights, a.scale, a.attention != "both");
  if (model) {
    if (a.attention == "both" || a.attention == "dense") modes.push_back("dense");
    if (a.attention == "both" || a.attention == "sparse") modes.push_back("sparse");
    if (a.attention != "both") sr::parse_attention_mode(a.attention);
  } else if (!bicubic_only) {
    std::cerr << "sr eval: no model weights for x" << a.scale << " (embedded or " << source_tree_sr_weights(a.scale)
              << "): bicubic only\n";
  }
  nlohmann::json js;
  js["scale"] = a.scale;
  js["data"] = a.data;
  js["protocol"] = "BasicSR: HR mod-crop, MATLAB bicubic LR, Y (BT.601, unrounded), border = scale";
  if (model) js["weights_training_step"] = model->config().training_step;
  js["self_ensemble"] = a.self_ensemble;
  js["precision"] = a.precision;
  if (!a.json && a.self_ensemble) std::printf("model rows: x8 geometric self-ensemble\n");
  if (!a.json && model && precision == Float32Precision::kBF16)
    std::printf("model rows: the matrix products on bf16 operands (--precision bf16)\n");
  std::map<std::string, ModeResult> mean;
  if (!a.json) {
    std::printf("%-16s", "image");
    for (const auto& m : modes) std::printf(" | %-7s PSNR    SSIM    time", m.c_str());
    std::printf("\n");
  }
  for (const auto& f : files) {
    // the outputs are HR-sized: the limit applies to the HR image itself
    const sr::Image hr = sr::mod_crop(sr::read_image(f.string(), a.max_output_pixels), a.scale);
    const sr::Image lr = sr::downscale(hr, a.scale);
    nlohmann::json row;
    row["name"] = f.filename().string();
    if (!a.json) std::printf("%-16s", f.filename().string().c_str());
    for (const auto& m : modes) {
      const auto t0 = Clock::now();
      sr::UpscaleStats st;
      sr::Image out;
      if (m == "bicubic") {
        out = sr::upscale_bicubic(lr, a.scale);
      } else {
        sr::UpscaleOptions opt;
        opt.mode = sr::parse_attention_mode(m);
        opt.num_threads = a.threads;
        opt.tile = auto_tile(a.tile, lr);
        opt.self_ensemble = a.self_ensemble;
        opt.max_output_pixels = a.max_output_pixels;
        opt.float32_precision = precision;
        out = model->upscale(lr, opt, &st);
      }
      const double secs = seconds_since(t0);
      const double p = sr::psnr_y(out, hr, a.scale), s = sr::ssim_y(out, hr, a.scale);
      auto& r = mean[m];
      r.psnr += p / double(files.size());
      r.ssim += s / double(files.size());
      r.seconds += secs;
      r.windows_total += st.windows_total;
      r.windows_routed += st.windows_routed;
      row[m] = {{"psnr", p}, {"ssim", s}, {"seconds", secs}};
      if (m != "bicubic")
        row[m]["routed_fraction"] = st.windows_total ? double(st.windows_routed) / double(st.windows_total) : 0.0;
      if (!a.json) std::printf(" | %-7s %7.3f %7.4f %6.2fs", "", p, s, secs);
    }
    if (!a.json) std::printf("\n"), std::fflush(stdout);
    js["images"].push_back(row);
  }
  if (!a.json) std::printf("%-16s", "mean");
  for (const auto& m : modes) {
    const auto& r = mean[m];
    js["mean"][m] = {{"psnr", r.psnr}, {"ssim", r.ssim}, {"seconds", r.seconds}};
    if (m != "bicubic")
      js["mean"][m]["routed_fraction"] = r.windows_total ? double(r.windows_routed) / double(r.windows_total) : 0.0;
    if (!a.json) std::printf(" | %-7s %7.3f %7.4f %6.2fs", "", r.psnr, r.ssim, r.seconds);
  }
  if (a.json) {
    std::cout << js.dump(1) << "\n";
  } else {
    std::printf("\n");
    if (mean.count("sparse") && mean["sparse"].windows_total)
      std::printf("sparse: %.1f%% of windows routed to attention\n",
                  100.0 * double(mean["sparse"].windows_routed) / double(mean["sparse"].windows_total));
  }
}

}  // namespace

void add_sr_command(CLI::App& app) {
  auto* sr = app.add_subcommand("sr", "Super-resolution: SattnSR model, MATLAB bicubic, BasicSR evaluation");
  sr->require_subcommand(1);

  auto ua = std::make_shared<UpscaleArgs>();
  auto* up = sr->add_subcommand("upscale", "Upscale a PNG/JPEG image with the SattnSR model, write a PNG");
  up->add_option("IN", ua->in, "input image (PNG or JPEG; gray is replicated to RGB)")->required();
  up->add_option("OUT", ua->out, "output PNG")->required();
  up->add_option("--scale", ua->scale, "2 or 4 (must match the weights)")->required();
  up->add_option("--attention", ua->attention, "dense (every window) or sparse (routed windows only)")
      ->capture_default_str();
  up->add_option("--threads", ua->threads, "threads (0 = SATTN_NUM_THREADS or all cores)")->check(thread_range());
  up->add_option("--tile", ua->tile,
                 "tile size in LR pixels (>= 16; 0 = whole image; -1 = whole image up to 512x512, else 256)")
      ->capture_default_str();
  up->add_option("--overlap", ua->overlap,
                 "context around each tile in LR pixels (-1 = the model's receptive radius: tiled == untiled)")
      ->capture_default_str();
  up->add_option("--weights", ua->weights, "safetensors weights (default: embedded / sr/weights/)");
  up->add_option("--precision", ua->precision, kPrecisionHelp)->capture_default_str();
  up->add_option("--max-output-pixels", ua->max_output_pixels,
                 "refuse inputs whose output (width x height x scale^2) has more pixels, checked from the file "
                 "header before decoding")
      ->capture_default_str();
  up->add_option("--float-out", ua->float_out, "also write the unclamped float output [3, sH, sW] as .npy");
  up->add_option("--routing-in", ua->routing_in, ".npy of per-window routing decisions to use (sparse, untiled)");
  up->add_option("--routing-out", ua->routing_out, "write the per-window routing decisions (.npy, uint8)");
  up->add_option("--gates-out", ua->gates_out, "write the per-window router gates (.npy, float32)");
  add_png_compression_option(up, ua->png_compression);
  up->add_flag("--self-ensemble", ua->self_ensemble,
               "x8 geometric self-ensemble: average the outputs of the 8 flips/transposes (8x the time)");
  up->add_option("--repeat", ua->repeat, "benchmarking: run the model N times in this process, report the median")
      ->capture_default_str();
  up->add_flag("--profile", ua->profile,
               "print the wall time of each stage of the model (per block: conv path, router, attention windows "
               "with the windows routed; convs outside the blocks), medians over --repeat runs, to stdout");
  up->callback([ua] { run_upscale(*ua); });

  auto da = std::make_shared<std::tuple<std::string, std::string, int, int>>("", "", 2, sr::kDefaultPngCompression);
  auto* down = sr->add_subcommand("downscale", "MATLAB-compatible bicubic downscale (imresize 1/s), HR mod-cropped");
  down->add_option("IN", std::get<0>(*da), "input image")->required();
  down->add_option("OUT", std::get<1>(*da), "output PNG")->required();
  down->add_option("--scale", std::get<2>(*da), "integer factor >= 1")->required();
  add_png_compression_option(down, std::get<3>(*da));
  down->callback([da] {
    const int s = std::get<2>(*da);
    check(s >= 1 && s <= 16, ErrorKind::kInvalidArgument, "--scale: expected 1..16, given ", s);
    io::OutputFile out(std::get<1>(*da), "OUT");  // before the work; OUT may be IN
    const sr::Image hr = sr::mod_crop(sr::read_image(std::get<0>(*da)), s);
    sr::write_png(out, sr::downscale(hr, s), std::get<3>(*da));
    out.commit();
  });

  auto ea = std::make_shared<EvalArgs>();
  auto* ev = sr->add_subcommand("eval", "BasicSR-protocol PSNR/SSIM (Y) of bicubic, model dense and sparse");
  ev->add_option("--scale", ea->scale, "2 or 4")->required();
  ev->add_option("--data", ea->data, "folder of HR images (PNG/JPEG)")->required();
  ev->add_option("--attention", ea->attention, "dense, sparse, both (model modes next to bicubic) or bicubic (only)")
      ->capture_default_str();
  ev->add_option("--weights", ea->weights, "safetensors weights (default: embedded / sr/weights/)");
  ev->add_option("--threads", ea->threads, "threads (0 = SATTN_NUM_THREADS or all cores)")->check(thread_range());
  ev->add_option("--tile", ea->tile, "tile size (0 = whole image; -1 = auto as in upscale)")->capture_default_str();
  ev->add_option("--limit", ea->limit, "evaluate only the first N images (sorted by name)");
  ev->add_option("--max-output-pixels", ea->max_output_pixels,
                 "refuse HR images with more pixels (the outputs are HR-sized), checked from the file header")
      ->capture_default_str();
  ev->add_flag("--json", ea->json, "print JSON (per image and mean) instead of the table");
  ev->add_flag("--self-ensemble", ea->self_ensemble, "model rows with the x8 geometric self-ensemble (8x the time)");
  ev->add_option("--precision", ea->precision, kPrecisionHelp)->capture_default_str();
  ev->callback([ea] {
    check(
        ea->attention == "both" || ea->attention == "dense" || ea->attention == "sparse" || ea->attention == "bicubic",
        ErrorKind::kInvalidArgument, "--attention: expected dense, sparse, both or bicubic, given '", ea->attention,
        "'");
    run_eval(*ea);
  });
}

}  // namespace sattn::cli
