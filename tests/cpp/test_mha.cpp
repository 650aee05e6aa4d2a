// nn::MultiheadAttention: against a plain double-precision transcription of PyTorch 2.x's
// F.multi_head_attention_forward on its need_weights=True path (explicit softmax; written here, only as the test
// oracle), layouts, masks, the is_causal hint, errors, weights I/O. Parity with torch itself is tested in
// tests/python/test_mha.py.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <random>
#include <string>

#include "sattn/mha.hpp"
#include "sattn/safetensors.hpp"

namespace {

using sattn::DType;
using sattn::Shape;
using sattn::Tensor;
using sattn::TensorView;
using sattn::nn::MultiheadAttention;

Tensor randn(DType dt, Shape shape, uint32_t seed, double scale = 1.0) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, scale);
  Tensor t(DType::kF64, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = nd(rng);
  return t.to(dt);
}

Tensor random_bool(Shape shape, uint32_t seed, double p_true) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  Tensor t(DType::kBool, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<uint8_t>()[i] = u(rng) < p_true;
  return t;
}

double at(const Tensor& t, std::initializer_list<int64_t> idx) { return t.view().get(idx); }

struct Config {
  int64_t E = 8, H = 2, N = 2, L = 3, S = 5;
  std::optional<int64_t> kdim, vdim;
  bool bias = true, add_bias_kv = false, add_zero_attn = false;
};

// Plain double transcription of torch 2.x's MHA math (need_weights=True path) for seq-first batched input; bool
// masks, True = masked.
// attn_mask: empty, [L, S] or [N*H, L, S]; kpm: empty or bool [N, S]. Returns out [L, N, E], weights [N, H, L, S'].
std::pair<Tensor, Tensor> oracle(const MultiheadAttention& m, const Config& c, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor* attn_mask, const Tensor* kpm) {
  std::map<std::string, Tensor> p;
  for (auto& [n, t] : m.state_dict()) p[n] = t.to(DType::kF64);
  const int64_t E = c.E, H = c.H, N = c.N, L = c.L, S = c.S, hd = E / H;
  const int64_t kd = m.kdim(), vd = m.vdim();
  const int64_t Sp = S + c.add_bias_kv + c.add_zero_attn;
  const bool packed = m.qkv_same_embed_dim();
  auto W = [&](int which, int64_t o, int64_t i) {
    if (packed) return p["in_proj_weight"].data<double>()[(which * E + o) * E + i];
    const char* names[] = {"q_proj_weight", "k_proj_weight", "v_proj_weight"};
    const int64_t in = which == 0 ? E : which == 1 ? kd : vd;
    return p[names[which]].data<double>()[o * in + i];
  };
  auto B = [&](int which, int64_t o) { return c.bias ? p["in_proj_bias"].data<double>()[which * E + o] : 0.0; };
  std::vector<double> Q(N * L * E), K(N * Sp * E, 0.0), V(N * Sp * E, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t l = 0; l < L; ++l)
      for (int64_t o = 0; o < E; ++o) {
        double s = B(0, o);
        for (int64_t i = 0; i < E; ++i) s += at(q, {l, n, i}) * W(0, o, i);
        Q[(n * L + l) * E + o] = s;
      }
    for (int64_t j = 0; j < S; ++j)
      for (int64_t o = 0; o < E; ++o) {
        double sk = B(1, o), sv = B(2, o);
        for (int64_t i = 0; i < kd; ++i) sk += at(k, {j, n, i}) * W(1, o, i);
        for (int64_t i = 0; i < vd; ++i) sv += at(v, {j, n, i}) * W(2, o, i);
        K[(n * Sp + j) * E + o] = sk;
        V[(n * Sp + j) * E + o] = sv;
      }
    if (c.add_bias_kv)
      for (int64_t o = 0; o < E; ++o) {
        K[(n * Sp + S) * E + o] = p["bias_k"].data<double>()[o];
        V[(n * Sp + S) * E + o] = p["bias_v"].data<double>()[o];
      }
  }
  Tensor weights(DType::kF64, {N, H, L, Sp});
  std::vector<double> attn(N * L * E, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t l = 0; l < L; ++l) {
        std::vector<double> s(Sp);
        double mx = -INFINITY;
        for (int64_t j = 0; j < Sp; ++j) {
          double d = 0;
          for (int64_t e = 0; e < hd; ++e) d += Q[(n * L + l) * E + h * hd + e] * K[(n * Sp + j) * E + h * hd + e];
          d /= std::sqrt(double(hd));
          bool masked = false;
          if (j < S && attn_mask)
            masked = attn_mask->dim() == 2 ? at(*attn_mask, {l, j}) != 0 : at(*attn_mask, {n * H + h, l, j}) != 0;
          if (j < S && kpm) masked = masked || at(*kpm, {n, j}) != 0;
          s[j] = masked ? -INFINITY : d;
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (double& x : s) z += (x = std::exp(x - mx));
        for (int64_t j = 0; j < Sp; ++j) {
          const double w = s[j] / z;
          weights.data<double>()[((n * H + h) * L + l) * Sp + j] = w;
          for (int64_t e = 0; e < hd; ++e) attn[(n * L + l) * E + h * hd + e] += w * V[(n * Sp + j) * E + h * hd + e];
        }
      }
  Tensor out(DType::kF64, {L, N, E});
  for (int64_t n = 0; n < N; ++n)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t o = 0; o < E; ++o) {
        double s = c.bias ? p["out_proj.bias"].data<double>()[o] : 0.0;
        for (int64_t i = 0; i < E; ++i) s += attn[(n * L + l) * E + i] * p["out_proj.weight"].data<double>()[o * E + i];
        out.data<double>()[(l * N + n) * E + o] = s;
      }
  return {out, weights};
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  if (a.shape() != b.shape()) return INFINITY;
  const Tensor x = a.to(DType::kF64), y = b.to(DType::kF64);
  double d = 0;
  for (int64_t i = 0; i < x.numel(); ++i) d = std::max(d, std::abs(x.data<double>()[i] - y.data<double>()[i]));
  return d;
}

