// The fused kernel against the reference (fp64 accumulation) over awkward shapes and every option, for every
// SIMD implementation the CPU supports (including the portable one), and bitwise determinism across threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <array>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/workspace.hpp"
#include "kernels/fused/fused.hpp"
#include "scoped.hpp"
#include "sattn/attention.hpp"
#include "sattn/merge.hpp"

namespace {

using sattn::DType;
using sattn::Shape;
using sattn::Tensor;
using sattn::TensorView;

struct Case {
  int64_t B = 1, Hq = 1, Hkv = 1, Lq = 1, Lk = 1, D = 8, Dv = 8;
  int mask = 0;        // 0 none, 1 bool, 2 additive
  int mask_shape = 0;  // 0 [B,Hq,Lq,Lk], 1 [Lq,Lk], 2 [B,1,1,Lk], 3 [Hq,Lq,1]
  int padding = 0;     // 0 none, 1 bool, 2 lengths
  sattn::Causal causal = sattn::Causal::kNone;
  double dropout = 0.0;
  bool strided = false;                            // q/k/v as [B, L, H, D] memory viewed as [B, H, L, D]
  int64_t q_offset = 0, k_offset = 0, stride = 1;  // global positions (AttentionOptions::query_offset, ...)
  std::string name() const {
    return sattn::message::concat("B", B, " H", Hq, "/", Hkv, " L", Lq, "x", Lk, " D", D, "/", Dv, " mask", mask, ":",
                                  mask_shape, " pad", padding, " causal=", sattn::to_string(causal), " drop", dropout,
                                  strided ? " strided" : "", " pos ", q_offset, "/", k_offset, "/", stride);
  }
};

// A [B, H, L, D] float view; when strided, backed by [B, L, H, D] memory.
struct Input {
  Tensor storage;
  TensorView view;
};

Input random_input(std::mt19937& rng, int64_t B, int64_t H, int64_t L, int64_t D, bool strided, float amp = 1.f) {
  std::normal_distribution<float> nd(0.f, amp);
  Input in;
  if (strided) {
    in.storage = Tensor(DType::kF32, {B, L, H, D});
    in.view = TensorView(in.storage.data(), DType::kF32, {B, H, L, D}, {L * H * D, D, H * D, 1});
  } else {
    in.storage = Tensor(DType::kF32, {B, H, L, D});
    in.view = in.storage.view();
  }
  float* p = in.storage.data<float>();
  for (int64_t x = 0; x < in.storage.numel(); ++x) p[x] = nd(rng);
  return in;
}

struct Problem {
  Case c;
  Input q, k, v, dout;
  Tensor mask, kpm, lengths;
  sattn::AttentionOptions opt;
};

Problem make_problem(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Problem pb;
  pb.c = c;
  pb.q = random_input(rng, c.B, c.Hq, c.Lq, c.D, c.strided, 1.5f);
  pb.k = random_input(rng, c.B, c.Hkv, c.Lk, c.D, c.strided, 1.5f);
  pb.v = random_input(rng, c.B, c.Hkv, c.Lk, c.Dv, c.strided);
  pb.dout = random_input(rng, c.B, c.Hq, c.Lq, c.Dv, false);
  if (c.mask) {
    Shape s;
    switch (c.mask_shape) {
      case 0: s = {c.B, c.Hq, c.Lq, c.Lk}; break;
      case 1: s = {c.Lq, c.Lk}; break;
      case 2: s = {c.B, 1, 1, c.Lk}; break;
      default: s = {c.Hq, c.Lq, 1}; break;
    }
    pb.mask = Tensor(c.mask == 1 ? DType::kBool : DType::kF32, s);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    const int64_t n = pb.mask.numel(), last = s.back();
    for (int64_t x = 0; x < n; ++x) {
      const bool first_row = x < last;  // make the first mask row fully masked (an empty row when 2-D/4-D)
      const bool masked = (first_row && c.mask_shape <= 1) || u(rng) < 0.2f;
      if (c.mask == 1) pb.mask.data<uint8_t>()[x] = masked ? 0 : 1;
      else pb.mask.data<float>()[x] = masked ? -std::numeric_limits<float>::infinity() : 2.f * (u(rng) - 0.5f);
    }
    pb.opt.attn_mask = pb.mask.view();
  }
  if (c.padding == 1) {
    pb.kpm = Tensor(DType::kBool, {c.B, c.Lk});
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (int64_t x = 0; x < pb.kpm.numel(); ++x) pb.kpm.data<uint8_t>()[x] = u(rng) < 0.3f;
    if (c.Lk > 70)  // a whole key tile of padding in batch 0
      for (int64_t j = 0; j < 64 && j < c.Lk; ++j) pb.kpm.data<uint8_t>()[j] = 1;
    pb.opt.key_padding_mask = pb.kpm.view();
  } else if (c.padding == 2) {
    pb.lengths = Tensor(DType::kI64, {c.B});
    for (int64_t b = 0; b < c.B; ++b)
      pb.lengths.data<int64_t>()[b] = c.k_offset + c.stride * (b == 1 ? 0 : std::max<int64_t>(1, c.Lk - 5 - 37 * b));
    pb.opt.key_lengths = pb.lengths.view();
  }
  pb.opt.query_offset = c.q_offset, pb.opt.key_offset = c.k_offset, pb.opt.position_stride = c.stride;
  pb.opt.causal = c.causal;
  pb.opt.dropout_p = c.dropout;
  pb.opt.seed = 1234 + seed;
  return pb;
}

// q, k and v of a problem rounded to dt: `in` reads them in dt, `up` reads the same values in float32. The tensors
// live in the struct (the problems' views point into their buffers); `edit` may change q, k, v before the upcast.
struct RoundedInputs {
  Tensor q, k, v, qf, kf, vf;
  Problem in, up;
};
template <class Edit>
RoundedInputs rounded_inputs(const Problem& pb, DType dt, Edit&& edit) {
  RoundedInputs r{Tensor::from_view(pb.q.view).to(dt),
                  Tensor::from_view(pb.k.view).to(dt),
                  Tensor::from_view(pb.v.view).to(dt),
                  {},
                  {},
                  {},
                  pb,
                  pb};
  edit(r.q, r.k, r.v);
  r.qf = r.q.to(DType::kF32), r.kf = r.k.to(DType::kF32), r.vf = r.v.to(DType::kF32);
  r.in.q.view = r.q.view(), r.in.k.view = r.k.view(), r.in.v.view = r.v.view();
  r.up.q.view = r.qf.view(), r.up.k.view = r.kf.view(), r.up.v.view = r.vf.view();
  return r;
}
RoundedInputs rounded_inputs(const Problem& pb, DType dt) {
  return rounded_inputs(pb, dt, [](Tensor&, Tensor&, Tensor&) {});
}

double max_abs(const Tensor& t) {
  double m = 0;
  const auto v = t.view();
  for (int64_t x = 0; x < t.numel(); ++x) {
    const double a = std::fabs(v.dtype == DType::kF64 ? t.data<double>()[x] : t.data<float>()[x]);
    if (std::isfinite(a)) m = std::max(m, a);
  }
  return m;
}

// Calls f(a, b) on the pairs of elements of got and ref (as double) that are finite in both; false where an
// infinity does not match exactly or a NaN appears.
template <class F>
bool for_finite_pairs(const Tensor& got, const Tensor& ref, F&& f) {
  EXPECT_EQ(got.numel(), ref.numel());
  const Tensor g = got.to(DType::kF64), r = ref.to(DType::kF64);
  for (int64_t x = 0; x < g.numel(); ++x) {
    const double a = g.data<double>()[x], b = r.data<double>()[x];
    if (std::isinf(b) || std::isinf(a)) {
      if (a != b) return false;
      continue;
    }
    if (std::isnan(a) || std::isnan(b)) return false;
    f(a, b);
  }
  return true;
}

// ‖got − ref‖∞ / max(1, ‖ref‖∞); -inf must match -inf exactly.
double rel_err(const Tensor& got, const Tensor& ref) {
  double e = 0;
  if (!for_finite_pairs(got, ref, [&](double a, double b) { e = std::max(e, std::fabs(a - b)); }))
    return std::numeric_limits<double>::infinity();
  return e / std::max(1.0, max_abs(ref.to(DType::kF64)));
}

// ‖got − ref‖₂ / ‖ref‖₂ over the entries finite in both (-inf must match -inf exactly, as in rel_err).
double norm_err(const Tensor& got, const Tensor& ref) {
  double num = 0, den = 0;
  if (!for_finite_pairs(got, ref, [&](double a, double b) { num += (a - b) * (a - b), den += b * b; }))
    return std::numeric_limits<double>::infinity();
  return std::sqrt(num / std::max(den, 1e-300));
}

struct FwdResult {
  Tensor out, lse;
  std::string kernel;
};

FwdResult run_forward(const Problem& pb, const std::string& kernel, int threads) {
  sattn::AttentionOptions o = pb.opt;
  o.kernel = kernel;
  o.num_threads = threads;
  o.accumulate_fp64 = kernel == "reference";
  const DType dt = kernel == "reference" ? DType::kF64 : DType::kF32;
  FwdResult r;
  r.out = Tensor(dt, {pb.c.B, pb.c.Hq, pb.c.Lq, pb.c.Dv});
  r.lse = Tensor(dt, {pb.c.B, pb.c.Hq, pb.c.Lq});
  sattn::KernelInfo info;
  sattn::scaled_dot_product_attention(pb.q.view, pb.k.view, pb.v.view, o, {r.out.view(), r.lse.view(), {}}, &info);
  r.kernel = info.kernel;
  return r;
}

// The reference's out and lse (float64) as float32, the dtype the fused backward reads them in.
FwdResult as_f32(const FwdResult& f) { return {f.out.to(DType::kF32), f.lse.to(DType::kF32), f.kernel}; }

struct BwdResult {
  Tensor dq, dk, dv, dmask;
};

// `dmask_strides`, when given, are the strides of the mask gradient's view (over the dense buffer r.dmask).
BwdResult run_backward(const Problem& pb, const FwdResult& fwd, const std::string& kernel, int threads,
                       const Shape* dmask_strides = nullptr) {
  sattn::AttentionOptions o = pb.opt;
  o.kernel = kernel;
  o.num_threads = threads;
  o.accumulate_fp64 = kernel == "reference";
  const DType dt = kernel == "reference" ? DType::kF64 : DType::kF32;
  BwdResult r;
  r.dq = Tensor(dt, pb.q.view.shape);
  r.dk = Tensor(dt, pb.k.view.shape);
  r.dv = Tensor(dt, pb.v.view.shape);
  sattn::AttentionGrads g{r.dq.view(), r.dk.view(), r.dv.view(), {}};
  if (pb.c.mask == 2) {
    r.dmask = Tensor(dt, pb.mask.shape());
    g.dmask = dmask_strides ? TensorView(r.dmask.data(), dt, pb.mask.shape(), *dmask_strides) : r.dmask.view();
  }
  sattn::scaled_dot_product_attention_backward(pb.dout.view, pb.q.view, pb.k.view, pb.v.view, fwd.out.view(),
                                               fwd.lse.view(), o, g);
  return r;
}

// dq, dk, dv (and dmask, when the reference has one) within `tol` of the reference's (rel_err).
void expect_grads_near(const BwdResult& got, const BwdResult& ref, double tol = 1e-4) {
  EXPECT_LE(rel_err(got.dq, ref.dq), tol);
  EXPECT_LE(rel_err(got.dk, ref.dk), tol);
  EXPECT_LE(rel_err(got.dv, ref.dv), tol);
  if (ref.dmask.data() != nullptr) {
    EXPECT_LE(rel_err(got.dmask, ref.dmask), tol);
  }
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

std::vector<Case> sweep() {
  using sattn::Causal;
  std::vector<Case> cs;
  // Shapes around the 64x64 tile, narrower query tiles (Lq 7, 27, 33, 129, 200) and, without causality, the larger
  // ones of short sequences in 8 tasks (Lq 65: 80 rows, 197: 208), odd D/Dv, Lq != Lk, GQA/MQA; the one-pass backward
  // with one key group, in one task per (b, kv head) or in query chunks (Lq 1100: 9 of them).
  const int64_t shapes[][7] = {
      {1, 1, 1, 1, 1, 8, 8},       {1, 2, 2, 7, 129, 16, 24},   {2, 4, 2, 65, 63, 17, 9},     {1, 2, 1, 64, 64, 64, 64},
      {1, 3, 1, 129, 130, 80, 80}, {2, 2, 2, 63, 200, 5, 33},   {1, 1, 1, 200, 65, 128, 128}, {3, 2, 1, 33, 47, 1, 3},
      {2, 2, 1, 27, 90, 24, 40},   {1, 2, 1, 1100, 50, 64, 48}, {2, 4, 2, 197, 70, 16, 24},
  };
  const Causal causals[] = {Causal::kNone, Causal::kTopLeft, Causal::kBottomRight};
  int n = 0;
  for (const auto& s : shapes) {
    for (int variant = 0; variant < 6; ++variant, ++n) {
      Case c;
      c.B = s[0], c.Hq = s[1], c.Hkv = s[2], c.Lq = s[3], c.Lk = s[4], c.D = s[5], c.Dv = s[6];
      c.causal = causals[(n + variant) % 3];
      c.mask = variant % 3;
      c.mask_shape = (n / 3) % 4;
      c.padding = (n / 2) % 3;
      c.strided = variant == 4 || variant == 1;
      c.dropout = variant == 5 ? 0.3 : 0.0;
      if (c.causal != Causal::kBottomRight && (variant == 2 || variant == 5)) {  // a shard of a longer sequence
        c.stride = 1 + n % 3;
        c.q_offset = (n * 37) % 150, c.k_offset = (n * 53) % 150;
      }
      cs.push_back(c);
    }
  }
  return cs;
}

class FusedSweep : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const auto avail = sattn::testing::simd_target_names();
    if (std::find(avail.begin(), avail.end(), GetParam()) == avail.end())
      GTEST_SKIP() << "this CPU has no " << GetParam();
    target_.emplace(GetParam());
    tiles_.emplace("SATTN_FUSED_TILE_MIN_WORK", "0");  // the bf16 products on the sweep's short keys too
  }
  void TearDown() override { tiles_.reset(), target_.reset(); }
  std::optional<sattn::testing::ScopedSimdTarget> target_;
  std::optional<sattn::testing::ScopedEnv> tiles_;
};

