#!/usr/bin/env python3
"""sattn sparse attention beside its PyTorch equivalents, timed in one process with the same thread count.

1-D patterns (B=1, H=8, D=64 by default): sattn.sparse_attention against PyTorch dense attention with the pattern's
dense mask (matmul + masked_fill(-inf) + softmax + matmul; torch 1.13 has no scaled_dot_product_attention).
BlockTopK's PyTorch peer is dense attention masked with the selection sattn returned (the selection pass itself is
not timed on the PyTorch side). Dense PyTorch runs only up to --dense-max-L (default 4096): the score matrix is
materialised.

2-D pattern Neighborhood2D(g, g, kernel) (H=4, D=32): against an unfold-based neighborhood attention with NATTEN's
semantics (window shifted at the borders, always kernel^2 keys): F.unfold of the K and V grids without padding gives
every in-grid window; each query gathers the window starting at clamp(x - kernel//2, 0, n - kernel) on both axes
into [B*H, L, kernel^2, D], then two batched matmuls. Processed in slabs of query rows to bound memory. The outputs are compared (max |difference| is printed).

Usage: build/venv/bin/python bench/sparse_peers.py [--threads 1 2] [--L 1024 4096] [--grids 64 128 256]
       [--kernels 7 13] [--reps 3] [--clock wall|thread] [--backward] [--md results.md]
Needs PYTHONPATH=build/python (the sattn module) and torch. --clock thread = CPU time of the calling thread
(1 thread only; robust to other processes' load, not to their cache pressure).
"""
import openblas_env  # noqa: F401  (first: OpenBLAS reads OPENBLAS_CORETYPE as numpy / torch load it)
import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_threads import set_threads  # noqa: E402

import sattn


def now(clock):
    return time.thread_time() if clock == "thread" else time.perf_counter()


