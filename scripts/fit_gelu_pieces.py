#!/usr/bin/env python3
"""Prints the coefficient table of the AVX-512 GELU in src/nn/simd_ops.cpp (kGeluPieces).

Phi(a) - 1/2 (Phi the standard normal CDF) for a >= 0, in 32 pieces of width 1/5.75 over t = 5.75 a: piece i covers
t in [i, i + 1) and is a quartic in f = t - i, a least-squares fit on 200 Chebyshev nodes, rounded to float32. The last
piece (t >= 31, a >= 5.39, where 1/2 - (Phi(a) - 1/2) < 3.5e-8) is the constant 1/2. Prints the worst error of the
float32 coefficients (evaluated in float64) over a fine grid, then the C++ rows.

Run with the build's venv: build/venv/bin/python scripts/fit_gelu_pieces.py
"""
import math

import numpy as np

SCALE, PIECES, DEGREE = 5.75, 32, 4


def h(a):
    return 0.5 * np.vectorize(math.erf)(a / math.sqrt(2.0))


def main():
    f_nodes = 0.5 + 0.5 * np.cos(np.pi * (np.arange(200) + 0.5) / 200)
    rows = []
    for i in range(PIECES - 1):
        rows.append(np.polyfit(f_nodes, h((i + f_nodes) / SCALE), DEGREE)[::-1])
    rows.append([0.5] + [0.0] * DEGREE)
    rows = np.array(rows, dtype=np.float32)
    worst = 0.0
    f = np.linspace(0.0, 1.0, 2001)
    for i in range(PIECES):
        worst = max(worst, float(np.max(np.abs(np.polyval(rows[i][::-1].astype(np.float64), f) - h((i + f) / SCALE)))))
    print(f"// worst |error| of the pieces (float32 coefficients, evaluated in float64): {worst:.3g}")
    for k in range(DEGREE + 1):
        vals = [f"{v:.9e}f" for v in rows[:, k]]
        lines = [", ".join(vals[j:j + 6]) for j in range(0, PIECES, 6)]
        print("    {" + ",\n     ".join(lines) + "},")


if __name__ == "__main__":
    main()
