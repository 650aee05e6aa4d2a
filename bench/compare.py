#!/usr/bin/env python3
"""sattn's fused attention against PyTorch on this CPU, in one run.

sattn numbers come from `build/sattn bench --json` (which also measures OpenBLAS SGEMM); PyTorch's manual
attention (softmax(q k^T * scale + mask) v, materialising the L x L scores) and, where the installed PyTorch has
it, F.scaled_dot_product_attention are timed here with the same thread count. Materialising baselines run only up
to L = 4096. Benchmarks are only meaningful on an idle machine.

  build/venv/bin/python bench/compare.py [--lens 1024,4096] [--dims 64] [--threads 1,2] [--reps 5] [--json out.json]
"""
import openblas_env  # noqa: F401  (first: OpenBLAS reads OPENBLAS_CORETYPE as numpy / torch load it)
import argparse
import json
import math
import os
import subprocess
import sys
import time


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def torch_rows(torch, L, D, causal, threads, reps):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, L, D, generator=g) for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    mask = torch.ones(L, L, dtype=torch.bool).tril() if causal else None

    def manual(q, k, v):
        s = (q @ k.transpose(-2, -1)) * scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    rows = []
    impls = [("torch_manual", manual)]
    F = torch.nn.functional
    if hasattr(F, "scaled_dot_product_attention"):
        impls.append(("torch_sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))
    for name, fn in impls:
        with torch.no_grad():
            fwd = median_ms(lambda: fn(q, k, v), reps)
        qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
        dout = torch.randn(1, 8, L, D, generator=g)

        def fwd_bwd():
            out = fn(qg, kg, vg)
            out.backward(dout)

        both = median_ms(fwd_bwd, reps)
        rows.append({"impl": name, "L": L, "D": D, "mask": "causal" if causal else "full", "threads": threads,
                     "fwd_ms": fwd, "bwd_ms": max(both - fwd, 0.0)})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lens", default="1024,4096")
    ap.add_argument("--dims", default="64")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--masks", default="full,causal")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sattn", default=os.path.join(os.path.dirname(__file__), "..", "build", "sattn"))
    ap.add_argument("--json", help="also write all rows to this file")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
        print("PyTorch not importable: only sattn is measured", file=sys.stderr)

    all_rows = []
    for t in [int(x) for x in a.threads.split(",")]:
        out = subprocess.run([a.sattn, "bench", "--json", "--threads", str(t), "--lens", a.lens, "--dims", a.dims,
                              "--masks", a.masks, "--reps", str(a.reps)], check=True, capture_output=True, text=True)
        srows = json.loads(out.stdout)
        sgemm = next(r["gflops"] for r in srows if r["kind"] == "sgemm")
        print(f"threads={t}  OpenBLAS sgemm N=2048: {sgemm:.1f} GFLOP/s")
        print(f"  {'impl':<13} {'D':>4} {'L':>6} {'mask':<6} {'fwd_ms':>9} {'bwd_ms':>9}  fwd speed-up of sattn")
        sat = {}
        for r in srows:
            if r["kind"] != "attention":
                continue
            key = (r["L"], r["D"], r["mask"])
            sat.setdefault(key, {})[r["pass"] + "_ms"] = r["median_ms"]
        for (L, D, mask), r in sorted(sat.items()):
            row = {"impl": "sattn_fused", "L": L, "D": D, "mask": mask, "threads": t, **r}
            all_rows.append(row)
            print(f"  {'sattn_fused':<13} {D:>4} {L:>6} {mask:<6} {r.get('fwd_ms', float('nan')):>9.2f} "
                  f"{r.get('bwd_ms', float('nan')):>9.2f}")
            if torch is None or L > 4096:
                continue
            for tr in torch_rows(torch, L, D, mask == "causal", t, a.reps):
                all_rows.append(tr)
                print(f"  {tr['impl']:<13} {D:>4} {L:>6} {mask:<6} {tr['fwd_ms']:>9.2f} {tr['bwd_ms']:>9.2f}  "
                      f"{tr['fwd_ms'] / r['fwd_ms']:.2f}x")
        all_rows.append({"impl": "openblas_sgemm", "threads": t, "gflops": sgemm})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(all_rows, f, indent=1)


if __name__ == "__main__":
    main()
