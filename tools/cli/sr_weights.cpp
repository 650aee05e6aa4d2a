// Default SR weights: embedded into the binary at build time when sr/weights/sattn_sr_x{2,4}.safetensors exist
// (CMake defines SATTN_SR_WEIGHTS_X2 / _X4 with their paths), else looked up in the source tree at run time.
#include <cstddef>
#include <filesystem>
#include <string>

#include "cli/sr_weights.hpp"
#include "sattn/error.hpp"

#define SATTN_STR2(x) #x
#define SATTN_INCBIN(sym, file)                                                                                        \
  __asm__(".section .rodata\n.balign 16\n.global " #sym "_begin\n" #sym "_begin:\n.incbin \"" file "\"\n.global " #sym \
          "_end\n" #sym "_end:\n.byte 0\n.previous\n");

#ifdef SATTN_SR_WEIGHTS_X2
SATTN_INCBIN(sattn_sr_x2, SATTN_SR_WEIGHTS_X2)
extern "C" const unsigned char sattn_sr_x2_begin[], sattn_sr_x2_end[];
#endif
#ifdef SATTN_SR_WEIGHTS_X4
SATTN_INCBIN(sattn_sr_x4, SATTN_SR_WEIGHTS_X4)
extern "C" const unsigned char sattn_sr_x4_begin[], sattn_sr_x4_end[];
#endif

namespace sattn::cli {

EmbeddedWeights embedded_sr_weights(int scale) {
#ifdef SATTN_SR_WEIGHTS_X2
  if (scale == 2) return {sattn_sr_x2_begin, size_t(sattn_sr_x2_end - sattn_sr_x2_begin), SATTN_SR_WEIGHTS_X2};
#endif
#ifdef SATTN_SR_WEIGHTS_X4
  if (scale == 4) return {sattn_sr_x4_begin, size_t(sattn_sr_x4_end - sattn_sr_x4_begin), SATTN_SR_WEIGHTS_X4};
#endif
  (void)scale;
  return {};
}

std::optional<sr::SrModel> find_sr_model(const std::string& weights, int scale, const char* what) {
  std::optional<sr::SrModel> m;
  if (!weights.empty()) {
    m = sr::SrModel::load(weights);
  } else if (const EmbeddedWeights e = embedded_sr_weights(scale); e.data) {
    m = sr::SrModel::from_memory(e.data, e.size, std::string("embedded:") + e.origin);
  } else if (const std::string f = source_tree_sr_weights(scale); std::filesystem::exists(f)) {
    m = sr::SrModel::load(f);
  } else {
    return std::nullopt;
  }
  check(scale == 0 || m->scale() == scale, ErrorKind::kInvalidArgument, what, ": x", scale,
        " asked for, but the weights '", m->name(), "' are for x", m->scale());
  return m;
}

std::string missing_sr_weights(int scale) {
  return "none embedded at build time and '" + source_tree_sr_weights(scale) + "' does not exist";
}

std::string source_tree_sr_weights(int scale) {
#ifdef SATTN_SOURCE_DIR
  return std::string(SATTN_SOURCE_DIR) + "/sr/weights/sattn_sr_x" + std::to_string(scale) + ".safetensors";
#else
  return "sr/weights/sattn_sr_x" + std::to_string(scale) + ".safetensors";
#endif
}

}  // namespace sattn::cli
