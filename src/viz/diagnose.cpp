// Health diagnostics for attention (see include/sattn/diagnose.hpp). The messages follow the symptom table of
// the debugging chapter: symptom -> most likely cause -> what to check and how to fix it.
#include "sattn/diagnose.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/kernel.hpp"
#include "viz/viz.hpp"

namespace sattn {

Expectation parse_expectation(const std::string& text) {
  if (text.empty() || text == "none") return Expectation::kNone;
  if (text == "causal") return Expectation::kCausal;
  if (text == "padding") return Expectation::kPadding;
  fail(ErrorKind::kInvalidArgument, "expect: expected 'causal', 'padding' or 'none', got '", text, "'");
}

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Accumulator {  // running mean/std (Welford) + min/max
  double mean = 0, m2 = 0, min = kInf, max = -kInf;
  int64_t n = 0;
  void add(double x) {
    if (!std::isfinite(x)) return;
    ++n;
    const double d = x - mean;
    mean += d / double(n);
    m2 += d * (x - mean);
    min = std::min(min, x);
    max = std::max(max, x);
  }
  Moments moments() const {
    Moments m;
    m.count = n;
    if (n == 0) return m;
    m.mean = mean;
    m.std = n > 1 ? std::sqrt(m2 / double(n)) : 0.0;
    m.min = min;
    m.max = max;
    return m;
  }
};

double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - double(lo)) * (v[hi] - v[lo]);
}

// Counts NaN and +-Inf in a tensor (for an additive mask, -inf is a legitimate "masked" and is not counted).
void count_nonfinite(const TensorView& t, bool allow_neg_inf, int64_t* nan, int64_t* inf) {
  if (t.data == nullptr || !is_floating(t.dtype)) return;
  const Tensor d = Tensor::from_view(t).to(DType::kF64);
  const double* p = d.data<double>();
  for (int64_t n = 0; n < d.numel(); ++n) {
    if (std::isnan(p[n])) ++*nan;
    else if (std::isinf(p[n]) && !(allow_neg_inf && p[n] < 0)) ++*inf;
  }
}

std::string fmt(double v, int prec = 3) {
  std::ostringstream os;
  os << std::setprecision(prec) << v;
  return os.str();
}

std::string percent(double f) { return fmt(100.0 * f, 3) + "%"; }

// Padded keys per batch entry inferred from zero-filled padding: the longest run of trailing keys whose k rows
// (every kv head) and v rows are exactly zero. Returns an empty vector when no batch entry has such keys.
std::vector<int64_t> infer_zero_padding(const Tensor& k, const Tensor& v) {
  const int64_t B = k.size(0), H = k.size(1), L = k.size(2), D = k.size(3), Dv = v.size(3);
  const double* kp = k.data<double>();
  const double* vp = v.data<double>();
  std::vector<int64_t> lengths(size_t(B), L);
  bool any = false;
  for (int64_t b = 0; b < B; ++b) {
    int64_t len = L;
    while (len > 0) {
      const int64_t j = len - 1;
      bool zero = true;
      for (int64_t h = 0; h < H && zero; ++h) {
        for (int64_t d = 0; d < D && zero; ++d) zero = kp[((b * H + h) * L + j) * D + d] == 0.0;
        for (int64_t d = 0; d < Dv && zero; ++d) zero = vp[((b * H + h) * L + j) * Dv + d] == 0.0;
      }
      if (!zero) break;
      --len;
    }
    if (len < L && len > 0) any = true;  // an all-zero sequence is not "padding", it is empty input
    lengths[size_t(b)] = len;
  }
  if (!any) return {};
  return lengths;
}

std::string heads_summary(const std::vector<std::pair<int64_t, int64_t>>& heads) {
  std::string s;
  for (size_t n = 0; n < heads.size() && n < 8; ++n)
    s += (n ? ", " : "") + std::string("b") + std::to_string(heads[n].first) + "h" + std::to_string(heads[n].second);
  if (heads.size() > 8) s += ", ... (" + std::to_string(heads.size()) + " heads)";
  return s;
}

}  // namespace

