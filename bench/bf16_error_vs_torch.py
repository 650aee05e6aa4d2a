#!/usr/bin/env python3
"""The bf16 forward's error against PyTorch 2.x's own bf16 SDPA, both against the fp64 reference on the same bf16
inputs, on the problems of tests/python/test_bf16_accuracy.py with Lq >= 8 (the test checks max |error| <= 2x
torch's + 1e-5; this prints how close the two are). Per problem: max |error| and mean |error| of out, ours / torch's;
and the mean |error| before the output's rounding (float32 inputs of the same values, float32_precision="bf16",
float32 out: P rounded to bf16 once, as for bf16 outputs).

  PYTHONPATH=build/python build/venv/bin/python bench/bf16_error_vs_torch.py [--simd amx|avx512bf16]
"""
import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import sattn
import sattn.torch as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from test_bf16_accuracy import problems  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--simd", help="SIMD target of the fused kernel (default: the widest this CPU runs)")
    a = ap.parse_args()
    if a.simd:
        sattn.set_simd_target(a.simd)
    print(f"fused kernel build: {sattn.simd_targets()['fused']}")
    print("   n    D    Lq    Lk causal  max ratio  mean ratio  mean err before rounding")
    maxes, means, pre = [], [], []
    for n, D, Lq, Lk, causal, hq, hkv in problems():
        if Lq < 8:
            continue
        g = torch.Generator().manual_seed(n)
        q = torch.randn(1, hq, Lq, D, generator=g).bfloat16()
        k, v = (torch.randn(1, hkv, Lk, D, generator=g).bfloat16() for _ in range(2))
        gqa = hq != hkv
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=gqa)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa).double()
        ours = st.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa).double()
        ours32 = torch.from_numpy(sattn.scaled_dot_product_attention(
            *(x.float().numpy() for x in (q, k, v)), is_causal=causal, enable_gqa=gqa,
            float32_precision="bf16")).double()
        ok = torch.isfinite(theirs)  # rows with no allowed key: torch NaN, sattn 0
        e_t, e_o, e_32 = ((x - ref)[ok].abs() for x in (theirs, ours, ours32))
        maxes.append(e_o.max().item() / e_t.max().item())
        means.append(e_o.mean().item() / e_t.mean().item())
        pre.append(e_32.mean().item())
        print(f"{n:4d} {D:4d} {Lq:5d} {Lk:5d} {str(causal):>6}  {maxes[-1]:9.2f}  {means[-1]:10.3f}  {pre[-1]:.3g}")
    print(f"largest max ratio {max(maxes):.2f}; mean ratio {np.mean(means):.3f} on average, {max(means):.3f} at most; "
          f"mean error before rounding {np.mean(pre):.3g}")


if __name__ == "__main__":
    main()
