"""The bf16 products. bf16 inputs against PyTorch 2.x's own bf16 SDPA: on 20 random problems (D 64/128, L <= 1024,
full and causal, GQA) the largest absolute error of out, dq, dk and dv against the fp64 reference on the same bf16
values is at most twice torch's bf16 error + 1e-5, for every fused build this CPU runs that has its own bf16 path
(amx: AMX tiles; avx512bf16: the vdpbf16ps products) and for the default one; the same for float16 inputs against
torch's float16 SDPA (the amx forward takes them as two bf16 each). float32_precision='bf16' (numpy API, sattn.torch and
torch.set_float32_matmul_precision('medium')): float32 inputs rounded only where the CPU has bf16 products."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not importable: bf16 accuracy against torch NOT tested")

import torch.nn.functional as F  # noqa: E402

import sattn  # noqa: E402
import sattn.torch as st  # noqa: E402


def problems():
    rng = np.random.default_rng(23)
    out = []
    for n in range(20):
        D = (64, 128)[n % 2]
        Lq = int(rng.integers(1, 1025)) if n % 5 else int(rng.integers(1, 5))  # a few decode-sized problems
        Lk = Lq if n % 3 else int(rng.integers(1, 1025))
        causal = n % 4 in (1, 2)
        hq, hkv = ((8, 2), (4, 4), (6, 3), (2, 1))[n % 4]
        out.append((n, D, Lq, Lk, causal, hq, hkv))
    return out


def grads(fn, q, k, v, dout, causal, gqa):
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    o = fn(q, k, v, is_causal=causal, enable_gqa=gqa)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), dout)
    return [t.double() for t in (o, dq, dk, dv)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("target", ["default", "amx", "avx512bf16"])
def test_bf16_errors_within_twice_torch(target, dtype):
    before = sattn.simd_targets()["selected"]
    if target != "default":
        if target not in sattn.simd_targets()["available"]:
            pytest.skip(f"this CPU does not run {target}: its bf16 products are NOT checked here")
        sattn.set_simd_target(target)
    try:
        for n, D, Lq, Lk, causal, hq, hkv in problems():
            g = torch.Generator().manual_seed(n)
            dt = torch.bfloat16 if dtype == "bf16" else torch.float16
            q = torch.randn(1, hq, Lq, D, generator=g).to(dt)
            k, v = (torch.randn(1, hkv, Lk, D, generator=g).to(dt) for _ in range(2))
            dout = torch.randn(1, hq, Lq, D, generator=g).to(dt)
            gqa = hq != hkv
            ref = grads(F.scaled_dot_product_attention, q.double(), k.double(), v.double(), dout.double(), causal, gqa)
            theirs = grads(F.scaled_dot_product_attention, q, k, v, dout, causal, gqa)
            ours = grads(st.scaled_dot_product_attention, q, k, v, dout, causal, gqa)
            for name, r, t, o in zip(("out", "dq", "dk", "dv"), ref, theirs, ours):
                # rows with no allowed key (causal, Lq > Lk): torch gives NaN there, sattn 0; compare the others
                ok = torch.isfinite(t)
                err_t = (t - r)[ok].abs().max().item() if ok.any() else 0.0
                err_o = (o - r)[ok].abs().max().item() if ok.any() else 0.0
                assert err_o <= 2 * err_t + 1e-5, (n, name, D, Lq, Lk, causal, hq, hkv, err_o, err_t)
    finally:
        sattn.set_simd_target(before)


def test_float32_precision_bf16_rounds_float32_inputs_only_where_the_cpu_has_bf16_products():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 150, 64)).astype(np.float32) for _ in range(3))
    ref = sattn.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                             is_causal=True)
    highest = sattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    rounded = sattn.scaled_dot_product_attention(q, k, v, is_causal=True, float32_precision="bf16")
    assert np.abs(highest - ref).max() <= 1e-5
    assert np.abs(rounded - ref).max() <= 2e-2
    if sattn.simd_targets()["fused"] in ("amx", "avx512bf16"):
        assert np.abs(rounded - highest).max() > 1e-5  # the bf16 products ran
    else:
        np.testing.assert_array_equal(rounded, highest)  # nothing to round with on this target
    for bad, err in (("medium", ValueError), (16, TypeError)):
        with pytest.raises(err, match="float32_precision: expected 'highest' or 'bf16'"):
            sattn.scaled_dot_product_attention(q, k, v, float32_precision=bad)


def test_sattn_torch_follows_torch_float32_matmul_precision():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 130, 64, generator=g, requires_grad=True) for _ in range(3))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        highest = st.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.set_float32_matmul_precision("medium")
        medium = st.scaled_dot_product_attention(q, k, v, is_causal=True)
        explicit = st.scaled_dot_product_attention(q, k, v, is_causal=True, float32_precision="highest")
        grads = torch.autograd.grad(medium.sum(), (q, k, v))
    finally:
        torch.set_float32_matmul_precision(before)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert torch.equal(explicit, highest)
    assert (medium.double() - ref).abs().max() <= 2e-2
    for got, want in zip(grads, ref_grads):
        assert (got.double() - want).abs().max() <= 5e-2 * max(1.0, want.abs().max().item())
    if sattn.simd_targets()["fused"] in ("amx", "avx512bf16"):
        assert not torch.equal(medium, highest)
    with pytest.raises(sattn.InvalidArgumentError, match="float32_precision: expected None, 'highest' or 'bf16'"):
        st.scaled_dot_product_attention(q, k, v, float32_precision="medium")