namespace {

// What the steps and checks of diagnose() share: the call as given, the options actually applied (key padding
// taken as ground truth is removed, no dropout), the problem they describe and the padding ground truth.
struct DiagnoseContext {
  const TensorView& q;
  const TensorView& k;
  const TensorView& v;
  const AttentionOptions& options;
  const DiagnoseOptions& dopt;
  AttentionProblem given;            // as called
  AttentionOptions applied;          // as run
  AttentionProblem p;                // describe_attention(q, k, v, applied)
  std::vector<uint8_t> padded;       // [B, Lk] ground truth for the padding check; empty when not checked
  Causal future = Causal::kTopLeft;  // the alignment that defines "the future" for the causal check
};

void check_diagnose_size(const AttentionProblem& given) {
  check(double(given.batch) * double(given.heads_q) * double(given.len_q) * double(given.len_k) <=
            double(int64_t(1) << 27),
        ErrorKind::kOutOfMemory,
        "diagnose: [B, Hq, Lq, Lk] = ", shape_text({given.batch, given.heads_q, given.len_q, given.len_k}),
        " has more than 2^27 entries (the checks keep several copies of the weights); diagnose a slice");
}

// Which masks are applied, and where the padding is for the padding check.
void choose_padding(DiagnoseContext& cx, const Tensor& k64, const Tensor& v64, Diagnosis& dg) {
  cx.applied = cx.options;
  cx.applied.dropout_p = 0.0;
  if (cx.dopt.expect != Expectation::kPadding) return;
  const int64_t B = cx.given.batch, Lk = cx.given.len_k;
  if (cx.given.key_padding != KeyPaddingKind::kNone) {
    const MaskData md = make_mask_data(cx.given, cx.options);
    cx.padded.assign(size_t(B * Lk), 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < Lk; ++j) cx.padded[size_t(b * Lk + j)] = md.key_is_padding(b, j) ? 1 : 0;
    dg.padding_source = cx.given.key_padding == KeyPaddingKind::kLengths ? "the given lengths (not applied)"
                                                                         : "the given key padding mask (not applied)";
    cx.applied.key_padding_mask = TensorView();
    cx.applied.key_lengths = TensorView();
  } else {
    const std::vector<int64_t> lengths = infer_zero_padding(k64, v64);
    if (!lengths.empty()) {
      cx.padded.assign(size_t(B * Lk), 0);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = lengths[size_t(b)]; j < Lk; ++j) cx.padded[size_t(b * Lk + j)] = 1;
      dg.padding_source = "trailing all-zero key/value rows (inferred zero padding)";
    } else {
      dg.padding_source = "none: no lengths or key padding given and no zero-filled trailing keys found";
    }
  }
}

void describe_applied(DiagnoseContext& cx, Diagnosis& dg) {
  cx.p = describe_attention(cx.q, cx.k, cx.v, cx.applied);
  dg.problem = cx.p.to_string();
  dg.scale = cx.p.scale;
  dg.head_dim = cx.p.head_dim;
  dg.default_scale = 1.0 / std::sqrt(double(cx.p.head_dim));
  cx.future = cx.dopt.causal_alignment != Causal::kNone ? cx.dopt.causal_alignment
              : cx.options.causal != Causal::kNone      ? cx.options.causal
                                                        : Causal::kTopLeft;
}

void count_input_nonfinite(const DiagnoseContext& cx, Diagnosis& dg) {
  count_nonfinite(cx.q, false, &dg.input_nan, &dg.input_inf);
  count_nonfinite(cx.k, false, &dg.input_nan, &dg.input_inf);
  count_nonfinite(cx.v, false, &dg.input_nan, &dg.input_inf);
  if (cx.p.mask == MaskKind::kAdditive) count_nonfinite(cx.options.attn_mask, true, &dg.input_nan, &dg.input_inf);
}

// The fp64 arrays the per-head statistics read: inputs, the reference weights and output, the allowed keys.
struct HeadInputs {
  const double* q;
  const double* k;
  const double* w;    // [B, H, Lq, Lk] reference weights
  const double* out;  // [B, H, Lq, Dv] reference output
  const uint8_t* allowed;
  const MaskData& md;
};

// Running sums of one head over its rows.
struct HeadSums {
  Accumulator raw, scaled;
  std::vector<double> maxp;  // largest weight per row with >= 2 allowed keys
  double ent_sum = 0, entn_sum = 0, causal_sum = 0, pad_sum = 0;
  int64_t ent_rows = 0, entn_rows = 0, saturated = 0;
};

