// The tensor file formats written into an OutputFile that the caller opened (a command opens its outputs before it
// computes) and commits. The public writers of a path are these with an OutputFile of their own. PNG images go the
// same way through sr/png_writer.hpp and viz/viz.hpp.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "io/output_file.hpp"
#include "sattn/tensor.hpp"

namespace sattn {

void write_npy(io::OutputFile& out, const TensorView& tensor);
void write_safetensors(io::OutputFile& out, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace sattn
