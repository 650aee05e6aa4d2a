// SIMD targets: every kernel with SIMD code (the fused kernel, the sparse tiles, TopK's scoring, the nn/SR kernels)
// runs the build for the target selected for the process. The selection is made once, on first use: the widest
// target this CPU runs, or SATTN_SIMD=<name>; set_simd_target changes it, for tests and measurements.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "sattn/problem.hpp"

namespace sattn {

struct SimdTargets {
  std::string selected;                // the target selected for the process
  std::vector<std::string> available;  // the targets this CPU runs, widest first ("portable" last)
  // The build each component runs under `selected`: the widest it was compiled for, no wider than `selected`.
  // fused is in sattn::core; sparse_tiles and topk are "" in a program that does not link sattn::sparse, nn in one
  // that does not link sattn::nn (the umbrella sattn::sattn links both).
  std::string fused, sparse_tiles, topk, nn;
};

SimdTargets simd_targets();

// For every SIMD target of the table (widest first), whether the fused kernel would run that target's build for
// inputs of `dtype` with `precision` (second = "") or why not: the CPU lacks it, it is wider than the selected
// target, it has nothing for this dtype/option (amx and avx512bf16: only bf16 inputs, or float32 ones with
// Float32Precision::kBF16), or a wider build runs. float64 inputs run the reference kernel: every entry says so.
std::vector<std::pair<std::string, std::string>> explain_simd_targets(DType dtype, Float32Precision precision);
// The same for one problem (its query dtype, pass, head dim and key length): also "not used" for the bf16 targets
// where its keys are too short for the bf16 products to pay (docs/fused.md) and for float16 inputs in the backward.
std::vector<std::pair<std::string, std::string>> explain_simd_targets(const AttentionProblem& problem,
                                                                      Float32Precision precision);

// Selects a target by name: "amx", "avx512bf16", "avx512", "avx2", "sse4", "portable" or "auto" (the widest this CPU
// runs); amx and avx512bf16 differ from avx512 only in the fused kernel's bf16 products (AMX tiles, vdpbf16ps). The
// names "avx2+fma", "base" and "scalar" are accepted too. Throws sattn::Error: InvalidArgument for an unknown name,
// Unsupported when this CPU cannot run it. Takes effect for calls that start after it returns.
void set_simd_target(const std::string& name);

}  // namespace sattn
