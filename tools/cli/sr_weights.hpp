// The SR model weights of the command: a file given with --weights, else the weights embedded at build time, else
// the source tree's sr/weights/ file. One lookup for every subcommand (sr, demo, viz --image).
#pragma once
#include <cstddef>
#include <optional>
#include <string>

#include "sattn/sr.hpp"

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

// The SR model: the file `weights` when not empty (any scale when `scale` is 0), else the default weights for
// ×scale (embedded, else the source tree's file); nullopt when there are none. A model whose scale is not `scale`
// is an InvalidArgument error naming `what` (e.g. "sr: --scale").
std::optional<sr::SrModel> find_sr_model(const std::string& weights, int scale, const char* what);

// Where the default weights for ×scale were looked for, for the message when there are none.
std::string missing_sr_weights(int scale);
}  // namespace sattn::cli
