// sattn::sattn, the umbrella: every component, and simd_targets() names the build of each.
#include <sattn/simd.hpp>

#include <iostream>

int main() {
  const sattn::SimdTargets t = sattn::simd_targets();
  std::cout << "all: selected " << t.selected << ", fused " << t.fused << ", sparse tiles " << t.sparse_tiles
            << ", topk " << t.topk << ", nn " << t.nn << "\n";
  return !t.fused.empty() && !t.sparse_tiles.empty() && !t.topk.empty() && !t.nn.empty() ? 0 : 1;
}
