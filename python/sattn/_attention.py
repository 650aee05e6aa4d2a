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
    "describe",
    "AttentionDescription",
]

_ALIGNMENTS = {"top_left": "top_left", "top-left": "top_left", "bottom_right": "bottom_right",
               "bottom-right": "bottom_right"}

try:  # optional: ml_dtypes.bfloat16 arrays
    import ml_dtypes as _ml_dtypes

    _BF16 = np.dtype(_ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = None

def _is_half(dtype):
    return dtype == np.float16 or (_BF16 is not None and dtype == _BF16)


def _native_byte_order(x):
    """Big-endian data (e.g. from a file) is converted to the machine's byte order; the kernels read native."""
    return x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("="))


def _value_error(msg):
    return _core.InvalidArgumentError(msg)


def _type_error(msg):
    return _core.DTypeError(msg)


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


def _check_scale(scale, name="scale"):
    if scale is not None and (isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real)):
        raise _type_error(f"{name}: expected a real number or None, got {type(scale).__name__}")
    return None if scale is None else float(scale)


def _causal(is_causal, causal_alignment):
    """is_causal and causal_alignment as the kernels' causal argument: 'none', 'top_left' or 'bottom_right'."""
    is_causal = _check_flag(is_causal, "is_causal")
    if not isinstance(causal_alignment, str) or causal_alignment not in _ALIGNMENTS:
        raise _value_error(f"causal_alignment: expected 'top_left' (PyTorch's is_causal) or 'bottom_right' "
                           f"(FlashAttention >= 2.1), got {causal_alignment!r}")
    return _ALIGNMENTS[causal_alignment] if is_causal else "none"


