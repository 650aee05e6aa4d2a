// describe_sdpa (PyTorch's layout, shapes only) against describe_attention (4-D views): the same problem for the
// same call, the same message for the same mistake, and the folding of leading dimensions.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <optional>
#include <string>

#include "sattn/attention.hpp"

using sattn::AttentionOptions;
using sattn::DType;
using sattn::Error;
using sattn::SdpaSpec;
using sattn::Shape;
using sattn::Tensor;
using sattn::TensorSpec;

namespace {

// The message of the sattn::Error that f throws ("" when it throws none).
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

SdpaSpec spec(const Shape& q, const Shape& k, const Shape& v, const std::string& dtype = "float32") {
  SdpaSpec c;
  c.query = {q, dtype};
  c.key = {k, dtype};
  c.value = {v, dtype};
  return c;
}

// A 4-D call through both entry points: the same message (both fail) or the same problem.
void expect_same(const SdpaSpec& c, const AttentionOptions& extra = {}) {
  const auto tensor = [](const TensorSpec& s) {
    return Tensor(s.dtype == "float64" ? DType::kF64 : DType::kF32, s.shape);
  };
  const Tensor q = tensor(c.query), k = tensor(c.key), v = tensor(c.value);
  AttentionOptions o = extra;
  o.scale = c.scale;
  o.dropout_p = c.dropout_p;
  Tensor mask, kpm;
  if (c.attn_mask) {
    mask = Tensor(c.attn_mask->dtype == "bool" ? DType::kBool : DType::kF32, c.attn_mask->shape);
    o.attn_mask = mask.view();
  }
  if (c.key_padding_mask) {
    kpm = Tensor(DType::kBool, c.key_padding_mask->shape);
    o.key_padding_mask = kpm.view();
  }
  sattn::AttentionProblem from_views;
  const std::string views_error = message_of([&] { from_views = sattn::describe_attention(q, k, v, o); });
  sattn::SdpaDescription from_shapes;
  SdpaSpec gqa = c;
  gqa.enable_gqa = true;  // the 4-D C++ API always allows Hq != Hkv
  const std::string shapes_error = message_of([&] { from_shapes = sattn::describe_sdpa(gqa); });
  EXPECT_EQ(views_error, shapes_error);
  if (views_error.empty()) {
    EXPECT_EQ(from_views.to_string(), from_shapes.problem.to_string());
  }
}

}  // namespace

TEST(Describe, FourDimensionalCallsAgreeWithTheViews) {
  expect_same(spec({2, 4, 5, 8}, {2, 2, 6, 8}, {2, 2, 6, 3}));
  expect_same(spec({2, 4, 5, 8}, {2, 2, 6, 7}, {2, 2, 6, 3}));  // E
  expect_same(spec({2, 4, 5, 8}, {2, 2, 6, 8}, {2, 2, 7, 3}));  // Lk of value
  expect_same(spec({2, 4, 5, 8}, {1, 2, 6, 8}, {1, 2, 6, 3}));  // batch
  expect_same(spec({2, 3, 5, 8}, {2, 2, 6, 8}, {2, 2, 6, 3}));  // heads not a multiple
  expect_same(spec({2, 4, 0, 8}, {2, 4, 6, 8}, {2, 4, 6, 3}));  // zero size
  SdpaSpec c = spec({2, 4, 5, 8}, {2, 4, 6, 8}, {2, 4, 6, 3});
  c.attn_mask = TensorSpec{{5, 6}, "bool"};
  expect_same(c);
  c.attn_mask = TensorSpec{{4, 1, 6}, "float32"};
  expect_same(c);
  c.attn_mask = TensorSpec{{3, 6}, "bool"};  // does not broadcast
  expect_same(c);
  c.attn_mask = TensorSpec{{1, 2, 4, 5, 6}, "bool"};  // too many dims
  expect_same(c);
  c.attn_mask.reset();
  c.key_padding_mask = TensorSpec{{2, 6}, "bool"};
  expect_same(c);
  c.key_padding_mask = TensorSpec{{2, 5}, "bool"};
  expect_same(c);
  c.key_padding_mask.reset();
  c.dropout_p = 1.0;
  expect_same(c);
}

