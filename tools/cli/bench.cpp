// `sattn bench`: times exact attention (forward and backward) against the FMA limit and OpenBLAS SGEMM measured in the
// same run.
//
// GFLOP/s: forward 4·B·H·Lq·Lk·D (half of it for causal), backward 2.5x the forward. Two ceilings, measured in the
// same process before the rows of each thread count: "% fma" divides by the FMA limit (independent vector FMA
// chains of the selected SIMD build on that many threads, simd/fma_limit.hpp), "% sgemm" by the cblas_sgemm rate
// (N=2048, same thread count). Under the amx and avx512bf16 builds the header also gives the vdpbf16ps limit (the
// same with AVX512-BF16 dot products). Benchmarks are only meaningful on an idle machine.
#include <dlfcn.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <iostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/bench_timing.hpp"
#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "kernels/fused/fused.hpp"
#include "simd/fma_limit.hpp"
#include "sattn/attention.hpp"

namespace sattn::cli {
namespace {

// The median time in milliseconds of `reps` calls of f (bench_timing.hpp).
template <typename F>
double median_ms(int reps, F&& f) {
  return 1e3 * median_seconds(reps, std::forward<F>(f));
}

std::vector<int64_t> parse_list(const std::string& s, const char* option) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    int64_t x = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), x);
    check(ec == std::errc() && end == item.data() + item.size(), ErrorKind::kInvalidArgument, option,
          ": expected comma-separated integers, got '", s, "'");
    v.push_back(x);
  }
  return v;
}
std::vector<std::string> parse_words(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) v.push_back(item);
  return v;
}

struct BenchConfig {
  std::string dims = "64", lens = "1024,4096", masks = "full,causal", passes = "fwd,bwd", threads = "1,2";
  std::string dtype = "f32", kernel = "fused", clock = "wall", float32_precision = "highest";
  int64_t batch = 1, heads = 8, sgemm_n = 2048, lq = 0, kv_heads = 0;
  int reps = 5;
  bool all = false, json = false;
};