// Row i of head (b, h): scores, weights and output counted into hd and sums.
void scan_row(const DiagnoseContext& cx, const HeadInputs& in, int64_t b, int64_t h, int64_t i, HeadDiagnosis& hd,
              HeadSums& sums) {
  const AttentionProblem& p = cx.p;
  const DiagnoseOptions& dopt = cx.dopt;
  const int64_t H = p.heads_q, Lq = p.len_q, Lk = p.len_k, D = p.head_dim, Dv = p.head_dim_v;
  const int64_t g = p.group_size(), Hkv = p.heads_kv;
  const size_t row = size_t(((b * H + h) * Lq + i) * Lk);
  int64_t n_allowed = 0;
  double row_max = 0, entropy = 0, leak_c = 0, leak_p = 0;
  for (int64_t j = 0; j < Lk; ++j) {
    const double w = in.w[row + size_t(j)];
    if (std::isnan(w)) ++hd.nan_count;
    else if (std::isinf(w)) ++hd.inf_count;
    if (dopt.expect == Expectation::kCausal && !causal_allows(cx.future, i, j, Lq, Lk) && std::isfinite(w)) leak_c += w;
    if (!cx.padded.empty() && cx.padded[size_t(b * Lk + j)] && std::isfinite(w)) leak_p += w;
    if (!in.allowed[row + size_t(j)]) continue;
    ++n_allowed;
    double dot = 0;
    const double* qi = in.q + ((b * H + h) * Lq + i) * D;
    const double* kj = in.k + ((b * Hkv + h / g) * Lk + j) * D;
    for (int64_t d = 0; d < D; ++d) dot += qi[d] * kj[d];
    if (std::isnan(dot)) ++hd.nan_count;
    else if (std::isinf(dot)) ++hd.inf_count;
    sums.raw.add(dot);
    const double bias = p.mask == MaskKind::kAdditive ? in.md.mask_value(b, h, i, j) : 0.0;
    sums.scaled.add(p.scale * dot + bias);
    if (std::isfinite(w)) {
      row_max = std::max(row_max, w);
      if (w > 0) entropy -= w * std::log(w);
    }
  }
  for (int64_t d = 0; d < Dv; ++d) {
    const double o = in.out[size_t(((b * H + h) * Lq + i) * Dv + d)];
    if (std::isnan(o)) ++hd.nan_count;
    else if (std::isinf(o)) ++hd.inf_count;
  }
  ++hd.rows;
  if (n_allowed == 0) {
    ++hd.fully_masked_rows;
  } else {
    sums.ent_sum += entropy;
    ++sums.ent_rows;
  }
  if (n_allowed >= 2) {
    sums.maxp.push_back(row_max);
    if (row_max > dopt.saturation_max_prob) ++sums.saturated;
    sums.entn_sum += entropy / std::log(double(n_allowed));
    ++sums.entn_rows;
  }
  if (leak_c > dopt.leak_tolerance) ++hd.causal_leak_rows;
  if (leak_p > dopt.leak_tolerance) ++hd.padding_leak_rows;
  hd.causal_leak_max = std::max(hd.causal_leak_max, leak_c);
  hd.padding_leak_max = std::max(hd.padding_leak_max, leak_p);
  sums.causal_sum += leak_c;
  sums.pad_sum += leak_p;
}

HeadDiagnosis diagnose_head(const DiagnoseContext& cx, const HeadInputs& in, int64_t b, int64_t h) {
  const int64_t Lq = cx.p.len_q;
  HeadDiagnosis hd;
  hd.batch = b;
  hd.head = h;
  HeadSums sums;
  for (int64_t i = 0; i < Lq; ++i) scan_row(cx, in, b, h, i, hd, sums);
  hd.raw_scores = sums.raw.moments();
  hd.scaled_scores = sums.scaled.moments();
  const std::vector<double>& maxp = sums.maxp;
  if (!maxp.empty()) {
    double s = 0;
    for (double m : maxp) s += m;
    hd.max_prob_mean = s / double(maxp.size());
    hd.max_prob_p50 = quantile(maxp, 0.5);
    hd.max_prob_p90 = quantile(maxp, 0.9);
    hd.max_prob_max = *std::max_element(maxp.begin(), maxp.end());
    hd.saturated_row_fraction = double(sums.saturated) / double(maxp.size());
  }
  hd.entropy_mean = sums.ent_rows ? sums.ent_sum / double(sums.ent_rows) : 0.0;
  hd.entropy_normalised = sums.entn_rows ? sums.entn_sum / double(sums.entn_rows) : 0.0;
  hd.causal_leak_mean = Lq ? sums.causal_sum / double(Lq) : 0.0;
  hd.padding_leak_mean = Lq ? sums.pad_sum / double(Lq) : 0.0;
  return hd;
}

