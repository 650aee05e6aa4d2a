// Ring attention against the single-process fused kernel on the gathered sequence, run under
// `mpirun -np P` (ctest: P = 1..4). Every rank builds the whole problem from the same seed, takes its shard as the
// layout defines it, runs the ring, and compares its shard of the ring's results with its shard of the fused
// kernel's results on the whole sequence: forward (out, lse) and backward (dq, dk, dv), every layout, causal or
// not, GQA, unequal shards, key lengths, dropout, float32 and bfloat16. Then: bitwise identical results for 1 and
// 3 threads per rank, and wrong arguments on one rank raising on every rank. Exit status 0 only if every rank
// passed everything.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sattn/attention.hpp"
#include "sattn/dist.hpp"

namespace {

using sattn::DType;
using sattn::Tensor;
using sattn::TensorView;
using sattn::dist::Layout;

int g_rank = 0, g_size = 1, g_failures = 0;

void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "[rank %d] FAILED: %s\n", g_rank, what.c_str());
}

Tensor random_tensor(std::mt19937& rng, sattn::Shape shape, float amp) {
  Tensor t(DType::kF32, std::move(shape));
  std::normal_distribution<float> nd(0.f, amp);
  for (int64_t x = 0; x < t.numel(); ++x) t.data<float>()[x] = nd(rng);
  return t;
}

// This rank's rows of a whole [B, H, L, X] (or [B, H, L]) tensor, as `segs` define them.
Tensor shard_of(const Tensor& whole, const std::vector<sattn::dist::Segment>& segs) {
  const Tensor w = whole.to(DType::kF32);
  sattn::Shape shape = w.shape();
  int64_t len = 0;
  for (const auto& s : segs) len += s.length;
  const int64_t L = shape[2], X = shape.size() == 4 ? shape[3] : 1, BH = shape[0] * shape[1];
  shape[2] = len;
  Tensor out(DType::kF32, shape);
  for (int64_t bh = 0; bh < BH; ++bh)
    for (const auto& s : segs)
      for (int64_t t = 0; t < s.length; ++t)
        std::memcpy(out.data<float>() + (bh * len + s.local_start + t) * X,
                    w.data<float>() + (bh * L + s.global_start + s.stride * t) * X, size_t(X) * sizeof(float));
  return out;
}

