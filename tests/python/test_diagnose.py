"""sattn.diagnose: the dict form of `sattn doctor` (seeded symptoms flagged, healthy inputs quiet)."""
import numpy as np
import pytest

import sattn


def qkv(b=1, h=2, l=24, d=32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, h, l, d)).astype(np.float32) for _ in range(3)]


def codes(result):
    return {f["code"] for f in result["findings"]}


def test_healthy_is_quiet():
    q, k, v = qkv()
    r = sattn.diagnose(q, k, v)
    assert r["findings"] == []
    assert r["stats"]["deterministic"] is True
    assert len(r["stats"]["heads"]) == 2
    assert abs(r["stats"]["heads"][0]["scaled_scores"]["std"] - 1.0) < 0.25
    assert sattn.diagnose(q, k, v, is_causal=True, expect="causal")["findings"] == []


def test_unscaled_scores():
    q, k, v = qkv()
    r = sattn.diagnose(q, k, v, scale=1.0)
    assert "unscaled_scores" in codes(r)
    f = next(f for f in r["findings"] if f["code"] == "unscaled_scores")
    assert f["heads"] == [[0, 0], [0, 1]]
    assert "sqrt(d_k)" in f["message"]


def test_reversed_causal_mask_leaks():
    q, k, v = qkv()
    reversed_mask = np.triu(np.ones((24, 24), dtype=bool), 1)  # torch-style True = masked, given as True = allowed
    r = sattn.diagnose(q, k, v, attn_mask=reversed_mask, expect="causal")
    assert {"causal_leak", "mask_polarity_suspect", "fully_masked_rows"} <= codes(r)
    # The right polarity is healthy.
    assert sattn.diagnose(q, k, v, attn_mask=~reversed_mask, expect="causal")["findings"] == []


def test_padding_lengths_not_applied_leak():
    q, k, v = qkv(b=2)
    lengths = np.array([24, 10], dtype=np.int64)
    r = sattn.diagnose(q, k, v, key_padding_mask=lengths, expect="padding")
    f = next(f for f in r["findings"] if f["code"] == "padding_leak")
    assert f["heads"] == [[1, 0], [1, 1]]
    # Bool key padding applied normally (no expect): healthy.
    kpm = np.arange(24)[None, :] >= lengths[:, None]
    assert sattn.diagnose(q, k, v, key_padding_mask=kpm)["findings"] == []


def test_nan_and_fully_masked_row():
    q, k, v = qkv()
    q[0, 1, 3, 0] = np.nan
    assert "nan_or_inf" in codes(sattn.diagnose(q, k, v))
    q, k, v = qkv()
    m = np.ones((24, 24), dtype=bool)
    m[5] = False
    r = sattn.diagnose(q, k, v, attn_mask=m)
    assert codes(r) == {"fully_masked_rows"}


def test_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="expect"):
        sattn.diagnose(q, k, v, expect="future")
    with pytest.raises(ValueError, match="key"):
        sattn.diagnose(q, k[..., :8], v)
    with pytest.raises(TypeError):
        sattn.diagnose(q.astype(np.complex64), k, v)
