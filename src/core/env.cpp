#include "core/env.hpp"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "sattn/error.hpp"

namespace sattn::env {

const std::vector<Variable>& variables() {
  static const std::vector<Variable> table = {
      {"SATTN_NUM_THREADS", "threads per call when the call does not say (default: the online cores)"},
      {"SATTN_KERNEL", "the dense kernel to use when the call does not name one (auto, reference, fused)"},
      {"SATTN_STRICT", "1: an error instead of falling back to the reference kernel"},
      {"SATTN_SIMD", "the SIMD target of every component (avx512, avx2, sse4, portable; default: the widest)"},
      {"SATTN_FUSED_BR", "the fused kernel's query tile rows (a multiple of 16 in [16, 1024]; for measurements)"},
      {"SATTN_FUSED_BC", "the fused kernel's key tile columns (a multiple of 16 in [16, 1024]; for measurements)"},
      {"SATTN_FUSED_TILE_MIN_WORK",
       "the least D·Lk at which the fused kernel takes the bf16 products for bf16, float16 or (float32_precision bf16) "
       "float32 inputs (default 2048; float16 on AMX 4097 with D a multiple of 16; 0: always; for tests and "
       "measurements)"},
      {"SATTN_FUSED_BACKWARD",
       "the fused backward's schedule: one_pass or two_pass (default: one pass unless a mask "
       "gradient's dS would take over 256 MiB)"},
      {"SATTN_SPARSE_BACKWARD", "the sparse backward's form: one_pass or two_pass (default: chosen per pattern)"},
      {"SATTN_WORKSPACE_CACHE_MB", "MiB of freed large kernel scratch kept for reuse (default 1024; 0 disables)"},
      {"SATTN_SPARSE_CACHE_MB", "the older name of SATTN_WORKSPACE_CACHE_MB, read when that is not set"},
      {"SATTN_TEST_RING_FAULT", "RANK:STEP: that rank of a ring attention fails at that step (tests the error path)"},
      {"SATTN_SPARSE_ISA", "no longer read: SATTN_SIMD replaces it (setting it prints one line saying so)"},
  };
  return table;
}

namespace {

struct Values {
  std::mutex mu;
  std::vector<std::optional<std::string>> values;
  bool loaded = false;
};

Values& values() {
  static Values* v = new Values;  // never destroyed: read from static destructors of other files
  return *v;
}

size_t index_of(const char* name) {
  const auto& table = variables();
  for (size_t i = 0; i < table.size(); ++i)
    if (std::strcmp(table[i].name, name) == 0) return i;
  fail(ErrorKind::kInternal, "env: '", name, "' is not in the table of environment variables");
}

void load(Values& v) {
  const auto& table = variables();
  v.values.assign(table.size(), std::nullopt);
  for (size_t i = 0; i < table.size(); ++i)
    if (const char* s = std::getenv(table[i].name); s && *s) v.values[i] = std::string(s);
  v.loaded = true;
  if (v.values[index_of("SATTN_SPARSE_ISA")])
    std::fprintf(stderr,
                 "sattn: SATTN_SPARSE_ISA is no longer read; SATTN_SIMD=avx512|avx2|sse4|portable sets "
                 "the SIMD target of every component\n");
}

}  // namespace

std::optional<std::string> get(const char* name) {
  const size_t i = index_of(name);
  Values& v = values();
  std::lock_guard<std::mutex> lock(v.mu);
  if (!v.loaded) load(v);
  return v.values[i];
}

long long get_integer(const char* name, long long lo, long long hi, long long fallback) {
  const std::optional<std::string> s = get(name);
  if (!s) return fallback;
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(s->c_str(), &end, 10);
  check(errno == 0 && end && *end == '\0' && n >= lo && n <= hi, ErrorKind::kInvalidArgument, name,
        ": expected an integer in [", lo, ", ", hi, "], got '", *s, "'");
  return n;
}

bool get_flag(const char* name) {
  const std::optional<std::string> s = get(name);
  return s && *s != "0";
}

void reload() {
  Values& v = values();
  std::lock_guard<std::mutex> lock(v.mu);
  load(v);
}

}  // namespace sattn::env
