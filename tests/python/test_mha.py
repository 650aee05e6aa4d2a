"""sattn.MultiheadAttention against torch.nn.MultiheadAttention (PyTorch 2.x, the outside oracle).

Recipe (the seeds'): build torch's module, perturb every parameter (so biases are non-zero), copy its
state_dict into sattn with load_state_dict, run both on the same inputs. Tolerance: max|diff| <= 1e-5 *
max(1, max|torch|) in float32, 1e-10 in float64. Where torch 2.x refuses an input (uint8 masks, float masks of
another dtype) sattn must refuse it too; where torch's result depends on its execution path (fully masked rows,
is_causal hints) the tests pin down torch's behaviour on each path beside sattn's. Without torch (the numpy-1
run) the torch tests skip visibly and the rest runs (torch_oracle.py).
"""
import contextlib
import os
import tempfile
import threading
import warnings

import numpy as np
import pytest

import sattn
import safetensors_py
from torch_oracle import needs_torch, torch

TOL32, TOL64 = 1e-5, 1e-10


def assert_close(got, ref, tol, what="output"):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != torch {ref.shape}"
    if got.size == 0:
        return
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    assert np.isfinite(ref).all(), f"{what}: torch gave non-finite values"
    err = np.abs(got - ref).max()
    scale = max(1.0, np.abs(ref).max())
    assert err <= tol * scale, f"{what}: max |sattn - torch| = {err:.3g} > {tol} * {scale:.3g}"


def make_pair(E, H, seed=0, dtype="float32", **kw):
    """(torch module, sattn module) with identical, perturbed parameters."""
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(E, H, **kw)
    if dtype == "float64":
        t = t.double()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(0.2 * torch.randn_like(p))
    s = sattn.MultiheadAttention(E, H, **kw, dtype=dtype)
    s.load_state_dict({k: v.numpy() for k, v in t.state_dict().items()})
    return t, s


def inputs(rng, N, L, S, E, kdim, vdim, batch_first, batched=True, dtype=np.float32):
    def one(length, dim):
        shape = ((N, length, dim) if batch_first else (length, N, dim)) if batched else (length, dim)
        return rng.standard_normal(shape).astype(dtype)
    return one(L, E), one(S, kdim), one(S, vdim)


def bool_attn_mask(rng, shape):
    m = rng.random(shape) < 0.35
    m[..., 0] = False  # key 0 always allowed: no fully masked rows (tested on their own below)
    return m


def float_attn_mask(rng, shape, dtype=np.float32):
    m = rng.standard_normal(shape).astype(dtype)
    m[rng.random(shape) < 0.2] = -np.inf
    m[..., 0] = rng.standard_normal(m[..., 0].shape)
    return m


def bool_kpm(rng, shape):
    m = rng.random(shape) < 0.3
    m[..., 0] = False
    return m


def float_kpm(rng, shape, dtype=np.float32):
    m = rng.standard_normal(shape).astype(dtype)
    m[rng.random(shape) < 0.25] = -np.inf
    m[..., 0] = 0.5
    return m


def causal_mask(L, S, kind="bool", dtype=np.float32):
    """The mask torch's is_causal hint stands for: masked where j > i (bool True, or float -inf; else False / 0)."""
    above = np.triu(np.ones((L, S), bool), 1)
    return above if kind == "bool" else np.where(above, -np.inf, 0).astype(dtype)


def torch_forward(t, q, k, v, fast_path=True, **kw):
    """torch's forward, without autograd (so that its eval fast path can run; fast_path=False disables it)."""
    tq = torch.from_numpy(q)
    tk = tq if k is q else torch.from_numpy(k)
    tv = tk if v is k else torch.from_numpy(v)
    kw = {name: (torch.from_numpy(x if x.flags.writeable else x.copy()) if isinstance(x, np.ndarray) else x)
          for name, x in kw.items()}
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fast_path)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # torch 2.x deprecates a bool key_padding_mask next to a float attn_mask (and the reverse); both work.
            warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask and attn_mask")
            o, w = t(tq, tk, tv, **kw)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    return o.numpy(), (None if w is None else w.numpy())


def check_parity(t, s, q, k, v, tol=TOL32, fast_path=True, **kw):
    o_ref, w_ref = torch_forward(t, q, k, v, fast_path=fast_path, **kw)
    o, w = s(q, k, v, **kw)
    assert o.dtype == q.dtype
    assert_close(o, o_ref, tol, "attn_output")
    if kw.get("need_weights", True):
        assert w is not None
        assert_close(w, w_ref, tol, "attn_weights")
    else:
        assert w is None and w_ref is None
    return o, w


# ---------------------------------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("average_attn_weights", [False, True])
def test_parity_layouts_and_weights(batch_first, need_weights, average_attn_weights):
    rng = np.random.default_rng(1)
    N, L, S, E, H = 3, 5, 7, 16, 4
    t, s = make_pair(E, H, seed=2, batch_first=batch_first)
    q, k, v = inputs(rng, N, L, S, E, E, E, batch_first)
    check_parity(t, s, q, k, v, key_padding_mask=bool_kpm(rng, (N, S)), attn_mask=float_attn_mask(rng, (L, S)),
                 need_weights=need_weights, average_attn_weights=average_attn_weights)