// Random non-zero parameters (torch initialises biases to 0, which would hide bias bugs).
void perturb(MultiheadAttention& m, uint32_t seed) {
  std::map<std::string, Tensor> sd;
  uint32_t s = seed;
  for (auto& [n, t] : m.state_dict()) sd[n] = randn(m.dtype(), t.shape(), ++s, 0.3);
  m.load_state_dict(sd);
}

class MhaOracle : public ::testing::TestWithParam<std::tuple<int, DType>> {};

TEST_P(MhaOracle, MatchesPlainTranscription) {
  const auto [variant, dt] = GetParam();
  Config c;
  c.kdim = variant % 2 ? std::optional<int64_t>(5) : std::nullopt;
  c.vdim = variant % 3 == 2 ? std::optional<int64_t>(3) : c.kdim;
  c.bias = variant != 4;
  c.add_bias_kv = variant % 4 >= 2;
  c.add_zero_attn = variant >= 3;
  MultiheadAttention m(c.E, c.H, 0.0, c.bias, c.add_bias_kv, c.add_zero_attn, c.kdim, c.vdim, false, dt, 11);
  perturb(m, 100 + variant);
  const Tensor q = randn(dt, {c.L, c.N, c.E}, 1), k = randn(dt, {c.S, c.N, m.kdim()}, 2),
               v = randn(dt, {c.S, c.N, m.vdim()}, 3);
  Tensor am = random_bool(variant % 2 ? Shape{c.N * c.H, c.L, c.S} : Shape{c.L, c.S}, 4 + variant, 0.3);
  Tensor kpm = random_bool({c.N, c.S}, 9 + variant, 0.3);
  for (int64_t i = 0; i < am.numel(); i += c.S) am.data<uint8_t>()[i] = 0;  // key 0 always allowed
  for (int64_t n = 0; n < c.N; ++n) kpm.data<uint8_t>()[n * c.S] = 0;
  auto [out, w] = m.forward(q, k, v, kpm, true, am, false);
  auto [ref_out, ref_w] = oracle(m, c, q, k, v, &am, &kpm);
  const double tol = dt == DType::kF64 ? 1e-12 : 1e-5;
  ASSERT_TRUE(w.has_value());
  EXPECT_LE(max_abs_diff(out, ref_out), tol);
  EXPECT_LE(max_abs_diff(*w, ref_w), tol);
  // Averaged weights are the mean over heads.
  auto [out2, wavg] = m.forward(q, k, v, kpm, true, am, true);
  ASSERT_EQ(wavg->shape(), (Shape{c.N, c.L, ref_w.size(3)}));
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t l = 0; l < c.L; ++l)
      for (int64_t j = 0; j < ref_w.size(3); ++j) {
        double s = 0;
        for (int64_t h = 0; h < c.H; ++h) s += at(ref_w, {n, h, l, j});
        EXPECT_NEAR(at(*wavg, {n, l, j}), s / double(c.H), tol);
      }
  EXPECT_EQ(max_abs_diff(out, out2), 0.0);
}

