// The tile operations compiled for AVX2 + FMA (used only when the CPU has both; see tiles.cpp).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#pragma GCC optimize("fp-contract=fast")
#define SATTN_TILES_NS avx2
#include "sparse/tiles_impl.inc"
