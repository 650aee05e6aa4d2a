"""sattn.read_safetensors / write_safetensors against an independent pure-Python implementation."""
import json
import os
import struct

import numpy as np
import pytest

import sattn
import safetensors_py


def sample_tensors(rng):
    return {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f64": rng.standard_normal((2, 1, 3)),
        "f16": rng.standard_normal(5).astype(np.float16),
        "i64": rng.integers(-2**40, 2**40, (2, 2)),
        "i32": rng.integers(-1000, 1000, (7,)).astype(np.int32),
        "bool": rng.random((2, 3)) < 0.5,
        "u8": rng.integers(0, 255, (4,)).astype(np.uint8),
        "scalar": np.array(2.5, np.float32),  # a 0-d array (a numpy scalar has no buffer interface of its own)
        "empty": np.zeros((0, 3), np.float32),
    }


def test_python_writer_to_sattn_reader(tmp_path):
    rng = np.random.default_rng(0)
    ts = sample_tensors(rng)
    path = str(tmp_path / "a.safetensors")
    safetensors_py.save(path, ts, {"format": "pt", "note": "x"})
    got, meta = sattn.read_safetensors(path, with_metadata=True)
    assert meta == {"format": "pt", "note": "x"}
    assert set(got) == set(ts)
    for name, a in ts.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name], a)


def test_sattn_writer_to_python_reader(tmp_path):
    rng = np.random.default_rng(1)
    ts = sample_tensors(rng)
    ts["strided"] = rng.standard_normal((4, 6)).astype(np.float32)[::2, ::3]
    path = str(tmp_path / "b.safetensors")
    sattn.write_safetensors(path, ts, {"k": "v"})
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0  # header padded so the buffer is 8-byte aligned
    got, meta = safetensors_py.load(path)
    assert meta == {"k": "v"}
    for name, a in ts.items():
        np.testing.assert_array_equal(got[name], a)
    assert sattn.read_safetensors(path).keys() == ts.keys()


def write_raw(tmp_path, data, name="bad.safetensors"):
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def header_bytes(header, extra=b""):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + extra


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}

MALFORMED = {
    "short": (b"\x01\x02", "too short"),
    "len_beyond_file": (struct.pack("<Q", 1000) + b"{}", "beyond the end of the file"),
    "huge_len": (struct.pack("<Q", 2**63) + b"{}", "exceeds the limit"),
    "invalid_json": (struct.pack("<Q", 5) + b"{abc}", "not valid JSON"),
    "not_object": (header_bytes([1, 2]), "not a JSON object"),
    "unknown_dtype": (header_bytes({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8),
                      "unsupported dtype 'C64'"),
    "offset_out_of_range": (header_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
                            "out of range"),
    "size_mismatch": (header_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
                      "span 8 bytes but shape"),
    "overlap": (header_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
                "overlaps"),
    "hole": (header_bytes({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "hole"),
    "trailing": (header_bytes(GOOD, b"\0" * 12), "trailing bytes"),
    "negative_shape": (header_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
                       "non-negative integer"),
    "absurd_shape": (header_bytes({"a": {"dtype": "F32", "shape": [2**31, 2**31, 2**31],
                                         "data_offsets": [0, 8]}}, b"\0" * 8), "needs"),
    "missing_field": (header_bytes({"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8), "missing field"),
    "bad_offsets": (header_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, b"\0" * 8),
                    "out of range"),
    "bad_metadata": (header_bytes({"__metadata__": {"k": 1}, **GOOD}, b"\0" * 8), "not a string"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_raise_value_error_naming_file_and_problem(tmp_path, case):
    data, msg = MALFORMED[case]
    path = write_raw(tmp_path, data, f"{case}.safetensors")
    with pytest.raises(ValueError) as e:
        sattn.read_safetensors(path)
    assert f"{case}.safetensors" in str(e.value)
    assert msg in str(e.value), str(e.value)


def test_good_handcrafted_file_reads(tmp_path):
    path = write_raw(tmp_path, header_bytes(GOOD, struct.pack("<2f", 1.5, -2.0)))
    np.testing.assert_array_equal(sattn.read_safetensors(path)["a"], [1.5, -2.0])


def test_against_pypi_safetensors_when_installed(tmp_path):
    """An independent implementation: the reference `safetensors` package (pinned in python/requirements-dev.txt)."""
    st = pytest.importorskip("safetensors.numpy", reason="PyPI safetensors not installed: cross-check skipped")
    ts = {k: v for k, v in sample_tensors(np.random.default_rng(2)).items()}
    a = str(tmp_path / "ref.safetensors")
    st.save_file(ts, a, metadata={"m": "1"})
    got = sattn.read_safetensors(a)
    for name, x in ts.items():
        np.testing.assert_array_equal(got[name], x)
    b = str(tmp_path / "ours.safetensors")
    sattn.write_safetensors(b, ts)
    back = st.load_file(b)
    for name, x in ts.items():
        np.testing.assert_array_equal(back[name], x)
