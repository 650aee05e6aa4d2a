"""Bounded pattern constructors and specs from Python: out-of-range, non-integer and non-finite parameters give one-line
errors naming the parameter; the largest accepted values give exact masks; long and deep pattern trees neither
crash nor hang; repr -> parse round-trips for random valid parameters of every pattern class."""
import random
import subprocess
import sys

import numpy as np
import pytest

import sattn

MAX = 2**31 - 1


def one_line_error(exc_type, f, *needles):
    with pytest.raises(exc_type) as info:
        f()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_out_of_range_parameters_name_the_parameter_range_and_value():
    one_line_error(ValueError, lambda: sattn.Neighborhood2D(4, 4, 3, dilation=3074457345618258603),
                   "Neighborhood2D: expected dilation in 1..2147483647, got 3074457345618258603")
    one_line_error(ValueError, lambda: sattn.BigBird(1, 0, 0, 2305843009213693952),
                   "BigBird: expected random_blocks in 0..2147483647, got 2305843009213693952")
    one_line_error(ValueError, lambda: sattn.SlidingWindow(1, 2**63 - 1),
                   "SlidingWindow: expected right in -1..2147483647 (-1 = unbounded), got 9223372036854775807")
    one_line_error(ValueError, lambda: sattn.SlidingWindow(2**63, 1), "expected left in", "got 9223372036854775808")
    one_line_error(ValueError, lambda: sattn.BigBird(2**63 - 1, 1, 0, 0), "expected block in 1..2147483647")
    one_line_error(ValueError, lambda: sattn.Dilated(7277124529082131342, 4), "expected window in 0..2147483647")
    one_line_error(ValueError, lambda: sattn.GlobalTokens([0, 2**31], sattn.Full()), "expected indices in")
    one_line_error(ValueError, lambda: sattn.TopK(0), "TopK: expected k in 1..2147483647, got 0")
    one_line_error(ValueError, lambda: sattn.BlockTopK(8, 2**40), "expected k_blocks in 1..2147483647")
    one_line_error(ValueError, lambda: sattn.BigBird(8, 1, 1, 1, seed=-1),
                   "BigBird: expected seed in 0..18446744073709551615, got -1")
    one_line_error(ValueError, lambda: sattn.BigBird(8, 1, 1, 1, seed=2**64), "got 18446744073709551616")


def test_non_integer_and_non_finite_parameters_name_the_parameter():
    one_line_error(TypeError, lambda: sattn.SlidingWindow(float("nan"), 1),
                   "SlidingWindow: expected left to be an int, got float nan")
    one_line_error(TypeError, lambda: sattn.Neighborhood2D(8, 8, 3, dilation=float("inf")), "dilation", "inf")
    one_line_error(TypeError, lambda: sattn.GlobalTokens([0, 1.5], sattn.Full()), "indices", "1.5")
    one_line_error(ValueError, lambda: sattn.ReLUAttention(float("nan")), "power", "nan")
    one_line_error(ValueError, lambda: sattn.MixedAttention((float("inf"), 0.0)), "finite logits")
    # Specs: the argument, the value and the position on one line.
    one_line_error(ValueError, lambda: sattn.Pattern.parse("SlidingWindow(nan, 1)"),
                   "argument 'left': expected an integer, got nan at position 14")
    one_line_error(ValueError, lambda: sattn.Pattern.parse("ReLUAttention(power=inf)"), "power", "inf")
    # numpy integers are ints
    assert sattn.SlidingWindow(np.int64(3), np.int32(2)) == sattn.SlidingWindow(3, 2)


def test_largest_accepted_parameters_give_exact_masks():
    L = 12
    i, j = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    want = {
        sattn.SlidingWindow(1, MAX): j >= i - 1,
        sattn.SlidingWindow(MAX, MAX): np.ones((L, L), bool),
        sattn.BigBird(MAX, 1, 0, 0): np.ones((L, L), bool),
        sattn.Dilated(MAX, 4) & sattn.BlockLocal(8): ((i - j) % 4 == 0) & (i // 8 == j // 8),
        sattn.Dilated(3, MAX): i == j,
    }
    for p, w in want.items():
        np.testing.assert_array_equal(p.dense_mask(L)[0], w, err_msg=repr(p))
    q = np.random.default_rng(0).standard_normal((1, 1, L, 8)).astype(np.float32)
    p = sattn.Dilated(MAX, 4) & sattn.BlockLocal(8)
    out = sattn.sparse_attention(q, q, q, p)
    ref = sattn.scaled_dot_product_attention(q, q, q, attn_mask=want[p], kernel="reference")
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5)


