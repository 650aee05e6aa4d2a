"""The one SIMD target table: sattn.simd_targets() / set_simd_target(), and every target this CPU runs checked in a
subprocess started with SATTN_SIMD=<target>: the fused kernel, the sparse tiles, TopK's scoring and the SR model's
nn kernels each report that target and match their oracles with the usual tolerances (fp64 references: 2e-5 on
outputs, 1e-4 on gradients; the PyTorch SR model: 1e-4 on the float output)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import sattn
from test_sparse import reference, rel

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "sr", "train")
WEIGHTS = os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors")
COMPONENTS = ("fused", "sparse_tiles", "topk", "nn")
BF16_TARGETS = ("amx", "avx512bf16")  # the bf16 products of the fused kernel, the sparse tiles and nn
# the components with builds for both bf16 targets (top-k runs its avx512 build under them)
TILE_COMPONENTS = ("fused", "sparse_tiles", "nn")


def test_report_and_selection():
    t = sattn.simd_targets()
    assert set(t) == {"selected", "available", *COMPONENTS}
    assert t["available"][-1] == "portable" and t["selected"] in t["available"]
    before = t["selected"]
    try:
        for name in t["available"]:
            sattn.set_simd_target(name)
            now = sattn.simd_targets()
            # amx and avx512bf16 differ in the fused kernel, the sparse tiles and nn; top-k runs its avx512 build
            # under both
            assert now["selected"] == name, now
            for c in COMPONENTS:
                bf16_build = name if c in TILE_COMPONENTS else "avx512"
                assert now[c] == (bf16_build if name in BF16_TARGETS else name), (c, now)
        sattn.set_simd_target("base")  # an older name of the portable target
        assert sattn.simd_targets()["selected"] == "portable"
        sattn.set_simd_target("auto")
        assert sattn.simd_targets()["selected"] == t["available"][0]
        with pytest.raises(sattn.InvalidArgumentError, match="expected one of auto, amx, avx512bf16, avx512, avx2, sse4, portable"):
            sattn.set_simd_target("avx1024")
        missing = [n for n in ("amx", "avx512bf16", "avx512", "avx2", "sse4") if n not in t["available"]]
        for name in missing:
            with pytest.raises(sattn.UnsupportedError, match="this CPU does not run"):
                sattn.set_simd_target(name)
    finally:
        sattn.set_simd_target(before)


CHILD = r"""
import json, sys
import numpy as np
import sattn
out = {}
inputs = np.load(sys.argv[5])  # the parent's problem (fixture `problems`)
q, k, v, dout = inputs["q"], inputs["k"], inputs["v"], inputs["dout"]
o, lse = sattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True,
                                            kernel="fused", strict=True)
dq, dk, dv = sattn.scaled_dot_product_attention_backward(dout, q, k, v, o, lse, is_causal=True, enable_gqa=True,
                                                         kernel="fused", strict=True)[:3]
out.update(fused_out=o, fused_lse=lse, fused_dq=dq, fused_dk=dk, fused_dv=dv)
p = sattn.SlidingWindow(8, 5)
o, lse = sattn.sparse_attention(q, k, v, p, enable_gqa=True, return_lse=True)
dq, dk, dv, _ = sattn.sparse_attention_backward(dout, q, k, v, o, lse, p, enable_gqa=True)
out.update(sparse_out=o, sparse_dq=dq, sparse_dk=dk, sparse_dv=dv)
o, idx = sattn.sparse_attention(q, k, v, sattn.TopK(6), enable_gqa=True, return_indices=True)
out.update(topk_out=o, topk_idx=idx)
if sys.argv[2]:
    m = sattn.sr.SrModel(sys.argv[2])
    x = np.load(sys.argv[3])
    out["sr_dense"] = m.forward(x, attention="dense")
    out["sr_sparse"] = m.forward(x, routing_in=np.load(sys.argv[4]))
