"""Every public function of the numpy API, on arrays of every dtype it takes, under whichever numpy runs the tests:
numpy 2 in build/venv, numpy 1.24 in scripts/test's run with Debian's /usr/bin/python3. A module built against
pybind11 < 2.12 reads numpy 2's dtype structs with numpy 1's layout (item size 0) and refuses or mis-strides every
array; here each call must run, return the documented dtype, and agree with a float64 computation."""
import numpy as np
import pytest

import sattn
import sattn.sr as sr

try:
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # the numpy-1 run has no ml_dtypes
    BF16 = None

FLOATS = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + ([BF16] if BF16 is not None else [])
FLOAT_IDS = [str(d) for d in FLOATS]
# Error of one rounding of the inputs to the dtype plus float32 arithmetic, relative to max(1, |ref|).
TOL = {"float32": 2e-5, "float64": 1e-12, "float16": 4e-3, "bfloat16": 3e-2}


def rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))


def arrays(dtype, *shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def softmax_attention(q, k, v, bias=None):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    m = np.max(s, axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    tot = p.sum(-1, keepdims=True)
    return np.where(tot > 0, p / np.where(tot > 0, tot, 1), 0) @ v


# ---- scaled_dot_product_attention and friends ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_sdpa_forward_backward_weights_explain(dtype):
    q, k, v = arrays(dtype, (2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5))
    out, lse = sattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    assert out.dtype == dtype and out.shape == (2, 3, 9, 5)
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert rel_err(out, softmax_attention(*f64(q, k, v))) <= TOL[dtype.name]
    dout, = arrays(dtype, out.shape, seed=1)
    grads = sattn.scaled_dot_product_attention_backward(dout, q, k, v, out, lse)
    ref = sattn.scaled_dot_product_attention_backward(*f64(dout, q, k, v), *f64(*sattn.scaled_dot_product_attention(
        *f64(q, k, v), return_lse=True)))
    for got, want in zip(grads, ref):
        assert got.dtype == dtype and got.shape == want.shape
        assert rel_err(got, want) <= 4 * TOL[dtype.name]
    w = sattn.attention_weights(q, k)
    assert w.dtype == dtype and w.shape == (2, 3, 9, 11)
    assert rel_err(np.asarray(w, np.float64).sum(-1), 1.0) <= 4 * TOL[dtype.name]
    report = sattn.explain_kernels(q, k, v)
    assert report.selected == ("reference" if dtype == np.float64 else "fused")


MASK_DTYPES = [np.dtype(np.bool_), np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)] + \
    ([BF16] if BF16 is not None else [])


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES, ids=[str(d) for d in MASK_DTYPES])
def test_sdpa_attn_mask_dtypes(mask_dtype):
    q, k, v = arrays(np.float32, (1, 2, 7, 8), (1, 2, 10, 8), (1, 2, 10, 8))
    rng = np.random.default_rng(3)
    if mask_dtype == np.bool_:
        mask = rng.random((7, 10)) > 0.3
        bias = np.where(mask, 0.0, -np.inf)
    else:
        mask = rng.standard_normal((7, 10)).astype(mask_dtype)
        bias = np.asarray(mask, np.float64)
    out, lse = sattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert rel_err(out, softmax_attention(*f64(q, k, v), bias)) <= 2e-5
    grads = sattn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse, attn_mask=mask)
    assert len(grads) == (3 if mask_dtype == np.bool_ else 4)
    if mask_dtype != np.bool_:
        assert grads[3].dtype == mask_dtype and grads[3].shape == mask.shape


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32])
def test_sdpa_key_lengths_and_padding_dtypes(dtype):
    q, k, v = arrays(np.float32, (3, 2, 5, 8), (3, 2, 6, 8), (3, 2, 6, 8))
    lengths = np.array([6, 2, 4], dtype)
    pad = np.arange(6)[None, :] >= lengths.astype(np.int64)[:, None]
    by_len = sattn.scaled_dot_product_attention(q, k, v, key_lengths=lengths)
    by_pad = sattn.scaled_dot_product_attention(q, k, v, key_padding_mask=pad)
    np.testing.assert_array_equal(by_len, by_pad)
    bias = np.where(pad, -np.inf, 0.0)[:, None, None, :]
    assert rel_err(by_len, softmax_attention(*f64(q, k, v), bias)) <= 2e-5


