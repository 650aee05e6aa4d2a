// `sattn profile`: forward time and peak memory against L and heads, per kernel, beside the analytic
// B·h·L²·4 bytes; a terminal table, CSV and plots (SVG or PNG by the file name). Method: include/sattn/profile.hpp.
#include <iostream>

#include "cli/commands.hpp"
#include "cli/options.hpp"
#include "cli/tool_inputs.hpp"
#include "io/writers.hpp"
#include "sattn/error.hpp"
#include "sattn/profile.hpp"
#include "sr/png_writer.hpp"
#include "viz/viz.hpp"

namespace sattn::cli {

// Writes the plots of `points` into `out`: PNG when its name ends in .png, else SVG text.
void write_profile_plot(io::OutputFile& out, const std::vector<ProfilePoint>& points) {
  const auto specs = profile_plot_specs(points);
  if (out.path().ends_with(".png")) sr::write_png(out, viz::render_plots_png(specs));
  else out.write(viz::render_plots_svg(specs));
}

ProfileOptions profile_options_with_progress(ProfileOptions o) {
  if (stderr_is_tty())
    o.progress = [](size_t i, size_t n, const std::string& what) {
      if (i < n) std::cerr << "\r\033[Kprofile [" << i + 1 << "/" << n << "] " << what << std::flush;
      else std::cerr << "\r\033[K" << std::flush;
    };
  return o;
}

namespace {

struct ProfileArgs {
  ProfileOptions o;
  std::string csv, plot;
};

void run_profile_command(const ProfileArgs& a) {
  if (!a.plot.empty()) {  // fail on a bad plot name before spending minutes measuring
    const bool ok = a.plot.size() > 4 && (a.plot.ends_with(".svg") || a.plot.ends_with(".png"));
    check(ok, ErrorKind::kInvalidArgument, "--plot: expected a file name ending in .svg or .png, got '", a.plot, "'");
  }
  io::OutputFiles outputs;  // and on an unwritable output
  io::OutputFile* csv = a.csv.empty() ? nullptr : &outputs.add(a.csv, "--csv");
  io::OutputFile* plot = a.plot.empty() ? nullptr : &outputs.add(a.plot, "--plot");
  const auto points = run_profile(profile_options_with_progress(a.o));
  std::cout << profile_to_table(points);
  if (!points.empty() && !points.front().memory_method.empty())
    std::cout << "peak MiB: extra resident memory of one forward call in a fresh child process ("
              << points.front().memory_method << "); analytic: B*h*L^2*4 bytes\n";
  if (csv) csv->write(profile_to_csv(points));
  if (plot) write_profile_plot(*plot, points);
  outputs.commit();
}

}  // namespace

void add_profile_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("profile",
                                 "Time and peak memory of attention kernels against L and heads, with the "
                                 "analytic B*h*L^2*4 bytes: table, CSV and plots (log axes)");
  auto a = std::make_shared<ProfileArgs>();
  a->o.kernels = kernel_names();
  cmd->add_option("--L", a->o.lengths, "sequence lengths, comma-separated")->delimiter(',')->capture_default_str();
  cmd->add_option("--heads", a->o.heads, "head counts, comma-separated")->delimiter(',')->capture_default_str();
  cmd->add_option("--kernels", a->o.kernels, "kernels to profile, comma-separated (default: every registered one)")
      ->delimiter(',');
  cmd->add_option("--pattern", a->o.patterns,
                  "also profile sparse attention with this pattern SPEC (docs/sparse.md "
                  "syntax, e.g. \"SlidingWindow(128, 128)\", \"BlockTopK(64, 8)\"), or "
                  "linear:elu / linear:favor+; repeatable, not comma-split");
  cmd->add_option("--B", a->o.batch, "batch size")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--D", a->o.head_dim, "head dimension")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--repeats", a->o.repeats, "timed runs per point (median reported)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--threads", a->o.num_threads, "threads (0: library default)")->check(thread_range());
  cmd->add_flag("--causal", a->o.causal, "profile with a causal (top-left) mask");
  cmd->add_option("--csv", a->csv, "write kernel,L,heads,ms,peak_mib,analytic_mib here");
  cmd->add_option("--plot", a->plot, "write time and memory plots here (.svg or .png)");
  cmd->callback([a] { run_profile_command(*a); });
}

}  // namespace sattn::cli
