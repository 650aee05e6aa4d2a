// The `sattn` command: parses the subcommand and maps errors to exit codes
// (0 ok, 1 a finding/failed check where a subcommand says so, 2 bad usage or input).
#include <exception>
#include <iostream>

#include "cli/commands.hpp"
#include "sattn/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"sattn: self-attention, exact and sparse — reference, fused and sparse kernels, tools"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show the help of every subcommand");
  sattn::cli::add_demo_command(app);
  sattn::cli::add_attn_command(app);
  sattn::cli::add_bench_command(app);
  sattn::cli::add_sparse_command(app);
  sattn::cli::add_sr_command(app);
  sattn::cli::add_version_command(app);
  sattn::cli::add_viz_command(app);
  sattn::cli::add_doctor_command(app);
  sattn::cli::add_profile_command(app);
  sattn::cli::add_report_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {  // a subcommand's own exit code (e.g. demo: 1 = check failed)
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  } catch (const sattn::Error& e) {
    std::cerr << "sattn: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "sattn: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