TEST_P(FusedSweep, ForwardAndBackwardMatchReference) {
  uint32_t seed = 0;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    const Problem pb = make_problem(c, ++seed);
    const FwdResult ref = run_forward(pb, "reference", 1);
    const FwdResult got = run_forward(pb, "fused", 2);
    ASSERT_EQ(got.kernel, "fused");
    EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
    EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
    // Backward from the reference's own out/lse (as float32) so that both start from the same statistics.
    FwdResult ref32 = as_f32(ref);
    const BwdResult gref = run_backward(pb, ref, "reference", 1);
    // Both schedules of the backward: one pass (the default) and two (what a mask's gradient takes where its dS
    // buffer would be too large)
    for (const char* schedule : {"one_pass", "two_pass"}) {
      SCOPED_TRACE(schedule);
      const sattn::testing::ScopedEnv env("SATTN_FUSED_BACKWARD", schedule);
      expect_grads_near(run_backward(pb, ref32, "fused", 2), gref);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Simd, FusedSweep, ::testing::Values("amx", "avx512bf16", "avx512", "avx2", "sse4", "portable"),
                         [](const auto& info) { return info.param; });

// The targets whose fused kernel has bf16 products: amx (tdpbf16ps tiles) and avx512bf16 (vdpbf16ps).
bool has_bf16_products(const std::string& simd) { return simd == "amx" || simd == "avx512bf16"; }

// The cases of the tests of passes over long keys (QueryBlocksShareThePassesOverLongKeys): 4 heads of Lq 300
// (20 blocks of 64, in tasks of 2, 2 and 1 per head), Lk 1500, D 64, Dv 48; variant 0: no mask; 1: GQA, causal
// bottom-right, a mask, padding; 2: strided, causal top-left, a mask; 3: GQA, Lk 2100; 4: D = Dv = 128, causal
// bottom-right, a mask; 5: GQA, causal top-left, a mask, dropout.
Case long_keys_case(int variant) {
  using sattn::Causal;
  const Causal causals[] = {Causal::kNone, Causal::kBottomRight, Causal::kTopLeft};
  Case c;
  c.B = 1, c.Hq = 4, c.Hkv = variant % 2 ? 2 : 4, c.Lq = 300, c.Lk = variant == 3 ? 2100 : 1500;
  c.D = variant == 4 ? 128 : 64, c.Dv = variant == 4 ? 128 : 48;
  c.causal = causals[variant % 3], c.mask = variant % 3, c.mask_shape = variant % 4, c.padding = variant == 1 ? 2 : 0;
  c.dropout = variant == 5 ? 0.2 : 0.0, c.strided = variant == 2;
  return c;
}

// Each head of `in` computed alone (a one-head call, so one query block per task) is bitwise the same head of
// `got`, the call on all of c.Hq heads with options o (the output's dtype that of got.out).
void expect_each_head_alone_bitwise(const Problem& in, const Case& c, const sattn::AttentionOptions& o,
                                    const FwdResult& got) {
  const auto head = [](TensorView t, int64_t h) {  // head h of t as a one-head view
    t.data = static_cast<char*>(t.data) + h * t.strides[1] * int64_t(sattn::dtype_size(t.dtype));
    t.shape[1] = 1;
    return t;
  };
  const DType out_dtype = got.out.dtype();
  const size_t out_row = size_t(c.Lq * c.Dv) * sattn::dtype_size(out_dtype), lse_row = size_t(c.Lq) * 4;
  for (int64_t h = 0; h < c.Hq; ++h) {
    Tensor out1(out_dtype, {1, 1, c.Lq, c.Dv}), lse1(DType::kF32, {1, 1, c.Lq});
    const int64_t hk = h / (c.Hq / c.Hkv);
    sattn::scaled_dot_product_attention(head(in.q.view, h), head(in.k.view, hk), head(in.v.view, hk), o,
                                        {out1.view(), lse1.view(), {}});
    EXPECT_EQ(std::memcmp(out1.data(), static_cast<const char*>(got.out.data()) + h * out_row, out_row), 0)
        << "head " << h << " alone";
    EXPECT_EQ(std::memcmp(lse1.data(), static_cast<const char*>(got.lse.data()) + h * lse_row, lse_row), 0)
        << "head " << h << " alone";
  }
}

// Keys longer than one pass of the float32 products (about 256 KiB of K and V rows: 576 keys at D 64, Dv 48, 256 at
// D = Dv = 128): a task takes the query blocks of a head in turn on each pass (4 heads of Lq 300: 20 blocks of 64, in
// tasks of 2, 2 and 1 per head), and every block computes what it would alone: the float32 tolerances against the
// fp64 reference, with masks, padding, both causal alignments (bottom-right: each block's keys end in another
// pass), dropout, GQA, strided inputs, float32 and (where the target has no bf16 products, which would take them)
// float16 inputs; bitwise the same for 1 and 3 threads, and (without masks and dropout) bitwise what each head
// computes alone (5 blocks: one per task).
TEST_P(FusedSweep, QueryBlocksShareThePassesOverLongKeys) {
  uint32_t seed = 1800;
  for (int variant = 0; variant < 6; ++variant) {
    const Case c = long_keys_case(variant);
    SCOPED_TRACE(c.name());
    const Problem pb = make_problem(c, ++seed);
    for (const DType in_dtype : {DType::kF32, DType::kF16}) {
      if (in_dtype == DType::kF16 && has_bf16_products(GetParam())) continue;
      SCOPED_TRACE(sattn::to_string(in_dtype));
      const RoundedInputs r = rounded_inputs(pb, in_dtype);
      const Problem& in = in_dtype == DType::kF32 ? pb : r.in;  // float32: the case's own (strided) layout
      const FwdResult ref = run_forward(in_dtype == DType::kF32 ? pb : r.up, "reference", 1);
      sattn::AttentionOptions o = in.opt;
      o.kernel = "fused";
      const auto forward = [&](int threads) {
        o.num_threads = threads;
        FwdResult f{Tensor(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv}), Tensor(DType::kF32, {c.B, c.Hq, c.Lq}), ""};
        sattn::scaled_dot_product_attention(in.q.view, in.k.view, in.v.view, o, {f.out.view(), f.lse.view(), {}});
        return f;
      };
      const FwdResult got = forward(1), got3 = forward(3);
      EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
      EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
      EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
      if (c.mask != 0 || c.padding != 0 || c.dropout > 0) continue;
      expect_each_head_alone_bitwise(in, c, o, got);
    }
  }
}

// The sweep with bf16 inputs on the bf16 products of each target that has them, forward and backward, against
// the fp64 reference on the same (rounded) values, with the float32 tolerances; bitwise the same for 1 and 3
// threads.
class FusedBf16Products : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const auto avail = sattn::testing::simd_target_names();
    if (std::find(avail.begin(), avail.end(), GetParam()) == avail.end())
      GTEST_SKIP() << "this CPU does not run " << GetParam() << " ("
                   << (GetParam() == "amx" ? sattn::simd::amx_unavailable_reason() : "no AVX512-BF16")
                   << "): its bf16 products are not tested here";
    target_.emplace(GetParam());
    tiles_.emplace("SATTN_FUSED_TILE_MIN_WORK", "0");  // the bf16 products on the sweep's short keys too
  }
  void TearDown() override { tiles_.reset(), target_.reset(); }
  std::optional<sattn::testing::ScopedSimdTarget> target_;
  std::optional<sattn::testing::ScopedEnv> tiles_;
};

TEST_P(FusedBf16Products, MatchReference) {
  uint32_t seed = 500;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    const Problem pb = make_problem(c, ++seed);
    RoundedInputs r = rounded_inputs(pb, DType::kBF16);
    Problem &in = r.in, &up = r.up;
    // dO in bf16 too for every other case (then dP = V dO^T is a bf16 product as well)
    const Tensor dout = Tensor::from_view(pb.dout.view).to(seed % 2 ? DType::kBF16 : DType::kF32);
    const Tensor doutf = dout.to(DType::kF32);
    in.dout.view = dout.view(), up.dout.view = doutf.view();
    const FwdResult ref = run_forward(up, "reference", 1);
    const FwdResult got = run_forward(in, "fused", 1);
    EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
    EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
    const FwdResult got3 = run_forward(in, "fused", 3);
    EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
    // Backward from the reference's out/lse, as in the float32 sweep.
    const FwdResult ref32 = as_f32(ref);
    const BwdResult gref = run_backward(up, ref, "reference", 1);
    const BwdResult g1 = run_backward(in, ref32, "fused", 1);
    expect_grads_near(g1, gref);
    const BwdResult g3 = run_backward(in, ref32, "fused", 3);
    EXPECT_TRUE(bitwise_equal(g1.dq, g3.dq) && bitwise_equal(g1.dk, g3.dk) && bitwise_equal(g1.dv, g3.dv));
  }
}

// NaN exactly where `want` has NaN; the other values equal, or within tol of the largest finite |want| (at least 1).
bool same_nans_and_close(const Tensor& got, const Tensor& want, double tol) {
  const Tensor g = got.to(DType::kF64), w = want.to(DType::kF64);
  double scale = 1.0;
  for (int64_t x = 0; x < w.numel(); ++x)
    if (std::isfinite(w.data<double>()[x])) scale = std::max(scale, std::fabs(w.data<double>()[x]));
  for (int64_t x = 0; x < g.numel(); ++x) {
    const double a = g.data<double>()[x], b = w.data<double>()[x];
    if (std::isnan(a) != std::isnan(b) || (!std::isnan(b) && a != b && !(std::fabs(a - b) <= tol * scale)))
      return false;
  }
  return true;
}

// A float16 or float32 [B, H, L, D] tensor's values with their elements two apart (a last-dimension stride of 2; NaN
// between them).
Input spread_rows(const Tensor& t) {
  const int64_t B = t.shape()[0], H = t.shape()[1], L = t.shape()[2], D = t.shape()[3];
  Input in;
  in.storage = Tensor(t.dtype(), {B, H, L, 2 * D});
  const auto spread = [&](auto* dst, const auto* src, auto nan) {
    for (int64_t r = 0; r < B * H * L; ++r)
      for (int64_t x = 0; x < D; ++x) dst[r * 2 * D + 2 * x] = src[r * D + x], dst[r * 2 * D + 2 * x + 1] = nan;
  };
  if (t.dtype() == DType::kF32)
    spread(in.storage.data<float>(), t.data<float>(), std::numeric_limits<float>::quiet_NaN());
  else spread(static_cast<uint16_t*>(in.storage.data()), static_cast<const uint16_t*>(t.data()), uint16_t(0x7E00u));
  in.view = TensorView(in.storage.data(), t.dtype(), {B, H, L, D}, {H * L * 2 * D, L * 2 * D, 2 * D, 2});
  return in;
}

// float16 inputs: the amx forward takes each value as two bf16 (hi + lo, exact), the avx512bf16 build the float32
// products; either way the float32 tolerances against the fp64 reference on the same values, and bitwise the same
// for 1 and 3 threads. With an infinity in q, k or v the forward takes the float32 products (the parts' products
// would meet inf · 0): bitwise what the float32 inputs give; a NaN makes NaN where the float32 products do.
TEST_P(FusedBf16Products, Float16InputsMatchReference) {
  uint32_t seed = 700;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    const Problem pb = make_problem(c, ++seed);
    const RoundedInputs r = rounded_inputs(pb, DType::kF16);
    const Problem &in = r.in, &up = r.up;
    const FwdResult ref = run_forward(up, "reference", 1);
    const FwdResult got = run_forward(in, "fused", 1);
    EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
    EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
    const FwdResult got3 = run_forward(in, "fused", 3);
    EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
    if (c.strided) {  // elements two apart (NaN between them): the same values packed, the same results
      const Input qs = spread_rows(r.q), ks = spread_rows(r.k), vs = spread_rows(r.v);
      Problem sp = in;
      sp.q.view = qs.view, sp.k.view = ks.view, sp.v.view = vs.view;
      const FwdResult got_s = run_forward(sp, "fused", 1);
      EXPECT_TRUE(bitwise_equal(got.out, got_s.out) && bitwise_equal(got.lse, got_s.lse));
    }
  }
  Case c;
  c.Hq = 2, c.Hkv = 2, c.Lq = 70, c.Lk = 81, c.D = 24, c.Dv = 40;
  for (int which = 0; which < 6; ++which) {
    const bool nan = which >= 3;
    SCOPED_TRACE(std::string(nan ? "a NaN in " : "an infinity in ") + "qkv"[which % 3]);
    const RoundedInputs r = rounded_inputs(make_problem(c, 9), DType::kF16, [&](Tensor& q, Tensor& k, Tensor& v) {
      Tensor* t[3] = {&q, &k, &v};
      static_cast<uint16_t*>(t[which % 3]->data())[77] = nan ? 0x7E00u : 0xFC00u;  // NaN or -inf
    });
    const FwdResult got = run_forward(r.in, "fused", 1);
    const sattn::testing::ScopedSimdTarget float32_products("avx512");
    const FwdResult want = run_forward(r.up, "fused", 1);
    if (!nan) {
      EXPECT_TRUE(bitwise_equal(got.out, want.out) && bitwise_equal(got.lse, want.lse));
    }
    EXPECT_TRUE(same_nans_and_close(got.out, want.out, 2e-5) && same_nans_and_close(got.lse, want.lse, 2e-5));
  }
}

// float32 inputs under Float32Precision::kHigh: the amx forward takes each value as two bf16 parts, as it takes
// float16 inputs (decode, Lq <= 4, excepted), with three part products (the two lo parts' product dropped), and so
// does the amx backward: S^T = K Q^T and dP^T = V dO^T, and in its one pass also dV, dK and dQ with P' and dS in
// two parts (in the two-pass schedule those three are the float32 products). Float32 inputs holding bf16 values
// split into themselves and zero: bitwise the bf16 inputs' results (float32 out; the gradients, from a bf16 dO,
// in the two-pass schedule). Full float32 values come within kHighTol (out, lse) and kHighGradTol (dq, dk, dv, the
// mask's gradient) of the fp64 reference: the parts carry about 16 significant bits, 2^-17 relative per operand, 128
// times float32's 2^-24. Measured on this sweep: out and lse up to 4.0e-5; the
// gradients 7e-6 to 6.2e-5, but dq 1.1e-4 where D = 1 and the gradient of a mask broadcast over the keys 4.0e-4 (that
// sum of dS over a row cancels to about 0; the float32 products' own error there is 1.6e-5, 25 times their usual); the
// float32 products' tolerances are 2e-5 forward and 1e-4 backward, bf16's 1e-2 and 3e-2. Not as the float32 products
// (the parts ran); bitwise the same for 1 and 3 threads. The avx512bf16 build runs the float32 products: bitwise
// kHighest. So does a pass whose q, k or v (or dO, backward) holds a value the parts cannot carry (an infinity, a NaN,
// a float32 that rounds past bf16's largest value), and so does a backward whose dO is not float32.
constexpr double kHighTol = 1e-4, kHighGradTol = 1e-3;

double max_grad_err(const BwdResult& got, const BwdResult& ref) {
  double e = std::max({rel_err(got.dq, ref.dq), rel_err(got.dk, ref.dk), rel_err(got.dv, ref.dv)});
  if (ref.dmask.data() != nullptr) e = std::max(e, rel_err(got.dmask, ref.dmask));
  return e;
}
bool grads_bitwise_equal(const BwdResult& a, const BwdResult& b) {
  return bitwise_equal(a.dq, b.dq) && bitwise_equal(a.dk, b.dk) && bitwise_equal(a.dv, b.dv) &&
         (a.dmask.data() == nullptr || bitwise_equal(a.dmask, b.dmask));
}

TEST_P(FusedBf16Products, Float32HighTakesTwoBf16Parts) {
  const bool amx = GetParam() == "amx";
  uint32_t seed = 1700;
  double worst = 0, worst_grad = 0;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    Problem pb = make_problem(c, ++seed);
    const FwdResult ref = run_forward(pb, "reference", 1);
    const FwdResult highest = run_forward(pb, "fused", 1);
    const BwdResult ghighest = run_backward(pb, as_f32(ref), "fused", 1);
    pb.opt.float32_precision = sattn::Float32Precision::kHigh;
    const FwdResult got = run_forward(pb, "fused", 1), got3 = run_forward(pb, "fused", 3);
    EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
    const BwdResult g = run_backward(pb, as_f32(ref), "fused", 1), g3 = run_backward(pb, as_f32(ref), "fused", 3);
    EXPECT_TRUE(grads_bitwise_equal(g, g3));
    if (!amx) {
      EXPECT_TRUE(bitwise_equal(got.out, highest.out) && bitwise_equal(got.lse, highest.lse));
      EXPECT_TRUE(grads_bitwise_equal(g, ghighest));
      continue;
    }
    const double e = std::max(rel_err(got.out, ref.out), rel_err(got.lse, ref.lse));
    worst = std::max(worst, e);
    EXPECT_LE(e, kHighTol);
    const double eg = max_grad_err(g, run_backward(pb, ref, "reference", 1));
    worst_grad = std::max(worst_grad, eg);
    EXPECT_LE(eg, kHighGradTol);
    if (max_abs(ghighest.dk) > 0) {  // (not every score masked)
      EXPECT_FALSE(grads_bitwise_equal(g, ghighest));
    }
    const bool decode = c.Lq <= 4;  // the forward's decode: the float32 products (their own path for float16 inputs)
    if (!decode && max_abs(highest.out) > 0) {
      EXPECT_FALSE(bitwise_equal(got.out, highest.out));
    }
    if (c.strided) {  // elements two apart (NaN between them): the same values split, the same results
      const Tensor qc = Tensor::from_view(pb.q.view), kc = Tensor::from_view(pb.k.view),
                   vc = Tensor::from_view(pb.v.view);
      const Input qs = spread_rows(qc), ks = spread_rows(kc), vs = spread_rows(vc);
      Problem sp = pb;
      sp.q.view = qs.view, sp.k.view = ks.view, sp.v.view = vs.view;
      const FwdResult got_s = run_forward(sp, "fused", 1);
      EXPECT_TRUE(bitwise_equal(got.out, got_s.out) && bitwise_equal(got.lse, got_s.lse));
      EXPECT_TRUE(grads_bitwise_equal(g, run_backward(sp, as_f32(ref), "fused", 1)));
    }
    // bf16 values (dO too), as bf16 and as float32
    RoundedInputs r = rounded_inputs(pb, DType::kBF16);
    const Tensor dout = pb.dout.storage.to(DType::kBF16), doutf = dout.to(DType::kF32);
    r.in.dout.view = dout.view(), r.up.dout.view = doutf.view();
    if (!decode) {
      const FwdResult from_bf16 = run_forward(r.in, "fused", 1), from_f32 = run_forward(r.up, "fused", 1);
      EXPECT_TRUE(bitwise_equal(from_bf16.out, from_f32.out) && bitwise_equal(from_bf16.lse, from_f32.lse));
    }
    // the two-pass schedule: S and dP on the parts, dV, dK and dQ on the float32 products (P' and dS not split)
    const sattn::testing::ScopedEnv two_pass("SATTN_FUSED_BACKWARD", "two_pass");
    EXPECT_TRUE(
        grads_bitwise_equal(run_backward(r.in, as_f32(ref), "fused", 1), run_backward(r.up, as_f32(ref), "fused", 1)));
    const BwdResult t1 = run_backward(pb, as_f32(ref), "fused", 1);
    EXPECT_LE(max_grad_err(t1, run_backward(pb, ref, "reference", 1)), kHighGradTol);
    EXPECT_TRUE(grads_bitwise_equal(t1, run_backward(pb, as_f32(ref), "fused", 3)));
  }
  if (amx)
    std::printf(
        "float32_precision high: worst error against the fp64 reference %.3g forward (tolerance %g), %.3g "
        "backward (tolerance %g)\n",
        worst, kHighTol, worst_grad, kHighGradTol);
  Case c;
  c.Hq = 2, c.Hkv = 2, c.Lq = 70, c.Lk = 81, c.D = 24, c.Dv = 40;
  for (int which = 0; which < 12; ++which) {
    const uint32_t bits[3] = {0x7F7F8000u, 0xFF800000u, 0x7FC00000u};  // rounds to bf16's infinity, -inf, NaN
    char what[64];
    std::snprintf(what, sizeof what, "value bits 0x%08X in %s", unsigned(bits[which % 3]),
                  std::array{"q", "k", "v", "dO"}[which / 3]);
    SCOPED_TRACE(what);
    Problem pb = make_problem(c, 9);
    Tensor* t[4] = {&pb.q.storage, &pb.k.storage, &pb.v.storage, &pb.dout.storage};  // (not strided: storage = view)
    std::memcpy(static_cast<float*>(t[which / 3]->data()) + 77, &bits[which % 3], sizeof(uint32_t));
    const FwdResult highest = run_forward(pb, "fused", 1);
    const BwdResult ghighest = run_backward(pb, highest, "fused", 1);
    pb.opt.float32_precision = sattn::Float32Precision::kHigh;
    if (which < 9) {  // (dO: the forward does not read it)
      const FwdResult got = run_forward(pb, "fused", 1);
      EXPECT_TRUE(bitwise_equal(got.out, highest.out) && bitwise_equal(got.lse, highest.lse));
    }
    EXPECT_TRUE(grads_bitwise_equal(run_backward(pb, highest, "fused", 1), ghighest));
  }
  // a dO of another dtype than the float32 inputs': the backward's float32 products (bitwise kHighest)
  for (const DType dt : {DType::kF64, DType::kBF16, DType::kF16}) {
    SCOPED_TRACE("dO in " + std::string(sattn::to_string(dt)));
    Problem pb = make_problem(c, 10);
    const Tensor dout = pb.dout.storage.to(dt);
    pb.dout.view = dout.view();
    const FwdResult f = run_forward(pb, "fused", 1);
    const BwdResult ghighest = run_backward(pb, f, "fused", 1);
    pb.opt.float32_precision = sattn::Float32Precision::kHigh;
    EXPECT_TRUE(grads_bitwise_equal(run_backward(pb, f, "fused", 1), ghighest));
  }
}

