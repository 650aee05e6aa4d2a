"""Test oracles for sattn's SDPA: a float64 numpy transcription of PyTorch 2.x's documented reference
implementation of torch.nn.functional.scaled_dot_product_attention, extended only where sattn documents an
extension, plus random problem generators.

PyTorch's documented reference (torch 2.5 docs), transcribed line by line below:
    L, S = query.size(-2), key.size(-2)
    scale_factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    attn_bias = torch.zeros(L, S, dtype=query.dtype)
    if is_causal:
        temp_mask = torch.ones(L, S, dtype=torch.bool).tril(diagonal=0)
        attn_bias.masked_fill_(temp_mask.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_bias.masked_fill_(attn_mask.logical_not(), float("-inf"))
        else:
            attn_bias = attn_mask + attn_bias
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3)//key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3)//value.size(-3), -3)
    attn_weight = query @ key.transpose(-2, -1) * scale_factor
    attn_weight += attn_bias
    attn_weight = torch.softmax(attn_weight, dim=-1)
    attn_weight = torch.dropout(attn_weight, dropout_p, train=True)
    return attn_weight @ value
Extensions (sattn's documented semantics): causal 'bottom_right' is FlashAttention >= 2.1's
tril(diagonal = S - L) (key j allowed iff j <= i + S - L); is_causal together with attn_mask intersects them (both
add -inf); key padding adds -inf on padded keys; a row whose every key is -inf gives weights 0 and output 0 (the
transcription would give NaN), lse = -inf; dropout uses a given keep mask (sattn's Philox decisions).
"""
import math

import numpy as np


def padding_from(key_padding_mask=None, key_lengths=None, len_k=None):
    """Bool (..., Lk) with True = padding, from either form (None if neither)."""
    if key_padding_mask is not None:
        return np.asarray(key_padding_mask, bool)
    if key_lengths is not None:
        return np.arange(len_k) >= np.asarray(key_lengths)[..., None]
    return None


def attn_bias(L, S, attn_mask=None, is_causal=False, causal_alignment="top_left", key_padding_mask=None,
              key_lengths=None):
    """The additive float64 bias (broadcastable to (..., H, L, S)): 0 / -inf from causality, bool masks and
    padding, plus a float mask."""
    bias = np.zeros((L, S))
    if is_causal:
        diagonal = 0 if causal_alignment == "top_left" else S - L
        temp_mask = np.tril(np.ones((L, S), bool), k=diagonal)
        bias = np.where(temp_mask, bias, -np.inf)
    if attn_mask is not None:
        attn_mask = np.asarray(attn_mask)
        if attn_mask.dtype == np.bool_:
            bias = np.where(attn_mask, bias, -np.inf)
        else:
            bias = attn_mask.astype(np.float64) + bias
    pad = padding_from(key_padding_mask, key_lengths, S)
    if pad is not None:
        # (..., S) -> (..., 1, 1, S): padding is per batch entry and key, the same for every head and query.
        pad = pad[..., None, None, :]
        bias = np.where(pad, -np.inf, bias)
    return bias


def softmax_rows(x):
    """softmax over the last axis; rows that are all -inf give 0 (sattn) rather than NaN. Also returns lse."""
    m = np.max(x, axis=-1, keepdims=True)
    live = np.isfinite(m)
    e = np.exp(x - np.where(live, m, 0.0))
    s = np.sum(e, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = np.where(live, e / s, 0.0)
        lse = np.where(live, m + np.log(s), -np.inf)[..., 0]
    return p, lse


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
         causal_alignment="top_left", key_padding_mask=None, key_lengths=None, keep=None):
    """Returns (out, lse, weights) in float64. `keep`: bool (..., H, L, S) dropout decisions (required when
    dropout_p > 0)."""
    q, k, v = (np.asarray(x, np.float64) for x in (query, key, value))
    L, S = q.shape[-2], k.shape[-2]
    scale_factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    bias = attn_bias(L, S, attn_mask, is_causal, causal_alignment, key_padding_mask, key_lengths)
    if enable_gqa and q.ndim >= 3:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)  # = repeat_interleave along dim -3
        v = np.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    attn_weight = q @ np.swapaxes(k, -2, -1) * scale_factor
    attn_weight = (attn_weight + bias).reshape(attn_weight.shape)  # padding's (1, 1, S) may add leading 1s
    attn_weight, lse = softmax_rows(attn_weight)
    if dropout_p > 0:
        assert keep is not None
        attn_weight = attn_weight * keep / (1 - dropout_p)
    return attn_weight @ v, lse, attn_weight


