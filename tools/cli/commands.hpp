// Each subcommand of `sattn` lives in its own file and adds itself to the app here.
// Conventions: every subcommand has --help; user errors throw sattn::Error (main prints it, exit 2);
// progress goes to stderr only when it is a terminal.
#pragma once
#include <CLI/CLI.hpp>

namespace sattn::cli {
void add_version_command(CLI::App& app);  // version.cpp
void add_demo_command(CLI::App& app);     // demo.cpp
void add_attn_command(CLI::App& app);     // attn.cpp
void add_sr_command(CLI::App& app);       // sr.cpp
}  // namespace sattn::cli