INSTANTIATE_TEST_SUITE_P(Variants, MhaOracle,
                         ::testing::Combine(::testing::Range(0, 6), ::testing::Values(DType::kF32, DType::kF64)),
                         [](const auto& info) {
                           return sattn::message::concat("v", std::get<0>(info.param),
                                                         std::get<1>(info.param) == DType::kF64 ? "_f64" : "_f32");
                         });

TEST(Mha, LayoutsAgree) {
  MultiheadAttention seq(12, 3, 0.0, true, false, false, std::nullopt, std::nullopt, false, DType::kF32, 1);
  MultiheadAttention bf = seq;
  bf = MultiheadAttention(12, 3, 0.0, true, false, false, std::nullopt, std::nullopt, true, DType::kF32, 1);
  perturb(seq, 5);
  std::map<std::string, Tensor> sd;
  for (auto& [n, t] : seq.state_dict()) sd[n] = t;
  bf.load_state_dict(sd);
  const Tensor x = randn(DType::kF32, {4, 2, 12}, 7);                     // [L, N, E]
  const TensorView x_bf(x.data(), DType::kF32, {2, 4, 12}, {12, 24, 1});  // the same data as [N, L, E]
  auto [o1, w1] = seq.forward(x, x, x);
  auto [o2, w2] = bf.forward(x_bf, x_bf, x_bf);
  EXPECT_EQ(max_abs_diff(Tensor::from_view(TensorView(o2.data(), DType::kF32, {4, 2, 12}, {12, 48, 1})), o1), 0.0);
  EXPECT_EQ(max_abs_diff(*w1, *w2), 0.0);
  // Unbatched == batch of one.
  const TensorView x0(x.data(), DType::kF32, {4, 12}, {24, 1});
  auto [o3, w3] = seq.forward(x0, x0, x0, {}, true, {}, false);
  EXPECT_EQ(o3.shape(), (Shape{4, 12}));
  EXPECT_EQ(w3->shape(), (Shape{3, 4, 4}));
  auto [o4, w4] = seq.forward(TensorView(x.data(), DType::kF32, {4, 1, 12}, {24, 12, 1}),
                              TensorView(x.data(), DType::kF32, {4, 1, 12}, {24, 12, 1}),
                              TensorView(x.data(), DType::kF32, {4, 1, 12}, {24, 12, 1}), {}, true, {}, false);
  EXPECT_EQ(max_abs_diff(o3, o4.reshape({4, 12})), 0.0);
  EXPECT_EQ(max_abs_diff(*w3, w4->reshape({3, 4, 4})), 0.0);
}

TEST(Mha, BoolMaskEqualsMinusInfinityAndFullyMaskedRowsAreZero) {
  MultiheadAttention m(8, 2);
  perturb(m, 3);
  const Tensor x = randn(DType::kF32, {5, 2, 8}, 8);
  Tensor am = random_bool({5, 5}, 1, 0.4);
  for (int64_t j = 0; j < 5; ++j) am.data<uint8_t>()[2 * 5 + j] = 1;  // row 2: nothing allowed
  for (int64_t i = 0; i < 5; ++i)
    if (i != 2) am.data<uint8_t>()[i * 5] = 0;
  Tensor fm(DType::kF32, {5, 5});
  for (int64_t i = 0; i < 25; ++i) fm.data<float>()[i] = am.data<uint8_t>()[i] ? -INFINITY : 0.0f;
  auto [ob, wb] = m.forward(x, x, x, {}, true, am);
  auto [of, wf] = m.forward(x, x, x, {}, true, fm);
  EXPECT_EQ(max_abs_diff(ob, of), 0.0);
  EXPECT_EQ(max_abs_diff(*wb, *wf), 0.0);
  std::map<std::string, Tensor> sd;
  for (auto& [n, t] : m.state_dict()) sd[n] = t;
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t e = 0; e < 8; ++e) {
      EXPECT_FLOAT_EQ(float(at(ob, {2, n, e})), sd["out_proj.bias"].data<float>()[e]);  // attention 0
      EXPECT_TRUE(std::isfinite(at(ob, {0, n, e})));
    }
  for (int64_t n = 0; n < 2; ++n)
    for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(at(*wb, {n, 2, j}), 0.0);
}

