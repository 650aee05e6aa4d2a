// Checks of the options that several subcommands share: thread counts and seeds.
#pragma once

#include <charconv>
#include <cstdint>
#include <string>

#include <CLI/CLI.hpp>

#include "sattn/error.hpp"

namespace sattn::cli {

// --threads: 0 (SATTN_NUM_THREADS, else every core) or 1 … kMaxThreads.
inline constexpr int kMaxThreads = 1024;
inline CLI::Range thread_range() { return CLI::Range(0, kMaxThreads); }

// The same check for a count read from a list (bench --threads 1,2).
inline void check_thread_count(int64_t n) {
  check(n >= 0 && n <= kMaxThreads, ErrorKind::kInvalidArgument, "--threads: expected 0 (default) or 1 .. ",
        kMaxThreads, ", got ", n);
}

// --seed: a decimal integer in 0 … 2^64 − 1 (CLI11's own conversion would read -1 as 2^64 − 1).
inline CLI::Validator seed_range() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        uint64_t value = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
        if (s.empty() || ec != std::errc() || end != s.data() + s.size())
          return "expected an integer in 0 .. 2^64-1, got '" + s + "'";
        return {};
      },
      "UINT64");
}

}  // namespace sattn::cli
