"""sattn.flash_attn_varlen against a float64 numpy transcription (per sequence, bottom-right causal) and torch
autograd for the backward."""
import numpy as np
import pytest

import sattn


def ref_attention(q, k, v, causal, scale):
    # q [Lq, H, D], k/v [Lk, H, D] (same H) -> out [Lq, H, Dv], lse [H, Lq]; float64.
    Lq, Lk = q.shape[0], k.shape[0]
    s = np.einsum("ihd,jhd->hij", q, k) * scale
    if causal:
        allowed = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + Lk - Lq
        s = np.where(allowed[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    l = e.sum(-1, keepdims=True)
    p = np.where(l > 0, e / np.where(l > 0, l, 1), 0.0)
    lse = np.where(l[..., 0] > 0, (m + np.log(np.where(l > 0, l, 1)))[..., 0], -np.inf)
    return np.einsum("hij,jhd->ihd", p, v), lse


def packed(rng, lens, H, D):
    return rng.standard_normal((sum(lens), H, D)).astype(np.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_matches_numpy(causal):
    rng = np.random.default_rng(0)
    lq, lk = [3, 17, 1, 40], [5, 17, 9, 33]
    H, D, Dv = 2, 16, 8
    q, k, v = packed(rng, lq, H, D), packed(rng, lk, H, D), packed(rng, lk, H, Dv)
    cq = np.cumsum([0] + lq).astype(np.int32)
    ck = np.cumsum([0] + lk).astype(np.int64)
    out, lse = sattn.flash_attn_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True)
    assert out.shape == (sum(lq), H, Dv) and lse.shape == (H, sum(lq))
    for s in range(len(lq)):
        qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
        ro, rl = ref_attention(qs.astype(np.float64), ks.astype(np.float64), vs.astype(np.float64), causal,
                               1 / np.sqrt(D))
        np.testing.assert_allclose(out[cq[s]:cq[s + 1]], ro, atol=2e-5)
        np.testing.assert_allclose(lse[:, cq[s]:cq[s + 1]], rl, atol=2e-5)


def test_varlen_backward_matches_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    lq, lk = [7, 20], [7, 30]
    H, D = 2, 8
    q, k, v = packed(rng, lq, H, D), packed(rng, lk, H, D), packed(rng, lk, H, D)
    dout = packed(rng, lq, H, D)
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    out, lse = sattn.flash_attn_varlen(q, k, v, cq, ck, 20, 30, causal=True, return_lse=True)
    dq, dk, dv = sattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cq, ck, 20, 30, causal=True)
    for s in range(2):
        tq, tk, tv = (torch.tensor(x[c[s]:c[s + 1]], dtype=torch.float64, requires_grad=True)
                      for x, c in ((q, cq), (k, ck), (v, ck)))
        sc = torch.einsum("ihd,jhd->hij", tq, tk) / np.sqrt(D)
        Lq, Lk = lq[s], lk[s]
        allowed = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + Lk - Lq
        sc = sc.masked_fill(~allowed[None], float("-inf"))
        o = torch.einsum("hij,jhd->ihd", torch.softmax(sc, -1), tv)
        o.backward(torch.tensor(dout[cq[s]:cq[s + 1]], dtype=torch.float64))
        np.testing.assert_allclose(dq[cq[s]:cq[s + 1]], tq.grad.numpy(), atol=1e-4)
        np.testing.assert_allclose(dk[ck[s]:ck[s + 1]], tk.grad.numpy(), atol=1e-4)
        np.testing.assert_allclose(dv[ck[s]:ck[s + 1]], tv.grad.numpy(), atol=1e-4)


def test_varlen_bad_offsets_raise_value_error():
    q = np.zeros((6, 2, 8), np.float32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        sattn.flash_attn_varlen(q, q, q, np.array([0, 4, 5], np.int32), np.array([0, 4, 6], np.int32), 6, 6)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_varlen_half_inputs_match_upcast(dtype_name):
    if dtype_name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = ml_dtypes.bfloat16
    else:
        dt = np.float16
    rng = np.random.default_rng(2)
    lens = [5, 70]  # D·Lk past 4096: long enough keys for the bf16 products of the amx and avx512bf16 builds
    q, k, v = (packed(rng, lens, 2, 64).astype(dt) for _ in range(3))
    cu = np.cumsum([0] + lens).astype(np.int32)
    out = sattn.flash_attn_varlen(q, k, v, cu, cu, 70, 70, causal=True)
    ref = sattn.flash_attn_varlen(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), cu, cu, 70, 70,
                                  causal=True)
    # Half-precision inputs are read natively and the output has their dtype (as FlashAttention's); the kernel
    # computes in float32, so it is the float32 result rounded once. The bf16 products (amx, avx512bf16 builds) round
    # the probabilities to bf16 once for a bf16 out, as FlashAttention does: then within 1e-2 of the largest value
    # (the C++ bf16-output sweep's bound). The amx forward takes float16 as two bf16 each, exactly, on its own
    # products: the float32 result up to float32 rounding (2e-5 of the largest value, the C++ sweep's bound), then
    # rounded to float16 (half a float16 ulp, 2^-11 relative).
    assert out.dtype == np.dtype(dt)
    fused = sattn.simd_targets()["fused"]
    if dtype_name == "bfloat16" and fused in ("amx", "avx512bf16"):
        assert np.abs(out.astype(np.float32) - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max())
        assert not np.array_equal(out, ref.astype(dt))  # the rounded products ran
    elif dtype_name == "float16" and fused == "amx":
        err = np.abs(out.astype(np.float64) - ref.astype(np.float64))
        assert (err <= 2.0**-11 * np.abs(ref) + 2e-5 * max(1.0, np.abs(ref).max())).all(), err.max()
        assert not np.array_equal(out, ref.astype(dt))  # its own products ran
    else:
        np.testing.assert_array_equal(out, ref.astype(dt))
    dout = rng.standard_normal(out.shape).astype(dt)
    out_l, lse = sattn.flash_attn_varlen(q, k, v, cu, cu, 70, 70, causal=True, return_lse=True)
    grads = sattn.flash_attn_varlen_backward(dout, q, k, v, out_l, lse, cu, cu, 70, 70, causal=True)
    assert lse.dtype == np.float32 and all(g.dtype == np.dtype(dt) for g in grads)


def test_varlen_float32_precision_bf16_rounds_only_where_the_cpu_has_bf16_products():
    """float32_precision='bf16' (numpy API, both passes, and sattn.torch's flash_attn_varlen_func, which also follows
    torch.set_float32_matmul_precision('medium')): float32 inputs on the bf16 products where the fused build has
    them, within bf16 rounding of the reference; elsewhere bitwise the 'highest' results."""
    rng = np.random.default_rng(6)
    lens = [40, 130, 7]
    H, D = 2, 64
    q, k, v, dout = (packed(rng, lens, H, D) for _ in range(4))
    cu = np.cumsum([0] + lens).astype(np.int32)
    bf16 = sattn.simd_targets()["fused"] in ("amx", "avx512bf16")
    results = {}
    for precision in ("highest", "bf16"):
        out, lse = sattn.flash_attn_varlen(q, k, v, cu, cu, 130, 130, causal=True, return_lse=True,
                                           float32_precision=precision)
        grads = sattn.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu, cu, 130, 130, causal=True,
                                                 float32_precision=precision)
        results[precision] = (out, *grads)
    for high, low in zip(results["highest"], results["bf16"]):
        if bf16:
            assert 1e-6 < np.abs(low - high).max() <= 3e-2 * max(1.0, np.abs(high).max())
        else:
            np.testing.assert_array_equal(low, high)
    with pytest.raises(sattn.InvalidArgumentError, match="float32_precision"):
        sattn.flash_attn_varlen(q, k, v, cu, cu, 130, 130, float32_precision="medium")
    torch = pytest.importorskip("torch", reason="torch not importable: sattn.torch's varlen precision NOT tested")
    import sattn.torch as st

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    before = torch.get_float32_matmul_precision()
    try:
        for setting, precision in (("medium", None), ("highest", "bf16"), ("highest", None)):
            torch.set_float32_matmul_precision(setting)
            o = st.flash_attn_varlen_func(tq, tk, tv, torch.from_numpy(cu), torch.from_numpy(cu), 130, 130,
                                          causal=True, float32_precision=precision)
            g = torch.autograd.grad(o, (tq, tk, tv), torch.from_numpy(dout))
            rounded = setting == "medium" or precision == "bf16"
            want = results["bf16" if rounded else "highest"]
            for got, w in zip((o, *g), want):
                np.testing.assert_array_equal(got.detach().numpy(), w)
    finally:
        torch.set_float32_matmul_precision(before)
