"""BasicSR-compatible evaluation of bicubic and of a SattnSR checkpoint (dense and sparse routing).

HR is cropped to a multiple of the scale; LR = MATLAB bicubic downscale (imresize.py); grayscale is replicated to
RGB; the model output is clamped to [0, 1] and rounded to uint8; PSNR/SSIM on the unrounded float Y channel
(metrics.py) with `scale` border pixels cropped; mean over images.

  python3 sr/train/evaluate.py --scale 2 --data ../shared/data/sr/test/Set5 [--ckpt sr/checkpoints/x2_last.pt]
         [--modes bicubic,dense,sparse] [--json out.json]
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import imgio  # noqa: E402
import imresize as R  # noqa: E402
import metrics as M  # noqa: E402


def load_pairs(folder, scale):
    """[(name, hr_u8, lr_u8)] with HR mod-cropped and LR from the MATLAB bicubic downscale."""
    out = []
    for p in imgio.list_images(folder):
        hr = R.mod_crop(imgio.read_image(p), scale)
        out.append((os.path.basename(p), hr, R.downscale(hr, scale)))
    return out


@torch.no_grad()
def run_model(model, lr_u8, mode, stats=None):
    """uint8 [h, w, 3] -> uint8 [s*h, s*w, 3]: clamp to [0, 1], scale by 255 and round (half away from zero)."""
    dev = next(model.parameters()).device                  # the model's device (train.py --device)
    x = torch.from_numpy(lr_u8).permute(2, 0, 1)[None].float().to(dev) / 255.0
    y = model(x, mode=mode, stats=stats)[0].clamp(0, 1).permute(1, 2, 0).double().cpu().numpy()
    return np.floor(y * 255.0 + 0.5).astype(np.uint8)


def evaluate(pairs, scale, mode, model=None):
    """mode: 'bicubic' | 'dense' | 'sparse'. Returns dict(psnr, ssim, per_image, kept_fraction, seconds)."""
    per, kept_n, kept_d, t0 = [], 0, 0, time.time()
    for name, hr, lr in pairs:
        if mode == "bicubic":
            sr = R.upscale_bicubic(lr, scale)
        else:
            stats = []
            sr = run_model(model, lr, mode, stats)
            for _, k in stats:
                kept_n += int(k.sum())
                kept_d += k.numel()
        per.append(dict(name=name, psnr=M.psnr_y(sr, hr, scale), ssim=M.ssim_y(sr, hr, scale)))
    return dict(psnr=float(np.mean([p["psnr"] for p in per])), ssim=float(np.mean([p["ssim"] for p in per])),
                per_image=per, kept_fraction=(kept_n / kept_d if kept_d else None), seconds=time.time() - t0)


def shipped_weights(ck):
    """The weights a checkpoint ships: the EMA ones when training kept them (train.py --ema), else the trained; a
    checkpoint marked ck["ship"] = "trained" (set by hand when the trained weights were the ones exported, as for
    the committed x2 checkpoint, sr/checkpoints/x2_last.pt) ships the trained ones."""
    if ck.get("ship") == "trained":
        return ck["model"]
    return ck["model_ema"] if "model_ema" in ck else ck["model"]


def load_model(ckpt_path):
    import model as MD
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    m = MD.SattnSR(ck["config"])
    m.load_state_dict(shipped_weights(ck))
    m.eval()
    return m, ck


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, required=True)
    ap.add_argument("--data", nargs="+", required=True, help="folders of HR images")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--modes", default=None, help="comma list of bicubic,dense,sparse")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--per-image", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    modes = a.modes.split(",") if a.modes else (["bicubic", "dense", "sparse"] if a.ckpt else ["bicubic"])
    model = None
    if any(m != "bicubic" for m in modes):
        if not a.ckpt:
            sys.exit("evaluate.py: --ckpt is required for modes dense/sparse")
        model, ck = load_model(a.ckpt)
        if ck["config"]["scale"] != a.scale:
            sys.exit("evaluate.py: --scale %d but checkpoint is x%d" % (a.scale, ck["config"]["scale"]))
        print("checkpoint %s: step %d" % (a.ckpt, ck.get("step", -1)))
    results = {}
    for folder in a.data:
        pairs = load_pairs(folder, a.scale)
        ds = os.path.basename(os.path.normpath(folder))
        for mode in modes:
            r = evaluate(pairs, a.scale, mode, model)
            results["%s/x%d/%s" % (ds, a.scale, mode)] = r
            kf = "" if r["kept_fraction"] is None else "  windows routed %.3f" % r["kept_fraction"]
            print("%-6s x%d %-7s PSNR %.4f  SSIM %.4f  (%.1f s)%s" % (ds, a.scale, mode, r["psnr"], r["ssim"],
                                                                      r["seconds"], kf))
            if a.per_image:
                for p in r["per_image"]:
                    print("    %-14s %.4f %.4f" % (p["name"], p["psnr"], p["ssim"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
