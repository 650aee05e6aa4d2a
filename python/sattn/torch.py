"""sattn.torch: sattn's kernels as PyTorch 2.x operators, with autograd, torch.compile, torch.export and autocast.

    from sattn.torch import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, is_causal=True)      # torch tensors in, torch tensors out
    out.sum().backward()                                              # dq, dk, dv (and a float attn_mask's grad)

Everything here works on CPU tensors of float32, float64, bfloat16 and float16; results have the inputs' dtype.
The public functions check and reshape their arguments and call operators registered with torch.library:

    sattn::sdpa_forward / sattn::sdpa_backward        scaled_dot_product_attention, MultiheadAttention, use_sattn
    sattn::sparse_forward / sattn::sparse_backward    sparse_attention
    sattn::varlen_forward / sattn::varlen_backward    flash_attn_varlen_func

Each forward operator has an autograd formula (its backward operator), a fake (meta) implementation for
torch.compile / torch.export, and an autocast rule (CPU autocast runs it in bfloat16, as torch's SDPA). Plain
eager calls skip the dispatcher (the eager route below: the same bodies and formulas as a torch.autograd.Function);
one that needs no gradient skips the log-sum-exp too.
The tensors reach the C++ kernels without a copy (their data pointers and strides) and the GIL is released while
they run.
The forward saves what the backward needs (out and the log-sum-exp), so nothing is recomputed or passed by hand.
Double backward is not implemented and raises.

Dropout draws the kernels' Philox seed from torch's default CPU generator (one int64 per call), so
torch.manual_seed(s) reproduces a run; the backward applies the same keep mask. Threads: torch.get_num_threads()
unless num_threads is given (docs/python.md: torch and sattn each have an OpenMP pool).
"""
from __future__ import annotations

import inspect
import math
import numbers
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from . import _core
from ._attention import _causal, _check_flag, _check_real, _check_scale, _describe, _mask_fold, _spec
from ._torch_ring import ring_attention

__all__ = [
    "scaled_dot_product_attention",
    "sparse_attention",
    "flash_attn_varlen_func",
    "MultiheadAttention",
    "multi_head_attention_forward",
    "use_sattn",
    "ring_attention",
]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)
_SEED_HIGH = 2**62  # seeds are drawn in [0, 2**62) from torch's generator


# ---- argument checks (errors are sattn.Error subclasses that are also the builtin exceptions) ----------------------

def _check_tensor(x, name, floating=True):
    if not isinstance(x, Tensor):
        raise _core.DTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "cpu":
        raise _core.UnsupportedError(f"{name}: sattn runs on the CPU, got a tensor on device '{x.device}' "
                                     "(move it with .cpu(), or use torch's own kernels for that device)")
    if floating and x.dtype not in _FLOATS:
        raise _core.DTypeError(f"{name}: expected float32, float64, bfloat16 or float16, got {x.dtype}")
    return x


def _check_qkv(query, key, value):
    """_check_tensor of query, key and value, each tensor once (self-attention passes one tensor three times)."""
    _check_tensor(query, "query")
    if key is not query:
        _check_tensor(key, "key")
    if value is not key and value is not query:
        _check_tensor(value, "value")


def _check_same_dtype(query, key, value):
    if torch.is_autocast_enabled("cpu"):
        return  # autocast casts them to one dtype
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise _core.DTypeError(f"key/value: expected the dtype of query ({query.dtype}), got key {key.dtype} and "
                               f"value {value.dtype}")


def _check_dropout(dropout_p):
    return _check_real(dropout_p, "dropout_p")  # its range: describe


def _threads(num_threads):
    """The operators' num_threads argument: 0 = torch.get_num_threads() when the operator runs (read there, not
    while torch.compile traces the caller)."""
    if num_threads is None:
        return 0
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise _core.DTypeError(f"num_threads: expected None or a positive int, got {type(num_threads).__name__}")
    if not 1 <= num_threads <= 4096:
        raise _core.InvalidArgumentError(f"num_threads: expected None or an int in [1, 4096], got {num_threads}")
    return num_threads


def _run_threads(num_threads):
    return num_threads if num_threads > 0 else torch.get_num_threads()


def _float32_precision(x):
    """The operators' float32_precision argument: 'highest', 'high', 'bf16', or 'auto' (None) for torch's setting, read
    when the operator runs (dynamo cannot trace torch.get_float32_matmul_precision, as for the thread count)."""
    if x is None:
        return "auto"
    if not isinstance(x, str) or x not in ("highest", "high", "bf16"):
        raise (_core.InvalidArgumentError if isinstance(x, str) else TypeError)(
            f"float32_precision: expected None, 'highest', 'high' or 'bf16', got {x!r}")
    return x


def _run_precision(x):
    if x == "auto":
        return {"medium": "bf16", "high": "high"}.get(torch.get_float32_matmul_precision(), "highest")
    return x


def _draw_seed(dropout_p):
    """The kernels' dropout seed, drawn from torch's default CPU generator (a tensor, so that compiled graphs draw a
    fresh one per call); None without dropout."""
    if dropout_p == 0.0:
        return None
    return torch.randint(0, _SEED_HIGH, (), dtype=torch.int64)


def _seed_value(seed):
    return 0 if seed is None else int(seed.item()) % 2**64


def _stats_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_stat_float(x):
    """The sparse engine's biases reach its kernels as float32/float64 (half precision ones, e.g. under autocast, are
    widened here; the gradient is cast back to their dtype). The dense operators take half-precision masks as they
    are."""
    return x.float() if x is not None and x.dtype in _HALF else x


def _contiguous_empty(shape, dtype):
    return torch.empty(shape, dtype=dtype)


