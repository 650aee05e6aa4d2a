"""Run by tests/python/test_dist.py under torchrun (2 processes, gloo on 127.0.0.1): sattn.torch.ring_attention,
forward and backward, against sattn.torch.scaled_dot_product_attention on the whole sequence, every layout, causal
or not, GQA; and in bfloat16. Exits non-zero when any check fails."""
import os
import sys

import torch
import torch.distributed as dist

import sattn.dist as sd
import sattn.torch as st

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
failures = []
seed = 0
for layout in sd.LAYOUTS:
    for causal in (False, True):
        for hkv in (4, 2):
            seed += 1
            g = torch.Generator().manual_seed(seed)  # the same whole problem on every rank
            B, H, E, L = 2, 4, 16, 2 * size * 23
            q = torch.randn(B, H, L, E, generator=g)
            k = torch.randn(B, hkv, L, E, generator=g)
            v = torch.randn(B, hkv, L, E, generator=g)
            dout = torch.randn(B, H, L, E, generator=g)
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = st.scaled_dot_product_attention(*whole, is_causal=causal, enable_gqa=hkv != H)
            ref.backward(dout)
            mine = [torch.from_numpy(sd.shard(t.numpy(), layout, rank, size)).requires_grad_() for t in (q, k, v)]
            out = st.ring_attention(*mine, is_causal=causal, layout=layout)
            out.backward(torch.from_numpy(sd.shard(dout.numpy(), layout, rank, size)))
            for name, got, want in [("out", out, ref)] + [(n, m.grad, w.grad) for n, m, w in
                                                           zip(("dq", "dk", "dv"), mine, whole)]:
                want_shard = torch.from_numpy(sd.shard(want.detach().numpy(), layout, rank, size))
                err = ((got.detach() - want_shard).abs().max() / max(1.0, want_shard.abs().max())).item()
                if not err <= 1e-5:
                    failures.append(f"{layout} causal={causal} Hkv={hkv}: {name} max rel err {err:.3g}")
# bfloat16 shards (every layout, causal, GQA): bf16 out and gradients within a few bf16 roundings (2^-7 of the
# largest value) of the float32 whole computation on the same values (the ring sums in float32).
for layout in sd.LAYOUTS:
    g = torch.Generator().manual_seed(100)
    B, H, E, L = 1, 4, 32, 2 * size * 19
    q, k, v, dout = (torch.randn(B, h, L, E, generator=g).bfloat16() for h in (H, 2, 2, H))
    whole = [t.float().requires_grad_() for t in (q, k, v)]
    ref = st.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    ref.backward(dout.float())
    mine = [torch.from_numpy(sd.shard(t.float().numpy(), layout, rank, size)).bfloat16().requires_grad_()
            for t in (q, k, v)]
    out = st.ring_attention(*mine, is_causal=True, layout=layout)
    out.backward(torch.from_numpy(sd.shard(dout.float().numpy(), layout, rank, size)).bfloat16())
    for name, got, want in [("out", out, ref)] + [(n, m.grad, w.grad) for n, m, w in
                                                   zip(("dq", "dk", "dv"), mine, whole)]:
        want_shard = torch.from_numpy(sd.shard(want.detach().numpy(), layout, rank, size))
        err = ((got.detach().float() - want_shard).abs().max() / want_shard.abs().max()).item()
        if got.dtype != torch.bfloat16 or not err <= 2**-7:
            failures.append(f"bf16 {layout}: {name} dtype {got.dtype}, max error {err:.3g} of the largest value")
every = [None] * size
dist.all_gather_object(every, failures)
if rank == 0:
    for r, fs in enumerate(every):
        for f in fs:
            print(f"rank {r}: {f}")
    print("torch ring worker: " + ("passed" if not any(every) else "FAILED"))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
# Leave without the interpreter's teardown: torch.distributed's threads have aborted it there now and then
# ("terminate called without an active exception") after every check had passed.
os._exit(1 if any(every) else 0)
