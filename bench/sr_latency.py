"""Latency of SattnSR on one image: the C++ CLI (`sattn sr upscale`, model time as it reports) against the same
weights run by PyTorch (sr/train/model.py) with the same thread count; medians of --repeat runs.

  python3 bench/sr_latency.py --image IN.png --weights sr/weights/sattn_sr_x2.safetensors [--cli build/sattn]
         [--threads 1 2] [--repeat 5]
Pause other CPU jobs first (timings on a busy machine are meaningless).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--cli", default=os.path.join(REPO, "build", "sattn"))
    ap.add_argument("--train-dir", default=os.path.join(REPO, "sr", "train"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    sys.path.insert(0, a.train_dir)
    sys.path.insert(0, os.path.join(REPO, "tests", "python"))
    import numpy as np
    import torch
    import export as EX
    import model as MD
    import sr_png

    tensors, meta = EX.read_safetensors(a.weights)
    arch = json.loads(meta["sattn_sr_config"])
    cfg = dict(scale=arch["scale"], dim=arch["dim"], heads=arch["heads"], mlp_ratio=arch["mlp_hidden"] / arch["dim"],
               groups=arch["groups"], threshold=arch.get("route_threshold", 0.5),
               keep_ratio=arch.get("keep_ratio", 0.5), router_norm=False)
    m = MD.SattnSR(cfg)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    m.eval()
    img = sr_png.read_png(a.image)[:, :, :3]
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float() / 255
    print(f"image {a.image} {img.shape[1]}x{img.shape[0]}, x{cfg['scale']}, torch {torch.__version__}")
    out = "/tmp/sr_latency_%d.png" % os.getpid()
    for t in a.threads:
        for mode in ("dense", "sparse"):
            cpp = []
            for _ in range(a.repeat):
                r = subprocess.run([a.cli, "sr", "upscale", a.image, out, "--scale", str(cfg["scale"]), "--attention",
                                    mode, "--weights", a.weights, "--threads", str(t), "--tile", "0"],
                                   capture_output=True, text=True, check=True)
                cpp.append(float(re.search(r", ([0-9.e+-]+) s$", r.stderr.strip()).group(1)))  # model time only
            torch.set_num_threads(t)
            py = []
            with torch.no_grad():
                for _ in range(a.repeat):
                    t0 = time.perf_counter()
                    y = m(x, mode=mode)[0].clamp(0, 1)
                    py.append(time.perf_counter() - t0)
            c, p = statistics.median(cpp), statistics.median(py)
            print(f"threads {t} {mode:6s}: C++ {c:.3f} s  PyTorch {p:.3f} s  (PyTorch / C++ = {p / c:.2f})")
    if os.path.exists(out):
        os.remove(out)


if __name__ == "__main__":
    main()
