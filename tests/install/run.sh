#!/usr/bin/env bash
# ctest: install the build tree into a temporary prefix, then configure, build and run a find_package(sattn) consumer.
set -euo pipefail
build_dir=$1; src_dir=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cmake --install "$build_dir" --prefix "$tmp/prefix" >/dev/null
cmake -S "$src_dir" -B "$tmp/build" -Dsattn_DIR="$tmp/prefix/lib/cmake/sattn" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$tmp/build" >/dev/null
"$tmp/build/consumer"
