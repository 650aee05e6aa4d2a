"""sattn.torch.ring_attention: ring (context-parallel) attention over a torch.distributed process group.

The same algorithm as sattn::dist (docs/distributed.md), with torch.distributed's point-to-point messages (gloo on
CPU) for the ring and sattn's fused kernel, told each block's global positions, for the attention: K/V blocks
travel one hop per step while every rank attends its queries to the block it holds; partial results merge through
their log-sum-exp in step order. The backward sends each block's float32 dK/dV accumulators around the ring with
it. Differentiable (torch.autograd.Function); deterministic for a given number of ranks and layout.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ._attention import scaled_dot_product_attention as _sdpa
from ._attention import scaled_dot_product_attention_backward as _sdpa_backward
from .dist import LAYOUTS


def _segments(layout, rank, lengths):
    """(local_start, length, global_start, stride) runs of rank's shard, as sattn::dist::shard_segments."""
    size = len(lengths)
    if layout == "contiguous":
        return [(0, lengths[rank], sum(lengths[:rank]), 1)]
    if layout == "zigzag":
        c = lengths[rank] // 2
        return [(0, c, rank * c, 1), (c, c, (2 * size - 1 - rank) * c, 1)]
    return [(0, lengths[rank], rank, size)]


def _masked(causal, qs, ks):
    """Whether a (query segment, key segment) pair has no allowed key: every key after every query."""
    return qs[1] == 0 or ks[1] == 0 or (causal and ks[2] > qs[2] + qs[3] * (qs[1] - 1))


def _numpy(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _rows(x, seg):
    return x[..., seg[0]:seg[0] + seg[1], :]


def _merge(out, lse, seg, o2, l2):
    """(out, lse) rows of seg ⊕ (o2, l2): weights e^(lse - max), a row with lse = -inf contributes nothing."""
    sl = slice(seg[0], seg[0] + seg[1])
    l1 = lse[..., sl]
    m = np.maximum(l1, l2)
    safe = np.where(np.isfinite(m), m, 0.0)
    w1 = np.where(np.isneginf(l1), 0.0, np.exp(l1 - safe))
    w2 = np.where(np.isneginf(l2), 0.0, np.exp(l2 - safe))
    s = w1 + w2
    inv = np.where(s > 0, 1.0 / np.where(s > 0, s, 1.0), 0.0)
    out[..., sl, :] = (w1[..., None] * out[..., sl, :] + w2[..., None] * o2) * inv[..., None]
    lse[..., sl] = np.where(s > 0, safe + np.log(np.where(s > 0, s, 1.0)), -np.inf)


class _Ring:
    """One ring call's group, ranks and segments (checked once, the same on every rank)."""

    def __init__(self, group, q, k, v, causal, layout, scale):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = (dist.get_global_rank(group, (self.rank - 1) % self.size) if group
                     else (self.rank - 1) % self.size)
        mine = torch.tensor([q.shape[2], q.shape[0], q.shape[1], k.shape[1], q.shape[3], v.shape[3], int(causal),
                             LAYOUTS.index(layout)], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(every, mine, group=group)
        names = ["shard length", "batch", "heads_q", "heads_kv", "head_dim", "head_dim_v", "is_causal", "layout"]
        for r, other in enumerate(every):
            for f in range(1 if layout == "contiguous" else 0, len(names)):
                if int(other[f]) != int(every[0][f]):
                    raise ValueError(f"ring_attention: the ranks disagree on {names[f]}: rank 0 has "
                                     f"{int(every[0][f])}, rank {r} has {int(other[f])}")
        self.lengths = [int(x[0]) for x in every]
        if layout == "zigzag" and any(n % 2 for n in self.lengths):
            raise ValueError(f"ring_attention: zigzag shards hold two equal chunks, so their length must be even, "
                             f"got {self.lengths}")
        self.segs = [_segments(layout, r, self.lengths) for r in range(self.size)]
        self.causal, self.scale = causal, scale

    def exchange(self, arrays, recv_shapes):
        """Posts the send of `arrays` (float tensors) to the next rank and the receive of tensors of recv_shapes from
        the previous one; returns (wait, received) where received() gives the tensors after wait()."""
        send = torch.cat([a.reshape(-1) for a in arrays])
        recv = torch.empty(sum(int(np.prod(s)) for s in recv_shapes), dtype=send.dtype)
        reqs = [dist.isend(send, self.next, group=self.group), dist.irecv(recv, self.prev, group=self.group)]

        def received():
            for r in reqs:
                r.wait()
            parts, at = [], 0
            for s in recv_shapes:
                n = int(np.prod(s))
                parts.append(recv[at:at + n].reshape(s))
                at += n
            return parts
        return received

    def kv_shapes(self, src, k, v):
        n = self.lengths[src]
        return [(k.shape[0], k.shape[1], n, k.shape[3]), (v.shape[0], v.shape[1], n, v.shape[3])]


def _ring_forward(ring, q, k, v):
    qn = _numpy(q)
    B, H, L, _ = q.shape
    out = np.zeros((B, H, L, v.shape[3]), np.float32)
    lse = np.full((B, H, L), -np.inf, np.float32)
    kv = [k.contiguous(), v.contiguous()]
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        received = None
        if step + 1 < ring.size:
            received = ring.exchange(kv, ring.kv_shapes((src - 1) % ring.size, k, v))
        kn, vn = _numpy(kv[0]), _numpy(kv[1])
        for qs in ring.segs[ring.rank]:
            for ks in ring.segs[src]:
                if _masked(ring.causal, qs, ks):
                    continue
                o2, l2 = _sdpa(_rows(qn, qs), _rows(kn, ks), _rows(vn, ks), is_causal=ring.causal, scale=ring.scale,
                               enable_gqa=True, return_lse=True, query_offset=qs[2], key_offset=ks[2],
                               position_stride=qs[3])
                _merge(out, lse, qs, np.asarray(o2, np.float32), l2)
        if received is not None:
            kv = received()
    return torch.from_numpy(out), torch.from_numpy(lse)  # float32: the backward reads out unrounded


def _ring_backward(ring, dout, q, k, v, out, lse):
    qn, dn, on, ln = _numpy(q), _numpy(dout), _numpy(out), lse.detach().numpy()
    dq = np.zeros(q.shape, np.float32)
    dkv = [torch.zeros(k.shape, dtype=torch.float32), torch.zeros(v.shape, dtype=torch.float32)]  # own block's
    kv = [k.contiguous(), v.contiguous()]
    dkv_received = None
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        kv_received = None
        if step + 1 < ring.size:
            kv_received = ring.exchange(kv, ring.kv_shapes((src - 1) % ring.size, k, v))
        kn, vn = _numpy(kv[0]), _numpy(kv[1])
        step_dk, step_dv = np.zeros(kn.shape, np.float32), np.zeros(vn.shape, np.float32)
        for qs in ring.segs[ring.rank]:
            for ks in ring.segs[src]:
                if _masked(ring.causal, qs, ks):
                    continue
                g = _sdpa_backward(_rows(dn, qs), _rows(qn, qs), _rows(kn, ks), _rows(vn, ks), _rows(on, qs),
                                   ln[..., qs[0]:qs[0] + qs[1]], is_causal=ring.causal, scale=ring.scale,
                                   enable_gqa=True, query_offset=qs[2], key_offset=ks[2], position_stride=qs[3])
                _rows(dq, qs)[...] += g[0]
                _rows(step_dk, ks)[...] += g[1]
                _rows(step_dv, ks)[...] += g[2]
        if dkv_received is not None:
            dkv = dkv_received()  # src's accumulators, from the previous holder
        dkv = [dkv[0] + torch.from_numpy(step_dk), dkv[1] + torch.from_numpy(step_dv)]
        if ring.size > 1:  # on to the next holder; after the last step, home to the owner
            dkv_received = ring.exchange(dkv, ring.kv_shapes((src - 1) % ring.size, k, v))
        if kv_received is not None:
            kv = kv_received()
    if dkv_received is not None:
        dkv = dkv_received()
    return torch.from_numpy(dq).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring):
        out, lse = _ring_forward(ring, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)  # Di = rowsum(dO * out) from the float32 out, as sattn.torch's
        ctx.ring = ring
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, grad_out, q, k, v, out, lse)
        return dq, dk, dv, None


