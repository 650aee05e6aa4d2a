"""`sattn sr downscale|eval|upscale` against the Python protocol code (sr/train/imresize.py, metrics.py) and the
published bicubic calibration; bad images give clear errors (exit 2, message naming the file)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import sattn
import sr_png

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.environ.get("SATTN_SR_TRAIN_DIR", os.path.join(REPO, "sr", "train"))
CLI = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sattn.__file__)))), "sattn")
TESTDATA = os.path.join(os.path.dirname(REPO), "shared", "data", "sr", "test")

if not os.path.exists(CLI):
    pytest.skip(f"CLI {CLI} not built", allow_module_level=True)

have_py = os.path.exists(os.path.join(TRAIN, "imresize.py")) and os.path.exists(os.path.join(TRAIN, "metrics.py"))
needs_py = pytest.mark.skipif(not have_py, reason=f"{TRAIN}/imresize.py, metrics.py missing: C++ vs Python NOT checked")
if have_py:
    sys.path.insert(0, TRAIN)


def run(*args, ok=True):
    r = subprocess.run([CLI, "sr", *args], capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def synth(h, w, seed, gray=False):
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([128 + 100 * np.sin(xx / 3.0 + yy / 5.0), 128 + 90 * np.cos(yy / 2.5), 60 + 1.5 * xx], -1)
    img += rng.normal(0, 12, img.shape)
    img[h // 3: h // 2, w // 4: w // 2] = 255
    img = np.clip(np.round(img), 0, 255).astype(np.uint8)
    return img[:, :, 0] if gray else img


@needs_py
@pytest.mark.parametrize("h,w,s,gray", [(37, 50, 2, False), (48, 33, 3, False), (64, 61, 4, False), (30, 26, 2, True)])
def test_downscale_matches_python(tmp_path, h, w, s, gray):
    import imresize as R
    img = synth(h, w, h * w, gray)
    inp, out = str(tmp_path / "hr.png"), str(tmp_path / "lr.png")
    sr_png.write_png(inp, img)
    run("downscale", inp, out, "--scale", str(s))
    rgb = np.repeat(img[:, :, None], 3, 2) if gray else img
    ref = R.downscale(R.mod_crop(rgb, s), s)
    got = sr_png.read_png(out)
    assert got.shape == ref.shape
    d = np.abs(got.astype(int) - ref.astype(int))
    assert d.max() == 0, f"{(d > 0).sum()} of {d.size} values differ from imresize.py (max {d.max()})"


@needs_py
def test_eval_matches_python(tmp_path):
    """Per-image bicubic PSNR/SSIM of `sr eval` equal metrics.py on imresize.py's images (mod-crop, LR, up)."""
    import imresize as R
    import metrics as M
    data = tmp_path / "set"
    data.mkdir()
    imgs = {"a.png": synth(45, 57, 1), "b.png": synth(40, 40, 2), "c.png": synth(33, 48, 3, gray=True)}
    for n, im in imgs.items():
        sr_png.write_png(str(data / n), im)
    for s in (2, 3):
        res = json.loads(run("eval", "--scale", str(s), "--data", str(data), "--attention", "bicubic", "--json").stdout)
        assert [r["name"] for r in res["images"]] == sorted(imgs)
        for r in res["images"]:
            im = imgs[r["name"]]
            im = np.repeat(im[:, :, None], 3, 2) if im.ndim == 2 else im
            hr = R.mod_crop(im, s)
            sr = R.upscale_bicubic(R.downscale(hr, s), s)
            assert r["bicubic"]["psnr"] == pytest.approx(M.psnr_y(sr, hr, s), abs=1e-9)
            assert r["bicubic"]["ssim"] == pytest.approx(M.ssim_y(sr, hr, s), abs=1e-9)
        mean = np.mean([r["bicubic"]["psnr"] for r in res["images"]])
        assert res["mean"]["bicubic"]["psnr"] == pytest.approx(mean, abs=1e-12)


# Bicubic rows: (set, scale) -> (ours with sr/train/evaluate.py, BasicSR protocol; published MATLAB value).
CALIBRATION = {("Set5", 2): (33.682, 33.66), ("Set5", 4): (28.431, 28.42),
               ("B100", 2): (29.565, 29.56), ("B100", 4): (25.963, 25.96)}


