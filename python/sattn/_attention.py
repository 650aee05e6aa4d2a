"""sattn.scaled_dot_product_attention and friends: numpy in, numpy out, PyTorch 2.x semantics.

Shapes follow torch.nn.functional.scaled_dot_product_attention:
    query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev) -> out (..., Hq, Lq, Ev)
with 2-D (L, E), 3-D (H, L, E), 4-D (B, H, L, E) or more leading batch dimensions (flattened into one). Dimension
-3 is the head dimension (it may differ between query and key/value only with enable_gqa=True, as in PyTorch 2.5).
Everything here only checks arguments and reshapes; the native module (_core) runs the kernels with the GIL
released and without copying inputs whose layout a strided view can describe.
"""
from __future__ import annotations

import math
import numbers
from collections import namedtuple

import numpy as np

from . import _core

__all__ = [
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "attention_weights",
    "explain_kernels",
    "KernelReport",
]

_ALIGNMENTS = {"top_left": "top_left", "top-left": "top_left", "bottom_right": "bottom_right",
               "bottom-right": "bottom_right"}

try:  # optional: ml_dtypes.bfloat16 arrays
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = None

_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _is_half(dtype):
    return dtype == np.float16 or (_BF16 is not None and dtype == _BF16)


def _native_byte_order(x):
    """Big-endian data (e.g. from a file) is converted to the machine's byte order; the kernels read native."""
    return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))


def _value_error(msg):
    return _core.InvalidArgumentError(msg)


def _type_error(msg):
    return _core.DTypeError(msg)


def _as_float_array(x, name):
    """x as a numpy array the kernels take: float32, float64 or half precision (float16, ml_dtypes.bfloat16), which
    the kernels read natively (no up-converted copy)."""
    if not isinstance(x, np.ndarray):
        if x is None:
            raise _type_error(f"{name}: expected a numpy array, got None")
        x = np.asarray(x)
    x = _native_byte_order(x)
    if x.dtype in _NATIVE_FLOATS or _is_half(x.dtype):
        return x
    raise _type_error(f"{name}: expected a float32, float64, float16 or bfloat16 array, got dtype {x.dtype}")


