"""SattnSR model invariants the C++ port relies on: window partition order, shift mask, routing switch."""
import os
import sys

import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "sr", "train"))
import model as MD  # noqa: E402


def test_window_partition_order_and_roundtrip():
    b, h, w, c, ws = 2, 8, 12, 3, 4
    x = torch.arange(b * h * w * c, dtype=torch.float32).view(b, h, w, c)
    xw = MD.window_partition(x, ws)
    assert xw.shape == (b * (h // ws) * (w // ws), ws * ws, c)
    # window n = (batch, wy, wx) row-major; token l = (ty, tx) row-major inside it
    for n in range(xw.shape[0]):
        bi, r = divmod(n, (h // ws) * (w // ws))
        wy, wx = divmod(r, w // ws)
        for l in (0, 5, ws * ws - 1):
            ty, tx = divmod(l, ws)
            assert torch.equal(xw[n, l], x[bi, wy * ws + ty, wx * ws + tx])
    assert torch.equal(MD.window_reverse(xw, ws, b, h, w), x)


def test_shift_mask_matches_region_labels():
    h, w, ws = 16, 24, 8
    s = ws // 2
    mask = MD.shift_mask(h, w, ws)
    # brute force: after rolling by -s, token (y, x) came from an image region; tokens from regions that are not
    # adjacent in the original image (wrapped around) are masked
    def region(y, x):
        ry = 0 if y < h - ws else (1 if y < h - s else 2)
        rx = 0 if x < w - ws else (1 if x < w - s else 2)
        return ry * 3 + rx
    nwx = w // ws
    for n in range(mask.shape[0]):
        wy, wx = divmod(n, nwx)
        toks = [(wy * ws + l // ws, wx * ws + l % ws) for l in range(ws * ws)]
        for i in range(0, ws * ws, 7):
            for j in range(0, ws * ws, 5):
                same = region(*toks[i]) == region(*toks[j])
                assert (mask[n, i, j] == 0) == same and (same or mask[n, i, j] == float("-inf"))


def _small_model(scale=2):
    cfg = MD.default_config(scale)
    cfg.update(dim=16, heads=2, groups=[[8, 8], [16, 16]])
    torch.manual_seed(0)
    m = MD.SattnSR(cfg).eval()
    for blk in m.modules():
        if isinstance(blk, MD.WindowBlock):
            torch.nn.init.normal_(blk.router.weight, std=0.5)
            torch.nn.init.normal_(blk.router.bias, std=0.5)
            blk.router_norm.running_mean.fill_(0.3)      # non-trivial inference-time norm (folded at export)
            blk.router_norm.running_var.fill_(2.0)
            blk.router_norm.bias.data.fill_(-0.2)
    return m


@pytest.mark.parametrize("scale", [2, 4])
def test_sparse_equals_dense_when_every_window_is_routed(scale):
    m = _small_model(scale)
    x = torch.rand(1, 3, 21, 35)           # not a multiple of the window: reflect padding + crop
    with torch.no_grad():
        dense = m(x, "dense")
        assert dense.shape == (1, 3, 21 * scale, 35 * scale)
        for blk in m.modules():
            if isinstance(blk, MD.WindowBlock):
                blk.threshold = -1.0       # g > -1 always: every window routed
        stats = []
        sparse = m(x, "sparse", stats)
    assert all(bool(k.all()) for _, k in stats)
    assert torch.allclose(dense, sparse, atol=1e-6)


def test_unrouted_windows_skip_the_branch():
    m = _small_model()
    x = torch.rand(1, 3, 32, 32)
    with torch.no_grad():
        stats = []
        sparse = m(x, "sparse", stats)
        kept = torch.cat([k for _, k in stats])
        assert 0 < int(kept.sum()) < kept.numel()   # a real mix of routed and skipped windows
        for blk in m.modules():
            if isinstance(blk, MD.WindowBlock):
                blk.threshold = 2.0                # nothing routed
        none = m(x, "sparse")
        for blk in m.modules():
            if isinstance(blk, MD.WindowBlock):
                blk.branch = lambda xw, mask: torch.zeros_like(xw)
        zero_branch = m(x, "dense")
    assert torch.allclose(none, zero_branch, atol=1e-6)
    assert not torch.allclose(sparse, none, atol=1e-4)


def test_safetensors_export_roundtrip(tmp_path):
    import json
    import numpy as np
    import export as EX
    m = _small_model(4)
    ck = tmp_path / "ck.pt"
    torch.save(dict(model=m.state_dict(), config=m.cfg, step=7), str(ck))
    path, n = EX.export(str(ck), str(tmp_path / "w"))
    with open(path, "rb") as f:
        raw = f.read()
    hlen = int(np.frombuffer(raw[:8], dtype="<u8")[0])
    assert (8 + hlen) % 8 == 0
    header = json.loads(raw[8:8 + hlen])
    assert json.loads(header["__metadata__"]["sattn_sr_config"])["scale"] == 4
    tensors, meta = EX.read_safetensors(path)
    sd = {k: v for k, v in m.state_dict().items() if ".router" not in k}
    assert set(tensors) - set(sd) == {k for k in tensors if ".router." in k}
    assert not any("router_norm" in k for k in tensors)
    ends = sorted(h["data_offsets"] for k, h in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:])) and 8 + hlen + ends[-1][1] == len(raw)
    for k, v in sd.items():
        assert np.array_equal(tensors[k], v.numpy()), k
    with open(str(tmp_path / "w.json")) as f:
        m2 = MD.SattnSR(json.loads(f.read()))   # builds from the exported JSON alone
    # the exported model (router_norm folded into the router, i.e. identity norm) computes the same function
    m2.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    m2.eval()
    x = torch.rand(1, 3, 24, 40)
    with torch.no_grad():
        s1, s2 = [], []
        assert torch.allclose(m(x, "dense", s1), m2(x, "dense", s2), atol=1e-5)
    assert all(torch.allclose(a[0], b[0], atol=1e-5) for a, b in zip(s1, s2))


def test_export_takes_the_ema_weights_unless_told_trained(tmp_path):
    import export as EX
    trained, ema = _small_model(2), _small_model(2)
    with torch.no_grad():
        for p in ema.parameters():
            p.add_(0.5)
    ck = tmp_path / "ck.pt"
    torch.save(dict(model=trained.state_dict(), model_ema=ema.state_dict(), config=trained.cfg, step=3), str(ck))
    key = "head.weight"
    for flag, src in ((False, ema), (True, trained)):
        path, _ = EX.export(str(ck), str(tmp_path / ("t" if flag else "e")), trained=flag)
        tensors, _ = EX.read_safetensors(path)
        assert torch.equal(torch.from_numpy(tensors[key]), src.state_dict()[key]), flag
    # a checkpoint marked ship="trained" ships (exports, evaluates) its trained weights by default
    torch.save(dict(model=trained.state_dict(), model_ema=ema.state_dict(), config=trained.cfg, step=3,
                    ship="trained"), str(ck))
    tensors, _ = EX.read_safetensors(EX.export(str(ck), str(tmp_path / "s"))[0])
    assert torch.equal(torch.from_numpy(tensors[key]), trained.state_dict()[key])
