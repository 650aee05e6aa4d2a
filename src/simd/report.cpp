// simd_targets() and set_simd_target() (sattn/simd.hpp): the one target table and each component's build.
#include "sattn/simd.hpp"

#include <array>

#include "kernels/fused/fused.hpp"
#include "simd/target.hpp"

namespace sattn {
namespace simd {
namespace {
using BuildName = const char* (*)();
std::array<BuildName, kNumComponents>& registry() {
  static std::array<BuildName, kNumComponents> builds{};
  return builds;
}
std::string build_of(Component c) {
  const BuildName f = registry()[size_t(c)];
  return f != nullptr ? f() : "";
}
}  // namespace

bool register_build(Component c, const char* (*build)()) {
  registry()[size_t(c)] = build;
  return true;
}
}  // namespace simd

SimdTargets simd_targets() {
  SimdTargets t;
  t.selected = simd::name(simd::selected());
  for (simd::Target a : simd::available()) t.available.emplace_back(simd::name(a));
  t.fused = fused::simd_build();
  t.sparse_tiles = simd::build_of(simd::Component::kSparseTiles);
  t.topk = simd::build_of(simd::Component::kTopK);
  t.nn = simd::build_of(simd::Component::kNn);
  return t;
}

void set_simd_target(const std::string& name) { simd::select(simd::parse(name, "set_simd_target")); }

}  // namespace sattn
