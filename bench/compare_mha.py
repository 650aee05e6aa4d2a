#!/usr/bin/env python3
"""sattn.torch.MultiheadAttention against torch.nn.MultiheadAttention (same weights) on this CPU, alternating.

Each configuration (batch x length x embedding x threads) builds both modules with the same state_dict and one input
[L, B, E] (sequence-first) or [B, L, E] (--batch-first) used as query, key and value (self-attention; --cross gives
key and value a tensor of their own). Modes: inference, the call in eval mode under torch.no_grad() with
need_weights=False (torch's own fast path runs where its conditions hold: batch_first, eval, no grad, self-attention);
train, forward and backward of out.sum() in training mode (dropout 0). Each of --rounds rounds times both, the side
that goes first alternating; each time is the median of --reps calls; the ratio is torch ms / sattn ms in the same
round (> 1: sattn faster), and the line gives its median over the rounds. Benchmarks are only meaningful on an idle
machine. Needs PyTorch 2.x and the sattn module (PYTHONPATH=build/python).

  PYTHONPATH=build/python build/venv/bin/python bench/compare_mha.py [--batch 1,8] [--lens 16,64,256]
      [--embed 256] [--heads 4] [--threads 1] [--modes inference,train] [--batch-first] [--cross]
      [--rounds 7] [--reps 20]
"""
import openblas_env  # noqa: F401  (first: OpenBLAS reads OPENBLAS_CORETYPE as numpy / torch load it)
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_threads import set_threads  # noqa: E402


def ints(text):
    return [int(x) for x in text.split(",") if x]


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=ints, default=[1, 8])
    ap.add_argument("--lens", type=ints, default=[16, 64, 256])
    ap.add_argument("--embed", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--threads", type=ints, default=[1])
    ap.add_argument("--modes", default="inference,train")
    ap.add_argument("--batch-first", action="store_true")
    ap.add_argument("--cross", action="store_true", help="key/value a tensor of their own (one for both)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in ("inference", "train"):
            ap.error(f"--modes: expected inference or train, got '{m}'")

    import torch
    import sattn.torch as st

    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), E = {a.embed}, H = {a.heads}, "
          f"batch_first = {a.batch_first}, {'cross' if a.cross else 'self'}-attention")
    print(f"{'mode':>9} {'B':>3} {'L':>5} thr {'sattn_ms':>9} {'torch_ms':>9}  ratio per round, median")
    for threads in a.threads:
        set_threads(torch, threads)
        for B in a.batch:
            for L in a.lens:
                torch.manual_seed(0)
                ref = torch.nn.MultiheadAttention(a.embed, a.heads, batch_first=a.batch_first)
                ours = st.MultiheadAttention(a.embed, a.heads, batch_first=a.batch_first)
                ours.load_state_dict(ref.state_dict())
                shape = (B, L, a.embed) if a.batch_first else (L, B, a.embed)
                x = torch.randn(*shape)
                kv = torch.randn(*shape) if a.cross else x
                for mode in modes:
                    def call(mod, mode=mode):
                        if mode == "inference":
                            mod.eval()
                            with torch.no_grad():
                                mod(x, kv, kv, need_weights=False)
                        else:
                            mod.train()
                            mod(x, kv, kv, need_weights=False)[0].sum().backward()
                    sides = {"sattn": ours, "torch": ref}
                    for mod in sides.values():
                        call(mod)  # warm-up
                    times = {"sattn": [], "torch": []}
                    for r in range(a.rounds):
                        order = ("sattn", "torch") if r % 2 == 0 else ("torch", "sattn")
                        for name in order:
                            times[name].append(median_ms(lambda: call(sides[name]), a.reps))
                    ratios = [t / s for s, t in zip(times["sattn"], times["torch"])]
                    print(f"{mode:>9} {B:>3} {L:>5} {threads:>3} {statistics.median(times['sattn']):9.3f} "
                          f"{statistics.median(times['torch']):9.3f}  "
                          + " ".join(f"{x:.2f}" for x in ratios) + f"   {statistics.median(ratios):.2f}",
                          flush=True)


if __name__ == "__main__":
    main()
