// The `sattn` command: parses the subcommand and maps errors to exit codes
// (0 ok, 1 a finding/failed check where a subcommand says so, 2 bad usage or input).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>

#include "cli/bench_timing.hpp"
#include "cli/commands.hpp"
#include "sattn/error.hpp"

namespace {
// OpenBLAS picks its kernels from the CPU model in cpuid; on a VM that hides the model (this one reports a
// generic "Intel(R) Xeon(R) Processor") it falls back to its Prescott (SSE3) kernels: SGEMM at ~30 GFLOP/s instead
// of ~150 on this AVX-512 machine, which would make every "% of SGEMM" of the benchmarks 3-5x too flattering.
// The benchmark commands (bench, sparse-bench; the only ones that open the BLAS) then re-execute themselves once with
// OPENBLAS_CORETYPE chosen from the CPU's features (OpenBLAS reads it as it loads). An OPENBLAS_CORETYPE already set
// is always respected.
void fix_openblas_core(int argc, char** argv) {
  if (argc < 2 || std::getenv("OPENBLAS_CORETYPE")) return;
  const std::string cmd = argv[1];
  if (cmd != "bench" && cmd != "sparse-bench") return;
  std::string core = sattn::cli::blas_core();
  if (core.empty()) return;
  std::transform(core.begin(), core.end(), core.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  const bool pre_avx2 = core == "prescott" || core == "core2" || core == "penryn" || core == "dunnington" ||
                        core == "nehalem" || core == "atom" || core == "katmai" || core == "northwood" ||
                        core == "banias" || core == "sandybridge" || core == "unknown";
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (!pre_avx2 || !(avx512 || avx2)) return;
  setenv("OPENBLAS_CORETYPE", avx512 ? "SkylakeX" : "Haswell", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: go on with the detected kernels
  unsetenv("OPENBLAS_CORETYPE");
}

// What was printed must reach standard output: a full disk there is an error, not exit 0.
int flush_stdout(int code) {
  std::cout.flush();
  if (std::fflush(stdout) == 0 && !std::ferror(stdout)) return code;
  std::cerr << "sattn: error: cannot write standard output: " << std::strerror(errno) << "\n";
  return code == 0 ? 2 : code;
}

// The subcommands given, e.g. "sr upscale" (empty before the first one is parsed).
std::string command_path(const CLI::App& app) {
  std::string path;
  for (const CLI::App* a = &app; !a->get_subcommands().empty();) {
    a = a->get_subcommands().front();
    path += (path.empty() ? "" : " ") + a->get_name();
  }
  return path;
}

// "sattn: error: MESSAGE" on one line of stderr (a message's own line breaks become "; ").
int error_line(const std::string& where, std::string message) {
  for (size_t p = 0; (p = message.find('\n', p)) != std::string::npos;)
    message.replace(p, 1, p + 1 < message.size() ? "; " : "");
  std::cerr << "sattn: error: " << (where.empty() ? "" : where + ": ") << message << "\n";
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  fix_openblas_core(argc, argv);
  CLI::App app{"sattn: self-attention, exact and sparse — reference, fused and sparse kernels, tools"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "Show the help of every subcommand");
  sattn::cli::add_demo_command(app);
  sattn::cli::add_attn_command(app);
  sattn::cli::add_bench_command(app);
  sattn::cli::add_sparse_command(app);
  sattn::cli::add_sr_command(app);
  sattn::cli::add_ring_command(app);
  sattn::cli::add_version_command(app);
  sattn::cli::add_viz_command(app);
  sattn::cli::add_doctor_command(app);
  sattn::cli::add_profile_command(app);
  sattn::cli::add_report_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {  // a subcommand's own exit code (e.g. demo: 1 = check failed)
    return flush_stdout(e.get_exit_code());
  } catch (const CLI::Success& e) {  // --help, --help-all
    return flush_stdout(app.exit(e));
  } catch (const CLI::ParseError& e) {  // names the option: "--threads: Value -3 not in range 0 to 1024"
    if (app.get_subcommands().empty() && argc > 1 && argv[1][0] != '-') {
      std::string names;
      for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; }))
        names += (names.empty() ? "" : ", ") + sub->get_name();
      return error_line("", std::string("unknown subcommand '") + argv[1] + "' (expected one of " + names + ")");
    }
    return error_line("", e.what());
  } catch (const sattn::Error& e) {
    return error_line("", e.what());
  } catch (const std::bad_alloc&) {
    return error_line(command_path(app),
                      "out of memory (std::bad_alloc): the sizes its arguments ask for do not "
                      "fit in this machine's memory");
  } catch (const std::length_error& e) {
    return error_line(command_path(app), std::string("the sizes its arguments ask for exceed what a buffer can "
                                                     "hold (std::length_error: ") +
                                             e.what() + ")");
  } catch (const std::exception& e) {
    return error_line(command_path(app), e.what());
  }
  return flush_stdout(0);
}