# ---- varlen, sparse, linear ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cu_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_flash_attn_varlen(dtype, cu_dtype):
    lens = [3, 8, 5]
    total = sum(lens)
    q, k, v = arrays(dtype, (total, 2, 8), (total, 2, 8), (total, 2, 4))
    cu = np.cumsum([0] + lens).astype(cu_dtype)
    out, lse = sattn.flash_attn_varlen(q, k, v, cu, cu, max(lens), max(lens), return_lse=True)
    assert out.dtype == dtype and out.shape == (total, 2, 4)
    for s in range(len(lens)):
        a, b = cu[s], cu[s + 1]
        ref = softmax_attention(*f64(*(x[a:b].swapaxes(0, 1) for x in (q, k, v))))
        assert rel_err(out[a:b].swapaxes(0, 1), ref) <= TOL[dtype.name]
    grads = sattn.flash_attn_varlen_backward(np.ones_like(out), q, k, v, out, lse, cu, cu, max(lens), max(lens))
    assert all(g.dtype == dtype and g.shape == x.shape for g, x in zip(grads, (q, k, v)))
    assert all(np.all(np.isfinite(np.asarray(g, np.float64))) for g in grads)


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_sparse_and_linear_attention(dtype):
    tol = TOL["float32" if dtype == np.float64 else dtype.name]  # the sparse and linear engines compute in float32
    q, k, v = arrays(dtype, (1, 2, 40, 8), (1, 2, 40, 8), (1, 2, 40, 8))
    pattern = sattn.SlidingWindow(4, 0)
    allowed = pattern.dense_mask(40)
    assert allowed.dtype == np.bool_ and allowed.shape == (1, 40, 40)
    kpm = np.zeros((1, 40), bool)
    kpm[0, -3:] = True
    bias, = arrays(np.float32, (40, 40), seed=2)
    out, lse = sattn.sparse_attention(q, k, v, pattern, key_padding_mask=kpm, bias=bias, return_lse=True)
    assert out.dtype == dtype
    ref_bias = np.where(allowed & ~kpm[:, None, :], bias, -np.inf)
    assert rel_err(out, softmax_attention(*f64(q, k, v), ref_bias)) <= tol
    dq, dk, dv, extra = sattn.sparse_attention_backward(np.ones_like(out), q, k, v, out, lse, pattern,
                                                        key_padding_mask=kpm, bias=bias)
    assert (dq.dtype, dk.dtype, dv.dtype) == (dtype, dtype, dtype) and extra["bias"].shape == bias.shape
    topk_out, idx = sattn.sparse_attention(q, k, v, sattn.TopK(5), return_indices=True)
    assert idx.dtype == np.int64 and idx.shape == (1, 2, 40, 5)
    sel = sattn.selection_mask(sattn.TopK(5), idx, 40, 40)
    assert sel.dtype == np.bool_ and sel.shape == (1, 2, 40, 40) and np.all(sel.sum(-1) == 5)
    lin = sattn.linear_attention(q, k, v)
    assert lin.dtype == dtype and lin.shape == (1, 2, 40, 8)
    phi = lambda x: np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))  # noqa: E731  elu + 1
    qf, kf, vf = f64(q, k, v)
    num = phi(qf) @ (phi(kf).swapaxes(-1, -2) @ vf)
    den = phi(qf) @ phi(kf).sum(-2)[..., None]
    assert rel_err(lin, num / den) <= tol
    grads = sattn.linear_attention_backward(np.ones(lin.shape, lin.dtype), q, k, v)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    block = sattn.block_mask_from_dense(allowed[0], block=16)
    assert block.len_q == 40 and block.row_ptr.dtype == np.int64


# ---- MultiheadAttention, safetensors, diagnose ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_multihead_attention_and_state_dict(dtype):
    mha = sattn.MultiheadAttention(8, 2, dtype=dtype)
    sd = mha.state_dict()
    assert all(a.dtype == dtype for a in sd.values())
    rng = np.random.default_rng(4)
    new = {name: rng.standard_normal(a.shape).astype(dtype) for name, a in sd.items()}
    mha.load_state_dict(new)
    x, = arrays(dtype, (5, 1, 8))
    out, w = mha(x, x, x)
    assert out.dtype == dtype and out.shape == (5, 1, 8) and w.shape == (1, 5, 5)
    qkv = x[:, 0].astype(np.float64) @ new["in_proj_weight"].T.astype(np.float64) + new["in_proj_bias"]
    q, k, v = (qkv[:, i * 8:(i + 1) * 8].reshape(5, 2, 4).swapaxes(0, 1) for i in range(3))
    att = softmax_attention(q, k, v).swapaxes(0, 1).reshape(5, 8)
    ref = att @ new["out_proj.weight"].T.astype(np.float64) + new["out_proj.bias"]
    assert rel_err(out[:, 0], ref) <= (1e-5 if dtype == np.float32 else 1e-12)