// ‖got − ref‖∞ / max(1, ‖ref‖∞), -inf matching -inf (tests/python/sdpa_reference.py's max_rel_err).
double rel_err(const Tensor& got, const Tensor& ref) {
  const Tensor g = got.to(DType::kF32), r = ref.to(DType::kF32);
  double e = 0, m = 1;
  for (int64_t x = 0; x < g.numel(); ++x) {
    const double a = g.data<float>()[x], b = r.data<float>()[x];
    if (std::isinf(a) || std::isinf(b)) {
      if (a != b) return INFINITY;
      continue;
    }
    if (std::isnan(a) || std::isnan(b)) return INFINITY;
    e = std::max(e, std::fabs(a - b));
    m = std::max(m, std::fabs(b));
  }
  return e / m;
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

struct Config {
  Layout layout = Layout::kContiguous;
  bool causal = false, lengths = false;
  int64_t Hq = 4, Hkv = 4;
  double dropout = 0;
  DType dtype = DType::kF32;
  bool long_shards = false;  // shards of three backward pieces (an eighth of a shard, >= 256 rows), B = 1
  std::string name() const {
    return sattn::message::concat(to_string(layout), causal ? " causal" : "", " H", Hq, "/", Hkv,
                                  lengths ? " key_lengths" : "", dropout > 0 ? " dropout" : "", " ",
                                  sattn::to_string(dtype), long_shards ? " long shards" : "");
  }
};

struct Results {
  Tensor out, lse, dq, dk, dv;
};

// Every rank's shard length under `layout` (contiguous: unequal ones).
std::vector<int64_t> shard_lengths(Layout layout, bool long_shards) {
  std::vector<int64_t> lengths;
  for (int r = 0; r < g_size; ++r)
    lengths.push_back(long_shards ? (layout == Layout::kContiguous ? 600 + 13 * r : 610)
                                  : (layout == Layout::kContiguous ? 45 + 13 * r : 74));
  return lengths;
}

struct Problem {
  Config c;
  int64_t B = 2, L = 0, D = 32, Dv = 24;
  Tensor q, k, v, dout, key_lengths;
  std::vector<sattn::dist::Segment> segs;
  sattn::dist::RingOptions ring;
  sattn::AttentionOptions whole;
};

Problem make_problem(const Config& c, uint32_t seed) {
  Problem p;
  p.c = c;
  const auto lengths = shard_lengths(c.layout, c.long_shards);
  if (c.long_shards) p.B = 1;
  for (int64_t n : lengths) p.L += n;
  p.segs = sattn::dist::shard_segments(c.layout, g_rank, lengths);
  std::mt19937 rng(seed);  // the same whole problem on every rank
  p.q = random_tensor(rng, {p.B, c.Hq, p.L, p.D}, 1.5f);
  p.k = random_tensor(rng, {p.B, c.Hkv, p.L, p.D}, 1.5f);
  p.v = random_tensor(rng, {p.B, c.Hkv, p.L, p.Dv}, 1.f);
  p.dout = random_tensor(rng, {p.B, c.Hq, p.L, p.Dv}, 1.f);
  if (c.dtype != DType::kF32) {
    p.q = p.q.to(c.dtype), p.k = p.k.to(c.dtype), p.v = p.v.to(c.dtype), p.dout = p.dout.to(c.dtype);
  }
  p.ring.layout = c.layout;
  p.ring.causal = c.causal;
  p.ring.dropout_p = c.dropout;
  p.ring.seed = 77 + seed;
  p.ring.num_threads = 1;
  if (c.lengths) {
    p.key_lengths = Tensor(DType::kI64, {p.B});
    p.key_lengths.data<int64_t>()[0] = p.L - 29;
    if (p.B > 1) p.key_lengths.data<int64_t>()[1] = p.L / 3;
    p.ring.key_lengths = p.key_lengths.view();
  }
  p.whole.kernel = "fused";
  p.whole.strict = true;
  p.whole.causal = c.causal ? sattn::Causal::kTopLeft : sattn::Causal::kNone;
  p.whole.dropout_p = c.dropout;
  p.whole.seed = p.ring.seed;
  p.whole.key_lengths = p.ring.key_lengths;
  p.whole.num_threads = 1;
  return p;
}

Results run_whole(const Problem& p) {
  Results r;
  r.out = Tensor(p.c.dtype, {p.B, p.c.Hq, p.L, p.Dv});
  r.lse = Tensor(DType::kF32, {p.B, p.c.Hq, p.L});
  sattn::scaled_dot_product_attention(p.q, p.k, p.v, p.whole, {r.out.view(), r.lse.view(), {}});
  r.dq = Tensor(p.c.dtype, p.q.shape()), r.dk = Tensor(p.c.dtype, p.k.shape()), r.dv = Tensor(p.c.dtype, p.v.shape());
  sattn::scaled_dot_product_attention_backward(p.dout, p.q, p.k, p.v, r.out, r.lse, p.whole,
                                               {r.dq.view(), r.dk.view(), r.dv.view(), {}});
  return r;
}

Results run_ring(const Problem& p, int threads) {
  sattn::dist::RingOptions o = p.ring;
  o.num_threads = threads;
  const Tensor q = shard_of(p.q, p.segs).to(p.c.dtype), k = shard_of(p.k, p.segs).to(p.c.dtype);
  const Tensor v = shard_of(p.v, p.segs).to(p.c.dtype), dout = shard_of(p.dout, p.segs).to(p.c.dtype);
  Results r;
  r.out = Tensor(p.c.dtype, {p.B, p.c.Hq, q.shape()[2], p.Dv});
  r.lse = Tensor(DType::kF32, {p.B, p.c.Hq, q.shape()[2]});
  sattn::dist::ring_attention(q, k, v, o, MPI_COMM_WORLD, r.out, r.lse);
  r.dq = Tensor(p.c.dtype, q.shape()), r.dk = Tensor(p.c.dtype, k.shape()), r.dv = Tensor(p.c.dtype, v.shape());
  sattn::dist::ring_attention_backward(dout, q, k, v, r.out, r.lse, o, MPI_COMM_WORLD, r.dq, r.dk, r.dv);
  return r;
}

void check_config(const Config& c, uint32_t seed) {
  const Problem p = make_problem(c, seed);
  const Results whole = run_whole(p);
  const Results ring = run_ring(p, 1);
  const double tol = c.dtype == DType::kF32 ? 1e-5 : 2e-2;
  const std::pair<const char*, std::pair<const Tensor*, const Tensor*>> parts[] = {{"out", {&ring.out, &whole.out}},
                                                                                   {"lse", {&ring.lse, &whole.lse}},
                                                                                   {"dq", {&ring.dq, &whole.dq}},
                                                                                   {"dk", {&ring.dk, &whole.dk}},
                                                                                   {"dv", {&ring.dv, &whole.dv}}};
  for (const auto& [name, t] : parts) {
    const double e = rel_err(*t.first, shard_of(*t.second, p.segs));
    expect(e <= tol, sattn::message::concat(c.name(), ": ", name, " max rel err ", e, " > ", tol));
  }
}

void check_thread_independence() {
  Config c;
  c.layout = Layout::kZigzag, c.causal = true, c.dropout = 0.1, c.Hkv = 2;
  const Problem p = make_problem(c, 5);
  const Results a = run_ring(p, 1), b = run_ring(p, 3);
  expect(bitwise_equal(a.out, b.out) && bitwise_equal(a.lse, b.lse), "forward: 1 vs 3 threads differ");
  expect(bitwise_equal(a.dq, b.dq) && bitwise_equal(a.dk, b.dk) && bitwise_equal(a.dv, b.dv),
         "backward: 1 vs 3 threads differ");
  const Results again = run_ring(p, 1);
  expect(bitwise_equal(a.out, again.out) && bitwise_equal(a.dk, again.dk), "two runs differ");
}

// One rank's wrong argument raises on every rank, naming the rank and the argument.
void check_errors() {
  Config c;
  const Problem p = make_problem(c, 9);
  const Tensor q = shard_of(p.q, p.segs), k = shard_of(p.k, p.segs), v = shard_of(p.v, p.segs);
  const int64_t Ls = q.shape()[2];
  const bool bad = g_rank == g_size - 1;
  Tensor out(DType::kF32, {p.B, c.Hq, bad ? Ls + 1 : Ls, p.Dv});
  std::string what;
  try {
    sattn::dist::ring_attention(q, k, v, p.ring, MPI_COMM_WORLD, out);
  } catch (const sattn::Error& e) {
    what = e.what();
  }
  expect(what.find(sattn::message::concat("rank ", g_size - 1, ": out: expected shape")) != std::string::npos,
         "wrong out shape on the last rank: got \"" + what + "\"");
  if (g_size < 2) return;
  sattn::dist::RingOptions o = p.ring;  // options that disagree
  o.causal = g_rank == 1;
  Tensor out2(DType::kF32, {p.B, c.Hq, Ls, p.Dv});
  what.clear();
  try {
    sattn::dist::ring_attention(q, k, v, o, MPI_COMM_WORLD, out2);
  } catch (const sattn::Error& e) {
    what = e.what();
  }
  expect(what.find("the ranks disagree on causal: rank 0 has 0, rank 1 has 1") != std::string::npos,
         "causal on one rank only: got \"" + what + "\"");
}

// Under SATTN_TEST_RING_FAULT=1:1 (rank 1 fails at step 1, after the entry check): every rank raises, in the
// forward and in the backward, at the end of that step, and says which rank failed.
void check_fault_agreement() {
  Config c;
  c.layout = Layout::kZigzag, c.causal = true;
  const Problem p = make_problem(c, 3);
  const Tensor q = shard_of(p.q, p.segs), k = shard_of(p.k, p.segs), v = shard_of(p.v, p.segs);
  Tensor out(DType::kF32, {p.B, c.Hq, q.shape()[2], p.Dv}), lse(DType::kF32, {p.B, c.Hq, q.shape()[2]});
  Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
  const std::string own = "rank 1 failed at ring step 1 (injected", other = "rank 1 failed at ring step 1 (its own";
  const std::string& want = g_rank == 1 ? own : other;
  for (bool backward : {false, true}) {
    std::string what;
    try {
      if (!backward) sattn::dist::ring_attention(q, k, v, p.ring, MPI_COMM_WORLD, out, lse);
      else sattn::dist::ring_attention_backward(out, q, k, v, out, lse, p.ring, MPI_COMM_WORLD, dq, dk, dv);
    } catch (const sattn::Error& e) {
      what = e.what();
    }
    expect(what.find(want) != std::string::npos,
           sattn::message::concat(backward ? "backward" : "forward", ": expected \"", want, "\", got \"", what, "\""));
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  uint32_t seed = 0;
  int configs = 0;
  const bool fault_mode = argc > 1 && std::string(argv[1]) == "--fault";
  if (fault_mode) {  // run with SATTN_TEST_RING_FAULT=1:1 and >= 2 ranks
    check_fault_agreement();
    int failures = g_failures;
    MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (g_rank == 0)
      std::printf("ring attention, %d ranks: fault agreement %s\n", g_size, failures ? "FAILED" : "passed");
    MPI_Finalize();
    return failures == 0 ? 0 : 1;
  }
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped})
    for (bool causal : {false, true})
      for (int variant = 0; variant < 5; ++variant) {
        Config c;
        c.layout = layout, c.causal = causal;
        if (variant == 1 || variant == 3) c.Hkv = variant == 1 ? 2 : 1, c.lengths = true;  // GQA/MQA + key lengths
        if (variant == 2) c.dropout = 0.25;
        if (variant >= 3) c.dtype = DType::kBF16;
        if (variant == 4) c.dropout = 0.1;
        try {
          check_config(c, ++seed);
        } catch (const std::exception& e) {
          expect(false, c.name() + ": threw " + e.what());
        }
        ++configs;
      }
  for (Layout layout : {Layout::kContiguous, Layout::kStriped}) {  // the backward's query side in pieces
    Config c;
    c.layout = layout, c.causal = true, c.long_shards = true, c.Hq = 2, c.Hkv = 1, c.lengths = true, c.dropout = 0.1;
    try {
      check_config(c, ++seed);
    } catch (const std::exception& e) {
      expect(false, c.name() + ": threw " + e.what());
    }
    ++configs;
  }
  check_thread_independence();
  check_errors();
  int failures = g_failures;
  MPI_Allreduce(MPI_IN_PLACE, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("ring attention, %d ranks: %d configurations, forward and backward, thread independence, errors: %s\n",
                g_size, configs, failures == 0 ? "passed" : "FAILED");
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