MASKS = ["none", "bool2d", "bool3d", "float2d", "float3d"]


@needs_torch
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kpm", ["none", "bool", "float"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_parity_masks(mask, kpm, need_weights):
    """Every attn_mask / key_padding_mask combination, given to torch as is (a float key_padding_mask is added to
    the scores, also next to a float attn_mask)."""
    rng = np.random.default_rng(3)
    N, L, S, E, H = 2, 6, 9, 12, 3
    t, s = make_pair(E, H, seed=4)
    q, k, v = inputs(rng, N, L, S, E, E, E, False)
    shape = (L, S) if mask.endswith("2d") else (N * H, L, S)
    am = {"none": None, "bool2d": bool_attn_mask(rng, shape), "bool3d": bool_attn_mask(rng, shape),
          "float2d": float_attn_mask(rng, shape), "float3d": float_attn_mask(rng, shape)}[mask]
    kp = {"none": None, "bool": bool_kpm(rng, (N, S)), "float": float_kpm(rng, (N, S))}[kpm]
    check_parity(t, s, q, k, v, key_padding_mask=kp, attn_mask=am, need_weights=need_weights,
                 average_attn_weights=False)


@needs_torch
@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64])
def test_integer_masks_are_refused_as_in_torch(which, dtype):
    """torch 2.x supports only bool and floating masks (uint8 included: it was deprecated and is now refused)."""
    rng = np.random.default_rng(31)
    N, L, S, E, H = 2, 4, 5, 8, 2
    t, s = make_pair(E, H, seed=32)
    q, k, v = inputs(rng, N, L, S, E, E, E, False)
    mask = (bool_attn_mask(rng, (L, S)) if which == "attn_mask" else bool_kpm(rng, (N, S))).astype(dtype)
    with pytest.raises(AssertionError, match=f"only bool and floating types of {which} are supported"):
        torch_forward(t, q, k, v, **{which: mask})
    name = np.dtype(dtype).name
    with pytest.raises(sattn.DTypeError, match=rf"{which}: expected bool \(True = .*\) or a float mask of the "
                                               rf"query's dtype \(float32, .*got {name}"):
        s(q, k, v, **{which: mask})
    with pytest.raises(TypeError, match=which):  # DTypeError is a TypeError
        s(q, k, v, **{which: mask}, need_weights=False)


@needs_torch
@pytest.mark.parametrize("which", ["attn_mask", "key_padding_mask"])
@pytest.mark.parametrize("query_dtype,mask_dtype", [("float32", "float64"), ("float32", "float16"),
                                                    ("float64", "float32")])
@pytest.mark.parametrize("need_weights", [True, False])
def test_float_masks_of_another_dtype_are_refused(which, query_dtype, mask_dtype, need_weights):
    """torch 2.x refuses a float mask whose dtype is not the query's ("Input dtypes must be the same" with
    need_weights=True, SDPA's "Expected attn_mask dtype to be bool or float or to match query dtype" without),
    except a float32 mask with float64 queries and need_weights=False, which its SDPA accepts. sattn refuses every
    one (the documented difference)."""
    rng = np.random.default_rng(33)
    N, L, S, E, H = 2, 4, 5, 8, 2
    t, s = make_pair(E, H, seed=34, dtype=query_dtype)
    q, k, v = inputs(rng, N, L, S, E, E, E, False, dtype=np.dtype(query_dtype))
    mask = (float_attn_mask(rng, (L, S)) if which == "attn_mask" else float_kpm(rng, (N, S))).astype(mask_dtype)
    kw = {which: mask, "need_weights": need_weights}
    torch_accepts = not need_weights and mask_dtype == "float32"
    with (contextlib.nullcontext() if torch_accepts else pytest.raises(RuntimeError, match="dtype")):
        torch_forward(t, q, k, v, **kw)
    with pytest.raises(sattn.DTypeError, match=rf"{which}: a float mask must have the query's dtype "
                                               rf"\({query_dtype}\), got {mask_dtype}"):
        s(q, k, v, **kw)


@needs_torch
@pytest.mark.parametrize("kdim,vdim", [(5, 5), (6, 10), (16, 3), (None, 7)])
@pytest.mark.parametrize("batch_first", [False, True])
def test_parity_kdim_vdim(kdim, vdim, batch_first):
    rng = np.random.default_rng(5)
    N, L, S, E, H = 2, 4, 6, 16, 2
    t, s = make_pair(E, H, seed=6, kdim=kdim, vdim=vdim, batch_first=batch_first)
    assert not s._qkv_same_embed_dim
    assert "q_proj_weight" in s.state_dict() and "in_proj_weight" not in s.state_dict()
    q, k, v = inputs(rng, N, L, S, E, kdim or E, vdim or E, batch_first)
    check_parity(t, s, q, k, v, key_padding_mask=bool_kpm(rng, (N, S)),
                 attn_mask=bool_attn_mask(rng, (N * H, L, S)))