// float32_precision "high" in the one-pass backward over several groups of key blocks (each task a group, dQ summed
// over the groups' partials; the sweep's keys fit one group): within kHighGradTol of the fp64 reference, not the
// "highest" bits on amx (bitwise them on avx512bf16), and bitwise the same for 1 and 3 threads. GQA, D = Dv = 128
// (16 key blocks a group), full and causal, with and without a float mask's gradient.
TEST_P(FusedBf16Products, Float32HighBackwardOverKeyGroups) {
  const bool amx = GetParam() == "amx";
  for (int variant = 0; variant < 3; ++variant) {
    Case c;
    c.B = 1, c.Hq = 4, c.Hkv = 2, c.Lq = 300, c.Lk = 1500, c.D = c.Dv = 128;
    if (variant == 1) c.causal = sattn::Causal::kTopLeft;
    if (variant == 2) c.mask = 2, c.mask_shape = 1;
    SCOPED_TRACE(c.name());
    Problem pb = make_problem(c, 60 + variant);
    const FwdResult ref = run_forward(pb, "reference", 2);
    const BwdResult gref = run_backward(pb, ref, "reference", 2);
    const BwdResult highest = run_backward(pb, as_f32(ref), "fused", 2);
    pb.opt.float32_precision = sattn::Float32Precision::kHigh;
    const BwdResult g1 = run_backward(pb, as_f32(ref), "fused", 1), g3 = run_backward(pb, as_f32(ref), "fused", 3);
    EXPECT_TRUE(grads_bitwise_equal(g1, g3));
    EXPECT_LE(max_grad_err(g1, gref), kHighGradTol);
    EXPECT_EQ(grads_bitwise_equal(g1, highest), !amx);
  }
}

// bf16 inputs whose out, dq, dk and dv are stored in bf16 too (as PyTorch returns them): there the bf16 products
// take P (forward) and P', dS (backward) rounded to bf16 once, as FlashAttention does, an error of the size of
// the outputs' own rounding. Against the fp64 reference on the same bf16 values (rel_err; the rounding of the exact
// result to bf16 alone gives up to 2^-9 = 2e-3): out within 1e-2 (measured up to 5.2e-3), dq, dk, dv within the oracle
// harness's bf16 tolerance 3e-2 (its backward sweeps allow 5 times that; measured up to 2.2e-2, dk of a D = 1 case,
// where dS·q cancels); bitwise the same for 1 and 3 threads. Additive masks without their gradient, so that the
// backward takes its one pass.
constexpr double kBf16OutTol = 1e-2, kBf16GradTol = 3e-2;
constexpr double kAmxAgreementTol = 6e-3, kAmxAgreementNormTol = 2e-3;  // measured 3.0e-3, 7e-4

TEST_P(FusedBf16Products, Bf16OutputsRoundPAndDsOnce) {
  uint32_t seed = 900;
  double worst_fwd = 0, worst_bwd = 0;
  int differs = 0, grads_differ = 0;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    const Problem pb = make_problem(c, ++seed);
    const Tensor q = Tensor::from_view(pb.q.view).to(DType::kBF16), k = Tensor::from_view(pb.k.view).to(DType::kBF16),
                 v = Tensor::from_view(pb.v.view).to(DType::kBF16), dout = pb.dout.storage.to(DType::kBF16);
    Problem up = pb;
    const Tensor qf = q.to(DType::kF32), kf = k.to(DType::kF32), vf = v.to(DType::kF32), doutf = dout.to(DType::kF32);
    up.q.view = qf.view(), up.k.view = kf.view(), up.v.view = vf.view(), up.dout.view = doutf.view();
    up.c.mask = c.mask == 2 ? 0 : c.mask;  // run_backward: no mask gradient (the mask itself stays)
    const FwdResult ref = run_forward(up, "reference", 1);
    const BwdResult gref = run_backward(up, ref, "reference", 1);
    sattn::AttentionOptions o = pb.opt;
    o.kernel = "fused";
    const auto forward = [&](int threads) {
      o.num_threads = threads;
      FwdResult r{Tensor(DType::kBF16, {c.B, c.Hq, c.Lq, c.Dv}), Tensor(DType::kF32, {c.B, c.Hq, c.Lq}), ""};
      sattn::scaled_dot_product_attention(q, k, v, o, {r.out.view(), r.lse.view(), {}});
      return r;
    };
    const auto backward = [&](const FwdResult& f, int threads) {
      o.num_threads = threads;
      BwdResult g{
          Tensor(DType::kBF16, q.shape()), Tensor(DType::kBF16, k.shape()), Tensor(DType::kBF16, v.shape()), {}};
      sattn::scaled_dot_product_attention_backward(dout, q, k, v, f.out, f.lse, o,
                                                   {g.dq.view(), g.dk.view(), g.dv.view(), {}});
      return g;
    };
    const FwdResult got = forward(1);
    worst_fwd = std::max(worst_fwd, rel_err(got.out, ref.out));
    EXPECT_LE(rel_err(got.out, ref.out), kBf16OutTol);
    EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
    const FwdResult got3 = forward(3);
    EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
    // The backward from the reference's out (rounded to bf16, as a bf16 forward returns it) and lse.
    const FwdResult ref16{ref.out.to(DType::kBF16), ref.lse.to(DType::kF32), ""};
    const BwdResult g1 = backward(ref16, 1);
    const struct {
      const char* name;
      const Tensor &got, &ref;
    } grads[] = {{"dq", g1.dq, gref.dq}, {"dk", g1.dk, gref.dk}, {"dv", g1.dv, gref.dv}};
    for (const auto& g : grads) {
      worst_bwd = std::max(worst_bwd, rel_err(g.got, g.ref));
      EXPECT_LE(rel_err(g.got, g.ref), kBf16GradTol) << g.name;
    }
    const BwdResult g3 = backward(ref16, 3);
    EXPECT_TRUE(bitwise_equal(g1.dq, g3.dq) && bitwise_equal(g1.dk, g3.dk) && bitwise_equal(g1.dv, g3.dv));
    // The same inputs with a float32 out (P in two bf16 parts), rounded to bf16 afterwards, are not what the rounded
    // products give: they did run.
    Problem in = pb;
    in.q.view = q.view(), in.k.view = k.view(), in.v.view = v.view();
    differs += !bitwise_equal(got.out, run_forward(in, "fused", 1).out.to(DType::kBF16));
    in.dout.view = dout.view(), in.c.mask = up.c.mask;
    const BwdResult g32 = run_backward(in, ref16, "fused", 1);
    grads_differ += !bitwise_equal(g1.dk, g32.dk.to(DType::kBF16));
  }
  EXPECT_GT(differs, 0);
  EXPECT_GT(grads_differ, 0);
  std::printf("bf16 outputs on %s: worst rel_err forward %.3g, backward %.3g\n", GetParam().c_str(), worst_fwd,
              worst_bwd);
}

// bf16 inputs and bf16 dq, dk, dv with an additive mask whose gradient is wanted (float32 here): dV, dK and dQ stay
// on the float32 products (PyTorch's bf16 SDPA runs its float32 math backend there, and with P' and dS rounded once
// the gradients pass twice its error: docs/fused.md). So dq, dk, dv are bitwise the float32 gradients of the same
// inputs rounded once to bf16, within kBf16GradTol of the fp64 reference; dmask bitwise the same and within the float32
// sweep's 1e-4; everything bitwise the same for 1 and 3 threads.
TEST_P(FusedBf16Products, Bf16GradientsStayOnFloat32ProductsWhereTheMaskHasAGradient) {
  uint32_t seed = 1100;
  int cases = 0;
  for (const Case& c : sweep()) {
    if (c.mask != 2) continue;
    SCOPED_TRACE(c.name());
    ++cases;
    const Problem pb = make_problem(c, ++seed);
    RoundedInputs r = rounded_inputs(pb, DType::kBF16);
    const Tensor dout = pb.dout.storage.to(DType::kBF16), doutf = dout.to(DType::kF32);
    r.in.dout.view = dout.view(), r.up.dout.view = doutf.view();
    // The backward from the reference's out and lse as float32 (a bf16 out would move Di = rowsum(dO ∘ O) away
    // from the reference's by its rounding, which the mask's gradient shows at 1e-3).
    const FwdResult ref = run_forward(r.up, "reference", 1);
    const FwdResult ref32 = as_f32(ref);
    const BwdResult gref = run_backward(r.up, ref, "reference", 1);
    sattn::AttentionOptions o = pb.opt;
    o.kernel = "fused";
    const auto backward = [&](int threads) {
      o.num_threads = threads;
      BwdResult g{Tensor(DType::kBF16, r.q.shape()), Tensor(DType::kBF16, r.k.shape()),
                  Tensor(DType::kBF16, r.v.shape()), Tensor(DType::kF32, pb.mask.shape())};
      sattn::scaled_dot_product_attention_backward(dout, r.q, r.k, r.v, ref32.out, ref32.lse, o,
                                                   {g.dq.view(), g.dk.view(), g.dv.view(), g.dmask.view()});
      return g;
    };
    const BwdResult g1 = backward(1);
    EXPECT_LE(rel_err(g1.dq, gref.dq), kBf16GradTol);
    EXPECT_LE(rel_err(g1.dk, gref.dk), kBf16GradTol);
    EXPECT_LE(rel_err(g1.dv, gref.dv), kBf16GradTol);
    EXPECT_LE(rel_err(g1.dmask, gref.dmask), 1e-4);
    const BwdResult g3 = backward(3);
    EXPECT_TRUE(bitwise_equal(g1.dq, g3.dq) && bitwise_equal(g1.dk, g3.dk) && bitwise_equal(g1.dv, g3.dv) &&
                bitwise_equal(g1.dmask, g3.dmask));
    const BwdResult g32 = run_backward(r.in, ref32, "fused", 1);  // float32 dq, dk, dv and dmask
    EXPECT_TRUE(bitwise_equal(g1.dmask, g32.dmask));
    EXPECT_TRUE(bitwise_equal(g1.dq, g32.dq.to(DType::kBF16)) && bitwise_equal(g1.dk, g32.dk.to(DType::kBF16)) &&
                bitwise_equal(g1.dv, g32.dv.to(DType::kBF16)));
  }
  EXPECT_GT(cases, 0);
}

// Long key ranges on the bf16 products: the amx forward sums the P of up to pv_keys() keys into O^T at once and
// moves a row's max only when a tile's scores exceed it by more than kLazyMax. Keys whose scores grow along the
// sequence move the max by small and large steps; a masked run of whole key tiles (skipped) splits a slab's keys;
// the lengths cross slabs of 256 keys and end on an odd key. float32 out (P in two bf16 parts) within the float32
// sweep's 2e-5, bf16 out within kBf16OutTol; bitwise the same for 1 and 3 threads.
TEST_P(FusedBf16Products, LongKeyRunsAndARisingMax) {
  uint32_t seed = 1300;
  for (const int64_t Lk : {333, 700}) {
    Case c;
    c.B = 2, c.Hq = 2, c.Hkv = 1, c.Lq = 40, c.Lk = Lk, c.D = 64, c.Dv = 48, c.mask = 1, c.mask_shape = 2;
    SCOPED_TRACE(c.name());
    Problem pb = make_problem(c, ++seed);
    float* kd = pb.k.storage.data<float>();  // batch 0 (one kv head): scores growing along the keys
    for (int64_t j = 0; j < Lk; ++j)
      for (int64_t x = 0; x < c.D; ++x) kd[j * c.D + x] *= 1.f + 5.f * float(j) / float(Lk);
    uint8_t* keep = pb.mask.data<uint8_t>();
    for (int64_t j = 0; j < Lk; ++j) {
      keep[j] = (j / 37) % 4 != 1 && keep[j] ? 1 : 0;  // batch 0: runs of 37 masked keys
      keep[Lk + j] = j < 64 || j >= 192;               // batch 1: keys [64, 192) masked, two whole tiles skipped
    }
    const Tensor q = Tensor::from_view(pb.q.view).to(DType::kBF16), k = Tensor::from_view(pb.k.view).to(DType::kBF16),
                 v = Tensor::from_view(pb.v.view).to(DType::kBF16);
    Problem up = pb;
    const Tensor qf = q.to(DType::kF32), kf = k.to(DType::kF32), vf = v.to(DType::kF32);
    up.q.view = qf.view(), up.k.view = kf.view(), up.v.view = vf.view();
    const FwdResult ref = run_forward(up, "reference", 1);
    for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
      sattn::AttentionOptions o = pb.opt;
      o.kernel = "fused";
      const auto forward = [&](int threads) {
        o.num_threads = threads;
        FwdResult r{Tensor(out_dtype, {c.B, c.Hq, c.Lq, c.Dv}), Tensor(DType::kF32, {c.B, c.Hq, c.Lq}), ""};
        sattn::scaled_dot_product_attention(q, k, v, o, {r.out.view(), r.lse.view(), {}});
        return r;
      };
      const FwdResult got = forward(1), got3 = forward(3);
      EXPECT_LE(rel_err(got.out, ref.out), out_dtype == DType::kF32 ? 2e-5 : kBf16OutTol)
          << sattn::to_string(out_dtype);
      EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5) << sattn::to_string(out_dtype);
      EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
    }
  }
}

