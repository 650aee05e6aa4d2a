#!/usr/bin/env python3
"""Speed of two builds of the `sattn` command, alternated in one run: the median per-round ratio new/old of

  - `sattn bench` fp32 forward and backward, L 4096, D 64, H 8, full and causal, 1 and 2 threads;
  - `sattn sparse-bench` SlidingWindow(256, 256) and BlockTopK(64, 4) at L 65536 (H 2, D 64, 1 thread),
    forward and backward;
  - `sattn sr upscale` x2 of a 256 x 256 crop, sparse attention, 2 threads (wall time of the command).

Each round runs every measurement with both binaries, the order alternating between rounds (old first in even
rounds). Ratios below 1 mean the new build is faster. Run on an idle machine:

  PYTHONPATH=build/python build/venv/bin/python bench/compare_builds.py --old OLD/sattn --new build/sattn \
      --rounds 7 [--image IMG] [--weights sr/weights/sattn_sr_x2.safetensors]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPARSE = ["SlidingWindow(256,256)", "BlockTopK(64,4)"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"compare_builds: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def dense(binary):
    out = run([binary, "bench", "--lens", "4096", "--dims", "64", "--threads", "1,2", "--reps", "3", "--sgemm-n", "0",
               "--json"])
    t = {}
    for row in json.loads(out):
        if "pass" in row:
            t[f"bench {row['pass']} {row['mask']} {row['threads']}t"] = row["median_ms"]
    return t


def sparse(binary):
    out = run([binary, "sparse-bench", "--pattern", *SPARSE, "--L", "65536", "--threads", "1", "--H", "2", "--D", "64",
               "--B", "1", "--reps", "3", "--backward"])
    t = {}
    for line in out.splitlines():
        f = line.split()
        if f and f[0] in SPARSE:
            t[f"sparse {f[0]} fwd"] = float(f[3])
            t[f"sparse {f[0]} bwd"] = float(f[4])
    return t


def upscale(binary, image, weights, tmp):
    cmd = [binary, "sr", "upscale", image, os.path.join(tmp, "out.png"), "--scale", "2", "--attention", "sparse",
           "--threads", "2"] + (["--weights", weights] if weights else [])
    t0 = time.perf_counter()
    run(cmd)
    return {"sr upscale x2 256x256 sparse 2t": 1e3 * (time.perf_counter() - t0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the baseline build's sattn")
    ap.add_argument("--new", required=True, help="the build under test's sattn")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--image", help="a PNG whose top-left 256 x 256 is upscaled (default: Set14's first image)")
    ap.add_argument("--weights", default=os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors"))
    ap.add_argument("--skip", default="", help="comma-separated groups to skip: bench, sparse, sr")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    import sattn.sr as sr
    with tempfile.TemporaryDirectory() as tmp:
        image = a.image or os.path.join(REPO, "..", "shared", "data", "sr", "test", "Set14",
                                        sorted(os.listdir(os.path.join(REPO, "..", "shared", "data", "sr", "test",
                                                                       "Set14")))[0])
        crop = os.path.join(tmp, "crop.png")
        sr.write_png(crop, sr.read_image(image)[:256, :256])
        times = {"old": {}, "new": {}}
        for r in range(a.rounds):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for which in order:
                b = a.old if which == "old" else a.new
                got = {}
                if "bench" not in skip:
                    got.update(dense(b))
                if "sparse" not in skip:
                    got.update(sparse(b))
                if "sr" not in skip:
                    got.update(upscale(b, crop, a.weights, tmp))
                for k, v in got.items():
                    times[which].setdefault(k, []).append(v)
            print(f"# round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    print(f"| measurement | old ms (median) | new ms (median) | new/old per round (median) | worst round |")
    print("|---|---|---|---|---|")
    for k in times["old"]:
        old, new = times["old"][k], times["new"][k]
        ratios = [n / o for o, n in zip(old, new)]
        print(f"| {k} | {statistics.median(old):.2f} | {statistics.median(new):.2f} | "
              f"{statistics.median(ratios):.3f} | {max(ratios):.3f} |")


if __name__ == "__main__":
    main()
