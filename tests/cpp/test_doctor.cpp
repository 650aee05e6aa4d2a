// sattn::diagnose: each seeded symptom is flagged on inputs built to have it, healthy inputs stay quiet,
// and the statistics are right on cases computed by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "sattn/diagnose.hpp"
#include "tools_test_util.hpp"

using namespace sattn;
using namespace sattn::testing_tools;

namespace {

std::vector<std::string> codes(const Diagnosis& d) {
  std::vector<std::string> c;
  for (const auto& f : d.findings) c.push_back(f.code);
  return c;
}
bool has(const Diagnosis& d, const std::string& code) {
  const auto c = codes(d);
  return std::find(c.begin(), c.end(), code) != c.end();
}
const Finding& finding(const Diagnosis& d, const std::string& code) {
  for (const auto& f : d.findings)
    if (f.code == code) return f;
  throw std::runtime_error("no finding " + code);
}
std::string joined(const Diagnosis& d) {
  std::string s;
  for (const auto& c : codes(d)) s += c + " ";
  return s;
}

Tensor bool_mask(int64_t lq, int64_t lk, const std::function<bool(int64_t, int64_t)>& allow) {
  Tensor m(DType::kBool, {lq, lk});
  auto* p = m.data<uint8_t>();
  for (int64_t i = 0; i < lq; ++i)
    for (int64_t j = 0; j < lk; ++j) p[i * lk + j] = allow(i, j) ? 1 : 0;
  return m;
}

struct Inputs {
  Tensor q, k, v;
};
Inputs healthy(int64_t B = 2, int64_t H = 3, int64_t L = 40, int64_t D = 32) {
  return {randn({B, H, L, D}, 11), randn({B, H, L, D}, 12), randn({B, H, L, D}, 13)};
}

}  // namespace

TEST(Doctor, HealthyInputsHaveNoFindings) {
  const Inputs in = healthy();
  const Diagnosis d = diagnose(in.q, in.k, in.v, {});
  EXPECT_TRUE(d.healthy()) << joined(d);
  EXPECT_TRUE(d.deterministic);
  EXPECT_EQ(d.heads.size(), 6u);
  EXPECT_NEAR(d.heads[0].scaled_scores.std, 1.0, 0.2);  // unit-variance q, k with 1/sqrt(D): std ~ 1
  EXPECT_NEAR(d.heads[0].raw_scores.std, std::sqrt(32.0), 1.2);
  // Healthy with the masks it is meant to have.
  AttentionOptions o;
  o.causal = Causal::kTopLeft;
  DiagnoseOptions c;
  c.expect = Expectation::kCausal;
  EXPECT_TRUE(diagnose(in.q, in.k, in.v, o, c).healthy());
  const Tensor tril = bool_mask(40, 40, [](int64_t i, int64_t j) { return j <= i; });
  AttentionOptions m;
  m.attn_mask = tril.view();
  EXPECT_TRUE(diagnose(in.q, in.k, in.v, m, c).healthy()) << joined(diagnose(in.q, in.k, in.v, m, c));
  // A local window mask allows little but is not "inverted".
  const Tensor window = bool_mask(40, 40, [](int64_t i, int64_t j) { return std::abs(i - j) <= 2; });
  AttentionOptions w;
  w.attn_mask = window.view();
  EXPECT_TRUE(diagnose(in.q, in.k, in.v, w).healthy()) << joined(diagnose(in.q, in.k, in.v, w));
}

TEST(Doctor, MissingScaleIsUnscaledScores) {
  const Inputs in = healthy(1, 2, 32, 64);
  AttentionOptions o;
  o.scale = 1.0;  // the 1/sqrt(d_k) forgotten
  const Diagnosis d = diagnose(in.q, in.k, in.v, o);
  ASSERT_TRUE(has(d, "unscaled_scores")) << joined(d);
  EXPECT_EQ(finding(d, "unscaled_scores").heads.size(), 2u);
  EXPECT_NE(finding(d, "unscaled_scores").message.find("sqrt(d_k)"), std::string::npos);
  EXPECT_NEAR(d.heads[0].scaled_scores.std, d.heads[0].raw_scores.std, 1e-9);
}

TEST(Doctor, LargeScoresSaturateTheSoftmax) {
  Inputs in = healthy(1, 2, 32, 64);
  in.q = randn({1, 2, 32, 64}, 11, 25.0);  // huge activations (scaled-score std ~25) with the correct scale
  const Diagnosis d = diagnose(in.q, in.k, in.v, {});
  EXPECT_TRUE(has(d, "saturated_softmax")) << joined(d);
  EXPECT_FALSE(has(d, "unscaled_scores"));  // the scale itself is right
  EXPECT_GT(d.heads[0].saturated_row_fraction, 0.5);
  EXPECT_GT(d.heads[0].max_prob_p50, 0.99);
}