@needs_torch
@pytest.mark.parametrize("add_bias_kv", [False, True])
@pytest.mark.parametrize("add_zero_attn", [False, True])
@pytest.mark.parametrize("mask", ["none", "bool2d", "float3d"])
@pytest.mark.parametrize("kpm", ["none", "bool", "float"])
def test_parity_bias_kv_zero_attn(add_bias_kv, add_zero_attn, mask, kpm):
    rng = np.random.default_rng(7)
    N, L, S, E, H = 2, 5, 4, 8, 2
    t, s = make_pair(E, H, seed=8, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    q, k, v = inputs(rng, N, L, S, E, E, E, False)
    am = {"none": None, "bool2d": bool_attn_mask(rng, (L, S)), "float3d": float_attn_mask(rng, (N * H, L, S))}[mask]
    kp = {"none": None, "bool": bool_kpm(rng, (N, S)), "float": float_kpm(rng, (N, S))}[kpm]
    _, w = check_parity(t, s, q, k, v, key_padding_mask=kp, attn_mask=am, average_attn_weights=False)
    assert w.shape == (N, H, L, S + add_bias_kv + add_zero_attn)


@needs_torch
@pytest.mark.parametrize("batch_first", [False, True])
def test_parity_no_bias(batch_first):
    rng = np.random.default_rng(9)
    t, s = make_pair(8, 4, seed=10, bias=False, batch_first=batch_first)
    assert set(s.state_dict()) == {"in_proj_weight", "out_proj.weight"}
    q, k, v = inputs(rng, 2, 3, 5, 8, 8, 8, batch_first)
    check_parity(t, s, q, k, v, attn_mask=float_attn_mask(rng, (3, 5)))


@needs_torch
@pytest.mark.parametrize("mask", ["none", "bool2d", "bool3d", "float3d"])
@pytest.mark.parametrize("average_attn_weights", [False, True])
def test_parity_unbatched(mask, average_attn_weights):
    rng = np.random.default_rng(11)
    L, S, E, H = 4, 6, 12, 3
    t, s = make_pair(E, H, seed=12, batch_first=True, add_zero_attn=True)
    q, k, v = inputs(rng, 1, L, S, E, E, E, True, batched=False)
    am = {"none": None, "bool2d": bool_attn_mask(rng, (L, S)), "bool3d": bool_attn_mask(rng, (H, L, S)),
          "float3d": float_attn_mask(rng, (H, L, S))}[mask]
    o, w = check_parity(t, s, q, k, v, key_padding_mask=bool_kpm(rng, (S,)), attn_mask=am,
                        average_attn_weights=average_attn_weights)
    assert o.shape == (L, E)
    assert w.shape == ((L, S + 1) if average_attn_weights else (H, L, S + 1))


@needs_torch
@pytest.mark.parametrize("kpm", ["none", "bool"])
@pytest.mark.parametrize("mask", ["none", "bool2d"])
@pytest.mark.parametrize("fast_path", [True, False])
def test_parity_self_attention_eval_fast_path(kpm, mask, fast_path):
    """eval + batch_first + query is key is value + an even number of heads + no autograd: torch 2.x runs its
    fast path (torch._native_multi_head_attention) unless it is disabled; sattn matches both paths."""
    rng = np.random.default_rng(13)
    N, L, E, H = 3, 7, 16, 4
    t, s = make_pair(E, H, seed=14, batch_first=True)
    t.eval()
    s.eval()
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    kw = dict(key_padding_mask=None if kpm == "none" else bool_kpm(rng, (N, L)),
              attn_mask=None if mask == "none" else bool_attn_mask(rng, (L, L)))
    check_parity(t, s, x, x, x, fast_path=fast_path, **kw)
    check_parity(t, s, x, x, x, fast_path=fast_path, **kw, need_weights=False)


@needs_torch
@pytest.mark.parametrize("batch_first", [False, True])
def test_parity_float64(batch_first):
    rng = np.random.default_rng(15)
    N, L, S, E, H = 2, 5, 8, 12, 2
    t, s = make_pair(E, H, seed=16, dtype="float64", batch_first=batch_first, add_bias_kv=True, kdim=7)
    q, k, v = inputs(rng, N, L, S, E, 7, E, batch_first, dtype=np.float64)
    for kpm in (bool_kpm(rng, (N, S)), float_kpm(rng, (N, S), np.float64)):
        check_parity(t, s, q, k, v, tol=TOL64, key_padding_mask=kpm,
                     attn_mask=float_attn_mask(rng, (N * H, L, S), np.float64), average_attn_weights=False)


@needs_torch
@pytest.mark.parametrize("seed", range(40))
def test_parity_random_configurations(seed):
    rng = np.random.default_rng(1000 + seed)
    H = int(rng.choice([1, 2, 3, 4]))
    E = H * int(rng.integers(1, 9))
    N, L, S = int(rng.integers(1, 4)), int(rng.integers(1, 10)), int(rng.integers(1, 10))
    batched = rng.random() < 0.8
    self_attn = rng.random() < 0.25
    kw = dict(batch_first=bool(rng.random() < 0.5), bias=bool(rng.random() < 0.7),
              add_bias_kv=bool(rng.random() < 0.3), add_zero_attn=bool(rng.random() < 0.3))
    if not self_attn and rng.random() < 0.4:
        kw["kdim"] = int(rng.integers(1, 12))
        kw["vdim"] = int(rng.integers(1, 12))
    if self_attn:
        S = L
    t, s = make_pair(E, H, seed=seed, **kw)
    if rng.random() < 0.5:
        t.eval()
        s.eval()
    q, k, v = inputs(rng, N, L, S, E, kw.get("kdim") or E, kw.get("vdim") or E, kw["batch_first"], batched)
    if self_attn:
        k = v = q
    Nm = N if batched else 1
    mask = rng.choice(["none", "bool2d", "bool3d", "float2d", "float3d", "causal"])
    shape = (L, S) if mask.endswith("2d") else (Nm * H, L, S)
    is_causal = mask == "causal" and not (kw["add_bias_kv"] or kw["add_zero_attn"])  # the hint where sattn takes it
    am = (None if mask == "none" else causal_mask(L, S, rng.choice(["bool", "float"])) if mask == "causal"
          else bool_attn_mask(rng, shape) if mask.startswith("bool") else float_attn_mask(rng, shape))
    kpm_shape = (N, S) if batched else (S,)
    kpm_kind = rng.choice(["none", "bool", "float"])
    kp = {"none": None, "bool": bool_kpm(rng, kpm_shape), "float": float_kpm(rng, kpm_shape)}[kpm_kind]
    call = dict(key_padding_mask=kp, attn_mask=am, need_weights=bool(rng.random() < 0.7),
                average_attn_weights=bool(rng.random() < 0.5), is_causal=is_causal)
    check_parity(t, s, q, k, v, **call)


# ---- fully masked rows ------------------------------------------------------------------------------------
def _fully_masked_problem():
    rng = np.random.default_rng(17)
    N, L, E, H = 2, 4, 8, 2
    t, s = make_pair(E, H, seed=18, batch_first=True)
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    am = bool_attn_mask(rng, (L, L))
    am[1, :] = True  # query row 1 may attend to nothing
    kpm = np.zeros((N, L), bool)
    kpm[1, :] = True  # batch entry 1: every key is padding
    dead = np.zeros((N, L), bool)
    dead[:, 1] = dead[1, :] = True
    return t, s, x, am, kpm, dead


@needs_torch
@pytest.mark.parametrize("mask", ["bool", "float"])
def test_fully_masked_rows_need_weights_false_match_torch(mask):
    """need_weights=False: torch 2.x runs scaled_dot_product_attention, which gives attention 0 in a row with no
    allowed key, so attn_output = out_proj.bias there, as sattn. Compared over every row, in training mode (torch
    leaves its fast path) and in eval mode with torch's fast path disabled."""
    t, s, x, am, kpm, dead = _fully_masked_problem()
    if mask == "float":
        am = np.where(am, -np.inf, 0).astype(np.float32)
    bias = s.state_dict()["out_proj.bias"]
    for mode in ("train", "eval"):
        t.train(mode == "train")
        s.train(mode == "train")
        o, _ = check_parity(t, s, x, x, x, fast_path=False, attn_mask=am, key_padding_mask=kpm, need_weights=False)
        np.testing.assert_allclose(o[dead], np.broadcast_to(bias, o[dead].shape), rtol=0, atol=1e-6)


@needs_torch
def test_fully_masked_rows_are_zero_where_torch_gives_nan():
    """need_weights=True: torch 2.x computes softmax explicitly and gives NaN output and weights in a row with no
    allowed key; so does its eval fast path, even with need_weights=False. sattn gives attention 0
    (attn_output = out_proj.bias) and weights 0 there, and torch's values in every other row."""
    t, s, x, am, kpm, dead = _fully_masked_problem()
    bias = s.state_dict()["out_proj.bias"]
    for mode, need_weights in (("train", True), ("eval", True), ("eval", False)):
        t.train(mode == "train")
        s.train(mode == "train")
        o_ref, w_ref = torch_forward(t, x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=need_weights,
                                     average_attn_weights=False)
        o, w = s(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=need_weights, average_attn_weights=False)
        assert np.isnan(o_ref[dead]).all() and np.isfinite(o_ref[~dead]).all(), (mode, need_weights)
        np.testing.assert_allclose(o[dead], np.broadcast_to(bias, o[dead].shape), rtol=0, atol=1e-6)
        assert_close(o[~dead], o_ref[~dead], TOL32)
        if need_weights:
            w_dead = np.broadcast_to(dead[:, None, :, None], w.shape)
            assert np.isnan(w_ref[w_dead]).all()
            assert (w[w_dead] == 0).all()
            assert_close(w[~w_dead], w_ref[~w_dead], TOL32, "attn_weights")


# ---- is_causal --------------------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("kpm", [False, True])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_is_causal_with_the_causal_mask_matches_torch(kind, need_weights, kpm, mode):
    """A correct hint: torch 2.x gives the masked result on each of its paths (SDPA's is_causal for
    need_weights=False without key_padding_mask, the mask otherwise; eval with batch_first and self-attention
    runs its fast path), and sattn the same."""
    rng = np.random.default_rng(19)
    N, L, E, H = 2, 6, 8, 2
    t, s = make_pair(E, H, seed=20, batch_first=True)
    t.train(mode == "train")
    s.train(mode == "train")
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    kw = dict(attn_mask=causal_mask(L, L, kind), key_padding_mask=bool_kpm(rng, (N, L)) if kpm else None,
              need_weights=need_weights, average_attn_weights=False)
    o, w = check_parity(t, s, x, x, x, **kw, is_causal=True)
    o_nohint, w_nohint = s(x, x, x, **kw)
    np.testing.assert_allclose(o, o_nohint, rtol=0, atol=1e-6)
    if need_weights:
        iu = np.triu_indices(L, 1)
        assert (w[:, :, iu[0], iu[1]] == 0).all()


@needs_torch
def test_is_causal_l_neq_s_and_3d_masks():
    """L != S (the top-left causal mask [L, S]) and a 3-D mask whose every slice is causal."""
    rng = np.random.default_rng(21)
    N, L, S, E, H = 2, 4, 7, 8, 2
    t, s = make_pair(E, H, seed=22, kdim=5, vdim=3)
    q, k, v = inputs(rng, N, L, S, E, 5, 3, False)
    m3 = np.broadcast_to(causal_mask(L, S), (N * H, L, S))
    for am in (causal_mask(L, S), causal_mask(L, S, "float"), m3):
        for need_weights in (True, False):
            check_parity(t, s, q, k, v, attn_mask=am, is_causal=True, need_weights=need_weights)


@needs_torch
def test_is_causal_requires_attn_mask():
    rng = np.random.default_rng(23)
    t, s = make_pair(8, 2, seed=24)
    x = rng.standard_normal((6, 2, 8)).astype(np.float32)
    with pytest.raises(RuntimeError, match="Need attn_mask if specifying the is_causal hint"):
        torch_forward(t, x, x, x, is_causal=True)
    with pytest.raises(sattn.InvalidArgumentError, match="is_causal.*requires attn_mask"):
        s(x, x, x, is_causal=True)


@needs_torch
@pytest.mark.parametrize("kind", ["bool", "bool3d", "float_bias"])
def test_is_causal_with_another_mask_is_refused(kind):
    """A wrong hint: torch 2.x applies SDPA's causal mask instead of attn_mask on one path (need_weights=False
    without key_padding_mask) and attn_mask on the others, so its result depends on need_weights. sattn refuses
    it, naming the first element that differs from the causal mask."""
    rng = np.random.default_rng(25)
    N, L, E, H = 2, 5, 8, 2
    t, s = make_pair(E, H, seed=26)
    x = rng.standard_normal((L, N, E)).astype(np.float32)
    if kind == "bool":
        am, where = bool_attn_mask(rng, (L, L)), None
    elif kind == "bool3d":
        am = np.broadcast_to(causal_mask(L, L), (N * H, L, L)).copy()
        am[3, 2, 4] = False
        where = r"attn_mask\[3, 2, 4\] = False, expected True"
    else:  # a causal -inf mask with finite biases below the diagonal (e.g. ALiBi)
        am = np.where(causal_mask(L, L), -np.inf, rng.standard_normal((L, L))).astype(np.float32)
        where = r"attn_mask\[0, 0\] = .*, expected 0"
    kw = dict(attn_mask=am, is_causal=True)
    o_weights, _ = torch_forward(t, x, x, x, **kw, need_weights=True)
    o_sdpa, _ = torch_forward(t, x, x, x, **kw, need_weights=False)
    o_mask, _ = torch_forward(t, x, x, x, attn_mask=am)
    o_causal, _ = torch_forward(t, x, x, x, attn_mask=causal_mask(L, L), need_weights=False)
    assert_close(o_weights, o_mask, TOL32)  # need_weights=True: attn_mask as given
    assert_close(o_sdpa, o_causal, TOL32)  # need_weights=False: the causal mask, attn_mask ignored
    assert np.abs(o_sdpa - o_weights).max() > 1e-3
    with pytest.raises(sattn.InvalidArgumentError, match=where or "is_causal: a hint that attn_mask is the causal"):
        s(x, x, x, **kw)
    o, _ = s(x, x, x, attn_mask=am)  # without the hint: attn_mask as given, torch's result on every path
    assert_close(o, o_mask, TOL32)


@needs_torch
@pytest.mark.parametrize("extra", ["add_bias_kv", "add_zero_attn"])
def test_is_causal_with_appended_keys_is_refused(extra):
    """add_bias_kv / add_zero_attn append a key column after the mask's S columns. With the causal hint torch
    2.x's SDPA path (need_weights=False, no key_padding_mask) hides it from queries i < S, its other paths let
    every query attend it: even a correct hint gives two results. sattn refuses the combination."""
    rng = np.random.default_rng(27)
    N, L, E, H = 2, 5, 8, 2
    t, s = make_pair(E, H, seed=28, **{extra: True})
    x = rng.standard_normal((L, N, E)).astype(np.float32)
    kw = dict(attn_mask=causal_mask(L, L), is_causal=True)
    o_weights, _ = torch_forward(t, x, x, x, **kw, need_weights=True)
    o_sdpa, _ = torch_forward(t, x, x, x, **kw, need_weights=False)
    assert np.abs(o_sdpa - o_weights).max() > 1e-3
    with pytest.raises(sattn.InvalidArgumentError, match=f"is_causal: not supported with add_bias_kv or add_zero_attn"):
        s(x, x, x, **kw)
    check_parity(t, s, x, x, x, attn_mask=causal_mask(L, L))  # the mask alone: torch's result on every path


@needs_torch
def test_train_eval_and_dropout():
    rng = np.random.default_rng(21)
    N, L, E, H, p = 2, 32, 8, 2, 0.5
    t, s = make_pair(E, H, seed=22, dropout=p, batch_first=True)
    assert s.training
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    assert s.eval() is s and not s.training
    o_eval, w_eval = check_parity(t.eval(), s, x, x, x, average_attn_weights=False)  # eval: no dropout
    assert s.train() is s and s.training
    s.set_dropout_seed(5)
    o1, w1 = s(x, x, x, average_attn_weights=False)
    o2, w2 = s(x, x, x, average_attn_weights=False)
    s.set_dropout_seed(5)
    o3, w3 = s(x, x, x, average_attn_weights=False)
    np.testing.assert_array_equal(o1, o3)  # reproducible from the seed
    assert not np.array_equal(w1, w2)  # a fresh stream on every call, as torch
    kept = w1 != 0
    assert 0.4 < kept.mean() < 0.6
    # returned weights are after dropout (as torch): kept ones scaled by 1/(1-p)
    np.testing.assert_allclose(w1[kept], w_eval[kept] / (1 - p), rtol=1e-5, atol=1e-7)
    s.train(False)
    assert not s.training


def test_dropout_one_in_training_drops_everything():
    s = sattn.MultiheadAttention(8, 2, dropout=1.0, seed=1)
    s.load_state_dict({k: v + 0.1 for k, v in s.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32)
    o, w = s(x, x, x)
    assert (w == 0).all()
    np.testing.assert_allclose(o, np.broadcast_to(s.state_dict()["out_proj.bias"], o.shape), atol=1e-7)
    s.eval()
    assert (s(x, x, x)[1] > 0).all()


# ---------------------------------------------------------------------------------------------------------
def test_constructor_defaults_and_state_dict_layout():
    s = sattn.MultiheadAttention(12, 3)
    assert (s.embed_dim, s.num_heads, s.head_dim, s.kdim, s.vdim, s.dropout, s.batch_first) == (12, 3, 4, 12, 12,
                                                                                                0.0, False)
    sd = s.state_dict()
    assert list(sd) == ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    assert sd["in_proj_weight"].shape == (36, 12) and sd["in_proj_weight"].dtype == np.float32
    assert (sd["in_proj_bias"] == 0).all() and (sd["out_proj.bias"] == 0).all()
    bound = np.sqrt(6 / (12 + 36))  # xavier_uniform on [3E, E]
    assert np.abs(sd["in_proj_weight"]).max() <= bound and np.abs(sd["in_proj_weight"]).std() > bound / 4
    s2 = sattn.MultiheadAttention(8, 2, 0.0, True, True, False, 5, 6, True, dtype=np.float64, seed=3)
    assert list(s2.state_dict()) == ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "bias_k",
                                     "bias_v", "out_proj.weight", "out_proj.bias"]
    assert s2.state_dict()["k_proj_weight"].shape == (8, 5) and s2.state_dict()["bias_k"].shape == (1, 1, 8)
    assert s2.state_dict()["q_proj_weight"].dtype == np.float64
    # seeded init: same seed -> same weights, other seed -> different
    a = sattn.MultiheadAttention(8, 2, seed=7).state_dict()["in_proj_weight"]
    b = sattn.MultiheadAttention(8, 2, seed=7).state_dict()["in_proj_weight"]
    c = sattn.MultiheadAttention(8, 2, seed=8).state_dict()["in_proj_weight"]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_usable_without_weights_and_float64_inputs():
    s = sattn.MultiheadAttention(8, 2, seed=1)
    x = np.random.default_rng(0).standard_normal((4, 2, 8))
    o, w = s(x, x, x)
    assert o.dtype == np.float64 and o.shape == (4, 2, 8) and w.shape == (2, 4, 4)
    np.testing.assert_allclose(w.sum(-1), 1, atol=1e-12)
    o32, _ = s(x.astype(np.float32), x.astype(np.float32), x.astype(np.float32))
    assert o32.dtype == np.float32
    np.testing.assert_allclose(o32, o, atol=1e-5)


def test_strided_inputs_match_contiguous():
    s = sattn.MultiheadAttention(8, 2, seed=2, batch_first=True)
    rng = np.random.default_rng(1)
    big = rng.standard_normal((3, 10, 16)).astype(np.float32)
    q = big[:, ::2, ::2]  # non-contiguous
    kpm = np.zeros((3, 10), bool)[:, ::2]
    o, w = s(q, q[:, ::-1], q, key_padding_mask=kpm)  # negative strides are copied
    oc, wc = s(np.ascontiguousarray(q), np.ascontiguousarray(q[:, ::-1]), np.ascontiguousarray(q),
               key_padding_mask=np.ascontiguousarray(kpm))
    np.testing.assert_array_equal(o, oc)
    np.testing.assert_array_equal(w, wc)


def test_threads_release_gil_and_agree():
    s = sattn.MultiheadAttention(32, 4, seed=3).eval()
    x = np.random.default_rng(2).standard_normal((64, 4, 32)).astype(np.float32)
    ref = s(x, x, x)[0]
    results = [None] * 4

    def work(i):
        results[i] = s(x, x, x)[0]
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r in results:
        np.testing.assert_array_equal(r, ref)


# ---------------------------------------------------------------------------------------------------------
def good_state(E=8, H=2, **kw):
    s = sattn.MultiheadAttention(E, H, **kw)
    return s, s.state_dict()


def test_load_state_dict_missing_key():
    s, sd = good_state()
    del sd["in_proj_bias"]
    with pytest.raises(ValueError, match="missing key.*'in_proj_bias'"):
        s.load_state_dict(sd)


def test_load_state_dict_unexpected_key():
    s, sd = good_state()
    sd["bias_k"] = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="unexpected key.*'bias_k'"):
        s.load_state_dict(sd)


