#!/usr/bin/env python3
"""sattn's SDPA against PyTorch's own SDPA on this CPU, in one process, in alternating rounds.

sattn.torch.scaled_dot_product_attention and torch.nn.functional.scaled_dot_product_attention run on the same torch
tensors (B = --batch, H = --heads query heads over --kv-heads key/value heads, Lk = L, Lq = --lq or L) with the
same thread count: torch.set_num_threads(t), which sattn.torch reads at every call (sattn.set_num_threads(t) and
OpenBLAS's pool, bench/torch_threads.py, are set to t too). The matrix is dtype x pass x mask x D x L x threads,
plus decode (Lq 1, Lk = --decode-lens, forward, no mask, dtypes --decode-dtypes).

Each configuration gets one warm-up call of each side, then --rounds rounds; a round times sattn and torch, sattn
first in even rounds and torch first in odd ones, and each time is the median of --reps calls (default 1). Forward:
the call under torch.no_grad(). Backward: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) on an output
computed once before the rounds (the forward is not timed). Masks: full (none), causal, bias: an additive float
mask [1, H, Lq, Lk] in the inputs' dtype shared by the batch (a learned position bias, as in windowed vision
transformers), whose gradient the backward computes too, padding: a bool attn_mask [B, 1, 1, Lk] (True = may
attend) that pads the last eighth of every sequence's keys, as a transformer's padding mask, or bool: a bool
attn_mask [1, 1, Lq, Lk] with about a tenth of the pairs masked at random (seeded), an arbitrary mask (GFLOP/s count
the padded or masked keys too). One line per configuration: the median over the rounds of
each side's time, sattn's GFLOP/s (forward 4·B·H·Lq·Lk·D, backward 2.5x that; half for causal when Lq == Lk), the
per-round ratios torch ms / sattn ms and their median (> 1: sattn faster). The warm-up outputs (forward) or
gradients (backward) of the two are compared; a gross mismatch is reported on stderr, the max |diff| goes to --json.

Ceilings, once per thread count before its rows: the FMA limit (independent vector FMA chains of sattn's selected SIMD
build on that many threads; under the amx and avx512bf16 builds also the vdpbf16ps limit, the same with AVX512-BF16
dot products) and OpenBLAS SGEMM at N=2048, all from `build/sattn bench --json` (the OpenBLAS that sattn bench
opens; --sattn names the binary), torch.mm at N=2048 in fp32 and bf16 (median of 5 after a warm-up;
at N=256 where one call at N=2048 would take over a second, as bf16 does on a CPU without bf16 products).
Each row's sattn_GF is also given as a share of the FMA limit (%fma; bf16 products on AMX tiles or vdpbf16ps are not
bound by it).
The header names the CPU model, its ISA flags (avx2, avx512f, avx512_bf16, avx512_fp16, amx_bf16, amx_tile), the
SIMD build of sattn's fused kernel that runs (sattn.simd_targets()) and torch's version and CPU capability.
Benchmarks are only meaningful on an idle machine. Needs PyTorch 2.x and the sattn module (PYTHONPATH=build/python;
build/python is also tried when sattn is not importable).

  PYTHONPATH=build/python build/venv/bin/python bench/compare.py                 # the full matrix (defaults)
  PYTHONPATH=build/python build/venv/bin/python bench/compare.py --quick         # smoke test (seconds)
  PYTHONPATH=build/python build/venv/bin/python bench/compare.py [--dtypes fp32,bf16,fp16] [--passes fwd,bwd]
      [--masks full,causal,bias,padding,bool] [--dims 64,128] [--lens 1024,4096] [--threads 1,2] [--decode-lens 65536]
      [--decode-dtypes bf16,fp32] [--batch 1] [--heads 8] [--kv-heads H] [--float32-precision highest]
      [--rounds 5] [--reps 1] [--sattn build/sattn] [--json out.json]

--quick: L 256, D 64, 2 rounds, 1 thread, decode Lk 1024, ceilings at N=512 (3 reps); options given explicitly
override it. --decode-lens '' skips decode. --kv-heads below --heads times grouped-query attention (both sides with
enable_gqa=True; query head h reads key/value head h // (H / Hkv)). --reps is the number of calls per measurement;
--rounds sets how many measurements each side gets. --json writes every row (header, ceilings, one per
configuration with every round's times and which side went first) to a file.

--layout blhd: q, k and v are views of [B, L, H, D] memory (a fused projection's output split into heads), and each
timed call is followed by out.transpose(1, 2).reshape(B, Lq, H·D), a transformer's next step: a view where out has the
query's layout, a copy where it does not (the backward then takes the gradient of that [B, Lq, H·D] tensor).
"""
import openblas_env  # noqa: F401  (first: OpenBLAS reads OPENBLAS_CORETYPE as numpy / torch load it)
import argparse
import contextlib
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_threads import set_threads  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError as err:
    torch = F = None
    TORCH_ERROR = err

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
DTYPE_NAMES = ("fp32", "bf16", "fp16")
DEFAULTS = {"dtypes": "fp32,bf16,fp16", "passes": "fwd,bwd", "masks": "full,causal", "dims": "64,128",
            "lens": "1024,4096", "threads": "1,2", "decode_lens": "65536", "decode_dtypes": "bf16,fp32", "rounds": 5,
            "ceiling_n": 2048, "ceiling_reps": 5}