TEST(Doctor, ReversedCausalMaskLeaksAndLooksInverted) {
  const Inputs in = healthy(1, 2, 24, 16);
  DiagnoseOptions c;
  c.expect = Expectation::kCausal;
  // torch-style "True = masked" causal mask given where True = may attend.
  const Tensor triu1 = bool_mask(24, 24, [](int64_t i, int64_t j) { return j > i; });
  AttentionOptions o;
  o.attn_mask = triu1.view();
  const Diagnosis d = diagnose(in.q, in.k, in.v, o, c);
  EXPECT_TRUE(has(d, "causal_leak")) << joined(d);
  EXPECT_TRUE(has(d, "mask_polarity_suspect")) << joined(d);
  EXPECT_TRUE(has(d, "fully_masked_rows"));  // the last query has no future key
  // Transposed causal mask (j >= i): leaks, every row still has a key.
  const Tensor triu0 = bool_mask(24, 24, [](int64_t i, int64_t j) { return j >= i; });
  o.attn_mask = triu0.view();
  const Diagnosis d2 = diagnose(in.q, in.k, in.v, o, c);
  EXPECT_TRUE(has(d2, "causal_leak")) << joined(d2);
  EXPECT_FALSE(has(d2, "fully_masked_rows"));
  // Without --expect causal a non-causal mask is intent, not a leak.
  EXPECT_FALSE(has(diagnose(in.q, in.k, in.v, o), "causal_leak"));
  // No mask at all with expect causal: leak.
  EXPECT_TRUE(has(diagnose(in.q, in.k, in.v, {}, c), "causal_leak"));
}

TEST(Doctor, CausalLeakStatisticsByHand) {
  // q = 0 gives uniform weights 1/Lk; row i has (Lk - 1 - i)/Lk of its weight in the future (top-left).
  const int64_t L = 10;
  Tensor q(DType::kF64, {1, 1, L, 4});
  const Tensor k = randn({1, 1, L, 4}, 5).to(DType::kF64), v = randn({1, 1, L, 4}, 6).to(DType::kF64);
  DiagnoseOptions c;
  c.expect = Expectation::kCausal;
  const Diagnosis d = diagnose(q, k, v, {}, c);
  ASSERT_EQ(d.heads.size(), 1u);
  EXPECT_NEAR(d.heads[0].causal_leak_max, double(L - 1) / L, 1e-12);
  EXPECT_NEAR(d.heads[0].causal_leak_mean, double(L - 1) / 2 / L, 1e-12);  // mean of (L-1-i)/L
  EXPECT_EQ(d.heads[0].causal_leak_rows, L - 1);
  EXPECT_NEAR(d.heads[0].entropy_mean, std::log(double(L)), 1e-12);
  EXPECT_NEAR(d.heads[0].entropy_normalised, 1.0, 1e-12);
  EXPECT_NEAR(d.heads[0].max_prob_mean, 1.0 / L, 1e-12);
  EXPECT_DOUBLE_EQ(d.heads[0].raw_scores.std, 0.0);
}

TEST(Doctor, ScoreMomentsByHand) {
  Tensor q(DType::kF64, {1, 1, 3, 4}), k(DType::kF64, {1, 1, 5, 4}), v(DType::kF64, {1, 1, 5, 2});
  for (int n = 0; n < 12; ++n) q.data<double>()[n] = 1.0;
  for (int n = 0; n < 20; ++n) k.data<double>()[n] = n < 8 ? 2.0 : -1.0;  // keys 0,1: dot 8; keys 2-4: dot -4
  const Diagnosis d = diagnose(q, k, v, {});
  const auto& h = d.heads[0];
  EXPECT_EQ(h.raw_scores.count, 15);
  EXPECT_NEAR(h.raw_scores.mean, (2 * 8.0 + 3 * -4.0) / 5, 1e-12);
  EXPECT_NEAR(h.raw_scores.std, std::sqrt((2 * std::pow(8 - 0.8, 2) + 3 * std::pow(-4 - 0.8, 2)) / 5), 1e-12);
  EXPECT_NEAR(h.scaled_scores.mean, 0.5 * 0.8, 1e-12);
  EXPECT_DOUBLE_EQ(h.raw_scores.max, 8.0);
  EXPECT_DOUBLE_EQ(h.raw_scores.min, -4.0);
}

