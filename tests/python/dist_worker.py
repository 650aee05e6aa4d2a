"""Runs under `mpirun -np P python -m mpi4py tests/python/dist_worker.py` (tests/python/test_dist.py starts it):
sattn.dist against sattn's single-process SDPA on the gathered sequence, every layout, causal or not, GQA, key
lengths, dropout, float32 and bfloat16, forward and backward; then one rank's wrong option raising on every rank.
Prints 'dist worker: passed' on rank 0 when every rank passed."""
import sys

import numpy as np
from mpi4py import MPI

import sattn
import sattn.dist as sd

try:
    from ml_dtypes import bfloat16
except ImportError:  # bfloat16 cases skipped
    bfloat16 = None

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
failures = []


def max_rel_err(got, ref):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    both_inf = np.isinf(got) & np.isinf(ref) & (got == ref)
    diff = np.where(both_inf, 0.0, np.abs(got - ref))
    finite = np.where(np.isfinite(ref), np.abs(ref), 0.0)
    return float(diff.max() / max(1.0, finite.max()))


def check(layout, causal, hkv, lengths, dropout, dtype, seed):
    rng = np.random.default_rng(seed)  # the same whole problem on every rank
    B, H, E, Ev = 2, 4, 16, 8
    L = 2 * size * 19 if layout != "contiguous" else 37 * size + 5
    q = rng.standard_normal((B, H, L, E)).astype(np.float32) * 1.5
    k = rng.standard_normal((B, hkv, L, E)).astype(np.float32) * 1.5
    v = rng.standard_normal((B, hkv, L, Ev)).astype(np.float32)
    dout = rng.standard_normal((B, H, L, Ev)).astype(np.float32)
    if dtype != np.float32:
        q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
    key_lengths = np.array([L - 7, L // 3], np.int64) if lengths else None
    kw = dict(is_causal=causal, enable_gqa=hkv != H, key_lengths=key_lengths, dropout_p=dropout, seed=seed)
    ref, ref_lse = sattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    ref_grads = sattn.scaled_dot_product_attention_backward(dout, q, k, v, ref, ref_lse, **kw)
    part = [sd.shard(x, layout, rank, size) for x in (q, k, v, dout)]
    out, lse = sd.ring_attention(*part[:3], layout=layout, return_lse=True, **kw)
    grads = sd.ring_attention_backward(part[3], *part[:3], out, lse, layout=layout, **kw)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    name = f"{layout} causal={causal} Hkv={hkv} lengths={lengths} dropout={dropout} {np.dtype(dtype).name}"
    for what, got, want in [("out", out, ref), ("lse", lse, ref_lse)] + list(zip(("dq", "dk", "dv"), grads, ref_grads)):
        whole = sd.unshard(comm.allgather(np.asarray(got)), layout, axis=-1 if what == "lse" else -2)
        err = max_rel_err(whole, want)
        if not err <= tol:
            failures.append(f"{name}: {what} max rel err {err:.3g} > {tol}")


seed = 0
for layout in sd.LAYOUTS:
    for causal in (False, True):
        for hkv, lengths, dropout, dtype in [(4, False, 0.0, np.float32), (2, True, 0.0, np.float32),
                                             (4, False, 0.2, np.float32), (1, True, 0.1, bfloat16)]:
            seed += 1
            if dtype is None:
                continue
            check(layout, causal, hkv, lengths, dropout, dtype, seed)

# One rank's option differs: every rank raises ValueError naming the disagreement.
x = np.ones((1, 2, 4, 8), np.float32)
try:
    sd.ring_attention(x, x, x, is_causal=(rank == size - 1 and size > 1))
    if size > 1:
        failures.append("causal on the last rank only: no error")
except ValueError as e:
    if "the ranks disagree on causal" not in str(e):
        failures.append(f"causal on the last rank only: {e}")

all_failures = comm.allgather(failures)
if rank == 0:
    for r, fs in enumerate(all_failures):
        for f in fs:
            print(f"rank {r}: {f}")
    print("dist worker: " + ("passed" if not any(all_failures) else "FAILED"))
sys.exit(1 if any(all_failures) else 0)
