"""sattn.scaled_dot_product_attention & co. against a float64 numpy transcription of PyTorch 2.x's documented SDPA
reference (sdpa_reference.py) and against torch.nn.functional.scaled_dot_product_attention itself (PyTorch 2.x,
in float64 and float32), over random problems nobody hand-picked. Without torch (the numpy-1 run) the torch tests
skip visibly and the rest runs (torch_oracle.py)."""
import numpy as np
import pytest

import sattn
import torch_oracle
from sdpa_reference import max_rel_err, random_problem, sdpa
from torch_oracle import needs_torch, torch

N_FORWARD = 240
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference_kwargs(kw):
    return {k: kw[k] for k in ("attn_mask", "is_causal", "scale", "enable_gqa", "causal_alignment",
                               "key_padding_mask", "key_lengths") if k in kw}


@pytest.mark.parametrize("seed", range(N_FORWARD))
def test_forward_matches_reference(seed):
    q, k, v, kw = random_problem(seed)
    out, lse = sattn.scaled_dot_product_attention(q, k, v, **kw, return_lse=True)
    ref_out, ref_lse, ref_w = sdpa(q, k, v, **_reference_kwargs(kw))
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and lse.dtype == q.dtype
    assert out.shape == q.shape[:-1] + (v.shape[-1],)
    assert lse.shape == q.shape[:-1]
    assert np.all(np.isfinite(out)), "fully masked rows must give 0, never NaN"
    assert max_rel_err(out, ref_out) <= tol
    assert max_rel_err(lse, ref_lse) <= tol
    dead = np.isneginf(ref_lse)
    assert np.all(np.isneginf(lse[dead]))
    assert np.all(out[dead] == 0)
    if seed % 3 == 0:  # weights on one problem in three (they materialise Lq x Lk)
        w = sattn.attention_weights(q, k, **kw)
        assert w.shape == ref_w.shape
        assert max_rel_err(w, ref_w) <= tol


def test_random_problems_cover_the_options():
    """The random sweep really exercises every option (guards against a generator that silently narrows)."""
    seen = set()
    for seed in range(N_FORWARD):
        q, k, v, kw = random_problem(seed)
        seen.add(("ndim", q.ndim))
        seen.add(("gqa", q.ndim >= 3 and q.shape[-3] != k.shape[-3]))
        seen.add(("lq!=lk", q.shape[-2] != k.shape[-2]))
        seen.add(("dv!=d", v.shape[-1] != q.shape[-1]))
        seen.add(("causal", kw.get("is_causal", False) and kw["causal_alignment"]))
        m = kw.get("attn_mask")
        if m is not None:
            seen.add(("mask", m.dtype == np.bool_, m.ndim))
            seen.add(("mask-inf", bool(np.isneginf(m).any()) if m.dtype != np.bool_ else None))
            seen.add(("mask-broadcast", any(s == 1 for s in m.shape)))
        seen.add(("kpm", "key_padding_mask" in kw, "key_lengths" in kw))
        seen.add(("noncontig", not q.flags.c_contiguous))
        seen.add(("negstride", any(s < 0 for s in q.strides + k.strides + v.strides)))
        seen.add(("dtype", q.dtype.name))
        ref_out, ref_lse, _ = sdpa(q, k, v, **_reference_kwargs(kw))
        seen.add(("dead-row", bool(np.isneginf(ref_lse).any())))
    for item in [("ndim", 2), ("ndim", 3), ("ndim", 4), ("ndim", 5), ("gqa", True), ("lq!=lk", True),
                 ("dv!=d", True), ("causal", "top_left"), ("causal", "bottom_right"), ("mask-inf", True),
                 ("mask-broadcast", True), ("kpm", True, False), ("kpm", False, True), ("noncontig", True),
                 ("negstride", True), ("dtype", "float32"), ("dtype", "float64"), ("dead-row", True)]:
        assert item in seen, item
    for nd in (1, 2, 3, 4):
        assert ("mask", True, nd) in seen or ("mask", False, nd) in seen


def test_fully_masked_rows_are_zero_not_nan():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 5, 8)).astype(np.float32) for _ in range(3))
    mask = np.ones((5, 5), bool)
    mask[2] = False
    out, lse = sattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    assert np.all(out[:, :, 2] == 0) and np.all(np.isneginf(lse[:, :, 2]))
    assert np.all(np.isfinite(out))
    dq, dk, dv = sattn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse, attn_mask=mask)
    assert np.all(dq[:, :, 2] == 0) and all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    # All keys padded (key_lengths = 0) for batch entry 1.
    out = sattn.scaled_dot_product_attention(q, k, v, key_lengths=np.array([5, 0]))
    assert np.all(out[1] == 0) and np.any(out[0] != 0)


