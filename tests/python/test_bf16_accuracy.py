"""The bf16 products. bf16 inputs against PyTorch 2.x's own bf16 SDPA: on 20 random problems (D 64/128, L <= 1024,
full and causal, GQA) the largest absolute error of out, dq, dk and dv against the fp64 reference on the same bf16
values is at most twice torch's bf16 error + 1e-5, for every fused build this CPU runs that has its own bf16 path
(amx: AMX tiles; avx512bf16: the vdpbf16ps products) and for the default one; the same for float16 inputs against
torch's float16 SDPA (the amx forward takes them as two bf16 each). float32_precision='bf16' (numpy API, sattn.torch and
torch.set_float32_matmul_precision('medium')): float32 inputs rounded only where the CPU has bf16 products."""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not importable: bf16 accuracy against torch NOT tested")

import torch.nn.functional as F  # noqa: E402

import sattn  # noqa: E402
import sattn.torch as st  # noqa: E402


@contextlib.contextmanager
def on_target(target, what):
    """Runs the block with the SIMD target `target` selected ("default": the one selected now), and the one before
    afterwards; skips the test, saying that `what` are not checked, where this CPU does not run it."""
    before = sattn.simd_targets()["selected"]
    if target != "default":
        if target not in sattn.simd_targets()["available"]:
            pytest.skip(f"this CPU does not run {target}: its {what} are NOT checked here")
        sattn.set_simd_target(target)
    try:
        yield
    finally:
        sattn.set_simd_target(before)


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
    with on_target(target, "bf16 products"):
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


@pytest.mark.parametrize("target", ["default", "amx", "avx512bf16"])
def test_bf16_learned_bias_gradients_within_twice_torch_from_the_float32_out(target):
    """bf16 inputs with a bf16 additive mask that needs its gradient (a learned bias; PyTorch's SDPA runs its float32
    math backend then): dq, dk, dv and the mask's gradient within twice torch's largest error + 1e-5. The backward
    starts from the float32 products' out of the same values, as the math backend's does (sattn::sdpa_backward
    takes it; through autograd, the forward's own float32 out, whose P was rounded once as FlashAttention does; its
    criterion, against torch's own bf16 kernel, is test_bf16_errors_within_twice_torch)."""
    ops = torch.ops.sattn
    with on_target(target, "bf16 products"):
        rng = np.random.default_rng(7)
        for n in range(20):  # D 64/128, L <= 1024, three mask shapes, half of them causal
            D, H, B = (64, 128)[n % 2], (8, 4, 2)[n % 3], 1 + n % 2
            Lq = int(rng.integers(1, 1025))
            Lk = Lq if n % 3 else int(rng.integers(1, 1025))
            shape = ("bhqk", "1hqk", "qk")[n % 3]
            g = torch.Generator().manual_seed(100 + n)
            q = torch.randn(B, H, Lq, D, generator=g).bfloat16()
            k, v = (torch.randn(B, H, Lk, D, generator=g).bfloat16() for _ in range(2))
            dout = torch.randn(B, H, Lq, D, generator=g).bfloat16()
            mshape = {"bhqk": (B, H, Lq, Lk), "1hqk": (1, H, Lq, Lk), "qk": (Lq, Lk)}[shape]
            bias = torch.randn(mshape, generator=g).bfloat16()
            if n % 4 in (1, 2):  # causal, as part of the bias
                bias = bias.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).tril().logical_not(), float("-inf"))

            def torch_grads(*xs):
                xs = [x.detach().clone().requires_grad_(True) for x in xs]
                o = F.scaled_dot_product_attention(xs[0], xs[1], xs[2], attn_mask=xs[3])
                return [t.double() for t in (o, *torch.autograd.grad(o, xs, dout.to(o.dtype)))]

            ref = torch_grads(q.double(), k.double(), v.double(), bias.double())
            theirs = torch_grads(q, k, v, bias)
            out16, lse, _ = ops.sdpa_forward(q, k, v, bias, None, "none", None, 0.0, None, 1)  # lse as autograd saves it
            out32, _, _ = ops.sdpa_forward(q.float(), k.float(), v.float(), bias.float(), None, "none", None, 0.0, None,
                                           1)
            grads = ops.sdpa_backward(dout, q, k, v, out32, lse, bias, None, "none", None, 0.0, None, 1, True)
            assert grads[0].dtype == torch.bfloat16 and grads[3].dtype == torch.bfloat16
            assert out16.dtype == torch.bfloat16
            for name, r, t, o in zip(("dq", "dk", "dv", "dmask"), ref[1:], theirs[1:], grads):
                o = o.double()
                ok = torch.isfinite(r)
                err_t = (t - r)[ok].abs().max().item()
                err_o = (o - r)[ok].abs().max().item()
                assert err_o <= 2 * err_t + 1e-5, (n, name, err_o, err_t)


SPARSE_PROBLEMS = (  # pattern, B, Hq, Hkv, L, D: fixed patterns, GQA, odd D, a content-adaptive selection
    ("SlidingWindow(64, 64)", 1, 4, 4, 700, 64), ("SlidingWindow(100, 0)", 2, 4, 2, 333, 128),
    ("Dilated(8, 3)", 1, 2, 2, 257, 65), ("BigBird(16, 3, 1, 2, seed=7)", 1, 2, 1, 300, 64),
    ("Neighborhood2D(20, 17, 7)", 1, 2, 2, 340, 32), ("BlockTopK(32, 4)", 1, 4, 2, 500, 64),
    ("SlidingWindow(256, 0)", 2, 8, 8, 1024, 64))


def sparse_run(spec, q, k, v, gqa):
    """sattn.torch.sparse_attention's out and the pattern's allowed keys as a 4-D bool mask [B, Hq, L, L]."""
    B, hq, L, _ = q.shape
    if spec.startswith("BlockTopK"):
        out, idx = st.sparse_attention(q, k, v, spec, enable_gqa=gqa, return_indices=True)
        allowed = torch.from_numpy(sattn.selection_mask(sattn.parse_pattern(spec), idx.numpy(), L, L))
    else:
        out = st.sparse_attention(q, k, v, spec, enable_gqa=gqa)
        allowed = torch.from_numpy(sattn.parse_pattern(spec).dense_mask(L, L, hq))
    return out, allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape)).expand(B, hq, L, L)


