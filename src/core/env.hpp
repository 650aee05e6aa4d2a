// The process environment, read in one place. Every SATTN_* variable the library reads is in the table of
// env.cpp (documented in docs/environment.md); each is read once, on first use, and kept for the process.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace sattn::env {

struct Variable {
  const char* name;     // e.g. "SATTN_SIMD"
  const char* meaning;  // one line, as in docs/environment.md
};

// The variables the library reads, in the order of docs/environment.md.
const std::vector<Variable>& variables();

// The value of `name` (which must be in variables()) as it was on first use; empty or unset gives nullopt.
std::optional<std::string> get(const char* name);

// An integer value in [lo, hi], or `fallback` when unset; anything else is an InvalidArgument error naming the
// variable, the range and the value.
long long get_integer(const char* name, long long lo, long long hi, long long fallback);

// Whether a flag variable is set to anything but "0".
bool get_flag(const char* name);

// Re-reads the environment: for tests of the variables themselves (the library never calls it).
void reload();

}  // namespace sattn::env