// Per-head statistics from the weights and output of the reference (the oracle materialises the weights).
void head_statistics(const DiagnoseContext& cx, const Tensor& q64, const Tensor& k64, Diagnosis& dg) {
  AttentionOptions ref_opts = cx.applied;
  ref_opts.kernel = "reference";
  const AttentionResult ref = attention(cx.q, cx.k, cx.v, ref_opts, false, true);
  const Tensor w64 = ref.weights.to(DType::kF64), o64 = ref.out.to(DType::kF64);
  const Tensor allowed_t = viz::allowed_keys(cx.p, cx.applied);
  const MaskData md = make_mask_data(cx.p, cx.applied);
  const HeadInputs in{q64.data<double>(), k64.data<double>(),        w64.data<double>(),
                      o64.data<double>(), allowed_t.data<uint8_t>(), md};
  for (int64_t b = 0; b < cx.p.batch; ++b)
    for (int64_t h = 0; h < cx.p.heads_q; ++h) dg.heads.push_back(diagnose_head(cx, in, b, h));
}

// ---- checks: each adds its finding (if any) to dg.findings; diagnose() runs them in a fixed order ------------

using HeadList = std::vector<std::pair<int64_t, int64_t>>;

template <typename Pred>
HeadList heads_where(const Diagnosis& dg, Pred pred) {
  HeadList out;
  for (const auto& hd : dg.heads)
    if (pred(hd)) out.emplace_back(hd.batch, hd.head);
  return out;
}

// Determinism: the kernel the user would get, twice, compared bit for bit.
void check_determinism(const DiagnoseContext& cx, Diagnosis& dg) {
  const TensorView &q = cx.q, &k = cx.k, &v = cx.v;
  // Two runs as configured, and (without a custom runner) one more on one thread: the library promises the
  // same bits for any thread count, so a difference there is a determinism bug too.
  Tensor a, c, one;
  if (cx.dopt.runner) {
    a = cx.dopt.runner(q, k, v, cx.applied);
    c = cx.dopt.runner(q, k, v, cx.applied);
    dg.kernel = "custom runner";
  } else {
    AttentionResult first = attention(q, k, v, cx.applied, false, false);
    dg.kernel = first.info.kernel;
    a = first.out;
    c = attention(q, k, v, cx.applied, false, false).out;
    AttentionOptions single = cx.applied;
    single.num_threads = 1;
    one = attention(q, k, v, single, false, false).out;
  }
  auto same = [](const Tensor& x, const Tensor& y) {
    return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.data(), y.data(), x.nbytes()) == 0;
  };
  dg.deterministic = same(a, c) && (!one.defined() || same(a, one));
  if (same(a, c) && !dg.deterministic) c = one;  // report the thread-count difference below
  if (!dg.deterministic && a.shape() == c.shape()) {
    const Tensor a64 = a.to(DType::kF64), c64 = c.to(DType::kF64);
    double md_ = 0;
    for (int64_t n = 0; n < a64.numel(); ++n)
      md_ = std::max(md_, std::fabs(a64.data<double>()[n] - c64.data<double>()[n]));
    dg.findings.push_back({"nondeterministic",
                           {},
                           "Two runs on the same inputs differ (max |difference| = " + fmt(md_) + ", kernel " +
                               dg.kernel +
                               "). Results that change between runs cannot be reproduced or debugged. Likely causes: "
                               "dropout without a fixed seed, a model left in train() mode, or a non-deterministic "
                               "kernel/reduction order. Fix the seeds (sattn: AttentionOptions::seed), call eval(), "
                               "and compare two runs again."});
  }
}

