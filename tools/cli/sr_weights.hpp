#pragma once
#include <cstddef>
#include <string>

namespace sattn::cli {
struct EmbeddedWeights {
  const unsigned char* data = nullptr;
  size_t size = 0;
  const char* origin = nullptr;  // the file embedded at build time
};
// The weights embedded at build time for ×scale, or {} when none were available then.
EmbeddedWeights embedded_sr_weights(int scale);
// <source tree>/sr/weights/sattn_sr_x<scale>.safetensors (the run-time fallback).
std::string source_tree_sr_weights(int scale);
}  // namespace sattn::cli
