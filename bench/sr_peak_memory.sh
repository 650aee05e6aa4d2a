#!/usr/bin/env bash
# Peak resident memory of `sattn sr upscale` on a 3840x2160 input (the SR memory target): Set14 baboon tiled to
# 3840x2160, written as PNG, then upscaled x2 (default tiling) under /usr/bin/time -v. Prints the CLI summary line, wall
# time and maximum resident set size. Usage: bench/sr_peak_memory.sh [THREADS] (default 1).
set -euo pipefail
cd "$(dirname "$0")/.."
T=${1:-1}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
build/venv/bin/python - "$TMP/big.png" <<'PY'
import os, struct, sys, zlib
import numpy as np
sys.path.insert(0, os.path.join("sr", "train"))
import imgio
img = imgio.read_image(os.path.join("..", "shared", "data", "sr", "test", "Set14", "baboon.png"))
if img.ndim == 2:
    img = np.stack([img] * 3, -1)
H, W = 2160, 3840
big = np.tile(img, (H // img.shape[0] + 1, W // img.shape[1] + 1, 1))[:H, :W].astype(np.uint8)
raw = b"".join(b"\x00" + big[y].tobytes() for y in range(H))
chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
with open(sys.argv[1], "wb") as f:
    f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 1)) + chunk(b"IEND", b""))
PY
/usr/bin/time -v build/sattn sr upscale "$TMP/big.png" "$TMP/out.png" --scale 2 --attention sparse --threads "$T" \
  2>"$TMP/time.txt"
grep -E "Elapsed|Maximum resident" "$TMP/time.txt"