void check_unscaled_scores(const DiagnoseContext& cx, Diagnosis& dg) {
  const bool scale_too_big = dg.scale > 1.5 * dg.default_scale;
  auto hs = heads_where(dg, [&](const HeadDiagnosis& hd) { return hd.scaled_scores.std > cx.dopt.unscaled_std; });
  if (hs.empty() || !scale_too_big) return;
  double raw_std = 0, sc_std = 0;
  for (const auto& hd : dg.heads)
    raw_std = std::max(raw_std, hd.raw_scores.std), sc_std = std::max(sc_std, hd.scaled_scores.std);
  dg.findings.push_back(
      {"unscaled_scores", hs,
       "Scores are not scaled by 1/sqrt(d_k): scale = " + fmt(dg.scale) + " but 1/sqrt(" + std::to_string(dg.head_dim) +
           ") = " + fmt(dg.default_scale) + ". The raw q.k has std up to " + fmt(raw_std) +
           " (about sqrt(d_k) for unit-variance q and k) and the scaled scores std " + fmt(sc_std) +
           ", so softmax is pushed towards one-hot: gradients vanish and the loss does not fall, or falls very "
           "slowly. Fix: divide the scores by sqrt(d_k) (in sattn leave scale unset: it defaults to 1/sqrt(D))."});
}

void check_saturated_softmax(const DiagnoseContext& cx, Diagnosis& dg) {
  auto hs = heads_where(dg, [&](const HeadDiagnosis& hd) {
    return hd.saturated_row_fraction >= cx.dopt.saturation_row_fraction && hd.max_prob_p50 > 0;
  });
  if (hs.empty()) return;
  double frac = 0;
  for (const auto& hd : dg.heads) frac = std::max(frac, hd.saturated_row_fraction);
  dg.findings.push_back(
      {"saturated_softmax", hs,
       "Softmax is saturated: in up to " + percent(frac) + " of a head's rows one key takes more than " +
           fmt(cx.dopt.saturation_max_prob) +
           " of the weight, so the softmax Jacobian is almost zero and gradients vanish (symptom: loss that does "
           "not fall, attention that freezes early on one position). Check the max/min of the weights (close to "
           "1 and 0 confirms it), the 1/sqrt(d_k) scale, and the magnitude of q and k (initialisation, missing "
           "normalisation, a temperature that is too low)."});
}

void check_fully_masked_rows(const DiagnoseContext&, Diagnosis& dg) {
  auto hs = heads_where(dg, [](const HeadDiagnosis& hd) { return hd.fully_masked_rows > 0; });
  if (hs.empty()) return;
  int64_t n = 0;
  for (const auto& hd : dg.heads) n += hd.fully_masked_rows;
  dg.findings.push_back(
      {"fully_masked_rows", hs,
       std::to_string(n) +
           " query rows (over all heads) have no allowed key: the mask, padding and causality "
           "together forbid every key. PyTorch's softmax turns such a row into NaN (symptom: the loss is fine and "
           "then suddenly becomes NaN); sattn returns zeros for it. Check the number of allowed keys per row "
           "(a sequence of length 0, a mask of the wrong polarity, causal alignment with Lq > Lk). Make sure "
           "every row keeps at least one key, or use a large negative number (-1e9) instead of -inf when a row "
           "may legitimately be empty."});
}

void check_nan_or_inf(const DiagnoseContext&, Diagnosis& dg) {
  auto hs = heads_where(dg, [](const HeadDiagnosis& hd) { return hd.nan_count + hd.inf_count > 0; });
  if (hs.empty() && dg.input_nan + dg.input_inf == 0) return;
  int64_t n = 0;
  for (const auto& hd : dg.heads) n += hd.nan_count + hd.inf_count;
  dg.findings.push_back(
      {"nan_or_inf", hs,
       "NaN/Inf found: " + std::to_string(dg.input_nan) + " NaN and " + std::to_string(dg.input_inf) +
           " Inf in the inputs (q, k, v, float mask), " + std::to_string(n) +
           " non-finite scores/weights/outputs. A single NaN key poisons every row that attends to it. Look "
           "upstream: overflow in half precision, a division by zero, uninitialised memory; in PyTorch a fully "
           "masked row with -inf also produces NaN (use -1e9 or keep one key per row)."});
}

