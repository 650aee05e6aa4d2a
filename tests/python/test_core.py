"""sattn's module core: import, version, exception classes, kernel registry queries, threads, GIL release."""
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import sattn


def test_version_matches_cmake_project():
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    version = re.search(r"project\(sattn VERSION (\S+)", cmake).group(1)
    assert sattn.__version__ == version


def test_exception_classes_derive_from_builtins():
    assert issubclass(sattn.InvalidArgumentError, (sattn.Error, ValueError))
    assert issubclass(sattn.InvalidArgumentError, ValueError) and issubclass(sattn.InvalidArgumentError, sattn.Error)
    assert issubclass(sattn.DTypeError, TypeError) and issubclass(sattn.DTypeError, sattn.Error)
    assert issubclass(sattn.OutOfMemoryError, MemoryError) and issubclass(sattn.OutOfMemoryError, sattn.Error)
    assert issubclass(sattn.UnsupportedError, NotImplementedError)
    assert issubclass(sattn.FileFormatError, ValueError) and issubclass(sattn.FileFormatError, OSError)
    assert issubclass(sattn.InternalError, RuntimeError)
    assert sattn.Error.__module__ == "sattn"


def test_native_errors_are_translated():
    """Errors raised inside the C++ library (not by the Python wrapper) arrive as the mapped classes."""
    q = np.zeros((1, 1, 2, 4), np.float32)
    with pytest.raises(sattn.InvalidArgumentError, match="kernel: unknown kernel 'x'"):
        sattn.scaled_dot_product_attention(q, q, q, kernel="x")
    with pytest.raises(sattn.DTypeError, match="key_padding_mask"):
        sattn._core._forward(q, q, q, None, np.zeros((1, 2), np.int32), None, "none", None, 0.0, 0, None, False,
                             None, False, False)


def test_kernel_names_and_explain():
    names = sattn.kernel_names()
    assert names[-1] == "reference" and len(set(names)) == len(names)
    q = np.zeros((1, 2, 3, 8), np.float32)
    rep = sattn.explain_kernels(q, q, q, is_causal=True)
    assert [n for n, _ in rep.kernels] == names
    assert dict(rep.kernels)["reference"] is None  # the reference supports everything
    assert rep.selected == next(n for n, why in rep.kernels if why is None)
    assert all(why is None or (isinstance(why, str) and why) for _, why in rep.kernels)
    assert "Lq=3" in rep.problem and "causal=top_left" in rep.problem
    back = sattn.explain_kernels(q, q, q, backward=True)
    assert "backward" in back.problem
    _, kernel = sattn.scaled_dot_product_attention(q, q, q, is_causal=True, return_kernel=True)
    assert kernel == rep.selected


def test_forcing_a_kernel_and_strict_mode():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 9, 16)).astype(np.float32) for _ in range(3))
    out, name = sattn.scaled_dot_product_attention(q, k, v, kernel="reference", return_kernel=True)
    assert name == "reference"
    auto = sattn.explain_kernels(q, k, v).selected
    if auto == "reference":
        with pytest.raises(NotImplementedError, match="strict") as info:
            sattn.scaled_dot_product_attention(q, k, v, strict=True)
        assert isinstance(info.value, sattn.UnsupportedError)
    else:
        _, name = sattn.scaled_dot_product_attention(q, k, v, strict=True, return_kernel=True)
        assert name == auto


def test_num_threads_settings():
    default = sattn.get_num_threads()
    assert default >= 1
    try:
        sattn.set_num_threads(3)
        assert sattn.get_num_threads() == 3
        with pytest.raises(ValueError, match="num_threads"):
            sattn.set_num_threads(-2)
        with pytest.raises(TypeError, match="num_threads"):
            sattn.set_num_threads("2")
    finally:
        sattn.set_num_threads(None)
    assert sattn.get_num_threads() == default


def test_workspace_cache_keeps_the_backward_scratch_until_emptied():
    # a backward whose packed query tiles and partial dQ tiles are 4 MiB and more each
    rng = np.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((1, 4, 1024, 64)).astype(np.float32) for _ in range(4))
    out, lse = sattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    sattn.empty_workspace_cache()
    assert sattn.workspace_cache_bytes() == 0
    first = sattn.scaled_dot_product_attention_backward(do, q, k, v, out, lse, kernel="fused")
    kept = sattn.workspace_cache_bytes()
    assert kept >= 4 << 20
    again = sattn.scaled_dot_product_attention_backward(do, q, k, v, out, lse, kernel="fused")
    assert sattn.workspace_cache_bytes() == kept  # the same blocks, reused
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    sattn.empty_workspace_cache()
    assert sattn.workspace_cache_bytes() == 0


def test_results_do_not_depend_on_thread_count():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 33, 16)).astype(np.float32) for _ in range(3))
    outs = [sattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=n, return_lse=True)
            for n in (1, 2, 3)]
    for o, lse in outs[1:]:
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(lse, outs[0][1])
    grads = [sattn.scaled_dot_product_attention_backward(outs[0][0], q, k, v, *outs[0], is_causal=True,
                                                         num_threads=n) for n in (1, 2)]
    for a, b in zip(*grads):
        np.testing.assert_array_equal(a, b)


def _long_problem():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 768, 64)).astype(np.float32)
    return q, q.copy(), q.copy()


def _ticks_during_a_call(q, k, v):
    """Runs one long call in a worker thread while this thread ticks; returns (call duration, ticks that fell in
    the middle 80% of the call)."""
    window = {}
    started = threading.Event()

    def worker():
        started.set()
        window["t0"] = time.perf_counter()
        sattn.scaled_dot_product_attention(q, k, v, num_threads=1, kernel="reference")
        window["t1"] = time.perf_counter()

    ticks = []
    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    while t.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.001)
    t.join()
    t0, t1 = window["t0"], window["t1"]
    inside = [x for x in ticks if t0 + 0.1 * (t1 - t0) < x < t1 - 0.1 * (t1 - t0)]
    return t1 - t0, len(inside)


def test_gil_is_released_during_a_call():
    """While one thread is inside a long sattn call, another Python thread keeps running: with the GIL held,
    the main thread could not execute a single bytecode between the worker's call start and end, so no attempt
    could pass; a few attempts only guard against a machine so loaded that this thread is never scheduled."""
    q, k, v = _long_problem()
    sattn.scaled_dot_product_attention(q, k, v, num_threads=1)  # warm-up
    attempts = []
    for _ in range(3):
        attempts.append(_ticks_during_a_call(q, k, v))
        assert attempts[-1][0] > 0.02, "the call is too short to tell anything"
        if attempts[-1][1] >= 2:
            break
    assert attempts[-1][1] >= 2, attempts


def test_concurrent_calls_from_threads_agree_with_serial():
    rng = np.random.default_rng(3)
    problems = [tuple(rng.standard_normal((2, 2, 40 + i, 16)).astype(np.float32) for _ in range(3))
                for i in range(4)]
    serial = [sattn.scaled_dot_product_attention(*p, is_causal=True, num_threads=1) for p in problems]
    results = [None] * len(problems)

    def run(i):
        for _ in range(5):
            results[i] = sattn.scaled_dot_product_attention(*problems[i], is_causal=True, num_threads=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(results, serial):
        np.testing.assert_array_equal(a, b)