def test_load_state_dict_wrong_shape_names_key_expected_and_given():
    s, sd = good_state()
    before = s.state_dict()
    sd["out_proj.weight"] = np.zeros((8, 7), np.float32)
    sd["in_proj_weight"] = sd["in_proj_weight"] + 1  # must not be applied when another key is bad
    with pytest.raises(ValueError, match=r"'out_proj.weight': expected shape \[8, 8\], got \[8, 7\]"):
        s.load_state_dict(sd)
    np.testing.assert_array_equal(s.state_dict()["in_proj_weight"], before["in_proj_weight"])


def test_load_state_dict_wrong_dtype_and_non_strict():
    s, sd = good_state()
    sd["in_proj_bias"] = np.zeros(24, np.int64)
    with pytest.raises(TypeError, match="in_proj_bias"):
        s.load_state_dict(sd)
    s, sd = good_state()
    new_bias = np.arange(8, dtype=np.float32)
    s.load_state_dict({"out_proj.bias": new_bias, "junk": np.zeros(1)}, strict=False)
    np.testing.assert_array_equal(s.state_dict()["out_proj.bias"], new_bias)
    np.testing.assert_array_equal(s.state_dict()["in_proj_weight"], sd["in_proj_weight"])


def test_constructor_errors():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        sattn.MultiheadAttention(10, 3)
    with pytest.raises(ValueError, match="num_heads"):
        sattn.MultiheadAttention(8, 0)
    with pytest.raises(ValueError, match="dropout"):
        sattn.MultiheadAttention(8, 2, dropout=1.5)
    with pytest.raises(TypeError, match="dtype"):
        sattn.MultiheadAttention(8, 2, dtype=np.int32)
    with pytest.raises(ValueError, match="device"):
        sattn.MultiheadAttention(8, 2, device="cuda")