@pytest.mark.parametrize("dataset,scale", sorted(CALIBRATION))
def test_bicubic_calibration(dataset, scale):
    folder = os.path.join(TESTDATA, dataset)
    if not os.path.isdir(folder):
        pytest.skip(f"{folder} missing: bicubic calibration NOT checked")
    res = json.loads(run("eval", "--scale", str(scale), "--data", folder, "--attention", "bicubic", "--json").stdout)
    psnr = res["mean"]["bicubic"]["psnr"]
    ours, published = CALIBRATION[(dataset, scale)]
    assert abs(psnr - ours) < 0.0015, f"{dataset} x{scale}: {psnr:.4f} vs evaluate.py {ours}"
    # the published tables round Y to integers (MATLAB rgb2ycbcr on uint8); unrounded Y is at most +0.025 dB
    assert abs(psnr - published) <= 0.025, f"{dataset} x{scale}: {psnr:.4f} vs published {published}"


def test_bad_images_give_clear_errors(tmp_path):
    good = str(tmp_path / "good.png")
    sr_png.write_png(good, synth(20, 20, 5))
    raw = open(good, "rb").read()
    cases = {"trunc.png": raw[: len(raw) // 2], "garbage.png": b"hello world" * 50, "empty.jpg": b"",
             "trunc.jpg": b"\xff\xd8\xff\xe0" + b"\x00" * 200}
    for name, data in cases.items():
        p = str(tmp_path / name)
        open(p, "wb").write(data)
        r = run("downscale", p, str(tmp_path / "o.png"), "--scale", "2", ok=False)
        assert r.returncode == 2, (name, r.stderr)
        assert p in r.stderr and "error" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "Aborted" not in r.stderr
    r = run("downscale", str(tmp_path / "missing.png"), str(tmp_path / "o.png"), "--scale", "2", ok=False)
    assert r.returncode == 2 and "cannot open" in r.stderr
    r = run("upscale", good, str(tmp_path / "o.png"), "--scale", "2", "--weights", str(tmp_path / "nope.st"), ok=False)
    assert r.returncode == 2 and "nope.st" in r.stderr
    r = run("upscale", good, str(tmp_path / "o.png"), "--scale", "2", "--attention", "fast", ok=False)
    assert r.returncode == 2 and "attention" in r.stderr


def jpeg_header_declaring(width, height):
    """A baseline JPEG header (SOI, DQT, SOF0 with this size, DHT, SOS) and a few bytes of scan: the start of a
    decompression bomb."""
    dqt = b"\xff\xdb\x00\x43\x00" + bytes([1] * 64)
    sof = b"\xff\xc0\x00\x0b\x08" + height.to_bytes(2, "big") + width.to_bytes(2, "big") + b"\x01\x01\x11\x00"
    dht = b"\xff\xc4\x00\x14\x00" + bytes([1] + [0] * 15) + b"\x00"             # one DC code: category 0
    sos = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"
    return b"\xff\xd8" + dqt + sof + dht + sos + b"\x00" * 16 + b"\xff\xd9"


def test_output_pixel_limit_refuses_bombs_from_the_header(tmp_path):
    """--max-output-pixels (default 2^27) counts the output, width x height x scale^2, and refuses from the header,
    before the weights are loaded or any pixel is decoded: a file declaring 11000 x 11000 fails at once."""
    bomb = tmp_path / "bomb.jpg"
    bomb.write_bytes(jpeg_header_declaring(11000, 11000))
    out = str(tmp_path / "o.png")
    for s in ("2", "4"):
        r = run("upscale", str(bomb), out, "--scale", s, ok=False)
        assert r.returncode == 2, r.stderr
        n = 121000000 * int(s) ** 2
        assert f"'{bomb}': 11000x11000 at x{s} = {n} output pixels is over the limit of 134217728" in r.stderr
        assert r.stderr.count("\n") == 1 and not os.path.exists(out)
    small = str(tmp_path / "small.png")
    sr_png.write_png(small, synth(20, 30, 9))                     # x2: 2400 output pixels
    r = run("upscale", small, out, "--scale", "2", "--max-output-pixels", "2399", ok=False)
    assert r.returncode == 2 and "over the limit of 2399 output pixels" in r.stderr, r.stderr
    r = run("upscale", small, out, "--scale", "2", "--max-output-pixels", "0", ok=False)
    assert r.returncode == 2 and "--max-output-pixels: expected >= 1, given 0" in r.stderr, r.stderr
    # eval: the outputs are HR-sized, so the HR image is what the limit counts
    data = tmp_path / "hr"
    data.mkdir()
    sr_png.write_png(str(data / "a.png"), synth(20, 30, 10))
    r = run("eval", "--scale", "2", "--data", str(data), "--attention", "bicubic", "--max-output-pixels", "599",
            ok=False)
    assert r.returncode == 2 and "30x20 = 600 pixels is over the limit of 599" in r.stderr, r.stderr
    run("eval", "--scale", "2", "--data", str(data), "--attention", "bicubic", "--max-output-pixels", "600")


def test_upscale_repeat_reports_median_and_same_output(tmp_path):
    """`sr upscale --repeat N` (benchmarking) runs the model N times in one process: same PNG as one run, the summary
    says it, and the model's CPU and wall seconds are reported; --repeat 0 is refused."""
    weights = os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors")
    if not os.path.exists(weights):
        pytest.skip("sr/weights/sattn_sr_x2.safetensors missing")
    inp = str(tmp_path / "in.png")
    sr_png.write_png(inp, synth(40, 36, 7))
    outs = []
    for rep in ("1", "3"):
        out = str(tmp_path / f"o{rep}.png")
        r = run("upscale", inp, out, "--scale", "2", "--weights", weights, "--threads", "2", "--repeat", rep)
        assert ("median of 3 runs" in r.stderr) == (rep == "3"), r.stderr
        assert ", cpu " in r.stderr, r.stderr
        outs.append(sr_png.read_png(out))
    assert np.array_equal(outs[0], outs[1])
    r = run("upscale", inp, str(tmp_path / "o.png"), "--scale", "2", "--weights", weights, "--repeat", "0", ok=False)
    assert r.returncode == 2 and "--repeat" in r.stderr


def test_upscale_self_ensemble_flips_commute_and_bad_combinations(tmp_path):
    """`sr upscale --self-ensemble` averages the 8 flips/transposes: the result for a horizontally flipped input is
    the flipped result (up to +-1 from the different summation order), it differs from the plain run, and options
    that read or write per-window routing are refused."""
    weights = os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors")
    if not os.path.exists(weights):
        pytest.skip("sr/weights/sattn_sr_x2.safetensors missing")
    img = synth(40, 36, 9)
    a, b = str(tmp_path / "a.png"), str(tmp_path / "b.png")
    sr_png.write_png(a, img)
    sr_png.write_png(b, np.ascontiguousarray(img[:, ::-1]))
    outs = {}
    for name, src, extra in (("a", a, ["--self-ensemble"]), ("b", b, ["--self-ensemble"]), ("plain", a, [])):
        out = str(tmp_path / f"o_{name}.png")
        r = run("upscale", src, out, "--scale", "2", "--weights", weights, "--threads", "2", *extra)
        assert ("self-ensemble" in r.stderr) == bool(extra), r.stderr
        outs[name] = sr_png.read_png(out).astype(np.int16)
    assert outs["a"].shape == (80, 72, 3)
    assert np.abs(outs["a"] - outs["b"][:, ::-1]).max() <= 1
    assert np.abs(outs["a"] - outs["plain"]).max() > 0
    r = run("upscale", a, str(tmp_path / "o.png"), "--scale", "2", "--weights", weights, "--self-ensemble",
            "--routing-out", str(tmp_path / "r.npy"), ok=False)
    assert r.returncode == 2 and "--self-ensemble" in r.stderr


def test_upscale_profile_lists_every_stage_and_the_routing(tmp_path):
    """`sr upscale --profile` prints one row per stage of the model (3 per block, a tail per group, the convs outside
    the blocks, other), the attention rows' routed windows add up to the summary's count, and the PNG is the same."""
    weights = os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors")
    if not os.path.exists(weights):
        pytest.skip("sr/weights/sattn_sr_x2.safetensors missing")
    inp = str(tmp_path / "in.png")
    sr_png.write_png(inp, synth(40, 36, 8))
    base = ["upscale", inp, "--scale", "2", "--weights", weights, "--threads", "2"]
    plain = run(*base[:2], str(tmp_path / "a.png"), *base[2:])
    assert "profile" not in plain.stdout
    r = run(*base[:2], str(tmp_path / "b.png"), *base[2:], "--profile", "--repeat", "3")
    assert np.array_equal(sr_png.read_png(str(tmp_path / "a.png")), sr_png.read_png(str(tmp_path / "b.png")))
    lines = r.stdout.splitlines()
    assert "median of 3 runs" in lines[0], r.stdout
    rows = [l for l in lines if l.startswith(("head", "block", "group", "body", "upsample", "other"))]
    blocks = sum(1 for l in rows if l.startswith("block") and ": conv path" in l)
    assert blocks >= 2 and len(rows) == 1 + 3 * blocks + sum(l.startswith("group") for l in rows) + 3, r.stdout
    routed = [l.split()[-2].split("/") for l in rows if "attention windows" in l]
    assert len(routed) == blocks
    summary = r.stderr.split("windows routed ")[1].split(",")[0].split("/")
    assert [sum(int(a) for a, _ in routed), sum(int(b) for _, b in routed)] == [int(summary[0]), int(summary[1])]
    assert lines[-1].startswith("by kind:") and "attention windows" in lines[-1], r.stdout


def test_precision_bf16_stays_within_a_gray_level_and_bad_values_are_named(tmp_path):
    """`sr upscale --precision bf16` (the model's matrix products on bf16 operands) gives the PNG of
    SrModel.upscale(float32_precision='bf16'), within one gray level of fp32; the summary says so; other values fail
    naming the option. Where the CPU has no bf16 products it is the fp32 output."""
    import sattn.sr as S
    weights = os.path.join(REPO, "sr", "weights", "sattn_sr_x2.safetensors")
    if not os.path.exists(weights):
        pytest.skip("sr/weights/sattn_sr_x2.safetensors missing")
    inp = str(tmp_path / "in.png")
    img = synth(40, 36, 11)
    sr_png.write_png(inp, img)
    outs = {}
    for p in ("fp32", "bf16"):
        out = str(tmp_path / f"o_{p}.png")
        r = run("upscale", inp, out, "--scale", "2", "--weights", weights, "--threads", "2", "--precision", p)
        assert ("(bf16 products)" in r.stderr) == (p == "bf16"), r.stderr
        outs[p] = sr_png.read_png(out)
    assert np.abs(outs["bf16"].astype(int) - outs["fp32"].astype(int)).max() <= 1
    model = S.SrModel(weights)
    assert np.array_equal(model.upscale(img, num_threads=2, float32_precision="bf16"), outs["bf16"])
    assert np.array_equal(model.upscale(img, num_threads=2), outs["fp32"])
    r = run("upscale", inp, str(tmp_path / "o.png"), "--scale", "2", "--weights", weights, "--precision", "fp16",
            ok=False)
    assert r.returncode == 2 and "--precision: expected fp32 or bf16, given 'fp16'" in r.stderr, r.stderr
    with pytest.raises(ValueError, match="float32_precision"):
        model.upscale(img, float32_precision="fp16")
    hr = tmp_path / "hr"
    hr.mkdir()
    sr_png.write_png(str(hr / "a.png"), synth(48, 40, 12))
    r = run("eval", "--scale", "2", "--data", str(hr), "--weights", weights, "--threads", "2", "--precision", "bf16")
    assert "model rows: the matrix products on bf16 operands" in r.stdout, r.stdout
    js = json.loads(run("eval", "--scale", "2", "--data", str(hr), "--weights", weights, "--json").stdout)
    assert js["precision"] == "fp32"
    r = run("eval", "--scale", "2", "--data", str(hr), "--precision", "half", ok=False)
    assert r.returncode == 2 and "--precision: expected fp32 or bf16, given 'half'" in r.stderr, r.stderr
