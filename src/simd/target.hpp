// The SIMD targets of the library, in one table: every SIMD component (the fused kernel, the sparse tiles, the
// TopK scan, the nn/SR kernels) is compiled for some of them and runs the widest of its builds that is no wider
// than the one selected for the process. The selection is made once, on first use: SATTN_SIMD=<name>, else the
// widest target this CPU runs; sattn::set_simd_target changes it (for tests and measurements).
#pragma once

#include <string>
#include <vector>

namespace sattn::simd {

// Widest first; each target's instructions include those of the targets after it. avx512bf16 is AVX-512 with the
// AVX512-BF16 dot products (vdpbf16ps); amx adds the AMX-BF16 tile products (tdpbf16ps). The fused kernel, the
// sparse tiles and the nn GEMMs have builds for these two (their bf16 products); the TopK scan runs its avx512 build
// under them.
enum class Target : int { kAmx = 0, kAvx512Bf16 = 1, kAvx512 = 2, kAvx2 = 3, kSse4 = 4, kPortable = 5 };
inline constexpr int kNumTargets = 6;

// "amx", "avx512bf16", "avx512", "avx2", "sse4", "portable".
const char* name(Target t);

// Whether this CPU runs code built for `t` (portable: always). For amx that includes the Linux permission to use
// the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM), requested once per process on the first call.
bool cpu_runs(Target t);

// Why the amx target does not run here ("" when it does): the missing CPU features, or the refused tile permission.
std::string amx_unavailable_reason();

// Whether streams of rows read once (the keys and values of a decode) are best left to the CPU's own prefetchers:
// true on AMD CPUs with AVX-512 (Zen 4 and later), where the decode's software prefetches made one thread stream
// K and V 1.25-1.4x slower (docs/PERFORMANCE.md, Decode); false elsewhere (the AMX Xeon read 1.3x faster with them).
bool hardware_prefetch_suffices();

// The target named `name`: one of the names above, "auto" (the widest this CPU runs), or an older name
// ("avx2+fma", "base", "scalar", "emu128"). Throws sattn::Error: InvalidArgument for an unknown name, Unsupported
// when this CPU cannot run it. `what` names the source of the name in the message ("SATTN_SIMD", ...).
Target parse(const std::string& name, const char* what);

// The target selected for the process (first use: SATTN_SIMD, else the widest this CPU runs). An invalid
// SATTN_SIMD is an error on every call that needs a target.
Target selected();

// Selects `t` for calls that start after this returns (a call already running may use either).
void select(Target t);

// The targets this CPU runs, widest first.
std::vector<Target> available();

// The SIMD components outside the fused kernel, each in its own library (sattn::sparse, sattn::nn). A component
// registers the function that names the build it runs (during static initialisation of the file that holds its
// kernels), and simd_targets() reports it; a component that is not linked into the program reports "".
enum class Component : int { kSparseTiles = 0, kTopK = 1, kNn = 2 };
inline constexpr int kNumComponents = 3;
bool register_build(Component c, const char* (*build)());

}  // namespace sattn::simd
