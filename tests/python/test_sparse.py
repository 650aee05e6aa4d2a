"""sattn sparse attention from Python: against a float64 numpy transcription of masked attention."""
import numpy as np
import pytest

import sattn


def reference(q, k, v, allowed, dout, bias=None, scale=None):
    """fp64 masked attention and its backward. allowed: bool [H or 1, Lq, Lk] (or broadcastable [B, H, Lq, Lk])."""
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    B, Hq, Lq, D = q.shape
    g = Hq // k.shape[1]
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    s = scale * q @ k.transpose(0, 1, 3, 2)
    if bias is not None:
        s = s + bias
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    mx = s.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(mx)
    mx = np.where(empty, 0.0, mx)
    e = np.where(allowed, np.exp(s - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    lse = np.where(empty[..., 0], -np.inf, (mx + np.log(np.where(tot > 0, tot, 1.0)))[..., 0])
    out = p @ v
    dp = dout @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = scale * ds @ k
    dk = scale * ds.transpose(0, 1, 3, 2) @ q
    dv = p.transpose(0, 1, 3, 2) @ dout
    dk = dk.reshape(B, -1, g, *dk.shape[2:]).sum(axis=2)
    dv = dv.reshape(B, -1, g, *dv.shape[2:]).sum(axis=2)
    return out, lse, dq, dk, dv, ds


def rel(got, ref):
    return np.max(np.abs(got - ref)) / max(1.0, np.max(np.abs(ref)))


CASES = [
    ("SlidingWindow(5, 3)", 2, 4, 2, 67, 67, 16, 24),
    ("SlidingWindow(-1, 0)", 1, 2, 1, 65, 130, 32, 32),
    ("Dilated(3, 2)", 1, 2, 2, 99, 99, 16, 16),
    ("BlockLocal(16)", 1, 2, 2, 70, 70, 8, 8),
    ("GlobalTokens([0, 9], SlidingWindow(2, 2))", 1, 2, 2, 65, 65, 16, 16),
    ("BigBird(8, 3, 1, 2, seed=4)", 1, 3, 3, 80, 80, 16, 16),
    ("Neighborhood2D(10, 11, 3, dilation=2)", 1, 2, 2, 110, 110, 16, 16),
    ("WindowAttention2D(8, 12, 4, shift=2)", 1, 2, 1, 96, 96, 16, 16),
    ("SlidingWindow(4, 0) | Dilated(2, 3)", 1, 2, 2, 50, 50, 16, 16),
]


@pytest.mark.parametrize("spec,B,Hq,Hkv,Lq,Lk,D,Dv", CASES)
def test_sparse_matches_reference(spec, B, Hq, Hkv, Lq, Lk, D, Dv):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Lk, Dv)).astype(np.float32)
    dout = rng.standard_normal((B, Hq, Lq, Dv)).astype(np.float32)
    pattern = sattn.Pattern.parse(spec)
    allowed = pattern.dense_mask(Lq, Lk, heads=Hq)
    out, lse = sattn.sparse_attention(q, k, v, pattern, enable_gqa=True, return_lse=True)
    r_out, r_lse, r_dq, r_dk, r_dv, _ = reference(q, k, v, allowed, dout)
    assert rel(out, r_out) <= 2e-5
    assert np.array_equal(np.isinf(lse), np.isinf(r_lse))
    fin = np.isfinite(r_lse)
    assert rel(lse[fin], r_lse[fin]) <= 2e-5
    dq, dk, dv, extra = sattn.sparse_attention_backward(dout, q, k, v, out, lse, pattern, enable_gqa=True)
    assert extra == {}
    assert rel(dq, r_dq) <= 1e-4 and rel(dk, r_dk) <= 1e-4 and rel(dv, r_dv) <= 1e-4


def test_key_padding_bias_and_gradients():
    rng = np.random.default_rng(1)
    B, H, L, D = 2, 2, 40, 8
    q, k, v, dout = (rng.standard_normal((B, H, L, D)).astype(np.float32) for _ in range(4))
    kpm = rng.random((B, L)) < 0.3
    bias = rng.standard_normal((H, L, L)).astype(np.float32) * 0.5
    p = sattn.SlidingWindow(6, 6)
    out, lse = sattn.sparse_attention(q, k, v, p, key_padding_mask=kpm, bias=bias, return_lse=True)
    allowed = p.dense_mask(L, L)[None] & ~kpm[:, None, None, :]
    r_out, _, r_dq, r_dk, r_dv, r_ds = reference(q, k, v, allowed, dout, bias=bias.astype(np.float64))
    assert rel(out, r_out) <= 2e-5
    dq, dk, dv, extra = sattn.sparse_attention_backward(dout, q, k, v, out, lse, p, key_padding_mask=kpm, bias=bias)
    assert rel(dq, r_dq) <= 1e-4 and rel(dk, r_dk) <= 1e-4 and rel(dv, r_dv) <= 1e-4
    assert rel(extra["bias"], r_ds.sum(axis=0)) <= 1e-4


