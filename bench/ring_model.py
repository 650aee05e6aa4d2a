#!/usr/bin/env python3
"""Analytic model of sattn's ring attention (sattn::dist, `sattn ring`): time per ring step, total time, and
memory per rank. docs/distributed.md derives it.

Each of P ranks holds n = L/P rows of q, k, v. In P steps the K/V block (B·Hkv·n·2D·bytes) moves one hop around
the ring while every rank attends its queries to the block it holds; the next block arrives in the background.
  compute(step) = 4·B·H·D·(allowed (query, key) pairs of the step's slowest rank) / R    (backward: 2.5x / R_bwd)
  comm(step)    = lat + block_bytes / BW                      (none at the last step; backward: + dK/dV float32)
  step time     = max(compute, comm) + overhead + 2·ceil(log2 P)·lat (the per-step error agreement, an Allreduce)
Comm is hidden while compute >= comm, i.e. from the block length n* = (b + sqrt(b² + 4·a·lat)) / (2a) on, with
a = 4·B·H·D·f/R, b = B·Hkv·2D·bytes/BW (f = 1 full or contiguous causal, 1/2 zigzag or striped causal):
n* ≈ Hkv·bytes·R / (2·f·H·BW) when latency is negligible (B and D cancel).

  bench/ring_model.py --L 65536 --P 4 --causal --layout zigzag    one configuration
  bench/ring_model.py --table [--bw 25 --lat 2e-6 --rate 45]        P = 1..1024 x L = 16K, 64K, 1M, 10M
  bench/ring_model.py --measured run1.json run2.json ...            model vs `sattn ring --json` runs

--rate R is the fused forward's GFLOP/s per rank: measure it on the target machine with
`mpirun -np 1 build/sattn ring --L 16384 --json` (forward_gflops_per_rank) at the thread count you will use.
--measured takes R from the P=1 run with the same L, causal, shapes, dtype and threads, and BW from the
multi-rank runs' exchange_alone_seconds ((P-1) blocks per pass); ranks x threads beyond --cores scale R down;
repeated runs of one configuration (e.g. bench/ring_scaling.sh's runs.jsonl) count by their median times.
"""
import argparse
import json
import math
import os
import statistics
import sys
from types import SimpleNamespace

GIB = 1 << 30


def tri(nq, nk, d):
    """Pairs (i, j), 0 <= i < nq, 0 <= j < nk, with j <= i + d: query i sees clamp(i + d + 1, 0, nk) keys."""
    a = max(0, -d)                        # first query that sees a key
    full = max(0, nk - d - 1)             # first query that sees every key
    e = min(nq, max(a, full))
    ramp = max(0, e - a) * (d + 1) + (a + e - 1) * max(0, e - a) // 2
    return ramp + max(0, nq - max(full, a)) * nk


