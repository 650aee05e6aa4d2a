// `sattn viz --image`: the SR model's window attention and routing drawn over the picture (viz_image.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "viz/viz.hpp"

namespace sattn::cli {

struct VizImageArgs {
  std::string image, out, weights, block, attention = "sparse", cmap = "viridis";
  int sr_scale = 0;           // 0: the scale of --weights, else 2 (the embedded weights)
  int64_t window = -1;        // -1: from --at, else the window holding the image centre
  std::vector<int64_t> at;    // X,Y: an LR pixel (of the cropped image)
  std::vector<int64_t> crop;  // X,Y,W,H
  int64_t max_pixels = 256 * 256;
  int side = 0;  // size of a picture panel (0: defaults)
  int columns = 0;
};

struct VizImagePictures {
  std::vector<std::pair<std::string, sr::Image>> pictures;  // file name, picture
  std::string json;                                         // routing.json
  std::string summary;                                      // one line for a report
};
// The pictures without writing them (args.out unused); `sattn report --image` embeds them.
VizImagePictures render_viz_image(const VizImageArgs& args);

// Runs the model once on the (cropped) image, capturing the chosen window's attention and every block's router
// gates, and writes head_<h>.png, heads.png, focus.png, routing.png and routing.json to args.out. Throws
// sattn::Error on bad input.
void run_viz_image(const VizImageArgs& args);

}  // namespace sattn::cli