@pytest.mark.parametrize("target", ["default", "avx512bf16", "avx512"])
def test_bf16_sparse_attention_within_twice_torch(target):
    """bf16 inputs through sattn.torch.sparse_attention (a bf16 out and bf16 gradients: the sparse tiles' bf16
    products where the CPU has them, P and dS rounded once) against PyTorch's bf16 SDPA kernel with the pattern's
    dense mask (its flash kernel, which takes the mask as a 4-D additive one; with a bool mask torch computes in
    float32 instead, the sharper peer of test_half_inputs_on_float32_products_are_the_float32_results_rounded): the
    largest error of out, dq, dk and dv against the fp64 reference on the same values is at most twice torch's
    + 1e-5."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with on_target(target, "sparse tiles"):
        for n, (spec, B, hq, hkv, L, D) in enumerate(SPARSE_PROBLEMS):
            g = torch.Generator().manual_seed(200 + n)
            q = torch.randn(B, hq, L, D, generator=g).bfloat16().requires_grad_()
            k, v = (torch.randn(B, hkv, L, D, generator=g).bfloat16().requires_grad_() for _ in range(2))
            dout = torch.randn(B, hq, L, D, generator=g).bfloat16()
            gqa = hq != hkv
            ours, allowed = sparse_run(spec, q, k, v, gqa)
            assert ours.dtype == torch.bfloat16
            q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
            ref = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=allowed, enable_gqa=gqa)
            additive = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, float("-inf"))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # torch's bf16 kernel, or an error (no silent fallback)
                theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=gqa)
                grads_t = torch.autograd.grad(theirs, (q, k, v), dout)
            grads_ref = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
            grads_o = torch.autograd.grad(ours, (q, k, v), dout)
            for name, r, t, o in zip(("out", "dq", "dk", "dv"), (ref, *grads_ref), (theirs, *grads_t),
                                     (ours, *grads_o)):
                assert o.dtype == torch.bfloat16
                err_t = (t.double() - r).abs().max().item()
                err_o = (o.double() - r).abs().max().item()
                assert err_o <= 2 * err_t + 1e-5, (spec, name, err_o, err_t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target", ["avx512", "avx2"])
def test_half_inputs_on_float32_products_are_the_float32_results_rounded(target, dtype):
    """Where half-precision inputs take the float32 products (builds without bf16 products; float16 outside the amx
    forward), sattn.torch's out and gradients are bit for bit those of the same values in float32, rounded once to
    the inputs' dtype: the forward writes its out in float32 where a gradient may be needed, and the backward's
    Di = rowsum(dO * out) reads that one (from the rounded out it would carry out's rounding into dq and dk).
    Dense, causal, GQA, sparse (fixed and content-adaptive patterns) and packed variable-length calls."""
    cu = torch.tensor([0, 70, 71, 300], dtype=torch.int32)
    calls = {
        "sdpa causal gqa": ((1, 8, 2, 300, 64), lambda q, k, v: st.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)),
        "sparse": ((2, 4, 4, 333, 64), lambda q, k, v: st.sparse_attention(q, k, v, "SlidingWindow(64, 32)")),
        "sparse top-k": ((1, 4, 2, 260, 48), lambda q, k, v: st.sparse_attention(q, k, v, "BlockTopK(32, 3)",
                                                                                  enable_gqa=True)),
        "varlen": ((0, 4, 2, 300, 64), lambda q, k, v: st.flash_attn_varlen_func(q, k, v, cu, cu, 229, 229,
                                                                                  causal=True)),
    }
    with on_target(target, "float32 products"):
        for name, ((B, hq, hkv, L, D), fn) in calls.items():
            g = torch.Generator().manual_seed(len(name))
            shape = (lambda h: (L, h, D)) if B == 0 else (lambda h: (B, h, L, D))
            q = torch.randn(shape(hq), generator=g).to(dtype)
            k, v = (torch.randn(shape(hkv), generator=g).to(dtype) for _ in range(2))
            dout = torch.randn(shape(hq), generator=g).to(dtype)
            results = []
            for xs in ((q, k, v), (q.float(), k.float(), v.float())):
                xs = [x.clone().requires_grad_() for x in xs]
                out = fn(*xs)
                results.append([out, *torch.autograd.grad(out, xs, dout.to(out.dtype))])
            for what, half, single in zip(("out", "dq", "dk", "dv"), *results):
                assert half.dtype == dtype and torch.equal(half, single.to(dtype)), (name, what)


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
        with pytest.raises(err, match="float32_precision: expected 'highest', 'high' or 'bf16'"):
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
    with pytest.raises(sattn.InvalidArgumentError,
                       match="float32_precision: expected None, 'highest', 'high' or 'bf16'"):
        st.scaled_dot_product_attention(q, k, v, float32_precision="medium")


def test_float32_precision_high_takes_two_bf16_parts_on_amx():
    """float32_precision='high' (torch.set_float32_matmul_precision('high')): on the amx target the forward takes each
    float32 value as two bf16 parts: within 1e-4 of the float64 result (measured 1.4e-5 here), 50 times closer
    than 'bf16', and not the 'highest' bits; so does the backward (dq, dk, dv within 1e-4 of float64's, measured
    2.6e-5 to 3.3e-5 here, and 100 times closer than 'bf16'). Elsewhere 'high' is 'highest'. sattn.torch follows
    torch's 'high' setting the same way."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 4, 300, 64)).astype(np.float32) for _ in range(3))
    ref = sattn.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                             is_causal=True)
    highest, lse = sattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    high, high_lse = sattn.scaled_dot_product_attention(q, k, v, is_causal=True, float32_precision="high",
                                                        return_lse=True)
    rounded = sattn.scaled_dot_product_attention(q, k, v, is_causal=True, float32_precision="bf16")
    if sattn.simd_targets()["fused"] == "amx":
        err = np.abs(high - ref).max()
        assert 0 < np.abs(high - highest).max() and err <= 1e-4 and err * 50 <= np.abs(rounded - ref).max()
    else:
        np.testing.assert_array_equal(high, highest)
    do = rng.standard_normal(q.shape).astype(np.float32)
    _, ref_lse = sattn.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                                    is_causal=True, return_lse=True)
    grads_ref = sattn.scaled_dot_product_attention_backward(*(x.astype(np.float64) for x in (do, q, k, v, ref)),
                                                            ref_lse, is_causal=True)
    by_precision = {p: sattn.scaled_dot_product_attention_backward(do, q, k, v, highest, lse, is_causal=True,
                                                                   float32_precision=p)
                    for p in ("highest", "high", "bf16")}
    for x, (g_ref, g_highest, g_high, g_bf16) in enumerate(zip(grads_ref, *by_precision.values())):
        if sattn.simd_targets()["fused"] == "amx":
            err = np.abs(g_high - g_ref).max()
            print(f"grad {x}: 'high' error {err:.3g}, 'bf16' {np.abs(g_bf16 - g_ref).max():.3g}")
            assert 0 < np.abs(g_high - g_highest).max() and err <= 1e-4 and err * 100 <= np.abs(g_bf16 - g_ref).max()
        else:
            np.testing.assert_array_equal(g_high, g_highest)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        followed = st.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        grads = torch.autograd.grad(followed, (tq, tk, tv), torch.from_numpy(do))
    finally:
        torch.set_float32_matmul_precision(before)
    np.testing.assert_array_equal(followed.detach().numpy(), high)
    # the backward of that out and lse, under 'high' too
    for a, b in zip(grads, sattn.scaled_dot_product_attention_backward(do, q, k, v, high, high_lse, is_causal=True,
                                                                       float32_precision="high")):
        np.testing.assert_array_equal(a.numpy(), b)
    pattern = sattn.parse_pattern("SlidingWindow(40, 40)")  # the sparse engine: 'high' is 'highest'
    np.testing.assert_array_equal(sattn.sparse_attention(q, k, v, pattern, float32_precision="high"),
                                  sattn.sparse_attention(q, k, v, pattern))


