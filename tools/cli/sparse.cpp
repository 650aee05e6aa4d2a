// `sattn sparse`: sparse attention on .npy files with a pattern spec; `sattn sparse-bench`: timings of the sparse
// kernels (median of repetitions, GFLOP/s on allowed and on computed scores, beside the dense fused kernel and
// OpenBLAS SGEMM when available).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "cli/bench_timing.hpp"
#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "io/writers.hpp"
#include "sattn/attention.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/linear.hpp"
#include "sattn/sparse.hpp"
#include "sparse/tiles.hpp"

namespace sattn::cli {

namespace {

Tensor randn(Shape s, uint64_t seed) {
  Tensor t(DType::kF32, std::move(s));
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int64_t x = 0; x < t.numel(); ++x) t.data<float>()[x] = n(g);
  return t;
}

// Allowed pairs per head slot 0 of a fixed pattern: full ranges count whole; partial ranges are checked.
double allowed_pairs(const sparse::Pattern& p, const sparse::BlockMask& m, int64_t lq, int64_t lk) {
  double n = 0;
  const int64_t nqb = m.num_q_blocks();
  for (int64_t qb = 0; qb < nqb; ++qb)
    for (int64_t r = m.row_ptr[qb]; r < m.row_ptr[qb + 1]; ++r) {
      const auto& kr = m.ranges[size_t(r)];
      if (kr.full) {
        n += double(m.q_block_start[qb + 1] - m.q_block_start[qb]) * (kr.end - kr.begin);
        continue;
      }
      const int64_t q0 = m.q_block_start[qb], mb = m.q_block_start[qb + 1] - q0;  // only the range's query rows
      for (int64_t qp = q0 + kr.q_first(mb); qp < q0 + kr.q_last(mb); ++qp)
        for (int64_t kp = kr.begin; kp < kr.end; ++kp) n += p.allowed(0, 0, m.q_index(qp), m.k_index(kp), lq, lk);
    }
  return n;
}

// Query-key pairs kept by a TopK / BlockTopK forward of q, k, v, from the selection it returns (0 for other patterns
// or Lq != Lk). BlockTopK computes its chosen blocks whole: the causal diagonal block counts its triangle only.
double selected_pairs(const sparse::Pattern& p, const Tensor& q, const Tensor& k, const Tensor& v,
                      const sparse::SparseOptions& o) {
  const std::string r = p.repr();
  const bool topk = r.rfind("TopK(", 0) == 0, blocktopk = r.rfind("BlockTopK(", 0) == 0;
  const int64_t L = q.size(2);
  if (!(topk || blocktopk) || k.size(2) != L) return 0.0;
  const Shape shape = sparse::selection_shape(p, q.size(0), q.size(1), L, L);
  Tensor idx(DType::kI64, shape), out(DType::kF32, {q.size(0), q.size(1), L, v.size(3)});
  sparse::sparse_attention(q, k, v, p, o, out, {}, idx.view());
  const int64_t* x = idx.data<int64_t>();
  const int64_t n = idx.numel();
  double pairs = 0;
  if (topk) {
    for (int64_t e = 0; e < n; ++e) pairs += x[e] >= 0;
    return pairs;
  }
  long block = 0, kb = 0;
  std::sscanf(r.c_str(), "BlockTopK(%ld, %ld", &block, &kb);
  const bool causal = r.find("causal=True") != std::string::npos;
  const int64_t nqb = shape[2], KB = shape[3];
  for (int64_t e = 0; e < n; ++e) {
    if (x[e] < 0) continue;
    const int64_t qb = (e / KB) % nqb, rows = std::min<int64_t>(block, L - qb * block);
    const int64_t keys = std::min<int64_t>(block, L - x[e] * block);
    pairs += causal && x[e] == qb ? double(rows) * double(rows + 1) / 2 : double(rows) * double(keys);
  }
  return pairs;
}

struct SparseArgs {
  std::string q, k, v, out, lse, pattern, indices;
  double scale = 0;
  bool gqa = true;
  std::string float32_precision = "highest";
};

void run_sparse(const SparseArgs& a) {
  io::OutputFiles outputs;  // opened first: an unwritable output fails before any work
  io::OutputFile& out_file = outputs.add(a.out, "--out");
  io::OutputFile* lse_file = a.lse.empty() ? nullptr : &outputs.add(a.lse, "--lse");
  io::OutputFile* indices_file = a.indices.empty() ? nullptr : &outputs.add(a.indices, "--indices");
  const sparse::Pattern p = sparse::Pattern::parse(a.pattern);
  const Tensor tq = read_npy(a.q), tk = read_npy(a.k), tv = read_npy(a.v);
  sparse::SparseOptions o;
  if (a.scale != 0) o.scale = a.scale;
  o.enable_gqa = a.gqa;
  o.float32_precision = parse_float32_precision(a.float32_precision, "--float32-precision");
  check(tq.dim() == 4 && tv.dim() == 4, ErrorKind::kInvalidArgument, "--q/--v: expected 4-D arrays");
  Tensor to(tq.dtype() == DType::kF64 ? DType::kF64 : DType::kF32, {tq.size(0), tq.size(1), tq.size(2), tv.size(3)});
  Tensor tl(to.dtype(), {tq.size(0), tq.size(1), tq.size(2)});
  Tensor ti;
  if (!a.indices.empty())
    ti = Tensor(DType::kI64, sparse::selection_shape(p, tq.size(0), tq.size(1), tq.size(2), tk.size(2)));
  sparse::sparse_attention(tq, tk, tv, p, o, to, tl, a.indices.empty() ? TensorView{} : ti.view());
  write_npy(out_file, to);
  if (lse_file) write_npy(*lse_file, tl);
  if (indices_file) write_npy(*indices_file, ti);
  outputs.commit();
}

void add_sparse_run(CLI::App& app) {
  auto* cmd = app.add_subcommand("sparse", "Sparse attention of .npy inputs under a pattern spec");
  static SparseArgs a;
  cmd->add_option("--q", a.q, "query .npy [B, Hq, Lq, D]")->required();
  cmd->add_option("--k", a.k, "key .npy [B, Hkv, Lk, D]")->required();
  cmd->add_option("--v", a.v, "value .npy [B, Hkv, Lk, Dv]")->required();
  cmd->add_option("--pattern", a.pattern, "pattern spec, e.g. \"SlidingWindow(256, 256)\" (see docs/sparse.md)")
      ->required();
  cmd->add_option("--scale", a.scale, "softmax scale (default 1/sqrt(D))");
  cmd->add_option("--out", a.out, "output .npy [B, Hq, Lq, Dv]")->required();
  cmd->add_option("--lse", a.lse, "log-sum-exp output .npy [B, Hq, Lq]");
  cmd->add_option("--indices", a.indices, "selected key (block) indices .npy (TopK / BlockTopK)");
  cmd->add_option("--float32-precision", a.float32_precision,
                  "highest or bf16 (float32 inputs may take the forward's bf16 products where the CPU has them, "
                  "rounded to bfloat16: faster, about 2^-9 relative per rounding; docs/sparse.md); high runs as "
                  "highest here")
      ->capture_default_str();
  cmd->callback([] { run_sparse(a); });
}

struct SparseBenchArgs {
  std::vector<std::string> patterns;
  std::vector<int64_t> lengths = {4096};
  std::vector<int> threads = {1};
  int64_t B = 1, H = 8, D = 64;
  int reps = 3;
  bool backward = false, dense = false;
  std::string clock_kind = "wall";
  std::string dtype = "f32";  // of q, k, v, the outputs and the gradients (lse float32)
  std::string float32_precision = "highest";
  Float32Precision precision = Float32Precision::kHighest;  // float32_precision parsed (run_sparse_bench)
  DType dt() const { return dtype == "bf16" ? DType::kBF16 : dtype == "f16" ? DType::kF16 : DType::kF32; }
};

// The lengths to time a spec at: --L, but a 2-D pattern's grid fixes L; sorted, without duplicates.
std::vector<int64_t> bench_lengths(const std::string& spec, bool linear, const std::vector<int64_t>& lengths) {
  std::vector<int64_t> ls = lengths;
  for (int64_t& L : ls) {
    // 2-D patterns: their grid fixes L.
    if (!linear && spec.find("2D(") != std::string::npos) {
      int64_t hh = 0, ww = 0;
      std::sscanf(spec.c_str() + spec.find("2D(") + 3, "%ld, %ld", &hh, &ww);
      L = hh * ww;
    }
  }
  std::sort(ls.begin(), ls.end());
  ls.erase(std::unique(ls.begin(), ls.end()), ls.end());
  return ls;
}

// The inputs (random, fixed seeds), the upstream gradient and the outputs of one benchmark row, [B, H, L, D], in
// dtype dt (lse float32).
struct BenchTensors {
  Tensor q, k, v, g, out, lse, dq, dk, dv;
  BenchTensors(int64_t B, int64_t H, int64_t L, int64_t D, DType dt)
      : q(randn({B, H, L, D}, 1).to(dt)),
        k(randn({B, H, L, D}, 2).to(dt)),
        v(randn({B, H, L, D}, 3).to(dt)),
        g(randn({B, H, L, D}, 4).to(dt)),
        out(dt, {B, H, L, D}),
        lse(DType::kF32, {B, H, L}),
        dq(dt, {B, H, L, D}),
        dk(dt, {B, H, L, D}),
        dv(dt, {B, H, L, D}) {}
};

// One table row: a sparse pattern or linear attention spec at length L on th threads.
void bench_spec(const SparseBenchArgs& a, const std::string& spec, const sparse::Pattern& p, bool linear, int64_t L,
                int th, double peak) {
  const int64_t B = a.B, H = a.H, D = a.D;
  const int reps = a.reps;
  BenchTensors t(B, H, L, D, a.dt());
  const Tensor &q = t.q, &k = t.k, &v = t.v, &g = t.g;
  Tensor &out = t.out, &lse = t.lse, &dq = t.dq, &dk = t.dk, &dv = t.dv;
  double tf = 0, tb = 0, allowed = 0, computed = 0;
  if (linear) {
    sparse::LinearOptions lo;
    lo.feature_map = spec.find("favor") != std::string::npos ? "favor+" : "elu";
    lo.causal = spec.find("causal") != std::string::npos;
    lo.num_threads = th;
    tf = median_seconds(reps, [&] { sparse::linear_attention(q, k, v, lo, out); });
    if (a.backward) tb = median_seconds(reps, [&] { sparse::linear_attention_backward(g, q, k, v, lo, dq, dk, dv); });
  } else {
    sparse::SparseOptions o;
    o.num_threads = th;
    o.float32_precision = a.precision;
    tf = median_seconds(reps, [&] { sparse::sparse_attention(q, k, v, p, o, out, lse); });
    if (a.backward)
      tb = median_seconds(reps, [&] {
        sparse::sparse_attention_backward(g, q, k, v, out, lse, p, o, {dq.view(), dk.view(), dv.view(), {}, {}, {}});
      });
    if (!sparse::selection_shape(p, 1, 1, L, L).empty()) {
      // TopK also scores every key (q·k only: half a pair's 4·D flops each); BlockTopK's block scores are
      // (L / block)² and not counted.
      allowed = computed = selected_pairs(p, q, k, v, o);
      if (allowed > 0 && p.repr().rfind("TopK(", 0) == 0) computed += 0.5 * double(L) * double(L) * B * H;
    } else if (p.node_ptr() && !sparse::has_logits(p)) {
      try {
        const sparse::BlockMask m = p.block_mask(L, L, H, 64);
        allowed = allowed_pairs(p, m, L, L) * B * H;
        computed = double(m.computed_pairs(0)) * B * H;
      } catch (const Error&) {
      }
    }
  }
  const double fl_all = 4.0 * D * allowed, fl_cmp = 4.0 * D * computed;
  std::printf("%-44s %7ld %3d %10.3f %10.3f %9.2f %9.2f %10.3f %8.1f\n", spec.c_str(), long(L), th, tf * 1e3, tb * 1e3,
              allowed > 0 ? fl_all / tf / 1e9 : 0.0, computed > 0 ? fl_cmp / tf / 1e9 : 0.0,
              allowed > 0 ? computed / allowed : 0.0, peak);
  std::fflush(stdout);
}

// One table row for the dense peer: the library's exact attention (the registry picks the fused kernel for fp32).
void bench_dense(const SparseBenchArgs& a, int64_t L, int th, double peak) {
  const int64_t B = a.B, H = a.H, D = a.D;
  const int reps = a.reps;
  BenchTensors t(B, H, L, D, a.dt());
  const Tensor &q = t.q, &k = t.k, &v = t.v, &g = t.g;
  Tensor &out = t.out, &lse = t.lse, &dq = t.dq, &dk = t.dk, &dv = t.dv;
  AttentionOptions ao;
  ao.num_threads = th;
  ao.float32_precision = a.precision;
  KernelInfo info;
  const double tf = median_seconds(reps, [&] {
    scaled_dot_product_attention(q, k, v, ao, {out.view(), lse.view(), {}}, &info);
  });
  double tb = 0;
  if (a.backward)
    tb = median_seconds(reps, [&] {
      scaled_dot_product_attention_backward(g, q, k, v, out, lse, ao, {dq.view(), dk.view(), dv.view(), {}});
    });
  const double pairs = double(L) * L * B * H;
  const std::string name = "dense (" + info.kernel + " kernel)";
  std::printf("%-44s %7ld %3d %10.3f %10.3f %9.2f %9.2f %10.3f %8.1f\n", name.c_str(), long(L), th, tf * 1e3, tb * 1e3,
              4.0 * D * pairs / tf / 1e9, 4.0 * D * pairs / tf / 1e9, 1.0, peak);
  std::fflush(stdout);
}

void run_sparse_bench(SparseBenchArgs a) {
  set_bench_thread_clock(a.clock_kind == "thread");
  check(!a.patterns.empty() || a.dense, ErrorKind::kInvalidArgument,
        "--pattern: expected at least one spec (or --dense)");
  check(a.clock_kind != "thread" || (a.threads.size() == 1 && a.threads[0] == 1), ErrorKind::kInvalidArgument,
        "--clock thread: only with --threads 1");
  check(a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "f16", ErrorKind::kInvalidArgument,
        "--dtype: expected f32, bf16 or f16, got '", a.dtype, "'");
  a.precision = parse_float32_precision(a.float32_precision, "--float32-precision");
  std::printf("# tiles: %s, clock: %s, dtype: %s, float32 precision: %s\n", sparse::tiles::simd_build(),
              a.clock_kind.c_str(), a.dtype.c_str(), a.float32_precision.c_str());
  std::printf("%-44s %7s %3s %10s %10s %9s %9s %10s %8s\n", "pattern", "L", "thr", "fwd_ms", "bwd_ms", "GF/s_all",
              "GF/s_cmp", "cmp/all", "sgemm");
  for (int th : a.threads) {
    const double peak = sgemm_gflops(th);
    for (const std::string& spec : a.patterns) {
      const bool linear = spec.rfind("linear:", 0) == 0;
      sparse::Pattern p;
      if (!linear) p = sparse::Pattern::parse(spec);
      for (int64_t L : bench_lengths(spec, linear, a.lengths)) bench_spec(a, spec, p, linear, L, th, peak);
    }
    if (a.dense)
      for (int64_t L : a.lengths) bench_dense(a, L, th, peak);
  }
}

void add_sparse_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("sparse-bench", "Time sparse / linear attention (a program, not a test)");
  static SparseBenchArgs a;
  cmd->add_option("--pattern", a.patterns,
                  "pattern specs (2-D patterns fix L), or linear:elu / linear:favor+ [/causal]");
  cmd->add_option("--L", a.lengths, "sequence lengths (ignored for 2-D patterns)");
  cmd->add_option("--threads", a.threads, "thread counts (0 = SATTN_NUM_THREADS or all cores)")->check(thread_range());
  cmd->add_option("--B", a.B, "batch");
  cmd->add_option("--H", a.H, "heads");
  cmd->add_option("--D", a.D, "head dim");
  cmd->add_option("--reps", a.reps, "repetitions (median)");
  cmd->add_flag("--backward", a.backward, "also time the backward");
  cmd->add_option("--clock", a.clock_kind,
                  "wall, or thread (CPU time of the calling thread: less sensitive to other load; 1 thread only, "
                  "run with OPENBLAS_NUM_THREADS=1 for the SGEMM column)")
      ->check(CLI::IsMember({"wall", "thread"}));
  cmd->add_flag("--dense", a.dense, "also time dense exact attention (the registry's fused kernel) at each L");
  cmd->add_option("--dtype", a.dtype,
                  "f32, bf16 or f16: q, k, v, the outputs and the gradients (bf16 takes the bf16 products where "
                  "the CPU has them, forward and backward)")
      ->capture_default_str();
  cmd->add_option("--float32-precision", a.float32_precision,
                  "highest or bf16 (float32 inputs on the bf16 products where the CPU has them, forward and "
                  "backward); high runs as highest here")
      ->capture_default_str();
  cmd->callback([] { run_sparse_bench(a); });
}

}  // namespace

void add_sparse_command(CLI::App& app) {
  add_sparse_run(app);
  add_sparse_bench(app);
}

}  // namespace sattn::cli
