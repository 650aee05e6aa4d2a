// `sattn ring`: ring attention over MPI (sattn::dist), timed. Run under mpirun: each rank makes its shard of
// q, k, v from a seed (every element a hash of its global position), so no rank ever holds the whole sequence;
// --check compares with a single-process run of the fused kernel on rank 0.
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <string>
#include <vector>

#include "cli/bench_timing.hpp"
#include "cli/commands.hpp"
#include "sattn/error.hpp"
#ifdef SATTN_HAVE_MPI
#include <nlohmann/json.hpp>

#include "sattn/attention.hpp"
#include "sattn/dist.hpp"
#endif

namespace sattn::cli {

namespace {

struct RingConfig {
  int64_t L = 16384, batch = 1, heads = 8, kv_heads = 0, dim = 64;
  bool causal = false, backward = false, check = false, json = false;
  std::string layout = "contiguous", dtype = "f32";
  int threads = 1, reps = 3;
  uint64_t seed = 0;
};

#ifdef SATTN_HAVE_MPI

// A value in [-1, 1) from (seed, tensor, b, h, global row, d): the same on every rank and in --check's whole run.
float element(uint64_t seed, uint64_t tensor, int64_t b, int64_t h, int64_t row, int64_t d) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (tensor << 56) ^ (uint64_t(b) << 48) ^ (uint64_t(h) << 40) ^
               (uint64_t(row) << 12) ^ uint64_t(d);
  x ^= x >> 30, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 27, x *= 0x94D049BB133111EBull, x ^= x >> 31;  // splitmix64
  return float(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

// Rows given by `segs` (all rows of the whole sequence when segs is one segment of length L).
Tensor make_rows(const RingConfig& c, uint64_t tensor, int64_t heads, int64_t width,
                 const std::vector<dist::Segment>& segs, DType dtype) {
  int64_t len = 0;
  for (const auto& s : segs) len += s.length;
  Tensor t(DType::kF32, {c.batch, heads, len, width});
  float* p = t.data<float>();
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (const auto& s : segs)
        for (int64_t i = 0; i < s.length; ++i)
          for (int64_t d = 0; d < width; ++d)
            p[((b * heads + h) * len + s.local_start + i) * width + d] =
                element(c.seed, tensor, b, h, s.global_start + s.stride * i, d);
  return dtype == DType::kF32 ? t : t.to(dtype);
}

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0;
}

// Seconds of one ring pass that only moves the blocks (no attention): the communication the ring has to hide.
double exchange_only_seconds(MPI_Comm comm, int64_t bytes) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (size == 1) return 0.0;
  std::vector<char> a(static_cast<size_t>(bytes)), b(static_cast<size_t>(bytes));
  MPI_Barrier(comm);
  const auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step + 1 < size; ++step) {
    for (int64_t off = 0; off < bytes; off += int64_t(1) << 30) {
      const int n = int(std::min<int64_t>(int64_t(1) << 30, bytes - off));
      MPI_Sendrecv(a.data() + off, n, MPI_BYTE, (rank + 1) % size, 3, b.data() + off, n, MPI_BYTE,
                   (rank - 1 + size) % size, 3, comm, MPI_STATUS_IGNORE);
    }
    std::swap(a, b);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Sharded {
  Tensor q, k, v, dout, out, lse, dq, dk, dv;
};

// The largest relative error (‖got − ref‖∞ / max(1, ‖ref‖∞)) of this rank's rows against the whole run's.
double shard_error(const Tensor& got, const Tensor& whole, const std::vector<dist::Segment>& segs) {
  const Tensor g = got.to(DType::kF32), w = whole.to(DType::kF32);
  const int64_t L = w.shape()[2], len = g.shape()[2], X = w.dim() == 4 ? w.shape()[3] : 1;
  const int64_t BH = w.shape()[0] * w.shape()[1];
  double e = 0, m = 1;
  for (int64_t bh = 0; bh < BH; ++bh)
    for (const auto& s : segs)
      for (int64_t i = 0; i < s.length; ++i)
        for (int64_t x = 0; x < X; ++x) {
          const double a = g.data<float>()[(bh * len + s.local_start + i) * X + x];
          const double r = w.data<float>()[(bh * L + s.global_start + s.stride * i) * X + x];
          if (std::isinf(a) && a == r) continue;
          e = std::isfinite(a - r) ? std::max(e, std::fabs(a - r)) : INFINITY;
          if (std::isfinite(r)) m = std::max(m, std::fabs(r));
        }
  return e / m;
}

// Broadcasts rank 0's tensor (float32 copy) to every rank.
Tensor broadcast_f32(const Tensor& t, const Shape& shape, MPI_Comm comm, int rank) {
  Tensor r = rank == 0 ? t.to(DType::kF32) : Tensor(DType::kF32, shape);
  for (int64_t off = 0; off < r.numel(); off += int64_t(1) << 28)
    MPI_Bcast(r.data<float>() + off, int(std::min<int64_t>(int64_t(1) << 28, r.numel() - off)), MPI_FLOAT, 0, comm);
  return r;
}

// --check: rank 0 runs the fused kernel on the whole sequence and sends the results to every rank, which compares
// its rows; the largest error over the ranks.
double check_against_whole(const RingConfig& c, const Sharded& s, const dist::RingOptions& o,
                           const std::vector<dist::Segment>& segs, DType dtype, MPI_Comm comm, int rank) {
  const std::vector<dist::Segment> all{{0, c.L, 0, 1}};
  const Shape qs{c.batch, c.heads, c.L, c.dim}, ks{c.batch, c.kv_heads, c.L, c.dim};
  Tensor out, lse, dq, dk, dv;
  if (rank == 0) {
    const Tensor q = make_rows(c, 0, c.heads, c.dim, all, dtype), k = make_rows(c, 1, c.kv_heads, c.dim, all, dtype);
    const Tensor v = make_rows(c, 2, c.kv_heads, c.dim, all, dtype);
    AttentionOptions w;
    w.kernel = "fused";
    w.causal = o.causal ? Causal::kTopLeft : Causal::kNone;
    w.num_threads = o.num_threads;
    out = Tensor(dtype, qs), lse = Tensor(DType::kF32, {c.batch, c.heads, c.L});
    scaled_dot_product_attention(q, k, v, w, {out.view(), lse.view(), {}});
    if (c.backward) {
      const Tensor dout = make_rows(c, 3, c.heads, c.dim, all, dtype);
      dq = Tensor(dtype, qs), dk = Tensor(dtype, ks), dv = Tensor(dtype, ks);
      scaled_dot_product_attention_backward(dout, q, k, v, out, lse, w, {dq.view(), dk.view(), dv.view(), {}});
    }
  }
  double err = std::max(shard_error(s.out, broadcast_f32(out, qs, comm, rank), segs),
                        shard_error(s.lse, broadcast_f32(lse, {c.batch, c.heads, c.L}, comm, rank), segs));
  if (c.backward)
    err = std::max({err, shard_error(s.dq, broadcast_f32(dq, qs, comm, rank), segs),
                    shard_error(s.dk, broadcast_f32(dk, ks, comm, rank), segs),
                    shard_error(s.dv, broadcast_f32(dv, ks, comm, rank), segs)});
  MPI_Allreduce(MPI_IN_PLACE, &err, 1, MPI_DOUBLE, MPI_MAX, comm);
  return err;
}

void run_ring(RingConfig c) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided);
    std::atexit([] {
      int finalized = 0;
      MPI_Finalized(&finalized);
      if (!finalized) MPI_Finalize();
    });
  }
  MPI_Comm comm = MPI_COMM_WORLD;
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (c.kv_heads == 0) c.kv_heads = c.heads;
  const dist::Layout layout = dist::parse_layout(c.layout, "--layout");
  check(c.dtype == "f32" || c.dtype == "bf16", ErrorKind::kInvalidArgument, "--dtype: expected f32 or bf16, got ",
        c.dtype);
  const DType dtype = c.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  const int64_t parts = layout == dist::Layout::kZigzag ? 2 * int64_t(size) : int64_t(size);
  check(c.L % parts == 0 || layout == dist::Layout::kContiguous, ErrorKind::kInvalidArgument,
        "--L: ", dist::to_string(layout), " with ", size, " ranks needs L divisible by ", parts, ", got ", c.L);
  check(!c.check || c.L <= 16384, ErrorKind::kInvalidArgument,
        "--check: runs the whole sequence in one process, so it needs L <= 16384, got ", c.L);
  std::vector<int64_t> lengths;
  for (int r = 0; r < size; ++r) lengths.push_back(c.L / size + (r < c.L % size ? 1 : 0));
  const auto segs = dist::shard_segments(layout, rank, lengths);
  const int64_t Ls = lengths[size_t(rank)];
  Sharded s;
  s.q = make_rows(c, 0, c.heads, c.dim, segs, dtype);
  s.k = make_rows(c, 1, c.kv_heads, c.dim, segs, dtype);
  s.v = make_rows(c, 2, c.kv_heads, c.dim, segs, dtype);
  s.out = Tensor(dtype, {c.batch, c.heads, Ls, c.dim});
  s.lse = Tensor(DType::kF32, {c.batch, c.heads, Ls});
  if (c.backward) {
    s.dout = make_rows(c, 3, c.heads, c.dim, segs, dtype);
    s.dq = Tensor(dtype, s.q.shape()), s.dk = Tensor(dtype, s.k.shape()), s.dv = Tensor(dtype, s.v.shape());
  }
  dist::RingOptions o;
  o.layout = layout, o.causal = c.causal, o.num_threads = c.threads, o.seed = c.seed;

  std::vector<double> fwd_t, bwd_t, fwd_wait, bwd_wait;
  dist::RingStats fs, bs;
  for (int rep = 0; rep < c.reps; ++rep) {
    MPI_Barrier(comm);
    dist::ring_attention(s.q, s.k, s.v, o, comm, s.out, s.lse, &fs);
    double t = fs.seconds, w = 0;
    for (double x : fs.wait_seconds) w += x;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm);  // the ring is as slow as its slowest rank
    MPI_Allreduce(MPI_IN_PLACE, &w, 1, MPI_DOUBLE, MPI_MAX, comm);
    fwd_t.push_back(t), fwd_wait.push_back(w);
    if (!c.backward) continue;
    MPI_Barrier(comm);
    dist::ring_attention_backward(s.dout, s.q, s.k, s.v, s.out, s.lse, o, comm, s.dq, s.dk, s.dv, &bs);
    t = bs.seconds, w = 0;
    for (double x : bs.wait_seconds) w += x;
    MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, comm);
    MPI_Allreduce(MPI_IN_PLACE, &w, 1, MPI_DOUBLE, MPI_MAX, comm);
    bwd_t.push_back(t), bwd_wait.push_back(w);
  }
  const int64_t esize = int64_t(dtype_size(dtype)), max_len = *std::max_element(lengths.begin(), lengths.end());
  const int64_t block_bytes = c.batch * c.kv_heads * max_len * 2 * c.dim * esize;
  double comm_alone = exchange_only_seconds(comm, block_bytes);
  MPI_Allreduce(MPI_IN_PLACE, &comm_alone, 1, MPI_DOUBLE, MPI_MAX, comm);
  double rss = peak_rss_bytes(), sent = double(fs.bytes_sent + (c.backward ? bs.bytes_sent : 0));
  std::vector<double> all_rss(static_cast<size_t>(size));
  MPI_Gather(&rss, 1, MPI_DOUBLE, all_rss.data(), 1, MPI_DOUBLE, 0, comm);
  MPI_Allreduce(MPI_IN_PLACE, &sent, 1, MPI_DOUBLE, MPI_MAX, comm);
  const double err = c.check ? check_against_whole(c, s, o, segs, dtype, comm, rank) : -1.0;
  if (rank != 0) {
    if (c.check && !(err <= (dtype == DType::kF32 ? 1e-5 : 2e-2))) throw CLI::RuntimeError(1);
    return;
  }
  // Model of the per-rank memory the ring needs (bytes): local q, k, v, out, lse, two K/V blocks; the backward
  // adds dout, dq, dk, dv, the float32 dq accumulator, two travelling float32 dK/dV blocks and the step's dK/dV.
  const double rows = double(c.batch) * double(max_len), d = double(c.dim);
  const double qo = rows * c.heads * d * esize, kv = rows * c.kv_heads * d * esize;
  double model = 2 * qo + 2 * kv + rows * c.heads * 4 + (size > 1 ? 2 : 1) * 2 * kv;
  if (c.backward)
    model += 2 * qo + 2 * kv + rows * c.heads * d * 4 + ((size > 1 ? 2 : 1) + 1) * 2 * rows * c.kv_heads * d * 4;
  const double flops = 4.0 * double(c.batch) * double(c.heads) * double(c.L) * double(c.L) * d * (c.causal ? 0.5 : 1.0);
  const double tf = median(fwd_t), tb = median(bwd_t);
  const double wf = median(fwd_wait), wb = median(bwd_wait);
  nlohmann::json j = {{"ranks", size},
                      {"L", c.L},
                      {"batch", c.batch},
                      {"heads", c.heads},
                      {"kv_heads", c.kv_heads},
                      {"dim", c.dim},
                      {"causal", c.causal},
                      {"layout", c.layout},
                      {"dtype", c.dtype},
                      {"threads_per_rank", c.threads},
                      {"reps", c.reps},
                      {"forward_seconds", tf},
                      {"forward_gflops", flops / tf / 1e9},
                      {"forward_gflops_per_rank", flops / tf / 1e9 / size},
                      {"forward_exposed_wait_seconds", wf},
                      {"exchange_alone_seconds", comm_alone},
                      {"bytes_sent_per_rank", sent},
                      {"peak_rss_bytes", all_rss},
                      {"memory_model_bytes", model}};
  if (c.backward)
    j.update(
        {{"backward_seconds", tb}, {"backward_gflops", 2.5 * flops / tb / 1e9}, {"backward_exposed_wait_seconds", wb}});
  if (c.check) j["check_max_rel_err"] = err;
  if (c.json) {
    std::cout << j.dump(1) << "\n";
  } else {
    std::cout << std::setprecision(4) << "ring attention: " << size << " ranks, " << c.layout << ", L " << c.L << ", B "
              << c.batch << ", H " << c.heads << "/" << c.kv_heads << ", D " << c.dim << (c.causal ? ", causal" : "")
              << ", " << c.dtype << ", " << c.threads << " thread(s) per rank, median of " << c.reps << "\n"
              << "  forward:  " << tf << " s, " << flops / tf / 1e9 << " GFLOP/s (" << flops / tf / 1e9 / size
              << " per rank), exposed wait " << wf << " s (" << wf / size << " s per step)\n";
    if (c.backward)
      std::cout << "  backward: " << tb << " s, " << 2.5 * flops / tb / 1e9 << " GFLOP/s, exposed wait " << wb
                << " s\n";
    std::cout << "  moving the K/V blocks alone takes " << comm_alone << " s per pass; bytes sent per rank " << sent
              << "\n  peak RSS per rank (MiB):";
    for (double x : all_rss) std::cout << " " << x / 1048576.0;
    std::cout << "; memory model " << model / 1048576.0 << " MiB\n";
    if (c.check) std::cout << "  check against one process: max rel err " << err << "\n";
  }
  if (c.check && !(err <= (dtype == DType::kF32 ? 1e-5 : 2e-2))) throw CLI::RuntimeError(1);
}