@pytest.mark.parametrize("case", ["query_dim", "query_rank", "key_rank", "batch", "value_len", "kdim", "kpm_shape",
                                  "mask2d", "mask3d", "mask4d", "zero_len"])
def test_forward_shape_errors(case):
    s = sattn.MultiheadAttention(8, 2, kdim=5)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((4, 2, 8)).astype(np.float32)
    k = rng.standard_normal((6, 2, 5)).astype(np.float32)
    v = rng.standard_normal((6, 2, 8)).astype(np.float32)
    kw = {}
    expect = {"query_dim": "query: expected last dimension embed_dim = 8", "query_rank": "query: expected a 3-D",
              "key_rank": "key/value: expected 3-D", "batch": "expected batch size N = 2",
              "value_len": "value: expected source length S = 6", "kdim": "key: expected last dimension kdim = 5",
              "kpm_shape": r"key_padding_mask: expected shape \[N, S\] = \[2, 6\]",
              "mask2d": r"attn_mask: expected a 2-D mask \[L, S\] = \[4, 6\]",
              "mask3d": r"\[N\*num_heads, L, S\] = \[4, 4, 6\], got shape \[2, 4, 6\]",
              "mask4d": "attn_mask: expected", "zero_len": "zero-size"}[case]
    if case == "query_dim":
        q = q[..., :6]
    elif case == "query_rank":
        q = q[None]
    elif case == "key_rank":
        k = k[0]
    elif case == "batch":
        k, v = k[:, :1], v[:, :1]
    elif case == "value_len":
        v = v[:5]
    elif case == "kdim":
        k = rng.standard_normal((6, 2, 8)).astype(np.float32)
    elif case == "kpm_shape":
        kw["key_padding_mask"] = np.zeros((6, 2), bool)
    elif case == "mask2d":
        kw["attn_mask"] = np.zeros((6, 4), bool)
    elif case == "mask3d":
        kw["attn_mask"] = np.zeros((2, 4, 6), np.float32)
    elif case == "mask4d":
        kw["attn_mask"] = np.zeros((2, 2, 4, 6), np.float32)
    elif case == "zero_len":
        q = q[:0]
    with pytest.raises(ValueError, match=expect):
        s(q, k, v, **kw)