def _dtype_name(dtype):
    """numpy's and torch's dtype names as sattn's: 'float32', 'bfloat16', 'bool', ... (torch.float32 -> 'float32')."""
    name = str(dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _spec(x, dtype=None):
    """(shape, dtype name) of an array, a tensor (fake and meta ones included) or anything with .shape and .dtype;
    None stays None."""
    if x is None:
        return None
    return tuple(map(int, x.shape)), _dtype_name(x.dtype if dtype is None else dtype)


AttentionDescription = namedtuple("AttentionDescription", [
    "batch_dims", "batch", "heads_q", "heads_kv", "len_q", "len_k", "head_dim", "head_dim_v", "scale", "problem"])
AttentionDescription.__doc__ = """A call of scaled_dot_product_attention checked by shapes and dtypes, and its 4-D
problem [B, H, L, E]: batch_dims (query's leading dimensions) fold into batch; 2-D inputs have one head; scale is the
one applied (1/sqrt(E) by default). problem: the kernels' one-line description of the call."""


def _mask_fold(mask_shape, weights_shape, nlead):
    """How a mask broadcastable to the weights (..., Hq, Lq, Lk) becomes one of at most 4 dims broadcastable to
    [B, Hq, Lq, Lk]: returns (folded shape, padded shape or None). Size-1 dims are kept (a float mask's gradient is
    reduced to them); leading batch dims beyond one are merged. padded (the mask's shape left-padded with 1s to the
    weights' rank) is given when the mask has batch dims of its own: it is then first expanded to the batch dims."""
    mask_shape, weights_shape = tuple(mask_shape), tuple(weights_shape)
    if not mask_shape:
        return (1,), None  # a scalar broadcasts to everything
    if len(weights_shape) <= 4 or len(mask_shape) <= 3:
        return mask_shape, None
    padded = (1,) * (len(weights_shape) - len(mask_shape)) + mask_shape
    if all(s == 1 for s in padded[:nlead]):
        return (1,) + padded[nlead:], None
    return (math.prod(weights_shape[:nlead]),) + padded[nlead:], padded


def describe(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
             key_padding_mask=None, key_lengths=None, causal_alignment="top_left"):
    """Checks the arguments of a scaled_dot_product_attention call by their shapes and dtypes only, without data
    (numpy arrays, torch tensors including fake and meta ones, or anything with .shape and .dtype), with the same
    checks and messages as the kernels' own validation; returns an AttentionDescription or raises sattn.Error."""
    return _describe(_spec(query), _spec(key), _spec(value), _spec(attn_mask), _spec(key_padding_mask),
                     _spec(key_lengths), _causal(is_causal, causal_alignment), _check_scale(scale),
                     _check_real(dropout_p, "dropout_p"), _check_flag(enable_gqa, "enable_gqa"))


def _describe(query, key, value, attn_mask, key_padding_mask, key_lengths, causal, scale, dropout_p, enable_gqa):
    """describe() on (shape, dtype name) pairs and checked scalars."""
    return AttentionDescription(**_core._describe(query, key, value, attn_mask, key_padding_mask, key_lengths, causal,
                                                  scale, dropout_p, enable_gqa))


def _as_array(x, name):
    """x as a numpy array in the machine's byte order (anything np.asarray accepts; None is refused)."""
    if x is None:
        raise _type_error(f"{name}: expected a numpy array, got None")
    return _native_byte_order(x if isinstance(x, np.ndarray) else np.asarray(x))


def _check_float32_precision(x):
    if not isinstance(x, str) or x not in ("highest", "high", "bf16"):
        raise (_value_error if isinstance(x, str) else _type_error)(
            f"float32_precision: expected 'highest', 'high' or 'bf16', got {x!r}")
    return x


class _Call:
    """The arguments of one call, checked (by describe) and normalised to the native 4-D form [B, H, L, E]."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, kernel, strict, num_threads, float32_precision="highest",
                 positions=(0, 0, 1)):
        q, k, v = _as_array(query, "query"), _as_array(key, "key"), _as_array(value, "value")
        self.in_dtype = q.dtype
        mask = None if attn_mask is None else _as_array(attn_mask, "attn_mask")
        self.mask_dtype = None if mask is None else mask.dtype  # dmask comes back in it
        kpm = None if key_padding_mask is None else _as_array(key_padding_mask, "key_padding_mask")
        klen = None if key_lengths is None else _as_array(key_lengths, "key_lengths")
        if klen is not None and klen.dtype.kind in "iu":
            klen = klen.astype(np.int64)
        self.causal = _causal(is_causal, causal_alignment)
        self.scale = _check_scale(scale)
        self.dropout_p = _check_real(dropout_p, "dropout_p")
        d = _describe(_spec(q), _spec(k), _spec(v), _spec(mask), _spec(kpm), _spec(klen), self.causal, self.scale,
                      self.dropout_p, _check_flag(enable_gqa, "enable_gqa"))
        self.q_shape, self.k_shape, self.v_shape = q.shape, k.shape, v.shape
        self.lead = d.batch_dims
        self.batch = d.batch
        self.len_k = d.len_k
        self.weights_shape = q.shape[:-1] + (self.len_k,)
        self.q, self.k, self.v = _to_4d(q), _to_4d(k), _to_4d(v)
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
        self.float32_precision = _check_float32_precision(float32_precision)
        for name, x in zip(("query_offset", "key_offset", "position_stride"), positions):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
                raise _type_error(f"{name}: expected an int, got {type(x).__name__}")
        self.positions = tuple(int(x) for x in positions)
        self._fold_mask(mask)
        self.kpm = None if kpm is None else kpm.reshape(self.batch, self.len_k)
        self.klen = None if klen is None else klen.reshape(self.batch)

    # attn_mask: folded to at most 4 dims (_mask_fold), which the native side broadcasts to [B, Hq, Lq, Lk] by
    # stride 0.
    def _fold_mask(self, m):
        self.mask = self.mask_fold = None
        self.mask_is_float = False
        if m is None:
            return
        self.mask_shape = m.shape
        self.mask_is_float = m.dtype != np.bool_
        nlead = len(self.lead)
        folded, padded = _mask_fold(m.shape, self.weights_shape, nlead)
        if padded is not None:
            # dmask comes back as [B, ...]; it is summed over the batch dims the mask broadcast along.
            bshape = self.lead + padded[nlead:]
            m = np.broadcast_to(m.reshape(padded), bshape)
            self.mask_fold = (bshape, tuple(i for i in range(nlead) if padded[i] == 1))
        self.mask = m.reshape(folded)

    def options(self):
        return dict(attn_mask=self.mask, key_padding_mask=self.kpm, key_lengths=self.klen, causal=self.causal,
                    scale=self.scale, dropout_p=self.dropout_p, seed=self.seed)

    def run_options(self):
        return dict(self.options(), kernel=self.kernel, strict=self.strict, num_threads=self.num_threads,
                    float32_precision=self.float32_precision, positions=self.positions)

    def unfold_dmask(self, dmask):
        if self.mask_fold is not None:
            bshape, axes = self.mask_fold
            dmask = dmask.reshape(bshape).sum(axis=axes, keepdims=True)
        return dmask.reshape(self.mask_shape)

    def cast_back(self, x):
        """Weights (computed in float32 for half-precision inputs) in the input dtype, as PyTorch returns them."""
        return x.astype(self.in_dtype) if _is_half(self.in_dtype) else x


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, key_padding_mask=None, key_lengths=None,
                                 causal_alignment="top_left", return_lse=False, seed=0, kernel=None, strict=False,
                                 num_threads=None, return_kernel=False, float32_precision="highest", query_offset=0,
                                 key_offset=0, position_stride=1):
    """Scaled dot-product attention with the semantics of torch.nn.functional.scaled_dot_product_attention.

    query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev) -> out (..., Hq, Lq, Ev).
    attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to (..., Hq, Lq, Lk).
    key_padding_mask: bool (..., Lk) with True = padding; or key_lengths: ints (...) = valid keys per batch entry.
    is_causal with causal_alignment 'top_left' (PyTorch: key j <= query i) or 'bottom_right' (FlashAttention:
    j <= i + Lk - Lq); intersected with attn_mask when both are given (PyTorch raises instead).
    A query row with no allowed key returns 0 (PyTorch returns NaN) and lse = -inf.
    float32_precision: 'highest' (default), 'high' or 'bf16', as torch.set_float32_matmul_precision's 'highest',
    'high' and 'medium'. 'bf16': float32 inputs and the softmax probabilities may be rounded to bfloat16 in the fused
    kernel's products where the CPU has bf16 products (the amx and avx512bf16 SIMD targets) — faster, about 2^-9
    relative per rounding. 'high': the amx target takes each float32 value as the sum of two bfloat16 (within about
    2^-17 relative) on the AMX tiles, forward and backward — faster, nearly float32 accuracy. Elsewhere no change.
    (bfloat16 inputs, whose out here is bfloat16, round the probabilities once on those targets in any case.)
    query_offset, key_offset, position_stride: the call is one shard of a longer sequence (sequence parallelism, as
    sattn.dist does): query row i sits at global position query_offset + position_stride * i, key j at
    key_offset + position_stride * j; is_causal (top_left), dropout and key_lengths (then global lengths) use them.
    Returns out; (out, lse) with return_lse=True, lse (..., Hq, Lq); the kernel's name is appended with
    return_kernel=True.
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, kernel, strict, num_threads, float32_precision,
                 (query_offset, key_offset, position_stride))
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
                                          strict=False, num_threads=None, return_kernel=False,
                                          float32_precision="highest", query_offset=0, key_offset=0,
                                          position_stride=1):
    """Gradients of scaled_dot_product_attention (same options, which must match the forward call).

    dout and out (..., Hq, Lq, Ev), lse (..., Hq, Lq) from the forward with return_lse=True.
    Returns (dq, dk, dv), or (dq, dk, dv, dmask) when attn_mask is a float array (dmask has the mask's own shape:
    the gradient summed over the dimensions it broadcasts along). Rows with no allowed key contribute nothing.
    float32_precision as in scaled_dot_product_attention (here: q, k, v and dout rounded in S = QK^T, dP = dO V^T,
    and P and dS rounded in the products of dv, dk and dq; bfloat16 inputs round those once in any case).
    query_offset, key_offset, position_stride as in scaled_dot_product_attention; with the forward's global out
    and lse, a shard's backward gives that shard's part of the gradients.
    """
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, kernel, strict, num_threads, float32_precision,
                 (query_offset, key_offset, position_stride))
    out_shape = call.q_shape[:-1] + (call.v_shape[-1],)
    arrays = {}
    for x, name, shape in ((dout, "dout", out_shape), (out, "out", out_shape), (lse, "lse", call.q_shape[:-1])):
        a = _as_array(x, name)
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


