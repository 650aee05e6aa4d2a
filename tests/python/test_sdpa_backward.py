"""sattn.scaled_dot_product_attention_backward against torch autograd (PyTorch 2.x), over random problems (GQA,
causal in both alignments, padding, broadcast masks, dropout with sattn's keep decisions, fully masked rows): dq,
dk, dv and the gradient of a float attn_mask.

Two oracles, both in float64: autograd of torch.nn.functional.scaled_dot_product_attention itself for every
problem without dropout (torch_oracle.sdpa_call: torch's own arguments where it has them, sattn's extensions as
one torch mask), and autograd of a manual attention for every problem, the only one that can apply sattn's
dropout decisions."""
import numpy as np
import pytest

import sattn
import torch_oracle
from sdpa_reference import attn_bias, max_rel_err, random_problem
from torch_oracle import needs_torch, torch

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_torch]

N_BACKWARD = 80
TOL = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-9}



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


def torch_sdpa_grads(q, k, v, dout, kw):
    """Gradients by torch autograd of torch's own SDPA, in float64 (float32 problems converted exactly)."""
    tq, tk, tv, tkw, leaf = torch_oracle.sdpa_call(q, k, v, kw, dtype=np.float64, requires_grad=True)
    out = torch_oracle.sdpa(tq, tk, tv, tkw)
    out.backward(torch.from_numpy(np.asarray(dout, np.float64)))
    grads = [tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()]
    if leaf is not None:
        grads.append(leaf.grad.numpy())
    return out.detach().numpy(), grads


def check_grads(grads, ref_grads, q, mask, oracle):
    tol = TOL[q.dtype]
    assert len(grads) == len(ref_grads) == (4 if mask is not None and mask.dtype != np.bool_ else 3), oracle
    for name, got, ref in zip(["dq", "dk", "dv", "dmask"], grads, ref_grads):
        assert got.shape == ref.shape, (oracle, name)
        assert np.all(np.isfinite(got)), (oracle, name)
        err = max_rel_err(got, ref)
        # dmask comes back in the mask's dtype (as in torch): a float32 mask with float64 inputs rounds to float32.
        assert err <= (max(tol, TOL[got.dtype]) if name == "dmask" else tol), f"{oracle}: {name}: {err}"


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
    check_grads(grads, ref_grads, q, mask, "manual attention")
    if keep is None:
        sdpa_out, sdpa_grads = torch_sdpa_grads(q, k, v, dout, kw)
        assert max_rel_err(out, sdpa_out) <= tol
        check_grads(grads, sdpa_grads, q, mask, "torch SDPA")
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
        if kw.get("dropout_p", 0) == 0:
            seen.add(("torch form", torch_oracle.form(torch_oracle.sdpa_call(q, k, v, kw)[3])))
    for item in [("dmask", True), ("gqa", True), ("dropout", True), ("causal", "top_left"),
                 ("causal", "bottom_right"), ("pad", True), ("torch form", "none"), ("torch form", "is_causal"),
                 ("torch form", "causal_lower_right"), ("torch form", "bool"), ("torch form", "float")]:
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
    for _, ref in (torch_manual_attention_grads(q, k, v, dout, kw), torch_sdpa_grads(q, k, v, dout, kw)):
        for got, want in zip(grads, ref):
            assert got.shape == want.shape
            assert max_rel_err(got, want) <= 1e-9
