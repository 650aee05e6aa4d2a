"""sattn.sr (Python): the same pixels as `sattn sr upscale` / `sr downscale`, the same numbers as the protocol's
Python code (sr/train/imresize.py, metrics.py), routing in and out, the stage profile, and clear errors."""
import os
import subprocess
import sys

import numpy as np
import pytest

import sattn
import sattn.sr as sr
import sr_png
from torch_oracle import needs_torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "sr", "train")
CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sattn.__file__)))), "sattn")
WEIGHTS = os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors")
needs_weights = pytest.mark.skipif(not os.path.exists(WEIGHTS), reason="sr/weights/sattn_sr_x2.safetensors missing")
needs_cli = pytest.mark.skipif(not os.path.exists(CLI), reason=f"CLI {CLI} not built")


def synth(h, w, seed):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(xx / 3.0 + yy / 5.0), 128 + 90 * np.cos(yy / 2.5), 60 + 1.5 * xx], -1)
    img += rng.normal(0, 12, img.shape)
    img[h // 3: h // 2, w // 4: w // 2] = 255          # a flat patch: some windows are not routed
    return np.clip(np.round(img), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def model():
    if not os.path.exists(WEIGHTS):
        pytest.skip("sr/weights/sattn_sr_x2.safetensors missing")
    return sr.SrModel(WEIGHTS)


@needs_weights
def test_model_properties(model):
    assert model.scale == 2 and model.config["scale"] == 2
    assert 0 < model.num_parameters <= 400_000
    assert model.receptive_radius > 0 and model.name.endswith("sattn_sr_x2.safetensors")


@needs_weights
@needs_cli
@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_upscale_is_the_cli_output(tmp_path, model, attention):
    img = synth(40, 52, 1)
    inp, out = str(tmp_path / "in.png"), str(tmp_path / "out.png")
    sr_png.write_png(inp, img)
    subprocess.run([CLI, "sr", "upscale", inp, out, "--scale", "2", "--weights", WEIGHTS, "--attention", attention,
                    "--tile", "0"], check=True, capture_output=True)
    got = model.upscale(img, attention=attention, num_threads=2)
    assert got.dtype == np.uint8 and got.shape == (80, 104, 3)
    assert np.array_equal(got, sr_png.read_png(out))
    # tiled (overlap = receptive radius) gives the same pixels; gray is replicated to RGB
    assert np.array_equal(model.upscale(img, attention=attention, tile=16), got)
    g = img[:, :, 1]
    assert np.array_equal(model.upscale(g, attention=attention), model.upscale(np.repeat(g[:, :, None], 3, 2),
                                                                               attention=attention))


@needs_weights
def test_forward_routing_out_and_in(model):
    x = synth(32, 48, 2).transpose(2, 0, 1).astype(np.float32) / 255
    y, routing, gates = model.forward(x, return_routing=True)
    assert y.shape == (3, 64, 96) and y.dtype == np.float32
    assert routing.dtype == np.uint8 and gates.dtype == np.float32 and routing.shape == gates.shape
    assert np.array_equal(routing, (gates > model.config["route_threshold"]).astype(np.uint8))
    assert 0 < routing.sum() < routing.size, "pick an input that routes some windows only"
    assert np.array_equal(model.forward(x, routing_in=routing), y)            # its own decisions: same output
    dense = model.forward(x, attention="dense")
    assert np.array_equal(model.forward(x, routing_in=np.ones_like(routing, dtype=bool)), dense)
    assert not np.array_equal(dense, y)
    # upscale = forward clamped and rounded (floor(255 v + 0.5))
    u8 = np.floor(np.clip(y, 0, 1).astype(np.float64) * 255 + 0.5).astype(np.uint8).transpose(1, 2, 0)
    img = np.round(x.transpose(1, 2, 0) * 255).astype(np.uint8)
    assert np.array_equal(model.upscale(img), u8)


@needs_weights
def test_profile_stats(model):
    img = synth(48, 40, 3)
    out, st = model.upscale(img, return_stats=True, profile=True)
    assert st["tiles"] == 1 and 0 < st["windows_routed"] <= st["windows_total"]   # tile -1: whole image here
    names = [s["name"] for s in st["stages"]]
    assert names[0] == "head conv" and names[-1] == "other" and "body tail conv + skip" in names
    attn = [s for s in st["stages"] if s["name"].endswith("attention windows")]
    assert len(attn) == sum(len(g) for g in model.config["groups"])
    assert sum(s["windows_routed"] for s in attn) == st["windows_routed"]
    assert sum(s["windows_total"] for s in attn) == st["windows_total"]
    assert all(s["seconds"] >= 0 for s in st["stages"])
    _, plain = model.upscale(img, return_stats=True)
    assert plain["stages"] == [] and np.array_equal(_, out)


def test_protocol_functions_match_the_python_protocol(tmp_path):
    if not os.path.exists(os.path.join(TRAIN, "imresize.py")):
        pytest.skip("sr/train/imresize.py missing")
    sys.path.insert(0, TRAIN)
    import imresize as R
    hr = synth(45, 38, 4)
    lr = sr.downscale(hr, 2)
    assert np.array_equal(lr, R.downscale(R.mod_crop(hr, 2), 2))
    assert np.array_equal(sr.mod_crop(hr, 2), R.mod_crop(hr, 2))
    assert sr.upscale_bicubic(lr, 2).shape == sr.mod_crop(hr, 2).shape
    p = str(tmp_path / "a.png")
    sr.write_png(p, hr)
    assert np.array_equal(sr.read_image(p), hr)


@needs_torch
def test_metrics_match_the_python_protocol():
    """sr/train/metrics.py computes SSIM's Gaussian filter with torch."""
    if not os.path.exists(os.path.join(TRAIN, "metrics.py")):
        pytest.skip("sr/train/metrics.py missing")
    sys.path.insert(0, TRAIN)
    import metrics as M
    hr = synth(45, 38, 4)
    up = sr.upscale_bicubic(sr.downscale(hr, 2), 2)
    ref = sr.mod_crop(hr, 2)
    assert sr.psnr_y(up, ref, 2) == pytest.approx(M.psnr_y(up, ref, 2), abs=1e-9)
    assert sr.ssim_y(up, ref, 2) == pytest.approx(M.ssim_y(up, ref, 2), abs=1e-7)


def test_bad_input_gives_clear_errors(tmp_path):
    with pytest.raises(sattn.Error, match="nope.png"):
        sr.read_image(str(tmp_path / "nope.png"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(sattn.Error, match="bad.png"):
        sr.read_image(str(bad))
    with pytest.raises(sattn.Error, match="model.safetensors"):
        sr.SrModel(str(tmp_path / "model.safetensors"))
    img = synth(20, 20, 5)
    with pytest.raises(TypeError, match="uint8.*float32"):
        sr.downscale(img.astype(np.float32), 2)
    with pytest.raises(ValueError, match=r"\[H, W, 3\].*\[20, 20, 4\]"):
        sr.upscale_bicubic(np.zeros((20, 20, 4), np.uint8), 2)
    with pytest.raises(ValueError, match="scale"):
        sr.downscale(img, 0)
    if os.path.exists(WEIGHTS):
        m = sr.SrModel(WEIGHTS)
        with pytest.raises(ValueError, match="attention"):
            m.upscale(img, attention="fast")
        with pytest.raises(TypeError, match="x: expected float32"):
            m.forward(img.transpose(2, 0, 1).astype(np.float64))
        with pytest.raises(ValueError, match=r"x: expected shape \[3, h, w\]"):
            m.forward(np.zeros((4, 20, 20), np.float32))
        with pytest.raises(ValueError, match="routing decisions: expected"):
            m.forward(np.zeros((3, 20, 20), np.float32), routing_in=np.ones(5, np.uint8))
        with pytest.raises(ValueError, match="tile"):
            m.upscale(img, tile=8)
        with pytest.raises(ValueError, match="tile: expected -1"):
            m.upscale(img, tile=-2)


@needs_weights
def test_max_output_pixels_refuses_before_any_work(model):
    img = synth(20, 30, 6)                                       # x2: 40 x 60 = 2400 output pixels
    assert model.upscale(img, max_output_pixels=2400).shape == (40, 60, 3)
    with pytest.raises(ValueError, match="30x20 input at x2 makes 2400 output pixels, over max_output_pixels = 2399"):
        model.upscale(img, max_output_pixels=2399)
    big = np.zeros((4096, 2049, 3), np.uint8)                   # x2: 33.6 M pixels, under the default 2^27
    with pytest.raises(ValueError, match="over max_output_pixels = 33554432"):
        model.upscale(big, max_output_pixels=2 ** 25)


def test_jpeg_pixels_are_pillows():
    """JPEG is decoded by libjpeg-turbo with its defaults (accurate integer IDCT, fancy upsampling), as Pillow does.
    Debian's python3-pil is there for /usr/bin/python3 (scripts/test's numpy-1 stage); build/venv has no Pillow."""
    Image = pytest.importorskip("PIL.Image", reason="Pillow (Debian python3-pil) not installed for this Python")
    import io
    import tempfile
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "t.jpg")
        for h, w in ((1, 1), (7, 13), (123, 77)):
            for img in (synth(h, w, 7), rng.integers(0, 256, (h, w, 3), dtype=np.uint8)):
                for mode in ("RGB", "L"):
                    for opts in ({"quality": 75}, {"quality": 95, "subsampling": 0},
                                 {"quality": 85, "progressive": True}):
                        buf = io.BytesIO()
                        Image.fromarray(img).convert(mode).save(buf, "JPEG", **opts)
                        with open(p, "wb") as f:
                            f.write(buf.getvalue())
                        want = np.asarray(Image.open(p).convert("RGB"))
                        assert np.array_equal(sr.read_image(p), want), (h, w, mode, opts)
        # and sattn's PNGs are read back by Pillow's own decoder as written
        img = synth(37, 29, 8)
        q = os.path.join(d, "t.png")
        sr.write_png(q, img)
        assert np.array_equal(np.asarray(Image.open(q).convert("RGB")), img)
