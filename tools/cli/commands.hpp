// Each subcommand of `sattn` lives in its own file and adds itself to the app here.
// Conventions: every subcommand has --help; user errors throw sattn::Error (main prints it, exit 2);
// progress goes to stderr only when it is a terminal.
#pragma once
#include <CLI/CLI.hpp>

namespace sattn::cli {
void add_version_command(CLI::App& app);  // version.cpp
void add_demo_command(CLI::App& app);     // demo.cpp
void add_attn_command(CLI::App& app);     // attn.cpp
void add_viz_command(CLI::App& app);      // viz.cpp
void add_doctor_command(CLI::App& app);   // doctor.cpp
void add_profile_command(CLI::App& app);  // profile.cpp
void add_report_command(CLI::App& app);   // report.cpp
void add_bench_command(CLI::App& app);    // bench.cpp
void add_sparse_command(CLI::App& app);   // sparse.cpp: sparse, sparse-bench
void add_sr_command(CLI::App& app);       // sr.cpp
void add_ring_command(CLI::App& app);     // ring.cpp: ring attention over MPI (built with MPI)
}  // namespace sattn::cli
