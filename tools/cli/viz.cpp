// `sattn viz`: attention maps as PNG — one heatmap per (batch entry, head), a grid of all heads with a colour bar
// and axis labels, and query-focus views (the keys one query attends to).
#include <filesystem>
#include <algorithm>
#include <iostream>
#include <limits>

#include "cli/commands.hpp"
#include "cli/tool_inputs.hpp"
#include "cli/viz_image.hpp"
#include "io/writers.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/mha.hpp"
#include "sattn/patterns.hpp"
#include "sattn/safetensors.hpp"
#include "sattn/sparse.hpp"
#include "sr/png_writer.hpp"
#include "viz/viz.hpp"

namespace sattn::cli {
namespace {

struct VizArgs {
  std::string q, k, out, pattern, cmap = "viridis";
  std::string mha, x, key, value;  // --mha weights.safetensors on --x [--key --value]
  int64_t embed_dim = 0, num_heads = 0;
  bool batch_first = false;
  MaskArgs masks;
  std::vector<int64_t> queries;
  int columns = 0, side = 0;
  double vmax = 0;
  bool has_vmax = false;
  bool example = false;
  VizImageArgs img;  // --image and its options
};

// A bool [heads, Lq, Lk] (or [1, Lq, Lk] / [B, Hq, Lq, Lk]) mask as matrices: 1 where a key is allowed, NaN (grey)
// where it is not. `lead` = the number of leading matrices (product of the leading dimensions).
std::vector<viz::Matrix> mask_matrices(const Tensor& mask) {
  const Shape& s = mask.shape();
  const int64_t lq = s[s.size() - 2], lk = s[s.size() - 1], lead = mask.numel() / std::max<int64_t>(lq * lk, 1);
  const auto* m = mask.data<uint8_t>();
  std::vector<viz::Matrix> out;
  for (int64_t x = 0; x < lead; ++x) {
    viz::Matrix mat(lq, lk);
    for (int64_t i = 0; i < lq * lk; ++i)
      mat.data[size_t(i)] = m[x * lq * lk + i] ? 1.0 : std::numeric_limits<double>::quiet_NaN();
    out.push_back(std::move(mat));
  }
  return out;
}

// The element of a user attn_mask (broadcastable to [B, Hq, Lq, Lk], right-aligned) for (b, h, i, j).
double mask_at(const TensorView& m, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t full[4] = {b, h, i, j};
  int64_t idx[4] = {0, 0, 0, 0};
  const int64_t nd = m.dim();
  for (int64_t d = 0; d < nd; ++d) idx[d] = m.size(d) == 1 ? 0 : full[4 - nd + d];
  return m.get(idx);
}

// What --pattern adds to a viz run: the pattern's own pictures and the attn_mask the maps are computed under.
struct PatternPictures {
  std::vector<std::pair<std::string, sr::Image>> images;  // file name, picture
  Tensor attn_mask;                                       // [B, Hq, Lq, Lk]: bool, or additive if --mask is float
};

PatternPictures pattern_pictures(const std::string& spec, const Tensor& q, const Tensor& k, const LoadedMasks& m,
                                 const VizArgs& a, const viz::HeatmapStyle& base) {
  const sparse::Pattern pattern = sparse::Pattern::parse(spec);
  check(q.dim() == 4 && k.dim() == 4, ErrorKind::kInvalidArgument,
        "--q/--k: expected [B, H, L, D] with --pattern, got ", shape_text(q.shape()), " and ", shape_text(k.shape()));
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2);
  check(double(B) * double(H) * double(Lq) * double(Lk) <= double(int64_t(1) << 27), ErrorKind::kOutOfMemory,
        "--pattern: [B, Hq, Lq, Lk] = ", shape_text({B, H, Lq, Lk}),
        " has more than 2^27 entries; slice the inputs to draw them");
  const Shape sel_shape = sparse::selection_shape(pattern, B, H, Lq, Lk);
  const bool adaptive = !sel_shape.empty();  // TopK / BlockTopK (alone or & a fixed pattern)
  const std::string repr = pattern.repr();
  check(repr.find("ReLUAttention") == std::string::npos && repr.find("MixedAttention") == std::string::npos,
        ErrorKind::kUnsupported, "--pattern '", spec,
        "': ReLUAttention/MixedAttention weights are not a softmax over allowed keys and cannot be drawn as attention "
        "maps; adaptive patterns that can be drawn: TopK, BlockTopK");
  PatternPictures out;
  viz::HeatmapStyle s = base;
  s.colorbar = false;
  if (a.side > 0) s.plot_side = a.side;
  Tensor allowed(DType::kBool, {B, H, Lq, Lk});  // the pairs the pattern lets through (selected, for adaptive)
  auto* al = allowed.data<uint8_t>();
  if (!adaptive) {
    pattern.check_lengths(Lq, Lk);
    const Tensor dm = pattern.dense_mask(Lq, Lk, H);  // [H or 1, Lq, Lk]
    const auto mats = mask_matrices(dm);
    for (size_t x = 0; x < mats.size(); ++x) {
      s.title = "allowed keys: " + pattern.repr() + (mats.size() > 1 ? ", head " + std::to_string(x) : "");
      out.images.emplace_back(mats.size() > 1 ? "pattern_h" + std::to_string(x) + ".png" : "pattern.png",
                              viz::render_heatmap(mats[x], s));
    }
    const auto* d = dm.data<uint8_t>();
    const int64_t hs = dm.size(0) == 1 ? 0 : 1;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) std::copy_n(d + h * hs * Lq * Lk, Lq * Lk, al + (b * H + h) * Lq * Lk);
  } else {
    // The selection depends on q and k (and on nothing the sparse kernel does not see: masks and causality
    // must be part of the pattern, e.g. "TopK(8) & SlidingWindow(-1, 0)").
    check(a.masks.mask.empty() && (a.masks.causal.empty() || a.masks.causal == "none"), ErrorKind::kUnsupported,
          "--pattern '", spec,
          "': --mask/--causal are not seen by the adaptive selection; put them in the pattern "
          "(e.g. \"TopK(8) & SlidingWindow(-1, 0)\" for causal)");
    Tensor qf = q.dtype() == DType::kF32 ? q : q.to(DType::kF32), kf = k.dtype() == DType::kF32 ? k : k.to(DType::kF32);
    Tensor v(DType::kF32, {k.size(0), k.size(1), Lk, 1}), o(DType::kF32, {B, H, Lq, 1});
    Tensor idx(DType::kI64, sel_shape);
    sparse::SparseOptions so;
    if (m.options.scale) so.scale = m.options.scale;
    so.key_padding_mask = m.options.key_padding_mask;
    so.key_lengths = m.options.key_lengths;
    sparse::sparse_attention(qf, kf, v, pattern, so, o, {}, idx);
    const Tensor sel = sparse::selection_mask(pattern, idx, Lq, Lk);  // [B, Hq, Lq, Lk]
    std::copy_n(sel.data<uint8_t>(), B * H * Lq * Lk, al);
    const auto mats = mask_matrices(sel);
    std::vector<std::string> titles;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        s.title = "selected keys: " + pattern.repr() + ", batch " + std::to_string(b) + " head " + std::to_string(h);
        out.images.emplace_back("selected_" + std::to_string(b) + "_" + std::to_string(h) + ".png",
                                viz::render_heatmap(mats[size_t(b * H + h)], s));
        titles.push_back("b" + std::to_string(b) + " h" + std::to_string(h));
      }
    s.title = "selected keys: " + pattern.repr();
    s.plot_side = a.side > 0 ? a.side : 160;
    out.images.emplace_back(
        "selected.png",
        viz::render_heatmap_grid(mats, titles, a.columns > 0 ? a.columns : int(std::min<int64_t>(H, 4)), s));
  }
  // The maps are computed by the reference under attn_mask = pattern AND --mask (bool), or --mask where the
  // pattern allows and -inf elsewhere (float --mask keeps its additive values).
  const TensorView um = m.options.attn_mask;
  if (!um.empty()) {
    bool ok = um.dim() >= 2 && um.dim() <= 4;
    const int64_t full[4] = {B, H, Lq, Lk};
    for (int64_t d = 0; ok && d < um.dim(); ++d) ok = um.size(d) == 1 || um.size(d) == full[4 - um.dim() + d];
    check(ok, ErrorKind::kInvalidArgument,
          "--mask: expected a shape broadcastable to [B, Hq, Lq, Lk] = ", shape_text({B, H, Lq, Lk}), ", got ",
          shape_text(um.shape));
  }
  const bool additive = !um.empty() && um.dtype != DType::kBool;
  out.attn_mask = Tensor(additive ? DType::kF64 : DType::kBool, {B, H, Lq, Lk});
  size_t n = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq; ++i)
        for (int64_t j = 0; j < Lk; ++j, ++n) {
          const double u = um.empty() ? 1.0 : mask_at(um, b, h, i, j);
          if (additive) out.attn_mask.data<double>()[n] = al[n] ? u : -std::numeric_limits<double>::infinity();
          else out.attn_mask.data<uint8_t>()[n] = al[n] && u != 0.0 ? 1 : 0;
        }
  return out;
}

