// Scoped settings for tests: an environment variable (re-read by the library's one reader, core/env.hpp) and the
// process's SIMD target (sattn::set_simd_target), each restored when the scope ends.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "sattn/simd.hpp"
#include "simd/target.hpp"

namespace sattn::testing {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
    env::reload();
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
    env::reload();
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

class ScopedSimdTarget {
 public:
  explicit ScopedSimdTarget(const std::string& name) : saved_(simd::selected()) { set_simd_target(name); }
  ~ScopedSimdTarget() { simd::select(saved_); }
  ScopedSimdTarget(const ScopedSimdTarget&) = delete;
  ScopedSimdTarget& operator=(const ScopedSimdTarget&) = delete;

 private:
  simd::Target saved_;
};

// The SIMD targets this CPU runs, widest first.
inline std::vector<std::string> simd_target_names() { return simd_targets().available; }

}  // namespace sattn::testing
