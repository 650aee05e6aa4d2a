// simd_targets() and set_simd_target() (sattn/simd.hpp): the one target table and each component's build.
#include "sattn/simd.hpp"

#include "kernels/fused/fused.hpp"
#include "nn/ops.hpp"
#include "sattn/sparse_tiles.hpp"
#include "simd/target.hpp"
#include "sparse/topk_scan.hpp"

namespace sattn {

SimdTargets simd_targets() {
  SimdTargets t;
  t.selected = simd::name(simd::selected());
  for (simd::Target a : simd::available()) t.available.emplace_back(simd::name(a));
  t.fused = fused::simd_build();
  t.sparse_tiles = sparse::tiles::simd_build();
  t.topk = sparse::topk::simd_build();
  t.nn = nn::simd_build();
  return t;
}

void set_simd_target(const std::string& name) { simd::select(simd::parse(name, "set_simd_target")); }

}  // namespace sattn
