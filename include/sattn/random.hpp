// Counter-based randomness for dropout: Philox4x32-10 (Salmon et al., SC'11).
// keep(b, h, i, j) depends only on (seed, b, h, i, j), never on tiling or thread count, so every
// kernel (reference, fused, sparse) drops exactly the same weights.
#pragma once

#include <array>
#include <cstdint>

namespace sattn {

inline std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(kM0) * ctr[0];
    const uint64_t p1 = uint64_t(kM1) * ctr[2];
    ctr = {uint32_t(p1 >> 32) ^ ctr[1] ^ key[0], uint32_t(p1), uint32_t(p0 >> 32) ^ ctr[3] ^ key[1], uint32_t(p0)};
    key[0] += kW0;
    key[1] += kW1;
  }
  return ctr;
}

// Uniform in [0, 1) with 24 bits, from the first Philox word of counter (b, h, i, j).
inline float dropout_uniform(uint64_t seed, uint32_t b, uint32_t h, uint32_t i, uint32_t j) {
  const auto r = philox4x32_10({j, i, h, b}, {uint32_t(seed), uint32_t(seed >> 32)});
  return float(r[0] >> 8) * (1.0f / 16777216.0f);
}

// True when weight (b, h, i, j) is kept under dropout probability p.
inline bool dropout_keep(uint64_t seed, double p, uint32_t b, uint32_t h, uint32_t i, uint32_t j) {
  return double(dropout_uniform(seed, b, h, i, j)) >= p;
}

}  // namespace sattn