def test_sparse_float32_precision_bf16_rounds_float32_inputs_only_where_the_cpu_has_bf16_products():
    """float32_precision on sparse attention (numpy API and sattn.torch, which also follows
    torch.set_float32_matmul_precision('medium')): the bf16 products for float32 inputs where the sparse tiles have
    them, forward and backward (out and gradients within 2e-2 of the float64 results), else bitwise the 'highest'
    results."""
    rng = np.random.default_rng(8)
    q, k, v, do = (rng.standard_normal((1, 4, 300, 64)).astype(np.float32) for _ in range(4))
    spec = "SlidingWindow(40, 40)"
    pattern = sattn.parse_pattern(spec)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    ref, ref_lse = sattn.sparse_attention(q64, k64, v64, pattern, return_lse=True)
    ref_grads = sattn.sparse_attention_backward(do64, q64, k64, v64, ref, ref_lse, pattern)[:3]
    highest = sattn.sparse_attention(q, k, v, pattern)
    rounded, rounded_lse = sattn.sparse_attention(q, k, v, pattern, float32_precision="bf16", return_lse=True)
    assert np.abs(highest - ref).max() <= 1e-5
    assert np.abs(rounded - ref).max() <= 2e-2
    bf16 = sattn.simd_targets()["sparse_tiles"] in ("amx", "avx512bf16")
    if bf16:
        assert np.abs(rounded - highest).max() > 1e-5  # the bf16 products ran
    else:
        np.testing.assert_array_equal(rounded, highest)
    with pytest.raises(sattn.InvalidArgumentError, match="float32_precision"):
        sattn.sparse_attention(q, k, v, pattern, float32_precision="medium")
    with pytest.raises(sattn.InvalidArgumentError, match="float32_precision"):
        sattn.sparse_attention_backward(do, q, k, v, rounded, rounded_lse, pattern, float32_precision="medium")
    np_grads = sattn.sparse_attention_backward(do, q, k, v, rounded, rounded_lse, pattern, float32_precision="bf16")
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    dout = torch.from_numpy(do)
    before = torch.get_float32_matmul_precision()
    try:
        grads = {}
        for setting, precision in (("medium", None), ("highest", "bf16"), ("highest", None), ("medium", "highest")):
            torch.set_float32_matmul_precision(setting)
            o = st.sparse_attention(tq, tk, tv, spec, float32_precision=precision)
            rounded_here = precision == "bf16" or (precision is None and setting == "medium")
            np.testing.assert_array_equal(o.detach().numpy(), rounded if rounded_here else highest)
            got = torch.autograd.grad(o, (tq, tk, tv), dout)
            if rounded_here in grads:  # the same gradients however the precision was asked for
                for a, b in zip(grads[rounded_here], got):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
            grads[rounded_here] = got
            o2 = st.sparse_attention(tq.detach(), tk.detach(), tv.detach(), spec, float32_precision=precision)
            np.testing.assert_array_equal(o2.numpy(), o.detach().numpy())  # the inference route too
        for r, g_high, g_low, g_np in zip(ref_grads, grads[False], grads[True], np_grads):
            scale = max(1.0, np.abs(r).max())
            assert np.abs(g_high.numpy() - r).max() <= 1e-4 * scale
            assert np.abs(g_low.numpy() - r).max() <= 2e-2 * scale
            np.testing.assert_array_equal(g_low.numpy(), g_np)  # the numpy backward takes float32_precision too
            if bf16:
                assert (g_low - g_high).abs().max().item() > 1e-5  # the backward's bf16 products ran
    finally:
        torch.set_float32_matmul_precision(before)
