// The Highway targets every SIMD component is compiled for: AVX-512 (AVX3), AVX2+FMA, SSE4 and the portable
// EMU128 (the names of simd/target.hpp). Include first, before <hwy/foreach_target.h>. AVX3_DL would add nothing
// these kernels use; SSSE3 is below the oldest target worth a build.
#ifndef HWY_DISABLED_TARGETS
#define HWY_DISABLED_TARGETS (HWY_SSSE3 | HWY_AVX3_DL)
#endif
