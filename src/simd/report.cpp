// simd_targets() and set_simd_target() (sattn/simd.hpp): the one target table and each component's build.
#include "sattn/simd.hpp"

#include <array>

#include "kernels/fused/fused.hpp"
#include "simd/target.hpp"

namespace sattn {
namespace simd {
namespace {
using BuildName = const char* (*)();
std::array<BuildName, kNumComponents>& registry() {
  static std::array<BuildName, kNumComponents> builds{};
  return builds;
}
std::string build_of(Component c) {
  const BuildName f = registry()[size_t(c)];
  return f != nullptr ? f() : "";
}
}  // namespace

bool register_build(Component c, const char* (*build)()) {
  registry()[size_t(c)] = build;
  return true;
}
}  // namespace simd

SimdTargets simd_targets() {
  SimdTargets t;
  t.selected = simd::name(simd::selected());
  for (simd::Target a : simd::available()) t.available.emplace_back(simd::name(a));
  t.fused = fused::simd_build();
  t.sparse_tiles = simd::build_of(simd::Component::kSparseTiles);
  t.topk = simd::build_of(simd::Component::kTopK);
  t.nn = simd::build_of(simd::Component::kNn);
  return t;
}

void set_simd_target(const std::string& name) { simd::select(simd::parse(name, "set_simd_target")); }

namespace {
// The table's entries for inputs of `dtype` that take the bf16 products (bf16_products) or not, `no_bf16` saying why
// not where a bf16 target would otherwise run.
std::vector<std::pair<std::string, std::string>> explain_targets(DType dtype, bool bf16_products,
                                                                 const std::string& no_bf16) {
  using simd::Target;
  const Target selected = simd::selected(), picked = simd::parse(fused::simd_build(), "fused build");
  // The fused kernel's build under `selected`: the bf16 entry serves only the inputs that take the bf16 products.
  const bool bf16_build = picked == Target::kAmx || picked == Target::kAvx512Bf16;
  const Target used = bf16_build && !bf16_products ? Target::kAvx512 : picked;
  const char* needs[simd::kNumTargets] = {"",  // amx: simd::amx_unavailable_reason()
                                          "AVX-512 (F, BW, DQ, VL) and AVX512-BF16",
                                          "AVX-512 (F, BW, DQ, VL)",
                                          "AVX2 and FMA",
                                          "SSE4.1/4.2",
                                          ""};
  std::vector<std::pair<std::string, std::string>> out;
  for (int i = 0; i < simd::kNumTargets; ++i) {
    const Target t = Target(i);
    std::string why;
    if (dtype == DType::kF64) {
      why = "float64 inputs run the reference kernel (no SIMD build)";
    } else if (t == Target::kAmx && !simd::cpu_runs(t)) {
      why = simd::amx_unavailable_reason();
    } else if (!simd::cpu_runs(t)) {
      why = std::string("this CPU lacks ") + needs[i];
    } else if (i < int(selected)) {
      why = std::string("wider than the selected target '") + simd::name(selected) +
            "' (SATTN_SIMD or set_simd_target chose it)";
    } else if ((t == Target::kAmx || t == Target::kAvx512Bf16) && t != used && !bf16_products) {
      why = no_bf16;
    } else if (t != used) {
      why = std::string("the wider '") + simd::name(used) + "' build runs";
    }
    out.emplace_back(simd::name(t), why);
  }
  return out;
}

// Whether inputs of `dtype` under `precision` take the bf16 products of the selected build (float16 in the
// forward, and float32 under kHigh, forward and backward: the amx tiles, each value as two bf16), and why not.
bool takes_bf16(DType dtype, Float32Precision precision, bool forward, std::string* why) {
  const bool amx = simd::parse(fused::simd_build(), "fused build") == simd::Target::kAmx;
  if (fused::takes_split_bf16(dtype, precision)) {
    if (dtype == DType::kF16) {
      *why =
          "float16 inputs take bf16 products only in the forward on AMX tiles (each value as two bf16), else the "
          "float32 ones";
      return amx && forward;
    }
    *why =
        "float32 inputs under float32_precision='high' take bf16 products only on AMX tiles (each value as two "
        "bf16), else the float32 ones";
    return amx;
  }
  *why = amx ? "float32 inputs take the bf16 products only with float32_precision='bf16' or 'high'"
             : "float32 inputs take the bf16 products only with float32_precision='bf16'";
  return fused::takes_bf16_products(dtype, precision);
}
}  // namespace

std::vector<std::pair<std::string, std::string>> explain_simd_targets(DType dtype, Float32Precision precision) {
  std::string why;
  const bool bf16 = takes_bf16(dtype, precision, true, &why);
  return explain_targets(dtype, bf16, why);
}

std::vector<std::pair<std::string, std::string>> explain_simd_targets(const AttentionProblem& problem,
                                                                      Float32Precision precision) {
  std::string why;
  bool bf16 = takes_bf16(problem.dtype_q, precision, !problem.backward, &why);
  const bool halves = fused::takes_split_bf16(problem.dtype_q, precision);  // two bf16 each
  if (bf16 && !fused::bf16_products_pay(problem.head_dim, problem.len_k, halves)) {
    bf16 = false;
    why = "keys too short for the bf16 products to pay (D·Lk = " + std::to_string(problem.head_dim * problem.len_k) +
          (halves ? ", at most 4096, or D not a multiple of 16" : ", below 2048") +
          "; SATTN_FUSED_TILE_MIN_WORK): the float32 products";
  }
  return explain_targets(problem.dtype_q, bf16, why);
}

}  // namespace sattn