// The float32 forward's online softmax over scores that grow along the keys (up to about 20x: the running max moves
// in most key blocks, by a lot, and O^T is rescaled each time) with runs of masked keys, and over flat scores with
// whole skipped tiles, both causal alignments and key lengths that end in a partial block; on every SIMD
// implementation, the float32 tolerance against the fp64 reference and bitwise the same for 1 and 3 threads.
TEST(Fused, Float32RisingMaxAndSkippedTiles) {
  uint32_t seed = 1700;
  const auto simds = sattn::testing::simd_target_names();
  for (const int64_t Lk : {333, 700}) {
    for (const sattn::Causal causal : {sattn::Causal::kNone, sattn::Causal::kTopLeft, sattn::Causal::kBottomRight}) {
      Case c;
      c.B = 2, c.Hq = 2, c.Hkv = 1, c.Lq = 130, c.Lk = Lk, c.D = 48, c.Dv = 40, c.mask = 1, c.mask_shape = 2;
      c.causal = causal;
      Problem pb = make_problem(c, ++seed);
      float* kd = pb.k.storage.data<float>();  // batch 0: scores growing along the keys
      for (int64_t j = 0; j < Lk; ++j)
        for (int64_t x = 0; x < c.D; ++x) kd[j * c.D + x] *= 1.f + 20.f * float(j) / float(Lk);
      uint8_t* keep = pb.mask.data<uint8_t>();
      for (int64_t j = 0; j < Lk; ++j) {
        keep[j] = (j / 37) % 4 != 1 && keep[j] ? 1 : 0;  // batch 0: runs of 37 masked keys
        keep[Lk + j] = j < 64 || j >= 192;  // batch 1 (its max rarely moves): keys [64, 192) masked, two tiles skipped
      }
      const FwdResult ref = run_forward(pb, "reference", 1);
      for (const std::string& simd : simds) {
        SCOPED_TRACE(c.name() + " " + simd);
        const sattn::testing::ScopedSimdTarget simd_target(simd);
        const FwdResult got = run_forward(pb, "fused", 1), got3 = run_forward(pb, "fused", 3);
        EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
        EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
        EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
      }
    }
  }
}

// Keys longer than one pass of the amx forward (Params::key_pass: 4 slabs of 256 keys): its tasks take query blocks
// of a head in turn on each pass (4 heads of Lq 300: 20 blocks of 64, in tasks of 2, 2 and 1 per head), and every
// block computes what it would alone: the float32 tolerances against the fp64 reference, with masks, padding, both
// causal alignments (bottom-right: each block's keys end in another pass), dropout, GQA, strided inputs, bf16 and
// float16 inputs (the latter as two bf16 parts on amx), float32 and bf16 outputs; bitwise the same for 1 and 3
// threads, and (without masks and dropout) bitwise what each head computes alone (5 blocks: one per task).
TEST_P(FusedBf16Products, QueryBlocksShareThePassesOverLongKeys) {
  uint32_t seed = 1700;
  for (int variant = 0; variant < 6; ++variant) {
    const Case c = long_keys_case(variant);
    SCOPED_TRACE(c.name());
    const Problem pb = make_problem(c, ++seed);
    for (const DType in_dtype : {DType::kBF16, DType::kF16}) {
      const RoundedInputs r = rounded_inputs(pb, in_dtype);
      const FwdResult ref = run_forward(r.up, "reference", 1);
      for (const DType out_dtype : {DType::kF32, DType::kBF16}) {
        if (in_dtype == DType::kF16 && out_dtype == DType::kBF16) continue;
        SCOPED_TRACE(std::string(sattn::to_string(in_dtype)) + " in, " + sattn::to_string(out_dtype) + " out");
        sattn::AttentionOptions o = r.in.opt;
        o.kernel = "fused";
        const auto forward = [&](int threads) {
          o.num_threads = threads;
          FwdResult f{Tensor(out_dtype, {c.B, c.Hq, c.Lq, c.Dv}), Tensor(DType::kF32, {c.B, c.Hq, c.Lq}), ""};
          sattn::scaled_dot_product_attention(r.in.q.view, r.in.k.view, r.in.v.view, o,
                                              {f.out.view(), f.lse.view(), {}});
          return f;
        };
        const FwdResult got = forward(1), got3 = forward(3);
        EXPECT_LE(rel_err(got.out, ref.out), out_dtype == DType::kF32 ? 2e-5 : kBf16OutTol);
        EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
        EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(got.lse, got3.lse));
        if (c.mask != 0 || c.padding != 0 || c.dropout > 0) continue;
        expect_each_head_alone_bitwise(r.in, c, o, got);
      }
    }
  }
}

// float32 inputs with float32_precision="bf16" are rounded to bf16 (nearest even) as they are packed, vectorised with
// masked tails for rows of any width: forward and backward are bitwise those of inputs rounded beforehand
// (float_to_bf16), for widths that are not whole vectors (20 as the SR model's heads, 33, 17, 40, 48, 2, 1) and
// strided [B, L, H, D] inputs.
TEST_P(FusedBf16Products, Float32InputsRoundAsWhenRoundedBeforehand) {
  uint32_t seed = 1400;
  for (const auto& [D, Dv, Lq, Lk, strided] :
       {std::tuple{20, 20, 64, 64, true}, std::tuple{33, 17, 37, 75, false}, std::tuple{40, 40, 100, 130, true},
        std::tuple{64, 48, 19, 300, true}, std::tuple{2, 1, 5, 3, true}}) {
    Case c;
    c.B = 2, c.Hq = 2, c.Hkv = 2, c.Lq = Lq, c.Lk = Lk, c.D = D, c.Dv = Dv, c.strided = strided;
    SCOPED_TRACE(c.name());
    Problem pb = make_problem(c, ++seed);
    pb.opt.float32_precision = sattn::Float32Precision::kBF16;
    Problem pre = pb;  // the same layout, every stored value rounded to bf16
    Tensor qs = pb.q.storage.to(DType::kBF16).to(DType::kF32), ks = pb.k.storage.to(DType::kBF16).to(DType::kF32),
           vs = pb.v.storage.to(DType::kBF16).to(DType::kF32);
    pre.q.view.data = qs.data(), pre.k.view.data = ks.data(), pre.v.view.data = vs.data();
    const FwdResult a = run_forward(pb, "fused", 2), b = run_forward(pre, "fused", 2);
    EXPECT_TRUE(bitwise_equal(a.out, b.out) && bitwise_equal(a.lse, b.lse));
    const BwdResult ga = run_backward(pb, a, "fused", 2), gb = run_backward(pre, a, "fused", 2);
    EXPECT_TRUE(bitwise_equal(ga.dq, gb.dq) && bitwise_equal(ga.dk, gb.dk) && bitwise_equal(ga.dv, gb.dv));
  }
}

// An odd number of live keys (key_lengths) pairs the last one with a key past the length in the bf16 products:
// that key must not reach the results even when it holds inf (inf · 0 = NaN).
TEST_P(FusedBf16Products, KeysPastTheLengthAreNeverReadIntoTheRoundedProducts) {
  Case c;
  c.B = 2, c.Hq = 2, c.Hkv = 1, c.Lq = 70, c.Lk = 150, c.D = 20, c.Dv = 12, c.padding = 2;
  const Problem pb = make_problem(c, 31);  // key lengths 145 and 0
  const int64_t len = pb.lengths.data<int64_t>()[0];
  ASSERT_EQ(len % 2, 1);
  Tensor q = pb.q.storage.to(DType::kBF16), k = pb.k.storage.to(DType::kBF16), v = pb.v.storage.to(DType::kBF16);
  const Tensor dout = pb.dout.storage.to(DType::kBF16);
  sattn::AttentionOptions o = pb.opt;
  o.kernel = "fused";
  const auto run = [&](const Tensor& kk, const Tensor& vv) {
    Tensor out(DType::kBF16, {c.B, c.Hq, c.Lq, c.Dv}), lse(DType::kF32, {c.B, c.Hq, c.Lq});
    sattn::scaled_dot_product_attention(q, kk, vv, o, {out.view(), lse.view(), {}});
    BwdResult g{
        Tensor(DType::kBF16, q.shape()), Tensor(DType::kBF16, kk.shape()), Tensor(DType::kBF16, vv.shape()), {}};
    sattn::scaled_dot_product_attention_backward(dout, q, kk, vv, out, lse, o,
                                                 {g.dq.view(), g.dk.view(), g.dv.view(), {}});
    return std::make_pair(out, g);
  };
  const auto [out, g] = run(k, v);
  Tensor k_inf = k.to(DType::kBF16), v_inf = v.to(DType::kBF16);
  const uint16_t inf = 0x7F80;  // bf16 +inf
  for (int64_t j = len; j < c.Lk; ++j) {
    for (int64_t x = 0; x < c.D; ++x) k_inf.data<uint16_t>()[j * c.D + x] = inf;
    for (int64_t x = 0; x < c.Dv; ++x) v_inf.data<uint16_t>()[j * c.Dv + x] = inf;
  }
  const auto [out_inf, g_inf] = run(k_inf, v_inf);
  EXPECT_TRUE(bitwise_equal(out, out_inf));
  EXPECT_TRUE(bitwise_equal(g.dq, g_inf.dq));
  // dk, dv of the live keys (the keys past the length get 0 in both)
  EXPECT_TRUE(bitwise_equal(g.dk, g_inf.dk) && bitwise_equal(g.dv, g_inf.dv));
}

// With one key group (few keys), the backward's tasks pack each query tile, its bf16 pairs included (Q^T, dO^T and
// the row pairs of Q and dO with float32_precision="bf16"), into buffers of their own: the scratch does not grow
// with the queries. 8192 and 16384 queries over 77 keys take the same 32 query chunks; tiles in the call's buffers
// would add 128 query blocks' worth of pairs (2.9 MB) to the longer call.
TEST_P(FusedBf16Products, OneGroupBackwardPacksQueryPairsPerTask) {
  int64_t peak[2] = {0, 0};
  for (const int64_t Lq : {8192, 16384}) {
    Case c;
    c.Lq = Lq, c.Lk = 77, c.D = c.Dv = 40;
    SCOPED_TRACE(c.name());
    Problem pb = make_problem(c, 41);
    pb.opt.float32_precision = sattn::Float32Precision::kBF16;
    const FwdResult f = run_forward(pb, "fused", 2);
    sattn::fused::workspace_reset_peak();
    run_backward(pb, f, "fused", 2);
    peak[Lq == 16384] = sattn::fused::workspace_peak_bytes();
  }
  const int64_t pair_bytes_per_block = 4 * (64 * 20 + 64 * 20 + 32 * (48 + 48));  // Br = 64, D = Dv = 40
  EXPECT_LT(peak[1] - peak[0], 128 * pair_bytes_per_block / 4)
      << "scratch peak " << peak[0] << " bytes at Lq 8192, " << peak[1] << " at 16384";
}

INSTANTIATE_TEST_SUITE_P(Simd, FusedBf16Products, ::testing::Values("amx", "avx512bf16"),
                         [](const auto& info) { return info.param; });

// The amx build multiplies the avx512bf16 build's operands (the same rounding of the inputs and of P, P' and dS,
// with float32_precision="bf16" all five backward products bf16) on the tiles: only the float32 summation order
// differs (and with it, now and then, which way a value of P' or dS rounds), so the two agree more closely than
// either does with the float64 reference: norm-wise close enough to see a small systematic error in one product
// that the bf16 tolerances let through (dK off by 1 % measured 1e-2, five times the bound).
TEST(FusedAmx, AgreesWithTheAvx512Bf16BuildToFloat32Rounding) {
  const auto avail = sattn::testing::simd_target_names();
  if (std::find(avail.begin(), avail.end(), "amx") == avail.end())
    GTEST_SKIP() << "this CPU does not run amx (" << sattn::simd::amx_unavailable_reason()
                 << "): its tiles are not compared with vdpbf16ps here";
  const sattn::testing::ScopedEnv tiles("SATTN_FUSED_TILE_MIN_WORK", "0");  // the sweep's short keys too
  uint32_t seed = 1700;
  double worst = 0, worst_norm = 0;
  for (const Case& c : sweep()) {
    SCOPED_TRACE(c.name());
    Problem pb = make_problem(c, ++seed);
    pb.opt.float32_precision = sattn::Float32Precision::kBF16;
    pb.c.mask = c.mask == 2 ? 0 : c.mask;  // no mask gradient: the one-pass backward, all five products bf16
    const auto run = [&](const char* target) {
      const sattn::testing::ScopedSimdTarget scoped(target);
      FwdResult f = run_forward(pb, "fused", 2);
      BwdResult g = run_backward(pb, f, "fused", 2);
      return std::make_pair(std::move(f), std::move(g));
    };
    const auto [f_amx, g_amx] = run("amx");
    const auto [f_avx, g_avx] = run("avx512bf16");
    const std::pair<const Tensor*, const Tensor*> pairs[] = {{&f_amx.out, &f_avx.out},
                                                             {&f_amx.lse, &f_avx.lse},
                                                             {&g_amx.dq, &g_avx.dq},
                                                             {&g_amx.dk, &g_avx.dk},
                                                             {&g_amx.dv, &g_avx.dv}};
    for (const auto& [a, b] : pairs) {
      worst = std::max(worst, rel_err(*a, *b));
      worst_norm = std::max(worst_norm, norm_err(*a, *b));
      EXPECT_LE(rel_err(*a, *b), kAmxAgreementTol);
      EXPECT_LE(norm_err(*a, *b), kAmxAgreementNormTol);
    }
  }
  std::printf("amx against avx512bf16: worst rel_err %.3g, norm-wise %.3g\n", worst, worst_norm);
}

TEST(Fused, ChosenAutomaticallyAndExplainsWeights) {
  Case c;
  c.Lq = c.Lk = 5;
  const Problem pb = make_problem(c, 7);
  EXPECT_EQ(run_forward(pb, "", 1).kernel, "fused");
  auto r = sattn::attention(pb.q.view, pb.k.view, pb.v.view, {}, true, true);
  EXPECT_EQ(r.info.kernel, "reference");
  ASSERT_FALSE(r.info.rejected.empty());
  EXPECT_EQ(r.info.rejected[0].first, "fused");
  EXPECT_NE(r.info.rejected[0].second.find("weights"), std::string::npos);
}

TEST(Fused, BitwiseIdenticalForAnyThreadCount) {
  Case c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = 150, c.Lk = 170, c.D = 40, c.Dv = 24;
  c.mask = 2, c.mask_shape = 1, c.causal = sattn::Causal::kBottomRight, c.dropout = 0.1;
  const Problem pb = make_problem(c, 99);
  const FwdResult f1 = run_forward(pb, "fused", 1);
  const BwdResult b1 = run_backward(pb, f1, "fused", 1);
  for (int t : {2, 3}) {
    const FwdResult ft = run_forward(pb, "fused", t);
    EXPECT_TRUE(bitwise_equal(f1.out, ft.out)) << t;
    EXPECT_TRUE(bitwise_equal(f1.lse, ft.lse)) << t;
    const BwdResult bt = run_backward(pb, f1, "fused", t);
    EXPECT_TRUE(bitwise_equal(b1.dq, bt.dq)) << t;
    EXPECT_TRUE(bitwise_equal(b1.dk, bt.dk)) << t;
    EXPECT_TRUE(bitwise_equal(b1.dv, bt.dv)) << t;
    EXPECT_TRUE(bitwise_equal(b1.dmask, bt.dmask)) << t;
  }
}

// Rows [a, b) of dimension 2 of a 4-D view, or of dimension 1 of a 2-D view (no copy).
TensorView narrow(const TensorView& t, int64_t dim, int64_t a, int64_t b) {
  TensorView r = t;
  r.shape[dim] = b - a;
  r.data = static_cast<char*>(t.data) + a * t.strides[dim] * int64_t(sattn::dtype_size(t.dtype));
  return r;
}

// A shard of queries and keys, told its global positions, computes exactly its part of the whole call: the
// causal diagonal, dropout and global key lengths follow the positions. Two key shards merged through their
// log-sum-exp give the rows of the whole call.
TEST(Fused, ShardsWithGlobalPositionsMatchTheWholeCall) {
  Case c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = 190, c.Lk = 190, c.D = 32, c.Dv = 24, c.padding = 2;
  c.causal = sattn::Causal::kTopLeft, c.dropout = 0.2;
  const Problem whole = make_problem(c, 7);
  const FwdResult ref = run_forward(whole, "fused", 2);
  const int64_t q0 = 70, q1 = 150, split = 100;  // queries [70, 150); keys [0, 100) and [100, 190)
  std::vector<Tensor> outs, lses;
  for (const auto& [k0, k1] : {std::pair<int64_t, int64_t>{0, split}, {split, c.Lk}}) {
    sattn::AttentionOptions o = whole.opt;
    o.kernel = "fused";
    o.query_offset = q0, o.key_offset = k0;
    Tensor out(DType::kF32, {c.B, c.Hq, q1 - q0, c.Dv}), lse(DType::kF32, {c.B, c.Hq, q1 - q0});
    sattn::KernelInfo info;
    sattn::scaled_dot_product_attention(narrow(whole.q.view, 2, q0, q1), narrow(whole.k.view, 2, k0, k1),
                                        narrow(whole.v.view, 2, k0, k1), o, {out.view(), lse.view(), {}}, &info);
    EXPECT_EQ(info.kernel, "fused");
    outs.push_back(std::move(out));
    lses.push_back(std::move(lse));
  }
  const auto merged =
      sattn::merge_attention_partials({outs[0].view(), outs[1].view()}, {lses[0].view(), lses[1].view()});
  EXPECT_LE(rel_err(merged.out, Tensor::from_view(narrow(ref.out.view(), 2, q0, q1))), 2e-6);
  EXPECT_LE(rel_err(merged.lse, Tensor::from_view(narrow(ref.lse.view(), 2, q0, q1))), 2e-6);
  // Bottom-right alignment is stated through the positions instead; a negative offset is refused.
  sattn::AttentionOptions bad = whole.opt;
  bad.query_offset = 1;
  bad.causal = sattn::Causal::kBottomRight;
  Tensor out(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv});
  EXPECT_THROW(sattn::scaled_dot_product_attention(whole.q.view, whole.k.view, whole.v.view, bad, {out.view(), {}, {}}),
               sattn::Error);
  bad.causal = sattn::Causal::kTopLeft, bad.query_offset = -1;
  EXPECT_THROW(sattn::scaled_dot_product_attention(whole.q.view, whole.k.view, whole.v.view, bad, {out.view(), {}, {}}),
               sattn::Error);
}

