#include <iostream>

#include "cli/commands.hpp"
#include "sattn/attention.hpp"
#include "sattn/simd.hpp"

namespace sattn::cli {
void add_version_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("version", "Print the version, the registered kernels and the SIMD targets");
  cmd->callback([] {
    std::cout << "sattn " << SATTN_VERSION << "\nkernels:";
    for (const auto& n : kernel_names()) std::cout << " " << n;
    const SimdTargets t = simd_targets();
    std::cout << "\nsimd: " << t.selected << " (this CPU runs:";
    for (const auto& n : t.available) std::cout << " " << n;
    std::cout << "; SATTN_SIMD=<target> selects one)\n";
  });
}
}  // namespace sattn::cli
