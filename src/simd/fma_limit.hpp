// The machine's float32 FMA limit, measured: the ceiling that `sattn bench` and bench/compare.py divide GFLOP/s by.
#pragma once

namespace sattn::simd {

struct FmaLimit {
  double gflops = 0;       // all threads together
  const char* build = "";  // the build that ran (simd::name of its target)
  // The rate of AVX512-BF16 dot products (vdpbf16ps, 4 flops per float32 lane), all threads together, measured
  // where the selected target is amx or avx512bf16; 0 elsewhere. The ceiling of the avx512bf16 build's bf16
  // products: twice the FMA limit on a CPU that issues vdpbf16ps as often as FMAs, half of it on the AMX Xeon of
  // docs/PERFORMANCE.md.
  double bf16_dot_gflops = 0;
};

// Runs 12 independent chains of vector fused multiply-adds (the selected target's widest float vectors) on
// `threads` threads at once, each for about `seconds` after a short warm-up, and returns all threads' flops (2 per
// lane per FMA) over the span from the first thread's start to the last one's end. No float32 kernel of that build
// can run faster (OpenBLAS SGEMM reached 0.82-0.89 of it on a Zen 2). The portable build has no such limit (its vectors
// are emulated in loops that the compiler vectorises): gflops 0 there. Then, under amx and avx512bf16, 16 chains of
// vdpbf16ps the same way (bf16_dot_gflops). Throws sattn::Error (InvalidArgument) for
// threads < 1 or seconds outside (0, 60].
FmaLimit fma_limit(int threads, double seconds = 0.2);

}  // namespace sattn::simd
