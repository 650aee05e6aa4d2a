#!/usr/bin/env bash
# Every measurement behind the sparse-attention targets (docs/PERFORMANCE.md), in one run (meant for an idle machine;
# about 6-8 minutes on the 2-core dev machine): sattn sparse-bench for 1 and 2 threads (1-D patterns and linear
# attention at L = 4096, 16384, 65536 with B=1 H=8 D=64; Neighborhood2D / WindowAttention2D on 64/128/256 grids with H=4
# D=32; the dense fused kernel; OpenBLAS SGEMM with the same thread count), then the PyTorch peers
# (bench/sparse_peers.py), then a summary of every target (bench/sparse_targets_summary.py).
#
# Usage (from the repository root, after `cmake --preset release && cmake --build build -j2`):
#   bench/sparse_targets.sh [OUT.md]          # default: sparse_targets_results.md
# Env: SATTN_BIN (default build/sattn), PYTHON (default build/venv/bin/python), QUICK=1 (small sizes: a smoke test).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-sparse_targets_results.md}
BIN=${SATTN_BIN:-build/sattn}
PY=${PYTHON:-build/venv/bin/python}
export PYTHONPATH=build/python${PYTHONPATH:+:$PYTHONPATH}
LOG=$(mktemp -d)
trap 'rm -rf "$LOG"' EXIT

if [[ "${QUICK:-0}" == 1 ]]; then
  LS="1024 2048"; LBIG=4096; GRIDS="32 64"; REPS=1; TORCH_L=1024
else
  LS="4096 16384"; LBIG=65536; GRIDS="64 128 256"; REPS=3; TORCH_L=4096
fi
PATTERNS_1D=("SlidingWindow(256, 256)" "Dilated(64, 4)" "BlockTopK(64, 16)" linear:elu linear:favor+)
PATTERNS_2D=()
for g in $GRIDS; do
  for k in 7 13; do PATTERNS_2D+=("Neighborhood2D($g, $g, $k)"); done
  for w in 8 16; do PATTERNS_2D+=("WindowAttention2D($g, $g, $w)"); done
done
FIRST_L=${LS%% *}

{
  echo "# sattn sparse-attention targets"
  echo
  echo "Run: \`bench/sparse_targets.sh\` on $(hostname) at $(date -u +'%Y-%m-%d %H:%M UTC'), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')."
  echo "Load before the run: \`$(uptime)\`."
  echo "CPU: $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p')."
  echo
} >"$OUT"

for T in 1 2; do
  export OPENBLAS_NUM_THREADS=$T
  # 1-D patterns and linear attention, forward + backward (median of REPS after a warm-up, the longest length too).
  "$BIN" sparse-bench --pattern "${PATTERNS_1D[@]}" --L $LS --threads $T --backward --reps $REPS | tee -a "$LOG/bench.txt"
  "$BIN" sparse-bench --pattern "${PATTERNS_1D[@]}" --L $LBIG --threads $T --backward --reps $REPS | tee -a "$LOG/bench.txt"
  # TopK(64) beside dense at the first length; the dense fused kernel (forward + backward at the first length,
  # forward only at the second: BlockTopK's dense peer at the longest length is extrapolated from it).
  "$BIN" sparse-bench --pattern "TopK(64)" --L $FIRST_L --threads $T --reps $REPS --dense --backward | tee -a "$LOG/bench.txt"
  "$BIN" sparse-bench --L ${LS##* } --threads $T --reps 1 --dense | tee -a "$LOG/bench.txt"
  # 2-D patterns (the grid fixes L).
  "$BIN" sparse-bench --pattern "${PATTERNS_2D[@]}" --H 4 --D 32 --threads $T --backward --reps $REPS | tee -a "$LOG/bench.txt"
done
unset OPENBLAS_NUM_THREADS

# PyTorch peers in one process per thread count (dense masked attention up to TORCH_L; unfold neighborhood).
"$PY" bench/sparse_peers.py --threads 1 2 --L $TORCH_L --grids $GRIDS --reps $REPS --md "$LOG/peers.md"

{
  echo "## Summary of the targets"
  echo
  "$PY" bench/sparse_targets_summary.py "$LOG/bench.txt" "$LOG/peers.md" --long $LBIG --short $FIRST_L \
    --mid ${LS##* }
  echo
  echo "## sattn sparse-bench output"
  echo
  echo '```'
  cat "$LOG/bench.txt"
  echo '```'
  echo
  echo "## PyTorch peers (bench/sparse_peers.py, wall clock)"
  echo
  cat "$LOG/peers.md"
} >>"$OUT"
echo "wrote $OUT"