def test_leading_dimension_forms_agree_with_4d():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 4, 7, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, 4, 9, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, 4, 9, 5)).astype(np.float32)
    mask = rng.standard_normal((3, 1, 7, 9)).astype(np.float32)  # broadcast over the outer batch dim and heads
    out5 = sattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    m4 = np.broadcast_to(mask, (2, 3, 4, 7, 9)).reshape(6, 4, 7, 9)
    out4 = sattn.scaled_dot_product_attention(q.reshape(6, 4, 7, 8), k.reshape(6, 4, 9, 8), v.reshape(6, 4, 9, 5),
                                              attn_mask=m4)
    np.testing.assert_array_equal(out5.reshape(6, 4, 7, 5), out4)
    out3 = sattn.scaled_dot_product_attention(q[0, 0], k[0, 0], v[0, 0])
    out2 = sattn.scaled_dot_product_attention(q[0, 0, 1], k[0, 0, 1], v[0, 0, 1])
    ref4 = sattn.scaled_dot_product_attention(q[0, :1], k[0, :1], v[0, :1])
    np.testing.assert_array_equal(out3, ref4[0])
    np.testing.assert_array_equal(out2, ref4[0, 1])


def test_noncontiguous_inputs_give_the_same_result():
    rng = np.random.default_rng(3)
    base = rng.standard_normal((2, 11, 4, 16)).astype(np.float32)  # PyTorch's (B, L, H, E) storage
    q = base.transpose(0, 2, 1, 3)
    k = base[:, ::-1].transpose(0, 2, 1, 3)  # negative stride: copied
    v = base[..., ::2].transpose(0, 2, 1, 3)
    out = sattn.scaled_dot_product_attention(q, k, v)
    ref = sattn.scaled_dot_product_attention(*(np.ascontiguousarray(x) for x in (q, k, v)))
    np.testing.assert_array_equal(out, ref)


def test_explicit_scale_and_default_scale():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 6, 10)) for _ in range(3))
    a = sattn.scaled_dot_product_attention(q, k, v)
    b = sattn.scaled_dot_product_attention(q, k, v, scale=1 / np.sqrt(10))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
    c = sattn.scaled_dot_product_attention(q, k, v, scale=0.9)
    assert max_rel_err(c, sdpa(q, k, v, scale=0.9)[0]) <= 1e-12


def test_is_causal_intersects_attn_mask():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    mask = rng.random((6, 6)) > 0.3
    out = sattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    both = mask & np.tril(np.ones((6, 6), bool))
    ref = sattn.scaled_dot_product_attention(q, k, v, attn_mask=both)
    np.testing.assert_array_equal(out, ref)


def test_half_precision_is_upconverted_and_cast_back():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 2, 9, 16)).astype(np.float16) for _ in range(3))
    out, lse = sattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref = sattn.scaled_dot_product_attention(*(x.astype(np.float32) for x in (q, k, v)), is_causal=True)
    if sattn.simd_targets()["fused"] == "amx":
        # float16 as two bf16 each on the tiles, exactly: the float32 result up to float32 rounding, then rounded to
        # float16 (half a float16 ulp)
        err = np.abs(out.astype(np.float64) - ref.astype(np.float64))
        assert (err <= 2.0**-11 * np.abs(ref) + 2e-5 * max(1.0, np.abs(ref).max())).all(), err.max()
    else:
        np.testing.assert_array_equal(out, ref.astype(np.float16))
    grads = sattn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse, is_causal=True)
    assert all(g.dtype == np.float16 for g in grads)


def test_bfloat16_if_ml_dtypes_is_installed():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes not installed: bfloat16 input not tested")
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 9, 16)).astype(ml_dtypes.bfloat16) for _ in range(3))
    out = sattn.scaled_dot_product_attention(q, k, v)
    assert out.dtype == np.dtype(ml_dtypes.bfloat16)
    ref = sattn.scaled_dot_product_attention(*(x.astype(np.float32) for x in (q, k, v)))
    if sattn.simd_targets()["fused"] in ("amx", "avx512bf16"):  # bf16 products, P rounded to bf16 once for a bf16 out
        assert np.abs(out.astype(np.float32) - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max())
    else:
        np.testing.assert_array_equal(out, ref.astype(ml_dtypes.bfloat16))