def test_window_relative_position_bias_gradient():
    rng = np.random.default_rng(2)
    Hh, W, win, H, D = 8, 8, 4, 2, 8
    L = Hh * W
    q, k, v, dout = (rng.standard_normal((1, H, L, D)).astype(np.float32) for _ in range(4))
    table = rng.standard_normal(((2 * win - 1) ** 2, H)).astype(np.float32)
    p = sattn.WindowAttention2D(Hh, W, win, shift=2)
    out, lse = sattn.sparse_attention(q, k, v, p, rel_pos_bias=table, return_lse=True)
    r, c = np.divmod(np.arange(L), W)
    dr = r[:, None] - r[None, :]
    dc = c[:, None] - c[None, :]
    near = (np.abs(dr) < win) & (np.abs(dc) < win)
    idx = np.where(near, (dr + win - 1) * (2 * win - 1) + dc + win - 1, 0)
    bias = np.where(near[None], table[idx].transpose(2, 0, 1), 0.0)[None]
    r_out, _, r_dq, r_dk, r_dv, r_ds = reference(q, k, v, p.dense_mask(L), dout, bias=bias)
    assert rel(out, r_out) <= 2e-5
    dq, dk, dv, extra = sattn.sparse_attention_backward(dout, q, k, v, out, lse, p, rel_pos_bias=table)
    assert rel(dq, r_dq) <= 1e-4
    want = np.zeros_like(table, dtype=np.float64)
    for h in range(H):
        np.add.at(want[:, h], idx[near], r_ds[0, h][near])
    assert rel(extra["rel_pos_bias"], want) <= 1e-4


def test_repr_round_trip_and_classes():
    p = sattn.Neighborhood2D(64, 64, 7, dilation=2) | sattn.GlobalTokens([0], sattn.SlidingWindow(8, 8))
    assert repr(p) == "Neighborhood2D(64, 64, 7, dilation=2) | GlobalTokens([0], SlidingWindow(8, 8))"
    assert sattn.Pattern.parse(repr(p)) == p
    assert sattn.parse_pattern("SlidingWindow(256,256)") == sattn.SlidingWindow(256, 256)
    assert isinstance(sattn.Dilated(4, 2), sattn.Pattern)
    assert repr(sattn.SlidingWindow(3, 0, alignment="top_left")) == "SlidingWindow(3, 0, alignment='top_left')"
    assert sattn.BigBird(16, 3, 1, 2, seed=5).head_dependent


def test_errors():
    with pytest.raises(ValueError, match="position 22"):
        sattn.Pattern.parse("SlidingWindow(256, 256")
    with pytest.raises(ValueError, match="multiples of window"):
        sattn.WindowAttention2D(10, 12, 4)
    q = np.zeros((1, 2, 16, 8), np.float32)
    k = np.zeros((1, 1, 16, 8), np.float32)
    with pytest.raises(ValueError, match="enable_gqa"):
        sattn.sparse_attention(q, k, k, sattn.SlidingWindow(1, 1))
    with pytest.raises(ValueError, match="height \\* width"):
        sattn.sparse_attention(q, q, q, sattn.Neighborhood2D(5, 5, 3))
    with pytest.raises(TypeError):
        sattn.sparse_attention(q.astype(np.int32), q, q, sattn.SlidingWindow(1, 1))


@pytest.mark.parametrize("spec,L", [("Neighborhood2D(23, 19, 7)", 437),
                                    ("Neighborhood2D(20, 22, 5, dilation=2, causal=True)", 440)])
