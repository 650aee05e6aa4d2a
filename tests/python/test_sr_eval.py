"""SR evaluation: MATLAB-compatible bicubic resize (hand-computed weights) and the bicubic calibration on Set5."""
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "sr", "train"))
import imresize as R  # noqa: E402
import metrics as M  # noqa: E402

SET5 = os.path.join(REPO, "..", "shared", "data", "sr", "test", "Set5")


def test_downscale_weights_by_hand():
    # s = 1/2, x = 1: u = 2*1 - 0.5 = 1.5, kernel widened to 8 taps, weight 0.5*cubic(0.5*d) for d = u - idx,
    # idx = -2..5: 0.5*d = 1.75, 1.25, 0.75, 0.25 (and mirrored) -> cubic = -0.0234375, -0.0703125, 0.2265625,
    # 0.8671875; sum over 8 taps = 2, so normalised weights are cubic/2. Symmetric padding of [a b c d]:
    # idx -2,-1,0 -> c,b,a and idx 5 -> d, so out1 = 0.546875a + 0.3984375b + 0.1015625c - 0.046875d.
    m = R.resize_matrix(4, 2, 0.5)
    np.testing.assert_allclose(m[0], [0.546875, 0.3984375, 0.1015625, -0.046875], rtol=0, atol=1e-15)
    np.testing.assert_allclose(m[1], m[0][::-1], rtol=0, atol=1e-15)   # mirror symmetry of the 2nd output
    # 10*0.546875 + 20*0.3984375 + 40*0.1015625 - 80*0.046875 = 13.75 -> uint8 14 (one rounding at the end)
    img = np.array([[10, 20, 40, 80]] * 4, dtype=np.uint8)
    out = R.imresize(img, 0.5)
    assert out.dtype == np.uint8 and out.shape == (2, 2)
    assert out[0, 0] == 14 and out[1, 0] == 14


def test_upscale_weights_by_hand():
    # s = 2 (no widening), x = 1: u = 0.75, idx -2..3, d = 2.75 1.75 0.75 -0.25 -1.25 -2.25,
    # cubic = 0, -0.0234375, 0.2265625, 0.8671875, -0.0703125, 0; idx -1 -> b, 0 -> a: out1 = 1.09375a - 0.09375b.
    m = R.resize_matrix(4, 8, 2.0)
    np.testing.assert_allclose(m[0], [1.09375, -0.09375, 0, 0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(m.sum(axis=1), np.ones(8), rtol=0, atol=1e-12)


def test_height_first_and_rounding_once():
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, size=(12, 9, 3)).astype(np.uint8)
    out = R.imresize(img, 1 / 3)
    mh, mw = R.resize_matrix(12, 4, 1 / 3), R.resize_matrix(9, 3, 1 / 3)
    ref = np.einsum("oh,hwc,pw->opc", mh, img.astype(np.float64), mw)
    np.testing.assert_array_equal(out, np.clip(np.floor(ref + 0.5), 0, 255).astype(np.uint8))


def test_y_channel_formula():
    px = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]]], dtype=np.uint8)
    np.testing.assert_allclose(M.rgb_to_y(px)[0], [16 + 65.481, 16 + 128.553, 16 + 24.966, 235.0], atol=1e-12)


@pytest.mark.skipif(not os.path.isdir(SET5), reason="../shared/data/sr/test/Set5 not present")
@pytest.mark.parametrize("scale,published", [(2, 33.66), (4, 28.42)])
def test_bicubic_calibration_set5(scale, published):
    import imgio
    rounded, basicsr = [], []
    for p in imgio.list_images(SET5):
        hr = R.mod_crop(imgio.read_image(p), scale)
        up = R.upscale_bicubic(R.downscale(hr, scale), scale)
        assert up.shape == hr.shape
        rounded.append(M.psnr_y(up, hr, scale, round_y=True))
        basicsr.append(M.psnr_y(up, hr, scale))
    # the published table was made in MATLAB (Y rounded to uint8 by rgb2ycbcr): reproduce it within 0.02 dB
    assert abs(np.mean(rounded) - published) <= 0.02, np.mean(rounded)
    # the BasicSR protocol (unrounded Y) differs from it only by the Y rounding
    assert abs(np.mean(basicsr) - np.mean(rounded)) < 0.05


SET14 = os.path.join(REPO, "..", "shared", "data", "sr", "test", "Set14")


@pytest.mark.skipif(not os.path.isdir(SET14), reason="../shared/data/sr/test/Set14 not present")
def test_pillow_fallback_reads_the_pixels_of_sattns_decoder(tmp_path):
    """Where sattn is not built (a GPU machine), imgio decodes with Pillow: the same RGB pixels as sattn's libpng
    decoder (grayscale bridge.png replicated alike), and lossless WebP copies of the training set read back equal."""
    pytest.importorskip("PIL", reason="Pillow is not installed (python/requirements-dev.txt pins it)")
    from PIL import Image
    import imgio
    import sattn.sr as sr
    names = ["baboon.png", "bridge.png", "comic.png"]
    for name in names:
        path = os.path.join(SET14, name)
        ref = sr.read_image(path)
        got = imgio._pillow_read(path)
        assert got.dtype == np.uint8 and got.shape == ref.shape, name
        np.testing.assert_array_equal(got, ref, err_msg=name)
        Image.fromarray(ref).save(tmp_path / (name[:-4] + ".webp"), lossless=True, quality=100, method=0)
    assert [os.path.basename(p) for p in imgio.list_images(tmp_path)] == [n[:-4] + ".webp" for n in names]
    for name, p in zip(names, imgio.list_images(tmp_path)):
        np.testing.assert_array_equal(imgio.read_image(p), sr.read_image(os.path.join(SET14, name)), err_msg=name)