void check_causal_leak(const DiagnoseContext& cx, Diagnosis& dg) {
  if (cx.dopt.expect != Expectation::kCausal) return;
  auto hs = heads_where(dg, [](const HeadDiagnosis& hd) { return hd.causal_leak_rows > 0; });
  if (hs.empty()) return;
  double mx = 0;
  int64_t rows = 0;
  for (const auto& hd : dg.heads) mx = std::max(mx, hd.causal_leak_max), rows += hd.causal_leak_rows;
  dg.findings.push_back(
      {"causal_leak", hs,
       "Weight on future keys: up to " + fmt(mx) + " of a row's weight goes to keys after the query (" +
           std::string(to_string(cx.future)) + " alignment), in " + std::to_string(rows) +
           " rows over all heads. The model sees the future: training loss falls suspiciously fast, and "
           "generation repeats the same token. Fix: apply a causal mask (sattn: --causal / is_causal) or check "
           "its direction: allowed keys are the lower triangle (torch.tril), and in SDPA's polarity True = may "
           "attend. Print the weights: everything above the diagonal must be 0."});
}

void check_padding_leak(const DiagnoseContext& cx, Diagnosis& dg) {
  if (cx.dopt.expect != Expectation::kPadding || cx.padded.empty()) return;
  auto hs = heads_where(dg, [](const HeadDiagnosis& hd) { return hd.padding_leak_rows > 0; });
  if (hs.empty()) return;
  double mx = 0;
  int64_t rows = 0;
  for (const auto& hd : dg.heads) mx = std::max(mx, hd.padding_leak_max), rows += hd.padding_leak_rows;
  dg.findings.push_back(
      {"padding_leak", hs,
       "Weight on padded keys (padding from " + dg.padding_source + "): up to " + fmt(mx) +
           " of a row's weight goes to padding, in " + std::to_string(rows) +
           " rows over all heads. Padding is not masked, so queries attend to empty positions (symptoms: short "
           "sequences do worse than long ones; a sequence alone gives a different result than inside a batch). "
           "Fix: pass the padding as key_padding_mask (True = padding) or lengths; if you fold it into attn_mask, "
           "shape it [B, 1, 1, Lk] explicitly so that it cannot broadcast along the wrong axis."});
}

// Mask polarity: a bool mask whose complement is a causal or padding pattern, or that forbids most rows entirely.
void check_bool_mask_polarity(const DiagnoseContext& cx, Diagnosis& dg) {
  if (cx.p.mask != MaskKind::kBool) return;
  const int64_t B = cx.p.batch, H = cx.p.heads_q, Lq = cx.p.len_q, Lk = cx.p.len_k;
  const MaskData md = make_mask_data(cx.p, cx.applied);
  int64_t allowed_n = 0, empty_rows = 0;
  bool comp_tl = true, comp_br = true, comp_pad = true, some_pad = false;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      // For the padding test: the mask's row must be the same for every query and be True exactly on a suffix.
      for (int64_t i = 0; i < Lq; ++i) {
        int64_t row_allowed = 0;
        for (int64_t j = 0; j < Lk; ++j) {
          const bool m = md.mask_value(b, h, i, j) != 0.0;
          row_allowed += m;
          comp_tl = comp_tl && (!m == causal_allows(Causal::kTopLeft, i, j, Lq, Lk));
          comp_br = comp_br && (!m == causal_allows(Causal::kBottomRight, i, j, Lq, Lk));
          if (comp_pad) {
            const bool first = md.mask_value(b, h, 0, j) != 0.0;
            const bool prev = j > 0 && md.mask_value(b, h, i, j - 1) != 0.0;
            if (m != first || (prev && !m)) comp_pad = false;  // differs across rows, or True then False
          }
        }
        allowed_n += row_allowed;
        if (row_allowed == 0) ++empty_rows;
        if (row_allowed > 0 && row_allowed < Lk) some_pad = true;
      }
    }
  comp_pad = comp_pad && some_pad;
  const double frac = double(allowed_n) / double(B * H * Lq * Lk);
  std::string why;
  if (frac < 0.5 && (comp_tl || comp_br))
    why = "its complement is exactly a causal mask (" + std::string(comp_tl ? "top_left" : "bottom_right") +
          "): it allows only the future";
  else if (frac < 0.5 && comp_pad)
    why = "it allows only a trailing block of keys, the same for every query: its complement looks like key padding";
  else if (empty_rows * 2 > B * H * Lq)
    why = "it forbids every key in " + std::to_string(empty_rows) + " of " + std::to_string(B * H * Lq) + " rows";
  if (why.empty()) return;
  dg.findings.push_back(
      {"mask_polarity_suspect",
       {},
       "The boolean attn_mask looks inverted: " + why + " (it allows " + percent(frac) +
           " of the entries). sattn and SDPA read True = may attend, but nn.MultiheadAttention and many codebases "
           "use True = masked out, so a mask copied from one to the other silently flips. Fix: pass ~mask "
           "(logical not), or print a few rows and check that True marks the keys a query may see."});
}

