#!/usr/bin/env bash
# Measures `sattn ring` for docs/distributed.md: one JSON object per run (sattn ring --json) into OUT/runs.jsonl.
#   bench/ring_scaling.sh [OUT] [ROUNDS] [PARTS]      PARTS: "small big" (default), or one of them
# 1. L = 16384, P = 1, 2, 4 (4 oversubscribed on this 2-core machine), contiguous/zigzag, full/causal, with the
#    backward; and the same commands at L = 1024 (the RSS baseline of the memory model).
# 2. L = 65536, causal: P = 1 zigzag, P = 2 zigzag, P = 2 contiguous, alternating, ROUNDS rounds (default 5);
#    and P = 4 zigzag once.
# One thread per rank. Run it on an idle machine: every rank is timed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/out/ring}
ROUNDS=${2:-5}
PARTS=${3:-small big}
mkdir -p "$OUT"
RUNS="$OUT/runs.jsonl"
: > "$RUNS"
MPIRUN=(mpirun --oversubscribe --allow-run-as-root)
run() {  # run NP ARGS...: one sattn ring run, its JSON on one line
  local np=$1
  shift
  "${MPIRUN[@]}" -np "$np" build/sattn ring --heads 8 --dim 64 --threads 1 --json "$@" | python3 -c \
    'import json, sys; print(json.dumps(json.load(sys.stdin)))' >> "$RUNS"
  tail -n 1 "$RUNS" | python3 -c 'import json, sys; j = json.load(sys.stdin); print("P=%d L=%d %s causal=%s fwd %.3f s bwd %s" % (
    j["ranks"], j["L"], j["layout"], j["causal"], j["forward_seconds"], j.get("backward_seconds", "-")))'
}
[[ " $PARTS " == *" small "* ]] && for L in 1024 16384; do
  for np in 1 2 4; do
    for layout in contiguous zigzag; do
      run "$np" --L "$L" --layout "$layout" --backward --reps 1
      run "$np" --L "$L" --layout "$layout" --causal --backward --reps 1
    done
  done
done
[[ " $PARTS " == *" big "* ]] || { echo "runs: $RUNS"; exit 0; }
for round in $(seq "$ROUNDS"); do
  echo "round $round of $ROUNDS (L = 65536, causal)"
  run 1 --L 65536 --causal --layout zigzag --reps 1
  run 2 --L 65536 --causal --layout zigzag --reps 1
  run 2 --L 65536 --causal --layout contiguous --reps 1
done
run 4 --L 65536 --causal --layout zigzag --reps 1
echo "runs: $RUNS"
