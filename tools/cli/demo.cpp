#include "cli/commands.hpp"

namespace sattn::cli {
void add_demo_command(CLI::App& app) { (void)app; }
}  // namespace sattn::cli