# ---- dropout ------------------------------------------------------------------------------------------------


def _dropout_problem():
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 3, 40, 16)).astype(np.float32)
    k = rng.standard_normal((2, 3, 50, 16)).astype(np.float32)
    v = rng.standard_normal((2, 3, 50, 8)).astype(np.float32)
    return q, k, v


def test_dropout_is_deterministic_per_seed():
    q, k, v = _dropout_problem()
    a = sattn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=11)
    b = sattn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=11)
    c = sattn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=12)
    np.testing.assert_array_equal(a, b)
    assert np.mean(a != c) > 0.5
    # and independent of the thread count
    d = sattn.scaled_dot_product_attention(q, k, v, dropout_p=0.3, seed=11, num_threads=1)
    np.testing.assert_array_equal(a, d)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_1_minus_p_and_matches_reference(p):
    q, k, v = _dropout_problem()
    mask = np.random.default_rng(9).random((40, 50)) > 0.2
    w0 = sattn.attention_weights(q, k, attn_mask=mask)
    w = sattn.attention_weights(q, k, attn_mask=mask, dropout_p=p, seed=5)
    live = w0 != 0
    keep = w != 0
    n = live.sum()
    frac = keep[live].mean()
    assert abs(frac - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n) + 1e-3, frac
    np.testing.assert_allclose(w[keep], w0[keep] / (1 - p), rtol=1e-6)
    keep_full = np.where(live, keep, True)
    out = sattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, seed=5)
    ref, _, _ = sdpa(q, k, v, attn_mask=mask, dropout_p=p, keep=keep_full)
    assert max_rel_err(out, ref) <= 2e-5


# ---- torch.nn.functional.scaled_dot_product_attention ------------------------------------------------------
# Every random problem, given to torch's own SDPA (torch_oracle.sdpa_call: torch's arguments where it has them,
# sattn's extensions as one torch mask). Fully masked rows are compared like every other row: torch 2.x gives 0
# there too.
TORCH_TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-10}


def _compare_with_torch(seed, dtype):
    q, k, v, kw = random_problem(seed)
    if dtype is not None:
        q, k, v = (np.asarray(x, dtype) for x in (q, k, v))
    out = sattn.scaled_dot_product_attention(q, k, v, **kw)
    tq, tk, tv, tkw, _ = torch_oracle.sdpa_call(q, k, v, kw)
    ref = torch_oracle.sdpa(tq, tk, tv, tkw).numpy()
    assert ref.shape == out.shape and ref.dtype == out.dtype
    assert np.isfinite(ref).all(), "torch 2.x SDPA gives 0 in fully masked rows, never NaN"
    err = max_rel_err(out, ref)
    assert err <= TORCH_TOL[q.dtype], f"max |sattn - torch| / max(1, |torch|) = {err:.3g}"
    _, ref_lse, _ = sdpa(q, k, v, **_reference_kwargs(kw))
    dead = np.isneginf(ref_lse)
    assert np.all(out[dead] == 0) and np.all(ref[dead] == 0)
    return dead.any()


@needs_torch
@pytest.mark.parametrize("seed", range(N_FORWARD))
def test_forward_matches_torch_sdpa_float64(seed):
    """All problems in float64 (float32 ones converted exactly), torch and sattn both in float64."""
    _compare_with_torch(seed, np.float64)


@needs_torch
@pytest.mark.parametrize("seed", [s for s in range(N_FORWARD) if random_problem(s)[0].dtype == np.float32])
def test_forward_matches_torch_sdpa_float32(seed):
    """The float32 problems as generated, torch and sattn both computing in float32."""
    _compare_with_torch(seed, None)


