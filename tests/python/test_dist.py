"""sattn.dist: shard/unshard, and ring attention under mpirun (tests/python/dist_worker.py) for 2 and 3 ranks."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import sattn.dist as sd

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker.py")


@pytest.mark.parametrize("layout", sd.LAYOUTS)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shard_and_unshard_are_inverse(layout, size):
    L = 2 * size * 5 if layout != "contiguous" else 23
    x = np.arange(2 * 3 * L * 4).reshape(2, 3, L, 4)
    parts = [sd.shard(x, layout, r, size) for r in range(size)]
    assert sum(p.shape[-2] for p in parts) == L
    np.testing.assert_array_equal(sd.unshard(parts, layout), x)
    rows = np.concatenate([sd.shard(np.arange(L), layout, r, size, axis=0) for r in range(size)])
    assert sorted(rows) == list(range(L))  # every row exactly once
    if layout == "zigzag":  # rank 0 holds chunks 0 and 2P-1
        c = L // (2 * size)
        assert list(sd.shard(np.arange(L), layout, 0, size, axis=0)) == list(range(c)) + list(range(L - c, L))
    if layout == "striped" and size > 1:
        assert list(sd.shard(np.arange(L), layout, 1, size, axis=0)) == list(range(1, L, size))


def test_shard_errors_name_the_problem():
    with pytest.raises(ValueError, match="zigzag: the length 10 must be divisible by 2 \\* size = 4"):
        sd.shard(np.zeros((10, 2)), "zigzag", 0, 2, axis=0)
    with pytest.raises(ValueError, match="layout: expected one of contiguous, zigzag, striped, got 'ring'"):
        sd.shard(np.zeros((10, 2)), "ring", 0, 2, axis=0)
    with pytest.raises(ValueError, match="rank, size"):
        sd.shard(np.zeros((10, 2)), "striped", 2, 2, axis=0)


def _mpirun():
    path = shutil.which("mpirun")
    if path is None:
        pytest.skip("mpirun not found (apt-get install openmpi-bin)")
    try:
        import sattn._dist  # noqa: F401
        import mpi4py  # noqa: F401
    except ImportError as e:
        pytest.skip(f"sattn.dist needs sattn built with MPI and mpi4py: {e}")
    return path


@pytest.mark.parametrize("ranks", [2, 3])
def test_ring_attention_matches_single_process_sdpa(ranks):
    cmd = [_mpirun(), "--oversubscribe", "--allow-run-as-root", "-np", str(ranks), sys.executable, "-m", "mpi4py",
           WORKER]
    env = dict(os.environ, OMP_NUM_THREADS="1", SATTN_NUM_THREADS="1")
    r = subprocess.run(["timeout", "300"] + cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "dist worker: passed" in r.stdout, r.stdout + r.stderr


def test_a_killed_rank_ends_the_job_within_30_seconds():
    """A dead rank is the MPI runtime's job: kill one of 3 ranks mid-ring, and mpirun exits non-zero promptly."""
    mpirun = _mpirun()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sattn_bin = os.path.join(os.environ.get("SATTN_BINARY_DIR", os.path.join(root, "build")), "sattn")
    if not os.path.exists(sattn_bin):
        pytest.skip(f"{sattn_bin} not built")
    import signal
    import time
    job = subprocess.Popen([mpirun, "--oversubscribe", "--allow-run-as-root", "-np", "3", sattn_bin, "ring", "--L",
                            "6144", "--heads", "4", "--reps", "1000", "--threads", "1"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ranks = []
        for _ in range(100):  # the three ranks, started by mpirun
            time.sleep(0.1)
            ps = subprocess.run(["pgrep", "-P", str(job.pid), "-f", "sattn ring"], capture_output=True, text=True)
            ranks = [int(p) for p in ps.stdout.split()]
            if len(ranks) == 3:
                break
        assert len(ranks) == 3, f"expected 3 ranks under mpirun, found {ranks}"
        time.sleep(2.0)  # inside the ring's steps
        assert job.poll() is None, "the job ended before a rank was killed"
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = job.communicate(timeout=30)
        assert job.returncode != 0
        assert time.monotonic() - t0 < 30
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def test_torch_ring_attention_over_gloo_matches_whole_sdpa():
    """sattn.torch.ring_attention with 2 torchrun processes on 127.0.0.1 (gloo), forward and backward."""
    pytest.importorskip("torch")
    worker = os.path.join(os.path.dirname(__file__), "torch_ring_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", SATTN_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", worker]
    r = subprocess.run(["timeout", "300"] + cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "torch ring worker: passed" in r.stdout, r.stdout + r.stderr