TEST(Describe, LeadingDimensionsFoldIntoTheBatch) {
  sattn::SdpaDescription d = sattn::describe_sdpa(spec({3, 2, 4, 5, 8}, {3, 2, 4, 6, 8}, {3, 2, 4, 6, 7}));
  EXPECT_EQ(d.batch_dims, (Shape{3, 2}));
  EXPECT_EQ(d.problem.batch, 6);
  EXPECT_EQ(d.problem.heads_q, 4);
  EXPECT_EQ(d.problem.len_k, 6);
  EXPECT_EQ(d.problem.head_dim_v, 7);
  d = sattn::describe_sdpa(spec({5, 8}, {6, 8}, {6, 3}));  // 2-D: one batch entry, one head
  EXPECT_EQ(d.batch_dims, Shape{});
  EXPECT_EQ(d.problem.batch, 1);
  EXPECT_EQ(d.problem.heads_q, 1);
  EXPECT_EQ(d.problem.len_q, 5);
  EXPECT_DOUBLE_EQ(d.problem.scale, 1.0 / std::sqrt(8.0));
  SdpaSpec c = spec({3, 2, 4, 5, 8}, {3, 2, 4, 6, 8}, {3, 2, 4, 6, 7});
  c.attn_mask = TensorSpec{{2, 1, 5, 6}, "float64"};  // broadcasts along the first batch dim
  c.key_padding_mask = TensorSpec{{3, 2, 6}, "bool"};
  d = sattn::describe_sdpa(c);
  EXPECT_EQ(d.problem.mask, sattn::MaskKind::kAdditive);
  EXPECT_EQ(d.problem.key_padding, sattn::KeyPaddingKind::kBool);
}

TEST(Describe, ShapeOnlyMistakes) {
  const auto error = [](const SdpaSpec& c) { return message_of([&] { sattn::describe_sdpa(c); }); };
  EXPECT_NE(error(spec({2, 4, 5, 8}, {2, 2, 6, 8}, {2, 2, 6, 8})).find("pass enable_gqa=True"), std::string::npos);
  EXPECT_NE(error(spec({8}, {8}, {8})).find("at least 2 dimensions"), std::string::npos);
  EXPECT_NE(error(spec({4, 5, 8}, {2, 4, 6, 8}, {2, 4, 6, 8})).find("key: expected 3 dimensions like query [4, 5, 8]"),
            std::string::npos);
  EXPECT_NE(error(spec({5, 8}, {6, 8}, {6, 8}, "int16"))
                .find("query: expected float32, float64, bfloat16 or "
                      "float16, got int16"),
            std::string::npos);
  SdpaSpec c = spec({3, 2, 4, 5, 8}, {3, 2, 4, 6, 8}, {3, 2, 4, 6, 7});
  c.key_lengths = TensorSpec{{3, 2}, "float64"};
  EXPECT_NE(error(c).find("key_lengths: expected an integer array"), std::string::npos);
  c.key_lengths = TensorSpec{{6}, "int64"};
  EXPECT_NE(error(c).find("key_lengths: expected shape [3, 2] (query's batch dimensions), got [6]"), std::string::npos);
  c.key_lengths = TensorSpec{{3, 2}, "int64"};
  c.key_padding_mask = TensorSpec{{3, 2, 6}, "bool"};
  EXPECT_NE(error(c).find("give one or the other"), std::string::npos);
  c.key_lengths.reset();
  c.key_padding_mask = TensorSpec{{3, 2, 6}, "uint8"};
  EXPECT_NE(error(c).find("key_padding_mask: expected bool (True = padding), got uint8"), std::string::npos);
}
