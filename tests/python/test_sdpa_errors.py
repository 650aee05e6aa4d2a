"""Bad arguments to the attention API raise the right exception type with a message naming the argument, the
expected and the given value."""
import numpy as np
import pytest

import sattn

rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
K = rng.standard_normal((2, 4, 7, 8)).astype(np.float32)
V = rng.standard_normal((2, 4, 7, 3)).astype(np.float32)


def call(**overrides):
    args = dict(query=Q, key=K, value=V)
    args.update(overrides)
    return sattn.scaled_dot_product_attention(**args)


# (overrides, exception, substrings the message must contain)
CASES = {
    "int query": (dict(query=Q.astype(np.int32)), TypeError, ["query", "int32"]),
    "mixed dtypes": (dict(key=K.astype(np.float64), value=V.astype(np.float64)), TypeError,
                     ["key", "float32", "float64"]),
    "half and float mixed": (dict(key=K.astype(np.float16)), TypeError, ["key", "float16"]),
    "1-D query": (dict(query=Q[0, 0, 0]), ValueError, ["query", "[8]"]),
    "ndim mismatch": (dict(key=K[0]), ValueError, ["key", "4 dimensions", "[4, 7, 8]"]),
    "batch mismatch": (dict(key=K[:1], value=V[:1]), ValueError, ["batch", "[2]", "[1, 4, 7, 8]"]),
    "E mismatch": (dict(key=K[..., :5]), ValueError, ["key", "E = 8", "[2, 4, 7, 5]"]),
    "value length": (dict(value=V[:, :, :6]), ValueError, ["value", "[2, 4, 6, 3]"]),
    "zero size": (dict(query=Q[:, :, :0]), ValueError, ["query", "zero-size", "[2, 4, 0, 8]"]),
    "gqa without enable_gqa": (dict(key=K[:, :2], value=V[:, :2]), ValueError, ["enable_gqa", "Hq = 4", "Hkv = 2"]),
    "heads not a multiple": (dict(key=K[:, :3], value=V[:, :3], enable_gqa=True), ValueError,
                             ["multiple", "Hq = 4", "Hkv = 3"]),
    "mask does not broadcast": (dict(attn_mask=np.ones((5, 6), bool)), ValueError,
                                ["attn_mask", "[5, 6]", "[2, 4, 5, 7]"]),
    "mask too many dims": (dict(attn_mask=np.ones((1, 2, 4, 5, 7), bool)), ValueError, ["attn_mask", "[1, 2, 4, 5, 7]"]),
    "int mask": (dict(attn_mask=np.ones((5, 7), np.int64)), TypeError, ["attn_mask", "bool", "int64"]),
    "float key_padding_mask": (dict(key_padding_mask=np.zeros((2, 7))), TypeError,
                               ["key_padding_mask", "bool", "float64", "key_lengths"]),
    "key_padding_mask shape": (dict(key_padding_mask=np.zeros((2, 5), bool)), ValueError,
                               ["key_padding_mask", "[2, 7]", "[2, 5]"]),
    "key_lengths dtype": (dict(key_lengths=np.array([1.0, 2.0])), TypeError, ["key_lengths", "integer", "float64"]),
    "key_lengths range": (dict(key_lengths=np.array([3, 2**32])), ValueError,
                          ["key_lengths[1]", "[0, 2^32 - 1]", "4294967296"]),
    "key_lengths shape": (dict(key_lengths=np.array([3])), ValueError, ["key_lengths", "[2]", "[1]"]),
    "both paddings": (dict(key_lengths=np.array([3, 4]), key_padding_mask=np.zeros((2, 7), bool)), ValueError,
                      ["key_padding_mask", "key_lengths"]),
    "dropout negative": (dict(dropout_p=-0.1), ValueError, ["dropout_p", "[0, 1)", "-0.1"]),
    "dropout one": (dict(dropout_p=1.0), ValueError, ["dropout_p", "[0, 1)", "got 1"]),
    "dropout str": (dict(dropout_p="0.1"), TypeError, ["dropout_p", "str"]),
    "bad alignment": (dict(is_causal=True, causal_alignment="bottom"), ValueError,
                      ["causal_alignment", "top_left", "bottom_right", "'bottom'"]),
    "is_causal not bool": (dict(is_causal="yes"), TypeError, ["is_causal", "bool", "str"]),
    "scale nan": (dict(scale=float("nan")), ValueError, ["scale", "nan"]),
    "negative seed": (dict(seed=-1), ValueError, ["seed", "-1"]),
    "float seed": (dict(seed=1.5), TypeError, ["seed", "float"]),
    "non-array mask": (dict(attn_mask="x"), TypeError, ["attn_mask", "<U1"]),
    "unknown kernel": (dict(kernel="nope"), ValueError, ["kernel", "nope", "reference"]),
    "num_threads zero": (dict(num_threads=0), ValueError, ["num_threads", "0"]),
    "num_threads float": (dict(num_threads=1.5), TypeError, ["num_threads", "float"]),
    "string query": (dict(query="abc"), TypeError, ["query", "<U3"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_argument(name):
    overrides, exc, parts = CASES[name]
    with pytest.raises(exc) as info:
        call(**overrides)
    assert isinstance(info.value, sattn.Error)
    msg = str(info.value)
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_backward_bad_arguments():
    out, lse = sattn.scaled_dot_product_attention(Q, K, V, return_lse=True)
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 4, 5\), got \(2, 4\)"):
        sattn.scaled_dot_product_attention_backward(out, Q, K, V, out, lse[..., 0])
    with pytest.raises(ValueError, match=r"dout: expected shape \(2, 4, 5, 3\), got \(2, 4, 5, 8\)"):
        sattn.scaled_dot_product_attention_backward(Q, Q, K, V, out, lse)
    with pytest.raises(TypeError, match="out: expected a float32"):
        sattn.scaled_dot_product_attention_backward(out, Q, K, V, out.astype(np.int64), lse)
    with pytest.raises(ValueError, match="enable_gqa"):
        sattn.scaled_dot_product_attention_backward(out, Q, K[:, :2], V[:, :2], out, lse)


def test_attention_weights_bad_arguments():
    with pytest.raises(ValueError, match="attn_mask"):
        sattn.attention_weights(Q, K, attn_mask=np.ones((3, 7), bool))
    with pytest.raises(TypeError, match="key"):
        sattn.attention_weights(Q, K.astype(np.int8))


def test_memory_limit_is_a_memory_error():
    """Weights (and the reference's score matrix) above half of physical memory are refused before allocation."""
    n = 1 << 20
    q = np.broadcast_to(np.ones((1, 1, 1, 1), np.float32), (1, 1, n, 1))  # stride 0: no memory
    with pytest.raises(MemoryError, match=r"\[1, 1, 1048576, 1048576\]") as info:
        sattn.attention_weights(q, q)
    assert isinstance(info.value, sattn.OutOfMemoryError)
    with pytest.raises(MemoryError, match="memory limit"):
        sattn.scaled_dot_product_attention(q, q, q, kernel="reference")
