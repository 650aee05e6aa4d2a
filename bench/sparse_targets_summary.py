#!/usr/bin/env python3
"""Summarises bench/sparse_targets.sh's logs against the sparse-attention targets (a markdown table per thread count).

Usage: sparse_targets_summary.py BENCH_TXT PEERS_MD [--long 65536] [--mid 16384] [--short 4096]
BENCH_TXT: the concatenated output of `sattn sparse-bench` (columns pattern, L, thr, fwd_ms, bwd_ms, GF/s_all,
GF/s_cmp, cmp/all, sgemm); PEERS_MD: bench/sparse_peers.py --md output.
"""
import argparse
import re


def parse_bench(path):
    rows = {}
    for line in open(path):
        if line.startswith("#") or line.startswith("pattern") or not line.strip():
            continue
        f = line.split()
        if len(f) < 9:
            continue
        try:
            nums = [float(x) for x in f[-8:]]
        except ValueError:
            continue
        name = " ".join(f[:-8])
        L, thr, fwd, bwd, gall, gcmp, ratio, sgemm = nums
        rows[(name, int(L), int(thr))] = dict(fwd=fwd, bwd=bwd, gall=gall, gcmp=gcmp, ratio=ratio, sgemm=sgemm)
    return rows


def parse_peers(path):
    """{(spec, L or None, threads): speed-up} from the markdown tables."""
    out = {}
    th = None
    for line in open(path):
        m = re.match(r"### .*?(\d+) thread", line)
        if m:
            th = int(m.group(1))
            continue
        if line.startswith("| ") and not line.startswith("| pattern") and th is not None:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0].startswith("Neighborhood2D"):
                out[(cells[0], None, th)] = cells[3]
            elif len(cells) > 4:
                out[(cells[0], int(cells[1]), th)] = cells[4]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("peers")
    ap.add_argument("--long", type=int, default=65536)
    ap.add_argument("--mid", type=int, default=16384)
    ap.add_argument("--short", type=int, default=4096)
    a = ap.parse_args()
    rows = parse_bench(a.bench)
    peers = parse_peers(a.peers)
    dense = next((n for (n, _, _) in rows if n.startswith("dense")), "dense (fused kernel)")
    grow_lim = 20.0 * (a.long / a.short) / 16.0
    for th in sorted({t for (_, _, t) in rows}):
        def get(name, L):
            return rows.get((name, L, th))

        print(f"### {th} thread(s)")
        print()
        print("| target | measured | goal | met |")
        print("|---|---|---|---|")

        def line(what, value, goal, ok):
            print(f"| {what} | {value} | {goal} | {'yes' if ok else 'NO'} |")

        sw, d4 = get("SlidingWindow(256, 256)", a.long), get(dense, a.short)
        if sw and d4:
            r = sw["gcmp"] / d4["gcmp"]
            line(f"SlidingWindow(256, 256) L={a.long}: per-computed-score GFLOP/s / dense fused at L={a.short}",
                 f"{sw['gcmp']:.1f} / {d4['gcmp']:.1f} = {r:.2f}", "≥ 0.75", r >= 0.75)
        for name in ["SlidingWindow(256, 256)", "Dilated(64, 4)", "BlockTopK(64, 16)", "linear:elu", "linear:favor+"]:
            lo, hi = get(name, a.short), get(name, a.long)
            if lo and hi:
                g = hi["fwd"] / lo["fwd"]
                gb = (hi["fwd"] + hi["bwd"]) / (lo["fwd"] + lo["bwd"]) if lo["bwd"] > 0 else float("nan")
                line(f"{name}: time growth L={a.short} → {a.long}, forward (fwd+bwd)", f"{g:.1f}× ({gb:.1f}×)",
                     f"≤ {grow_lim:.0f}×", g <= grow_lim and gb <= grow_lim)
        nbig = sorted({n for (n, _, t) in rows if n.startswith("Neighborhood2D(") and n.endswith(", 7)") and t == th},
                      key=lambda n: int(n.split("(")[1].split(",")[0]))
        if nbig:
            n7 = nbig[-1]
            rr = next(v for (n, _, t), v in rows.items() if n == n7 and t == th)
            line(f"{n7} H=4 D=32: computed/allowed", f"{rr['ratio']:.2f}", "≤ 3", rr["ratio"] <= 3)
            sp = peers.get((n7, None, th))
            if sp:
                v = float(sp.rstrip("×"))
                line(f"{n7}: speed-up over PyTorch unfold (forward)", sp, "≥ 10×", v >= 10)
        for (name, L, t), r in sorted(rows.items()):
            # (TopK is not a block-sparse kernel: its allowed pairs are L·k, its work is scoring every key)
            if t != th or r["bwd"] <= 0 or r["gall"] <= 0 or name.startswith(("dense", "TopK(")) or r["sgemm"] <= 0:
                continue
            if L not in (a.short, a.long) and "2D(" not in name:
                continue
            bw = 2.5 * r["gall"] * r["fwd"] / r["bwd"]
            line(f"{name} L={L}: backward GFLOP/s on allowed scores / SGEMM", f"{bw:.1f} / {r['sgemm']:.1f} = "
                 f"{100 * bw / r['sgemm']:.0f}%", "≥ 15%", bw >= 0.15 * r["sgemm"])
        tk = get("TopK(64)", a.short)
        if tk and d4:
            line(f"TopK(64) L={a.short}: forward ms vs dense fused", f"{tk['fwd']:.1f} vs {d4['fwd']:.1f}",
                 "≤ dense", tk["fwd"] <= d4["fwd"])
        btk, dm = get("BlockTopK(64, 16)", a.long), get(dense, a.mid)
        if btk and dm:
            ext = dm["fwd"] * (a.long / a.mid) ** 2
            line(f"BlockTopK(64, 16) L={a.long}: speed-up over dense (dense extrapolated from L={a.mid})",
                 f"{ext:.0f} / {btk['fwd']:.0f} ms = {ext / btk['fwd']:.1f}×", "≥ 10×", ext / btk["fwd"] >= 10)
        for name in ["SlidingWindow(256, 256)", "Dilated(64, 4)", "BlockTopK(64, 16)"]:
            sp = peers.get((name, a.short, th))
            if sp:
                print(f"| {name} L={a.short}: speed-up over PyTorch dense masked (forward) | {sp} | (shown) | – |")
        print()


if __name__ == "__main__":
    main()