def test_forward_dtype_errors():
    s = sattn.MultiheadAttention(8, 2)
    x = np.zeros((3, 1, 8), np.float32)
    with pytest.raises(TypeError, match="query: expected float32 or float64"):
        s(x.astype(np.int32), x, x)
    with pytest.raises(TypeError, match="dtype of query"):
        s(x, x.astype(np.float64), x)
    with pytest.raises(TypeError, match="key_padding_mask"):
        s(x, x, x, key_padding_mask=np.zeros((1, 3), np.int64))
    with pytest.raises(TypeError, match="attn_mask"):
        s(x, x, x, attn_mask=np.zeros((3, 3), np.int32))
    with pytest.raises(sattn.DTypeError, match="attn_mask: expected bool.*got uint8"):
        s(x, x, x, attn_mask=np.zeros((3, 3), np.uint8))
    with pytest.raises(sattn.DTypeError, match="key_padding_mask: expected bool.*got uint8"):
        s(x, x, x, key_padding_mask=np.zeros((1, 3), np.uint8))
    with pytest.raises(sattn.DTypeError, match=r"attn_mask: a float mask must have the query's dtype \(float32\)"):
        s(x, x, x, attn_mask=np.zeros((3, 3), np.float64))
    with pytest.raises(TypeError):
        s("not an array", x, x)