@needs_torch
def test_torch_sweep_covers_fully_masked_rows_and_every_torch_form():
    """The sweep above reaches torch through each of its forms and has fully masked rows (so the direct
    comparison of those rows is exercised)."""
    forms, dead = set(), 0
    for seed in range(N_FORWARD):
        q, k, v, kw = random_problem(seed)
        _, _, _, tkw, _ = torch_oracle.sdpa_call(q, k, v, kw)
        forms.add(torch_oracle.form(tkw))
        forms.add(("gqa", bool(tkw.get("enable_gqa")) and q.shape[-3] != k.shape[-3]))
        _, ref_lse, _ = sdpa(q, k, v, **_reference_kwargs(kw))
        dead += bool(np.isneginf(ref_lse).any())
    assert {"none", "is_causal", "causal_lower_right", "bool", "float", ("gqa", True)} <= forms, forms
    assert dead >= 10, dead


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fully_masked_rows_match_torch(dtype):
    """A fully masked row (bool mask, -inf float mask, all keys padded) gives 0 in torch 2.x's SDPA as in sattn,
    and zero gradients."""
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((2, 3, 5, 8)).astype(dtype) for _ in range(3))
    bool_mask = rng.random((5, 5)) > 0.3
    bool_mask[2] = False
    float_mask = np.where(bool_mask, rng.standard_normal((5, 5)), -np.inf).astype(dtype)
    for kw in (dict(attn_mask=bool_mask), dict(attn_mask=float_mask), dict(key_lengths=np.array([5, 0]))):
        out, lse = sattn.scaled_dot_product_attention(q, k, v, **kw, return_lse=True)
        tq, tk, tv, tkw, _ = torch_oracle.sdpa_call(q, k, v, kw, requires_grad=True)
        ref = torch_oracle.sdpa(tq, tk, tv, tkw)
        dout = rng.standard_normal(out.shape).astype(dtype)
        ref.backward(torch.from_numpy(dout))
        ref = ref.detach().numpy()
        dead = np.isneginf(lse)
        assert dead.any() and np.all(ref[dead] == 0) and np.all(out[dead] == 0)
        assert max_rel_err(out, ref) <= TORCH_TOL[np.dtype(dtype)]
        grads = sattn.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw)[:3]
        assert np.all(tq.grad.numpy()[dead] == 0) and np.all(grads[0][dead] == 0)
        for got, want in zip(grads, (tq.grad, tk.grad, tv.grad)):
            assert max_rel_err(got, want.numpy()) <= (1e-4 if dtype == np.float32 else 1e-9)


def test_strided_inputs_are_not_copied():
    """Inputs a strided view can describe (transposed, sliced, broadcast) reach the kernels without a copy: the
    numpy memory allocated during the call (traced by tracemalloc) is the output alone. A negative stride forces
    a copy, which the same measurement sees (so the check can fail)."""
    import tracemalloc

    rng = np.random.default_rng(10)
    base = rng.standard_normal((2, 256, 4, 128)).astype(np.float32)  # (B, L, H, 2E) storage
    q = base[..., ::2].transpose(0, 2, 1, 3)  # (B, H, L, E), neither contiguous nor dense
    k = base[..., 1::2].transpose(0, 2, 1, 3)
    v = np.broadcast_to(rng.standard_normal((1, 1, 256, 64)).astype(np.float32), (2, 4, 256, 64))
    mask = np.broadcast_to(rng.random((256, 1)) > 0.1, (256, 256))

    def traced_peak(*args, **kw):
        tracemalloc.start()
        try:
            out = sattn.scaled_dot_product_attention(*args, **kw)
            return tracemalloc.get_traced_memory()[1], out
        finally:
            tracemalloc.stop()

    peak, out = traced_peak(q, k, v, attn_mask=mask)
    assert peak < out.nbytes + 64 * 1024, (peak, out.nbytes)
    peak_rev, _ = traced_peak(q[:, :, ::-1], k, v, attn_mask=mask)
    assert peak_rev >= out.nbytes + q.nbytes


def test_scalar_float_mask_and_its_gradient():
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 2, 4, 8)) for _ in range(3))
    bias = np.array(0.7)
    out, lse = sattn.scaled_dot_product_attention(q, k, v, attn_mask=bias, return_lse=True)
    ref_out, ref_lse, _ = sdpa(q, k, v, attn_mask=bias)
    assert max_rel_err(out, ref_out) <= 1e-12 and max_rel_err(lse, ref_lse) <= 1e-12
    *_, dmask = sattn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, out, lse, attn_mask=bias)
    assert dmask.shape == () and abs(float(dmask)) < 1e-10  # a constant bias does not change softmax


def test_big_endian_inputs_are_converted():
    rng = np.random.default_rng(12)
    q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    bias = rng.standard_normal((5, 5))
    out = sattn.scaled_dot_product_attention(*(x.astype(">f8") for x in (q, k, v)), attn_mask=bias.astype(">f4"),
                                             key_lengths=np.array([4], ">i8"))
    ref = sattn.scaled_dot_product_attention(q, k, v, attn_mask=bias.astype(np.float32), key_lengths=np.array([4]))
    np.testing.assert_array_equal(out, ref)
