// `sattn viz`: attention maps as PNG — one heatmap per (batch entry, head), a grid of all heads with a colour bar
// and axis labels, and query-focus views (the keys one query attends to).
#include <filesystem>
#include <iostream>

#include "cli/commands.hpp"
#include "cli/tool_inputs.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/viz.hpp"

namespace sattn::cli {
namespace {

struct VizArgs {
  std::string q, k, out, pattern, image, cmap = "viridis";
  MaskArgs masks;
  std::vector<int64_t> queries;
  int columns = 0, side = 0;
  double vmax = 0;
  bool has_vmax = false;
  bool example = false;
};

void run_viz(const VizArgs& a) {
  // Hooks for work that lands on other branches; refuse clearly instead of drawing something misleading.
  check(a.pattern.empty(), ErrorKind::kUnsupported, "--pattern '", a.pattern,
        "': sparse/adaptive pattern maps are not yet available in this build (they arrive with the sparse kernels)");
  check(a.image.empty(), ErrorKind::kUnsupported, "--image '", a.image,
        "': attention maps of the super-resolution model are not yet available in this build");
  // TODO(nn): `--mha weights.safetensors --x x.npy` once include/sattn/mha.hpp lands: project x with the
  // module's in_proj weights to q/k [B, H, L, D] and reuse everything below (torch MHA mask polarity!).
  check(a.example || (!a.q.empty() && !a.k.empty()), ErrorKind::kInvalidArgument,
        "--q and --k: both are required (or --example)");
  check(!a.example || (a.q.empty() && a.k.empty()), ErrorKind::kInvalidArgument,
        "--example: replaces --q/--k, give one or the other");
  Tensor q, k;
  if (a.example) {
    const viz::ExampleInputs ex = viz::example_inputs(1, 4, 48, 32, 7);
    q = ex.q, k = ex.k;
  } else {
    q = read_npy(a.q), k = read_npy(a.k);
  }
  LoadedMasks m = load_masks(a.masks);
  const viz::AttentionMaps maps = viz::attention_maps(q, k, m.options);
  std::filesystem::create_directories(a.out);

  viz::HeatmapStyle style;
  style.cmap = viz::parse_colormap(a.cmap);
  if (a.has_vmax) style.vmax = a.vmax;
  std::vector<std::string> written;
  auto save = [&](const std::string& name, const viz::Image& img) {
    const std::string path = (std::filesystem::path(a.out) / name).string();
    viz::write_png(path, img);
    written.push_back(path);
  };
  const bool progress = stderr_is_tty();
  std::vector<std::string> titles;
  for (int64_t b = 0; b < maps.batch; ++b)
    for (int64_t h = 0; h < maps.heads; ++h) {
      if (progress) std::cerr << "\rviz: head " << b * maps.heads + h + 1 << "/" << maps.batch * maps.heads << std::flush;
      viz::HeatmapStyle s = style;
      s.title = "attention weights, batch " + std::to_string(b) + " head " + std::to_string(h);
      if (a.side > 0) s.plot_side = a.side;
      save("head_" + std::to_string(b) + "_" + std::to_string(h) + ".png", viz::render_heatmap(maps.at(b, h), s));
      titles.push_back("b" + std::to_string(b) + " h" + std::to_string(h));
    }
  if (progress) std::cerr << "\r" << std::string(40, ' ') << "\r";
  {
    viz::HeatmapStyle s = style;
    s.title = "attention weights, " + std::to_string(maps.batch * maps.heads) + " heads (grey: masked)";
    s.plot_side = a.side > 0 ? a.side : 160;
    const int cols = a.columns > 0 ? a.columns : int(std::min<int64_t>(maps.heads, 4));
    save("heads.png", viz::render_heatmap_grid(maps.maps, titles, cols, s));
  }
  std::vector<int64_t> queries = a.queries;
  if (queries.empty()) queries.push_back(maps.len_q / 2);
  for (int64_t qi : queries) {
    check(qi >= 0 && qi < maps.len_q, ErrorKind::kInvalidArgument, "--query: expected an index in [0, Lq = ",
          maps.len_q, "), got ", qi);
    viz::Matrix rows(maps.batch * maps.heads, maps.len_k);
    std::vector<std::string> labels;
    for (int64_t b = 0; b < maps.batch; ++b)
      for (int64_t h = 0; h < maps.heads; ++h) {
        for (int64_t j = 0; j < maps.len_k; ++j) rows.at(b * maps.heads + h, j) = maps.at(b, h).at(qi, j);
        std::string label = maps.batch > 1 ? "b" + std::to_string(b) : std::string();
        label += "h";
        label += std::to_string(h);
        labels.push_back(label);
      }
    viz::HeatmapStyle s = style;
    if (a.side > 0) s.plot_side = a.side;
    save("query_" + std::to_string(qi) + ".png",
         viz::render_query_focus(rows, labels, "keys attended by query " + std::to_string(qi), s));
  }
  for (const auto& p : written) std::cout << p << "\n";
}

}  // namespace

void add_viz_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("viz", "Attention maps as PNG: DIR/head_<b>_<h>.png, DIR/heads.png (grid with colour "
                                        "bar), DIR/query_<i>.png (the keys one query attends to)");
  auto a = std::make_shared<VizArgs>();
  cmd->add_option("--q", a->q, "queries .npy [B, Hq, Lq, D]")->check(CLI::ExistingFile);
  cmd->add_option("--k", a->k, "keys .npy [B, Hkv, Lk, D]")->check(CLI::ExistingFile);
  cmd->add_flag("--example", a->example, "use generated inputs instead of --q/--k: 4 heads, L=48, D=32 with a diagonal, "
                                         "a 3-back, a sink and a random head");
  add_mask_options(cmd, a->masks, true);
  cmd->add_option("--pattern", a->pattern, "sparse/adaptive pattern SPEC to draw (not yet available in this build)");
  cmd->add_option("--image", a->image, "an image through the SR model (not yet available in this build)");
  cmd->add_option("--query", a->queries, "query index for a focus view (repeatable; default Lq/2)");
  cmd->add_option("--cmap", a->cmap, "colour map")->check(CLI::IsMember({"viridis", "magma", "gray"}));
  cmd->add_option("--columns", a->columns, "panels per row in heads.png (default min(Hq, 4))")->check(CLI::Range(1, 64));
  cmd->add_option("--side", a->side, "size of a map in pixels (default 384, 160 in the grid)")->check(CLI::Range(16, 4096));
  cmd->add_option("--vmax", a->vmax, "top of the colour scale (default: the largest weight)")
      ->each([a](const std::string&) { a->has_vmax = true; });
  cmd->add_option("--out", a->out, "output directory (created)")->required();
  cmd->callback([a] { run_viz(*a); });
}

}  // namespace sattn::cli
