"""Ring (context-parallel) attention over MPI, on numpy arrays.

Every rank of an mpi4py communicator holds its shard of the sequence (``shard`` makes it from the whole array,
``unshard`` puts the shards back together) and calls ``ring_attention`` collectively; the K/V shards travel around
the ring and the result equals ``sattn.scaled_dot_product_attention`` on the whole sequence. Run the ranks under
``mpirun -np P python -m mpi4py script.py`` so that an uncaught exception on one rank ends the job.

Layouts (``layout=``): ``"contiguous"`` (rank r holds one run of rows; any lengths), ``"zigzag"`` (L divisible by
2P; rank r holds chunks r and 2P-1-r of 2P equal chunks, in that order: balanced causal work) and ``"striped"``
(L divisible by P; rank r holds rows r, r+P, r+2P, ...). Needs sattn built with MPI (sattn._dist) and mpi4py.
"""

import numpy as np

from . import _core  # noqa: F401  (registers sattn's exception types for the native module)
from . import get_num_threads

__all__ = ["ring_attention", "ring_attention_backward", "shard", "unshard", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def _native():
    try:
        from . import _dist
    except ImportError as e:  # built without MPI
        raise ImportError("sattn.dist needs sattn built with MPI (apt-get install libopenmpi-dev, then rebuild); "
                          f"the native module sattn._dist is missing ({e})") from e
    return _dist


def _comm_handle(comm):
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    if not hasattr(comm, "py2f"):
        raise TypeError(f"comm: expected an mpi4py communicator, got {type(comm).__name__}")
    return comm, comm.py2f()


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def _rows(layout, rank, size, length):
    """Global row indices held by `rank` of `size` under `layout`, for a sequence of `length` rows."""
    _check_layout(layout)
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(f"rank, size: expected 0 <= rank < size, got rank={rank!r}, size={size!r}")
    if layout == "contiguous":
        base, extra = divmod(length, size)
        start = rank * base + min(rank, extra)
        return np.arange(start, start + base + (rank < extra))
    if layout == "zigzag":
        if length % (2 * size):
            raise ValueError(f"zigzag: the length {length} must be divisible by 2 * size = {2 * size}")
        c = length // (2 * size)
        return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                               np.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)])
    if length % size:
        raise ValueError(f"striped: the length {length} must be divisible by size = {size}")
    return np.arange(rank, length, size)


def shard(x, layout, rank, size, axis=-2):
    """Rank `rank`'s shard (of `size` ranks) of the whole array `x` along `axis` (the sequence), as `layout`
    defines it. contiguous gives the first L % size ranks one row more."""
    x = np.asarray(x)
    return np.take(x, _rows(layout, rank, size, x.shape[axis]), axis=axis)


def unshard(shards, layout, axis=-2):
    """The whole array from every rank's shard (a list in rank order, e.g. comm.allgather(shard)); the inverse of
    shard(). contiguous accepts any shard lengths."""
    shards = [np.asarray(s) for s in shards]
    if not shards:
        raise ValueError("shards: expected one array per rank, got none")
    size = len(shards)
    if _check_layout(layout) == "contiguous":
        return np.concatenate(shards, axis=axis)
    length = sum(s.shape[axis] for s in shards)
    whole = np.empty(shards[0].shape[:axis % shards[0].ndim] + (length,) + shards[0].shape[axis % shards[0].ndim + 1:],
                     dtype=shards[0].dtype)
    moved = np.moveaxis(whole, axis, 0)
    for r, s in enumerate(shards):
        moved[_rows(layout, r, size, length)] = np.moveaxis(s, axis, 0)
    return whole


def _as4d(name, x):
    x = np.asarray(x)
    if x.ndim not in (3, 4):
        raise ValueError(f"{name}: expected a 3-D (H, L, E) or 4-D (B, H, L, E) array, got shape {x.shape}")
    return x if x.ndim == 4 else x[None]


def _common(query, key, enable_gqa, is_causal, layout, scale, num_threads, key_lengths):
    q, k = _as4d("query", query), _as4d("key", key)
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"query and key have {q.shape[1]} and {k.shape[1]} heads: pass enable_gqa=True for "
                         "grouped-query attention (query heads a multiple of key heads)")
    threads = get_num_threads() if num_threads is None else num_threads
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"num_threads: expected None or an int >= 0, got {num_threads!r}")
    lengths = None if key_lengths is None else np.ascontiguousarray(key_lengths).reshape(-1)
    return dict(layout=_check_layout(layout), causal=bool(is_causal),
                scale=None if scale is None else float(scale), key_lengths=lengths, num_threads=threads)


def ring_attention(query, key, value, comm=None, *, is_causal=False, layout="contiguous", scale=None,
                   enable_gqa=False, return_lse=False, key_lengths=None, dropout_p=0.0, seed=0, num_threads=None,
                   float32_precision="highest"):
    """Exact attention over the whole sequence, this rank's shard in and out (collective over `comm`).

    query (B, Hq, Ls, E) or (Hq, Ls, E), key (…, Hkv, Ls, E), value (…, Hkv, Ls, Ev): this rank's rows, as
    `layout` defines them; float32, bfloat16 (ml_dtypes) or float16. is_causal is top-left on the global
    positions. key_lengths: ints (B,) = valid keys per batch entry, global lengths. dropout keeps weight (b, h, i, j)
    by global i, j, so the result equals the single-process call with the same seed. comm: an mpi4py
    communicator (default COMM_WORLD). Returns out (…, Hq, Ls, Ev), with lse (…, Hq, Ls) float32 if return_lse.
    """
    comm, handle = _comm_handle(comm)
    squeeze = np.ndim(query) == 3
    opts = _common(query, key, enable_gqa, is_causal, layout, scale, num_threads, key_lengths)
    out, lse = _native()._ring_forward(_as4d("query", query), _as4d("key", key), _as4d("value", value), handle,
                                       opts["layout"], opts["causal"], opts["scale"], opts["key_lengths"],
                                       float(dropout_p), int(seed), opts["num_threads"], float32_precision)
    if squeeze:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


def ring_attention_backward(grad_out, query, key, value, out, lse, comm=None, *, is_causal=False,
                            layout="contiguous", scale=None, enable_gqa=False, key_lengths=None, dropout_p=0.0,
                            seed=0, num_threads=None, float32_precision="highest"):
    """Gradients (dq, dk, dv) of ring_attention for this rank's shard, from grad_out and the forward's out and lse
    (return_lse=True); the options must match the forward's. Collective over `comm`."""
    comm, handle = _comm_handle(comm)
    squeeze = np.ndim(query) == 3
    opts = _common(query, key, enable_gqa, is_causal, layout, scale, num_threads, key_lengths)
    lse4 = np.asarray(lse)
    lse4 = lse4 if lse4.ndim == 3 else lse4[None]
    dq, dk, dv = _native()._ring_backward(_as4d("grad_out", grad_out), _as4d("query", query), _as4d("key", key),
                                          _as4d("value", value), _as4d("out", out), lse4, handle, opts["layout"],
                                          opts["causal"], opts["scale"], opts["key_lengths"], float(dropout_p),
                                          int(seed), opts["num_threads"], float32_precision)
    if squeeze:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv
