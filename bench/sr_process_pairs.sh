#!/usr/bin/env bash
# Whole-process SR latency, dense against sparse: `sattn sr upscale --scale S` of the top-left CROP x CROP of an image,
# PAIRS pairs with the order alternating (dense first in odd pairs), wall time of each process (start-up, decoding,
# the model, encoding and the atomic write included). Prints every run, then the medians and the median of the
# per-pair dense/sparse ratios. Run it on an idle machine (pause a training run: kill -STOP).
#   bench/sr_process_pairs.sh WEIGHTS IMAGE [PAIRS=9] [CROP=256] [THREADS=2] [SCALE=2]
set -euo pipefail
cd "$(dirname "$0")/.."
if (($# < 2)); then sed -n '2,6p' "$0"; exit 2; fi
weights=$1 image=$2 pairs=${3:-9} crop=${4:-256} threads=${5:-2} scale=${6:-2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHONPATH=build/python build/venv/bin/python - "$image" "$crop" "$work/in.png" <<'EOF'
import sys
import numpy as np
import sattn.sr as S
im = S.read_image(sys.argv[1])
c = int(sys.argv[2])
if im.shape[0] < c or im.shape[1] < c:
    sys.exit("sr_process_pairs.sh: %s is %dx%d, smaller than the crop %d" % (sys.argv[1], im.shape[1], im.shape[0], c))
S.write_png(sys.argv[3], np.ascontiguousarray(im[:c, :c]))
EOF
for ((i = 1; i <= pairs; ++i)); do
  if ((i % 2)); then order=(dense sparse); else order=(sparse dense); fi
  for mode in "${order[@]}"; do
    t0=$(date +%s.%N)
    build/sattn sr upscale --scale "$scale" --weights "$weights" --attention "$mode" --threads "$threads" \
      "$work/in.png" "$work/out.png" > /dev/null
    t1=$(date +%s.%N)
    echo "$i $mode $(echo "$t1 - $t0" | bc)"
  done
done | tee "$work/times" >&2
python3 - "$work/times" <<'EOF'
import statistics as st
import sys
runs = {}
for line in open(sys.argv[1]):
    i, mode, t = line.split()
    runs.setdefault(int(i), {})[mode] = float(t)
d = [r["dense"] for r in runs.values()]
s = [r["sparse"] for r in runs.values()]
ratios = [r["dense"] / r["sparse"] for r in runs.values()]
print("dense median %.3f s, sparse median %.3f s, dense/sparse per pair: median %.2fx (%.2f-%.2f), %d pairs" % (
    st.median(d), st.median(s), st.median(ratios), min(ratios), max(ratios), len(ratios)))
EOF