// MultiheadAttention's per-head weights (need_weights, average_attn_weights=false) as maps [N, H, L, S].
viz::AttentionMaps mha_maps(const VizArgs& a) {
  check(a.q.empty() && a.k.empty() && !a.example && a.pattern.empty(), ErrorKind::kInvalidArgument,
        "--mha: draws the module's own weights; --q/--k/--example/--pattern do not apply");
  check(a.masks.mask.empty() && a.masks.key_padding.empty() && a.masks.lengths.empty() &&
            (a.masks.causal.empty() || a.masks.causal == "none") && !a.masks.has_scale,
        ErrorKind::kInvalidArgument,
        "--mha: --mask/--key-padding/--lengths/--causal/--scale are not supported with "
        "--mha (torch MHA's mask polarity differs from sattn's)");
  check(!a.x.empty(), ErrorKind::kInvalidArgument, "--x: required with --mha (the query input .npy)");
  check(a.embed_dim > 0 && a.num_heads > 0, ErrorKind::kInvalidArgument,
        "--embed-dim/--num-heads: both required with --mha, got ", a.embed_dim, " and ", a.num_heads);
  check(a.value.empty() || !a.key.empty(), ErrorKind::kInvalidArgument, "--value: needs --key");
  const Tensor x = read_npy(a.x);
  const Tensor key = a.key.empty() ? x : read_npy(a.key);
  const Tensor value = a.value.empty() ? key : read_npy(a.value);
  const SafetensorsFile st = read_safetensors(a.mha);
  check(key.dim() >= 1 && value.dim() >= 1, ErrorKind::kInvalidArgument, "--key/--value: expected [S, N, dim]");
  nn::MultiheadAttention mha(a.embed_dim, a.num_heads, 0.0, st.tensors.count("in_proj_bias") > 0,
                             st.tensors.count("bias_k") > 0, false, key.size(-1), value.size(-1), a.batch_first,
                             x.dtype() == DType::kF64 ? DType::kF64 : DType::kF32);
  mha.load_state_dict(st.tensors);
  mha.eval();
  const Tensor xf = x.dtype() == DType::kF64 || x.dtype() == DType::kF32 ? x : x.to(DType::kF32);
  const Tensor kf = key.dtype() == xf.dtype() ? key : key.to(xf.dtype());
  const Tensor vf = value.dtype() == xf.dtype() ? value : value.to(xf.dtype());
  const auto [out, w] = mha.forward(xf, kf, vf, {}, true, {}, false);
  check(w.has_value(), ErrorKind::kInternal, "--mha: the module returned no weights");
  // [N, H, L, S] per head, or [H, L, S] for unbatched input.
  const Tensor wt = w->dim() == 3 ? w->reshape({1, w->size(0), w->size(1), w->size(2)}) : *w;
  viz::AttentionMaps maps{wt.size(0), wt.size(1), wt.size(2), wt.size(3), {}};
  for (int64_t b = 0; b < maps.batch; ++b)
    for (int64_t h = 0; h < maps.heads; ++h) {
      viz::Matrix mm(maps.len_q, maps.len_k);
      for (int64_t i = 0; i < maps.len_q; ++i)
        for (int64_t j = 0; j < maps.len_k; ++j) mm.at(i, j) = wt.view().get({b, h, i, j});
      maps.maps.push_back(std::move(mm));
    }
  return maps;
}

