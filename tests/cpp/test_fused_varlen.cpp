// Packed variable-length attention against the reference run on each sequence separately (dense copies).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "sattn/attention.hpp"
#include "sattn/varlen.hpp"

namespace {

using sattn::DType;
using sattn::Tensor;

Tensor randn(std::mt19937& rng, sattn::Shape s) {
  Tensor t(DType::kF32, s);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = nd(rng);
  return t;
}

// Rows [r0, r1) of packed [total, H, X] as a dense [1, H, r1 - r0, X] tensor.
Tensor unpack(const Tensor& t, int64_t r0, int64_t r1) {
  const int64_t H = t.size(1), X = t.size(2);
  Tensor o(DType::kF32, {1, H, r1 - r0, X});
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t x = 0; x < X; ++x)
        o.data<float>()[(h * (r1 - r0) + r - r0) * X + x] = t.data<float>()[(r * H + h) * X + x];
  return o;
}

double max_err(const Tensor& packed, int64_t r0, int64_t r1, const Tensor& dense) {
  const Tensor got = unpack(packed, r0, r1);
  double e = 0, m = 1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double r = dense.dtype() == DType::kF64 ? dense.data<double>()[i] : dense.data<float>()[i];
    e = std::max(e, std::fabs(got.data<float>()[i] - r));
    m = std::max(m, std::fabs(r));
  }
  return e / m;
}

TEST(FusedVarlen, MatchesPerSequenceReference) {
  std::mt19937 rng(5);
  const std::vector<int64_t> lq = {5, 0, 70, 1, 130}, lk = {9, 4, 70, 0, 65};
  const int64_t Hq = 4, Hkv = 2, D = 24, Dv = 16;
  std::vector<int64_t> cq = {0}, ck = {0};
  for (size_t s = 0; s < lq.size(); ++s) cq.push_back(cq.back() + lq[s]), ck.push_back(ck.back() + lk[s]);
  Tensor cuq(DType::kI64, {int64_t(cq.size())}), cuk(DType::kI32, {int64_t(ck.size())});
  for (size_t s = 0; s < cq.size(); ++s) cuq.data<int64_t>()[s] = cq[s], cuk.data<int32_t>()[s] = int32_t(ck[s]);
  const Tensor q = randn(rng, {cq.back(), Hq, D}), k = randn(rng, {ck.back(), Hkv, D}),
               v = randn(rng, {ck.back(), Hkv, Dv});
  const Tensor dout = randn(rng, {cq.back(), Hq, Dv});
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal);
    sattn::VarlenOptions o;
    o.causal = causal;
    Tensor out(DType::kF32, {cq.back(), Hq, Dv}), lse(DType::kF32, {Hq, cq.back()});
    sattn::flash_attn_varlen(q, k, v, cuq, cuk, 130, 70, o, out, lse);
    Tensor dq(DType::kF32, q.shape()), dk(DType::kF32, k.shape()), dv(DType::kF32, v.shape());
    sattn::flash_attn_varlen_backward(dout, q, k, v, out, lse, cuq, cuk, 130, 70, o, dq, dk, dv);
    for (size_t s = 0; s < lq.size(); ++s) {
      SCOPED_TRACE(s);
      const int64_t q0 = cq[s], q1 = cq[s + 1], k0 = ck[s], k1 = ck[s + 1];
      if (q1 == q0) continue;
      if (k1 == k0) {
        for (int64_t i = q0; i < q1; ++i)
          for (int64_t h = 0; h < Hq; ++h)
            EXPECT_EQ(lse.data<float>()[h * cq.back() + i], -std::numeric_limits<float>::infinity());
        EXPECT_EQ(max_err(out, q0, q1, Tensor(DType::kF32, {1, Hq, q1 - q0, Dv})), 0.0);
        continue;
      }
      sattn::AttentionOptions ro;
      ro.kernel = "reference";
      ro.accumulate_fp64 = true;
      ro.causal = causal ? sattn::Causal::kBottomRight : sattn::Causal::kNone;
      const Tensor qs = unpack(q, q0, q1), ks = unpack(k, k0, k1), vs = unpack(v, k0, k1), ds = unpack(dout, q0, q1);
      Tensor ro_out(DType::kF64, {1, Hq, q1 - q0, Dv}), ro_lse(DType::kF64, {1, Hq, q1 - q0});
      sattn::scaled_dot_product_attention(qs, ks, vs, ro, {ro_out.view(), ro_lse.view(), {}});
      EXPECT_LE(max_err(out, q0, q1, ro_out), 2e-5);
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = q0; i < q1; ++i) {
          const double r = ro_lse.data<double>()[h * (q1 - q0) + i - q0];
          const float g = lse.data<float>()[h * cq.back() + i];
          if (std::isinf(r)) EXPECT_EQ(double(g), r);
          else EXPECT_NEAR(g, r, 2e-5 * std::max(1.0, std::fabs(r)));
        }
      Tensor gq(DType::kF64, qs.shape()), gk(DType::kF64, ks.shape()), gv(DType::kF64, vs.shape());
      sattn::scaled_dot_product_attention_backward(ds, qs, ks, vs, ro_out, ro_lse, ro,
                                                   {gq.view(), gk.view(), gv.view(), {}});
      EXPECT_LE(max_err(dq, q0, q1, gq), 1e-4);
      EXPECT_LE(max_err(dk, k0, k1, gk), 1e-4);
      EXPECT_LE(max_err(dv, k0, k1, gv), 1e-4);
    }
  }
}

TEST(FusedVarlen, RejectsBadOffsets) {
  Tensor q(DType::kF32, {6, 2, 8}), k(DType::kF32, {6, 2, 8}), out(DType::kF32, {6, 2, 8});
  Tensor cu(DType::kI32, {3});
  cu.data<int32_t>()[0] = 0, cu.data<int32_t>()[1] = 4, cu.data<int32_t>()[2] = 5;  // last != total
  EXPECT_THROW(sattn::flash_attn_varlen(q, k, k, cu, cu, 6, 6, {}, out), sattn::Error);
  cu.data<int32_t>()[2] = 6;
  EXPECT_THROW(sattn::flash_attn_varlen(q, k, k, cu, cu, 3, 6, {}, out), sattn::Error);  // max_seqlen_q too small
  EXPECT_NO_THROW(sattn::flash_attn_varlen(q, k, k, cu, cu, 4, 4, {}, out));
}

}  // namespace