TEST(Doctor, FullyMaskedRowIsFound) {
  const Inputs in = healthy(2, 2, 12, 8);
  const Tensor m = bool_mask(12, 12, [](int64_t i, int64_t) { return i != 5; });  // row 5 allows nothing
  AttentionOptions o;
  o.attn_mask = m.view();
  const Diagnosis d = diagnose(in.q, in.k, in.v, o);
  ASSERT_TRUE(has(d, "fully_masked_rows")) << joined(d);
  EXPECT_EQ(finding(d, "fully_masked_rows").heads.size(), 4u);
  for (const auto& h : d.heads) EXPECT_EQ(h.fully_masked_rows, 1);
  EXPECT_FALSE(has(d, "nan_or_inf"));  // sattn gives zeros, not NaN
  EXPECT_FALSE(has(d, "mask_polarity_suspect"));
  // A length-0 sequence in the batch also leaves rows with no key.
  Tensor lengths(DType::kI32, {2});
  lengths.data<int32_t>()[0] = 12;
  lengths.data<int32_t>()[1] = 0;
  AttentionOptions l;
  l.key_lengths = lengths.view();
  const Diagnosis d2 = diagnose(in.q, in.k, in.v, l);
  ASSERT_TRUE(has(d2, "fully_masked_rows"));
  EXPECT_EQ(finding(d2, "fully_masked_rows").heads, (std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {1, 1}}));
}

TEST(Doctor, PaddingGivenButNotAppliedLeaks) {
  const Inputs in = healthy(2, 2, 16, 8);
  Tensor lengths(DType::kI64, {2});
  lengths.data<int64_t>()[0] = 16;
  lengths.data<int64_t>()[1] = 9;
  DiagnoseOptions p;
  p.expect = Expectation::kPadding;
  AttentionOptions o;
  o.key_lengths = lengths.view();  // with kPadding: where the padding is, not applied
  const Diagnosis d = diagnose(in.q, in.k, in.v, o, p);
  ASSERT_TRUE(has(d, "padding_leak")) << joined(d);
  EXPECT_EQ(finding(d, "padding_leak").heads, (std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {1, 1}}));
  EXPECT_NE(d.padding_source.find("lengths"), std::string::npos);
  // The same padding hidden by the mask that is actually used: no leak.
  Tensor mask(DType::kBool, {2, 1, 1, 16});
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t j = 0; j < 16; ++j) mask.data<uint8_t>()[b * 16 + j] = j < lengths.data<int64_t>()[b];
  o.attn_mask = mask.view();
  const Diagnosis ok = diagnose(in.q, in.k, in.v, o, p);
  EXPECT_TRUE(ok.healthy()) << joined(ok);
  // Without --expect padding the lengths are simply applied.
  AttentionOptions plain;
  plain.key_lengths = lengths.view();
  EXPECT_TRUE(diagnose(in.q, in.k, in.v, plain).healthy());
}

TEST(Doctor, ZeroFilledPaddingIsInferred) {
  Inputs in = healthy(1, 2, 16, 8);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t j = 11; j < 16; ++j)
      for (int64_t d = 0; d < 8; ++d) {
        in.k.data<float>()[(h * 16 + j) * 8 + d] = 0.f;
        in.v.data<float>()[(h * 16 + j) * 8 + d] = 0.f;
      }
  DiagnoseOptions p;
  p.expect = Expectation::kPadding;
  const Diagnosis d = diagnose(in.q, in.k, in.v, {}, p);
  EXPECT_TRUE(has(d, "padding_leak")) << joined(d);
  EXPECT_NE(d.padding_source.find("inferred"), std::string::npos);
  // Nothing zero-filled: nothing to check, no finding.
  const Inputs clean = healthy(1, 2, 16, 8);
  const Diagnosis c = diagnose(clean.q, clean.k, clean.v, {}, p);
  EXPECT_TRUE(c.healthy());
  EXPECT_NE(c.padding_source.find("none"), std::string::npos);
}

TEST(Doctor, NanAndInfAreCounted) {
  Inputs in = healthy(1, 2, 8, 8);
  in.q.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  const Diagnosis d = diagnose(in.q, in.k, in.v, {});
  ASSERT_TRUE(has(d, "nan_or_inf")) << joined(d);
  EXPECT_EQ(d.input_nan, 1);
  EXPECT_EQ(finding(d, "nan_or_inf").heads, (std::vector<std::pair<int64_t, int64_t>>{{0, 0}}));
  Inputs inf = healthy(1, 2, 8, 8);
  inf.v.data<float>()[8 * 8 + 2] = std::numeric_limits<float>::infinity();  // head 1, key 0
  const Diagnosis d2 = diagnose(inf.q, inf.k, inf.v, {});
  ASSERT_TRUE(has(d2, "nan_or_inf"));
  EXPECT_EQ(d2.input_inf, 1);
  // -inf in an additive mask is how masking is spelled: not a finding.
  const Inputs ok = healthy(1, 2, 8, 8);
  Tensor add(DType::kF32, {8, 8});
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 8; ++j)
      add.data<float>()[i * 8 + j] = j > i ? -std::numeric_limits<float>::infinity() : 0.f;
  AttentionOptions o;
  o.attn_mask = add.view();
  EXPECT_TRUE(diagnose(ok.q, ok.k, ok.v, o).healthy());
}

