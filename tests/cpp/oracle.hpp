// The oracle harness: random attention problems over a pairwise-covering sweep of configurations, an
// independent naive fp64 implementation (forward and analytic backward, written here from the math, never
// calling the library's reference), and a relative compare helper.
//
// Any kernel can run the same sweep by name (AttentionOptions::kernel) with one line in its test file:
//
//   SATTN_ORACLE_SWEEP(FusedOracle, "fused", sattn::DType::kF32)
//
// which instantiates FusedOracleForward (pairwise_configs(), out + lse + weights where the kernel returns them),
// FusedOracleBackward (pairwise_backward_configs(), dq/dk/dv/dmask) and FusedOracleNanRows (nan_row_configs(),
// forward and backward on every SIMD target of the CPU); configurations the kernel does not support are reported
// as skipped. For other tolerances or options, call make_problem + check_forward /
// check_backward from your own TEST_P (see SATTN_ORACLE_SWEEP below).
//
// Tolerances are relative: ||actual - expected||_inf <= tol * max(1, ||expected||_inf); non-finite values
// (lse = -inf of a fully masked row, NaN of a row whose scores contain NaN) must match exactly.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "sattn/attention.hpp"

namespace sattn::testing {

// The attn_mask of a configuration: its kind and shape (right-aligned against [B, Hq, Lq, Lk]).
enum class MaskCase : uint8_t {
  kNone,
  kBool2D,       // bool [Lq, Lk]
  kBool4D,       // bool [B, Hq, Lq, Lk]
  kBoolKeys,     // bool [B, 1, 1, Lk]
  kBoolRows,     // bool [Hq, Lq, 1]
  kAdd2D,        // f32 additive [Lq, Lk], finite biases and some -inf
  kAdd4D,        // f32 additive [B, Hq, Lq, Lk], finite biases and some -inf
  kAddHeadKeys,  // f32 additive [Hq, 1, Lk], finite biases and some -inf
  kAddKeys64,    // f64 additive [Lk], finite biases only
  kAddHuge2D,    // f32 additive [Lq, Lk]: rows i % 3 == 0 carry -1e30 on every key (a huge finite bias, so that
                 // the softmax is uniform and lse cannot hold log Lk in float), rows i % 3 == 1 on every other key
  kAddMinB1QK,   // f32 additive [B, 1, Lq, Lk] of 0 / float lowest() ("finfo.min as mask"): in batch 0 the even
                 // rows are lowest() on every key, elsewhere 30 % of the keys are
};
inline constexpr int kMaskCaseCount = 11;
const char* to_string(MaskCase m);
bool is_additive(MaskCase m);

// Where a configuration puts a NaN (nan_row_configs()); a NaN score makes its whole query row NaN.
enum class NanCase : uint8_t {
  kNone,
  kQuery,  // q rows (b 0, h 0, i Lq/2) and (B-1, Hq-1, Lq-1)
  kKey,    // k row (b 0, kv head 0, j Lk/3): NaN in every row that may attend to it
  kMask,   // the additive mask's middle element (of its own shape)
};
const char* to_string(NanCase n);

struct Config {
  int64_t batch = 1, heads_q = 1, heads_kv = 1, len_q = 7, len_k = 7, head_dim = 8, head_dim_v = 8;
  bool strided = false;  // q/k/v (and the mask) are non-contiguous views
  MaskCase mask = MaskCase::kNone;
  KeyPaddingKind key_padding = KeyPaddingKind::kNone;
  Causal causal = Causal::kNone;
  bool fully_masked = false;  // force at least one fully masked row (needs a mask or key padding)
  double dropout_p = 0.0;
  bool custom_scale = false;  // scale = 0.37 instead of 1/sqrt(D)
  NanCase nan = NanCase::kNone;

