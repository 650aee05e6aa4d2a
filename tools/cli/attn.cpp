// `sattn attn`: scaled-dot-product attention on .npy files.
//
//   sattn attn --q q.npy --k k.npy --v v.npy [--mask m.npy] [--key-padding p.npy | --lengths n.npy]
//              [--causal top-left|bottom-right] [--scale s] [--dropout p --seed n] [--kernel name]
//              [--threads n] --out o.npy [--lse l.npy] [--weights w.npy]
#include <iostream>
#include <optional>
#include <string>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "io/writers.hpp"
#include "sattn/attention.hpp"
#include "sattn/io.hpp"

namespace sattn::cli {
namespace {

struct AttnArgs {
  std::string q, k, v, mask, key_padding, lengths, causal = "none", kernel, out, lse, weights;
  std::string float32_precision = "highest";
  std::optional<double> scale;
  double dropout = 0.0;
  uint64_t seed = 0;
  int threads = 0;
  bool fp64 = false, verbose = false;
};

// Reads an .npy file given to `option` and checks its dtype against `allowed` (a short description).
Tensor read_input(const std::string& option, const std::string& path) {
  Tensor t = read_npy(path);
  if (option == "--q" || option == "--k" || option == "--v")
    check(t.dtype() == DType::kF32 || t.dtype() == DType::kF64 || t.dtype() == DType::kF16, ErrorKind::kTypeError,
          option, " ", path, ": expected float32, float64 or float16, got ", to_string(t.dtype()));
  if (option == "--mask")
    check(t.dtype() == DType::kBool || t.dtype() == DType::kF32 || t.dtype() == DType::kF64, ErrorKind::kTypeError,
          option, " ", path, ": expected bool (True = may attend) or float32/float64 (additive), got ",
          to_string(t.dtype()));
  if (option == "--key-padding")
    check(t.dtype() == DType::kBool, ErrorKind::kTypeError, option, " ", path,
          ": expected bool [B, Lk] (True = padding), got ", to_string(t.dtype()));
  if (option == "--lengths")
    check(t.dtype() == DType::kI32 || t.dtype() == DType::kI64, ErrorKind::kTypeError, option, " ", path,
          ": expected int32 or int64 [B], got ", to_string(t.dtype()));
  return t;
}

void run_attn(const AttnArgs& a) {
  const Float32Precision precision = parse_float32_precision(a.float32_precision, "--float32-precision");
  io::OutputFiles outputs;  // opened first: an unwritable output fails before any work
  io::OutputFile& out = outputs.add(a.out, "--out");
  io::OutputFile* lse = a.lse.empty() ? nullptr : &outputs.add(a.lse, "--lse");
  io::OutputFile* weights = a.weights.empty() ? nullptr : &outputs.add(a.weights, "--weights");
  const Tensor q = read_input("--q", a.q), k = read_input("--k", a.k), v = read_input("--v", a.v);
  AttentionOptions o;
  Tensor mask, kpm, lengths;
  if (!a.mask.empty()) mask = read_input("--mask", a.mask), o.attn_mask = mask;
  if (!a.key_padding.empty()) kpm = read_input("--key-padding", a.key_padding), o.key_padding_mask = kpm;
  if (!a.lengths.empty()) lengths = read_input("--lengths", a.lengths), o.key_lengths = lengths;
  o.causal = parse_causal(a.causal, "--causal");
  o.scale = a.scale;
  o.dropout_p = a.dropout;
  o.seed = a.seed;
  o.kernel = a.kernel;
  o.num_threads = a.threads;
  o.accumulate_fp64 = a.fp64;
  o.float32_precision = precision;
  const AttentionResult r = attention(q, k, v, o, !a.lse.empty(), !a.weights.empty());
  write_npy(out, r.out);
  if (lse) write_npy(*lse, r.lse);
  if (weights) write_npy(*weights, r.weights);
  outputs.commit();
  if (a.verbose) {
    std::cerr << "sattn attn: kernel " << r.info.kernel << "\n";
    for (const auto& [name, why] : r.info.rejected) std::cerr << "  not " << name << ": " << why << "\n";
  }
}

}  // namespace

void add_attn_command(CLI::App& app) {
  auto a = std::make_shared<AttnArgs>();
  auto* cmd = app.add_subcommand("attn", "Scaled-dot-product attention on .npy files");
  cmd->footer(
      "Shapes: q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv]; Hq must be a multiple of Hkv (query head h\n"
      "uses key/value head h // (Hq/Hkv)). out is [B, Hq, Lq, Dv] in the dtype of q (float32 for float16 input),\n"
      "lse [B, Hq, Lq], weights [B, Hq, Lq, Lk] (after dropout).\n"
      "Mask polarity: --mask bool True = MAY attend (PyTorch scaled_dot_product_attention), False = masked;\n"
      "a float --mask is added to the scores (-inf masks, a finite bias never does). --key-padding True = padding\n"
      "(nn.MultiheadAttention's key_padding_mask). All given masks and --causal are intersected. A query row that\n"
      "may attend to no key gets out = 0, weights = 0, lse = -inf.\n"
      "Example: sattn attn --q q.npy --k k.npy --v v.npy --causal bottom-right --out o.npy --lse l.npy");
  cmd->add_option("--q", a->q, "Query .npy, float32/float64/float16 [B, Hq, Lq, D]")->required();
  cmd->add_option("--k", a->k, "Key .npy [B, Hkv, Lk, D], same dtype as q")->required();
  cmd->add_option("--v", a->v, "Value .npy [B, Hkv, Lk, Dv], same dtype as q")->required();
  cmd->add_option("--mask", a->mask,
                  "attn_mask .npy broadcastable to [B, Hq, Lq, Lk]: bool with True = may attend (SDPA polarity), "
                  "or float32/float64 additive");
  auto* kp = cmd->add_option("--key-padding", a->key_padding, "Key padding .npy, bool [B, Lk], True = padding");
  auto* len = cmd->add_option("--lengths", a->lengths, "Key lengths .npy, int32/int64 [B]: keys j >= n[b] are padding");
  kp->excludes(len);
  len->excludes(kp);
  cmd->add_option("--causal", a->causal,
                  "Causal mask: none, top-left (PyTorch is_causal: key j <= i) or bottom-right "
                  "(FlashAttention >= 2.1: j <= i + Lk - Lq)")
      ->check(CLI::IsMember({"none", "top-left", "bottom-right", "top_left", "bottom_right"}))
      ->default_str("none");
  cmd->add_option("--scale", a->scale, "Score scale (default 1/sqrt(D))");
  cmd->add_option("--dropout", a->dropout, "Dropout probability in [0, 1) (Philox keep rule, see docs/semantics.md)")
      ->default_str("0");
  cmd->add_option("--seed", a->seed, "Dropout seed")->check(seed_range())->default_str("0");
  cmd->add_option("--kernel", a->kernel, "Kernel name (default: the registry's choice; see `sattn version`)");
  cmd->add_option("--threads", a->threads, "Threads (0 = SATTN_NUM_THREADS or all cores)")
      ->check(thread_range())
      ->default_str("0");
  cmd->add_flag("--fp64", a->fp64, "Accumulate in float64 (reference kernel) even for float32 inputs");
  cmd->add_option("--float32-precision", a->float32_precision,
                  "highest: float32 accuracy in every product; high: the AMX tiles (amx) take each "
                  "float32 value as the sum of two bfloat16 (within about 2^-17 relative), as "
                  "torch.set_float32_matmul_precision('high'); bf16: float32 inputs and the softmax probabilities "
                  "may be rounded to bfloat16 in the fused kernel's products where the CPU has bf16 products "
                  "(amx, avx512bf16), as torch.set_float32_matmul_precision('medium')")
      ->capture_default_str();
  cmd->add_option("--out", a->out, "Output .npy [B, Hq, Lq, Dv]")->required();
  cmd->add_option("--lse", a->lse, "Also write the log-sum-exp [B, Hq, Lq]");
  cmd->add_option("--weights", a->weights, "Also write the attention weights [B, Hq, Lq, Lk]");
  cmd->add_flag("--verbose", a->verbose, "Print which kernel ran (and why faster ones did not) on stderr");
  cmd->callback([a] { run_attn(*a); });
}

}  // namespace sattn::cli
