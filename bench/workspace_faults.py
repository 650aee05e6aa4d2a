"""Page faults and time of repeated fused backward calls through sattn.torch: what the workspace cache saves.

Runs the causal backward of one attention problem (default B 1, H 8, L 4096, D 64, float32, one thread) --calls
times after one warm-up call and prints the minor page faults per call (getrusage) and the median time. Compare
SATTN_WORKSPACE_CACHE_MB=0 (huge pages only, every call allocates afresh) with the default cache:

    PYTHONPATH=build/python SATTN_WORKSPACE_CACHE_MB=0 build/venv/bin/python bench/workspace_faults.py
    PYTHONPATH=build/python build/venv/bin/python bench/workspace_faults.py
"""
import argparse
import resource
import statistics
import time

import torch

import sattn
import sattn.torch

from torch_threads import set_threads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    if args.calls < 1:
        ap.error(f"--calls: expected at least 1, got {args.calls}")
    set_threads(torch, args.threads)
    sattn.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.length, args.dim)
    q, k, v = (torch.randn(shape, generator=g, requires_grad=True) for _ in range(3))
    out = sattn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    dout = torch.randn(shape, generator=g)

    def backward():
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    backward()  # warm-up: the cache (when on) fills here
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times = []
    for _ in range(args.calls):
        t = time.perf_counter()
        backward()
        times.append(time.perf_counter() - t)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    print(f"B 1, H {args.heads}, L {args.length}, D {args.dim}, causal, {args.threads} thread(s), "
          f"{args.calls} calls: {faults / args.calls:,.0f} minor page faults per call, "
          f"median {statistics.median(times) * 1e3:.1f} ms; workspace cache now "
          f"{sattn.workspace_cache_bytes() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