np.savez(sys.argv[1], **out)
print(json.dumps(sattn.simd_targets()))
"""


@pytest.fixture(scope="module")
def problems(tmp_path_factory):
    """One GQA problem (Hq 4, Hkv 2, Lq 77, Lk 90, D 24), saved for the subprocesses, and its fp64 references."""
    rng = np.random.default_rng(7)
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 77, 90, 24
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    dout = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    rep = lambda x: np.repeat(x, Hq // Hkv, axis=1)  # noqa: E731  (GQA: key head h // 2)
    causal = np.tril(np.ones((Lq, Lk), bool))[None]
    window = sattn.SlidingWindow(8, 5).dense_mask(Lq, Lk, heads=Hq)
    path = tmp_path_factory.mktemp("simd_inputs") / "inputs.npz"
    np.savez(path, q=q, k=k, v=v, dout=dout)
    return dict(q=q, k=k, v=v, dout=dout, rep=rep, path=str(path), fused=reference(q, rep(k), rep(v), causal, dout),
                sparse=reference(q, rep(k), rep(v), window, dout))


@pytest.fixture(scope="module")
def sr_oracle(tmp_path_factory):
    """The PyTorch SR model on the trained weights: its dense output, and its sparse output with its own routing."""
    try:
        import torch
    except ImportError:
        return None
    if not (os.path.exists(WEIGHTS) and os.path.exists(os.path.join(TRAIN, "model.py"))):
        return None
    sys.path.insert(0, TRAIN)
    try:
        import export as EX
        import model as MD
    finally:
        sys.path.remove(TRAIN)
    tensors, meta = EX.read_safetensors(WEIGHTS)
    arch = json.loads(meta["sattn_sr_config"])
    m = MD.SattnSR(dict(scale=arch["scale"], dim=arch["dim"], heads=arch["heads"],
                        mlp_ratio=arch["mlp_hidden"] / arch["dim"], groups=arch["groups"],
                        threshold=arch.get("route_threshold", 0.5), keep_ratio=arch.get("keep_ratio", 0.5),
                        router_norm=False))
    m.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    m.eval()
    rng = np.random.default_rng(3)
    yy, xx = np.mgrid[0:40, 0:56]
    x = np.stack([0.5 + 0.3 * np.sin(xx / 5), 0.4 + 0.3 * np.cos(yy / 4), (xx + yy) / 120], 0)
    x = np.clip(x + rng.normal(0, 0.05, x.shape), 0, 1).astype(np.float32)
    with torch.no_grad():
        dense = m(torch.from_numpy(x)[None], mode="dense")[0].numpy()
        stats = []
        sparse = m(torch.from_numpy(x)[None], mode="sparse", stats=stats)[0].numpy()
    routing = np.concatenate([kept.numpy().astype(np.uint8) for _, kept in stats])
    tmp = tmp_path_factory.mktemp("simd_sr")
    np.save(tmp / "x.npy", x)
    np.save(tmp / "routing.npy", routing)
    return dict(x=str(tmp / "x.npy"), routing=str(tmp / "routing.npy"), dense=dense, sparse=sparse)


@pytest.mark.parametrize("target", ["amx", "avx512bf16", "avx512", "avx2", "sse4", "portable"])
def test_every_component_runs_the_target_set_by_SATTN_SIMD(target, problems, sr_oracle, tmp_path):
    if target not in sattn.simd_targets()["available"]:
        pytest.skip(f"this CPU does not run {target}: its builds are NOT checked here")
    env = dict(os.environ, SATTN_SIMD=target)
    npz = tmp_path / "out.npz"
    sr_args = [WEIGHTS, sr_oracle["x"], sr_oracle["routing"]] if sr_oracle else ["", "", ""]
    r = subprocess.run([sys.executable, "-c", CHILD, str(npz), *sr_args, problems["path"]], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    # amx, avx512bf16: the fused kernel, the sparse tiles and nn have a build of each, top-k its avx512 one
    assert report["selected"] == target, report
    for c in COMPONENTS:
        bf16_build = target if c in TILE_COMPONENTS else "avx512"
        assert report[c] == (bf16_build if target in BF16_TARGETS else target), (c, report)
    got = np.load(npz)
    p = problems
    for name in ("fused", "sparse"):
        r_out, r_lse, r_dq, r_dk, r_dv, _ = p[name]
        assert rel(got[f"{name}_out"], r_out) <= 2e-5, name
        # GQA: the key gradients of the two query heads of a key head add up.
        r_dk = r_dk.reshape(r_dk.shape[0], -1, 2, *r_dk.shape[2:]).sum(2)
        r_dv = r_dv.reshape(r_dv.shape[0], -1, 2, *r_dv.shape[2:]).sum(2)
        for g, want in ((f"{name}_dq", r_dq), (f"{name}_dk", r_dk), (f"{name}_dv", r_dv)):
            assert rel(got[g], want) <= 1e-4, g
    r_lse = p["fused"][1]
    assert rel(got["fused_lse"], r_lse) <= 2e-5
    # TopK(6): a valid top-6 of the fp64 scores, and attention over the selection.
    q, k, v, rep = p["q"], p["k"], p["v"], p["rep"]
    s = q.astype(np.float64) @ rep(k).astype(np.float64).transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    idx = got["topk_idx"]
    sel = np.zeros(s.shape, bool)
    np.put_along_axis(sel, idx, True, axis=-1)
    assert (sel.sum(-1) == 6).all()
    chosen_min = np.where(sel, s, np.inf).min(-1)
    others_max = np.where(sel, -np.inf, s).max(-1)
    assert (chosen_min >= others_max - 1e-5).all()
    assert rel(got["topk_out"], reference(q, rep(k), rep(v), sel, p["dout"])[0]) <= 2e-5
    if sr_oracle is None:
        pytest.skip("PyTorch, sr/train/model.py or the SR weights missing: the SR model's target NOT checked")
    assert np.abs(got["sr_dense"] - sr_oracle["dense"]).max() <= 1e-4
    assert np.abs(got["sr_sparse"] - sr_oracle["sparse"]).max() <= 1e-4


def test_bad_SATTN_SIMD_is_an_error_naming_the_variable_and_SATTN_SPARSE_ISA_says_it_is_gone():
    code = ("import numpy as np, sattn\n"
            "q = np.ones((1, 1, 4, 8), np.float32)\n"
            "try:\n"
            "    sattn.scaled_dot_product_attention(q, q, q)\n"
            "except sattn.InvalidArgumentError as e:\n"
            "    print('error:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, SATTN_SIMD="avx1024"),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "error: SATTN_SIMD: expected one of auto, amx, avx512bf16, avx512, avx2, sse4, portable; got 'avx1024'" in r.stdout
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, SATTN_SPARSE_ISA="avx2"),
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("SATTN_SPARSE_ISA is no longer read") == 1, r.stderr
    assert "SATTN_SIMD" in r.stderr


def test_explain_kernels_lists_every_target_used_or_why_not():
    rng = np.random.default_rng(4)
    q32 = rng.standard_normal((1, 2, 512, 16)).astype(np.float32)  # keys long enough for the bf16 products to pay
    short = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)  # D·Lk 128: the float32 products
    names = ["amx", "avx512bf16", "avx512", "avx2", "sse4", "portable"]
    avail = sattn.simd_targets()["available"]
    before = sattn.simd_targets()["selected"]

    def report(q, **kw):
        simd = sattn.explain_kernels(q, q, q, **kw).simd
        assert [name for name, _ in simd] == names
        return dict(simd)

    try:
        sattn.set_simd_target("auto")
        r = report(q32)
        widest = avail[0]
        for name in names:
            if name not in avail:  # amx: or the kernel refused the tile state
                assert r[name].startswith("this CPU lacks") or (name == "amx" and r[name].startswith("Linux refused")), (
                    name, r[name])
        used = "avx512" if widest in BF16_TARGETS else widest
        assert r[used] is None and sum(why is None for why in r.values()) == 1, r
        if widest in BF16_TARGETS:
            assert r[widest] == ("float32 inputs take the bf16 products only with float32_precision='bf16'" +
                                 (" or 'high'" if widest == "amx" else ""))
            assert report(q32, float32_precision="bf16")[widest] is None
            high_why = "float32 inputs under float32_precision='high' take bf16 products only on AMX"
            if widest == "amx":  # float32 as two bf16 each on the tiles, forward and backward
                assert report(q32, float32_precision="high")["amx"] is None
                assert report(q32, float32_precision="high", backward=True)["amx"] is None
                assert report(short, float32_precision="high")["amx"].startswith(
                    "keys too short for the bf16 products to pay (D·Lk = 128, at most")
            else:
                assert report(q32, float32_precision="high")[widest].startswith(high_why)
                assert report(q32, float32_precision="high", backward=True)[widest].startswith(high_why)
            r16 = report(q32.astype(np.float16))
            if widest == "amx":  # float16 as two bf16 each on the tiles
                assert r16["amx"] is None and r16["avx512bf16"] == "the wider 'amx' build runs", r16
                assert report(q32, float32_precision="bf16")["avx512bf16"] == "the wider 'amx' build runs"
            else:
                assert r16[widest].startswith("float16 inputs take bf16 products only in the forward on AMX"), r16
            assert report(q32.astype(np.float16), backward=True)[widest].startswith(
                "float16 inputs take bf16 products only in the forward on AMX")
            assert report(q32, float32_precision="bf16", backward=True)[widest] is None
            rs = report(short, float32_precision="bf16")
            assert rs[widest].startswith("keys too short for the bf16 products to pay (D·Lk = 128, below 2048"), rs
            assert rs["avx512"] is None, rs
            if widest == "amx":
                rs = report(short.astype(np.float16))
                assert rs["amx"].startswith("keys too short for the bf16 products to pay (D·Lk = 128, at most"), rs
        narrower = names[names.index(used) + 1]
        if narrower in avail:
            assert r[narrower] == f"the wider '{used}' build runs"
        sattn.set_simd_target("portable")
        r = report(q32)
        assert r["portable"] is None
        for name in avail[:-1]:
            assert r[name] == "wider than the selected target 'portable' (SATTN_SIMD or set_simd_target chose it)"
        assert all(why.startswith("float64 inputs run the reference kernel") for why in
                   report(q32.astype(np.float64)).values())
    finally:
        sattn.set_simd_target(before)
