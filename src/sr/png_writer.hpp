// sr::write_png into an OutputFile that the caller opened and commits (io/output_file.hpp); the tensor formats are
// in io/writers.hpp.
#pragma once

#include "io/output_file.hpp"
#include "sattn/image.hpp"

namespace sattn::sr {

void write_png(io::OutputFile& out, const Image& image, int compression_level = kDefaultPngCompression,
               int num_threads = 0);

}  // namespace sattn::sr