  std::string name() const;  // a gtest-safe identifier
  double cost() const { return double(batch) * heads_q * len_q * len_k * (head_dim + head_dim_v); }
};

// gtest prints a Config by its name.
inline void PrintTo(const Config& c, std::ostream* os) { *os << c.name(); }

// Name generator for INSTANTIATE_TEST_SUITE_P.
struct ConfigName {
  std::string operator()(const ::testing::TestParamInfo<Config>& info) const {
    return std::to_string(info.index) + "_" + info.param.name();
  }
};

// A pairwise-covering list: every pair of values of any two factors (B, heads, Lq, Lk, D, Dv, strided, mask,
// key padding, causal, fully masked, dropout, scale) appears in at least one configuration, each with
// cost() <= max_cost (which keeps the L = 1000 cases to small head counts and dims). Deterministic.
std::vector<Config> pairwise_configs(double max_cost = 2.5e7);
// A smaller pairwise list (L <= 64) for backward sweeps.
std::vector<Config> pairwise_backward_configs();
// A short list with a NaN in q, k or the mask, over masks, causality, padding, dropout, GQA, several query and
// key tiles and the decode paths (forward and backward).
std::vector<Config> nan_row_configs();

// One generated problem: storage, the views the library sees, and the exact same values in double.
struct Problem {
  Config config;
  DType dtype = DType::kF32;
  Tensor q_store, k_store, v_store, mask_store, kpm_store, lengths_store;
  TensorView q, k, v;  // [B, H, L, D] views, non-contiguous when config.strided
  AttentionOptions options;

  // Dense row-major double copies of exactly what the views hold.
  std::vector<double> qd, kd, vd;  // [B, Hq, Lq, D], [B, Hkv, Lk, D], [B, Hkv, Lk, Dv]
  Shape mask_shape;                // the mask's own shape ({} when none)
  std::vector<double> mask_own;    // dense in mask_shape: 1/0 for bool, additive values otherwise
  std::vector<uint8_t> padding;    // [B, Lk], 1 = padding (empty when none)
  double scale = 0.0;

  Shape out_shape() const { return {config.batch, config.heads_q, config.len_q, config.head_dim_v}; }
  Shape lse_shape() const { return {config.batch, config.heads_q, config.len_q}; }
  Shape weights_shape() const { return {config.batch, config.heads_q, config.len_q, config.len_k}; }
};

// Builds a problem with q/k/v ~ N(0, 1) rounded to `dtype`. Deterministic in (config, dtype, seed).
Problem make_problem(const Config& config, DType dtype = DType::kF32, uint64_t seed = 1);

// Independent naive fp64 attention.
struct NaiveForward {
  std::vector<double> out, lse, weights;  // dense, row-major
  int64_t fully_masked_rows = 0;
  int64_t nan_rows = 0;  // rows with a NaN score (all NaN: out, lse, the allowed weights)
};
NaiveForward naive_forward(const Problem& problem);

struct NaiveGrads {
  std::vector<double> dq, dk, dv, dmask;  // dmask in the mask's own shape (additive masks only)
};
// Gradient of sum(dout * out) with respect to q, k, v and an additive mask.
NaiveGrads naive_backward(const Problem& problem, const std::vector<double>& dout);

// Dense row-major double values of a view (any strides, any dtype).
std::vector<double> to_doubles(const TensorView& view);
// Random N(0, 1) values, deterministic in seed.
std::vector<double> random_normal(size_t n, uint64_t seed);

// ||actual - expected||_inf <= tol * max(1, ||expected||_inf); non-finite entries must match exactly.
::testing::AssertionResult all_close(const TensorView& actual, const std::vector<double>& expected, double tol,
                                     const std::string& what);
::testing::AssertionResult all_close(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
                                     const std::string& what);

struct CheckOptions {
  std::string kernel = "reference";  // AttentionOptions::kernel
  bool lse = true, weights = true;   // which optional outputs to request
  double tol = 0.0;                  // 0: by dtype (f64 1e-10, f32 2e-5, f16 5e-3, bf16 3e-2); backward x5
  int num_threads = 0;
  bool skip_unsupported = true;   // a kernel that does not support the problem: *skipped = true, success
  DType out_dtype = DType::kF32;  // dtype of out/lse/weights/grads (f64 when the problem is f64)
  bool mask_grad = true;          // backward: request an additive mask's gradient
};
double default_tolerance(DType dtype);

// Runs the kernel on `problem` and compares out (and lse, weights) with naive_forward.
::testing::AssertionResult check_forward(const Problem& problem, const CheckOptions& options, bool* skipped = nullptr);
// Runs forward + backward with a random dout and compares dq, dk, dv (and dmask) with naive_backward.
::testing::AssertionResult check_backward(const Problem& problem, const CheckOptions& options, bool* skipped = nullptr);
// check_forward and check_backward under each SIMD target the CPU has (set_simd_target), then the default.
::testing::AssertionResult check_every_simd_target(const Problem& problem, const CheckOptions& options,
                                                   bool* skipped = nullptr);

}  // namespace sattn::testing