void check_key_padding_polarity(const DiagnoseContext& cx, Diagnosis& dg) {
  if (cx.given.key_padding != KeyPaddingKind::kBool || cx.dopt.expect == Expectation::kPadding) return;
  // True = padding. A mask that is True on a leading block and False after it, in every batch entry, reads
  // as "True = real token" (padding normally trails; left padding is legitimate but rarer).
  const int64_t B = cx.p.batch, Lk = cx.p.len_k;
  const MaskData kp = make_mask_data(cx.given, cx.options);
  bool all_leading = true;
  for (int64_t b = 0; b < B && all_leading; ++b) {
    int64_t n_true = 0;
    while (n_true < Lk && kp.key_is_padding(b, n_true)) ++n_true;
    bool rest_false = true;
    for (int64_t j = n_true; j < Lk; ++j) rest_false = rest_false && !kp.key_is_padding(b, j);
    all_leading = n_true > 0 && n_true < Lk && rest_false;
  }
  if (all_leading)
    dg.findings.push_back(
        {"mask_polarity_suspect",
         {},
         "The key_padding_mask is True on a leading block of keys and False after it in every batch entry. In "
         "sattn (as in nn.MultiheadAttention) True = padding, so this hides the start of every sequence and "
         "keeps its padding; it looks like a mask where True marks real tokens. Fix: pass ~key_padding_mask, "
         "or lengths. (If the batch really is left-padded, ignore this.)"});
}

// A float mask that only holds 0 and 1 (it is additive, not a keep/drop flag).
void check_float_mask_polarity(const DiagnoseContext& cx, Diagnosis& dg) {
  if (cx.p.mask != MaskKind::kAdditive) return;
  const Tensor m64 = Tensor::from_view(cx.options.attn_mask).to(DType::kF64);
  bool zero_one = true, has_one = false;
  for (int64_t n = 0; n < m64.numel(); ++n) {
    const double x = m64.data<double>()[n];
    zero_one = zero_one && (x == 0.0 || x == 1.0);
    has_one = has_one || x == 1.0;
  }
  if (zero_one && has_one)
    dg.findings.push_back(
        {"mask_polarity_suspect",
         {},
         "The float attn_mask only holds 0 and 1. A float mask is additive: 1 adds 1 to a score and masks "
         "nothing, so this is probably a keep/drop flag passed as float. Fix: pass it as bool (True = may attend) "
         "or convert it to 0 (keep) / -inf (drop), e.g. mask.masked_fill(mask == 0, -inf) - 1."});
}

using Check = void (*)(const DiagnoseContext&, Diagnosis&);

// The checks in the order their findings are reported.
constexpr Check kChecks[] = {
    check_determinism,          check_unscaled_scores,     check_saturated_softmax, check_fully_masked_rows,
    check_nan_or_inf,           check_causal_leak,         check_padding_leak,      check_bool_mask_polarity,
    check_key_padding_polarity, check_float_mask_polarity,
};

}  // namespace

Diagnosis diagnose(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& options,
                   const DiagnoseOptions& dopt) {
  DiagnoseContext cx{q, k, v, options, dopt, describe_attention(q, k, v, options), {}, {}, {}};  // validates all
  check_diagnose_size(cx.given);
  Diagnosis dg;
  const Tensor q64 = Tensor::from_view(q).to(DType::kF64), k64 = Tensor::from_view(k).to(DType::kF64);
  const Tensor v64 = Tensor::from_view(v).to(DType::kF64);
  choose_padding(cx, k64, v64, dg);
  describe_applied(cx, dg);
  count_input_nonfinite(cx, dg);
  head_statistics(cx, q64, k64, dg);
  for (const Check run_check : kChecks) run_check(cx, dg);
  return dg;
}

// ---- reporting ------------------------------------------------------------------------------------------------

namespace {
nlohmann::json moments_json(const Moments& m) {
  return {{"mean", m.mean}, {"std", m.std}, {"min", m.min}, {"max", m.max}, {"count", m.count}};
}
}  // namespace