SAFETENSORS_DTYPES = [np.float32, np.float64, np.float16, np.bool_, np.int32, np.int64, np.uint8] + \
    ([BF16] if BF16 is not None else [])


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES, ids=[np.dtype(d).name for d in SAFETENSORS_DTYPES])
def test_safetensors_roundtrip(tmp_path, dtype):
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((3, 4)) * 50).astype(dtype)
    path = str(tmp_path / "t.safetensors")
    sattn.write_safetensors(path, {"a": a, "t": a.T})
    got = sattn.read_safetensors(path)
    for name, want in (("a", a), ("t", a.T)):
        assert got[name].dtype == np.dtype(dtype) and got[name].shape == want.shape
        np.testing.assert_array_equal(got[name].view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@pytest.mark.parametrize("dtype", FLOATS, ids=FLOAT_IDS)
def test_diagnose(dtype):
    q, k, v = arrays(dtype, (1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    mask = np.ones((6, 6), bool)
    mask[2] = False
    d = sattn.diagnose(q, k, v, attn_mask=mask, key_padding_mask=np.array([6], np.int64))
    codes = {f["code"] for f in d["findings"]}
    assert "fully_masked_rows" in codes, codes


# ---- sattn.sr ------------------------------------------------------------------------------------------------------

def test_sr_functions(tmp_path):
    rng = np.random.default_rng(6)
    img = rng.integers(0, 256, (24, 20, 3), dtype=np.uint8)
    path = str(tmp_path / "x.png")
    sr.write_png(path, img)
    np.testing.assert_array_equal(sr.read_image(path), img)
    np.testing.assert_array_equal(sr.read_image(path), sr.mod_crop(img, 1))
    for level in (0, 9):
        sr.write_png(path, img, compression_level=level)
        np.testing.assert_array_equal(sr.read_image(path), img)
    with pytest.raises(ValueError, match="compression_level must be in 0..9, given 10"):
        sr.write_png(path, img, compression_level=10)
    # several bands of rows (~128 KiB each), compressed on any number of threads: the same bytes
    big = rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)
    files = []
    for threads in (1, 2, None):
        p = tmp_path / ("big%s.png" % threads)
        sr.write_png(str(p), big, num_threads=threads)
        np.testing.assert_array_equal(sr.read_image(str(p)), big)
        files.append(p.read_bytes())
    assert files[0] == files[1] == files[2]
    gray = img[..., 0]
    np.testing.assert_array_equal(sr.mod_crop(gray, 4), np.repeat(gray[:24, :20, None], 3, axis=2))
    lr = sr.downscale(img, 2)
    assert lr.dtype == np.uint8 and lr.shape == (12, 10, 3)
    up = sr.upscale_bicubic(lr, 2)
    assert up.dtype == np.uint8 and up.shape == (24, 20, 3)
    assert sr.psnr_y(img, img, 2) == float("inf") and 0 < sr.psnr_y(up, img, 2) < 60
    assert sr.ssim_y(img, img, 2) == pytest.approx(1.0) and sr.ssim_y(up, img, 2) < 1.0
    # The strides of a flipped or sliced image are honoured, not reinterpreted.
    np.testing.assert_array_equal(sr.mod_crop(img[::-1, ::2], 1), np.ascontiguousarray(img[::-1, ::2]))


def test_sr_model(tmp_path):
    import os
    weights = os.path.join(os.path.dirname(__file__), "..", "..", "sr", "weights", "sattn_sr_x2.safetensors")
    if not os.path.exists(weights):
        pytest.skip("sr/weights/sattn_sr_x2.safetensors missing")
    model = sr.SrModel(weights)
    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, (16, 18, 3), dtype=np.uint8)
    up = model.upscale(img, attention="dense", num_threads=1)
    assert up.dtype == np.uint8 and up.shape == (32, 36, 3)
    x = np.ascontiguousarray(img.transpose(2, 0, 1), np.float32) / 255
    y = model.forward(x, attention="dense", num_threads=1)
    assert y.dtype == np.float32 and y.shape == (3, 32, 36)
    # upscale = forward, clamped and rounded (BasicSR's tensor2img)
    np.testing.assert_array_equal(up, np.floor(np.clip(y, 0, 1) * 255 + 0.5).astype(np.uint8).transpose(1, 2, 0))
