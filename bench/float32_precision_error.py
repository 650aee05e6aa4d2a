#!/usr/bin/env python3
"""The error of float32_precision="highest", "high" and "bf16" against the fp64 reference, forward and backward.

B = 1, H = 2, L = 4096 (--len), D = 64 and 128, unit-normal float32 inputs; max |error| / max |reference| of out, dq,
dk and dv. On a CPU without bf16 products (neither the amx nor the avx512bf16 SIMD target) the rows are the same;
"high" differs from "highest" only on the amx target (forward and backward).

  PYTHONPATH=build/python build/venv/bin/python bench/float32_precision_error.py [--len 4096]
"""
import argparse

import numpy as np

import sattn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--len", type=int, default=4096)
    a = ap.parse_args()
    print(f"fused kernel build: {sattn.simd_targets()['fused']}")
    rng = np.random.default_rng(0)
    for D in (64, 128):
        q, k, v, dout = (rng.standard_normal((1, 2, a.len, D)).astype(np.float32) for _ in range(4))
        q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
        ref, lse_ref = sattn.scaled_dot_product_attention(q64, k64, v64, return_lse=True)
        gref = sattn.scaled_dot_product_attention_backward(dout.astype(np.float64), q64, k64, v64, ref, lse_ref)
        for precision in ("highest", "high", "bf16"):
            out, lse = sattn.scaled_dot_product_attention(q, k, v, return_lse=True, float32_precision=precision)
            grads = sattn.scaled_dot_product_attention_backward(dout, q, k, v, out, lse,
                                                                float32_precision=precision)
            errs = [np.abs(g - r).max() / np.abs(r).max() for g, r in zip((out,) + grads, (ref,) + gref)]
            print(f"D={D} {precision:>7}: out {errs[0]:.2e} dq {errs[1]:.2e} dk {errs[2]:.2e} dv {errs[3]:.2e}")


if __name__ == "__main__":
    main()