# ---------------------------------------------------------------------------------------------------------
@needs_torch
@pytest.mark.parametrize("kw", [{}, {"kdim": 5, "vdim": 3, "add_bias_kv": True}, {"bias": False}])
def test_load_safetensors_from_torch_state_dict(kw):
    rng = np.random.default_rng(23)
    t, _ = make_pair(8, 2, seed=24, **kw)
    s = sattn.MultiheadAttention(8, 2, **kw)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "mha.safetensors")
        safetensors_py.save(path, {k: v.numpy() for k, v in t.state_dict().items()}, {"format": "pt"})
        s.load_safetensors(path)
        q, k, v = inputs(rng, 2, 3, 4, 8, kw.get("kdim", 8), kw.get("vdim", 8), False)
        check_parity(t, s, q, k, v)
        # and back: sattn's writer, read by the independent Python reader
        out = os.path.join(d, "back.safetensors")
        s.save_safetensors(out)
        back, meta = safetensors_py.load(out)
        assert meta == {"format": "pt"}
        assert set(back) == set(t.state_dict())
        for name, val in t.state_dict().items():
            np.testing.assert_array_equal(back[name], val.numpy())


def test_load_safetensors_errors():
    s = sattn.MultiheadAttention(8, 2)
    with tempfile.TemporaryDirectory() as d:
        missing = os.path.join(d, "nope.safetensors")
        with pytest.raises(ValueError, match="nope.safetensors.*cannot open"):
            s.load_safetensors(missing)
        path = os.path.join(d, "extra.safetensors")
        sd = s.state_dict()
        sd["extra.weight"] = np.zeros(3, np.float32)
        safetensors_py.save(path, sd)
        with pytest.raises(ValueError, match="unexpected key.*'extra.weight'"):
            s.load_safetensors(path)


def test_huge_need_weights_is_refused_before_allocating():
    s = sattn.MultiheadAttention(2, 1)
    x = np.zeros((1 << 19, 1, 2), np.float32)  # weights would be [1, 1, 2^19, 2^19] float32 = 1.1 TB
    with pytest.raises(MemoryError, match="need_weights"):
        s(x, x, x)
