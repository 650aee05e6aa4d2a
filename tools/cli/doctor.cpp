// `sattn doctor`: health diagnostics of one attention call (see include/sattn/diagnose.hpp).
// Exit 0 when healthy, 1 when there are findings, 2 on bad usage or input.
#include <cstdlib>
#include <iostream>
#include <optional>

#include "cli/commands.hpp"
#include "cli/tool_inputs.hpp"
#include "io/writers.hpp"
#include "sattn/diagnose.hpp"
#include "sattn/error.hpp"
#include "sattn/io.hpp"
#include "sr/png_writer.hpp"
#include "viz/viz.hpp"

namespace sattn::cli {
namespace {

struct DoctorArgs {
  std::string q, k, v, expect;
  MaskArgs masks;
  bool json = false;
  bool example = false;
  std::string plot;
};

void run_doctor(const DoctorArgs& a) {
  check(a.example || (!a.q.empty() && !a.k.empty() && !a.v.empty()), ErrorKind::kInvalidArgument,
        "--q, --k and --v: all three are required (or --example)");
  check(!a.example || (a.q.empty() && a.k.empty() && a.v.empty()), ErrorKind::kInvalidArgument,
        "--example: replaces --q/--k/--v, give one or the other");
  check(a.plot.empty() || (a.plot.size() > 4 && a.plot.ends_with(".png")), ErrorKind::kInvalidArgument,
        "--plot: expected a file name ending in .png, given '", a.plot, "'");
  std::optional<io::OutputFile> plot;  // opened before the work
  if (!a.plot.empty()) plot.emplace(a.plot, "--plot");
  Tensor q, k, v;
  if (a.example) {
    viz::ExampleInputs ex = viz::example_inputs(1, 4, 48, 32, 7);
    q = ex.q, k = ex.k, v = ex.v;
  } else {
    q = read_npy(a.q), k = read_npy(a.k), v = read_npy(a.v);
  }
  LoadedMasks m = load_masks(a.masks);
  DiagnoseOptions d;
  d.expect = parse_expectation(a.expect);
  const Diagnosis dg = diagnose(q, k, v, m.options, d);
  if (plot) {
    sr::write_png(*plot, render_diagnosis(dg, d));
    plot->commit();
  }
  if (a.json) std::cout << diagnosis_to_json(dg, 2) << "\n";
  else std::cout << diagnosis_to_text(dg);
  std::cout.flush();
  if (!dg.healthy()) throw CLI::RuntimeError(1);  // findings: exit 1 (documented); stdout is flushed above
}

}  // namespace

void add_doctor_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "doctor",
      "Health check of attention on given q/k/v: saturation, missing scaling, fully masked rows, NaN/Inf, "
      "causal and padding leaks, suspicious mask polarity, determinism. Exit 0 healthy, 1 findings, 2 bad usage");
  auto a = std::make_shared<DoctorArgs>();
  cmd->add_option("--q", a->q, "queries .npy [B, Hq, Lq, D]")->check(CLI::ExistingFile);
  cmd->add_option("--k", a->k, "keys .npy [B, Hkv, Lk, D]")->check(CLI::ExistingFile);
  cmd->add_option("--v", a->v, "values .npy [B, Hkv, Lk, Dv]")->check(CLI::ExistingFile);
  cmd->add_flag("--example", a->example, "use generated inputs instead of --q/--k/--v (as `sattn viz --example`)");
  add_mask_options(cmd, a->masks, true);
  cmd->add_option("--expect", a->expect,
                  "what the masks are meant to do. causal: flag weight on future keys (alignment from --causal, else "
                  "top-left). padding: flag weight on padded keys; --key-padding/--lengths then say WHERE the padding "
                  "is and are not applied (the check is whether --mask/--causal hide it); without them, trailing "
                  "all-zero k/v rows are taken as padding")
      ->check(CLI::IsMember({"causal", "padding", "none"}));
  cmd->add_option("--plot", a->plot, "also draw the findings and per-head statistics as a PNG (bar charts)");
  cmd->add_flag("--json", a->json, "print {\"findings\": [...], \"stats\": {...}} instead of text");
  cmd->callback([a] { run_doctor(*a); });
}

}  // namespace sattn::cli