std::string diagnosis_to_json(const Diagnosis& d, int indent) {
  nlohmann::json j;
  j["findings"] = nlohmann::json::array();
  for (const auto& f : d.findings) {
    nlohmann::json heads = nlohmann::json::array();
    for (const auto& [b, h] : f.heads) heads.push_back({b, h});
    j["findings"].push_back({{"code", f.code}, {"heads", heads}, {"message", f.message}});
  }
  nlohmann::json heads = nlohmann::json::array();
  for (const auto& h : d.heads) {
    heads.push_back(
        {{"batch", h.batch},
         {"head", h.head},
         {"raw_scores", moments_json(h.raw_scores)},
         {"scaled_scores", moments_json(h.scaled_scores)},
         {"max_prob",
          {{"mean", h.max_prob_mean},
           {"p50", h.max_prob_p50},
           {"p90", h.max_prob_p90},
           {"max", h.max_prob_max},
           {"saturated_row_fraction", h.saturated_row_fraction}}},
         {"entropy", {{"mean", h.entropy_mean}, {"normalised", h.entropy_normalised}}},
         {"rows", h.rows},
         {"fully_masked_rows", h.fully_masked_rows},
         {"causal_leak", {{"max", h.causal_leak_max}, {"mean", h.causal_leak_mean}, {"rows", h.causal_leak_rows}}},
         {"padding_leak", {{"max", h.padding_leak_max}, {"mean", h.padding_leak_mean}, {"rows", h.padding_leak_rows}}},
         {"nan", h.nan_count},
         {"inf", h.inf_count}});
  }
  j["stats"] = {{"problem", d.problem},
                {"scale", d.scale},
                {"default_scale", d.default_scale},
                {"head_dim", d.head_dim},
                {"kernel", d.kernel},
                {"deterministic", d.deterministic},
                {"padding_source", d.padding_source},
                {"input_nan", d.input_nan},
                {"input_inf", d.input_inf},
                {"heads", heads}};
  return j.dump(indent);
}

std::string diagnosis_to_text(const Diagnosis& d) {
  std::ostringstream os;
  os << "sattn doctor: " << d.problem << "\n";
  os << "  scale " << fmt(d.scale) << " (1/sqrt(" << d.head_dim << ") = " << fmt(d.default_scale) << "), kernel "
     << d.kernel << ", two runs " << (d.deterministic ? "bitwise identical" : "DIFFER") << "\n";
  if (!d.padding_source.empty()) os << "  padding for the leak check: " << d.padding_source << "\n";
  if (d.findings.empty()) {
    os << "\nhealthy: no findings\n";
  } else {
    os << "\n" << d.findings.size() << (d.findings.size() == 1 ? " finding" : " findings") << ":\n";
    for (const auto& f : d.findings) {
      os << "\n[" << f.code << "]";
      if (!f.heads.empty()) os << " heads " << heads_summary(f.heads);
      os << "\n";
      // Wrap the message at ~100 columns.
      std::istringstream words(f.message);
      std::string word, line = "  ";
      while (words >> word) {
        if (line.size() + word.size() + 1 > 100) {
          os << line << "\n";
          line = "  ";
        }
        line += (line.size() > 2 ? " " : "") + word;
      }
      if (line.size() > 2) os << line << "\n";
    }
  }
  os << "\nper head:\n";
  os << "   b   h | raw mean    std | scaled mean  std | max-p mean  p90  sat% | entropy norm | empty rows | "
        "leak causal pad | nan/inf\n";
  for (const auto& h : d.heads) {
    char buf[320];
    std::snprintf(
        buf, sizeof buf,
        "%4lld %3lld | %8.3g %7.3g | %8.3g %7.3g | %9.3g %5.3g %5.1f | %7.3g %5.2f | %10lld | %11.3g %5.3g | %lld\n",
        (long long)h.batch, (long long)h.head, h.raw_scores.mean, h.raw_scores.std, h.scaled_scores.mean,
        h.scaled_scores.std, h.max_prob_mean, h.max_prob_p90, 100.0 * h.saturated_row_fraction, h.entropy_mean,
        h.entropy_normalised, (long long)h.fully_masked_rows, h.causal_leak_max, h.padding_leak_max,
        (long long)(h.nan_count + h.inf_count));
    os << buf;
  }
  return os.str();
}

}  // namespace sattn
