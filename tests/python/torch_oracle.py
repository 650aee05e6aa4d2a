"""PyTorch 2.x as the outside oracle: the import rule of the parity tests and sattn's SDPA problems given to
torch.nn.functional.scaled_dot_product_attention.

torch is required where numpy >= 2 (build/venv: PyPI torch 2.x). The numpy-1 run (Debian's /usr/bin/python3 with
numpy 1.24, no torch) runs the files that must work without torch; there the tests that need torch skip with a
visible reason and everything else runs. A numpy-2 interpreter without torch fails those tests instead of skipping
them, so a broken venv cannot pass the parity tests silently.

Importable without torch: nothing here touches torch before a test calls it.
"""
import functools
import warnings

import numpy as np
import pytest

from sdpa_reference import attn_bias, padding_from

try:
    import torch
    TORCH_IMPORT_ERROR = None
except ImportError as e:  # the numpy-1 run
    torch = None
    TORCH_IMPORT_ERROR = e

NUMPY_MAJOR = int(np.__version__.split(".")[0])

if torch is None and NUMPY_MAJOR >= 2:
    def needs_torch(f):
        """numpy >= 2 means build/venv, where torch is a requirement: fail, do not skip."""
        @functools.wraps(f)
        def fail(*args, **kwargs):
            pytest.fail(f"torch is required with numpy {np.__version__} (build/venv) but not importable: "
                        f"{TORCH_IMPORT_ERROR}")
        return fail
else:
    needs_torch = pytest.mark.skipif(torch is None, reason="torch not importable (numpy-1 run)")


def t(x, dtype=None):
    """numpy -> torch (a copy: negative strides and read-only arrays are fine), optionally converted."""
    a = np.array(x, dtype=dtype, order="C", copy=True)
    return torch.from_numpy(a)


def _fit(mask, ndim):
    """Drop leading size-1 dims so that `mask` has at most `ndim` dims (torch broadcasts the mask to the
    weights' shape, which has `ndim` dims); a 1-D mask gets a leading 1 (torch needs >= 2 dims)."""
    while mask.dim() > ndim and mask.shape[0] == 1:
        mask = mask.squeeze(0)
    return mask.unsqueeze(0) if mask.dim() == 1 else mask


def sdpa_call(q, k, v, kw, dtype=None, requires_grad=False):
    """sattn problem (arrays + sattn keyword arguments, without dropout) -> (q, k, v, torch kwargs, mask leaf).

    torch gets its own arguments wherever it has them: is_causal=True (top-left), causal_lower_right(L, S) for
    bottom-right causal alone, the bool or float attn_mask as given (both True = may attend), enable_gqa, scale.
    What only sattn has as an argument — key padding, causal together with a mask — goes in as one torch mask: a
    bool mask (True = may attend) when nothing is float, else the float mask plus 0/-inf (computed by torch, so
    autograd gives the float mask's gradient in its own shape). With requires_grad, q, k, v and the float mask
    are autograd leaves; the mask leaf (or None) is returned for its gradient.

    dtype: None = the arrays' own dtype (a float mask of another dtype is converted to it: torch refuses a
    float64 mask with float32 queries); np.float64 = everything converted to float64.
    """
    assert kw.get("dropout_p", 0) == 0, "torch's dropout draws its own random numbers"
    dt = np.dtype(dtype or q.dtype)
    tq, tk, tv = (t(x, dt).requires_grad_(requires_grad) for x in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    mask = kw.get("attn_mask")
    causal = kw.get("is_causal", False)
    align = kw.get("causal_alignment", "top_left").replace("-", "_")
    pad = padding_from(kw.get("key_padding_mask"), kw.get("key_lengths"), S)
    tkw = {"scale": kw.get("scale")}
    if q.ndim >= 3:
        tkw["enable_gqa"] = kw.get("enable_gqa", False)  # torch's GQA needs a head dim (no 2-D + enable_gqa)
    leaf = None
    if mask is not None and mask.dtype != np.bool_:
        leaf = t(mask, dt).requires_grad_(requires_grad)
    if pad is None and not (causal and mask is not None):  # torch's own arguments
        if causal and align == "top_left":
            tkw["is_causal"] = True
        elif causal:
            from torch.nn.attention.bias import causal_lower_right
            with warnings.catch_warnings():  # it warns of NaN for Lq > Lk; those rows are 0 (the tests check)
                warnings.filterwarnings("ignore", message="Lower right causal bias will produce NaNs")
                tkw["attn_mask"] = causal_lower_right(L, S)
        elif mask is not None:
            tkw["attn_mask"] = _fit(leaf if leaf is not None else t(mask), q.ndim)
        return tq, tk, tv, tkw, leaf
    # sattn-only combinations: causal, padding and a bool mask as one 0/-inf bias (True/False for torch).
    rest = t(attn_bias(L, S, mask if leaf is None else None, causal, align, pad), np.float64)
    if leaf is None:
        tkw["attn_mask"] = _fit(torch.isfinite(rest), q.ndim)
    else:
        tkw["attn_mask"] = _fit(leaf + rest.to(leaf.dtype), q.ndim)
    return tq, tk, tv, tkw, leaf


def sdpa(tq, tk, tv, tkw):
    """torch.nn.functional.scaled_dot_product_attention."""
    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **tkw)


def form(tkw):
    """How sdpa_call's problem reaches torch: 'none', 'is_causal', 'causal_lower_right', 'bool' or 'float'."""
    m = tkw.get("attn_mask")
    if tkw.get("is_causal"):
        return "is_causal"
    if m is None:
        return "none"
    if type(m).__name__ == "CausalBias":
        return "causal_lower_right"
    return "bool" if m.dtype == torch.bool else "float"
