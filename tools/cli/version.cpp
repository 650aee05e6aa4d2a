#include <iostream>

#include "cli/commands.hpp"
#include "sattn/attention.hpp"

namespace sattn::cli {
void add_version_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("version", "Print the version and the registered kernels");
  cmd->callback([] {
    std::cout << "sattn " << SATTN_VERSION << "\nkernels:";
    for (const auto& n : kernel_names()) std::cout << " " << n;
    std::cout << "\n";
  });
}
}  // namespace sattn::cli