QUICK = {"lens": "256", "dims": "64", "rounds": 2, "threads": "1", "decode_lens": "1024", "ceiling_n": 512,
         "ceiling_reps": 3}
# A relative max |difference| above this between the two sides' results means they did not compute the same thing
# (a mask or scale mismatch), not rounding: bf16 / fp16 backward differences stay far below it.
MISMATCH = 0.1


def cpu_info():
    """("model name", the ISA_FLAGS this CPU has) from /proc/cpuinfo."""
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, [x for x in ISA_FLAGS if x in flags]


def import_sattn():
    try:
        sattn = importlib.import_module("sattn")
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "build", "python"))
        try:
            sattn = importlib.import_module("sattn")
        except ImportError as e:
            sys.exit(f"compare.py: the sattn module is not importable ({e}); run with PYTHONPATH=build/python")
    try:
        sattn_torch = importlib.import_module("sattn.torch")
    except ImportError as e:
        sys.exit(f"compare.py: sattn.torch is not importable ({e}); it needs PyTorch 2.x")
    return sattn, sattn_torch


def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sattn_ceilings(binary, threads, n, reps):
    """(FMA limit GFLOP/s or None where the build has none, OpenBLAS SGEMM GFLOP/s, its core, vdpbf16ps limit
    GFLOP/s or None where not measured) from `sattn bench --json` (its attention row, tiny, is ignored), or None
    without the binary."""
    if not os.path.exists(binary):
        return None
    r = subprocess.run([binary, "bench", "--json", "--threads", str(threads), "--lens", "64", "--dims", "64",
                        "--masks", "full", "--passes", "fwd", "--reps", str(reps), "--sgemm-n", str(n)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare.py: {binary} bench failed ({r.returncode}): {r.stderr.strip()}")
    rows = json.loads(r.stdout)
    sgemm = next(x for x in rows if x["kind"] == "sgemm")
    limit = next((x for x in rows if x["kind"] == "fma_limit"), {})
    dot = limit.get("bf16_dot_gflops") or None
    return limit.get("gflops") or None, sgemm["gflops"], sgemm.get("blas_core", "?"), dot


def mm_ceiling(dtype, n, reps):
    """(torch.mm GFLOP/s at N x N x N: median of reps calls after one warm-up, the N used). A smaller N (256) where
    one call at the full N would take over a second: bf16 on a CPU without bf16 products runs at ~0.3 GFLOP/s, and
    6 calls at N = 2048 would take minutes."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        small = min(n, 256)
        a, b = (torch.randn(small, small, generator=g).to(dtype) for _ in range(2))
        torch.mm(a, b)
        if median_ms(lambda: torch.mm(a, b), 1) * (n / small) ** 3 > 1e3:
            n = small
        else:
            a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
            torch.mm(a, b)
        ms = median_ms(lambda: torch.mm(a, b), reps)
    return 2.0 * n ** 3 / (ms * 1e6), n


def at_n(n, ceiling_n):
    """' (N=n)' where a ceiling was timed at another N than --ceiling-n, else ''."""
    return "" if n == ceiling_n else f" (N={n})"


def flops(pas, causal, B, H, Lq, Lk, D):
    f = 4.0 * B * H * Lq * Lk * D * (2.5 if pas == "bwd" else 1.0)
    return f / 2 if causal and Lq == Lk else f


def max_rel_diff(xs, ys):
    """max |x - y| over the pairs, and that divided by max |y|."""
    diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(xs, ys))
    ref = max(y.float().abs().max().item() for y in ys)
    return diff, diff / max(ref, 1e-30)


def run_config(sdpa, dtype_name, pas, mask, D, Lq, Lk, threads, a):
    """One configuration: warm-up, then a.rounds alternating rounds. Returns the JSON row."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    causal = mask == "causal"
    g = torch.Generator().manual_seed(0)
    if a.layout == "blhd":  # views of [B, L, H, D] memory
        q = torch.randn(a.batch, Lq, a.heads, D, generator=g).to(dtype).transpose(1, 2)
        k, v = (torch.randn(a.batch, Lk, a.kv_heads, D, generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    else:
        q = torch.randn(a.batch, a.heads, Lq, D, generator=g).to(dtype)
        k, v = (torch.randn(a.batch, a.kv_heads, Lk, D, generator=g).to(dtype) for _ in range(2))
    kw = {"enable_gqa": True} if a.kv_heads != a.heads else {}
    bias = torch.randn(1, a.heads, Lq, Lk, generator=g).to(dtype) if mask == "bias" else None
    if bias is not None:
        kw["attn_mask"] = bias
    if mask == "padding":  # every sequence's last eighth of keys is padding (True = may attend)
        kw["attn_mask"] = (torch.arange(Lk) < Lk - Lk // 8).reshape(1, 1, 1, Lk).repeat(a.batch, 1, 1, 1)
    if mask == "bool":  # an arbitrary mask: about a tenth of the pairs masked (True = may attend)
        kw["attn_mask"] = torch.rand(1, 1, Lq, Lk, generator=g) >= 0.1
    inputs = (q, k, v) if bias is None else (q, k, v, bias)
    impls = {"sattn": sdpa, "torch": F.scaled_dot_product_attention}
    if a.layout == "blhd":  # each call followed by the merge of the heads
        impls = {n: (lambda *x, fn=fn, **o: fn(*x, **o).transpose(1, 2).reshape(a.batch, Lq, a.heads * D))
                 for n, fn in impls.items()}
    if pas == "fwd":
        ctx = torch.no_grad
        calls = {n: (lambda fn=fn: fn(q, k, v, is_causal=causal, **kw)) for n, fn in impls.items()}
        with ctx():
            warm = {n: [c()] for n, c in calls.items()}
    else:
        ctx = contextlib.nullcontext
        for x in inputs:
            x.requires_grad_(True)
        dout = torch.randn(a.batch, a.heads, Lq, D, generator=g).to(dtype)
        if a.layout == "blhd":
            dout = dout.transpose(1, 2).reshape(a.batch, Lq, a.heads * D)
        # once; the rounds time the backward
        outs = {n: fn(q, k, v, is_causal=causal, **kw) for n, fn in impls.items()}
        calls = {n: (lambda out=out: torch.autograd.grad(out, inputs, dout, retain_graph=True))
                 for n, out in outs.items()}
        warm = {n: list(c()) for n, c in calls.items()}
    diff, rel = max_rel_diff(warm["sattn"], warm["torch"])
    del warm
    if not rel <= MISMATCH:
        print(f"compare.py: sattn and torch differ: max |diff| {diff:.3g} ({rel:.3g} of torch's max |value|) at "
              f"{dtype_name} {pas} {mask} D={D} Lq={Lq} Lk={Lk}", file=sys.stderr)
    times = {"sattn": [], "torch": []}
    first = []
    with ctx():
        for r in range(a.rounds):
            order = ("sattn", "torch") if r % 2 == 0 else ("torch", "sattn")
            first.append(order[0])
            for n in order:
                times[n].append(median_ms(calls[n], a.reps))
    fl = flops(pas, causal, a.batch, a.heads, Lq, Lk, D)
    ratios = [t / s for s, t in zip(times["sattn"], times["torch"])]
    s_ms, t_ms = statistics.median(times["sattn"]), statistics.median(times["torch"])
    return {"kind": "sdpa", "dtype": dtype_name, "pass": pas, "mask": mask, "B": a.batch, "H": a.heads,
            "Hkv": a.kv_heads, "D": D,
            "Lq": Lq, "Lk": Lk, "threads": threads, "reps": a.reps, "first": first, "sattn_ms": times["sattn"],
            "torch_ms": times["torch"], "sattn_median_ms": s_ms, "torch_median_ms": t_ms,
            "sattn_gflops": fl / (s_ms * 1e6), "torch_gflops": fl / (t_ms * 1e6), "ratios": ratios,
            "ratio_median": statistics.median(ratios), "max_abs_diff": diff, "max_rel_diff": rel}


def print_row(r):
    per_round = " ".join(f"{x:5.2f}" for x in r["ratios"])
    pct = f"{r['sattn_pct_fma_limit']:5.1f}%" if r.get("sattn_pct_fma_limit") is not None else "   n/a"
    print(f"  {r['dtype']:<5} {r['pass']:<4} {r['mask']:<6} {r['D']:>4} {r['Lq']:>6} {r['Lk']:>6} {r['threads']:>3} "
          f"{r['sattn_median_ms']:>10.3f} {r['torch_median_ms']:>10.3f} {r['sattn_gflops']:>8.1f} {pct}  "
          f"{per_round}  {r['ratio_median']:5.2f}", flush=True)


def names(text, allowed, option):
    got = [x for x in text.split(",") if x]
    bad = [x for x in got if x not in allowed]
    if bad:
        sys.exit(f"compare.py: {option}: unknown {', '.join(bad)} (expected some of {','.join(allowed)})")
    return got


def ints(text, option):
    try:
        got = [int(x) for x in text.split(",") if x]
    except ValueError:
        sys.exit(f"compare.py: {option}: expected comma-separated integers, got '{text}'")
    if any(x <= 0 for x in got):
        sys.exit(f"compare.py: {option}: expected positive integers, got '{text}'")
    return got


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for opt, what in (("--dtypes", "fp32,bf16,fp16"), ("--passes", "fwd,bwd"),
                      ("--masks", "full,causal,bias,padding,bool"),
                      ("--dims", "head dims D"), ("--lens", "sequence lengths L (Lq = Lk)"),
                      ("--threads", "thread counts"), ("--decode-lens", "decode key lengths (Lq 1; '' skips decode)"),
                      ("--decode-dtypes", "decode dtypes")):
        key = opt[2:].replace("-", "_")
        ap.add_argument(opt, help=f"{what}, comma separated (default {DEFAULTS[key]})")
    ap.add_argument("--batch", type=int, default=1, help="B (default 1)")
    ap.add_argument("--heads", type=int, default=8, help="H, query heads (default 8)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads, a divisor of H (default H; fewer: GQA)")
    ap.add_argument("--lq", type=int, help="query length of every row, keys L (default L; e.g. 4096 queries over "
                    "77 keys: cross-attention; causal is then torch's is_causal, top-left, on both sides)")
    ap.add_argument("--layout", choices=("bhld", "blhd"), default="bhld",
                    help="q, k, v contiguous [B, H, L, D] (default) or views of [B, L, H, D] memory, each call then "
                    "followed by out.transpose(1, 2).reshape(B, Lq, H*D) (see above)")
    ap.add_argument("--float32-precision", choices=("highest", "high", "medium"), default="highest",
                    help="torch.set_float32_matmul_precision for the run, which sattn.torch follows ('high': float32 "
                         "as two bf16 in sattn's AMX forward; 'medium': rounded to bf16); default highest")
    ap.add_argument("--rounds", type=int, help="alternating rounds per configuration (default 5)")
    ap.add_argument("--reps", type=int, default=1, help="calls per measurement, median taken (default 1)")
    ap.add_argument("--ceiling-n", type=int, help="N of the SGEMM and torch.mm ceilings (default 2048)")
    ap.add_argument("--ceiling-reps", type=int, help="timed calls per ceiling, median taken (default 5)")
    ap.add_argument("--sattn", default=os.path.join(REPO, "build", "sattn"),
                    help="the sattn command, for the OpenBLAS SGEMM ceiling (default build/sattn)")
    ap.add_argument("--json", help="also write all rows to this file")
    ap.add_argument("--quick", action="store_true", help="a tiny matrix for smoke tests (see above)")
    a = ap.parse_args()
    for key, value in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, QUICK[key] if a.quick and key in QUICK else value)
    if a.kv_heads is None:
        a.kv_heads = a.heads
    for key in ("batch", "heads", "kv_heads", "rounds", "reps", "ceiling_n", "ceiling_reps", "lq"):
        if getattr(a, key) is not None and getattr(a, key) <= 0:
            sys.exit(f"compare.py: --{key.replace('_', '-')}: expected a positive integer")
    if a.heads % a.kv_heads:
        sys.exit(f"compare.py: --kv-heads: expected a divisor of --heads ({a.heads}), got {a.kv_heads}")
    return a


def main():
    a = parse_args()
    if torch is None:
        sys.exit(f"compare.py: PyTorch is not importable ({TORCH_ERROR}). This benchmark times sattn.torch against "
                 "torch's own scaled_dot_product_attention in one process: run it with build/venv/bin/python "
                 "(PyTorch 2.x, installed by scripts/bootstrap)")
    if not hasattr(F, "scaled_dot_product_attention"):
        sys.exit(f"compare.py: PyTorch {torch.__version__} has no scaled_dot_product_attention; PyTorch 2.x needed")
    sattn, sattn_torch = import_sattn()
    dtypes = names(a.dtypes, DTYPE_NAMES, "--dtypes")
    passes = names(a.passes, ("fwd", "bwd"), "--passes")
    masks = names(a.masks, ("full", "causal", "bias", "padding", "bool"), "--masks")
    dims, lens, thread_counts = ints(a.dims, "--dims"), ints(a.lens, "--lens"), ints(a.threads, "--threads")
    decode_lens = ints(a.decode_lens, "--decode-lens")
    decode_dtypes = names(a.decode_dtypes, DTYPE_NAMES, "--decode-dtypes")

    torch.set_float32_matmul_precision(a.float32_precision)  # both sides (sattn.torch follows torch's setting)
    model, isa = cpu_info()
    simd = sattn.simd_targets()
    cap = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else "?"
    print(f"CPU: {model}; ISA flags: {' '.join(isa) or 'none of ' + ' '.join(ISA_FLAGS)}")
    print(f"sattn {sattn.__version__} ({os.path.dirname(sattn.__file__)}): fused kernel SIMD build {simd['fused']} "
          f"(selected {simd['selected']}; this CPU runs {', '.join(simd['available'])})")
    print(f"torch {torch.__version__} (CPU capability {cap}); B={a.batch} H={a.heads} Hkv={a.kv_heads}, "
          f"{'q, k, v from [B, L, H, D] memory, out merged to [B, L, H*D], ' if a.layout == 'blhd' else ''}"
          f"float32 matmul precision {a.float32_precision}; "
          f"{a.rounds} rounds of {a.reps} call(s) per side, alternating which goes first; "
          "ratio = torch ms / sattn ms (> 1: sattn faster)")
    rows = [{"kind": "env", "cpu": model, "isa_flags": isa, "sattn_version": sattn.__version__, "sattn_simd": simd,
             "torch_version": torch.__version__, "torch_cpu_capability": cap, "batch": a.batch, "heads": a.heads,
             "kv_heads": a.kv_heads, "layout": a.layout, "float32_precision": a.float32_precision,
             "rounds": a.rounds, "reps": a.reps}]

    for t in thread_counts:
        set_threads(torch, t)  # torch's pool (sattn.torch reads torch.get_num_threads()) and OpenBLAS's
        sattn.set_num_threads(t)  # sattn's default for its numpy API, kept equal
        if torch.get_num_threads() != t:
            sys.exit(f"compare.py: torch.set_num_threads({t}) left torch at {torch.get_num_threads()} threads")
        ceil = sattn_ceilings(a.sattn, t, a.ceiling_n, a.ceiling_reps)
        fma = ceil[0] if ceil else None
        mm32, n32 = mm_ceiling(torch.float32, a.ceiling_n, a.ceiling_reps)
        mm16, n16 = mm_ceiling(torch.bfloat16, a.ceiling_n, a.ceiling_reps)
        no_binary = f"n/a (no {a.sattn}; --sattn names it)"
        fma_text = f"{fma:.1f} GFLOP/s" if fma else ("n/a (portable build)" if ceil else no_binary)
        dot = ceil[3] if ceil else None
        if dot:
            fma_text += f", vdpbf16ps limit {dot:.1f} GFLOP/s"
        sg_text = f"{ceil[1]:.1f} GFLOP/s (OpenBLAS {ceil[2]})" if ceil else no_binary
        print(f"\nthreads={t}  FMA limit {fma_text}; N={a.ceiling_n}: sgemm {sg_text}; torch.mm fp32 {mm32:.1f}"
              f"{at_n(n32, a.ceiling_n)}, bf16 {mm16:.1f}{at_n(n16, a.ceiling_n)} GFLOP/s", flush=True)
        rows.append({"kind": "ceiling", "threads": t, "n": a.ceiling_n, "fma_limit_gflops": fma,
                     "vdpbf16ps_limit_gflops": dot,
                     "sgemm_gflops": ceil[1] if ceil else None, "blas_core": ceil[2] if ceil else None,
                     "torch_mm_fp32_gflops": mm32, "torch_mm_fp32_n": n32,
                     "torch_mm_bf16_gflops": mm16, "torch_mm_bf16_n": n16})
        print(f"  {'dtype':<5} {'pass':<4} {'mask':<6} {'D':>4} {'Lq':>6} {'Lk':>6} {'thr':>3} {'sattn_ms':>10} "
              f"{'torch_ms':>10} {'sattn_GF':>8} {'%fma':>6}  ratio per round, median")
        configs = [(dt, p, m, D, a.lq or L, L)
                   for dt in dtypes for p in passes for m in masks for D in dims for L in lens]
        configs += [(dt, "fwd", "full", D, 1, L) for dt in decode_dtypes for D in dims for L in decode_lens]
        for dt, p, m, D, Lq, Lk in configs:
            row = run_config(sattn_torch.scaled_dot_product_attention, dt, p, m, D, Lq, Lk, t, a)
            row["sattn_pct_fma_limit"] = 100.0 * row["sattn_gflops"] / fma if fma else None
            rows.append(row)
            print_row(row)
    if a.json:  # atomically: a file of that name is replaced only by a complete one
        fd, tmp = tempfile.mkstemp(prefix=".compare.", suffix=".json", dir=os.path.dirname(os.path.abspath(a.json)))
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(tmp, a.json)
        except BaseException:
            os.unlink(tmp)
            raise


if __name__ == "__main__":
    main()