#endif  // SATTN_HAVE_MPI

}  // namespace

void add_ring_command(CLI::App& app) {
  auto cfg = std::make_shared<RingConfig>();
  auto* cmd = app.add_subcommand(
      "ring",
      "Ring attention over MPI, timed: run as `mpirun -np P sattn ring ...`; each rank makes its shard of "
      "q, k, v from --seed");
  cmd->add_option("--L", cfg->L, "global sequence length")->check(CLI::Range(int64_t(1), int64_t(1) << 31));
  cmd->add_option("--batch", cfg->batch, "batch size")->check(CLI::Range(1, 4096));
  cmd->add_option("--heads", cfg->heads, "query heads")->check(CLI::Range(1, 4096));
  cmd->add_option("--kv-heads", cfg->kv_heads, "key/value heads (GQA; default: --heads)")->check(CLI::Range(0, 4096));
  cmd->add_option("--dim", cfg->dim, "head dimension")->check(CLI::Range(1, 1024));
  cmd->add_flag("--causal", cfg->causal, "causal (top-left on the global positions)");
  cmd->add_option("--layout", cfg->layout, "contiguous | zigzag (L divisible by 2P) | striped (L divisible by P)");
  cmd->add_option("--dtype", cfg->dtype, "f32 | bf16");
  cmd->add_flag("--backward", cfg->backward, "also run and time the backward");
  cmd->add_option("--threads", cfg->threads, "threads per rank (0 = SATTN_NUM_THREADS or all cores)")
      ->check(CLI::Range(0, 1024));
  cmd->add_option("--reps", cfg->reps, "timed repetitions (the median is reported)")->check(CLI::Range(1, 1000));
  cmd->add_option("--seed", cfg->seed, "seed of the inputs (and of nothing else: no dropout here)");
  cmd->add_flag("--check", cfg->check,
                "compare every rank's results with one process's fused kernel on the whole sequence (L <= 16384); "
                "exit 1 when the max relative error exceeds 1e-5 (f32) or 2e-2 (bf16)");
  cmd->add_flag("--json", cfg->json, "print one JSON object instead of text");
  cmd->callback([cfg] {
#ifdef SATTN_HAVE_MPI
    run_ring(*cfg);
#else
    fail(ErrorKind::kUnsupported, "this sattn was built without MPI (apt-get install libopenmpi-dev, then rebuild)");
#endif
  });
}

}  // namespace sattn::cli
