// `sattn demo`: attention on generated inputs with the registry's chosen kernel, checked against the
// reference in float64, with timing. (Until the super-resolution issue replaces it.)
// Exit 0 when the check passes, 1 when it fails, 2 on bad options.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <vector>

#include "cli/commands.hpp"
#include "sattn/attention.hpp"

namespace sattn::cli {
namespace {

struct DemoArgs {
  int64_t batch = 1, heads = 8, heads_kv = 0, len = 1024, dim = 64;
  std::string causal = "none", kernel;
  int threads = 0, repeat = 3;
  uint64_t seed = 0;
  double tol = 1e-4;
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

}  // namespace

void add_demo_command(CLI::App& app) {
  auto a = std::make_shared<DemoArgs>();
  auto* cmd = app.add_subcommand(
      "demo", "Run attention on generated inputs with the automatically chosen kernel, check it against the "
              "float64 reference and print the error, the kernel and the timing (exit 1 if the check fails)");
  const auto positive = CLI::Range(int64_t(1), int64_t(1) << 30);
  cmd->add_option("--batch", a->batch, "Batch size B")->check(positive)->default_str("1");
  cmd->add_option("--heads", a->heads, "Query heads Hq")->check(positive)->default_str("8");
  cmd->add_option("--kv-heads", a->heads_kv, "Key/value heads Hkv (default Hq; must divide Hq)")->check(positive);
  cmd->add_option("--len", a->len, "Sequence length L (Lq = Lk)")->check(positive)->default_str("1024");
  cmd->add_option("--dim", a->dim, "Head dimension D (= Dv)")->check(positive)->default_str("64");
  cmd->add_option("--causal", a->causal, "none, top-left or bottom-right")
      ->check(CLI::IsMember({"none", "top-left", "bottom-right", "top_left", "bottom_right"}))
      ->default_str("none");
  cmd->add_option("--kernel", a->kernel, "Force a kernel by name (default: the registry's choice)");
  cmd->add_option("--threads", a->threads, "Threads (0 = SATTN_NUM_THREADS or all cores)")
      ->check(CLI::Range(0, 4096))
      ->default_str("0");
  cmd->add_option("--repeat", a->repeat, "Timed runs (the median is reported)")->check(CLI::Range(1, 1000))
      ->default_str("3");
  cmd->add_option("--seed", a->seed, "Seed of the generated inputs")->default_str("0");
  cmd->add_option("--tol", a->tol, "Relative tolerance: max|out - ref| <= tol * max(1, max|ref|)")
      ->check(CLI::Range(1e-15, 1.0))
      ->default_str("1e-4");
  cmd->callback([a] {
    const int code = run_demo(*a);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace sattn::cli