// The query tile follows Lq (whole groups of 8 or 16 rows, as few and as even blocks of at most 64 as possible).
TEST(Fused, QueryTileFollowsTheQueryCount) {
  using sattn::fused::query_tile;
  const int64_t expect16[][3] = {{0, 64, 16},   {1, 64, 16},    {16, 64, 16},   {17, 64, 32},  {24, 64, 32},
                                 {32, 64, 32},  {33, 64, 48},   {48, 64, 48},   {49, 64, 64},  {64, 64, 64},
                                 {65, 64, 48},  {96, 64, 48},   {97, 64, 64},   {129, 64, 48}, {130, 64, 48},
                                 {145, 64, 64}, {4096, 64, 64}, {4097, 64, 64}, {100, 32, 32}, {100, 128, 112}};
  for (const auto& e : expect16) EXPECT_EQ(query_tile(e[0], e[1], 16), e[2]) << "Lq " << e[0] << " br " << e[1];
  const int64_t expect8[][3] = {{0, 64, 8},     {8, 64, 8},    {9, 64, 16},    {20, 64, 24},  {24, 64, 24},
                                {57, 64, 64},   {65, 64, 40},  {96, 64, 48},   {200, 64, 56}, {4096, 64, 64},
                                {4097, 64, 64}, {100, 32, 32}, {100, 128, 104}};
  for (const auto& e : expect8) EXPECT_EQ(query_tile(e[0], e[1], 8), e[2]) << "Lq " << e[0] << " br " << e[1];
}

// The default tile: blocks of 64 rows at most, or, without causality, one block of up to 128 or 256 where that
// computes at least 5 % fewer rows (Lq = 197: 208 rows instead of 4 x 64; Lq = 300 keeps 64: 320 against 320), in at
// least the blocks asked for.
TEST(Fused, DefaultQueryTileTakesLargerBlocksWhereTheyPadLess) {
  using sattn::fused::default_query_tile;
  const int64_t expect16[][2] = {{1, 16},   {49, 64},   {64, 64},   {65, 80},  {96, 48},  {100, 112},
                                 {145, 80}, {197, 208}, {240, 240}, {300, 64}, {577, 64}, {4096, 64}};
  for (const auto& e : expect16) EXPECT_EQ(default_query_tile(e[0], false, 16), e[1]) << "Lq " << e[0];
  const int64_t expect8[][2] = {{49, 56}, {65, 72}, {197, 104}, {300, 152}, {577, 120}, {4096, 64}};
  for (const auto& e : expect8) EXPECT_EQ(default_query_tile(e[0], false, 8), e[1]) << "Lq " << e[0];
  EXPECT_EQ(default_query_tile(197, false, 16, 2), 112);  // two blocks at least: 2 x 112 rows
  EXPECT_EQ(default_query_tile(197, false, 16, 3), 64);   // three: blocks of 64 (the larger ones make one or two)
  for (const int64_t lq : {65, 197, 240, 300}) {          // causal: query_tile's blocks of at most 64
    EXPECT_EQ(default_query_tile(lq, true, 16), sattn::fused::query_tile(lq, 64, 16)) << "Lq " << lq;
    EXPECT_EQ(default_query_tile(lq, true, 8), sattn::fused::query_tile(lq, 64, 8)) << "Lq " << lq;
  }
}

// In float32 a row's out, lse and dQ do not depend on the query tile: the first rows of a call (Lq = 96, 24, 40)
// are those of a call on those rows alone (a different query tile: 48 against 64, 24 or 32 against 16, 40 or 48
// against 24 or 32, by the build's granule), bitwise, on every SIMD target; with a bool mask, and with an additive one
// whose gradient is wanted (the two-pass backward).
TEST(Fused, RowsDoNotDependOnTheQueryTile) {
  const int64_t pairs[][2] = {{96, 64}, {24, 16}, {40, 17}};
  uint32_t seed = 80;
  for (const std::string& target : sattn::testing::simd_target_names()) {
    sattn::testing::ScopedSimdTarget scoped(target);
    for (const auto& [lq, rows] : pairs) {
      Case c;
      c.B = 2, c.Hq = 2, c.Hkv = 1, c.Lq = lq, c.Lk = 75, c.D = 40, c.Dv = 24, c.mask = lq == 40 ? 2 : 1,
      c.mask_shape = 2;
      c.causal = lq == 24 ? sattn::Causal::kNone : sattn::Causal::kTopLeft;
      SCOPED_TRACE(target + " " + c.name() + " first rows " + std::to_string(rows));
      const int64_t granule = sattn::fused::forward_ops().query_granule;
      const bool causal = c.causal != sattn::Causal::kNone;
      ASSERT_NE(sattn::fused::default_query_tile(lq, causal, granule),
                sattn::fused::default_query_tile(rows, causal, granule));
      const Problem whole = make_problem(c, ++seed);
      Problem part = whole;
      part.c.Lq = rows;
      part.q.view = narrow(whole.q.view, 2, 0, rows), part.dout.view = narrow(whole.dout.view, 2, 0, rows);
      const FwdResult fw = run_forward(whole, "fused", 2), fp = run_forward(part, "fused", 2);
      ASSERT_EQ(fw.kernel, "fused");
      ASSERT_EQ(fp.kernel, "fused");
      EXPECT_TRUE(bitwise_equal(Tensor::from_view(narrow(fw.out.view(), 2, 0, rows)), fp.out));
      EXPECT_TRUE(bitwise_equal(Tensor::from_view(narrow(fw.lse.view(), 2, 0, rows)), fp.lse));
      const BwdResult bw = run_backward(whole, fw, "fused", 2), bp = run_backward(part, fp, "fused", 2);
      EXPECT_TRUE(bitwise_equal(Tensor::from_view(narrow(bw.dq.view(), 2, 0, rows)), bp.dq));
    }
  }
}

// The fused backward of pb on one thread, checked against the fp64 reference and bitwise against three threads
// (dq, dk, dv and, with an additive mask, its gradient); returned with the float32 forward it was given.
struct CheckedBackward {
  FwdResult ref32;
  BwdResult g1;
};
CheckedBackward backward_checked_against_reference(const Problem& pb, bool mask_gradient) {
  const FwdResult ref = run_forward(pb, "reference", 2);
  CheckedBackward r{as_f32(ref), {}};
  const BwdResult gref = run_backward(pb, ref, "reference", 2);
  r.g1 = run_backward(pb, r.ref32, "fused", 1);
  expect_grads_near(r.g1, gref);
  const BwdResult g3 = run_backward(pb, r.ref32, "fused", 3);
  EXPECT_TRUE(bitwise_equal(r.g1.dq, g3.dq));
  EXPECT_TRUE(bitwise_equal(r.g1.dk, g3.dk));
  EXPECT_TRUE(bitwise_equal(r.g1.dv, g3.dv));
  if (mask_gradient) {
    EXPECT_TRUE(bitwise_equal(r.g1.dmask, g3.dmask));
  }
  return r;
}

// Problems large enough that the backward's tasks cover several key blocks each (groups of 3 and 4 blocks, the
// last group shorter), and short keys in one group whose query blocks are split into chunks (partial dK and dV):
// gradients against the reference, and bitwise the same for 1 and 3 threads.
TEST(Fused, BackwardKeyGroupsMatchReferenceAndThreadCounts) {
  Case a;
  a.B = 3, a.Hq = 4, a.Hkv = 2, a.Lq = 150, a.Lk = 1180, a.D = 120, a.Dv = 136;  // 19 key blocks in groups of 3
  a.mask = 1, a.mask_shape = 1, a.padding = 2, a.causal = sattn::Causal::kBottomRight, a.strided = true;
  Case b;
  b.B = 1, b.Hq = b.Hkv = 8, b.Lq = b.Lk = 1030, b.D = b.Dv = 64;  // 17 key blocks in groups of 4
  b.padding = 1, b.causal = sattn::Causal::kTopLeft, b.dropout = 0.2;
  // an additive [Lq, Lk] mask with its gradient: the key groups' dS summed over batch and heads, with key lengths
  Case m = a;
  m.mask = 2;
  // one key group, 2 kv heads of 2 query heads, 32 query blocks in 8 chunks of 4; with key lengths (some rows of
  // no key), dropout and a mask; then causal from the bottom right (the first 14 query blocks see no key)
  Case s;
  s.B = 2, s.Hq = 4, s.Hkv = 2, s.Lq = 1000, s.Lk = 77, s.D = 40, s.Dv = 24;
  s.mask = 1, s.padding = 2, s.dropout = 0.1;
  Case sc = s;
  sc.causal = sattn::Causal::kBottomRight, sc.mask = 0, sc.padding = 0, sc.dropout = 0, sc.strided = true;
  uint32_t seed = 40;
  for (const Case& c : {a, b, m, s, sc}) {
    SCOPED_TRACE(c.name());
    backward_checked_against_reference(make_problem(c, ++seed), c.mask == 2);
  }
}

// The one pass's buffers for a mask's gradient stay within the call's memory limit for L x L buffers: the dS of
// every score ([B, Hq, Lq, Lk] floats, 2 MB here, far more than the call's other counted scratch) for a mask
// broadcast over the keys ([Hq, Lq, 1]), and the chunk sums (about [Lq, Lk] floats, 1 MB) for a mask shared by the
// heads ([Lq, Lk]). Under a lower limit the backward takes the two passes, which need neither, and its gradients
// are as close to the reference.
TEST(Fused, MaskGradientBufferStaysWithinTheMemoryLimit) {
  for (const int shape : {3, 1}) {
    Case c;
    c.B = 1, c.Hq = 2, c.Hkv = 1, c.Lq = 500, c.Lk = 500, c.D = 8, c.Dv = 8, c.mask = 2, c.mask_shape = shape;
    Problem pb = make_problem(c, 17);
    const FwdResult ref = run_forward(pb, "reference", 2);
    const FwdResult ref32 = as_f32(ref);
    const BwdResult gref = run_backward(pb, ref, "reference", 2);
    const int64_t buffer_bytes = c.B * c.Hq * c.Lq * c.Lk * 4 / (shape == 3 ? 1 : c.Hq);
    for (const int64_t limit : {int64_t(0), buffer_bytes / 2}) {
      SCOPED_TRACE(c.name() + " memory limit " + std::to_string(limit));
      pb.opt.memory_limit_bytes = limit;
      sattn::fused::workspace_reset_peak();
      const BwdResult got = run_backward(pb, ref32, "fused", 2);
      expect_grads_near(got, gref);
      if (limit == 0) {
        EXPECT_GE(sattn::fused::workspace_peak_bytes(), buffer_bytes);
      } else {
        EXPECT_LT(sattn::fused::workspace_peak_bytes(), buffer_bytes / 2);
      }
    }
  }
}

// A full-shape float32 mask's gradient takes the one pass's dS directly (no [B, Hq, Lq, Lk] buffer) also when the
// gradient's view has a stride of 0 for a size-1 dimension, as the Python bindings make them.
TEST(Fused, FullShapeMaskGradientIsWrittenDirectlyWhateverSizeOneStrides) {
  Case c;
  c.B = 1, c.Hq = 2, c.Hkv = 1, c.Lq = 300, c.Lk = 300, c.D = 8, c.Dv = 8, c.mask = 2, c.mask_shape = 0;
  Problem pb = make_problem(c, 23);
  const FwdResult ref = run_forward(pb, "reference", 2);
  const FwdResult ref32 = as_f32(ref);
  const BwdResult gref = run_backward(pb, ref, "reference", 2);
  Shape strides = sattn::contiguous_strides(pb.mask.shape());
  strides[0] = 0;  // B = 1
  ASSERT_TRUE(TensorView(pb.mask.data(), DType::kF32, pb.mask.shape(), strides).is_contiguous());
  sattn::fused::workspace_reset_peak();
  const BwdResult got = run_backward(pb, ref32, "fused", 2, &strides);
  expect_grads_near(got, gref);
  EXPECT_LT(sattn::fused::workspace_peak_bytes(), c.B * c.Hq * c.Lq * c.Lk * 4);
}

// A full-shape float32 mask's gradient of 1 MiB and more is written with non-temporal stores where a whole vector
// of a gradient row is aligned (Params::stream_dscores), and with plain stores elsewhere: rows of 900 keys (3600
// bytes) start at every multiple of 16 bytes, and the last query block (44 of 300 rows, 8 of 520) ends in a partial
// vector. Against the reference, bitwise the same for 1 and 3 threads, and the same values as the two-pass
// schedule, which writes the gradient without them.
TEST(Fused, LargeMaskGradientIsStreamedAroundTheCaches) {
  Case wide;
  wide.B = 1, wide.Hq = 2, wide.Hkv = 1, wide.Lq = 300, wide.Lk = 900, wide.mask = 2;
  Case square = wide;
  square.Lq = square.Lk = 520, square.causal = sattn::Causal::kTopLeft;
  uint32_t seed = 90;
  for (const Case& c : {wide, square}) {
    SCOPED_TRACE(c.name());
    ASSERT_GE(c.B * c.Hq * c.Lq * c.Lk * 4, int64_t(1) << 20);
    const Problem pb = make_problem(c, ++seed);
    const auto [ref32, g1] = backward_checked_against_reference(pb, true);
    const sattn::testing::ScopedEnv env("SATTN_FUSED_BACKWARD", "two_pass");
    const Tensor two_pass = run_backward(pb, ref32, "fused", 2).dmask;
    ASSERT_EQ(two_pass.numel(), g1.dmask.numel());
    int64_t differ = 0;  // as values: the two-pass sums start from +0, so a dS of -0 comes out as +0 there
    for (int64_t x = 0; x < two_pass.numel(); ++x) differ += g1.dmask.data<float>()[x] != two_pass.data<float>()[x];
    EXPECT_EQ(differ, 0);
  }
}

// A float mask [B or 1, Hq or 1, Lq, Lk] whose gradient is not the dS itself (a mask shared by the batch or the
// heads, or a gradient in another dtype) is summed per chunk of batches and kv head inside the backward's tasks,
// without a [B, Hq, Lq, Lk] buffer: chunks of two batches with a last chunk of one (B = 41), sums over kv heads
// (a [B, 1, Lq, Lk] mask with GQA), two key groups per (b, kv head) with chunks of two (Lk = 1100, D = 128), and a
// full-shape mask with a float64 gradient. Against the reference, and bitwise the same for 1 and 3 threads.
TEST(Fused, SharedMaskGradientIsSummedInChunks) {
  struct Shared {
    Case c;
    Shape mask;
    DType grad;
  };
  Case a;
  a.B = 41, a.Hq = 8, a.Hkv = 4, a.Lq = a.Lk = 49, a.D = a.Dv = 16;
  Case b;
  b.B = 6, b.Hq = 4, b.Hkv = 2, b.Lq = 70, b.Lk = 150, b.D = 16, b.Dv = 8, b.padding = 2;
  b.causal = sattn::Causal::kBottomRight;
  Case g;
  g.B = 9, g.Hq = g.Hkv = 8, g.Lq = 8, g.Lk = 1100, g.D = g.Dv = 128;
  Case f = b;
  f.B = 2;
  uint32_t seed = 60;
  const Shared shared[] = {Shared{a, {1, a.Hq, a.Lq, a.Lk}, DType::kF32}, Shared{b, {b.B, 1, b.Lq, b.Lk}, DType::kF32},
                           Shared{g, {g.Hq, g.Lq, g.Lk}, DType::kF32}, Shared{f, {f.B, f.Hq, f.Lq, f.Lk}, DType::kF64}};
  for (const Shared& sh : shared) {
    Case c = sh.c;
    c.mask = 2;
    SCOPED_TRACE(c.name() + " mask " + sattn::shape_to_string(sh.mask));
    Problem pb = make_problem(c, ++seed);
    pb.mask = Tensor(DType::kF32, sh.mask);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (int64_t x = 0; x < pb.mask.numel(); ++x)
      pb.mask.data<float>()[x] = u(rng) < 0.1f ? -std::numeric_limits<float>::infinity() : 2.f * u(rng) - 1.f;
    pb.opt.attn_mask = pb.mask.view();
    const FwdResult ref = run_forward(pb, "reference", 2);
    const BwdResult gref = run_backward(pb, ref, "reference", 2);
    const FwdResult ref32 = as_f32(ref);
    BwdResult got[2];
    for (const int threads : {1, 3}) {
      BwdResult& r = got[threads / 3];
      r = run_backward(pb, ref32, "fused", threads);
      if (&sh == &shared[0]) {  // under a memory limit that only chunks of 8 batches meet (chunks of 2: 2.1 MB)
        Problem limited = pb;
        limited.opt.memory_limit_bytes = 700 << 10;
        sattn::fused::workspace_reset_peak();
        const BwdResult l = run_backward(limited, ref32, "fused", threads);
        // the sums of chunks of 8 (0.6 MB) and the tiles of the tasks running at once (0.12 MB each: 0.85 MB in all
        // on one thread, up to 1.1 MB when three run together); not chunks of 4 (1.1 MB of sums alone), the dS
        // buffer (3.1 MB) or the two passes' packed tiles (5.4 MB)
        EXPECT_LT(sattn::fused::workspace_peak_bytes(), 1150000);
        expect_grads_near(l, gref);
        EXPECT_FALSE(bitwise_equal(l.dmask, r.dmask)) << "other chunks, other float sums";
      }
      if (sh.grad != DType::kF32) {  // the same call with the mask's gradient in sh.grad
        const Tensor dm(sh.grad, sh.mask);
        sattn::AttentionOptions o = pb.opt;
        o.kernel = "fused", o.num_threads = threads;
        sattn::scaled_dot_product_attention_backward(pb.dout.view, pb.q.view, pb.k.view, pb.v.view, ref32.out.view(),
                                                     ref32.lse.view(), o,
                                                     {r.dq.view(), r.dk.view(), r.dv.view(), dm.view()});
        r.dmask = dm;
      }
      expect_grads_near(r, gref);
    }
    EXPECT_TRUE(bitwise_equal(got[0].dq, got[1].dq));
    EXPECT_TRUE(bitwise_equal(got[0].dk, got[1].dk));
    EXPECT_TRUE(bitwise_equal(got[0].dv, got[1].dv));
    EXPECT_TRUE(bitwise_equal(got[0].dmask, got[1].dmask));
  }
}

