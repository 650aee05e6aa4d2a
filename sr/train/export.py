"""Export a SattnSR checkpoint to safetensors (written by hand: numpy + json) and an architecture JSON.

  python3 sr/train/export.py --ckpt sr/checkpoints/x2_last.pt --out sr/weights/sattn_sr_x2
writes sattn_sr_x2.safetensors and sattn_sr_x2.json.

safetensors layout: u64 little-endian N, then N bytes of JSON header (space-padded to a multiple of 8), then the
raw little-endian tensor data. Header: {"<key>": {"dtype": "F32", "shape": [...], "data_offsets": [b, e]}, ...,
"__metadata__": {"format": "pt", "sattn_sr_config": "<architecture JSON>", "step": "<training step>"}} with
offsets relative to the start of the data. Keys are PyTorch state_dict names (see sr/README.md, "Weights"):
conv weights [out, in/groups, kh, kw], linear weights [out, in] (y = x W^T + b), LayerNorm weight/bias [C].
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

_DT = {np.dtype("float32"): "F32", np.dtype("float64"): "F64", np.dtype("int64"): "I64", np.dtype("int32"): "I32"}
_NP = {v: k for k, v in _DT.items()}


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: np.ndarray}; metadata: {str: str}. Tensors are stored in sorted key order."""
    header, blobs, off = {}, [], 0
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k])
        a = a.astype(a.dtype.newbyteorder("<"), copy=False)
        b = a.tobytes()
        header[k] = {"dtype": _DT[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((-len(hj)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(np.uint64(len(hj)).astype("<u8").tobytes())
        f.write(hj)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path):
    """-> ({name: np.ndarray}, metadata dict)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int(np.frombuffer(raw[:8], dtype="<u8")[0])
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    base = 8 + n
    out = {}
    for k, h in header.items():
        b, e = h["data_offsets"]
        out[k] = np.frombuffer(raw[base + b:base + e], dtype=_NP[h["dtype"]]).reshape(h["shape"]).copy()
    return out, meta


def architecture(cfg, step):
    """The description the C++ side builds the model from (see sr/README.md for the op-by-op semantics)."""
    return dict(
        format="sattn-sr-v1", scale=cfg["scale"], dim=cfg["dim"], heads=cfg["heads"], mlp_ratio=cfg["mlp_ratio"],
        router_norm=False, threshold=cfg["threshold"], keep_ratio=cfg["keep_ratio"],
        head_dim=cfg["dim"] // cfg["heads"], mlp_hidden=int(cfg["dim"] * cfg["mlp_ratio"]),
        groups=cfg["groups"], shifted="odd block index inside each group (1, 3, ...), shift = window // 2",
        pad_multiple=max(max(g) for g in cfg["groups"]), pad_mode="reflect (bottom/right), output cropped",
        layer_norm_eps=1e-5, gelu="exact (erf)", router_std_eps=1e-6, route_threshold=cfg["threshold"],
        route_rule="sparse: window routed iff sigmoid(router([mean, std])) > route_threshold; dense: all",
        input_range="RGB float in [0, 1], NCHW", output="clamp to [0, 1], *255, round half away from zero",
        training_step=step)


def fold_router_norm(sd):
    """Fold each block's inference-time BatchNorm1d(1) on the router logit into the router linear:
    z = gamma * (w.f + b - mean) / sqrt(var + eps) + beta  ->  w' = k w, b' = k (b - mean) + beta, k = gamma/sqrt(var+eps).
    Input/Output: {name: float64 np.ndarray}; the router_norm.* entries are removed."""
    out = dict(sd)
    for key in [k for k in sd if k.endswith(".router_norm.weight")]:
        pre = key[: -len("router_norm.weight")]
        k = sd[key] / np.sqrt(sd[pre + "router_norm.running_var"] + 1e-5)    # BatchNorm1d eps 1e-5
        out[pre + "router.weight"] = sd[pre + "router.weight"] * k[:, None]
        out[pre + "router.bias"] = k * (sd[pre + "router.bias"] - sd[pre + "router_norm.running_mean"]) \
            + sd[pre + "router_norm.bias"]
        for suffix in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            out.pop(pre + "router_norm." + suffix, None)
    return out


def export(ckpt_path, out_prefix, trained=False):
    """trained=True exports the trained weights ("model") even when the checkpoint also holds EMA ones."""
    import torch
    from evaluate import shipped_weights
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    weights = ck["model"] if trained else shipped_weights(ck)
    sd = fold_router_norm({k: v.detach().double().numpy() for k, v in weights.items()})
    tensors = {k: v.astype(np.float32) for k, v in sd.items()}
    arch = architecture(ck["config"], ck.get("step", -1))
    write_safetensors(out_prefix + ".safetensors", tensors,
                      dict(format="pt", sattn_sr_config=json.dumps(arch), step=str(ck.get("step", -1))))
    with open(out_prefix + ".json", "w") as f:
        json.dump(dict(arch, tensors={k: list(v.shape) for k, v in sorted(tensors.items())}), f, indent=1)
    return out_prefix + ".safetensors", sum(v.size for v in tensors.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True, help="output prefix, e.g. sr/weights/sattn_sr_x2")
    ap.add_argument("--trained", action="store_true",
                    help="export the trained weights, not the EMA ones (by default the EMA weights are exported "
                         "when the checkpoint has them)")
    a = ap.parse_args()
    path, n = export(a.ckpt, a.out, a.trained)
    print("wrote %s (%d parameters, %d bytes)" % (path, n, os.path.getsize(path)))


if __name__ == "__main__":
    main()