def median_time(fn, reps, clock):
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t0 = now(clock)
        fn()
        ts.append(now(clock) - t0)
    ts.sort()
    return ts[len(ts) // 2]


def torch_dense_masked(q, k, v, mask, scale):
    """Dense masked attention as PyTorch users write it without SDPA. mask: bool (True = may attend)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p)  # rows with no allowed key -> 0 (sattn's convention)
    return torch.matmul(p, v)


def neighborhood_starts(n, kernel):
    """NATTEN (dilation 1, not causal): window start on an axis of length n, shifted to stay inside."""
    x = torch.arange(n)
    return (x - kernel // 2).clamp(0, n - kernel)


def torch_unfold_neighborhood(q, k, v, grid, kernel, scale, slab_bytes=256 << 20):
    """Unfold-based 2-D neighborhood attention. q, k, v: [B, H, g*g, D] -> out [B, H, g*g, D]."""
    B, H, L, D = q.shape
    n = grid
    nw = n - kernel + 1  # window positions per axis
    starts = neighborhood_starts(n, kernel)
    kg = k.reshape(B * H, n, n, D).permute(0, 3, 1, 2)  # [BH, D, n, n]
    vg = v.reshape(B * H, n, n, D).permute(0, 3, 1, 2)
    qg = q.reshape(B * H, n, n, D)
    per_row = B * H * D * kernel * kernel * (nw + n) * 4 * 2
    rows = max(1, min(n, slab_bytes // per_row))
    outs = []
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        w0, w1 = int(starts[r0]), int(starts[r1 - 1])
        ks = F.unfold(kg[:, :, w0:w1 + kernel, :], kernel)  # [BH, D*k*k, (w1-w0+1)*nw]
        vs = F.unfold(vg[:, :, w0:w1 + kernel, :], kernel)
        # window index of every query of the slab
        widx = ((starts[r0:r1] - w0)[:, None] * nw + starts[None, :]).reshape(-1)  # [(r1-r0)*n]
        # [BH, windows, k*k, D] views of the unfolded grids; gathering the query's window copies it into
        # [BH, nq, k*k, D], then batched matmuls (the fastest of the formulations we tried with torch 1.13).
        kl = ks.view(B * H, D, kernel * kernel, -1).permute(0, 3, 2, 1)
        vl = vs.view(B * H, D, kernel * kernel, -1).permute(0, 3, 2, 1)
        kq, vq = kl[:, widx], vl[:, widx]
        qs = qg[:, r0:r1].reshape(B * H, -1, D, 1)  # [BH, nq, D, 1]
        s = torch.matmul(kq, qs).squeeze(-1) * scale  # [BH, nq, k*k]
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p.unsqueeze(-2), vq).squeeze(-2)  # [BH, nq, D]
        outs.append(o)
    return torch.cat(outs, dim=1).reshape(B, H, L, D)


def fmt(x):
    return "–" if x is None else f"{x:.2f}"


def ratio(a, b):
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--L", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--patterns", nargs="+",
                    default=["SlidingWindow(256, 256)", "Dilated(64, 4)", "BlockTopK(64, 16)"])
    ap.add_argument("--grids", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--kernels", type=int, nargs="+", default=[7, 13])
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--H2d", type=int, default=4)
    ap.add_argument("--D2d", type=int, default=32)
    ap.add_argument("--dense-max-L", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    ap.add_argument("--backward", action="store_true", help="also time the backward (PyTorch: autograd)")
    ap.add_argument("--skip-1d", action="store_true")
    ap.add_argument("--skip-2d", action="store_true")
    ap.add_argument("--md", help="also write the markdown tables to this file")
    a = ap.parse_args()
    if a.clock == "thread" and a.threads != [1]:
        sys.exit("--clock thread: only with --threads 1")

    lines = [f"torch {torch.__version__}, sattn tiles {getattr(sattn, '__version__', '')}, clock {a.clock}, "
             f"reps {a.reps} (median)", ""]

    def emit(s=""):
        print(s, flush=True)
        lines.append(s)

    rng = np.random.default_rng(0)
    for th in a.threads:
        set_threads(torch, th)  # and OpenBLAS's pool (bench/torch_threads.py)
        if not a.skip_1d:
            emit(f"### 1-D patterns vs PyTorch dense masked attention, B=1 H={a.H} D={a.D}, {th} thread(s)")
            emit()
            hdr = "| pattern | L | sattn fwd ms | torch fwd ms | fwd speed-up |"
            sep = "|---|---|---|---|---|"
            if a.backward:
                hdr += " sattn bwd ms | torch bwd ms | bwd speed-up |"
                sep += "---|---|---|"
            emit(hdr + " max abs diff |")
            emit(sep + "---|")
            for spec in a.patterns:
                pat = sattn.Pattern.parse(spec)
                for L in a.L:
                    q, k, v, g = (rng.standard_normal((1, a.H, L, a.D), dtype=np.float32) for _ in range(4))
                    scale = 1.0 / math.sqrt(a.D)
                    adaptive = spec.startswith("BlockTopK") or spec.startswith("TopK")
                    if adaptive:
                        out, lse, idx = sattn.sparse_attention(q, k, v, pat, return_lse=True, return_indices=True,
                                                               num_threads=th)
                    else:
                        out, lse = sattn.sparse_attention(q, k, v, pat, return_lse=True, num_threads=th)
                    tf = median_time(lambda: sattn.sparse_attention(q, k, v, pat, num_threads=th), a.reps, a.clock)
                    tb = None
                    if a.backward:
                        tb = median_time(lambda: sattn.sparse_attention_backward(g, q, k, v, out, lse, pat,
                                                                                 num_threads=th), a.reps, a.clock)
                    pf = pb = diff = None
                    if L <= a.dense_max_L:
                        if adaptive:
                            mask = torch.from_numpy(sattn.selection_mask(pat, idx, L, L))
                        else:
                            mask = torch.from_numpy(pat.dense_mask(L, L, 1))
                        tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
                        with torch.no_grad():
                            ref = torch_dense_masked(tq, tk, tv, mask, scale)
                            diff = float((ref - torch.from_numpy(out)).abs().max())
                            pf = median_time(lambda: torch_dense_masked(tq, tk, tv, mask, scale), a.reps, a.clock)
                        if a.backward:
                            lq, lk, lv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

                            def tb_fn():
                                lq.grad = lk.grad = lv.grad = None
                                torch_dense_masked(lq, lk, lv, mask, scale).backward(tg)

                            pb = median_time(tb_fn, a.reps, a.clock)
                        del mask
                    row = f"| {spec} | {L} | {fmt(tf * 1e3)} | {fmt(pf and pf * 1e3)} | {ratio(pf, tf)} |"
                    if a.backward:
                        row += f" {fmt(tb * 1e3)} | {fmt(pb and pb * 1e3)} | {ratio(pb, tb)} |"
                    emit(row + (" – |" if diff is None else f" {diff:.1e} |"))
            emit()
        if not a.skip_2d:
            emit(f"### Neighborhood2D vs PyTorch unfold-based neighborhood attention (NATTEN border semantics), "
                 f"B=1 H={a.H2d} D={a.D2d}, {th} thread(s)")
            emit()
            hdr = "| pattern | sattn fwd ms | torch unfold fwd ms | fwd speed-up |"
            sep = "|---|---|---|---|"
            if a.backward:
                hdr += " sattn bwd ms | torch bwd ms | bwd speed-up |"
                sep += "---|---|---|"
            emit(hdr + " max abs diff |")
            emit(sep + "---|")
            for grid in a.grids:
                for kern in a.kernels:
                    spec = f"Neighborhood2D({grid}, {grid}, {kern})"
                    pat = sattn.Pattern.parse(spec)
                    L = grid * grid
                    q, k, v, g = (rng.standard_normal((1, a.H2d, L, a.D2d), dtype=np.float32) for _ in range(4))
                    scale = 1.0 / math.sqrt(a.D2d)
                    out, lse = sattn.sparse_attention(q, k, v, pat, return_lse=True, num_threads=th)
                    tf = median_time(lambda: sattn.sparse_attention(q, k, v, pat, num_threads=th), a.reps, a.clock)
                    tb = None
                    if a.backward:
                        tb = median_time(lambda: sattn.sparse_attention_backward(g, q, k, v, out, lse, pat,
                                                                                 num_threads=th), a.reps, a.clock)
                    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
                    with torch.no_grad():
                        ref = torch_unfold_neighborhood(tq, tk, tv, grid, kern, scale)
                        diff = float((ref - torch.from_numpy(out)).abs().max())
                        pf = median_time(lambda: torch_unfold_neighborhood(tq, tk, tv, grid, kern, scale), a.reps,
                                         a.clock)
                    pb = None
                    if a.backward:
                        lq, lk, lv = (x.clone().requires_grad_(True) for x in (tq, tk, tv))

                        def tb_fn():
                            lq.grad = lk.grad = lv.grad = None
                            torch_unfold_neighborhood(lq, lk, lv, grid, kern, scale).backward(tg)

                        pb = median_time(tb_fn, a.reps, a.clock)
                    row = f"| {spec} | {fmt(tf * 1e3)} | {fmt(pf * 1e3)} | {ratio(pf, tf)} |"
                    if a.backward:
                        row += f" {fmt(tb * 1e3)} | {fmt(pb * 1e3)} | {ratio(pb, tb)} |"
                    emit(row + f" {diff:.1e} |")
            emit()
    if a.md:
        with open(a.md, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