void run_viz(const VizArgs& a) {
  if (!a.img.image.empty()) {
    check(a.q.empty() && a.k.empty() && !a.example && a.mha.empty() && a.pattern.empty() && a.queries.empty() &&
              a.masks.mask.empty() && a.masks.key_padding.empty() && a.masks.lengths.empty() &&
              (a.masks.causal.empty() || a.masks.causal == "none") && !a.masks.has_scale && !a.has_vmax,
          ErrorKind::kInvalidArgument,
          "--image: draws the SR model's own attention; --q/--k/--example/--mha/--pattern/"
          "--query/--vmax, --scale (the softmax scale; the model's is --sr-scale) and the mask options do not apply "
          "(choose the window with --block, --window or --at)");
    VizImageArgs ia = a.img;
    ia.out = a.out, ia.cmap = a.cmap, ia.side = a.side, ia.columns = a.columns;
    run_viz_image(ia);
    return;
  }
  check(a.img.window < 0 && a.img.at.empty() && a.img.crop.empty() && a.img.block.empty() && a.img.weights.empty(),
        ErrorKind::kInvalidArgument, "--block/--window/--at/--crop/--weights: only with --image");
  create_output_directory(a.out);
  io::OutputFiles outputs;  // heads.png is opened before the work: an unwritable folder fails at once
  const std::string heads_path = (std::filesystem::path(a.out) / "heads.png").string();
  io::OutputFile& heads_file = outputs.add(heads_path, "--out");
  viz::HeatmapStyle style;
  style.cmap = viz::parse_colormap(a.cmap);
  if (a.has_vmax) style.vmax = a.vmax;
  PatternPictures pp;
  viz::AttentionMaps maps;
  if (!a.mha.empty()) {
    maps = mha_maps(a);
  } else {
    check(a.example || (!a.q.empty() && !a.k.empty()), ErrorKind::kInvalidArgument,
          "--q and --k: both are required (or --example, or --mha)");
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
    if (!a.pattern.empty()) {
      pp = pattern_pictures(a.pattern, q, k, m, a, style);
      m.options.attn_mask = pp.attn_mask.view();
    }
    maps = viz::attention_maps(q, k, m.options);
  }
  std::vector<std::string> written;
  auto save = [&](const std::string& name, const sr::Image& img) {
    const std::string path = (std::filesystem::path(a.out) / name).string();
    if (std::find(written.begin(), written.end(), path) != written.end()) return;  // a --query given twice
    io::OutputFile& f = path == heads_path ? heads_file : outputs.add(path, "--out");
    sr::write_png(f, img);
    f.close();  // one open file at a time; the renames wait for commit()
    written.push_back(path);
  };
  for (const auto& [name, img] : pp.images) save(name, img);
  const bool progress = stderr_is_tty();
  std::vector<std::string> titles;
  for (int64_t b = 0; b < maps.batch; ++b)
    for (int64_t h = 0; h < maps.heads; ++h) {
      if (progress)
        std::cerr << "\rviz: head " << b * maps.heads + h + 1 << "/" << maps.batch * maps.heads << std::flush;
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
    check(qi >= 0 && qi < maps.len_q, ErrorKind::kInvalidArgument,
          "--query: expected an index in [0, Lq = ", maps.len_q, "), got ", qi);
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
  outputs.commit();
  for (const auto& p : written) std::cout << p << "\n";
}

}  // namespace