def test_neighborhood_block_mask_rows_cover_allowed_pairs(spec, L):
    # Ranges may narrow the query rows they are computed for (columns 3, 4: q_lo, q_hi; q_hi = 0: to the block's
    # end): every allowed pair is still listed exactly once, no full range holds a masked pair.
    p = sattn.Pattern.parse(spec)
    dense = p.dense_mask(L, L)[0]
    bm = p.block_mask(L, L)
    qperm = np.asarray(bm.q_perm) if len(bm.q_perm) else np.arange(L)
    kperm = np.asarray(bm.k_perm) if len(bm.k_perm) else np.arange(L)
    cover = np.zeros((L, L), np.int32)
    narrowed = 0
    for qb in range(bm.num_q_blocks):
        q0, q1 = bm.q_block_start[qb], bm.q_block_start[qb + 1]
        for b, e, full, qlo, qhi in bm.ranges[bm.row_ptr[qb]:bm.row_ptr[qb + 1]]:
            hi = q1 - q0 if qhi == 0 else min(qhi, q1 - q0)
            narrowed += qlo > 0 or hi < q1 - q0
            rows, cols = qperm[q0 + qlo:q0 + hi], kperm[b:e]
            cover[np.ix_(rows, cols)] += 1
            if full:
                assert qlo == 0 and qhi == 0 and dense[np.ix_(rows, cols)].all()
    assert cover.max() == 1 and (cover[dense] == 1).all()
    assert narrowed > 0
    assert bm.computed_pairs() == cover.sum()


def test_block_mask_from_dense():
    rng = np.random.default_rng(3)
    m = rng.random((50, 70)) < 0.2
    m[:, :5] = True
    bm = sattn.block_mask_from_dense(m, 16)
    assert bm.num_q_blocks == 4 and bm.heads == 1
    for qb in range(bm.num_q_blocks):
        q0, q1 = bm.q_block_start[qb], bm.q_block_start[qb + 1]
        listed = {int(r[0]): int(r[2]) for r in bm.ranges[bm.row_ptr[qb]:bm.row_ptr[qb + 1]]}
        for k0 in range(0, 70, 16):
            tile = m[q0:q1, k0:k0 + 16]
            want = None if not tile.any() else int(tile.all())
            assert listed.get(k0) == want


def test_adaptive_patterns_from_python():
    rng = np.random.default_rng(4)
    B, H, L, D = 1, 2, 48, 8
    q, k, v, dout = (rng.standard_normal((B, H, L, D)).astype(np.float32) for _ in range(4))
    p = sattn.TopK(6) & sattn.SlidingWindow(12, 12)
    assert repr(p) == "TopK(6) & SlidingWindow(12, 12)"
    out, lse, idx = sattn.sparse_attention(q, k, v, p, return_lse=True, return_indices=True)
    assert idx.shape == (B, H, L, 6) and idx.dtype == np.int64
    sel = sattn.selection_mask(p, idx, L, L)
    # A valid top-k of the fp64 scores within the window.
    s = (q.astype(np.float64) @ k.astype(np.float64).transpose(0, 1, 3, 2)) / np.sqrt(D)
    win = sattn.SlidingWindow(12, 12).dense_mask(L)[0]
    for h in range(H):
        for i in range(L):
            chosen = s[0, h, i][sel[0, h, i]]
            others = s[0, h, i][win[i] & ~sel[0, h, i]]
            assert len(chosen) == min(6, win[i].sum())
            assert others.size == 0 or chosen.min() >= others.max() - 1e-5
    r_out, _, r_dq, r_dk, r_dv, _ = reference(q, k, v, sel, dout)
    assert rel(out, r_out) <= 2e-5
    dq, dk, dv, extra = sattn.sparse_attention_backward(dout, q, k, v, out, lse, p, indices=idx)
    assert rel(dq, r_dq) <= 1e-4 and rel(dk, r_dk) <= 1e-4 and rel(dv, r_dv) <= 1e-4

    m = sattn.MixedAttention(logits=(0.2, -0.1))
    assert repr(m) == "MixedAttention(logits=(0.2, -0.1))"
    out, lse = sattn.sparse_attention(q, k, v, m, return_lse=True)
    _, _, _, extra = sattn.sparse_attention_backward(dout, q, k, v, out, lse, m)
    assert extra["logits"].shape == (2,)
    # ReLU attention, normalize='sum', against the formula.
    r = sattn.ReLUAttention(power=2, normalize="sum")
    out = sattn.sparse_attention(q, k, v, r)
    w = np.maximum(s, 0) ** 2
    z = w.sum(-1, keepdims=True)
    want = np.where(z > 0, w / np.where(z > 0, z, 1), 0) @ v.astype(np.float64)
    assert rel(out, want) <= 2e-5
    with pytest.raises(ValueError):
        sattn.sparse_attention(q, k, v, r, return_indices=True)