void expect_error(const std::function<void()>& f, sattn::ErrorKind kind, std::initializer_list<const char*> needles) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const sattn::Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.what();
    for (const char* n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(Mha, StateDictErrorsNameTheKey) {
  MultiheadAttention m(8, 2, 0.0, true, true);
  std::map<std::string, Tensor> sd;
  for (auto& [n, t] : m.state_dict()) sd[n] = t;
  auto missing = sd;
  missing.erase("bias_v");
  expect_error([&] { m.load_state_dict(missing); }, sattn::ErrorKind::kInvalidArgument, {"missing", "'bias_v'"});
  auto extra = sd;
  extra["k_proj_weight"] = Tensor(DType::kF32, {8, 8});
  expect_error([&] { m.load_state_dict(extra); }, sattn::ErrorKind::kInvalidArgument,
               {"unexpected", "'k_proj_weight'"});
  auto shaped = sd;
  shaped["in_proj_bias"] = Tensor(DType::kF32, {8});
  expect_error([&] { m.load_state_dict(shaped); }, sattn::ErrorKind::kInvalidArgument,
               {"'in_proj_bias'", "expected shape [24]", "got [8]"});
  auto typed = sd;
  typed["in_proj_bias"] = Tensor(DType::kI32, {24});
  expect_error([&] { m.load_state_dict(typed); }, sattn::ErrorKind::kTypeError, {"'in_proj_bias'"});
}

TEST(Mha, ConstructorAndForwardErrors) {
  expect_error([] { MultiheadAttention(10, 4); }, sattn::ErrorKind::kInvalidArgument, {"divisible by num_heads"});
  expect_error([] { MultiheadAttention(8, 2, -0.1); }, sattn::ErrorKind::kInvalidArgument, {"dropout"});
  expect_error([] { MultiheadAttention(8, 2, 0.0, true, false, false, 0); }, sattn::ErrorKind::kInvalidArgument,
               {"kdim"});
  MultiheadAttention m(8, 2);
  const Tensor x = randn(DType::kF32, {3, 2, 8}, 1);
  expect_error(
      [&] {
        m.forward(randn(DType::kF32, {3, 2, 7}, 1), x, x);
      },
      sattn::ErrorKind::kInvalidArgument, {"query", "embed_dim = 8", "[3, 2, 7]"});
  expect_error(
      [&] {
        m.forward(x, randn(DType::kF32, {3, 3, 8}, 1), randn(DType::kF32, {3, 3, 8}, 1));
      },
      sattn::ErrorKind::kInvalidArgument, {"batch size N = 2"});
  expect_error(
      [&] {
        m.forward(x, x, x, Tensor(DType::kBool, {2, 4}));
      },
      sattn::ErrorKind::kInvalidArgument, {"key_padding_mask", "[2, 3]", "[2, 4]"});
  expect_error(
      [&] {
        m.forward(x, x, x, {}, true, Tensor(DType::kBool, {3, 4}));
      },
      sattn::ErrorKind::kInvalidArgument, {"attn_mask", "[3, 3]", "[4, 3, 3]", "[3, 4]"});
  expect_error([&] { m.forward(x, x, x, {}, true, {}, true, true); }, sattn::ErrorKind::kInvalidArgument,
               {"is_causal", "requires attn_mask"});
  expect_error(
      [&] {
        m.forward(x, x, x, {}, true, Tensor(DType::kI32, {3, 3}));
      },
      sattn::ErrorKind::kTypeError, {"attn_mask", "expected bool", "got int32"});
  expect_error([&] { m.forward(x.to(DType::kI32), x, x); }, sattn::ErrorKind::kTypeError, {"query"});
  expect_error(
      [&] {
        m.forward(Tensor(DType::kF32, {0, 2, 8}), x, x);
      },
      sattn::ErrorKind::kInvalidArgument, {"zero-size"});
  expect_error([&] { m.forward(TensorView(), x, x); }, sattn::ErrorKind::kInvalidArgument, {"query"});
}

// torch 2.x accepts only bool and floating masks ("only bool and floating types of attn_mask are supported"; uint8
// was deprecated before), and a float mask must have the query's dtype.
TEST(Mha, MaskDtypesAsTorch2) {
  MultiheadAttention m(8, 2);
  const Tensor x = randn(DType::kF32, {3, 2, 8}, 1);
  Tensor am_u8(DType::kU8, {3, 3}), kpm_u8(DType::kU8, {2, 3});
  expect_error([&] { m.forward(x, x, x, {}, true, am_u8); }, sattn::ErrorKind::kTypeError,
               {"attn_mask: expected bool (True = may NOT attend) or a float mask of the query's dtype (float32",
                "got uint8", "only bool and floating"});
  expect_error([&] { m.forward(x, x, x, kpm_u8); }, sattn::ErrorKind::kTypeError,
               {"key_padding_mask: expected bool (True = padding)", "got uint8"});
  expect_error([&] { m.forward(x, x, x, {}, false, am_u8); }, sattn::ErrorKind::kTypeError, {"attn_mask", "uint8"});
  expect_error(
      [&] {
        m.forward(x, x, x, {}, true, Tensor(DType::kF64, {3, 3}));
      },
      sattn::ErrorKind::kTypeError, {"attn_mask: a float mask must have the query's dtype (float32), got float64"});
  expect_error(
      [&] {
        m.forward(x, x, x, Tensor(DType::kF16, {2, 3}));
      },
      sattn::ErrorKind::kTypeError,
      {"key_padding_mask: a float mask must have the query's dtype (float32), got float16"});
  MultiheadAttention m64(8, 2, 0.0, true, false, false, std::nullopt, std::nullopt, false, DType::kF64);
  const Tensor x64 = x.to(DType::kF64);
  expect_error(
      [&] {
        m64.forward(x64, x64, x64, Tensor(DType::kF32, {2, 3}), false);
      },
      sattn::ErrorKind::kTypeError, {"key_padding_mask", "(float64), got float32"});
  // Same-dtype float and bool masks are accepted (a bool mask with a float32 or float64 query).
  EXPECT_NO_THROW(m64.forward(x64, x64, x64, Tensor(DType::kBool, {2, 3}), true, Tensor(DType::kF64, {3, 3})));
  EXPECT_NO_THROW(m.forward(x, x, x, Tensor(DType::kF32, {2, 3}), true, Tensor(DType::kBool, {3, 3})));
}

// is_causal: torch 2.x's hint that attn_mask is the causal mask (masked exactly where j > i). A correct hint gives
// the masked result (run as top-left causal attention); a wrong one, or one with appended keys, is refused.
TEST(Mha, IsCausalHint) {
  Config c;
  c.L = 4;
  c.S = 6;
  c.kdim = 5;
  c.vdim = 3;
  MultiheadAttention m(c.E, c.H, 0.0, true, false, false, c.kdim, c.vdim, false, DType::kF64, 2);
  perturb(m, 40);
  const Tensor q = randn(DType::kF64, {c.L, c.N, c.E}, 1), k = randn(DType::kF64, {c.S, c.N, 5}, 2),
               v = randn(DType::kF64, {c.S, c.N, 3}, 3);
  Tensor causal(DType::kBool, {c.L, c.S}), causal_f(DType::kF64, {c.L, c.S});
  for (int64_t i = 0; i < c.L; ++i)
    for (int64_t j = 0; j < c.S; ++j) {
      causal.data<uint8_t>()[i * c.S + j] = j > i;
      causal_f.data<double>()[i * c.S + j] = j > i ? -INFINITY : 0.0;
    }
  const TensorView causal3(causal.data(), DType::kBool, {c.N * c.H, c.L, c.S}, {0, c.S, 1});  // every slice
  Tensor kpm = random_bool({c.N, c.S}, 5, 0.3);
  kpm.data<uint8_t>()[0] = kpm.data<uint8_t>()[c.S] = 0;
  auto [ref_out, ref_w] = oracle(m, c, q, k, v, &causal, &kpm);
  for (const TensorView& am : {causal.view(), causal_f.view(), causal3})
    for (bool need_weights : {true, false}) {
      auto [out, w] = m.forward(q, k, v, kpm, need_weights, am, false, /*is_causal=*/true);
      EXPECT_LE(max_abs_diff(out, ref_out), 1e-12);
      if (need_weights) {
        EXPECT_LE(max_abs_diff(*w, ref_w), 1e-12);
      }
      auto [out_nohint, w_nohint] = m.forward(q, k, v, kpm, need_weights, am, false, false);
      EXPECT_LE(max_abs_diff(out, out_nohint), 1e-12);
    }
  // A wrong hint names the first element that differs from the causal mask.
  Tensor wrong = Tensor::from_view(causal.view());
  wrong.data<uint8_t>()[1 * c.S + 3] = 0;
  expect_error([&] { m.forward(q, k, v, {}, false, wrong, true, true); }, sattn::ErrorKind::kInvalidArgument,
               {"is_causal", "attn_mask[1, 3] = False, expected True", "pass is_causal=False"});
  Tensor bias = Tensor::from_view(causal_f.view());
  bias.data<double>()[2 * c.S + 1] = 0.5;  // a finite bias below the diagonal: not the causal mask either
  expect_error([&] { m.forward(q, k, v, {}, true, bias, true, true); }, sattn::ErrorKind::kInvalidArgument,
               {"attn_mask[2, 1] = 0.5, expected 0"});
  Tensor wrong3 = Tensor::from_view(causal3);
  wrong3.data<uint8_t>()[(3 * c.L + 0) * c.S + 0] = 1;
  expect_error([&] { m.forward(q, k, v, {}, true, wrong3, true, true); }, sattn::ErrorKind::kInvalidArgument,
               {"attn_mask[3, 0, 0] = True, expected False"});
  // The mask alone (no hint) is applied as given.
  EXPECT_NO_THROW(m.forward(q, k, v, {}, true, wrong, true, false));
  for (bool zero_attn : {false, true}) {
    MultiheadAttention appended(8, 2, 0.0, true, !zero_attn, zero_attn);
    const Tensor x = randn(DType::kF32, {4, 2, 8}, 6);
    Tensor sq(DType::kBool, {4, 4});
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 4; ++j) sq.data<uint8_t>()[i * 4 + j] = j > i;
    expect_error([&] { appended.forward(x, x, x, {}, false, sq, true, true); }, sattn::ErrorKind::kInvalidArgument,
                 {"is_causal: not supported with add_bias_kv or add_zero_attn"});
    EXPECT_NO_THROW(appended.forward(x, x, x, {}, false, sq, true, false));
  }
}

