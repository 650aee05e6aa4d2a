"""sattn.scaled_dot_product_attention_backward against torch autograd (Debian's torch 1.13) on a float64 manual
attention: dq, dk, dv and the gradient of a float attn_mask, over random problems (GQA, causal in both alignments,
padding, broadcast masks, dropout with sattn's keep decisions, fully masked rows)."""
import numpy as np
import pytest

import sattn
from sdpa_reference import attn_bias, max_rel_err, random_problem

torch = pytest.importorskip("torch", reason="torch not installed: backward parity with torch autograd skipped")

N_BACKWARD = 80
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-9}


pytestmark = pytest.mark.usefixtures("one_thread")


def torch_manual_attention_grads(q, k, v, dout, kw, keep=None):
    """Gradients by torch autograd of a float64 manual attention with sattn's semantics: the bool/causal/padding
    masks as -inf, the float mask as a leaf tensor added to the scores (autograd reduces its gradient to the
    mask's own shape), GQA by repeat_interleave, rows with no allowed key giving 0 and no gradient."""
    qt, kt, vt = (torch.tensor(np.array(x, np.float64), requires_grad=True) for x in (q, k, v))
    mask = kw.get("attn_mask")
    float_mask = mask is not None and mask.dtype != np.bool_
    L, S = q.shape[-2], k.shape[-2]
    bias = attn_bias(L, S, None if float_mask else mask, kw.get("is_causal", False),
                     kw.get("causal_alignment", "top_left"), kw.get("key_padding_mask"), kw.get("key_lengths"))
    g = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    K = torch.repeat_interleave(kt, g, dim=-3) if g > 1 else kt
    V = torch.repeat_interleave(vt, g, dim=-3) if g > 1 else vt
    scale = kw.get("scale", 1 / np.sqrt(q.shape[-1]))
    scores = qt @ K.transpose(-2, -1) * scale
    s = scores + torch.from_numpy(np.ascontiguousarray(bias))
    mt = None
    if float_mask:
        mt = torch.tensor(mask.astype(np.float64), requires_grad=True)
        s = s + mt
    s = s.reshape(scores.shape)
    live = torch.isfinite(s).any(-1, keepdim=True)
    s_safe = torch.where(live, s, torch.zeros_like(s))
    P = torch.softmax(s_safe, dim=-1) * live
    if keep is not None:
        P = P * torch.from_numpy(keep) / (1 - kw["dropout_p"])
    out = P @ V
    out.backward(torch.from_numpy(np.asarray(dout, np.float64)))
    grads = [qt.grad.numpy(), kt.grad.numpy(), vt.grad.numpy()]
    if float_mask:
        grads.append(mt.grad.numpy())
    return out.detach().numpy(), grads


def sattn_keep_mask(q, k, kw):
    """sattn's dropout decisions, read off its weights with and without dropout."""
    nodrop = {key: val for key, val in kw.items() if key not in ("dropout_p", "seed")}
    w0 = sattn.attention_weights(q, k, **nodrop)
    w = sattn.attention_weights(q, k, **kw)
    return np.where(w0 != 0, w != 0, True)


@pytest.mark.parametrize("seed", range(1000, 1000 + N_BACKWARD))
def test_backward_matches_torch_autograd(seed):
    q, k, v, kw = random_problem(seed, max_len=32, max_dim=24, allow_dropout=True)
    out, lse = sattn.scaled_dot_product_attention(q, k, v, **kw, return_lse=True)
    dout = np.random.default_rng(seed).standard_normal(out.shape).astype(q.dtype)
    keep = sattn_keep_mask(q, k, kw) if kw.get("dropout_p", 0) > 0 else None
    ref_out, ref_grads = torch_manual_attention_grads(q, k, v, dout, kw, keep)
    tol = TOL[q.dtype]
    assert max_rel_err(out, ref_out) <= tol
    grads = sattn.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw)
    mask = kw.get("attn_mask")
    assert len(grads) == (4 if mask is not None and mask.dtype != np.bool_ else 3)
    names = ["dq", "dk", "dv", "dmask"]
    for name, got, ref in zip(names, grads, ref_grads):
        assert got.shape == ref.shape, name
        assert np.all(np.isfinite(got)), name
        err = max_rel_err(got, ref)
        # dmask comes back in the mask's dtype (as in torch): a float32 mask with float64 inputs rounds to float32.
        assert err <= (max(tol, TOL[got.dtype]) if name == "dmask" else tol), f"{name}: {err}"
    if len(grads) == 4:
        assert grads[3].dtype == mask.dtype


def test_backward_sweep_covers_the_options():
    seen = set()
    for seed in range(1000, 1000 + N_BACKWARD):
        q, k, v, kw = random_problem(seed, max_len=32, max_dim=24, allow_dropout=True)
        m = kw.get("attn_mask")
        seen.add(("dmask", m is not None and m.dtype != np.bool_ and any(s == 1 for s in m.shape)))
        seen.add(("gqa", q.ndim >= 3 and q.shape[-3] != k.shape[-3]))
        seen.add(("dropout", kw.get("dropout_p", 0) > 0))
        seen.add(("causal", kw.get("is_causal", False) and kw["causal_alignment"]))
        seen.add(("pad", "key_padding_mask" in kw or "key_lengths" in kw))
    for item in [("dmask", True), ("gqa", True), ("dropout", True), ("causal", "top_left"),
                 ("causal", "bottom_right"), ("pad", True)]:
        assert item in seen, item


def test_dmask_of_a_5d_broadcast_mask():
    """A float mask with leading batch dims beyond one (folded into B internally) gets its gradient summed back."""
    rng = np.random.default_rng(20)
    q = rng.standard_normal((2, 3, 2, 5, 4))
    k = rng.standard_normal((2, 3, 2, 6, 4))
    v = rng.standard_normal((2, 3, 2, 6, 3))
    mask = rng.standard_normal((3, 1, 5, 6))
    kw = dict(attn_mask=mask)
    out, lse = sattn.scaled_dot_product_attention(q, k, v, **kw, return_lse=True)
    dout = rng.standard_normal(out.shape)
    grads = sattn.scaled_dot_product_attention_backward(dout, q, k, v, out, lse, **kw)
    _, ref = torch_manual_attention_grads(q, k, v, dout, kw)
    for got, want in zip(grads, ref):
        assert got.shape == want.shape
        assert max_rel_err(got, want) <= 1e-9
