// sattn::diagnose — health diagnostics for one attention call, mapped to the symptom table of the debugging
// chapter (loss that does not fall, NaN, outputs that repeat, padding that leaks, runs that differ).
//
// Shapes as in attention.hpp: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; the masks in
// AttentionOptions keep sattn's polarity (bool attn_mask True = may attend, key_padding_mask True = padding).
// Raw scores q·k are computed here; the weights come from the reference kernel (need_weights); the
// determinism check runs the automatically chosen kernel twice and compares the outputs bit for bit.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sattn/attention.hpp"

namespace sattn {

// What the masks were meant to do, so that a leak can be told apart from intent.
enum class Expectation : uint8_t {
  kNone,
  kCausal,   // no weight on keys after the query (alignment: DiagnoseOptions::causal_alignment)
  kPadding,  // no weight on padded keys
};
Expectation parse_expectation(const std::string& text);  // "none" | "causal" | "padding"; throws sattn::Error

struct DiagnoseOptions {
  Expectation expect = Expectation::kNone;
  // For kCausal: which keys count as "the future" (top_left: j > i; bottom_right: j > i + Lk - Lq).
  // kNone means: the alignment of AttentionOptions::causal if set, else top_left.
  Causal causal_alignment = Causal::kNone;
  // For kPadding: where the padded keys are. When the key padding of AttentionOptions is given together with
  // kPadding it is taken as this ground truth and NOT applied, so the check tells whether the masks actually
  // used (attn_mask, causal) hide the padding. With no padding information at all, trailing keys whose k and
  // v rows are exactly zero (zero-filled padding) are taken as padding.
  // Thresholds.
  double saturation_max_prob = 0.99;     // a row is saturated when its largest weight exceeds this ...
  double saturation_row_fraction = 0.5;  // ... and a head is flagged when this fraction of its rows is
  double unscaled_std = 4.0;             // scaled-score std above which scores count as too large
  double leak_tolerance = 1e-6;          // total weight on forbidden keys per row that counts as a leak
  // Test/extension hook: computes attention for the determinism check (default: sattn::attention, auto kernel).
  std::function<Tensor(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions&)> runner;
};

struct Moments {
  double mean = 0, std = 0, min = 0, max = 0;
  int64_t count = 0;
};

struct HeadDiagnosis {
  int64_t batch = 0, head = 0;
  Moments raw_scores;     // q·k over allowed (b, h, i, j), before scaling (and before any additive bias)
  Moments scaled_scores;  // scale · q·k + additive bias, over allowed entries
  // Largest weight per row (rows with >= 2 allowed keys): mean, median, 90th percentile, max.
  double max_prob_mean = 0, max_prob_p50 = 0, max_prob_p90 = 0, max_prob_max = 0;
  double saturated_row_fraction = 0;  // rows with max weight > saturation_max_prob
  double entropy_mean = 0;            // nats, over rows with >= 1 allowed key
  double entropy_normalised = 0;      // mean of H / log(allowed keys), rows with >= 2 allowed keys (1 = uniform)
  int64_t rows = 0, fully_masked_rows = 0;
  double causal_leak_max = 0, causal_leak_mean = 0;  // per-row weight on future keys (with kCausal)
  int64_t causal_leak_rows = 0;
  double padding_leak_max = 0, padding_leak_mean = 0;  // per-row weight on padded keys (with kPadding)
  int64_t padding_leak_rows = 0;
  int64_t nan_count = 0, inf_count = 0;  // in this head's scores, weights and output
};

struct Finding {
  std::string code;  // saturated_softmax, unscaled_scores, fully_masked_rows, nan_or_inf, causal_leak,
                     // padding_leak, mask_polarity_suspect, nondeterministic
  std::vector<std::pair<int64_t, int64_t>> heads;  // (batch, head) pairs concerned; empty when not per head
  std::string message;                             // what it means and how to fix it
};

struct Diagnosis {
  std::string problem;  // AttentionProblem::to_string()
  double scale = 0, default_scale = 0;
  int64_t head_dim = 0;
  std::string kernel;  // the kernel the determinism check ran
  bool deterministic = true;
  std::string padding_source;            // where the padding for the padding check came from ("" when not checked)
  int64_t input_nan = 0, input_inf = 0;  // in q, k, v and a float mask (an additive -inf is not counted)
  std::vector<HeadDiagnosis> heads;
  std::vector<Finding> findings;
  bool healthy() const { return findings.empty(); }
};

// Runs every check. Throws sattn::Error for invalid inputs (as scaled_dot_product_attention would).
Diagnosis diagnose(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& options,
                   const DiagnoseOptions& diagnose_options = {});

// {"findings": [{"code", "heads": [[b, h], ...], "message"}], "stats": {...}} as a JSON string.
std::string diagnosis_to_json(const Diagnosis& d, int indent = 2);
// A human-readable summary: findings first (what it means, how to fix), then a per-head table.
std::string diagnosis_to_text(const Diagnosis& d);

}  // namespace sattn