// Padding given as a mask runs as key lengths: a bool attn_mask [B, 1, 1, Lk] whose rows' allowed keys are a run from
// key 0, or a bool key_padding_mask [B, Lk] whose rows pad a run at the end. out, lse and the gradients are those of
// the reference (which applies the masks element by element), and bitwise those of the same problem given as
// key_lengths; a mask with a hole, or one that differs by head, keeps the mask (also checked against the reference).
TEST(Fused, PaddingMasksRunAsKeyLengths) {
  for (const bool causal : {false, true})
    for (const int variant : {0, 1, 2, 3}) {  // attn_mask: 0 padding only, 1 with a hole, 2 by head; 3 key padding
      Case c;
      c.B = 4, c.Hq = 4, c.Hkv = 2, c.Lq = variant == 0 ? 1 : 70, c.Lk = 150, c.D = 16, c.Dv = 8;
      c.Lq = causal ? 70 : c.Lq;
      c.causal = causal ? sattn::Causal::kBottomRight : sattn::Causal::kNone;
      SCOPED_TRACE(c.name() + " variant " + std::to_string(variant));
      Problem pb = make_problem(c, 31 + variant);
      const int64_t lengths[4] = {150, 0, 97, 1};
      if (variant == 3) {
        pb.kpm = Tensor(DType::kBool, {c.B, c.Lk});
        for (int64_t b = 0; b < c.B; ++b)
          for (int64_t j = 0; j < c.Lk; ++j) pb.kpm.data<uint8_t>()[b * c.Lk + j] = j >= lengths[b];
        pb.opt.key_padding_mask = pb.kpm.view();
      } else {
        pb.mask = Tensor(DType::kBool, {c.B, variant == 2 ? c.Hq : 1, 1, c.Lk});
        for (int64_t b = 0; b < c.B; ++b)
          for (int64_t h = 0; h < pb.mask.shape()[1]; ++h)
            for (int64_t j = 0; j < c.Lk; ++j)
              pb.mask.data<uint8_t>()[(b * pb.mask.shape()[1] + h) * c.Lk + j] = j < lengths[b] - h;
        if (variant == 1) pb.mask.data<uint8_t>()[2 * c.Lk + 120] = 1;
        pb.opt.attn_mask = pb.mask.view();
      }
      const FwdResult ref = run_forward(pb, "reference", 2);
      const BwdResult gref = run_backward(pb, ref, "reference", 2);
      const FwdResult got = run_forward(pb, "fused", 3);
      EXPECT_LE(rel_err(got.out, ref.out), 1e-5);
      const BwdResult g = run_backward(pb, got, "fused", 3);
      expect_grads_near(g, gref);
      if (variant == 1 || variant == 2) continue;
      Problem lp = pb;  // the same call with key lengths instead of the mask
      lp.opt.attn_mask = {};
      lp.opt.key_padding_mask = {};
      lp.lengths = Tensor(DType::kI64, {c.B});
      for (int64_t b = 0; b < c.B; ++b) lp.lengths.data<int64_t>()[b] = lengths[b];
      lp.opt.key_lengths = lp.lengths.view();
      const FwdResult lf = run_forward(lp, "fused", 1);
      EXPECT_TRUE(bitwise_equal(got.out, lf.out));
      EXPECT_TRUE(bitwise_equal(got.lse, lf.lse));
      const BwdResult lg = run_backward(lp, lf, "fused", 1);
      EXPECT_TRUE(bitwise_equal(g.dq, lg.dq));
      EXPECT_TRUE(bitwise_equal(g.dk, lg.dk));
      EXPECT_TRUE(bitwise_equal(g.dv, lg.dv));
    }
}

TEST(Fused, BackwardScheduleNamesAreChecked) {
  Case c;
  c.Lq = c.Lk = 20;
  const Problem pb = make_problem(c, 5);
  const FwdResult f = run_forward(pb, "fused", 1);
  const sattn::testing::ScopedEnv env("SATTN_FUSED_BACKWARD", "three_pass");
  try {
    run_backward(pb, f, "fused", 1);
    ADD_FAILURE() << "no error";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), sattn::ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("SATTN_FUSED_BACKWARD: expected auto, one_pass or two_pass, got 'three_pass'"),
              std::string::npos)
        << e.what();
  }
}

// Non-contiguous float32 K and V rows are read through one dense copy per call: the results are bitwise those of
// contiguous inputs holding the same values, forward and backward, for rows interleaved with other heads (B = 1,
// whose batch stride is normalised to 0, and B = 2), a non-unit last stride, and K/V broadcast over the heads
// (a zero head stride).
TEST(Fused, NonContiguousKeysAndValuesGiveTheContiguousResultsBitwise) {
  struct Layout {
    int64_t B, Hq, Hkv, Lq, Lk, D, Dv;
    int kind;  // 0: [B, L, H, D] memory; 1: every other element of the last dim; 2: one head broadcast to Hkv
  };
  const Layout layouts[] = {{1, 4, 4, 130, 200, 64, 40, 0},
                            {2, 4, 2, 70, 129, 17, 24, 0},
                            {2, 2, 2, 65, 90, 16, 8, 1},
                            {1, 4, 2, 100, 150, 32, 32, 2}};
  uint32_t seed = 60;
  for (const Layout& l : layouts) {
    Case c;
    c.B = l.B, c.Hq = l.Hq, c.Hkv = l.Hkv, c.Lq = l.Lq, c.Lk = l.Lk, c.D = l.D, c.Dv = l.Dv;
    c.causal = sattn::Causal::kBottomRight, c.strided = l.kind == 0;
    SCOPED_TRACE(c.name() + " layout " + std::to_string(l.kind));
    Problem pb = make_problem(c, ++seed);
    std::vector<Tensor> keep;
    auto respace = [&](Input& in, int64_t width) {
      if (l.kind == 1) {  // the same values at a last-dim stride of 2
        Tensor wide(DType::kF32, {c.B, c.Hkv, c.Lk, 2 * width});
        TensorView v(wide.data(), DType::kF32, {c.B, c.Hkv, c.Lk, width},
                     {c.Hkv * c.Lk * 2 * width, c.Lk * 2 * width, 2 * width, 2});
        const Tensor dense = Tensor::from_view(in.view);
        for (int64_t x = 0; x < dense.numel(); ++x) wide.data<float>()[2 * x] = dense.data<float>()[x];
        in.view = v, keep.push_back(wide);
      } else if (l.kind == 2) {  // head 0 of every batch, seen by every kv head
        TensorView v = in.view;
        v.shape[1] = c.Hkv, v.strides[1] = 0;
        in.view = v;
      }
    };
    respace(pb.k, c.D), respace(pb.v, c.Dv);
    Problem dense = pb;
    dense.k.storage = Tensor::from_view(pb.k.view), dense.k.view = dense.k.storage.view();
    dense.v.storage = Tensor::from_view(pb.v.view), dense.v.view = dense.v.storage.view();
    ASSERT_FALSE(pb.k.view.is_contiguous());
    for (int threads : {1, 2}) {
      const FwdResult a = run_forward(pb, "fused", threads), b = run_forward(dense, "fused", threads);
      EXPECT_TRUE(bitwise_equal(a.out, b.out) && bitwise_equal(a.lse, b.lse));
      const BwdResult ga = run_backward(pb, a, "fused", threads), gb = run_backward(dense, b, "fused", threads);
      EXPECT_TRUE(bitwise_equal(ga.dq, gb.dq));
      EXPECT_TRUE(bitwise_equal(ga.dk, gb.dk) && bitwise_equal(ga.dv, gb.dv));
    }
  }
}

// Large scratch (the backward's partial dQ and packed query tiles, dense K/V copies) comes from the workspace
// cache, reused between calls without being cleared. A call that finds the cache full of NaN blocks of every size
// it could take gives the results of a call on fresh (zeroed) pages, bitwise; after it the cache holds its blocks,
// and empty_workspace_cache() gives them back.
TEST(Fused, ReusedWorkspaceGivesTheFreshResultsBitwise) {
  if (sattn::workspace_cache_limit() < (size_t(256) << 20))
    GTEST_SKIP() << "SATTN_WORKSPACE_CACHE_MB is under the 256 MiB this test fills";
  Case c;
  c.B = 1, c.Hq = 8, c.Hkv = 8, c.Lq = 2048, c.Lk = 2048, c.D = 64, c.Dv = 64;
  c.causal = sattn::Causal::kTopLeft, c.strided = true;
  const Problem pb = make_problem(c, 77);
  for (int threads : {1, 2}) {
    SCOPED_TRACE(threads);
    sattn::empty_workspace_cache();
    EXPECT_EQ(sattn::workspace_cache_bytes(), 0);
    const FwdResult fresh = run_forward(pb, "fused", threads);
    const BwdResult fresh_g = run_backward(pb, fresh, "fused", threads);
    EXPECT_GT(sattn::workspace_cache_bytes(), 0);  // the backward's blocks, kept
    // NaN blocks of 4 .. 45 MiB (8, the most the cache keeps): any request of 4 .. 45 MiB finds one of at most
    // twice its size
    sattn::empty_workspace_cache();
    std::vector<void*> blocks;
    for (size_t mib : {4, 6, 8, 11, 16, 23, 32, 45}) {
      blocks.push_back(sattn::workspace_alloc(mib << 20));
      std::memset(blocks.back(), 0xff, mib << 20);
    }
    for (void* b : blocks) sattn::workspace_free(b);
    EXPECT_GE(sattn::workspace_cache_bytes(), int64_t(145) << 20);
    const FwdResult reused = run_forward(pb, "fused", threads);
    const BwdResult reused_g = run_backward(pb, reused, "fused", threads);
    EXPECT_TRUE(bitwise_equal(fresh.out, reused.out) && bitwise_equal(fresh.lse, reused.lse));
    EXPECT_TRUE(bitwise_equal(fresh_g.dq, reused_g.dq));
    EXPECT_TRUE(bitwise_equal(fresh_g.dk, reused_g.dk) && bitwise_equal(fresh_g.dv, reused_g.dv));
    sattn::empty_workspace_cache();
    EXPECT_EQ(sattn::workspace_cache_bytes(), 0);
  }
}

// Float32Precision::kBF16 lets float32 inputs (and P) be rounded to bf16 in the bf16 products (amx, avx512bf16):
// then within bf16's rounding of the fp64 reference (about 2^-9 relative per operand; 1e-2 on these unit-scale
// problems), not the same as the float32 products, and still bitwise the same for 1 and 3 threads. kHighest (the
// default) is the float32 path, on every target. Without AVX512-BF16 kBF16 changes nothing.
TEST(Fused, Float32PrecisionBf16RoundsOnlyWhereAllowed) {
  EXPECT_EQ(sattn::parse_float32_precision("bf16"), sattn::Float32Precision::kBF16);
  EXPECT_EQ(sattn::parse_float32_precision("highest"), sattn::Float32Precision::kHighest);
  EXPECT_EQ(sattn::parse_float32_precision("high"), sattn::Float32Precision::kHigh);
  try {
    sattn::parse_float32_precision("medium", "--float32-precision");
    ADD_FAILURE() << "no error";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(std::string(e.what()), "--float32-precision: expected 'highest', 'high' or 'bf16', got 'medium'");
  }
  const auto avail = sattn::testing::simd_target_names();
  const bool has_bf16 = std::any_of(avail.begin(), avail.end(), has_bf16_products);
  Case c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = 130, c.Lk = 201, c.D = 40, c.Dv = 24, c.causal = sattn::Causal::kBottomRight;
  c.padding = 1;
  Problem pb = make_problem(c, 77);
  const FwdResult ref = run_forward(pb, "reference", 2);
  const FwdResult ref32 = as_f32(ref);
  const BwdResult gref = run_backward(pb, ref, "reference", 2);
  const FwdResult highest = run_forward(pb, "fused", 1);
  const BwdResult ghighest = run_backward(pb, ref32, "fused", 1);
  pb.opt.float32_precision = sattn::Float32Precision::kBF16;
  for (const std::string& simd : avail) {
    SCOPED_TRACE(simd);
    const sattn::testing::ScopedSimdTarget target(simd);
    const FwdResult got = run_forward(pb, "fused", 1);
    const BwdResult g = run_backward(pb, ref32, "fused", 1);
    if (!has_bf16_products(simd)) {  // nothing to round with: the float32 products of that target
      EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
      expect_grads_near(g, gref);
      continue;
    }
    EXPECT_LE(rel_err(got.out, ref.out), 1e-2);
    EXPECT_LE(rel_err(got.lse, ref.lse), 1e-2);
    EXPECT_FALSE(bitwise_equal(got.out, highest.out));  // the bf16 products ran
    expect_grads_near(g, gref, 2e-2);
    EXPECT_FALSE(bitwise_equal(g.dq, ghighest.dq));
    const FwdResult got3 = run_forward(pb, "fused", 3);
    const BwdResult g3 = run_backward(pb, ref32, "fused", 3);
    EXPECT_TRUE(bitwise_equal(got.out, got3.out) && bitwise_equal(g.dq, g3.dq) && bitwise_equal(g.dk, g3.dk) &&
                bitwise_equal(g.dv, g3.dv));
  }
  if (!has_bf16)
    GTEST_SKIP() << "this CPU has no bf16 products (amx, avx512bf16): the bf16 rounding of float32 inputs is not "
                    "tested here";
}

TEST(Fused, FullyMaskedRowsGiveZeroAndMinusInf) {
  Case c;
  c.Lq = 70, c.Lk = 3, c.D = 8, c.Dv = 8, c.causal = sattn::Causal::kBottomRight;  // rows i < Lq - Lk see nothing
  const Problem pb = make_problem(c, 3);
  const FwdResult got = run_forward(pb, "fused", 1);
  for (int64_t i = 0; i < c.Lq - c.Lk; ++i) {
    EXPECT_EQ(got.lse.data<float>()[i], -std::numeric_limits<float>::infinity());
    for (int64_t x = 0; x < c.Dv; ++x) EXPECT_EQ(got.out.data<float>()[i * c.Dv + x], 0.f);
  }
  const BwdResult g = run_backward(pb, got, "fused", 1);
  for (int64_t x = 0; x < (c.Lq - c.Lk) * c.D; ++x) EXPECT_EQ(g.dq.data<float>()[x], 0.f);
}

