"""A tiny, independent safetensors reader/writer in pure Python + numpy, for tests only.

Written from the format description (8-byte little-endian header length, JSON header
{name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then the byte buffer), so that sattn's C++
implementation is checked against a second implementation rather than against itself.
"""
import json
import struct

import numpy as np

DTYPES = {
    "F32": np.dtype("<f4"), "F64": np.dtype("<f8"), "F16": np.dtype("<f2"), "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"), "BOOL": np.dtype("bool"), "U8": np.dtype("u1"),
}
NAMES = {v: k for k, v in DTYPES.items()}


def dumps(tensors, metadata=None, header_override=None):
    """Bytes of a safetensors file holding `tensors` ({name: array}) in name order."""
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    blobs, offset = [], 0
    for name in sorted(tensors):
        a = np.asarray(tensors[name], order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
        a = a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
        raw = a.tobytes()
        header[name] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if header_override is not None:
        header = header_override(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def save(path, tensors, metadata=None):
    with open(path, "wb") as f:
        f.write(dumps(tensors, metadata))


def load(path):
    """({name: array}, metadata) from a safetensors file."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    buf = data[8 + n:]
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        out[name] = np.frombuffer(buf[b:e], dtype=DTYPES[info["dtype"]]).reshape(info["shape"]).copy()
    return out, meta
