#include "simd/target.hpp"

#include <atomic>

#include <hwy/targets.h>

#include "core/env.hpp"
#include "sattn/error.hpp"

namespace sattn::simd {

namespace {

struct Info {
  Target target;
  const char* name;
  int64_t hwy_target;  // the Highway target whose CPU features it needs (0: none)
  bool bf16_dot;       // and the AVX512-BF16 dot products
};

constexpr Info kTable[kNumTargets] = {
    {Target::kAvx512Bf16, "avx512bf16", HWY_AVX3, true},
    {Target::kAvx512, "avx512", HWY_AVX3, false},
    {Target::kAvx2, "avx2", HWY_AVX2, false},
    {Target::kSse4, "sse4", HWY_SSE4, false},
    {Target::kPortable, "portable", 0, false},
};

bool cpu_has_bf16_dot() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

constexpr int kUnset = -1;
std::atomic<int> g_selected{kUnset};

Target widest_available() {
  for (const Info& i : kTable)
    if (cpu_runs(i.target)) return i.target;
  return Target::kPortable;
}

}  // namespace

const char* name(Target t) { return kTable[int(t)].name; }

bool cpu_runs(Target t) {
  const Info& i = kTable[int(t)];
  if (i.bf16_dot && !cpu_has_bf16_dot()) return false;
  return i.hwy_target == 0 || (hwy::SupportedTargets() & i.hwy_target) != 0;
}

Target parse(const std::string& s, const char* what) {
  if (s == "auto") return widest_available();
  const char* alias = s == "avx2+fma" ? "avx2" : s == "base" || s == "scalar" || s == "emu128" ? "portable" : nullptr;
  for (const Info& i : kTable) {
    if (s != i.name && !(alias && std::string(alias) == i.name)) continue;
    check(
        cpu_runs(i.target), ErrorKind::kUnsupported, what, ": this CPU does not run '", s, "' (it runs ",
        [] {
          std::string all;
          for (Target t : available()) all += std::string(all.empty() ? "" : ", ") + name(t);
          return all;
        },
        ")");
    return i.target;
  }
  fail(ErrorKind::kInvalidArgument, what, ": expected one of auto, avx512bf16, avx512, avx2, sse4, portable; got '", s,
       "'");
}

Target selected() {
  const int t = g_selected.load(std::memory_order_relaxed);
  if (t != kUnset) return Target(t);
  const std::optional<std::string> env = env::get("SATTN_SIMD");
  const Target chosen = env ? parse(*env, "SATTN_SIMD") : widest_available();
  int expected = kUnset;
  g_selected.compare_exchange_strong(expected, int(chosen));
  return Target(g_selected.load());
}

void select(Target t) { g_selected.store(int(t)); }

std::vector<Target> available() {
  std::vector<Target> v;
  for (const Info& i : kTable)
    if (cpu_runs(i.target)) v.push_back(i.target);
  return v;
}

}  // namespace sattn::simd
