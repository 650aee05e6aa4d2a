// The SR model's prepared weights, shared by its three files: model_load.cpp (the safetensors file, the config,
// the weights re-laid out for the kernels), model.cpp (the forward) and upscale.cpp (images, tiles, self-ensemble).
// Internal.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "nn/ops.hpp"
#include "sattn/attention.hpp"
#include "sattn/sr.hpp"

namespace sattn::sr {

// A GEMM weight in nn's layout ([K][padded_cols(N)] floats) and its bf16 pairs (nn::weight_pairs), which the
// products take under UpscaleOptions::float32_precision = kBF16.
struct GemmWeight {
  WorkspaceVector<float> f;         // cache-line aligned, as the pairs
  WorkspaceVector<uint32_t> pairs;  // empty for an odd K
  GemmWeight() = default;
  GemmWeight(const std::vector<float>& w, int64_t n) : f(w.begin(), w.end()), pairs(nn::weight_pairs(w, n)) {}
  const float* data() const { return f.data(); }
  // the pairs when `precision` asks for bf16 products, else null (the float32 weight)
  const uint32_t* pairs_for(Float32Precision precision) const {
    return precision == Float32Precision::kBF16 && !pairs.empty() ? pairs.data() : nullptr;
  }
};

struct BlockW {
  int ws = 8;
  bool cyclic_shift = false;  // cyclic shifted windows (Swin): rolled by ws / 2, docs/sparse.md "Shifted windows"
  std::vector<float> dw, dw_b, pw_b, router_w;  // dw [9][C]
  GemmWeight pw;                                // [C][C] (in-major)
  float router_b = 0;
  std::vector<float> n1_w, n1_b, qkv_b, proj_b, n2_w, n2_b, fc1_b, fc2_b;
  GemmWeight qkv, proj, fc1, fc2;
};
struct GroupW {
  std::vector<BlockW> blocks;
  std::vector<float> dw, dw_b, pw_b;
  GemmWeight pw;
};

struct SrModel::Prepared {
  std::vector<float> head, head_b, body_tail_b, up_b;  // head: Cin = 3, float32 products only
  GemmWeight body_tail, up;
  std::vector<GroupW> groups;
};

// Refuses, before anything is allocated, an output of more than options.max_output_pixels.
void check_output_pixels(int64_t h, int64_t w, int64_t s, const UpscaleOptions& options, const char* fn);

}  // namespace sattn::sr