def step_pairs(c):
    """Allowed pairs per rank: (step 0, later steps' slowest rank, later steps' fastest rank)."""
    n = -(-c.L // c.P)  # the longest shard (contiguous gives the first L % P ranks one row more)
    if not c.causal:
        return n * n, n * n, n * n
    if c.layout == "contiguous":  # later steps: ranks r >= step hold an earlier block (full), the others skip it
        return tri(n, n, 0), n * n, 0
    if c.layout == "zigzag":  # chunks r, 2P-1-r: another rank's block meets them in exactly two full chunk pairs
        h = n // 2
        return 2 * tri(h, h, 0) + h * h, 2 * h * h, 2 * h * h
    return tri(n, n, 0), tri(n, n, 0), tri(n, n, -1)  # striped: src < r on the diagonal, src > r just above it


def steps(c, backward=False):
    """[(count, compute slowest, compute fastest, comm)] per kind of step, for one call."""
    n, P = -(-c.L // c.P), c.P
    first, slow, fast = step_pairs(c)
    flops, rate = (2.5 * 4 * c.B * c.H * c.D, c.rate_bwd) if backward else (4 * c.B * c.H * c.D, c.rate)
    kv = c.B * c.Hkv * n * 2 * c.D * c.bytes
    dkv = c.B * c.Hkv * n * 2 * c.D * 4 if backward else 0   # dK/dV accumulators travel with the block
    msg = lambda b: c.lat + b / c.bw if b else 0.0
    t = lambda pairs: flops * pairs / rate
    if P == 1:
        return [(1, t(first), t(first), 0.0)]
    out = [(1, t(first), t(first), msg(kv)), (P - 2, t(slow), t(fast), msg(kv + dkv)), (1, t(slow), t(fast), msg(dkv))]
    if backward:
        out.append((1, 0.0, 0.0, msg(dkv)))  # the last hop home, after the last step: exposed
    return out


def ring_time(c, backward=False):
    """(seconds of one call, exposed wait of the rank that waits most, every comm hidden?)."""
    overhead = c.overhead + 2 * math.ceil(math.log2(c.P)) * c.lat
    total = wait = 0.0
    hidden = True
    for count, slow, fast, comm in steps(c, backward):  # no overlap: the transfer happens in the wait
        total += count * ((slow + comm if c.no_overlap else max(slow, comm)) + overhead)
        wait += count * (comm if c.no_overlap else max(0.0, comm - fast))
        hidden &= count == 0 or comm == 0.0 or slow == 0.0 or (comm <= slow and not c.no_overlap)
    return total, wait, hidden


def crossover(c, backward=False):
    """Block length n* from which compute per step >= comm per step (steady steps, slowest rank)."""
    f = 0.5 if c.causal and c.layout != "contiguous" else 1.0
    a = (2.5 / c.rate_bwd if backward else 1.0 / c.rate) * 4 * c.B * c.H * c.D * f    # s per n²
    b = c.B * c.Hkv * 2 * c.D * (c.bytes + (4 if backward else 0)) / c.bw           # s per n
    return (b + math.sqrt(b * b + 4 * a * c.lat)) / (2 * a), b / a


def fused_backward_scratch(c, nq, nk):
    """The fused backward's scratch (src/kernels/fused/fused_kernel.cpp), lse_eff/delta and: with every key tile in
    one group (their dK/dV accumulators within 1 MiB, kv_group_size), the query chunks' partial dK and dV
    (query_chunks; a task's one query tile is negligible); otherwise packed query tiles (4 float copies of q-sized
    data) and the partial dQ tiles (one float copy of dQ per group of key tiles)."""
    pad = lambda x: -(-x // 16) * 16
    br, bc = (16 if nq <= 16 else 64), 64
    nqb, nkb = -(-nq // br), -(-nk // bc)
    rows = 2 * c.B * c.H * nq * 4
    max_group = max(1, (1 << 20) // (bc * 2 * pad(c.D) * 4))
    if nkb <= max_group:
        heads, items = c.B * c.Hkv, (c.H // c.Hkv) * nqb
        chunks = min(max(-(-32 // heads), 1), max(1, items // 4))
        return rows + (heads * chunks * nkb * bc * 2 * pad(c.D) * 4 if chunks > 1 else 0)
    copy = c.B * c.H * nqb * br * c.D * 4
    group = min(max(c.B * c.Hkv * nkb // 32, 1), max_group)
    group = min(max(group, -(-nkb // max(4, (256 << 20) // max(copy, 1)))), nkb)
    packed = c.B * c.H * nqb * br * (2 * c.D + 2 * pad(c.D)) * 4
    return packed + -(-nkb // group) * copy + rows


def memory_bytes(c, backward=False):
    """Bytes per rank: (the terms `sattn ring` reports as memory_model_bytes, the peak with the scratch buffers)."""
    n, e = -(-c.L // c.P), c.bytes
    B, H, Hkv, D = c.B, c.H, c.Hkv, c.D
    q, kv = B * H * n * D * e, B * Hkv * n * D * e            # q (and out, dout, dq); one of k, v (dk, dv)
    blocks = (2 if c.P > 1 else 1) * 2 * kv                  # the block held and the one arriving
    seg = n // 2 if c.layout == "zigzag" else n               # one query (and key) segment
    merges = c.P > 1 or c.layout == "zigzag"                  # a segment meets a second block: float32 partials
    listed = 2 * q + 2 * kv + B * H * n * 4 + blocks          # q, k, v, out, lse, blocks
    fwd_scratch = merges * B * H * seg * (D + 1) * 4 + (e != 4) * B * H * n * D * 4  # partial out/lse; f32 out
    if not backward:
        return listed, listed + fwd_scratch
    listed += 2 * q + 2 * kv                                  # dout, dq, dk, dv (live during the forward too)
    dkv = B * Hkv * n * 2 * D * 4
    bwd_buffers = B * H * n * D * 4 + ((2 if c.P > 1 else 1) + 1) * dkv  # f32 dq, travelling and step dK/dV
    piece = min(max(n // 8, 256), 2048, seg)  # the backward runs pairs in pieces of both sides (ring_parts.cpp)
    bwd_scratch = (B * H * piece * D * 4 + B * Hkv * piece * 2 * D * 4  # a later piece's dQ and dK/dV
                   + fused_backward_scratch(c, piece, piece))
    return listed + bwd_buffers, listed + max(fwd_scratch, bwd_buffers + bwd_scratch)


def config(args, **over):
    d = dict(L=args.L, P=args.P, B=args.batch, H=args.heads, Hkv=args.kv_heads or args.heads, D=args.dim,
             bytes=args.bytes, causal=args.causal, layout=args.layout, rate=args.rate * 1e9,
             rate_bwd=(args.rate_bwd or 0.8 * args.rate) * 1e9, bw=args.bw * 1e9, lat=args.lat,
             overhead=args.overhead, no_overlap=args.no_overlap)
    d.update(over)
    return SimpleNamespace(**d)


def describe(args, c):
    n = -(-c.L // c.P)
    print(f"L {c.L}, P {c.P} ({c.layout}{', causal' if c.causal else ''}), n = L/P {n}, B {c.B}, H {c.H}/{c.Hkv}, "
          f"D {c.D}, {c.bytes} B/element; R {c.rate / 1e9:g} GFLOP/s, BW {c.bw / 1e9:g} GB/s, lat {c.lat:g} s")
    for bwd in ([False, True] if args.backward else [False]):
        name = "backward" if bwd else "forward"
        for count, slow, fast, comm in steps(c, bwd):
            if count:
                print(f"  {name}: {count} step(s): compute {slow:.4g} s (fastest rank {fast:.4g}), comm {comm:.4g} s")
        total, wait, hidden = ring_time(c, bwd)
        one = ring_time(config(args, L=c.L, P=1, layout="contiguous"), bwd)[0]
        n_star, n_bw = crossover(c, bwd)
        print(f"  {name}: {total:.4g} s, exposed wait {wait:.4g} s, comm hidden: {'yes' if hidden else 'no'}, "
              f"speed-up over P=1 {one / total:.3g} (ideal {c.P})\n  {name}: comm hides from n* = {n_star:.4g} rows "
              f"per rank ({n_bw:.4g} without latency), i.e. L >= {c.P * n_star:.4g} at P = {c.P}")
    listed, full = memory_bytes(c, args.backward)
    print(f"  memory per rank: {full / GIB:.4g} GiB ({listed / GIB:.4g} GiB in `sattn ring`'s model)")


def table(args):
    c0 = config(args)
    n_star, n_bw = crossover(c0)
    print(f"# B {c0.B}, H {c0.H}/{c0.Hkv}, D {c0.D}, {c0.bytes} B/element, {c0.layout}{', causal' if c0.causal else ''}"
          f"; R {args.rate:g} GFLOP/s/rank, BW {args.bw:g} GB/s, lat {args.lat:g} s, overhead {args.overhead:g} s/step")
    print(f"# comm hides behind compute from L/P >= n* = {n_star:.3g} rows ({n_bw:.3g} without latency)")
    head = ["P", "L", "L/P", "compute s/step", "comm s/step", "hidden?", "total s", "memory/rank GiB"]
    head += ["bwd total s", "bwd hidden?"] if args.backward else []
    fmt = "{:>5} {:>9} {:>8} {:>15} {:>12} {:>8} {:>10} {:>16}" + " {:>12} {:>12}" * args.backward
    print(fmt.format(*head))
    for L0 in (16384, 65536, 10**6, 10**7):
        for P in (2**i for i in range(11)):
            L = max(2 * P, round(L0 / (2 * P)) * 2 * P)       # a multiple of 2P: every layout's shards are equal
            c = config(args, L=L, P=P)
            kind = steps(c)[1 if P > 1 else 0]                # a steady step (step 0 at P = 1)
            total, _, hidden = ring_time(c)
            row = [P, L, L // P, f"{kind[1]:.3g}", f"{kind[3]:.3g}", "yes" if hidden else "no", f"{total:.4g}",
                   f"{memory_bytes(c, args.backward)[1] / GIB:.4g}"]
            if args.backward:
                bt, _, bh = ring_time(c, True)
                row += [f"{bt:.4g}", "yes" if bh else "no"]
            print(fmt.format(*row))


def load_runs(paths):
    """Every JSON object in the files (`sattn ring --json` prints one; concatenated output is fine; - = stdin)."""
    runs, dec = [], json.JSONDecoder()
    for p in paths:
        text, i = (sys.stdin.read() if p == "-" else open(p).read()), 0
        while text[i:].strip():
            obj, i = dec.raw_decode(text, len(text) - len(text[i:].lstrip()))
            runs.append(obj)
    return runs


def measured(args):
    shape = lambda r: (r["causal"], r["batch"], r["heads"], r["kv_heads"], r["dim"], r["dtype"],
                       r.get("threads_per_rank", 1))
    groups = {}  # repeated runs of one configuration: medians of their times, the largest peak RSS
    for r in load_runs(args.measured):
        groups.setdefault((r["ranks"], r["layout"], r["L"]) + shape(r), []).append(r)
    runs = []
    for g in groups.values():
        runs.append({**g[-1], "runs": len(g), "peak_rss_bytes": [max(max(r["peak_rss_bytes"]) for r in g)]})
        for f in ("forward_seconds", "backward_seconds", "forward_exposed_wait_seconds", "exchange_alone_seconds"):
            if any(f in r for r in g):
                runs[-1][f] = statistics.median(r[f] for r in g if f in r)
    ones = {(r["L"],) + shape(r): r for r in runs if r["ranks"] == 1}
    bws = [(r["ranks"] - 1) * r["batch"] * r["kv_heads"] * -(-r["L"] // r["ranks"]) * 2 * r["dim"]
           * (2 if r["dtype"] == "bf16" else 4) / r["exchange_alone_seconds"]    # (P-1) blocks per pass
           for r in runs if r["ranks"] > 1 and r["exchange_alone_seconds"] > 0]
    bw = statistics.median(bws) / 1e9 if bws else args.bw
    print(f"# BW {bw:.4g} GB/s (median of {len(bws)} exchange-alone passes), lat {args.lat:g} s, {args.cores} cores;"
          " memory in MiB: model, `sattn ring`'s model, max peak RSS; d: minus the smallest L's (same P, layout)")
    print(f"{'P':>4} {'L':>8} {'layout':>10} {'causal':>6} {'runs':>4} {'R GF/s':>7} {'model s':>9} {'meas s':>9} {'ratio':>6}"
          f" {'wait mod':>9} {'wait meas':>9} {'bwd mod':>9} {'bwd meas':>9} {'mem':>8} {'cli':>8} {'RSS':>8}"
          f" {'d mem':>8} {'d RSS':>8}")
    base = {}
    for r in sorted(runs, key=lambda r: (r["causal"], r["layout"], r["ranks"], r["L"])):
        one = ones.get((r["L"],) + shape(r))
        if one is None:
            print(f"{r['ranks']:>4} {r['L']:>8} {r['layout']:>10}: no P=1 run with the same L and shape for R")
            continue
        c = config(args, L=r["L"], P=r["ranks"], B=r["batch"], H=r["heads"], Hkv=r["kv_heads"], D=r["dim"],
                   bytes=2 if r["dtype"] == "bf16" else 4, causal=r["causal"], layout=r["layout"], bw=bw * 1e9)
        c1 = config(args, **{**vars(c), "P": 1, "layout": "contiguous", "rate": 1.0, "rate_bwd": 1.0,
                             "overhead": 0.0, "lat": 0.0})  # its ring_time = the whole problem's flops
        share = min(1.0, args.cores / (r["ranks"] * r.get("threads_per_rank", 1)))  # oversubscribed cores
        c.rate = ring_time(c1)[0] / one["forward_seconds"] * share
        bwd = f"{'-':>9} {'-':>9}"
        if "backward_seconds" in r and "backward_seconds" in one:
            c.rate_bwd = ring_time(c1, True)[0] / one["backward_seconds"] * share
            bwd = f"{ring_time(c, True)[0]:>9.4g} {r['backward_seconds']:>9.4g}"
        t, wait, _ = ring_time(c)
        mem, rss = memory_bytes(c, "backward_seconds" in r)[1] / 2**20, max(r["peak_rss_bytes"]) / 2**20
        b = base.setdefault((r["ranks"], r["layout"]) + shape(r), (mem, rss))
        print(f"{r['ranks']:>4} {r['L']:>8} {r['layout']:>10} {str(r['causal']):>6} {r['runs']:>4} {c.rate / 1e9:>7.3g} {t:>9.4g} "
              f"{r['forward_seconds']:>9.4g} {r['forward_seconds'] / t:>6.3g} {wait:>9.3g} "
              f"{r.get('forward_exposed_wait_seconds', float('nan')):>9.3g} {bwd} {mem:>8.1f} "
              f"{r['memory_model_bytes'] / 2**20:>8.1f} {rss:>8.1f} {mem - b[0]:>8.1f} {rss - b[1]:>8.1f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--L", type=int, default=65536, help="global sequence length (default 65536)")
    p.add_argument("--P", type=int, default=4, help="ranks (default 4)")
    p.add_argument("--batch", type=int, default=1, help="B (default 1)")
    p.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=0, help="key/value heads Hkv (default: --heads)")
    p.add_argument("--dim", type=int, default=64, help="head dimension D = Dv (default 64)")
    p.add_argument("--bytes", type=int, default=4, choices=(2, 4), help="bytes per element: 4 fp32, 2 bf16")
    p.add_argument("--causal", action="store_true", help="causal (top-left on the global positions)")
    p.add_argument("--layout", default="contiguous", choices=("contiguous", "zigzag", "striped"))
    p.add_argument("--backward", action="store_true", help="also model the backward (and its memory)")
    p.add_argument("--rate", type=float, default=45.0,
                   help="R: fused forward GFLOP/s per rank (default 45; measure with `sattn ring` at P=1)")
    p.add_argument("--rate-bwd", type=float, default=0.0,
                   help="backward GFLOP/s per rank, counting 2.5x the forward's flops (default 0.8·R)")
    p.add_argument("--bw", type=float, default=25.0, help="network bandwidth per link, GB/s (default 25: InfiniBand)")
    p.add_argument("--lat", type=float, default=2e-6, help="network latency, s (default 2e-6)")
    p.add_argument("--overhead", type=float, default=1e-5, help="fixed cost per ring step, s (default 1e-5)")
    p.add_argument("--no-overlap", action="store_true",
                   help="communication not overlapped (MPI below MPI_THREAD_SERIALIZED: no progress thread)")
    p.add_argument("--table", action="store_true", help="grid of P = 1..1024 and L = 16K, 64K, 1M, 10M")
    p.add_argument("--measured", nargs="+", metavar="JSON", help="`sattn ring --json` outputs: model vs measured")
    p.add_argument("--cores", type=int, default=os.cpu_count(), help="cores of the measured machine (--measured)")
    args = p.parse_args()
    if args.measured:
        measured(args)
    elif args.table:
        table(args)
    else:
        describe(args, config(args))


if __name__ == "__main__":
    main()
