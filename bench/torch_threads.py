"""Thread count for the PyTorch peers in the benchmarks: torch's own pool and the OpenBLAS pool its matmuls call.

Debian's torch calls the system OpenBLAS (pthreads build), whose pool has one worker per core whatever
torch.set_num_threads says: a "1-thread" PyTorch run then does its matmuls on every core, and its spinning workers
inflate its CPU time and compete with torch's own threads. set_threads(torch, n) sizes both pools to n.
"""
import ctypes


def set_threads(torch, n):
    """torch.set_num_threads(n) and openblas_set_num_threads(n); returns the BLAS library it set, or None."""
    torch.set_num_threads(n)
    for lib in ("libopenblas.so.0", "libblas.so.3"):
        try:
            ctypes.CDLL(lib).openblas_set_num_threads(int(n))
            return lib
        except (OSError, AttributeError):
            continue
    return None