def _to_4d(x):
    """(L, E) -> (1, 1, L, E); (H, L, E) -> (1, H, L, E); (B, H, L, E) as is; (..., H, L, E) -> (prod(...), H, L, E)
    (a view when numpy can merge the leading dimensions, else a copy)."""
    if x.ndim == 2:
        return x[None, None]
    if x.ndim == 3:
        return x[None]
    if x.ndim == 4:
        return x
    return x.reshape((-1,) + x.shape[-3:])


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise _type_error(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def _check_real(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise _type_error(f"{name}: expected a real number, got {type(value).__name__}")
    return float(value)


class _Call:
    """The arguments of one call, checked and normalised to the native 4-D form [B, H, L, E]."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, kernel, strict, num_threads):
        orig = [x.dtype if isinstance(x, np.ndarray) else None for x in (query, key, value)]
        q = _as_float_array(query, "query")
        k = _as_float_array(key, "key")
        v = _as_float_array(value, "value")
        self.in_dtype = query.dtype if isinstance(query, np.ndarray) else q.dtype
        if orig[0] is not None and (orig[1] != orig[0] or orig[2] != orig[0]):
            raise _type_error(f"key/value: expected the dtype of query ({orig[0]}), got key {orig[1]} and value "
                              f"{orig[2]}")
        if q.ndim < 2:
            raise _value_error(f"query: expected at least 2 dimensions (..., Hq, Lq, E), got shape {q.shape}")
        for x, name in ((k, "key"), (v, "value")):
            if x.ndim != q.ndim:
                raise _value_error(f"{name}: expected {q.ndim} dimensions like query {q.shape}, got shape {x.shape}")
        for x, name, layout in ((q, "query", "(..., Hq, Lq, E)"), (k, "key", "(..., Hkv, Lk, E)"),
                                (v, "value", "(..., Hkv, Lk, Ev)")):
            if 0 in x.shape:
                raise _value_error(f"{name}: zero-size dimension in shape {x.shape} (expected {layout} with every "
                                   "size >= 1)")
        lead = q.shape[:-3]
        if k.shape[:-3] != lead or v.shape[:-3] != lead:
            raise _value_error(f"key/value: expected the batch dimensions {lead} of query {q.shape}, got key "
                               f"{k.shape} and value {v.shape}")
        if k.shape[-1] != q.shape[-1]:
            raise _value_error(f"key: expected embedding size E = {q.shape[-1]} (from query {q.shape}), got shape "
                               f"{k.shape}")
        if v.shape[:-1] != k.shape[:-1]:
            raise _value_error(f"value: expected shape {k.shape[:-1] + (v.shape[-1],)} (..., Hkv, Lk, Ev) to match "
                               f"key {k.shape}, got {v.shape}")
        enable_gqa = _check_flag(enable_gqa, "enable_gqa")
        if q.ndim >= 3:
            hq, hkv = q.shape[-3], k.shape[-3]
            if hq != hkv and not enable_gqa:
                raise _value_error(f"key/value: query has Hq = {hq} heads (dimension -3) but key/value have Hkv = "
                                   f"{hkv}; pass enable_gqa=True for grouped-query attention (as PyTorch 2.5)")
            if hq % hkv != 0:
                raise _value_error(f"key/value: enable_gqa needs query heads Hq = {hq} to be a multiple of key/value "
                                   f"heads Hkv = {hkv}")
        self.q_shape, self.k_shape, self.v_shape = q.shape, k.shape, v.shape
        self.lead = lead
        self.len_k = k.shape[-2]
        self.weights_shape = q.shape[:-1] + (self.len_k,)
        self.q, self.k, self.v = _to_4d(q), _to_4d(k), _to_4d(v)
        self.batch = self.q.shape[0]

        # Options.
        self.dropout_p = _check_real(dropout_p, "dropout_p")
        if not (0.0 <= self.dropout_p < 1.0):
            raise _value_error(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
        is_causal = _check_flag(is_causal, "is_causal")
        if not isinstance(causal_alignment, str) or causal_alignment not in _ALIGNMENTS:
            raise _value_error(f"causal_alignment: expected 'top_left' (PyTorch's is_causal) or 'bottom_right' "
                               f"(FlashAttention >= 2.1), got {causal_alignment!r}")
        self.causal = _ALIGNMENTS[causal_alignment] if is_causal else "none"
        self.scale = None if scale is None else _check_real(scale, "scale")
        if self.scale is not None and not math.isfinite(self.scale):
            raise _value_error(f"scale: expected a finite number or None, got {scale}")
        if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
            raise _type_error(f"seed: expected an int in [0, 2**64), got {type(seed).__name__}")
        if not 0 <= seed < 2**64:
            raise _value_error(f"seed: expected an int in [0, 2**64), got {seed!r}")
        self.seed = int(seed)
        if kernel is not None and not isinstance(kernel, str):
            raise _type_error(f"kernel: expected None or a kernel name (str), got {type(kernel).__name__}")
        self.kernel = kernel
        self.strict = _check_flag(strict, "strict")
        self.num_threads = num_threads

        self._init_mask(attn_mask)
        self._init_padding(key_padding_mask, key_lengths)

    # attn_mask: bool (True = may attend) or float additive, broadcastable (numpy rules) to the weights' shape
    # (..., Hq, Lq, Lk). The native side broadcasts a mask of up to 4 dims to [B, Hq, Lq, Lk] by stride 0.
    def _init_mask(self, attn_mask):
        self.mask = None
        self.mask_is_float = False
        self.mask_dtype = None
        if attn_mask is None:
            return
        m = _native_byte_order(attn_mask if isinstance(attn_mask, np.ndarray) else np.asarray(attn_mask))
        self.mask_dtype = m.dtype
        self.mask_shape = m.shape
        if m.ndim == 0:  # a scalar broadcasts to everything
            m = m.reshape(1)
        if m.dtype == np.bool_:
            pass
        elif m.dtype in _NATIVE_FLOATS:
            self.mask_is_float = True
        elif _is_half(m.dtype):
            self.mask_is_float = True
            m = m.astype(np.float32)
        else:
            raise _type_error(f"attn_mask: expected bool (True = may attend) or a float array (added to the scores),"
                              f" got dtype {m.dtype}")
        target = self.weights_shape
        ok = m.ndim <= len(target) and all(a == 1 or a == b for a, b in zip(m.shape[::-1], target[::-1]))
        if not ok:
            raise _value_error(f"attn_mask: shape {m.shape} does not broadcast to the attention weights' shape "
                               f"{target} (..., Hq, Lq, Lk)")
        self.mask_fold = None
        if m.ndim > 4 or (m.ndim == 4 and len(target) > 4):
            # Leading batch dimensions beyond one: fold them into B like the inputs.
            padded = m.reshape((1,) * (len(target) - m.ndim) + m.shape)
            nlead = len(self.lead)
            if all(s == 1 for s in padded.shape[:nlead]):
                m = padded.reshape((1,) + padded.shape[nlead:])
            else:
                bshape = self.lead + padded.shape[nlead:]
                m = np.broadcast_to(padded, bshape).reshape((-1,) + padded.shape[nlead:])
                # dmask comes back as [B, ...]; sum it over the batch dimensions the mask broadcast along.
                self.mask_fold = (bshape, tuple(i for i in range(nlead) if padded.shape[i] == 1), padded.shape)
        self.mask = m

    def _init_padding(self, key_padding_mask, key_lengths):
        self.kpm = self.klen = None
        if key_padding_mask is not None and key_lengths is not None:
            raise _value_error("key_padding_mask/key_lengths: give one or the other, not both")
        want = self.lead + (self.len_k,)
        if key_padding_mask is not None:
            m = key_padding_mask if isinstance(key_padding_mask, np.ndarray) else np.asarray(key_padding_mask)
            if m.dtype != np.bool_:
                raise _type_error(f"key_padding_mask: expected a bool array (True = padding), got dtype {m.dtype}; "
                                  "for per-batch lengths use key_lengths=")
            if m.shape != want:
                raise _value_error(f"key_padding_mask: expected shape {want} (query's batch dimensions, Lk), got "
                                   f"{m.shape}")
            self.kpm = m.reshape(self.batch, self.len_k)
        if key_lengths is not None:
            n = key_lengths if isinstance(key_lengths, np.ndarray) else np.asarray(key_lengths)
            if n.dtype.kind not in "iu":
                raise _type_error(f"key_lengths: expected an integer array (number of valid keys per batch entry), "
                                  f"got dtype {n.dtype}")
            if n.shape != self.lead:
                raise _value_error(f"key_lengths: expected shape {self.lead} (query's batch dimensions), got "
                                   f"{n.shape}")
            n = n.astype(np.int64).reshape(self.batch)
            bad = np.nonzero((n < 0) | (n > self.len_k))[0]
            if bad.size:
                raise _value_error(f"key_lengths: expected lengths in [0, Lk = {self.len_k}], got "
                                   f"{int(n[bad[0]])} at flat index {int(bad[0])}")
            self.klen = n

    def options(self):
        return dict(attn_mask=self.mask, key_padding_mask=self.kpm, key_lengths=self.klen, causal=self.causal,
                    scale=self.scale, dropout_p=self.dropout_p, seed=self.seed)

    def run_options(self):
        return dict(self.options(), kernel=self.kernel, strict=self.strict, num_threads=self.num_threads)

    def unfold_dmask(self, dmask):
        if self.mask_fold is not None:
            bshape, axes, padded_shape = self.mask_fold
            dmask = dmask.reshape(bshape).sum(axis=axes, keepdims=True)
        return dmask.reshape(self.mask_shape)

    def cast_back(self, x):
        """Weights (computed in float32 for half-precision inputs) in the input dtype, as PyTorch returns them."""
        return x.astype(self.in_dtype) if _is_half(self.in_dtype) else x


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, key_padding_mask=None, key_lengths=None,
                                 causal_alignment="top_left", return_lse=False, seed=0, kernel=None, strict=False,
                                 num_threads=None, return_kernel=False):
    """Scaled dot-product attention with the semantics of torch.nn.functional.scaled_dot_product_attention.

    query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev) -> out (..., Hq, Lq, Ev).
    attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to (..., Hq, Lq, Lk).
    key_padding_mask: bool (..., Lk) with True = padding; or key_lengths: ints (...) = valid keys per batch entry.
    is_causal with causal_alignment 'top_left' (PyTorch: key j <= query i) or 'bottom_right' (FlashAttention:
    j <= i + Lk - Lq); intersected with attn_mask when both are given (PyTorch raises instead).
    A query row with no allowed key returns 0 (PyTorch returns NaN) and lse = -inf.
    Returns out; (out, lse) with return_lse=True, lse (..., Hq, Lq); the kernel's name is appended with
    return_kernel=True.
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, kernel, strict, num_threads)
    return_lse = _check_flag(return_lse, "return_lse")
    out, lse, _, name = _core._forward(call.q, call.k, call.v, **call.run_options(), need_lse=return_lse,
                                       need_weights=False)
    out = out.reshape(call.q_shape[:-1] + (call.v_shape[-1],))
    result = (out,)
    if return_lse:
        result += (lse.reshape(call.q_shape[:-1]),)
    if _check_flag(return_kernel, "return_kernel"):
        result += (name,)
    return result[0] if len(result) == 1 else result


