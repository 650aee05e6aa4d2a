// The tile operations for the baseline instruction set (any x86-64 / other CPUs; see tiles.cpp).
#pragma GCC optimize("fp-contract=fast")
#pragma GCC diagnostic ignored "-Wpsabi"
#define SATTN_TILES_NS base
#include "sparse/tiles_impl.inc"
