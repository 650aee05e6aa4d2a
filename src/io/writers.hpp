// The library's file formats written into an OutputFile that the caller opened (a command opens its outputs before
// it computes) and commits. The public writers of a path are these with an OutputFile of their own.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "io/output_file.hpp"
#include "sattn/sr.hpp"
#include "sattn/tensor.hpp"
#include "sattn/viz.hpp"

namespace sattn {

void write_npy(io::OutputFile& out, const TensorView& tensor);
void write_safetensors(io::OutputFile& out, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

namespace sr {
void write_png(io::OutputFile& out, const Image& image);
}  // namespace sr

namespace viz {
void write_png(io::OutputFile& out, const Image& image);
}  // namespace viz

}  // namespace sattn
