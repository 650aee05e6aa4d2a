#include "simd/target.hpp"

#include <atomic>
#include <cerrno>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

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
  bool amx;            // and the AMX-BF16 tiles, with the kernel's permission
};

constexpr Info kTable[kNumTargets] = {
    {Target::kAmx, "amx", HWY_AVX3, true, true},         {Target::kAvx512Bf16, "avx512bf16", HWY_AVX3, true, false},
    {Target::kAvx512, "avx512", HWY_AVX3, false, false}, {Target::kAvx2, "avx2", HWY_AVX2, false, false},
    {Target::kSse4, "sse4", HWY_SSE4, false, false},     {Target::kPortable, "portable", 0, false, false},
};

bool cpu_has_bf16_dot() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (EDX bit 24).
bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  return (d >> 22 & 1u) != 0 && (d >> 24 & 1u) != 0;
#else
  return false;
#endif
}

// "" once Linux lets this process use the tile data state (XFEATURE_XTILEDATA = 18, ARCH_REQ_XCOMP_PERM = 0x1023;
// without the permission the first tile load raises SIGILL), else why not. Asked once; the answer is kept.
std::string request_tile_permission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) return "";
  return std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") + std::strerror(errno) + ")";
#else
  return "AMX tiles are used only on x86-64 Linux";
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

bool hardware_prefetch_suffices() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool amd_avx512 = __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f");
  return amd_avx512;
#else
  return false;
#endif
}

std::string amx_unavailable_reason() {
  if (!cpu_has_amx_bf16() || !cpu_has_bf16_dot() || (hwy::SupportedTargets() & HWY_AVX3) == 0)
    return "this CPU lacks AMX-BF16 (with AVX-512 and AVX512-BF16)";
  static const std::string refused = request_tile_permission();
  return refused;
}

bool cpu_runs(Target t) {
  const Info& i = kTable[int(t)];
  if (i.bf16_dot && !cpu_has_bf16_dot()) return false;
  if (i.amx && !amx_unavailable_reason().empty()) return false;
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
  fail(ErrorKind::kInvalidArgument, what,
       ": expected one of auto, amx, avx512bf16, avx512, avx2, sse4, portable; got '", s, "'");
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
