"""Count multiply-accumulates of SattnSR for an input size, dense and sparse (analytic, op by op).

  python3 sr/train/flops.py --scale 2 [--ckpt sr/checkpoints/x2_last.pt] [--size 256] [--data DIR ...]
Sparse counts use each block's routed-window fraction measured with --ckpt on the LR images of --data (default
Set5 + B100). GFLOP = 2 * GMAC; elementwise ops (GELU, softmax, LayerNorm, residual adds) are counted as
1 FLOP per element per op separately and reported apart.
"""
import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import model as MD  # noqa: E402


def count(cfg, h, w, routed=None):
    """MACs and elementwise FLOPs for an LR input h x w. routed: per-block fraction of windows routed (None=dense)."""
    c, s = cfg["dim"], cfg["scale"]
    pm = max(max(g) for g in cfg["groups"])
    H, W = h + (-h) % pm, w + (-w) % pm
    n = H * W
    hid = int(c * cfg["mlp_ratio"])
    mac = 9 * 3 * c * n                      # head conv3x3
    elem = 0
    bi = 0
    for g in cfg["groups"]:
        for ws in g:
            L = ws * ws
            f = 1.0 if routed is None else routed[bi]
            mac += 9 * c * n + c * c * n         # dw3x3 + pw1x1 (every pixel)
            elem += 2 * c * n                    # gelu + residual
            mac += 2 * c * n + 2 * c * n // L    # window mean/var + router linear
            t = f * n                            # routed tokens
            mac += t / L * MD.window_cost(ws, c, hid)       # qkv, proj, fc1, fc2, q k^T and P v per routed window
            elem += t * (2 * 5 * c + 3 * L * cfg["heads"] + hid + 4 * c)  # 2 LN, softmax, gelu, residual/gate
            bi += 1
        mac += 9 * c * n + c * c * n             # group tail dw3x3 + pw1x1
    mac += 9 * c * c * n                         # body tail conv3x3
    mac += 9 * c * 3 * s * s * n                 # upsampler conv3x3
    return mac, elem


def measure_routed(model, lr_images):
    """Per-block fraction of windows routed in sparse mode over the given uint8 LR images (window-weighted)."""
    tot = None
    with torch.no_grad():
        for lr in lr_images:
            x = torch.from_numpy(lr).permute(2, 0, 1)[None].float() / 255.0
            stats = []
            model(x, "sparse", stats)
            k = np.array([[float(kk.sum()), kk.numel()] for _, kk in stats])
            tot = k if tot is None else tot + k
    return tot[:, 0] / tot[:, 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--size", type=int, default=256, help="LR input size (square)")
    ap.add_argument("--data", nargs="*", default=[os.path.join(HERE, "..", "..", "..", "shared", "data", "sr",
                                                               "test", d) for d in ("Set5", "B100")])
    a = ap.parse_args()
    cfg = MD.default_config(a.scale)
    model = None
    if a.ckpt:
        import evaluate as EV
        model, ck = EV.load_model(a.ckpt)
        cfg = ck["config"]
    print("params %d" % MD.param_count(model or MD.SattnSR(cfg)))
    mac, el = count(cfg, a.size, a.size)
    print("dense  %dx%d LR input: %.3f GMAC = %.3f GFLOP (+%.3f GFLOP elementwise)" % (
        a.size, a.size, mac / 1e9, 2 * mac / 1e9, el / 1e9))
    if model is not None:
        import evaluate as EV
        torch.set_num_threads(2)
        lrs = [lr for d in a.data if os.path.isdir(d) for _, _, lr in EV.load_pairs(d, a.scale)]
        routed = measure_routed(model, lrs)
        mac_s, el_s = count(cfg, a.size, a.size, routed)
        print("routed fraction per block (%d images): %s, mean %.3f" % (
            len(lrs), " ".join("%.3f" % r for r in routed), routed.mean()))
        print("sparse %dx%d LR input: %.3f GMAC = %.3f GFLOP (+%.3f GFLOP elementwise); dense/sparse MAC %.2fx" % (
            a.size, a.size, mac_s / 1e9, 2 * mac_s / 1e9, el_s / 1e9, mac / mac_s))
    for f in (0.5, 0.3):
        m2, _ = count(cfg, a.size, a.size, [f] * sum(len(g) for g in cfg["groups"]))
        print("if %.0f%% of windows were routed: %.3f GFLOP (dense/sparse %.2fx)" % (100 * f, 2 * m2 / 1e9, mac / m2))


if __name__ == "__main__":
    main()