@pytest.mark.parametrize("feature_map,causal", [("elu", False), ("elu", True), ("favor+", False), ("favor+", True)])
def test_linear_attention(feature_map, causal):
    rng = np.random.default_rng(5)
    B, H, L, D = 1, 2, 70, 8
    sd = 0.5 if feature_map == "favor+" else 1.0
    q, k = (rng.standard_normal((B, H, L, D)) * sd for _ in range(2))
    v, dout = (rng.standard_normal((B, H, L, D)) for _ in range(2))
    q, k, v, dout = (x.astype(np.float32) for x in (q, k, v, dout))
    out = sattn.linear_attention(q, k, v, feature_map=feature_map, causal=causal, seed=3)

    def phi(x):
        x = x.astype(np.float64)
        if feature_map == "elu":
            return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
        w = sattn.favor_projection(D, int(np.floor(D * np.log(D))), 3)
        xs = x * D ** -0.25
        return np.exp(xs @ w.T - (xs ** 2).sum(-1, keepdims=True) / 2) / np.sqrt(w.shape[0])

    a = phi(q) @ phi(k).transpose(0, 1, 3, 2)
    if causal:
        a = np.tril(a)
    want = (a @ v.astype(np.float64)) / a.sum(-1, keepdims=True)
    assert rel(out, want) <= 2e-5
    dq, dk, dv = sattn.linear_attention_backward(dout, q, k, v, feature_map=feature_map, causal=causal, seed=3)
    # dv is linear: (a / rowsum)^T dout.
    assert rel(dv, (a / a.sum(-1, keepdims=True)).transpose(0, 1, 3, 2) @ dout.astype(np.float64)) <= 1e-4
    assert dq.shape == q.shape and dk.shape == k.shape


def test_negative_strides_are_copied_as_in_sdpa():
    """Reversed or otherwise negatively strided inputs give the results of their contiguous copies."""
    rng = np.random.default_rng(6)
    q, k, v, dout = (rng.standard_normal((1, 2, 40, 8)).astype(np.float32) for _ in range(4))
    kpm = rng.random((1, 40)) < 0.2
    bias = rng.standard_normal((2, 40, 40)).astype(np.float32)
    rq, rk, rv, rdout = (x[:, :, ::-1] for x in (q, k, v, dout))
    rkpm, rbias = kpm[:, ::-1], bias[:, ::-1, ::-1]
    assert rq.strides[2] < 0
    c = [np.ascontiguousarray(x) for x in (rq, rk, rv, rdout, rkpm, rbias)]
    p = sattn.SlidingWindow(5, 5)
    want, want_lse = sattn.sparse_attention(c[0], c[1], c[2], p, key_padding_mask=c[4], bias=c[5], return_lse=True)
    out, lse = sattn.sparse_attention(rq, rk, rv, p, key_padding_mask=rkpm, bias=rbias, return_lse=True)
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)
    def reversed_view(x):  # the same values, with a negative stride along the sequence
        return np.flip(np.ascontiguousarray(np.flip(x, 2)), 2)

    grads = sattn.sparse_attention_backward(rdout, rq, rk, rv, reversed_view(out), reversed_view(lse), p,
                                            key_padding_mask=rkpm, bias=rbias)
    want_grads = sattn.sparse_attention_backward(c[3], c[0], c[1], c[2], want, want_lse, p, key_padding_mask=c[4],
                                                 bias=c[5])
    for g, w in zip(grads[:3], want_grads[:3]):
        assert np.array_equal(g, w)
    assert np.array_equal(grads[3]["bias"], want_grads[3]["bias"])
    assert np.array_equal(sattn.linear_attention(rq, rk, rv), sattn.linear_attention(c[0], c[1], c[2]))
    for g, w in zip(sattn.linear_attention_backward(rdout, rq, rk, rv),
                    sattn.linear_attention_backward(c[3], c[0], c[1], c[2])):
        assert np.array_equal(g, w)


def test_a_size_past_what_a_buffer_can_hold_is_a_sattn_error():
    """k_blocks = 2^61 asks for a selection buffer larger than std::vector can hold: a sattn.Error, never a bare
    ValueError about std::vector."""
    q = np.zeros((1, 1, 8, 4), np.float32)
    with pytest.raises(sattn.Error):
        sattn.sparse_attention(q, q, q, sattn.BlockTopK(4, 2**61))
