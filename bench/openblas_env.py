"""Import first (before numpy / torch): sets OPENBLAS_CORETYPE when OpenBLAS would pick the wrong kernels.

OpenBLAS chooses its kernels from the CPU model in cpuid. On a VM that hides the model (the development machine
reports a generic "Intel(R) Xeon(R) Processor") it falls back to Prescott (SSE3) kernels: SGEMM ~30 GFLOP/s
instead of ~150 with AVX-512. Debian's numpy and torch call that OpenBLAS, so the PyTorch peers would run 3-5x
slow on their matmuls and every "faster than PyTorch" figure would flatter sattn. From the CPU flags this picks
SkylakeX (AVX-512) or Haswell (AVX2 + FMA) unless OPENBLAS_CORETYPE is already set; child processes inherit it
(`sattn bench` / `sattn sparse-bench` do the same for themselves).
"""
import os


def _flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


if "OPENBLAS_CORETYPE" not in os.environ:
    _f = _flags()
    if {"avx512f", "avx512vl"} <= _f:
        os.environ["OPENBLAS_CORETYPE"] = "SkylakeX"
    elif {"avx2", "fma"} <= _f:
        os.environ["OPENBLAS_CORETYPE"] = "Haswell"
