// Attention maps from the reference kernel, the allowed-key pattern of a call, and structured example inputs.
#include <cmath>
#include <limits>
#include <numbers>

#include "kernels/kernel.hpp"
#include "sattn/random.hpp"
#include "viz/viz.hpp"

namespace sattn::viz {

Tensor allowed_keys(const AttentionProblem& p, const AttentionOptions& options) {
  const MaskData md = make_mask_data(p, options);
  Tensor out(DType::kU8, {p.batch, p.heads_q, p.len_q, p.len_k});
  auto* a = out.data<uint8_t>();
  size_t n = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h)
      for (int64_t i = 0; i < p.len_q; ++i)
        for (int64_t j = 0; j < p.len_k; ++j) {
          bool ok = p.causal_allows(i, j) && !md.key_is_padding(b, j);
          if (ok && p.mask == MaskKind::kBool) ok = md.mask_value(b, h, i, j) != 0.0;
          if (ok && p.mask == MaskKind::kAdditive)
            ok = md.mask_value(b, h, i, j) != -std::numeric_limits<double>::infinity();
          a[n++] = ok ? 1 : 0;
        }
  return out;
}

AttentionMaps attention_maps(const TensorView& q, const TensorView& k, const AttentionOptions& options) {
  // v only fixes shapes here; a [B, Hkv, Lk, 1] zero tensor keeps the reference's work small.
  Tensor v(q.dtype == DType::kF64 ? DType::kF64 : DType::kF32, {k.size(0), k.size(1), k.size(2), 1});
  Tensor qq = q.dtype == v.dtype() ? Tensor::from_view(q) : Tensor::from_view(q).to(v.dtype());
  Tensor kk = k.dtype == v.dtype() ? Tensor::from_view(k) : Tensor::from_view(k).to(v.dtype());
  AttentionOptions o = options;
  o.kernel = "reference";  // the oracle materialises the weights
  o.dropout_p = 0.0;
  const AttentionProblem p = describe_attention(qq, kk, v, o);
  check(double(p.batch) * double(p.heads_q) * double(p.len_q) * double(p.len_k) <= double(int64_t(1) << 27),
        ErrorKind::kOutOfMemory,
        "attention maps: [B, Hq, Lq, Lk] = ", shape_text({p.batch, p.heads_q, p.len_q, p.len_k}),
        " has more than 2^27 entries; slice the inputs (fewer heads, batch entries or queries) to draw them");
  const AttentionResult r = attention(qq, kk, v, o, false, true);
  const Tensor allowed = allowed_keys(p, o);
  const auto* al = allowed.data<uint8_t>();
  AttentionMaps maps{p.batch, p.heads_q, p.len_q, p.len_k, {}};
  size_t n = 0;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads_q; ++h) {
      Matrix m(p.len_q, p.len_k);
      for (int64_t i = 0; i < p.len_q; ++i)
        for (int64_t j = 0; j < p.len_k; ++j, ++n) {
          const int64_t idx[4] = {b, h, i, j};
          m.at(i, j) = al[n] ? r.weights.view().get(idx) : std::numeric_limits<double>::quiet_NaN();
        }
      maps.maps.push_back(std::move(m));
    }
  return maps;
}

namespace {
// Standard normal from Philox (Box-Muller), addressed by (stream, a, b, c): independent of call order.
double normal(uint64_t seed, uint32_t stream, uint32_t a, uint32_t b, uint32_t c) {
  const auto r = philox4x32_10({c, b, a, stream}, {uint32_t(seed), uint32_t(seed >> 32) ^ 0x5a77u});
  const double u1 = (double(r[0]) + 1.0) / 4294967297.0, u2 = double(r[1]) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}
}  // namespace

ExampleInputs example_inputs(int64_t batch, int64_t heads, int64_t len, int64_t dim, uint64_t seed) {
  check(batch > 0 && heads > 0 && len > 0 && dim >= 2, ErrorKind::kInvalidArgument,
        "example inputs: expected batch, heads, len >= 1 and dim >= 2, got ", batch, ", ", heads, ", ", len, ", ", dim);
  ExampleInputs ex{Tensor(DType::kF32, {batch, heads, len, dim}), Tensor(DType::kF32, {batch, heads, len, dim}),
                   Tensor(DType::kF32, {batch, heads, len, dim})};
  float* q = ex.q.data<float>();
  float* k = ex.k.data<float>();
  float* v = ex.v.data<float>();
  const int64_t pairs = dim / 2;
  // Positional features e(p) = [cos(w_m p), sin(w_m p)]_m: e(a)·e(b) = sum_m cos(w_m (a - b)) peaks at a = b.
  auto feature = [&](double pos, int64_t d) {
    const int64_t m = d / 2;
    const double w = std::numbers::pi * std::pow(double(2 * len), -double(m) / double(std::max<int64_t>(pairs - 1, 1)));
    return d % 2 == 0 ? std::cos(w * pos) : std::sin(w * pos);
  };
  const double beta = 1.6 * std::sqrt(double(dim)) / std::sqrt(double(pairs));  // sharpness of the positional heads
  size_t n = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < len; ++i)
        for (int64_t d = 0; d < dim; ++d, ++n) {
          const auto ub = uint32_t(b), uh = uint32_t(h), ui = uint32_t(i), ud = uint32_t(d);
          const double nq = normal(seed, 0, ub * 4096u + uh, ui, ud), nk = normal(seed, 1, ub * 4096u + uh, ui, ud);
          v[n] = float(normal(seed, 2, ub * 4096u + uh, ui, ud));
          const bool odd_tail = d >= 2 * pairs;
          switch (h % 4) {
            case 0:  // diagonal: query i looks at key i
              q[n] = odd_tail ? 0.f : float(beta * feature(double(i), d));
              k[n] = odd_tail ? 0.f : float(feature(double(i), d) + 0.1 * nk);
              break;
            case 1:  // three keys back
              q[n] = odd_tail ? 0.f : float(beta * feature(double(i) - 3.0, d));
              k[n] = odd_tail ? 0.f : float(feature(double(i), d) + 0.1 * nk);
              break;
            case 2:  // a sink: every query looks at the first keys
              q[n] = odd_tail ? 0.f : float(beta * feature(0.0, d) + 0.3 * nq);
              k[n] = odd_tail ? 0.f : float(feature(double(i), d) + 0.1 * nk);
              break;
            default:  // unstructured
              q[n] = float(nq);
              k[n] = float(nk);
          }
        }
  return ex;
}

}  // namespace sattn::viz
