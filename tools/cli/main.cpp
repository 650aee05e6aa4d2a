// The `sattn` command. Subcommands are added in tools/cli/*.cpp.
#include <CLI/CLI.hpp>
#include <iostream>

#include "sattn/attention.hpp"

int main(int argc, char** argv) {
  CLI::App app{"sattn: self-attention, exact and sparse"};
  app.require_subcommand(1);
  auto* version = app.add_subcommand("version", "Print the version and the registered kernels");
  version->callback([] {
    std::cout << "sattn 0.1.0\n";
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const sattn::Error& e) {
    std::cerr << "sattn: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