def test_bigbird_seeds_round_trip():
    for seed in (2**63, 2**64 - 1, 12345678901234567890):
        p = sattn.BigBird(8, 3, 1, 2, seed=seed)
        assert repr(p) == f"BigBird(8, 3, 1, 2, seed={seed})"
        assert sattn.Pattern.parse(repr(p)) == p


def test_deep_and_long_specs_and_trees_neither_crash_nor_hang():
    # In a child process: a stack overflow would take the interpreter with it.
    code = """
import sattn
for spec, want in [("(" * 20000 + "Full()" + ")" * 20000, "expected patterns nested at most 256 deep at position 256"),
                   ("Full()" + " | Full()" * 999999, "expected at most 65536 characters, got 8999997"),
                   ("GlobalTokens([0], " * 300 + "Full()" + ")" * 300, "nested at most 256 deep")]:
    try:
        sattn.Pattern.parse(spec)
    except ValueError as e:
        assert want in str(e) and "\\n" not in str(e), str(e)[:300]
    else:
        raise AssertionError("accepted: " + spec[:40])
w, d = sattn.SlidingWindow(1, 1), sattn.Dilated(1, 5)
p = w
for x in range(1, 200000):
    p = p | (d if x % 2 else w)
r = repr(p)
assert len(r) == 100000 * 19 + 100000 * 13 + 199999 * 3, len(r)
assert p.allowed(0, 10, 5, 16, 16) and not p.allowed(0, 10, 4, 16, 16)
r = w
for x in range(1, 256):
    r = w | r
try:
    w | r
except ValueError as e:
    assert "nested at most 256 deep, got 257" in str(e), e
else:
    raise AssertionError("depth 257 accepted")
del p
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (res.returncode, res.stderr[-2000:])


def test_repr_round_trips_for_random_valid_parameters():
    rnd = random.Random(20240521)

    def pick(lo, hi):
        c = rnd.randrange(8)
        if c == 0:
            return lo
        if c == 1:
            return hi
        return lo + rnd.randrange(min(hi - lo, 2 ** rnd.randrange(1, 32) - 1) + 1)

    def align():
        return rnd.choice(["top_left", "bottom_right"])

    def neighborhood():
        height = pick(1, 46340)
        width = pick(1, MAX // height)
        side = min(height, width)
        kernel = 1 + 2 * pick(0, (side - 1) // 2)
        return sattn.Neighborhood2D(height, width, kernel, dilation=pick(1, side // kernel),
                                    causal=rnd.random() < 0.5)

    def swin():
        window = pick(1, 46340)
        height = window * pick(1, MAX // window // window)
        width = window * pick(1, MAX // height // window)
        return sattn.WindowAttention2D(height, width, window, shift=pick(0, window - 1))

    fixed = [
        lambda: sattn.SlidingWindow(pick(-1, MAX), pick(-1, MAX), alignment=align()),
        lambda: sattn.Dilated(pick(0, MAX), pick(1, MAX), alignment=align()),
        lambda: sattn.BlockLocal(pick(1, MAX), alignment=align()),
        lambda: sattn.BigBird(pick(1, MAX), pick(0, MAX), pick(0, MAX), pick(0, MAX), seed=rnd.randrange(2**64),
                              alignment=align()),
        neighborhood,
        swin,
        sattn.Full,
    ]
    adaptive = [
        lambda: sattn.TopK(pick(1, MAX)),
        lambda: sattn.BlockTopK(pick(1, MAX), pick(1, MAX), local=rnd.random() < 0.5, causal=rnd.random() < 0.5),
        lambda: sattn.ReLUAttention(1 + rnd.expovariate(0.1), normalize=rnd.choice(["none", "sum", "length"])),
        lambda: sattn.MixedAttention((rnd.uniform(-1e6, 1e6), rnd.gauss(0, 1))),
    ]
    for _ in range(200):
        p = rnd.choice(fixed + adaptive)()
        assert sattn.Pattern.parse(repr(p)) == p, repr(p)
        c = rnd.choice(fixed)()
        for _ in range(rnd.randrange(5)):
            e = rnd.choice(fixed)()
            c = rnd.choice([lambda: c | e, lambda: e & c, lambda: e | (c & e),
                            lambda: sattn.GlobalTokens([pick(0, MAX), pick(0, MAX)], c, alignment=align())])()
        assert sattn.Pattern.parse(repr(c)) == c, repr(c)