TEST(Doctor, FloatZeroOneMaskIsSuspect) {
  const Inputs in = healthy(1, 1, 8, 8);
  Tensor m(DType::kF32, {8, 8});
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t j = 0; j < 8; ++j) m.data<float>()[i * 8 + j] = j <= i ? 1.f : 0.f;
  AttentionOptions o;
  o.attn_mask = m.view();
  EXPECT_TRUE(has(diagnose(in.q, in.k, in.v, o), "mask_polarity_suspect"));
  // Complement of a padding pattern (True only on the trailing keys).
  const Tensor pad_inv = bool_mask(8, 8, [](int64_t, int64_t j) { return j >= 6; });
  AttentionOptions b;
  b.attn_mask = pad_inv.view();
  EXPECT_TRUE(has(diagnose(in.q, in.k, in.v, b), "mask_polarity_suspect"));
}

TEST(Doctor, NondeterministicRunsAreFlagged) {
  const Inputs in = healthy(1, 1, 8, 8);
  int calls = 0;
  DiagnoseOptions o;
  o.runner = [&](const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& opt) {
    Tensor out = attention(q, k, v, opt).out;
    if (++calls == 2) out.data<float>()[5] += 1e-6f;  // the second run differs in one element
    return out;
  };
  const Diagnosis d = diagnose(in.q, in.k, in.v, {}, o);
  EXPECT_FALSE(d.deterministic);
  EXPECT_TRUE(has(d, "nondeterministic"));
  o.runner = [](const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& opt) {
    return attention(q, k, v, opt).out;
  };
  EXPECT_TRUE(diagnose(in.q, in.k, in.v, {}, o).healthy());
}

TEST(Doctor, JsonAndTextShapes) {
  const Inputs in = healthy(1, 2, 16, 16);
  AttentionOptions o;
  o.scale = 1.0;
  const Diagnosis d = diagnose(in.q, in.k, in.v, o);
  const auto j = nlohmann::json::parse(diagnosis_to_json(d));
  ASSERT_TRUE(j["findings"].is_array());
  ASSERT_FALSE(j["findings"].empty());
  for (const auto& f : j["findings"]) {
    EXPECT_TRUE(f["code"].is_string());
    EXPECT_TRUE(f["heads"].is_array());
    EXPECT_TRUE(f["message"].is_string());
  }
  EXPECT_EQ(j["stats"]["heads"].size(), 2u);
  EXPECT_TRUE(j["stats"]["deterministic"].get<bool>());
  EXPECT_DOUBLE_EQ(j["stats"]["scale"].get<double>(), 1.0);
  const std::string text = diagnosis_to_text(d);
  EXPECT_NE(text.find("[unscaled_scores]"), std::string::npos);
  EXPECT_NE(text.find("per head"), std::string::npos);
  EXPECT_THROW(parse_expectation("future"), Error);
  // Invalid inputs raise the library's errors.
  EXPECT_THROW(diagnose(in.q, randn({1, 2, 16, 8}, 1), in.v, {}), Error);
}

TEST(Doctor, KeyPaddingMaskMarkingRealTokensIsSuspect) {
  const Inputs in = healthy(2, 1, 10, 8);
  Tensor kpm(DType::kBool, {2, 10});
  const int64_t len[2] = {7, 4};
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t j = 0; j < 10; ++j) kpm.data<uint8_t>()[b * 10 + j] = j < len[b];  // True = real token (wrong)
  AttentionOptions o;
  o.key_padding_mask = kpm.view();
  EXPECT_TRUE(has(diagnose(in.q, in.k, in.v, o), "mask_polarity_suspect"));
  for (int64_t n = 0; n < 20; ++n) kpm.data<uint8_t>()[n] = !kpm.data<uint8_t>()[n];  // the right polarity
  EXPECT_TRUE(diagnose(in.q, in.k, in.v, o).healthy());
}

TEST(Doctor, TooLargeProblemIsRefusedClearly) {
  Tensor q(DType::kF32, {1, 1, 12000, 1}), k(DType::kF32, {1, 1, 12000, 1}), v(DType::kF32, {1, 1, 12000, 1});
  try {
    diagnose(q, k, v, {});
    FAIL() << "expected sattn::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("2^27"), std::string::npos);
  }
}