// bf16 and float16 inputs compute what their float32 values do (K and V widened once per call where the float32
// products read them; the amx forward takes float16 as two bf16 each, exactly); float16 and bf16 outputs of that
// computation are the float32 results rounded.
TEST(Fused, HalfPrecisionInputsMatchUpcast) {
  Case c;
  c.Hq = 2, c.Hkv = 2, c.Lq = 77, c.Lk = 90, c.D = 40, c.Dv = 83, c.causal = sattn::Causal::kTopLeft;  // rows past 64
  const Problem pb = make_problem(c, 5);
  const sattn::testing::ScopedEnv tiles("SATTN_FUSED_TILE_MIN_WORK", "0");  // float16 as two bf16 at D 40 too
  for (const std::string& simd : sattn::testing::simd_target_names())
    for (DType dt : {DType::kBF16, DType::kF16}) {
      const sattn::testing::ScopedSimdTarget simd_target(simd);
      const Tensor q = Tensor::from_view(pb.q.view).to(dt), k = Tensor::from_view(pb.k.view).to(dt),
                   v = Tensor::from_view(pb.v.view).to(dt);
      Problem up = pb;
      const Tensor qf = q.to(DType::kF32), kf = k.to(DType::kF32), vf = v.to(DType::kF32);
      up.q.view = qf.view(), up.k.view = kf.view(), up.v.view = vf.view();
      const FwdResult ref = run_forward(up, "fused", 1);
      sattn::AttentionOptions o = pb.opt;
      o.kernel = "fused";
      Tensor out(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv});
      sattn::scaled_dot_product_attention(q, k, v, o, {out.view(), {}, {}});
      // its own products: as accurate, not the same bits
      if ((has_bf16_products(simd) && dt == DType::kBF16) || (simd == "amx" && dt == DType::kF16)) {
        EXPECT_LE(rel_err(out, ref.out), 2e-5) << sattn::to_string(dt) << " " << simd;
        EXPECT_FALSE(bitwise_equal(out, ref.out)) << sattn::to_string(dt) << " " << simd;
      } else {
        EXPECT_TRUE(bitwise_equal(out, ref.out)) << sattn::to_string(dt) << " " << simd;
      }
      // Backward with half-precision q/k/v equals the backward on the up-cast inputs.
      const BwdResult gref = run_backward(up, ref, "fused", 1);
      Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
      sattn::scaled_dot_product_attention_backward(pb.dout.view, q, k, v, ref.out, ref.lse, o,
                                                   {dq.view(), dk.view(), dv.view(), {}});
      if (has_bf16_products(simd) && dt == DType::kBF16) {
        EXPECT_LE(rel_err(dq, gref.dq), 1e-4);
        EXPECT_LE(rel_err(dk, gref.dk), 1e-4);
        EXPECT_LE(rel_err(dv, gref.dv), 1e-4);
      } else {
        EXPECT_TRUE(bitwise_equal(dq, gref.dq) && bitwise_equal(dk, gref.dk) && bitwise_equal(dv, gref.dv))
            << sattn::to_string(dt) << " " << simd;
      }
      // float16 results, and bf16 ones where the bf16 products do not take them: the float32 ones, rounded once
      // (vectors of them where possible)
      if (dt == DType::kF16 || !has_bf16_products(simd)) {
        Tensor out16(dt, out.shape()), dq16(dt, q.shape()), dk16(dt, k.shape()), dv16(dt, v.shape());
        sattn::scaled_dot_product_attention(q, k, v, o, {out16.view(), {}, {}});
        sattn::scaled_dot_product_attention_backward(pb.dout.view, q, k, v, ref.out, ref.lse, o,
                                                     {dq16.view(), dk16.view(), dv16.view(), {}});
        EXPECT_TRUE(bitwise_equal(out16, out.to(dt))) << sattn::to_string(dt) << " " << simd;
        EXPECT_TRUE(bitwise_equal(dq16, dq.to(dt)) && bitwise_equal(dk16, dk.to(dt)) && bitwise_equal(dv16, dv.to(dt)))
            << sattn::to_string(dt) << " " << simd;
      }
    }
}

// A key row holding a NaN, with bf16 and float16 inputs, every SIMD target: the backward (and forward) give what
// the same values in float32 give (the backward zeroes such rows wherever K is read; float32 products: bitwise).
// The forward takes the bf16 products only where they pay for their fixed costs per query tile: bf16 inputs and
// float32 ones under kBF16 from D·Lk = 2048 on, float16 (amx only, as two bf16 each) past D·Lk = 4096 with D a
// multiple of 16. Below, the float32 products: bitwise what the inputs' float32 values give under kHighest. The
// backward likewise from D·Lk = 2048 (float16 never). SATTN_FUSED_TILE_MIN_WORK=0 puts every size on the bf16
// products.
TEST(Fused, ShortKeysTakeTheFloat32Products) {
  struct Size {
    int64_t D, Lk;
    DType dt;
    bool tiles;  // on amx; avx512bf16 has no float16 products
  };
  const Size sizes[] = {{20, 64, DType::kF32, false},  {20, 103, DType::kF32, true}, {32, 63, DType::kBF16, false},
                        {32, 64, DType::kBF16, true},  {64, 64, DType::kF16, false}, {64, 65, DType::kF16, true},
                        {40, 512, DType::kF16, false}, {128, 32, DType::kBF16, true}};
  bool ran = false;
  for (const std::string& simd : sattn::testing::simd_target_names()) {
    if (!has_bf16_products(simd)) continue;
    ran = true;
    const sattn::testing::ScopedSimdTarget target(simd);
    for (const Size& z : sizes)
      for (const char* min_work : {"", "0"}) {
        const bool tiles = std::string(min_work) == "0" ? z.dt != DType::kF16 || simd == "amx"
                                                        : z.tiles && (z.dt != DType::kF16 || simd == "amx");
        SCOPED_TRACE(simd + " D " + std::to_string(z.D) + " Lk " + std::to_string(z.Lk) + " " + sattn::to_string(z.dt) +
                     " SATTN_FUSED_TILE_MIN_WORK='" + min_work + "'");
        const sattn::testing::ScopedEnv env("SATTN_FUSED_TILE_MIN_WORK", min_work);
        Case c;
        c.Hq = 2, c.Hkv = 2, c.Lq = 70, c.Lk = z.Lk, c.D = z.D, c.Dv = z.D;
        const Problem pb = make_problem(c, 31);
        const Tensor q = Tensor::from_view(pb.q.view).to(z.dt), k = Tensor::from_view(pb.k.view).to(z.dt),
                     v = Tensor::from_view(pb.v.view).to(z.dt);
        const Tensor qf = q.to(DType::kF32), kf = k.to(DType::kF32), vf = v.to(DType::kF32);
        sattn::AttentionOptions o = pb.opt;
        o.kernel = "fused";
        Tensor want(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv}), got(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv});
        sattn::scaled_dot_product_attention(qf, kf, vf, o, {want.view(), {}, {}});
        if (z.dt == DType::kF32) o.float32_precision = sattn::Float32Precision::kBF16;
        sattn::scaled_dot_product_attention(q, k, v, o, {got.view(), {}, {}});
        EXPECT_EQ(bitwise_equal(got, want), !tiles);
        EXPECT_LE(rel_err(got, want), z.dt == DType::kF32 ? 1e-2 : 2e-5);
        // the backward from the same out and lse
        Tensor lse(DType::kF32, {c.B, c.Hq, c.Lq});
        sattn::AttentionOptions oh = pb.opt;
        oh.kernel = "fused";
        sattn::scaled_dot_product_attention(qf, kf, vf, oh, {want.view(), lse.view(), {}});
        const auto grads = [&](const Tensor& gq, const Tensor& gk, const Tensor& gv,
                               const sattn::AttentionOptions& go) {
          Tensor dq(DType::kF32, gq.shape()), dk(DType::kF32, gk.shape()), dv(DType::kF32, gv.shape());
          sattn::scaled_dot_product_attention_backward(pb.dout.view, gq, gk, gv, want, lse, go,
                                                       {dq.view(), dk.view(), dv.view(), {}});
          return std::array<Tensor, 3>{dq, dk, dv};
        };
        const auto gw = grads(qf, kf, vf, oh), gg = grads(q, k, v, o);
        const bool tiles_bwd = tiles && z.dt != DType::kF16;
        EXPECT_EQ(bitwise_equal(gg[0], gw[0]) && bitwise_equal(gg[1], gw[1]) && bitwise_equal(gg[2], gw[2]),
                  !tiles_bwd);
        for (int g = 0; g < 3; ++g) EXPECT_LE(rel_err(gg[size_t(g)], gw[size_t(g)]), z.dt == DType::kF32 ? 2e-2 : 1e-4);
      }
  }
  if (!ran) GTEST_SKIP() << "this CPU has no bf16 products (amx, avx512bf16): nothing to choose between";
}

TEST(Fused, HalfPrecisionNanKeyRowsMatchUpcast) {
  Case c;
  c.Hq = 2, c.Hkv = 2, c.Lq = 40, c.Lk = 70, c.D = 24, c.Dv = 16;
  c.causal =
      sattn::Causal::kTopLeft;  // queries 0..4 do not see key 5: their rows stay finite (0 · NaN must not reach them)
  const Problem pb = make_problem(c, 17);
  for (const std::string& simd : sattn::testing::simd_target_names())
    for (DType dt : {DType::kBF16, DType::kF16}) {
      SCOPED_TRACE(simd + " " + sattn::to_string(dt));
      const sattn::testing::ScopedSimdTarget simd_target(simd);
      const RoundedInputs r = rounded_inputs(pb, dt, [&](Tensor&, Tensor& k, Tensor&) {
        static_cast<uint16_t*>(k.data())[5 * c.D + 3] = dt == DType::kBF16 ? 0x7FC0u : 0x7E00u;  // key 5: NaN
      });
      const Problem &in = r.in, &up = r.up;
      const FwdResult ref = run_forward(up, "fused", 1);
      const BwdResult want = run_backward(up, ref, "fused", 1), got = run_backward(in, ref, "fused", 1);
      const double tol = has_bf16_products(simd) && dt == DType::kBF16 ? 1e-4 : 0.0;  // its own products
      EXPECT_TRUE(same_nans_and_close(got.dq, want.dq, tol) && same_nans_and_close(got.dk, want.dk, tol) &&
                  same_nans_and_close(got.dv, want.dv, tol));
    }
}

// Rows whose keys all carry the same huge finite bias (-1e30, or the float minimum used as "masked"): in float the
// bias swallows the scores, the exact softmax is uniform, and lse = -1e30 + log Lk rounds to -1e30, so a backward
// that forms P = exp(s - lse) gets P = 1 instead of 1/Lk. Rows i % 3 == 0 carry the bias on every key, rows
// i % 3 == 1 on every other key. Forward (tiles and split-key decode) and backward against the fp64 reference,
// for float32, bfloat16 and float16 inputs and every SIMD implementation, and bitwise identical for 1 and 3 threads.
// Lq = 300 also runs the backward without the mask's gradient, in query chunks (the row statistics recomputed per
// query block inside the chunks' tasks).
TEST(Fused, HugeUniformBiasRowsMatchReference) {
  const float lowest = std::numeric_limits<float>::lowest();
  const struct {
    int64_t Lq, Lk, D, Dv;
    float huge;
  } cases[] = {{70, 100, 16, 12, -1e30f}, {70, 100, 16, 12, lowest}, {300, 100, 16, 12, -1e30f},
               {1, 1100, 16, 16, lowest}, {3, 1100, 8, 8, -1e30f},   {9, 1100, 24, 8, lowest}};
  // lse row by row: |got - ref| <= tol max(1, |ref|) (rel_err would scale every row by the largest, ~1e30)
  auto lse_ok = [](const Tensor& got, const Tensor& ref, double tol = 2e-5) {
    const Tensor g = got.to(DType::kF64), r = ref.to(DType::kF64);
    for (int64_t x = 0; x < g.numel(); ++x) {
      const double a = g.data<double>()[x], b = r.data<double>()[x];
      if (!(a == b || std::fabs(a - b) <= tol * std::max(1.0, std::fabs(b)))) return false;
    }
    return true;
  };
  uint32_t seed = 40;
  for (const auto& [Lq, Lk, D, Dv, huge] : cases) {
    Case c;
    c.B = 2, c.Hq = 4, c.Hkv = 2, c.Lq = Lq, c.Lk = Lk, c.D = D, c.Dv = Dv;
    c.mask = 2, c.mask_shape = 1;  // additive [Lq, Lk]
    Problem pb = make_problem(c, ++seed);
    float* m = pb.mask.data<float>();
    for (int64_t i = 0; i < c.Lq; ++i)
      for (int64_t j = 0; j < c.Lk; ++j)
        if (i % 3 == 0 || (i % 3 == 1 && j % 2 == 1)) m[i * c.Lk + j] = huge;
    const auto simds = sattn::testing::simd_target_names();
    for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
      // The fused kernel gets q, k, v in dt; the reference the same (rounded) values in float32.
      const RoundedInputs r = rounded_inputs(pb, dt);
      const Problem &in = r.in, &up = r.up;
      const FwdResult ref = run_forward(up, "reference", 2);
      const BwdResult gref = run_backward(up, ref, "reference", 2);
      for (const std::string& simd : simds) {
        if (dt != DType::kF32 && simd != simds.front()) continue;  // half inputs share the tile loops
        SCOPED_TRACE(c.name() + " bias " + std::to_string(huge) + " " + simd + " " + sattn::to_string(dt));
        const sattn::testing::ScopedSimdTarget simd_target(simd);
        const FwdResult got = run_forward(in, "fused", 2);
        EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
        EXPECT_TRUE(lse_ok(got.lse, ref.lse));
        const BwdResult g1 = run_backward(in, got, "fused", 1);
        expect_grads_near(g1, gref);
        const BwdResult g3 = run_backward(in, got, "fused", 3);
        EXPECT_TRUE(bitwise_equal(g1.dq, g3.dq) && bitwise_equal(g1.dk, g3.dk) && bitwise_equal(g1.dv, g3.dv) &&
                    bitwise_equal(g1.dmask, g3.dmask));
        if (Lq >= 256) {  // the same mask, its gradient not wanted
          Problem no_dmask = in;
          no_dmask.c.mask = 0;
          const BwdResult n1 = run_backward(no_dmask, got, "fused", 1), n3 = run_backward(no_dmask, got, "fused", 3);
          expect_grads_near(n1, BwdResult{gref.dq, gref.dk, gref.dv, {}});
          EXPECT_TRUE(bitwise_equal(n1.dq, n3.dq) && bitwise_equal(n1.dk, n3.dk) && bitwise_equal(n1.dv, n3.dv));
        }
        if (dt != DType::kF32) continue;
        // float32_precision "high" (on amx: two bf16 parts per value; elsewhere "highest"), with and without the
        // mask's gradient, within its tolerances (Float32HighTakesTwoBf16Parts); the parts on these short keys too
        const sattn::testing::ScopedEnv tiles("SATTN_FUSED_TILE_MIN_WORK", "0");
        Problem high = in;
        high.opt.float32_precision = sattn::Float32Precision::kHigh;
        const FwdResult hf = run_forward(high, "fused", 2);
        EXPECT_LE(rel_err(hf.out, ref.out), kHighTol);
        EXPECT_TRUE(lse_ok(hf.lse, ref.lse, kHighTol));
        for (const bool dmask : {true, false}) {
          high.c.mask = dmask ? 2 : 0;
          const BwdResult h1 = run_backward(high, hf, "fused", 1), h3 = run_backward(high, hf, "fused", 3);
          EXPECT_LE(max_grad_err(h1, dmask ? gref : BwdResult{gref.dq, gref.dk, gref.dv, {}}), kHighGradTol);
          EXPECT_TRUE(grads_bitwise_equal(h1, h3));
        }
      }
    }
  }
}

// Median over the elements of |got - ref| / scale[n].
double median_rel_err(const Tensor& got, const Tensor& ref, const std::vector<double>& scale) {
  const Tensor g = got.to(DType::kF64), r = ref.to(DType::kF64);
  std::vector<double> e(scale.size());
  for (size_t n = 0; n < e.size(); ++n) e[n] = std::fabs(g.data<double>()[n] - r.data<double>()[n]) / scale[n];
  std::nth_element(e.begin(), e.begin() + e.size() / 2, e.end());
  return e[e.size() / 2];
}

