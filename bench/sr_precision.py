"""`sattn sr upscale --precision bf16` against fp32 on one image: speed (alternating processes) and, with --psnr,
the PSNR-Y of `sattn sr eval` on whole test sets in both precisions.

  build/venv/bin/python bench/sr_precision.py [--image IN.png] [--crop 256] [--scales 2 4] [--threads 1 2]
         [--modes sparse dense] [--rounds 7] [--repeat 5] [--cli build/sattn] [--psnr Set5 B100]
         [--weights W.safetensors]

Speed: per scale (the committed weights sr/weights/sattn_sr_x{S}.safetensors, or --weights with one --scales),
thread count and attention mode,
--rounds rounds of one `sattn sr upscale --repeat N` process per precision, the two precisions' order alternating
between rounds; each process reports the median model time of its N runs. Printed: the medians over the rounds and
the median of the per-round ratios fp32 / bf16 (> 1: bf16 faster), with the smallest and largest round. Defaults:
a 256x256 crop (top-left) of ../shared/data/sr/test/Set14/baboon.png, as bench/sr_latency.py. Run it on an idle
machine (pause a training run first).

PSNR (--psnr SET ...): `sattn sr eval --scale S --data ../shared/data/sr/test/SET --threads 2 --json --precision P`
for P = fp32 and bf16, and the difference of the mean PSNR-Y (dense and sparse) against the 0.02 dB bound.
On a CPU without bf16 products (AVX512-BF16 or AMX-BF16) both precisions run the same float32 code.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "..", "shared", "data", "sr", "test")
DEFAULT_IMAGE = os.path.join(DATA, "Set14", "baboon.png")
PRECISIONS = ("fp32", "bf16")


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def crop_image(path, size, out):
    sys.path.insert(0, os.path.join(REPO, "tests", "python"))  # sr_png: a PNG reader/writer on zlib
    import numpy as np
    import sr_png
    img = sr_png.read_png(path)
    if img.ndim == 2:
        img = img[:, :, None]
    img = np.repeat(img, 3, axis=2) if img.shape[2] == 1 else img[:, :, :3]
    if size:
        if img.shape[0] < size or img.shape[1] < size:
            sys.exit(f"{path} is smaller than --crop {size}")
        img = img[:size, :size]
    sr_png.write_png(out, np.ascontiguousarray(img))
    return img.shape[1], img.shape[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default=DEFAULT_IMAGE)
    ap.add_argument("--crop", type=int, default=256, help="top-left crop size in LR pixels (0 = whole image)")
    ap.add_argument("--scales", type=int, nargs="+", default=[2])
    ap.add_argument("--threads", type=int, nargs="+", default=[2])
    ap.add_argument("--modes", nargs="+", default=["sparse", "dense"], choices=["sparse", "dense"])
    ap.add_argument("--rounds", type=int, default=7, help="timing rounds (0: PSNR only)")
    ap.add_argument("--repeat", type=int, default=5, help="model runs per process (the process reports the median)")
    ap.add_argument("--cli", default=os.path.join(REPO, "build", "sattn"))
    ap.add_argument("--psnr", nargs="*", default=[], metavar="SET", help="test sets for the PSNR check (e.g. Set5 B100)")
    ap.add_argument("--weights", help="weights of the one scale in --scales (default: the committed ones)")
    a = ap.parse_args()
    if a.weights and len(a.scales) != 1:
        ap.error("--weights needs exactly one scale in --scales")

    def weights_of(s):
        return a.weights or os.path.join(REPO, "sr", "weights", f"sattn_sr_x{s}.safetensors")
    if a.rounds < 0 or a.repeat < 1:
        ap.error("--rounds must be >= 0 (0: no timing) and --repeat >= 1")
    tmp = tempfile.mkdtemp(prefix="sr_precision_")
    inp, out = os.path.join(tmp, "in.png"), os.path.join(tmp, "out.png")
    w, h = crop_image(a.image, a.crop, inp)
    shown = a.weights or "sr/weights/sattn_sr_x{S}.safetensors"
    timing = f", {a.rounds} rounds, medians of {a.repeat} runs per process" if a.rounds else ""
    print(f"image {a.image} crop {w}x{h}, weights {shown}{timing}, cores {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if a.rounds:
        print("| scale | threads | mode | fp32 s | bf16 s | fp32 / bf16 (median of rounds) | range |")
        print("|---|---|---|---|---|---|---|")
    for s in a.scales if a.rounds else []:
        weights = weights_of(s)
        for t in a.threads:
            for mode in a.modes:
                times = {p: [] for p in PRECISIONS}
                ratios = []
                for rnd in range(a.rounds):
                    order = PRECISIONS if rnd % 2 == 0 else tuple(reversed(PRECISIONS))
                    for p in order:
                        err = run([a.cli, "sr", "upscale", inp, out, "--scale", str(s), "--attention", mode,
                                   "--weights", weights, "--threads", str(t), "--tile", "0", "--repeat",
                                   str(a.repeat), "--precision", p]).stderr
                        m = re.search(r"cpu ([0-9.e+-]+) s, ([0-9.e+-]+) s$", err.strip())  # model time
                        if not m:
                            sys.exit(f"unexpected output of sattn sr upscale: {err}")
                        times[p].append(float(m.group(2)))
                    ratios.append(times["fp32"][-1] / times["bf16"][-1])
                print(f"| x{s} | {t} | {mode} | {statistics.median(times['fp32']):.4f} | "
                      f"{statistics.median(times['bf16']):.4f} | {statistics.median(ratios):.3f} | "
                      f"{min(ratios):.3f}-{max(ratios):.3f} |", flush=True)
    for s in a.scales if a.psnr else []:
        weights = weights_of(s)
        for ds in a.psnr:
            res = {}
            for p in PRECISIONS:
                js = json.loads(run([a.cli, "sr", "eval", "--scale", str(s), "--data", os.path.join(DATA, ds),
                                     "--weights", weights, "--threads", "2", "--json", "--precision", p]).stdout)
                res[p] = js["mean"]
            for mode in ("dense", "sparse"):
                d = res["bf16"][mode]["psnr"] - res["fp32"][mode]["psnr"]
                print(f"PSNR-Y x{s} {ds} {mode}: fp32 {res['fp32'][mode]['psnr']:.4f} dB, bf16 "
                      f"{res['bf16'][mode]['psnr']:.4f} dB, difference {d:+.4f} dB "
                      f"({'PASS' if abs(d) <= 0.02 else 'FAIL'}: within 0.02 dB)", flush=True)


if __name__ == "__main__":
    main()
