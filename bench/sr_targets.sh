#!/bin/sh
# The SR speed-target tables (docs/PERFORMANCE.md) on THIS machine (run it idle): C++ `sattn sr upscale` vs the same
# weights in PyTorch (sr/train/model.py), 1 and 2 threads, dense and sparse, medians of 5 (C++: 5 rounds, modes
# alternating; the sparse/dense target on the median of the paired per-round ratios), 256x256 crop of Set14 baboon, x2
# then x4 (the shipped weights of each scale), PASS/FAIL per target. Pauses any running SR training (SIGSTOP, SIGCONT
# afterwards). ~4-7 minutes. Five paired rounds, not three: one slow phase of this VM (seconds long) can make a single
# round's ratio meaningless (0.92x in one measured round), and the median of five tolerates two such rounds.
#   bench/sr_targets.sh [extra sr_latency.py options for both runs, e.g. --repeat 7]
set -e
cd "$(dirname "$0")/.."
[ -f build/CMakeCache.txt ] || cmake --preset release
cmake --build build -j2 --target sattn_cli
for s in 2 4; do
  # shellcheck disable=SC2046
  build/venv/bin/python bench/sr_latency.py --weights sr/weights/sattn_sr_x$s.safetensors --threads 1 2 --repeat 5 --rounds 5 \
    --pause $(pgrep -f sr/train/train.py || true) "$@"
done