def _empty_as(x):
    """An uninitialised contiguous tensor of x's shape and dtype (torch.empty_like costs less than torch.empty with
    a shape, which counts in small calls; docs/PERFORMANCE.md "Small calls")."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _can_take_query_layout(query, ev):
    """Whether an output of last size ev can take the query's layout (_empty_out): the same last size, rows of unit
    stride (as torch's output always has)."""
    return ev == query.shape[-1] and query.stride(-1) == 1


def _empty_out(query, value, dtype=None, query_layout=False):
    """The attention output (query's shape with value's last size), in query's dtype or `dtype`: contiguous, or with
    query_layout (SDPA's out, Ev == E, the query's last dimension of unit stride) in the query's memory layout
    (torch.empty_like), as torch's SDPA makes it: a query viewed from [B, L, H, E] memory (a fused projection's) gives
    an out laid out the same way, so that `out.transpose(1, 2).reshape(B, L, H * E)`, a transformer's next step, is a
    view, not a copy."""
    if query_layout and _can_take_query_layout(query, value.shape[-1]):
        return torch.empty_like(query, dtype=dtype or query.dtype)
    if value.shape[-1] == query.shape[-1] and dtype in (None, query.dtype):
        return _empty_as(query)
    return _contiguous_empty(tuple(query.shape[:-1]) + (value.shape[-1],), dtype or query.dtype)


# Half precision and the backward. The backward computes Di = rowsum(dO * out); from a half out it would carry out's
# rounding into dq and dk. Where a gradient may be needed (_run), a forward operator on half-precision inputs gets
# float32_out=True (its last argument): it computes out in float32 (the same products and P rounding as for a half
# out) and returns it twice, rounded to the inputs' dtype and as it is (its last output, out_float32), which the
# autograd formula saves for the backward. Otherwise out_float32 is an empty tensor. The rounding happens inside the
# operator, so eager and compiled calls give the same bits and the gradient reaches the backward in the inputs' dtype.

def _float32_out(query, float32_out):
    return float32_out and query.dtype in _HALF


def _forward_out(query, value, float32_out, query_layout=False):
    """The out the kernels write: float32 for a float32_out call on half-precision inputs (layout: _empty_out)."""
    return _empty_out(query, value, torch.float32 if _float32_out(query, float32_out) else None, query_layout)


def _forward_outputs(query, out, float32_out):
    """(out in query's dtype, out_float32) from the out the kernels wrote."""
    if _float32_out(query, float32_out):
        return out.to(query.dtype), out
    return out, query.new_empty((0,))


def _fake_outputs(query, shape, float32_out, query_layout=False):
    """The fake (out, out_float32) of a forward operator, laid out as the real ones (_empty_out)."""
    def empty(dtype=None):
        if query_layout and _can_take_query_layout(query, shape[-1]):
            return torch.empty_like(query, dtype=dtype or query.dtype)
        return query.new_empty(shape, dtype=dtype or query.dtype)

    if _float32_out(query, float32_out):
        return empty(), empty(torch.float32)
    return empty(), query.new_empty((0,))


def _saved_out(out, out_float32):
    """The out that the backward reads: the float32 one where the operator made it."""
    return out_float32 if out_float32.dtype != out.dtype else out


def _forward_precision(query, float32_precision, float32_out):
    """The kernels' float32_precision for a forward: bf16 inputs writing a float32 out take "bf16", so that their
    products and P's rounding are those of a bf16 out (the float32 out is then that out before its rounding)."""
    if float32_out and query.dtype == torch.bfloat16:
        return "bf16"
    return _run_precision(float32_precision)


# ---- the eager route ----------------------------------------------------------------------------------------------
# A call through torch.library's dispatcher and its Python autograd wrapper costs more than the kernels at small
# sizes (docs/python.md). An eager call on plain CPU tensors, with nothing around it that must see the operator,
# runs the operator's own body and autograd formula directly (a torch.autograd.Function). Everything else goes
# through the operators: torch.compile and export, dispatch modes (FakeTensorMode, make_fx, FlopCounterMode...),
# torch-function modes, functorch transforms (vmap, grad), autocast, the profiler, torch.jit tracing, tensor
# subclasses. Both routes run the same code on the same tensors, so their results are identical. A call that needs no
# gradient runs the body without the log-sum-exp (_sdpa_inference, for scaled_dot_product_attention's common call).

_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)
try:  # torch's private state queries (2.15 has them); a torch without one of them takes the operators always
    _MODES = (torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled,
              torch._C._functorch.peek_interpreter_stack, torch._C._autograd._profiler_enabled,
              torch._C._get_tracing_state)
except AttributeError:
    _MODES = None


def _eager_state():
    """Whether nothing around the call must see the operators (the conditions of the eager route but the tensors')."""
    if _MODES is None or torch.compiler.is_compiling():
        return False
    dispatch_modes, function_modes, functorch, profiler, tracing = _MODES
    return (dispatch_modes() == 0 and not function_modes() and functorch() is None and not profiler()
            and tracing() is None and not torch.is_autocast_enabled("cpu"))


def _eager(tensors):
    return _eager_state() and all(type(t) in _PLAIN_TENSORS for t in tensors if t is not None)


def _eager_backward(saved, grad_out):
    """Whether an autograd formula may call its backward body directly: eagerly, and not building a graph of the
    gradient (create_graph=True goes to the backward operator, whose own formula refuses double backward)."""
    return not torch.is_grad_enabled() and _eager((*saved, grad_out))


def _eager_function(name, forward_impl, setup_context, autograd):
    """The torch.autograd.Function of an operator: its forward body, setup_context and autograd formula."""

    def forward(ctx, *inputs):
        output = forward_impl(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(forward), "backward": staticmethod(autograd),
                                                   "impl": staticmethod(forward_impl)})