void run_bench(const BenchConfig& cfg_in) {
  BenchConfig cfg = cfg_in;
  check(cfg.clock == "wall" || cfg.clock == "thread", ErrorKind::kInvalidArgument,
        "--clock: expected wall or thread, got '", cfg.clock, "'");
  set_bench_thread_clock(cfg.clock == "thread");
  if (cfg.clock == "thread") cfg.threads = "1";
  if (cfg.all) cfg.dims = "64,128", cfg.lens = "512,1024,4096,16384";
  const auto dims = parse_list(cfg.dims, "--dims"), lens = parse_list(cfg.lens, "--lens"),
             threads = parse_list(cfg.threads, "--threads");
  for (const int64_t t : threads) check_thread_count(t);
  const auto masks = parse_words(cfg.masks), passes = parse_words(cfg.passes);
  check(cfg.dtype == "f32" || cfg.dtype == "bf16" || cfg.dtype == "f16", ErrorKind::kInvalidArgument,
        "--dtype: expected f32, bf16 or f16, got '", cfg.dtype, "'");
  const DType dt = cfg.dtype == "f32" ? DType::kF32 : cfg.dtype == "bf16" ? DType::kBF16 : DType::kF16;
  const Float32Precision precision = parse_float32_precision(cfg.float32_precision, "--float32-precision");
  nlohmann::json rows = nlohmann::json::array();
  const bool tty = !cfg.json;
  for (const int64_t t : threads) {
    const simd::FmaLimit fma = simd::fma_limit(int(t));
    const double sg = sgemm_gflops(int(t), cfg.sgemm_n, cfg.reps);
    if (tty) {
      std::printf("threads=%lld  FMA limit: ", (long long)t);
      if (fma.gflops > 0) std::printf("%.1f GFLOP/s (%s)", fma.gflops, fma.build);
      else std::printf("n/a (portable build)");
      if (fma.bf16_dot_gflops > 0) std::printf("  vdpbf16ps limit: %.1f GFLOP/s", fma.bf16_dot_gflops);
      if (cfg.sgemm_n > 0)
        std::printf("  sgemm N=%lld: %.1f GFLOP/s%s", (long long)cfg.sgemm_n, sg,
                    blas_core().empty() ? "" : (" (OpenBLAS " + blas_core() + ")").c_str());
      else std::printf("  sgemm skipped (--sgemm-n 0)");
      std::printf("  simd=%s  dtype=%s  float32_precision=%s\n", fused::simd_build(), cfg.dtype.c_str(),
                  to_string(precision));
    }
    rows.push_back({{"kind", "fma_limit"},
                    {"threads", t},
                    {"gflops", fma.gflops},  // 0: n/a
                    {"simd", fma.build},
                    {"bf16_dot_gflops", fma.bf16_dot_gflops}});  // 0: not measured (not amx / avx512bf16)
    rows.push_back({{"kind", "sgemm"}, {"threads", t}, {"n", cfg.sgemm_n}, {"gflops", sg}, {"blas_core", blas_core()}});
    if (tty)
      std::printf("  %-4s %6s %-6s %-3s %10s %9s %7s %8s %10s %s\n", "D", "L", "mask", "pass", "median_ms", "GFLOP/s",
                  "%fma", "%sgemm", "ws_MiB", "kernel");
    for (const int64_t D : dims)
      for (const int64_t L : lens) {
        std::mt19937 rng(42);
        std::normal_distribution<float> nd(0.f, 1.f);
        const int64_t Lq = cfg.lq > 0 ? cfg.lq : L;
        const int64_t hkv = cfg.kv_heads > 0 ? cfg.kv_heads : cfg.heads;
        const Shape shape = {cfg.batch, cfg.heads, Lq, D}, kshape = {cfg.batch, hkv, L, D};
        const bool any_bwd = std::find(passes.begin(), passes.end(), "bwd") != passes.end();
        Tensor q(DType::kF32, shape), k(DType::kF32, kshape), v(DType::kF32, kshape), dout;
        if (any_bwd) dout = Tensor(DType::kF32, shape);
        for (Tensor* x : {&q, &k, &v, &dout})
          if (x->data())
            for (int64_t i = 0; i < x->numel(); ++i) x->data<float>()[i] = nd(rng);
        // Half-precision runs take q, k, v, out, dO and the gradients in that dtype (as a PyTorch training step);
        // lse stays float32.
        Tensor qd = q, kd = k, vd = v, doutd = dout;
        if (dt != DType::kF32) qd = q.to(dt), kd = k.to(dt), vd = v.to(dt), doutd = any_bwd ? dout.to(dt) : dout;
        for (const auto& mask : masks)
          for (const auto& pass : passes) {
            check(mask == "full" || mask == "causal" || mask == "bias", ErrorKind::kInvalidArgument,
                  "--masks: expected full, causal or bias, got '", mask, "'");
            check(pass == "fwd" || pass == "bwd", ErrorKind::kInvalidArgument, "--passes: expected fwd/bwd");
            AttentionOptions o;
            o.causal = mask == "causal" ? (Lq == L ? Causal::kTopLeft : Causal::kBottomRight) : Causal::kNone;
            o.num_threads = int(t);
            o.kernel = cfg.kernel;
            o.float32_precision = precision;
            // bias: an additive mask [1, H, Lq, L] in the inputs' dtype shared by the batch (a learned position bias);
            // the backward computes its gradient too
            Tensor bias, dbias;
            if (mask == "bias") {
              Tensor b32(DType::kF32, {1, cfg.heads, Lq, L});
              for (int64_t i = 0; i < b32.numel(); ++i) b32.data<float>()[i] = nd(rng);
              bias = dt == DType::kF32 ? b32 : b32.to(dt);
              o.attn_mask = bias.view();
            }
            Tensor out(dt, shape), lse(DType::kF32, {cfg.batch, cfg.heads, Lq});
            Tensor dq, dk, dv;  // only for the backward (keeps the forward's resident memory honest)
            if (pass == "bwd") dq = Tensor(dt, shape), dk = Tensor(dt, kshape), dv = Tensor(dt, kshape);
            if (pass == "bwd" && mask == "bias") dbias = Tensor(dt, bias.shape());
            KernelInfo info;
            auto fwd = [&] { scaled_dot_product_attention(qd, kd, vd, o, {out.view(), lse.view(), {}}, &info); };
            fwd();
            fused::workspace_reset_peak();
            double ms;
            if (pass == "fwd") {
              ms = median_ms(cfg.reps, fwd);
            } else {
              ms = median_ms(cfg.reps, [&] {
                scaled_dot_product_attention_backward(doutd, qd, kd, vd, out, lse, o,
                                                      {dq.view(), dk.view(), dv.view(), dbias.view()}, &info);
              });
            }
            double flops = 4.0 * cfg.batch * cfg.heads * double(Lq) * L * D;
            if (mask == "causal") flops /= 2;
            if (pass == "bwd") flops *= 2.5;
            const double gf = flops / (ms * 1e6);
            const double ws = double(fused::workspace_peak_bytes()) / (1 << 20);
            const double pct = sg > 0 ? 100.0 * gf / sg : 0.0, pct_fma = fma.gflops > 0 ? 100.0 * gf / fma.gflops : 0.0;
            if (tty)
              std::printf("  %-4lld %6lld %-6s %-4s %10.2f %9.1f %6.1f%% %7.1f%% %10.2f %s\n", (long long)D,
                          (long long)L, mask.c_str(), pass.c_str(), ms, gf, pct_fma, pct, ws, info.kernel.c_str());
            std::fflush(stdout);
            rows.push_back({{"kind", "attention"},
                            {"threads", t},
                            {"B", cfg.batch},
                            {"H", cfg.heads},
                            {"Lq", Lq},
                            {"L", L},
                            {"D", D},
                            {"mask", mask},
                            {"pass", pass},
                            {"dtype", cfg.dtype},
                            {"float32_precision", to_string(precision)},
                            {"median_ms", ms},
                            {"gflops", gf},
                            {"pct_fma_limit", pct_fma},
                            {"pct_sgemm", pct},
                            {"workspace_peak_bytes", fused::workspace_peak_bytes()},
                            {"kernel", info.kernel},
                            {"simd", fused::simd_build()}});
          }
      }
  }
  if (cfg.json) std::cout << rows.dump(1) << "\n";
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("bench", "Benchmark exact attention against the FMA limit and SGEMM measured in the same run");
  static BenchConfig cfg;
  cmd->add_option("--dims", cfg.dims, "head dims, comma separated")->capture_default_str();
  cmd->add_option("--lens", cfg.lens, "sequence lengths (Lq = Lk), comma separated")->capture_default_str();
  cmd->add_option("--masks", cfg.masks,
                  "full, causal, bias (an additive [1, H, Lq, L] mask; the backward computes its gradient too)")
      ->capture_default_str();
  cmd->add_option("--passes", cfg.passes, "fwd,bwd")->capture_default_str();
  cmd->add_option("--threads", cfg.threads, "thread counts, comma separated")->capture_default_str();
  cmd->add_option("--dtype", cfg.dtype, "f32, bf16 or f16 inputs")->capture_default_str();
  cmd->add_option("--float32-precision", cfg.float32_precision,
                  "highest, high or bf16 (float32 values as two bfloat16 on the AMX tiles, or rounded to bfloat16 "
                  "in the products; see sattn attn --help)")
      ->capture_default_str();
  cmd->add_option("--kernel", cfg.kernel, "kernel to force (fused, reference, auto)")->capture_default_str();
  cmd->add_option("--lq", cfg.lq, "query length (0 = L; e.g. 1 for decode, keys L; causal is then bottom-right)")
      ->capture_default_str();
  cmd->add_option("--batch", cfg.batch, "B")->capture_default_str();
  cmd->add_option("--kv-heads", cfg.kv_heads, "key/value heads (GQA/MQA; 0 = --heads)")->capture_default_str();
  cmd->add_option("--heads", cfg.heads, "H")->capture_default_str();
  cmd->add_option("--reps", cfg.reps, "timed repetitions (median reported)")->capture_default_str();
  cmd->add_option("--sgemm-n", cfg.sgemm_n, "SGEMM size (0: skip SGEMM)")->capture_default_str();
  cmd->add_option("--clock", cfg.clock,
                  "wall, or thread (CPU time of the calling thread; forces 1 thread; for tuning on a busy machine)")
      ->capture_default_str();
  cmd->add_flag("--all", cfg.all, "the full sweep: D in {64,128}, L in {512,1024,4096,16384}");
  cmd->add_flag("--json", cfg.json, "print JSON rows instead of a table");
  cmd->callback([] { run_bench(cfg); });
}

}  // namespace sattn::cli
