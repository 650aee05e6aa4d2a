#!/usr/bin/env bash
# ctest InstallAndFindPackage: install the build tree into a temporary prefix, then
#   - every installed header compiles alone (its own translation unit) and none declares a `detail` namespace;
#   - a downstream project (this directory) finds every component, builds one consumer per component, each linking
#     only sattn::<component>, and one on the umbrella sattn::sattn, and runs them;
#   - find_package(sattn COMPONENTS core) alone works, and an unknown component fails with a message naming it.
set -euo pipefail
build_dir=$1; src_dir=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$build_dir/CMakeCache.txt")

headers=$(cd "$prefix/include" && find sattn -type f | sort)
echo "installed headers: $(echo $headers)"
if grep -rnE 'namespace[[:space:]]+([a-z_:]*::)?detail\b|\bdetail::' "$prefix/include"; then
  echo "FAIL: an installed header has detail:: internals"; exit 1
fi
for h in $headers; do
  echo "#include <$h>" > "$tmp/alone.cpp"
  "${cxx:-c++}" -std=c++20 -fsyntax-only -Wall -Wextra -Werror -I "$prefix/include" "$tmp/alone.cpp" \
    || { echo "FAIL: $h does not compile alone"; exit 1; }
done
echo "every installed header compiles alone"

configure() {  # configure <build dir> [cmake arguments...]
  local dir=$1; shift
  cmake -S "$src_dir" -B "$dir" -Dsattn_DIR="$prefix/lib/cmake/sattn" -DCMAKE_BUILD_TYPE=Release "$@"
}
configure "$tmp/build" >/dev/null
cmake --build "$tmp/build" -j2 >/dev/null
for c in core sparse nn sr viz all; do "$tmp/build/sattn_$c"; done

configure "$tmp/build-core" -DSATTN_COMPONENTS=core >/dev/null
cmake --build "$tmp/build-core" >/dev/null
"$tmp/build-core/sattn_core"
[ ! -e "$tmp/build-core/sattn_all" ] || { echo "FAIL: sattn::sattn defined for COMPONENTS core"; exit 1; }

if configure "$tmp/build-bad" -DSATTN_COMPONENTS="core;bogus" >"$tmp/bad.log" 2>&1; then
  echo "FAIL: find_package(sattn COMPONENTS bogus) succeeded"; exit 1
fi
grep -q "sattn has no component 'bogus'" "$tmp/bad.log" || { cat "$tmp/bad.log"; echo "FAIL: no message"; exit 1; }
echo "find_package(sattn COMPONENTS bogus) fails: $(grep -o "sattn has no component 'bogus'[^;]*" "$tmp/bad.log" | head -1)"