def ring_attention(query, key, value, group=None, *, is_causal=False, layout="contiguous", scale=None):
    """Exact attention over a sequence sharded across the ranks of a torch.distributed group (gloo, CPU tensors),
    differentiable: each rank passes its shard and gets its rows of the output.

    query (B, Hq, Ls, E) or (Hq, Ls, E), key (…, Hkv, Ls, E), value (…, Hkv, Ls, Ev): this rank's rows as `layout`
    defines them (sattn.dist.shard makes them), float32 or bfloat16 on the CPU; Hq a multiple of Hkv (GQA).
    layout: "contiguous", "zigzag" or "striped" (sattn.dist). is_causal: top-left on the global positions. The
    result equals sattn.torch.scaled_dot_product_attention on the whole sequence. Collective over `group`
    (default: the world).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialised (dist.init_process_group('gloo'))")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.dtype not in (torch.float32,
                                                                                        torch.bfloat16):
            raise TypeError(f"{name}: expected a float32 or bfloat16 CPU tensor, got "
                            f"{type(t).__name__ if not isinstance(t, torch.Tensor) else (t.dtype, t.device.type)}")
        if t.dim() not in (3, 4):
            raise ValueError(f"{name}: expected a 3-D or 4-D tensor, got shape {tuple(t.shape)}")
    squeeze = query.dim() == 3
    q, k, v = (t.unsqueeze(0) if squeeze else t for t in (query, key, value))
    ring = _Ring(group, q, k, v, bool(is_causal), layout, None if scale is None else float(scale))
    out = _RingAttention.apply(q, k, v, ring)
    return out.squeeze(0) if squeeze else out