KernelReport = namedtuple("KernelReport", ["selected", "kernels", "problem", "simd"])
KernelReport.__doc__ = """Which kernel the registry would choose for a problem and why the others were not eligible.
selected: name of the first eligible kernel (what runs when neither kernel= nor $SATTN_KERNEL forces one);
kernels: [(name, None if eligible else the reason)] in registry order (reference last); problem: a description;
simd: [(SIMD target, None if the fused kernel would run its build else the reason)], widest first (the CPU lacks
it, another target is selected, the inputs' dtype or float32_precision do not take it, a wider one runs)."""


def explain_kernels(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                    *, key_padding_mask=None, key_lengths=None, causal_alignment="top_left", seed=0, backward=False,
                    return_lse=False, need_weights=False, float32_precision="highest"):
    """Asks the registry, without running anything, which kernel a call with these arguments would use (forward,
    or the backward with backward=True) and why each faster kernel was rejected. Returns a KernelReport."""
    call = _Call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
                 key_lengths, causal_alignment, seed, None, False, None, float32_precision)
    problem, kernels, simd = _core._explain(call.q, call.k, call.v, **call.options(),
                                            backward=_check_flag(backward, "backward"),
                                            need_lse=_check_flag(return_lse, "return_lse"),
                                            need_weights=_check_flag(need_weights, "need_weights"),
                                            need_dmask=call.mask_is_float, float32_precision=call.float32_precision)
    selected = next((name for name, why in kernels if why is None), None)
    return KernelReport(selected, list(kernels), problem, list(simd))