def max_rel_err(got, ref):
    """||got - ref||_inf / max(1, ||ref||_inf), with matching infinities (lse = -inf) counted as equal."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if got.size == 0:
        return 0.0
    same_inf = np.isinf(ref) & (got == ref)
    with np.errstate(invalid="ignore"):
        diff = np.where(same_inf, 0.0, np.abs(got - ref))
    finite_ref = np.where(np.isinf(ref), 0.0, np.abs(ref))
    return float(np.max(diff) / max(1.0, float(np.max(finite_ref))))


# ---- random problems ---------------------------------------------------------------------------------------


def make_array(rng, shape, dtype, layout):
    """Random normal array of `shape` with a given memory layout: 'contig', 'transposed' (PyTorch's
    (B, L, H, E) storage viewed as (B, H, L, E)), 'sliced' (every other element of the last axis), 'reversed'
    (negative stride: sattn must copy)."""
    shape = tuple(int(s) for s in shape)
    if layout == "transposed" and len(shape) >= 3:
        base = rng.standard_normal(shape[:-3] + (shape[-2], shape[-3], shape[-1])).astype(dtype)
        return np.swapaxes(base, -3, -2)
    if layout == "sliced":
        base = rng.standard_normal(shape[:-1] + (2 * shape[-1],)).astype(dtype)
        return base[..., ::2]
    if layout == "reversed":
        return rng.standard_normal(shape).astype(dtype)[..., ::-1, :]
    return rng.standard_normal(shape).astype(dtype)


def random_mask_shape(rng, target):
    """A random shape that broadcasts to `target`: a random number of trailing dims, each 1 with p = 0.35."""
    nd = int(rng.integers(1, len(target) + 1))
    return tuple(1 if rng.random() < 0.35 else int(t) for t in target[-nd:])


def random_problem(seed, max_len=40, max_dim=40, allow_dropout=False):
    """A random SDPA problem (a dict of sattn keyword arguments plus the arrays), none of it hand-picked."""
    rng = np.random.default_rng(seed)
    nd = int(rng.choice([2, 3, 4, 4, 4, 5]))
    lead = () if nd <= 3 else tuple(int(x) for x in rng.integers(1, 4, size=nd - 3))
    hkv = int(rng.integers(1, 4)) if nd >= 3 else 1
    group = int(rng.choice([1, 1, 2, 3])) if nd >= 3 else 1
    hq = hkv * group
    lq = int(rng.integers(1, max_len + 1))
    lk = lq if rng.random() < 0.25 else int(rng.integers(1, max_len + 1))
    d = int(rng.integers(1, max_dim + 1))
    dv = d if rng.random() < 0.5 else int(rng.integers(1, max_dim + 1))
    dtype = np.float32 if rng.random() < 0.7 else np.float64
    heads = lambda h: (h,) if nd >= 3 else ()  # noqa: E731
    layouts = ["contig", "contig", "transposed", "sliced", "reversed"]
    q = make_array(rng, lead + heads(hq) + (lq, d), dtype, rng.choice(layouts))
    k = make_array(rng, lead + heads(hkv) + (lk, d), dtype, rng.choice(layouts))
    v = make_array(rng, lead + heads(hkv) + (lk, dv), dtype, rng.choice(layouts))
    kw = dict(enable_gqa=bool(hq != hkv or rng.random() < 0.3))
    target = lead + heads(hq) + (lq, lk)
    mask_kind = rng.choice(["none", "bool", "float", "float_inf"])
    if mask_kind != "none":
        shape = random_mask_shape(rng, target)
        if mask_kind == "bool":
            m = rng.random(shape) > 0.3
            if rng.random() < 0.3 and m.ndim >= 2:  # some fully masked rows
                m[..., int(rng.integers(0, m.shape[-2])), :] = False
        else:
            m = (rng.standard_normal(shape) * 2).astype(rng.choice([np.float32, np.float64]))
            if mask_kind == "float_inf":
                m[rng.random(shape) < 0.3] = -np.inf
        kw["attn_mask"] = m
    c = rng.random()
    if c < 0.6:
        kw["is_causal"] = True
        kw["causal_alignment"] = "top_left" if c < 0.3 else "bottom_right"
    pad = rng.choice(["none", "bool", "lengths"])
    if pad == "bool":
        kw["key_padding_mask"] = rng.random(lead + (lk,)) < 0.3
    elif pad == "lengths":
        kw["key_lengths"] = rng.integers(0, lk + 1, size=lead).astype(rng.choice([np.int32, np.int64]))
    if rng.random() < 0.3:
        kw["scale"] = float(rng.uniform(0.05, 1.5))
    if allow_dropout and rng.random() < 0.3:
        kw["dropout_p"] = float(rng.uniform(0.05, 0.6))
        kw["seed"] = int(rng.integers(0, 2**63))
    return q, k, v, kw