// The gradient of a broadcast float mask is a long sum of dS values: over B·Hq·Lq = 32768 terms for a key bias
// [Lk], over Lk = 4096 keys for a row bias [Lq, 1]. Median relative error against the fp64 reference.
// A float mask in bf16 or float16 gives what its values in float32 give: the same bits for out, lse, dq, dk, dv and
// a float32 dmask (the mask widened exactly, the same kernel), and a dmask in the mask's own dtype is the float32
// one rounded once (from the double sums, where the float32 one is rounded to float first: within one unit of the
// last place). Every SIMD target; the vector path (unit key stride: a full mask, a shared one, decode with split
// keys) and the element path (a mask broadcast along the keys, a few queries) of the fused kernel, and the reference.
TEST(Fused, HalfPrecisionMasksMatchTheirFloat32Values) {
  const int64_t shapes[][7] = {{2, 2, 2, 77, 90, 40, 0},
                               {2, 4, 2, 65, 130, 32, 1},
                               {1, 2, 2, 1, 1100, 64, 0},
                               {2, 2, 1, 3, 200, 16, 3},
                               {1, 2, 2, 50, 70, 16, 2}};
  uint32_t seed = 60;
  for (const auto& sh : shapes) {
    Case c;
    c.B = sh[0], c.Hq = sh[1], c.Hkv = sh[2], c.Lq = sh[3], c.Lk = sh[4], c.D = c.Dv = sh[5], c.mask_shape = int(sh[6]);
    c.mask = 2;
    const Problem pb = make_problem(c, seed++);
    for (const std::string& simd : sattn::testing::simd_target_names())
      for (DType dt : {DType::kBF16, DType::kF16}) {
        const sattn::testing::ScopedSimdTarget simd_target(simd);
        const std::string what = c.name() + " " + sattn::to_string(dt) + " " + simd;
        Problem half = pb, wide = pb;
        half.mask = pb.mask.to(dt), half.opt.attn_mask = half.mask.view();
        wide.mask = half.mask.to(DType::kF32), wide.opt.attn_mask = wide.mask.view();
        const FwdResult f16 = run_forward(half, "fused", 2), f32 = run_forward(wide, "fused", 2);
        EXPECT_TRUE(bitwise_equal(f16.out, f32.out) && bitwise_equal(f16.lse, f32.lse)) << what;
        const BwdResult g16 = run_backward(half, f16, "fused", 2), g32 = run_backward(wide, f32, "fused", 2);
        EXPECT_TRUE(bitwise_equal(g16.dq, g32.dq) && bitwise_equal(g16.dk, g32.dk) && bitwise_equal(g16.dv, g32.dv))
            << what;
        EXPECT_TRUE(bitwise_equal(g16.dmask, g32.dmask)) << what;
        sattn::AttentionOptions o = half.opt;
        o.kernel = "fused", o.num_threads = 2;
        Tensor dq(DType::kF32, pb.q.view.shape), dk(DType::kF32, pb.k.view.shape), dv(DType::kF32, pb.v.view.shape),
            dm(dt, pb.mask.shape());
        sattn::scaled_dot_product_attention_backward(half.dout.view, half.q.view, half.k.view, half.v.view,
                                                     f16.out.view(), f16.lse.view(), o,
                                                     {dq.view(), dk.view(), dv.view(), dm.view()});
        EXPECT_TRUE(bitwise_equal(dq, g32.dq)) << what;
        if (c.mask_shape == 0 && c.Lq > 1) {  // a strided gradient (a transposed view): the same values
          Tensor t(dt, {c.B, c.Hq, c.Lk, c.Lq});
          const TensorView tv(t.data(), dt, pb.mask.shape(), {c.Hq * c.Lk * c.Lq, c.Lk * c.Lq, 1, c.Lq});
          sattn::scaled_dot_product_attention_backward(half.dout.view, half.q.view, half.k.view, half.v.view,
                                                       f16.out.view(), f16.lse.view(), o,
                                                       {dq.view(), dk.view(), dv.view(), tv});
          EXPECT_TRUE(bitwise_equal(Tensor::from_view(tv), dm)) << what << " strided";
        }
        // and under a memory limit that leaves no room for a float32 copy of the gradient (the two-pass schedule,
        // storing element by element), against the float32 gradient of the same schedule (a bias shared by a row's
        // keys has an exact gradient of 0: its value is the schedule's rounding noise)
        Tensor dm_limited(dt, pb.mask.shape()), dm32_limited(DType::kF32, pb.mask.shape());
        o.memory_limit_bytes = 4096;
        sattn::scaled_dot_product_attention_backward(half.dout.view, half.q.view, half.k.view, half.v.view,
                                                     f16.out.view(), f16.lse.view(), o,
                                                     {dq.view(), dk.view(), dv.view(), dm_limited.view()});
        o.attn_mask = wide.opt.attn_mask;
        sattn::scaled_dot_product_attention_backward(half.dout.view, half.q.view, half.k.view, half.v.view,
                                                     f16.out.view(), f16.lse.view(), o,
                                                     {dq.view(), dk.view(), dv.view(), dm32_limited.view()});
        const double ulp = dt == DType::kBF16 ? 0x1p-8 : 0x1p-11, tiny = dt == DType::kBF16 ? 0.0 : 0x1p-24;
        for (const Tensor* t : {&dm, &dm_limited}) {
          const Tensor got = t->to(DType::kF64), want = (t == &dm ? g32.dmask : dm32_limited).to(DType::kF64);
          int64_t off = 0, nonzero = 0;
          for (int64_t x = 0; x < got.numel(); ++x) {
            const double a = got.data<double>()[x], b = want.data<double>()[x];
            off += !(std::fabs(a - b) <= ulp * std::fabs(b) + tiny);
            nonzero += b != 0.0;
          }
          EXPECT_EQ(off, 0) << what << (t == &dm ? "" : " limited");
          EXPECT_GT(nonzero, got.numel() / 4) << what;  // -inf entries (a fifth) and fully masked rows give 0
        }
        if (simd == sattn::testing::simd_target_names().front()) {
          const FwdResult r16 = run_forward(half, "reference", 1), r32 = run_forward(wide, "reference", 1);
          EXPECT_TRUE(bitwise_equal(r16.out, r32.out) && bitwise_equal(r16.lse, r32.lse)) << what;
        }
      }
  }
}

TEST(Fused, BroadcastMaskGradientIsAccurate) {
  {
    Case c;
    c.B = 2, c.Hq = 4, c.Hkv = 4, c.Lq = 4096, c.Lk = 32, c.D = 8, c.Dv = 8;
    Problem pb = make_problem(c, 21);
    pb.c.mask = 2;
    pb.mask = Tensor(DType::kF32, {c.Lk});
    std::mt19937 rng(22);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t j = 0; j < c.Lk; ++j) pb.mask.data<float>()[j] = nd(rng);
    pb.opt.attn_mask = pb.mask.view();
    const FwdResult ref = run_forward(pb, "reference", 2);
    const BwdResult gref = run_backward(pb, ref, "reference", 2);
    const BwdResult got = run_backward(pb, run_forward(pb, "fused", 2), "fused", 2);
    std::vector<double> scale(size_t(c.Lk));
    for (int64_t j = 0; j < c.Lk; ++j) scale[size_t(j)] = std::fabs(gref.dmask.data<double>()[j]);
    EXPECT_LE(median_rel_err(got.dmask, gref.dmask, scale), 1.5e-6) << "key bias [Lk]";
  }
  {
    // A bias shared by all keys of a row does not change the row's softmax: the exact gradient is 0 and the
    // reference's is rounding noise, so the error is measured against the size of the summed terms, sum_j |dS_ij|
    // (the fp64 reference's gradient of the same bias given as a full [Lq, Lk] mask).
    Case c;
    c.Lq = 32, c.Lk = 4096, c.D = 16, c.Dv = 16;
    Problem pb = make_problem(c, 23);
    pb.c.mask = 2;
    pb.mask = Tensor(DType::kF32, {c.Lq, 1});
    std::mt19937 rng(24);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int64_t i = 0; i < c.Lq; ++i) pb.mask.data<float>()[i] = nd(rng);
    Problem full = pb;
    full.mask = Tensor(DType::kF32, {c.Lq, c.Lk});
    for (int64_t x = 0; x < full.mask.numel(); ++x) full.mask.data<float>()[x] = pb.mask.data<float>()[x / c.Lk];
    full.opt.attn_mask = full.mask.view();
    pb.opt.attn_mask = pb.mask.view();
    const FwdResult ref = run_forward(pb, "reference", 2);
    const BwdResult gref = run_backward(pb, ref, "reference", 2);
    const BwdResult ds = run_backward(full, run_forward(full, "reference", 2), "reference", 2);
    const BwdResult got = run_backward(pb, run_forward(pb, "fused", 2), "fused", 2);
    std::vector<double> scale(size_t(c.Lq), 0.0);
    for (int64_t x = 0; x < ds.dmask.numel(); ++x) scale[size_t(x / c.Lk)] += std::fabs(ds.dmask.data<double>()[x]);
    EXPECT_LE(median_rel_err(got.dmask, gref.dmask, scale), 1.5e-6) << "row bias [Lq, 1]";
  }
}

}  // namespace

namespace {

TEST(FusedDecode, SplitKeysMatchReference) {
  using sattn::Causal;
  std::vector<Case> cs;
  const int64_t shapes[][4] = {{1, 1100, 64, 64}, {5, 1537, 33, 20}, {16, 2048, 128, 128},
                               {3, 1030, 7, 9},   {2, 300, 17, 40},  {4, 64, 16, 16}};
  int n = 0;
  for (const auto& s : shapes)
    for (int variant = 0; variant < 4; ++variant, ++n) {
      constexpr int64_t kv_heads[] = {2, 2, 1, 4};  // GQA groups of 2 and 4, and none
      Case c;
      c.B = 2, c.Hq = 4, c.Hkv = kv_heads[variant], c.Lq = s[0], c.Lk = s[1], c.D = s[2], c.Dv = s[3];
      c.causal = variant == 1 ? Causal::kBottomRight : Causal::kNone;
      c.mask = n % 3, c.mask_shape = n % 4, c.padding = (n + 1) % 3, c.dropout = variant == 2 ? 0.2 : 0.0;
      c.strided = variant == 0;
      cs.push_back(c);
    }
  uint32_t seed = 100;
  for (const Case& c : cs) {
    const Problem pb = make_problem(c, ++seed);
    const FwdResult ref = run_forward(pb, "reference", 2);
    for (const std::string& simd : sattn::testing::simd_target_names()) {
      SCOPED_TRACE(c.name() + " " + simd);
      const sattn::testing::ScopedSimdTarget simd_target(simd);
      const FwdResult got = run_forward(pb, "fused", 2);
      EXPECT_LE(rel_err(got.out, ref.out), 2e-5);
      EXPECT_LE(rel_err(got.lse, ref.lse), 2e-5);
      const FwdResult one = run_forward(pb, "fused", 1), three = run_forward(pb, "fused", 3);
      EXPECT_TRUE(bitwise_equal(one.out, got.out) && bitwise_equal(three.out, got.out));
      EXPECT_TRUE(bitwise_equal(one.lse, got.lse) && bitwise_equal(three.lse, got.lse));
      // The split-key decode (Lk >= 1024) with bf16 and float16 K and V (read in place by the keys-in-lanes kernel,
      // widened in registers): what their float32 values give (the decode computes in float32; bitwise but for the
      // scalar tails of D and Dv past whole vectors, which the compiler may contract into FMAs differently)
      for (DType dt : {DType::kBF16, DType::kF16}) {
        if (c.Lk < 1024) break;
        const RoundedInputs r = rounded_inputs(pb, dt);
        const FwdResult half = run_forward(r.in, "fused", 2), upcast = run_forward(r.up, "fused", 2);
        if (c.D % 16 == 0 && c.Dv % 16 == 0) {
          EXPECT_TRUE(bitwise_equal(half.out, upcast.out) && bitwise_equal(half.lse, upcast.lse))
              << sattn::to_string(dt);
        }
        EXPECT_LE(rel_err(half.out, upcast.out), 1e-6) << sattn::to_string(dt);
        EXPECT_LE(rel_err(half.lse, upcast.lse), 1e-6) << sattn::to_string(dt);
      }
    }
  }
}

// Attention over keys [0, a) and [a, Lk) merged equals attention over all keys.
TEST(MergePartials, MatchesAttentionOverTheUnion) {
  Case c;
  c.B = 2, c.Hq = 3, c.Hkv = 3, c.Lq = 9, c.Lk = 50, c.D = 16, c.Dv = 12;
  const Problem pb = make_problem(c, 11);
  const FwdResult full = run_forward(pb, "fused", 1);
  std::vector<Tensor> outs, lses;
  for (auto [j0, j1] : {std::pair<int64_t, int64_t>{0, 20}, {20, 50}}) {
    auto slice = [&](const TensorView& t) {
      TensorView s = t;
      s.data = static_cast<float*>(t.data) + j0 * t.strides[2];
      s.shape[2] = j1 - j0;
      return s;
    };
    sattn::AttentionOptions o;
    o.kernel = "fused";
    Tensor out(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv}), lse(DType::kF32, {c.B, c.Hq, c.Lq});
    sattn::scaled_dot_product_attention(pb.q.view, slice(pb.k.view), slice(pb.v.view), o, {out.view(), lse.view(), {}});
    outs.push_back(out), lses.push_back(lse);
  }
  // One more partial, with no allowed key, is ignored.
  Tensor empty_out(DType::kF32, {c.B, c.Hq, c.Lq, c.Dv}), empty_lse(DType::kF32, {c.B, c.Hq, c.Lq});
  for (int64_t x = 0; x < empty_lse.numel(); ++x) empty_lse.data<float>()[x] = -std::numeric_limits<float>::infinity();
  for (int64_t x = 0; x < empty_out.numel(); ++x) empty_out.data<float>()[x] = 123.f;
  outs.push_back(empty_out), lses.push_back(empty_lse);
  std::vector<TensorView> ov(outs.begin(), outs.end()), lv(lses.begin(), lses.end());
  const auto merged = sattn::merge_attention_partials(ov, lv);
  EXPECT_LE(rel_err(merged.out, full.out), 2e-6);
  EXPECT_LE(rel_err(merged.lse, full.lse), 2e-6);
  // All partials empty: (0, -inf).
  const auto none = sattn::merge_attention_partials({empty_out.view()}, {empty_lse.view()});
  EXPECT_EQ(max_abs(none.out), 0.0);
  EXPECT_EQ(none.lse.data<float>()[0], -std::numeric_limits<float>::infinity());
  EXPECT_THROW(sattn::merge_attention_partials({empty_out.view()}, {}), sattn::Error);
  // A partial of a NaN row (lse NaN) makes the row NaN, next to a normal partial and next to an empty one.
  Tensor nan_lse = lses[0].to(DType::kF32);
  nan_lse.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  for (const Tensor& other : {lses[1], empty_lse}) {
    const auto m = sattn::merge_attention_partials({outs[0].view(), empty_out.view()}, {nan_lse.view(), other.view()});
    EXPECT_TRUE(std::isnan(m.lse.data<float>()[1]));
    for (int64_t x = 0; x < c.Dv; ++x) EXPECT_TRUE(std::isnan(m.out.data<float>()[c.Dv + x]));
    EXPECT_FALSE(std::isnan(m.lse.data<float>()[0]));
  }
}

}  // namespace

// The shared oracle sweep (independent fp64 implementation, pairwise-covering configurations) on the fused kernel.
#include "oracle.hpp"
SATTN_ORACLE_SWEEP(FusedOracleF32, "fused", sattn::DType::kF32);

// bf16 q, k, v with out, dq, dk, dv in bf16 (the rounded bf16 products on the targets that have them, see
// Bf16OutputsRoundPAndDsOnce) over the oracle's backward configurations (huge-bias and lowest() masks among them)
// and its NaN-row configurations on every SIMD target; additive masks without their gradient, so that the backward
// takes its one pass. Tolerance 1e-2 (forward; the harness multiplies it by 5 for the backward, 5e-2), below the
// harness's bf16 default of 3e-2. Without the configurations of a single key: there the exact dk is 0, and each
// dS = P (dP − Di) is the difference of two O(1) values whose Di = dO · out takes out as stored, in bf16; under
// dropout (out = v / (1 − p), inexact in bf16) dk then sums Lq rounding residues of out against 0, as much with
// float32 products as with the rounded ones (it would be a test of a bf16 out, not of the products).
std::vector<sattn::testing::Config> backward_configs_with_several_keys() {
  std::vector<sattn::testing::Config> cs;
  for (const auto& c : sattn::testing::pairwise_backward_configs())
    if (c.len_k > 1) cs.push_back(c);
  return cs;
}
class FusedOracleBf16Out : public ::testing::TestWithParam<sattn::testing::Config> {};
TEST_P(FusedOracleBf16Out, MatchNaiveFp64OnEverySimdTarget) {
  const auto problem = sattn::testing::make_problem(GetParam(), sattn::DType::kBF16);
  sattn::testing::CheckOptions co;
  co.kernel = "fused";
  co.out_dtype = sattn::DType::kBF16;
  co.mask_grad = false;
  co.weights = false;
  co.tol = 1e-2;
  const sattn::testing::ScopedEnv tiles("SATTN_FUSED_TILE_MIN_WORK", "0");  // the bf16 products on short keys too
  bool skipped = false;
  EXPECT_TRUE(sattn::testing::check_every_simd_target(problem, co, &skipped));
  if (skipped) GTEST_SKIP() << "fused does not support " << GetParam().name();
}
INSTANTIATE_TEST_SUITE_P(Pairwise, FusedOracleBf16Out, ::testing::ValuesIn(backward_configs_with_several_keys()),
                         sattn::testing::ConfigName());
INSTANTIATE_TEST_SUITE_P(NanRows, FusedOracleBf16Out, ::testing::ValuesIn(sattn::testing::nan_row_configs()),
                         sattn::testing::ConfigName());
