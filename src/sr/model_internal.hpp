// The SR model's prepared weights, shared by its three files: model_load.cpp (the safetensors file, the config,
// the weights re-laid out for the kernels), model.cpp (the forward) and upscale.cpp (images, tiles, self-ensemble).
// Internal.
#pragma once

#include <cstdint>
#include <vector>

#include "sattn/sr.hpp"

namespace sattn::sr {

struct BlockW {
  int ws = 8;
  bool cyclic_shift = false;  // cyclic shifted windows (Swin): rolled by ws / 2, docs/sparse.md "Shifted windows"
  std::vector<float> dw, dw_b, pw, pw_b, router_w;  // dw [9][C], pw [C][C] (in-major)
  float router_b = 0;
  std::vector<float> n1_w, n1_b, qkv, qkv_b, proj, proj_b, n2_w, n2_b, fc1, fc1_b, fc2, fc2_b;
};
struct GroupW {
  std::vector<BlockW> blocks;
  std::vector<float> dw, dw_b, pw, pw_b;
};

struct SrModel::Prepared {
  std::vector<float> head, head_b, body_tail, body_tail_b, up, up_b;
  std::vector<GroupW> groups;
};

// Refuses, before anything is allocated, an output of more than options.max_output_pixels.
void check_output_pixels(int64_t h, int64_t w, int64_t s, const UpscaleOptions& options, const char* fn);

}  // namespace sattn::sr