TEST(Mha, SafetensorsRoundTripAndDropout) {
  MultiheadAttention a(8, 2, 0.25, true, true, true, 6, 4, true, DType::kF64, 3);
  const auto path =
      (std::filesystem::temp_directory_path() / ("sattn_mha_" + std::to_string(::getpid()) + ".safetensors")).string();
  a.save_safetensors(path);
  MultiheadAttention b(8, 2, 0.25, true, true, true, 6, 4, true, DType::kF64, 99);
  b.load_safetensors(path);
  std::filesystem::remove(path);
  a.eval();
  b.eval();
  const Tensor q = randn(DType::kF64, {2, 3, 8}, 1), k = randn(DType::kF64, {2, 4, 6}, 2),
               v = randn(DType::kF64, {2, 4, 4}, 3);
  EXPECT_EQ(max_abs_diff(a.forward(q, k, v).first, b.forward(q, k, v).first), 0.0);
  // Training: dropout changes the output, reproducibly from the dropout seed.
  a.train();
  a.set_dropout_seed(7);
  const Tensor t1 = a.forward(q, k, v).first, t2 = a.forward(q, k, v).first;
  a.set_dropout_seed(7);
  const Tensor t3 = a.forward(q, k, v).first;
  EXPECT_GT(max_abs_diff(t1, t2), 0.0);
  EXPECT_EQ(max_abs_diff(t1, t3), 0.0);
  EXPECT_GT(max_abs_diff(t1, b.forward(q, k, v).first), 0.0);
}

}  // namespace
