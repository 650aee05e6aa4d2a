// `sattn report out.html`: one static HTML file — no server, no network; PNGs as data: URIs, SVG inline — with
// profile plots, attention maps and a doctor summary for the given q/k/v (or a generated example).
#include <iostream>
#include <sstream>

#include "cli/commands.hpp"
#include "cli/tool_inputs.hpp"
#include "cli/viz_image.hpp"
#include "io/writers.hpp"
#include "sattn/diagnose.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sattn/profile.hpp"
#include "viz/viz.hpp"

namespace sattn::cli {

ProfileOptions profile_options_with_progress(ProfileOptions o);  // profile.cpp

namespace {

struct ReportArgs {
  std::string out, q, k, v, expect;
  MaskArgs masks;
  ProfileOptions o;
  int64_t query = -1;
  bool no_profile = false;
  VizImageArgs image;  // --image: the SR model's routing and one window's attention
};

void run_report(ReportArgs a) {
  const bool have_inputs = !a.q.empty() || !a.k.empty() || !a.v.empty();
  check(!have_inputs || (!a.q.empty() && !a.k.empty() && !a.v.empty()), ErrorKind::kInvalidArgument,
        "--q/--k/--v: give all three, or none for a generated example");
  io::OutputFile out(a.out, "report");  // before the work: an unwritable path fails at once
  // Profile first: it forks, and libgomp must not have started its threads yet (see profile.hpp).
  std::vector<ProfilePoint> points;
  if (!a.no_profile) points = run_profile(profile_options_with_progress(a.o));

  Tensor q, k, v;
  LoadedMasks m;
  std::string source;
  if (have_inputs) {
    q = read_npy(a.q);
    k = read_npy(a.k);
    v = read_npy(a.v);
    m = load_masks(a.masks);
    source = "q = " + a.q + ", k = " + a.k + ", v = " + a.v;
  } else {
    viz::ExampleInputs ex = viz::example_inputs(1, 4, 48, 32, 7);
    q = ex.q, k = ex.k, v = ex.v;
    m = load_masks(a.masks);
    if (a.masks.causal.empty()) m.options.causal = Causal::kTopLeft;
    if (a.expect.empty()) a.expect = "causal";
    source = "generated example: B=1, 4 heads, L=48, D=32 (diagonal, 3-back, sink and random heads), causal mask";
  }
  VizImagePictures sr_pictures;
  if (!a.image.image.empty()) sr_pictures = render_viz_image(a.image);
  DiagnoseOptions dopt;
  dopt.expect = parse_expectation(a.expect);
  const Diagnosis dg = diagnose(q, k, v, m.options, dopt);
  const viz::AttentionMaps maps = viz::attention_maps(q, k, m.options);
  std::vector<std::string> titles;
  for (int64_t b = 0; b < maps.batch; ++b)
    for (int64_t h = 0; h < maps.heads; ++h) titles.push_back("b" + std::to_string(b) + " h" + std::to_string(h));
  viz::HeatmapStyle style;
  style.plot_side = 160;
  style.title = "attention weights (grey: masked)";
  const sr::Image grid = viz::render_heatmap_grid(maps.maps, titles, int(std::min<int64_t>(maps.heads, 4)), style);
  const int64_t qi = a.query >= 0 ? a.query : maps.len_q - 1;
  check(qi < maps.len_q, ErrorKind::kInvalidArgument, "--query: expected an index in [0, Lq = ", maps.len_q, "), got ",
        qi);
  viz::Matrix rows(maps.batch * maps.heads, maps.len_k);
  std::vector<std::string> labels;
  for (int64_t b = 0; b < maps.batch; ++b)
    for (int64_t h = 0; h < maps.heads; ++h) {
      for (int64_t j = 0; j < maps.len_k; ++j) rows.at(b * maps.heads + h, j) = maps.at(b, h).at(qi, j);
      labels.push_back("b" + std::to_string(b) + "h" + std::to_string(h));
    }
  viz::HeatmapStyle fstyle;
  fstyle.plot_side = 320;
  const sr::Image focus = viz::render_query_focus(rows, labels, "keys attended by query " + std::to_string(qi), fstyle);

  std::ostringstream h;
  h << "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>sattn report</title>\n"
    << "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
       "pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}table{border-collapse:collapse}"
       "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}.finding{border-left:4px solid #d55e00;"
       "padding:0.3em 1em;margin:0.6em 0;background:#fff6f0}.ok{border-left:4px solid #009e73;padding:0.3em 1em;"
       "background:#f0fff8}img{max-width:100%}</style></head><body>\n";
  h << "<h1>sattn report</h1>\n<p>Input: " << viz::html_escape(source)
    << "<br>Problem: " << viz::html_escape(dg.problem) << "</p>\n";
  h << "<h2>Doctor</h2>\n";
  if (dg.findings.empty()) h << "<div class=\"ok\">Healthy: no findings.</div>\n";
  for (const auto& f : dg.findings) {
    h << "<div class=\"finding\"><b>" << viz::html_escape(f.code) << "</b>";
    if (!f.heads.empty()) h << " (" << f.heads.size() << " heads)";
    h << "<br>" << viz::html_escape(f.message) << "</div>\n";
  }
  h << "<details><summary>per-head statistics</summary><pre>" << viz::html_escape(diagnosis_to_text(dg))
    << "</pre></details>\n";
  h << "<h2>Attention maps</h2>\n<img alt=\"attention weights per head\" src=\"" << viz::png_data_uri(grid) << "\">\n";
  h << "<h3>Query focus</h3>\n<img alt=\"keys attended by one query\" src=\"" << viz::png_data_uri(focus) << "\">\n";
  if (!sr_pictures.pictures.empty()) {
    h << "<h2>Super-resolution model: " << viz::html_escape(a.image.image) << "</h2>\n<p>"
      << viz::html_escape(sr_pictures.summary) << "</p>\n";
    for (const auto& [name, img] : sr_pictures.pictures)
      if (name == "routing.png" || name == "focus.png")
        h << "<img alt=\"" << (name == "routing.png" ? "routed windows per block" : "a query pixel's attention")
          << "\" src=\"" << viz::png_data_uri(img) << "\">\n";
  }
  h << "<h2>Profile</h2>\n";
  if (points.empty()) {
    h << "<p>(not run: --no-profile)</p>\n";
  } else {
    h << viz::render_plots_svg(profile_plot_specs(points));
    h << "<table><tr><th>kernel</th><th>L</th><th>heads</th><th>ms</th><th>peak MiB</th><th>analytic MiB</th></tr>\n";
    for (const auto& p : points) {
      h << "<tr><td>" << viz::html_escape(p.kernel) << "</td><td>" << p.length << "</td><td>" << p.heads << "</td>";
      if (p.error.empty()) h << "<td>" << p.ms << "</td><td>" << p.peak_mib << "</td>";
      else h << "<td colspan=\"2\">" << viz::html_escape(p.error) << "</td>";
      h << "<td>" << p.analytic_mib << "</td></tr>\n";
    }
    h << "</table>\n<p>Peak MiB: extra resident memory of one forward call, measured in a fresh child process "
         "(VmHWM after resetting it via /proc/self/clear_refs); analytic: B&middot;h&middot;L&sup2;&middot;4 bytes, "
         "one fp32 score matrix.</p>\n";
  }
  h << "</body></html>\n";
  out.write(h.str());
  out.commit();
  std::cout << a.out << "\n";
}

}  // namespace

void add_report_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("report",
                                 "One static HTML file (images embedded, no network) with profile plots, "
                                 "attention maps and a doctor summary; a generated example without inputs");
  auto a = std::make_shared<ReportArgs>();
  a->o.kernels = kernel_names();
  a->o.lengths = {128, 256, 512};
  a->o.heads = {4};
  cmd->add_option("out", a->out, "output .html file")->required();
  cmd->add_option("--q", a->q, "queries .npy [B, Hq, Lq, D]")->check(CLI::ExistingFile);
  cmd->add_option("--k", a->k, "keys .npy [B, Hkv, Lk, D]")->check(CLI::ExistingFile);
  cmd->add_option("--v", a->v, "values .npy [B, Hkv, Lk, Dv]")->check(CLI::ExistingFile);
  add_mask_options(cmd, a->masks, true);
  cmd->add_option("--expect", a->expect, "doctor: what the masks are meant to do (see `sattn doctor --help`)")
      ->check(CLI::IsMember({"causal", "padding", "none"}));
  cmd->add_option("--query", a->query, "query index for the focus view (default: the last)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--L", a->o.lengths, "profile: sequence lengths")->delimiter(',')->capture_default_str();
  cmd->add_option("--heads", a->o.heads, "profile: head counts")->delimiter(',')->capture_default_str();
  cmd->add_option("--kernels", a->o.kernels, "profile: kernels (default: every registered one)")->delimiter(',');
  cmd->add_option("--pattern", a->o.patterns,
                  "profile: also a sparse pattern SPEC or linear:elu (repeatable, see "
                  "`sattn profile --help`)");
  cmd->add_option("--image", a->image.image,
                  "also the SR model on this PNG/JPEG: its routing map and one window's "
                  "attention (as `sattn viz --image`)")
      ->check(CLI::ExistingFile);
  cmd->add_option("--crop", a->image.crop, "with --image: X,Y,W,H")->delimiter(',')->expected(4);
  cmd->add_option("--at", a->image.at, "with --image: X,Y, the query pixel")->delimiter(',')->expected(2);
  cmd->add_option("--repeats", a->o.repeats, "profile: timed runs per point")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_flag("--no-profile", a->no_profile, "skip the profile section");
  cmd->callback([a] { run_report(*a); });
}

}  // namespace sattn::cli