def scaled_dot_product_attention_backward(dout, query, key, value, out, lse, attn_mask=None, dropout_p=0.0,
                                          is_causal=False, scale=None, enable_gqa=False, *, key_padding_mask=None,
                                          key_lengths=None, causal_alignment="top_left", seed=0, kernel=None,
                                          strict=False, num_threads=None, return_kernel=False):
    """Gradients of scaled_dot_product_attention (same options, which must match the forward call).

    dout and out (..., Hq, Lq, Ev), lse (..., Hq, Lq) from the forward with return_lse=True.
    Returns (dq, dk, dv), or (dq, dk, dv, dmask) when attn_mask is a float array (dmask has the mask's own shape:
    the gradient summed over the dimensions it broadcasts along). Rows with no allowed key contribute nothing.
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, kernel, strict, num_threads)
    out_shape = call.q_shape[:-1] + (call.v_shape[-1],)
    arrays = {}
    for x, name, shape in ((dout, "dout", out_shape), (out, "out", out_shape), (lse, "lse", call.q_shape[:-1])):
        a = _as_float_array(x, name)
        if a.shape != shape:
            raise _value_error(f"{name}: expected shape {shape}, got {a.shape}")
        arrays[name] = a.reshape((call.batch,) + call.q.shape[1:3] + shape[len(call.q_shape) - 1:])
    dq, dk, dv, dmask, name = _core._backward(arrays["dout"], call.q, call.k, call.v, arrays["out"], arrays["lse"],
                                              **call.run_options(), need_dmask=call.mask_is_float)
    result = (dq.reshape(call.q_shape), dk.reshape(call.k_shape), dv.reshape(call.v_shape))
    if call.mask_is_float:
        result += (call.unfold_dmask(dmask).astype(call.mask_dtype, copy=False),)
    if _check_flag(return_kernel, "return_kernel"):
        result += (name,)
    return result


def attention_weights(query, key, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                      key_padding_mask=None, key_lengths=None, causal_alignment="top_left", seed=0, num_threads=None):
    """The attention probabilities softmax(scale * q k^T + bias) (..., Hq, Lq, Lk), after dropout (kept weights
    scaled by 1/(1 - p)), with the masks and options of scaled_dot_product_attention. Rows with no allowed key
    are 0. Materialises Lq x Lk per head: meant for inspection and small problems."""
    key_arr = key if isinstance(key, np.ndarray) else np.asarray(key)
    # The library computes weights alongside an output; give it a value of Ev = 1 that costs no memory.
    dummy = np.broadcast_to(np.zeros((), dtype=key_arr.dtype), key_arr.shape[:-1] + (1,))
    call = _Call(query, key_arr, dummy, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, None, False, num_threads)
    _, _, weights, _ = _core._forward(call.q, call.k, call.v, **call.run_options(), need_lse=False, need_weights=True)
    return call.cast_back(weights.reshape(call.weights_shape))


KernelReport = namedtuple("KernelReport", ["selected", "kernels", "problem"])
KernelReport.__doc__ = """Which kernel the registry would choose for a problem and why the others were not eligible.
selected: name of the first eligible kernel (what runs when neither kernel= nor $SATTN_KERNEL forces one);
kernels: [(name, None if eligible else the reason)] in registry order (reference last); problem: a description."""


def explain_kernels(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    *, key_padding_mask=None, key_lengths=None, causal_alignment="top_left", seed=0, backward=False,
                    return_lse=False, need_weights=False):
    """Asks the registry, without running anything, which kernel a call with these arguments would use (forward,
    or the backward with backward=True) and why each faster kernel was rejected. Returns a KernelReport."""
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, None, False, None)
    problem, kernels = _core._explain(call.q, call.k, call.v, **call.options(), backward=_check_flag(backward,
                                      "backward"), need_lse=_check_flag(return_lse, "return_lse"),
                                      need_weights=_check_flag(need_weights, "need_weights"),
                                      need_dmask=call.mask_is_float)
    selected = next((name for name, why in kernels if why is None), None)
    return KernelReport(selected, list(kernels), problem)