def _run(operator, function, *args):
    """A forward operator's call: through the dispatcher, or on the eager route (the Function where a gradient may
    be needed, else the body itself). Its outputs but the last (out_float32); float32_out where a gradient may be
    needed (see _float32_out)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    args += (grad,)
    if not _eager(tensors):
        return operator(*args)[:-1]
    if grad:
        return function.apply(*args)[:-1]
    return function.impl(*args)[:-1]


# ---- sattn::sdpa_forward / sattn::sdpa_backward -------------------------------------------------------------------
# 4-D query [B, Hq, Lq, E], key [B, Hkv, Lk, E], value [B, Hkv, Lk, Ev]; attn_mask bool (True = may attend) or float
# (additive), at most 4-D and broadcastable to [B, Hq, Lq, Lk]; key_padding_mask bool [B, Lk] (True = padding);
# causal "none" | "top_left" | "bottom_right"; float32_precision "highest" | "high" | "bf16" (AttentionOptions) |
# "auto" (torch.get_float32_matmul_precision() when the operator runs: "medium" is "bf16"). Returns out
# [B, Hq, Lq, Ev] (query's dtype), lse [B, Hq, Lq] (float32; float64 for float64 inputs) and out_float32 (see "Half
# precision and the backward" above).

def _sdpa_forward_impl(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
                       key_padding_mask: Optional[Tensor], causal: str, scale: Optional[float], dropout_p: float,
                       seed: Optional[Tensor], num_threads: int, float32_precision: str = "highest",
                       float32_out: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    B, Hq, Lq, _ = query.shape
    out = _forward_out(query, value, float32_out, query_layout=True)
    lse = _contiguous_empty((B, Hq, Lq), _stats_dtype(query.dtype))
    _core._torch_sdpa_forward(query, key, value, attn_mask, key_padding_mask, causal, scale,
                              dropout_p, _seed_value(seed), _run_threads(num_threads), out, lse,
                              _forward_precision(query, float32_precision, float32_out))
    out, out_float32 = _forward_outputs(query, out, float32_out)
    return out, lse, out_float32


_sdpa_forward = torch.library.custom_op("sattn::sdpa_forward", _sdpa_forward_impl, mutates_args=(),
                                        device_types="cpu")


def _describe_4d(query, key, value, attn_mask, key_padding_mask, causal, scale, dropout_p):
    """The operators' argument checks (describe) on their 4-D tensors, where every size is known: under
    torch.compile with dynamic shapes the symbolic sizes are left alone (reading them would specialise the graph), and
    the kernels check the real tensors when they run."""
    tensors = [t for t in (query, key, value, attn_mask, key_padding_mask) if t is not None]
    if all(isinstance(n, int) for t in tensors for n in t.shape):
        _describe(_spec(query), _spec(key), _spec(value), _spec(attn_mask), _spec(key_padding_mask), None, causal,
                  scale, dropout_p, True)


@_sdpa_forward.register_fake
def _sdpa_forward_fake(query, key, value, attn_mask, key_padding_mask, causal, scale, dropout_p, seed, num_threads,
                       float32_precision="highest", float32_out=False):
    _describe_4d(query, key, value, attn_mask, key_padding_mask, causal, scale, dropout_p)
    B, Hq, Lq, _ = query.shape
    out, out_float32 = _fake_outputs(query, (B, Hq, Lq, value.shape[-1]), float32_out, query_layout=True)
    return out, query.new_empty((B, Hq, Lq), dtype=_stats_dtype(query.dtype)), out_float32


def _sdpa_backward_impl(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                        attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], causal: str,
                        scale: Optional[float], dropout_p: float, seed: Optional[Tensor], num_threads: int,
                        need_dmask: bool, float32_precision: str = "highest") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq = _empty_as(query)
    dk = _empty_as(key)
    dv = _empty_as(value)
    dmask = _empty_as(attn_mask) if need_dmask else None  # in the mask's dtype, half precision included
    _core._torch_sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, key_padding_mask, causal, scale,
                               dropout_p, _seed_value(seed), _run_threads(num_threads), dq, dk, dv, dmask,
                               _run_precision(float32_precision))
    if dmask is None:
        return dq, dk, dv, query.new_empty((0,))
    return dq, dk, dv, dmask


_sdpa_backward = torch.library.custom_op("sattn::sdpa_backward", _sdpa_backward_impl, mutates_args=(),
                                         device_types="cpu")


@_sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out, query, key, value, out, lse, attn_mask, key_padding_mask, causal, scale,
                        dropout_p, seed, num_threads, need_dmask, float32_precision="highest"):
    _describe_4d(query, key, value, attn_mask, key_padding_mask, causal, scale, dropout_p)
    dmask = attn_mask.new_empty(attn_mask.shape) if need_dmask else query.new_empty((0,))
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dmask


def _sdpa_setup_context(ctx, inputs, output):
    query, key, value, attn_mask, key_padding_mask, causal, scale, dropout_p, seed, num_threads, precision = inputs[:11]
    out, lse, out_float32 = output
    ctx.save_for_backward(query, key, value, attn_mask, key_padding_mask, seed, _saved_out(out, out_float32), lse)
    ctx.options = (causal, scale, dropout_p, num_threads, precision)
    ctx.mark_non_differentiable(lse, out_float32)
    ctx.set_materialize_grads(False)  # lse's gradient stays None (no zero tensor made for it at each backward)


def _sdpa_autograd(ctx, grad_out, grad_lse, grad_out_float32):
    if grad_out is None:  # out's gradient undefined (grads are not materialised): no input gets one
        return (None,) * 12
    saved = ctx.saved_tensors  # unpacked once (saved-tensor hooks run at each unpacking)
    query, key, value, attn_mask, key_padding_mask, seed, out, lse = saved
    causal, scale, dropout_p, num_threads, precision = ctx.options
    need_dmask = bool(attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3])
    backward = _sdpa_backward_impl if _eager_backward(saved, grad_out) else _sdpa_backward
    dq, dk, dv, dmask = backward(grad_out, query, key, value, out, lse, attn_mask, key_padding_mask, causal,
                                 scale, dropout_p, seed, num_threads, need_dmask, precision)
    return dq, dk, dv, (dmask if need_dmask else None), None, None, None, None, None, None, None, None


def _no_double_backward(ctx, *grads):
    raise RuntimeError("sattn.torch: double backward (the gradient of a gradient, e.g. create_graph=True followed by "
                       "another backward) is not implemented for sattn's attention operators")


torch.library.register_autograd("sattn::sdpa_forward", _sdpa_autograd, setup_context=_sdpa_setup_context)
torch.library.register_autograd("sattn::sdpa_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
torch.library.register_autocast("sattn::sdpa_forward", "cpu", torch.bfloat16)
_SdpaFunction = _eager_function("SdpaFunction", _sdpa_forward_impl, _sdpa_setup_context, _sdpa_autograd)


def _to_4d(x):
    """(L, E) -> (1, 1, L, E); (H, L, E) -> (1, H, L, E); (B, H, L, E) as is; (..., H, L, E) -> (prod(...), H, L, E)."""
    if x.dim() == 2:
        return x[None, None]
    if x.dim() == 3:
        return x[None]
    if x.dim() == 4:
        return x
    return x.reshape((-1,) + tuple(x.shape[-3:]))


def _sdpa_inference(query, key, value, attn_mask, key_padding_mask, causal, scale, num_threads, float32_precision):
    """An eager call that needs no gradient, on plain 4-D CPU tensors with at most a 4-D attn_mask and no dropout
    (inference's common call, decoding included, where the fixed cost of a call matters most): the forward operator's
    body without the log-sum-exp, which only the backward reads (one tensor less to make; the same output bits)."""
    out = _empty_out(query, value, query_layout=True)
    _core._torch_sdpa_forward(query, key, value, attn_mask, key_padding_mask, causal, scale, 0.0, 0,
                              _run_threads(num_threads), out, None, _run_precision(float32_precision))
    return out


def _sdpa_unsupported(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):
    """Why sattn cannot run a call of torch.nn.functional.scaled_dot_product_attention (None if it can)."""
    for x, name in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(x, Tensor):
            return f"{name} is a {type(x).__name__}, not a torch.Tensor"
        if x.device.type != "cpu":
            return f"{name} is on device '{x.device}' (sattn runs on the CPU)"
        if x.dtype not in _FLOATS:
            return f"{name} has dtype {x.dtype} (sattn takes float32, float64, bfloat16, float16)"
        if x.is_nested or x.layout != torch.strided:
            return f"{name} is not a dense strided tensor"
        if x.dim() < 2:
            return f"{name} has {x.dim()} dimensions (at least 2 needed)"
    if not torch.is_autocast_enabled("cpu") and not (query.dtype == key.dtype == value.dtype):
        return "query, key and value have different dtypes"
    if not query.dim() == key.dim() == value.dim():
        return "query, key and value have different numbers of dimensions"
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
        return "the batch dimensions of query, key and value differ (sattn does not broadcast them)"
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor) or attn_mask.device.type != "cpu":
            return "attn_mask is not a CPU tensor"
        if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
            return f"attn_mask has dtype {attn_mask.dtype}"
        if is_causal:
            return "attn_mask together with is_causal (torch refuses it; sattn would intersect them)"
    return None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, key_padding_mask=None, causal_alignment="top_left",
                                 num_threads=None, float32_precision=None):
    """torch.nn.functional.scaled_dot_product_attention on sattn's kernels (CPU tensors).

    query (..., Hq, Lq, E), key (..., Hkv, Lk, E), value (..., Hkv, Lk, Ev) -> (..., Hq, Lq, Ev), in the inputs'
    dtype (float32, float64, bfloat16, float16). 2-D, 3-D, 4-D or more leading batch dims (flattened).
    attn_mask: bool (True = may attend) or float (added to the scores), broadcastable to (..., Hq, Lq, Lk);
    differentiable when float. Hq != Hkv needs enable_gqa=True (query head h reads key/value head h // (Hq/Hkv)).
    key_padding_mask: bool (..., Lk), True = padding. is_causal with causal_alignment "top_left" (PyTorch: key
    j <= query i) or "bottom_right" (FlashAttention: j <= i + Lk - Lq); with attn_mask the two are intersected.
    A query row with no allowed key gives 0 (as torch 2.x). Dropout's seed comes from torch's default generator.
    Differentiable with respect to query, key, value and a float attn_mask.
    float32_precision: 'highest', 'high' or 'bf16'. 'bf16': float32 inputs and the softmax probabilities may be
    rounded to bfloat16 in the products where the CPU has bf16 products (faster, about 2^-9 relative per rounding).
    'high': on AMX each float32 value is taken as the sum of two bfloat16 (within about 2^-17 relative; faster,
    forward and backward). None (default) follows torch.get_float32_matmul_precision(): 'medium' means
    'bf16', 'high' 'high' and 'highest' 'highest'.
    """
    if (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor
            and (attn_mask is None or (type(attn_mask) is Tensor and attn_mask.is_cpu and attn_mask.dim() <= 4))
            and (key_padding_mask is None or (type(key_padding_mask) is Tensor and key_padding_mask.is_cpu))
            and type(dropout_p) is float and dropout_p == 0.0 and type(enable_gqa) is bool
            and query.is_cpu and key.is_cpu and value.is_cpu and query.dim() == 4 and key.dim() == 4
            and value.dim() == 4 and (enable_gqa or query.shape[1] == key.shape[1]) and _eager_state()):
        # The common eager call: plain 4-D CPU tensors, at most a 4-D attn_mask (which then needs no folding), no
        # dropout. The kernels check the rest (shapes, dtypes, the masks' shapes) with the messages of describe.
        causal, scale = _causal(is_causal, causal_alignment), _check_scale(scale)
        threads, precision = _threads(num_threads), _float32_precision(float32_precision)
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or (attn_mask is not None and attn_mask.requires_grad)):
            return _SdpaFunction.apply(query, key, value, attn_mask, key_padding_mask, causal, scale, 0.0, None,
                                       threads, precision, True)[0]
        return _sdpa_inference(query, key, value, attn_mask, key_padding_mask, causal, scale, threads, precision)
    for x, name in ((query, "query"), (key, "key"), (value, "value"), (attn_mask, "attn_mask"),
                    (key_padding_mask, "key_padding_mask")):
        if x is not None:
            _check_tensor(x, name, floating=False)
    # Under autocast the operator runs in bfloat16 whatever the (floating) inputs' dtypes.
    autocast = torch.is_autocast_enabled("cpu") and all(x.is_floating_point() for x in (query, key, value))
    qkv_dtype = torch.bfloat16 if autocast else None
    causal = _causal(is_causal, causal_alignment)
    dropout_p = _check_dropout(dropout_p)
    scale = _check_scale(scale)
    enable_gqa = _check_flag(enable_gqa, "enable_gqa")
    plain_4d = query.dim() == key.dim() == value.dim() == 4 and attn_mask is None and key_padding_mask is None
    if not torch.compiler.is_compiling() and not plain_4d:
        _core._describe(_spec(query, qkv_dtype), _spec(key, qkv_dtype), _spec(value, qkv_dtype),
                        _spec(attn_mask), _spec(key_padding_mask), None, causal, scale, dropout_p, enable_gqa)
    elif not enable_gqa and query.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        # Compiled (dynamo cannot trace the native describe) or plain 4-D (the kernels' own validation gives describe's
        # messages), the operators check the 4-D form; this is the one check they cannot make, as they take any Hq
        # that is a multiple of Hkv.
        raise _core.InvalidArgumentError(f"key/value: query has Hq = {query.shape[-3]} heads (dimension -3) but "
                                         f"key/value have Hkv = {key.shape[-3]}; pass enable_gqa=True for "
                                         "grouped-query attention (as PyTorch 2.5)")
    lead, len_k = tuple(query.shape[:-3]), key.shape[-2]
    mask = attn_mask
    if mask is not None:
        folded, padded = _mask_fold(mask.shape, tuple(query.shape[:-1]) + (len_k,), len(lead))
        if padded is not None:  # batch dims of its own: expanded to the query's, then merged into B
            mask = mask.reshape(padded).expand(lead + padded[len(lead):])
        mask = mask.reshape(folded)
    kpm = None if key_padding_mask is None else key_padding_mask.reshape(-1, len_k)
    q4, k4, v4 = _to_4d(query), _to_4d(key), _to_4d(value)
    out, _ = _run(_sdpa_forward, _SdpaFunction, q4, k4, v4, mask, kpm, causal, scale, dropout_p,
                  _draw_seed(dropout_p), _threads(num_threads), _float32_precision(float32_precision))
    return out if query.dim() == 4 else out.reshape(tuple(query.shape[:-1]) + (value.shape[-1],))


# ---- sattn::sparse_forward / sattn::sparse_backward ---------------------------------------------------------------
# 4-D query [B, Hq, Lq, D], key [B, Hkv, Lk, D], value [B, Hkv, Lk, Dv]; pattern: a spec (sattn.Pattern's repr).
# Returns out [B, Hq, Lq, Dv] (query's dtype), lse [B, Hq, Lq] (float32/float64), indices (int64: the selection of
# TopK / BlockTopK, else empty) and out_float32.

@torch.compiler.assume_constant_result
def _pattern_spec(pattern):
    """The canonical spec (the operators' pattern argument) of a sattn.Pattern or a spec string; parse errors are
    raised here, naming the spec. A function of its constant argument: torch.compile calls it while tracing and
    keeps the result (dynamo cannot trace into the C++ parser)."""
    return repr(pattern if isinstance(pattern, _core.Pattern) else _core.parse_pattern(pattern))


@torch.compiler.assume_constant_result
def _selection_kind(pattern):
    """("none" | "per_query" | "per_block", count): what the pattern's indices output holds per (b, h, row). A
    function of the spec alone, kept as a constant by torch.compile (as _pattern_spec)."""
    probe = 4099  # a prime: only a per-query selection (TopK, or BlockTopK with blocks of 1) has this many rows
    shape = _core._torch_sparse_selection_shape(pattern, 1, 1, probe, probe)
    if not shape:
        return "none", 0
    return ("per_query" if shape[2] == probe else "per_block"), shape[3]


def _selection_shape(pattern, B, Hq, Lq, Lk):
    """Shape of the indices output ((0,) when the pattern selects nothing); symbolic sizes under torch.compile."""
    if all(isinstance(x, int) for x in (B, Hq, Lq, Lk)):
        shape = tuple(_core._torch_sparse_selection_shape(pattern, B, Hq, Lq, Lk))
        return shape if shape else (0,)
    kind, count = _selection_kind(pattern)
    if kind == "none":
        return (0,)
    if kind == "per_query":
        return (B, Hq, Lq, count)
    return (B, Hq, torch.library.get_ctx().new_dynamic_size(), count)  # query blocks aligned to Lk - Lq


def _sparse_forward_impl(query: Tensor, key: Tensor, value: Tensor, pattern: str, scale: Optional[float],
                         enable_gqa: bool, key_padding_mask: Optional[Tensor], block: int,
                         alibi_slopes: Optional[list[float]], softcap: float, bias: Optional[Tensor],
                         rel_pos_bias: Optional[Tensor], num_threads: int, float32_precision: str = "highest",
                         float32_out: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, Hq, Lq, _ = query.shape
    out = _forward_out(query, value, float32_out)
    lse = _contiguous_empty((B, Hq, Lq), _stats_dtype(query.dtype))
    ishape = _selection_shape(pattern, B, Hq, Lq, key.shape[2])
    indices = _contiguous_empty(ishape, torch.int64)
    _core._torch_sparse_forward(query, key, value, pattern, scale, enable_gqa, key_padding_mask, block, alibi_slopes,
                                softcap, _as_stat_float(bias), _as_stat_float(rel_pos_bias), _run_threads(num_threads),
                                out, lse, indices if len(ishape) == 4 else None,
                                _forward_precision(query, float32_precision, float32_out))
    out, out_float32 = _forward_outputs(query, out, float32_out)
    return out, lse, indices, out_float32


_sparse_forward = torch.library.custom_op("sattn::sparse_forward", _sparse_forward_impl, mutates_args=(),
                                          device_types="cpu")


@_sparse_forward.register_fake
def _sparse_forward_fake(query, key, value, pattern, scale, enable_gqa, key_padding_mask, block, alibi_slopes,
                         softcap, bias, rel_pos_bias, num_threads, float32_precision="highest", float32_out=False):
    B, Hq, Lq, _ = query.shape
    out, out_float32 = _fake_outputs(query, (B, Hq, Lq, value.shape[-1]), float32_out)
    return (out, query.new_empty((B, Hq, Lq), dtype=_stats_dtype(query.dtype)),
            query.new_empty(_selection_shape(pattern, B, Hq, Lq, key.shape[2]), dtype=torch.int64), out_float32)


def _sparse_backward_impl(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
                          indices: Tensor, pattern: str, scale: Optional[float], enable_gqa: bool,
                          key_padding_mask: Optional[Tensor], block: int, alibi_slopes: Optional[list[float]],
                          softcap: float, bias: Optional[Tensor], rel_pos_bias: Optional[Tensor],
                          num_threads: int,
                          float32_precision: str = "highest") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq = _empty_as(query)
    dk = _empty_as(key)
    dv = _empty_as(value)
    b32, r32 = _as_stat_float(bias), _as_stat_float(rel_pos_bias)
    dbias = _empty_as(b32) if bias is not None else None
    drel = _empty_as(r32) if rel_pos_bias is not None else None
    _core._torch_sparse_backward(grad_out, query, key, value, out, lse, pattern, scale, enable_gqa, key_padding_mask,
                                 block, alibi_slopes, softcap, b32, r32, _run_threads(num_threads),
                                 indices if indices.dim() == 4 else None, dq, dk, dv, dbias, drel,
                                 _run_precision(float32_precision))
    return (dq, dk, dv, query.new_empty((0,)) if dbias is None else dbias.to(bias.dtype),
            query.new_empty((0,)) if drel is None else drel.to(rel_pos_bias.dtype))


_sparse_backward = torch.library.custom_op("sattn::sparse_backward", _sparse_backward_impl, mutates_args=(),
                                           device_types="cpu")


@_sparse_backward.register_fake
def _sparse_backward_fake(grad_out, query, key, value, out, lse, indices, pattern, scale, enable_gqa,
                          key_padding_mask, block, alibi_slopes, softcap, bias, rel_pos_bias, num_threads,
                          float32_precision="highest"):
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape),
            query.new_empty((0,)) if bias is None else bias.new_empty(bias.shape),
            query.new_empty((0,)) if rel_pos_bias is None else rel_pos_bias.new_empty(rel_pos_bias.shape))


def _sparse_setup_context(ctx, inputs, output):
    (query, key, value, pattern, scale, enable_gqa, key_padding_mask, block, alibi_slopes, softcap, bias,
     rel_pos_bias, num_threads, float32_precision) = inputs[:14]
    out, lse, indices, out_float32 = output
    ctx.save_for_backward(query, key, value, key_padding_mask, bias, rel_pos_bias, _saved_out(out, out_float32), lse,
                          indices)
    ctx.options = (pattern, scale, enable_gqa, block, alibi_slopes, softcap, num_threads, float32_precision)
    ctx.mark_non_differentiable(lse, indices, out_float32)
    ctx.set_materialize_grads(False)  # no zero tensors for the non-differentiable outputs


def _sparse_autograd(ctx, grad_out, grad_lse, grad_indices, grad_out_float32):
    if grad_out is None:  # out's gradient undefined (grads are not materialised): no input gets one
        return (None,) * 15
    saved = ctx.saved_tensors
    query, key, value, key_padding_mask, bias, rel_pos_bias, out, lse, indices = saved
    pattern, scale, enable_gqa, block, alibi_slopes, softcap, num_threads, float32_precision = ctx.options
    backward = _sparse_backward_impl if _eager_backward(saved, grad_out) else _sparse_backward
    dq, dk, dv, dbias, drel = backward(grad_out, query, key, value, out, lse, indices, pattern, scale,
                                       enable_gqa, key_padding_mask, block, alibi_slopes, softcap, bias,
                                       rel_pos_bias, num_threads, float32_precision)
    return (dq, dk, dv, None, None, None, None, None, None, None, dbias if bias is not None else None,
            drel if rel_pos_bias is not None else None, None, None, None)


torch.library.register_autograd("sattn::sparse_forward", _sparse_autograd, setup_context=_sparse_setup_context)
torch.library.register_autograd("sattn::sparse_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
torch.library.register_autocast("sattn::sparse_forward", "cpu", torch.bfloat16)
_SparseFunction = _eager_function("SparseFunction", _sparse_forward_impl, _sparse_setup_context, _sparse_autograd)


def sparse_attention(query, key, value, pattern, scale=None, enable_gqa=False, *, key_padding_mask=None,
                     return_lse=False, return_indices=False, block=64, alibi_slopes=None, softcap=0.0, bias=None,
                     rel_pos_bias=None, num_threads=None, float32_precision=None):
    """sattn.sparse_attention on torch tensors, differentiable with respect to query, key, value, bias and
    rel_pos_bias. query [B, Hq, Lq, D], key [B, Hkv, Lk, D], value [B, Hkv, Lk, Dv]; pattern: a sattn.Pattern or
    its spec (e.g. "SlidingWindow(256, 256)", "TopK(32)"); the keyword arguments are sattn.sparse_attention's
    (docs/sparse.md). Returns out [B, Hq, Lq, Dv] in the inputs' dtype; with return_lse=True also lse
    [B, Hq, Lq], with return_indices=True the TopK/BlockTopK selection (int64); neither is differentiable.
    float32_precision: 'highest', 'bf16' (float32 inputs may take the bf16 products, forward and backward), 'high'
    (here as 'highest') or None (torch.get_float32_matmul_precision(), 'medium' being 'bf16')."""
    for x, name in ((query, "query"), (key, "key"), (value, "value")):
        _check_tensor(x, name)
    _check_same_dtype(query, key, value)
    if isinstance(pattern, (_core.Pattern, str)):
        spec = _pattern_spec(pattern)
    else:
        raise _core.DTypeError(f"pattern: expected a sattn.Pattern or a pattern spec (str), got "
                               f"{type(pattern).__name__}")
    if return_indices and _selection_kind(spec)[0] == "none":
        raise _core.InvalidArgumentError(f"return_indices: only TopK and BlockTopK patterns return a selection, "
                                         f"got {spec}")
    for x, name in ((key_padding_mask, "key_padding_mask"), (bias, "bias"), (rel_pos_bias, "rel_pos_bias")):
        if x is not None:
            _check_tensor(x, name, floating=name != "key_padding_mask")
    if alibi_slopes is not None:
        alibi_slopes = [float(s) for s in (alibi_slopes.tolist() if isinstance(alibi_slopes, Tensor)
                                           else alibi_slopes)]
    if isinstance(block, bool) or not isinstance(block, int):
        raise _core.DTypeError(f"block: expected an int, got {type(block).__name__}")
    out, lse, indices = _run(_sparse_forward, _SparseFunction, query, key, value, spec, _check_scale(scale),
                             _check_flag(enable_gqa, "enable_gqa"), key_padding_mask, block, alibi_slopes,
                             float(softcap), bias, rel_pos_bias, _threads(num_threads),
                             _float32_precision(float32_precision))
    result = (out,)
    if _check_flag(return_lse, "return_lse"):
        result += (lse,)
    if _check_flag(return_indices, "return_indices"):
        result += (indices,)
    return result[0] if len(result) == 1 else result


# ---- sattn::varlen_forward / sattn::varlen_backward ---------------------------------------------------------------
# Packed sequences: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv], cu_seqlens int32/int64 [n + 1].
# Returns out [total_q, Hq, Dv] (q's dtype), lse [Hq, total_q] (FlashAttention's layout) and out_float32.

def _varlen_forward_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: Optional[float],
                         num_threads: int, float32_precision: str = "highest",
                         float32_out: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    out = _forward_out(q, v, float32_out)
    lse = _contiguous_empty((q.shape[1], q.shape[0]), _stats_dtype(q.dtype))
    _core._torch_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                _run_threads(num_threads), out, lse,
                                _forward_precision(q, float32_precision, float32_out))
    out, out_float32 = _forward_outputs(q, out, float32_out)
    return out, lse, out_float32


_varlen_forward = torch.library.custom_op("sattn::varlen_forward", _varlen_forward_impl, mutates_args=(),
                                          device_types="cpu")


@_varlen_forward.register_fake
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                         num_threads, float32_precision="highest", float32_out=False):
    out, out_float32 = _fake_outputs(q, (q.shape[0], q.shape[1], v.shape[-1]), float32_out)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=_stats_dtype(q.dtype)), out_float32


def _varlen_backward_impl(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          causal: bool, scale: Optional[float], num_threads: int,
                          float32_precision: str = "highest") -> tuple[Tensor, Tensor, Tensor]:
    dq = _empty_as(q)
    dk = _empty_as(k)
    dv = _empty_as(v)
    _core._torch_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, scale, _run_threads(num_threads), dq, dk, dv,
                                 _run_precision(float32_precision))
    return dq, dk, dv


_varlen_backward = torch.library.custom_op("sattn::varlen_backward", _varlen_backward_impl, mutates_args=(),
                                           device_types="cpu")


@_varlen_backward.register_fake
def _varlen_backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal, scale, num_threads, float32_precision="highest"):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, num_threads, precision = inputs[:11]
    out, lse, out_float32 = output
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, _saved_out(out, out_float32), lse)
    ctx.options = (max_seqlen_q, max_seqlen_k, causal, scale, num_threads, precision)
    ctx.mark_non_differentiable(lse, out_float32)
    ctx.set_materialize_grads(False)  # no zero tensors for the non-differentiable outputs


def _varlen_autograd(ctx, grad_out, grad_lse, grad_out_float32):
    if grad_out is None:  # out's gradient undefined (grads are not materialised): no input gets one
        return (None,) * 12
    saved = ctx.saved_tensors
    q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse = saved
    max_seqlen_q, max_seqlen_k, causal, scale, num_threads, precision = ctx.options
    backward = _varlen_backward_impl if _eager_backward(saved, grad_out) else _varlen_backward
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, causal, scale, num_threads, precision)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("sattn::varlen_forward", _varlen_autograd, setup_context=_varlen_setup_context)
torch.library.register_autograd("sattn::varlen_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None)
torch.library.register_autocast("sattn::varlen_forward", "cpu", torch.bfloat16)
_VarlenFunction = _eager_function("VarlenFunction", _varlen_forward_impl, _varlen_setup_context, _varlen_autograd)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, *, num_threads=None, float32_precision=None):
    """FlashAttention's flash_attn_varlen_func on sattn's fused kernel (CPU tensors), differentiable with respect
    to q, k and v. q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] (Hq a multiple of Hkv);
    cu_seqlens_q/k int32 [n + 1] (sequence s owns rows cu[s]:cu[s+1]); max_seqlen_q/k >= every length. causal is
    bottom-right within each sequence, as in FlashAttention >= 2.1. Returns out [total_q, Hq, Dv] in q's dtype.
    Dropout is not supported (dropout_p must be 0). float32_precision as in scaled_dot_product_attention (None:
    torch.get_float32_matmul_precision(), "medium" being "bf16")."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_tensor(x, name)
    _check_same_dtype(q, k, v)
    for x, name in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k")):
        _check_tensor(x, name, floating=False)
    if dropout_p != 0.0:
        raise _core.UnsupportedError(f"dropout_p: sattn's varlen attention has no dropout; expected 0.0, got "
                                     f"{dropout_p}")
    for x, name in ((max_seqlen_q, "max_seqlen_q"), (max_seqlen_k, "max_seqlen_k")):
        if isinstance(x, bool) or not isinstance(x, int):
            raise _core.DTypeError(f"{name}: expected an int, got {type(x).__name__}")
    out, _ = _run(_varlen_forward, _VarlenFunction, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, _check_flag(causal, "causal"), _check_scale(softmax_scale, "softmax_scale"),
                  _threads(num_threads), _float32_precision(float32_precision))
    return out


# ---- MultiheadAttention -------------------------------------------------------------------------------------------

class MultiheadAttention(torch.nn.MultiheadAttention):
    """torch.nn.MultiheadAttention with its attention on sattn (sattn::sdpa_forward): the same constructor,
    parameters, state_dict, forward arguments, masks (bool True = may NOT attend / is padding; float added),
    shapes and results. load_state_dict(torch_mha.state_dict()) gives torch's outputs and, after backward(), its
    parameter gradients.

    need_weights=True (torch's default) also returns the attention weights, computed as torch computes them
    (materialised softmax, averaged over heads when average_attn_weights); the output still comes from sattn,
    except in training with dropout > 0, where it is the dropped-out weights times the values as in torch (so that
    weights and output agree). With need_weights=False nothing of size L x S is materialised: key_padding_mask and
    a bool attn_mask reach the kernel as they are. A query row with no allowed key gives 0 (torch gives 0 with
    need_weights=False and NaN with need_weights=True).
    """

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        _check_qkv(query, key, value)
        batched = query.dim() == 3
        if self.batch_first and batched:  # as torch: the functional form is sequence-first (shared inputs kept shared)
            same_kv = key is value
            same_qk = query is key
            query = query.transpose(0, 1)
            key = query if same_qk else key.transpose(0, 1)
            value = key if same_kv else value.transpose(0, 1)
        separate = not self._qkv_same_embed_dim
        out, weights = multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias, self.bias_k,
            self.bias_v, self.add_zero_attn, self.dropout, self.out_proj.weight, self.out_proj.bias,
            training=self.training, key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=separate, q_proj_weight=self.q_proj_weight if separate else None,
            k_proj_weight=self.k_proj_weight if separate else None,
            v_proj_weight=self.v_proj_weight if separate else None, average_attn_weights=average_attn_weights,
            is_causal=is_causal)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        return out, weights


def multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight, in_proj_bias,
                                 bias_k, bias_v, add_zero_attn, dropout_p, out_proj_weight, out_proj_bias,
                                 training=True, key_padding_mask=None, need_weights=True, attn_mask=None,
                                 use_separate_proj_weight=False, q_proj_weight=None, k_proj_weight=None,
                                 v_proj_weight=None, static_k=None, static_v=None, average_attn_weights=True,
                                 is_causal=False):
    """torch.nn.functional.multi_head_attention_forward (sequence-first: query [L, N, E] or unbatched [L, E]) with
    the attention on sattn; see MultiheadAttention for the semantics."""
    _check_qkv(query, key, value)
    batched = query.dim() == 3
    if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
        raise _core.InvalidArgumentError(f"query/key/value: expected 3-D (batched) or 2-D (unbatched) tensors, got "
                                         f"shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    L, N, E = query.shape
    S = key.shape[0]
    H = num_heads
    hd = E // H
    if E != embed_dim_to_check or hd * H != E:
        raise _core.InvalidArgumentError(f"query: expected embedding size {embed_dim_to_check} divisible by "
                                         f"num_heads = {H}, got shape {tuple(query.shape)}")
    if key.shape[:2] != value.shape[:2] or key.shape[1] != N:
        raise _core.InvalidArgumentError(f"key/value: expected [S, N, *] with N = {N} and equal S, got key "
                                         f"{tuple(key.shape)} and value {tuple(value.shape)}")
    kpm = _mha_mask(key_padding_mask, "key_padding_mask")
    am = _mha_mask(attn_mask, "attn_mask")
    if kpm is not None and tuple(kpm.shape) != (N, S):
        raise _core.InvalidArgumentError(f"key_padding_mask: expected shape {(N, S) if batched else (S,)}, got "
                                         f"{tuple(key_padding_mask.shape)}")
    if is_causal and attn_mask is None:
        raise _core.InvalidArgumentError("is_causal: a hint that attn_mask is the causal mask; it requires attn_mask "
                                         "(as torch). Pass attn_mask = "
                                         "torch.nn.Transformer.generate_square_subsequent_mask(L)")
    if am is not None:
        if am.dim() == 2 and tuple(am.shape) != (L, S):
            raise _core.InvalidArgumentError(f"attn_mask: expected shape {(L, S)} (2-D), got {tuple(am.shape)}")
        if am.dim() == 3 and tuple(am.shape) != (N * H, L, S):
            raise _core.InvalidArgumentError(f"attn_mask: expected shape {(N * H, L, S)} (3-D), got "
                                             f"{tuple(am.shape)}")
        if am.dim() not in (2, 3):
            raise _core.InvalidArgumentError(f"attn_mask: expected 2 or 3 dimensions, got {am.dim()}")
        am = am.reshape(1, 1, L, S) if am.dim() == 2 else am.reshape(N, H, L, S)
    # As torch: with is_causal, no key padding and no weights wanted, the causal hint replaces the mask.
    causal = bool(is_causal and kpm is None and not need_weights)
    if causal:
        am = None

    # In-projection: one product for inputs that are one tensor (self-attention: q, k and v; k and v), as torch's
    # packed projection; q, k and v are then views of its result, which the kernels read in place.
    packed = not use_separate_proj_weight and key is value
    if packed and query is key and bias_k is None and static_k is None and static_v is None:
        # [L, N, 3E] -> [3, N, H, L, hd]
        q, k, v = F.linear(query, in_proj_weight, in_proj_bias).reshape(L, N, 3, H, hd).permute(2, 1, 3, 0, 4)
    else:
        if use_separate_proj_weight:
            wq, wk, wv = q_proj_weight, k_proj_weight, v_proj_weight
        else:
            wq, wk, wv = in_proj_weight.chunk(3)
        bq, bk, bv = (None, None, None) if in_proj_bias is None else in_proj_bias.chunk(3)
        q = F.linear(query, wq, bq)
        if packed:
            k, v = F.linear(key, in_proj_weight[E:], None if in_proj_bias is None else in_proj_bias[E:]).chunk(2, -1)
        else:
            k = F.linear(key, wk, bk)
            v = F.linear(value, wv, bv)
        if bias_k is not None and bias_v is not None:
            k = torch.cat([k, bias_k.repeat(1, N, 1)])
            v = torch.cat([v, bias_v.repeat(1, N, 1)])
            am, kpm = _pad_key(am), _pad_key(kpm)
        q = q.reshape(L, N, H, hd).permute(1, 2, 0, 3)  # [N, H, L, hd]
        k = (k.reshape(k.shape[0], N, H, hd).permute(1, 2, 0, 3) if static_k is None
             else static_k.reshape(N, H, static_k.shape[1], hd))
        v = (v.reshape(v.shape[0], N, H, hd).permute(1, 2, 0, 3) if static_v is None
             else static_v.reshape(N, H, static_v.shape[1], hd))
    if add_zero_attn:
        k = torch.cat([k, k.new_zeros(N, H, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(N, H, 1, hd)], dim=2)
        am, kpm = _pad_key(am), _pad_key(kpm)
    if not training:
        dropout_p = 0.0

    # Masks as sattn takes them: a bool MHA mask (True = masked) becomes "True = may attend"; a bool padding mask
    # goes to the kernel as key padding; a float padding mask is added to the scores.
    sattn_mask, sattn_kpm = None, None
    if am is not None:
        sattn_mask = ~am if am.dtype == torch.bool else am
    if kpm is not None:
        if kpm.dtype == torch.bool:
            sattn_kpm = kpm
        else:
            add = kpm.reshape(N, 1, 1, kpm.shape[-1])
            if sattn_mask is None:
                sattn_mask = add
            elif sattn_mask.dtype == torch.bool:
                sattn_mask = torch.where(sattn_mask, 0.0, float("-inf")).to(add.dtype) + add
            else:
                sattn_mask = sattn_mask + add

    weights = attn = None
    if need_weights:
        bias = _additive(sattn_mask, sattn_kpm, q.dtype, N, k.shape[2])
        scores = (q * (1.0 / math.sqrt(hd))) @ k.transpose(-2, -1)
        weights = torch.softmax(scores if bias is None else scores + bias, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
            attn = weights @ v
    if attn is None:
        attn = scaled_dot_product_attention(q, k, v, attn_mask=sattn_mask, dropout_p=dropout_p, is_causal=causal,
                                            key_padding_mask=sattn_kpm)
    attn = attn.permute(2, 0, 1, 3).reshape(L, N, E)
    out = F.linear(attn, out_proj_weight, out_proj_bias)
    if weights is not None and average_attn_weights:
        weights = weights.mean(dim=1)
    if not batched:
        out = out.squeeze(1)
        if weights is not None:
            weights = weights.squeeze(0)
    return out, weights


def _mha_mask(mask, name):
    """torch 2.x's MHA mask rule: bool (True = masked) or a float tensor (added); anything else is refused."""
    if mask is None:
        return None
    _check_tensor(mask, name, floating=False)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise _core.DTypeError(f"{name}: expected bool (True = may NOT attend) or a float tensor (added to the "
                               f"scores), as torch.nn.MultiheadAttention; got {mask.dtype}")
    return mask


def _pad_key(mask):
    """One more key (bias_k / the zero key) that every query may attend to."""
    if mask is None:
        return None
    return F.pad(mask, (0, 1), value=False if mask.dtype == torch.bool else 0.0)


def _additive(mask, key_padding_mask, dtype, N, S):
    """sattn's masks (bool True = may attend, float added; key padding True = padding) as one additive bias."""
    bias = None
    if mask is not None:
        bias = torch.where(mask, 0.0, float("-inf")).to(dtype) if mask.dtype == torch.bool else mask.to(dtype)
    if key_padding_mask is not None:
        pad = torch.where(key_padding_mask.reshape(N, 1, 1, S), float("-inf"), 0.0).to(dtype)
        bias = pad if bias is None else bias + pad
    return bias


# ---- use_sattn ----------------------------------------------------------------------------------------------------

class use_sattn(TorchFunctionMode):
    """Inside `with sattn.torch.use_sattn():`, torch.nn.functional.scaled_dot_product_attention runs on sattn for
    the CPU tensors it supports, including the calls made by nn.MultiheadAttention and nn.TransformerEncoderLayer
    (their native fast path is disabled inside, and restored on exit). Other calls go to torch; with strict=True
    they raise sattn.UnsupportedError with the reason instead."""

    def __init__(self, strict=False):
        super().__init__()
        self.strict = _check_flag(strict, "strict")
        self._fastpath = None

    def __enter__(self):
        self._fastpath = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(False)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            torch.backends.mha.set_fastpath_enabled(self._fastpath)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            try:
                why = _sdpa_unsupported(*args, **kwargs)
            except TypeError as e:  # arguments this version of sattn does not know
                why = f"arguments not understood ({e})"
            if why is None:
                return scaled_dot_product_attention(*args, **kwargs)
            if self.strict:
                raise _core.UnsupportedError(f"use_sattn(strict=True): scaled_dot_product_attention stays on torch: "
                                             f"{why}")
        elif func is F.multi_head_attention_forward:
            # torch runs this function with the mode popped, so the SDPA call inside it would not be seen: run
            # sattn's version of it instead. With need_weights torch materialises the weights and calls no SDPA;
            # that case stays on torch as it is.
            bound = _MHA_SIGNATURE.bind(*args, **kwargs)
            query = bound.arguments["query"]
            why = None
            if bound.arguments.get("need_weights", True):
                why = "need_weights=True (torch materialises the weights and calls no SDPA)"
            elif not isinstance(query, Tensor) or query.device.type != "cpu" or query.dtype not in _FLOATS:
                why = "query is not a CPU float tensor"
            if why is None:
                return multi_head_attention_forward(*args, **kwargs)
            if self.strict and not why.startswith("need_weights"):
                raise _core.UnsupportedError(f"use_sattn(strict=True): multi_head_attention_forward stays on torch: "
                                             f"{why}")
        return func(*args, **kwargs)


_MHA_SIGNATURE = inspect.signature(multi_head_attention_forward)