void add_viz_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("viz",
                                 "Attention maps as PNG: DIR/head_<b>_<h>.png, DIR/heads.png (grid with colour "
                                 "bar), DIR/query_<i>.png (the keys one query attends to); with --pattern also "
                                 "DIR/pattern.png (pattern_h<h>.png per head) or, for TopK/BlockTopK, "
                                 "DIR/selected_<b>_<h>.png and DIR/selected.png");
  auto a = std::make_shared<VizArgs>();
  cmd->add_option("--q", a->q, "queries .npy [B, Hq, Lq, D]")->check(CLI::ExistingFile);
  cmd->add_option("--k", a->k, "keys .npy [B, Hkv, Lk, D]")->check(CLI::ExistingFile);
  cmd->add_flag("--example", a->example,
                "use generated inputs instead of --q/--k: 4 heads, L=48, D=32 with a diagonal, "
                "a 3-back, a sink and a random head");
  add_mask_options(cmd, a->masks, true);
  cmd->add_option("--pattern", a->pattern,
                  "sparse/adaptive pattern SPEC (docs/sparse.md syntax, e.g. \"SlidingWindow(4, 0)\", "
                  "\"TopK(8)\"): draw it and the maps computed under it");
  cmd->add_option("--mha", a->mha,
                  "a torch.nn.MultiheadAttention state_dict (.safetensors): draw its per-head "
                  "weights on --x [--key --value]")
      ->check(CLI::ExistingFile);
  cmd->add_option("--x", a->x, "with --mha: query input .npy [L, N, E] ([N, L, E] with --batch-first; or [L, E])")
      ->check(CLI::ExistingFile);
  cmd->add_option("--key", a->key, "with --mha: key input .npy (default --x)")->check(CLI::ExistingFile);
  cmd->add_option("--value", a->value, "with --mha: value input .npy (default --key)")->check(CLI::ExistingFile);
  cmd->add_option("--embed-dim", a->embed_dim, "with --mha: embed_dim E");
  cmd->add_option("--num-heads", a->num_heads, "with --mha: num_heads H");
  cmd->add_flag("--batch-first", a->batch_first, "with --mha: inputs are [N, L, E]");
  cmd->add_option("--image", a->img.image,
                  "a PNG/JPEG through the SR model: writes DIR/head_<h>.png, heads.png (one "
                  "window's attention), focus.png (a query pixel's attention over the picture), "
                  "routing.png (each block's routed windows), routing.json")
      ->check(CLI::ExistingFile);
  cmd->add_option("--sr-scale", a->img.sr_scale,
                  "with --image: the model's scale, 2 or 4 (must match the weights; "
                  "default: that of --weights, else 2)");
  cmd->add_option("--weights", a->img.weights,
                  "with --image: SR weights .safetensors (default: embedded / "
                  "sr/weights/)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--attention", a->img.attention,
                  "with --image: sparse (the router decides) or dense (every "
                  "window)")
      ->check(CLI::IsMember({"sparse", "dense"}))
      ->capture_default_str();
  cmd->add_option("--block", a->img.block,
                  "with --image: the block G.B whose window is drawn (default: the first "
                  "block with the widest windows)");
  cmd->add_option("--window", a->img.window, "with --image: window index of that block (partition order)");
  cmd->add_option("--at", a->img.at,
                  "with --image: X,Y, an LR pixel: the query, and the window that holds it "
                  "(default: the image centre)")
      ->delimiter(',')
      ->expected(2);
  cmd->add_option("--crop", a->img.crop, "with --image: X,Y,W,H, run on this part of the image")
      ->delimiter(',')
      ->expected(4);
  cmd->add_option("--max-pixels", a->img.max_pixels, "with --image: refuse larger images (after --crop)")
      ->capture_default_str();
  cmd->add_option("--query", a->queries, "query index for a focus view (repeatable; default Lq/2)");
  cmd->add_option("--cmap", a->cmap, "colour map")->check(CLI::IsMember({"viridis", "magma", "gray"}));
  cmd->add_option("--columns", a->columns, "panels per row in heads.png (default min(Hq, 4))")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--side", a->side, "size of a map in pixels (default 384, 160 in the grid)")
      ->check(CLI::Range(16, 4096));
  cmd->add_option("--vmax", a->vmax, "top of the colour scale (default: the largest weight)")
      ->each([a](const std::string&) { a->has_vmax = true; });
  cmd->add_option("--out", a->out, "output directory (created)")->required();
  cmd->callback([a] { run_viz(*a); });
}

}  // namespace sattn::cli