// The whole sweep for one kernel (see the top of this file). `dtype`: the dtype of q, k, v.
#define SATTN_ORACLE_SWEEP(Suite, kernel_name, dtype)                                                           \
  class Suite##Forward : public ::testing::TestWithParam<::sattn::testing::Config> {};                          \
  TEST_P(Suite##Forward, MatchesNaiveFp64) {                                                                    \
    const auto problem = ::sattn::testing::make_problem(GetParam(), dtype);                                     \
    ::sattn::testing::CheckOptions co;                                                                          \
    co.kernel = kernel_name;                                                                                    \
    co.weights = GetParam().cost() < 3e6; /* weights for all but the largest problems */                        \
    bool skipped = false;                                                                                       \
    EXPECT_TRUE(::sattn::testing::check_forward(problem, co, &skipped));                                        \
    if (skipped) GTEST_SKIP() << kernel_name << " does not support " << GetParam().name();                      \
  }                                                                                                             \
  INSTANTIATE_TEST_SUITE_P(Pairwise, Suite##Forward, ::testing::ValuesIn(::sattn::testing::pairwise_configs()), \
                           ::sattn::testing::ConfigName());                                                     \
  class Suite##Backward : public ::testing::TestWithParam<::sattn::testing::Config> {};                         \
  TEST_P(Suite##Backward, MatchesNaiveFp64) {                                                                   \
    const auto problem = ::sattn::testing::make_problem(GetParam(), dtype);                                     \
    ::sattn::testing::CheckOptions co;                                                                          \
    co.kernel = kernel_name;                                                                                    \
    bool skipped = false;                                                                                       \
    EXPECT_TRUE(::sattn::testing::check_backward(problem, co, &skipped));                                       \
    if (skipped) GTEST_SKIP() << kernel_name << " has no backward for " << GetParam().name();                   \
  }                                                                                                             \
  INSTANTIATE_TEST_SUITE_P(Pairwise, Suite##Backward,                                                           \
                           ::testing::ValuesIn(::sattn::testing::pairwise_backward_configs()),                  \
                           ::sattn::testing::ConfigName());                                                     \
  class Suite##NanRows : public ::testing::TestWithParam<::sattn::testing::Config> {};                          \
  TEST_P(Suite##NanRows, MatchNaiveFp64OnEverySimdTarget) {                                                     \
    const auto problem = ::sattn::testing::make_problem(GetParam(), dtype);                                     \
    ::sattn::testing::CheckOptions co;                                                                          \
    co.kernel = kernel_name;                                                                                    \
    bool skipped = false;                                                                                       \
    EXPECT_TRUE(::sattn::testing::check_every_simd_target(problem, co, &skipped));                              \
    if (skipped) GTEST_SKIP() << kernel_name << " does not support " << GetParam().name();                      \
  }                                                                                                             \
  INSTANTIATE_TEST_SUITE_P(Listed, Suite##NanRows, ::testing::ValuesIn(::sattn::testing::nan_row_configs()),    \
                           ::sattn::testing::ConfigName())
