#!/usr/bin/python3
"""Writes the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/ (committed; rerun after editing).

Valid and near-valid inputs of each format, and known reproducers as regression inputs, each a few hundred bytes
at most. Files it does not write stay: inputs that fuzzing found are copied into the corpus as they are.
`--large DIR` instead writes the large pattern-spec reproducers (20 000 nested parentheses, a 10^6-term union, ...)
into DIR/pattern_spec/; tests/fuzz/run generates and replays them.

Needs only the standard library, except the JPEG seeds (Pillow: Debian python3-pil).
"""
import argparse
import io
import json
import struct
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent


# ---- .npy ------------------------------------------------------------------------------------------------------

def npy(descr, shape, payload, fortran=False, major=1, header=None):
    """A .npy file as numpy writes it: preamble, header dict padded with spaces to 64 bytes, '\\n', payload."""
    if header is None:
        dims = "".join(f"{d}, " for d in shape)
        dims = "(" + (dims[:-2] + ("," if len(shape) == 1 else "") if shape else "") + ")"
        header = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {dims}, }}"
    prefix = 10 if major == 1 else 12
    header += " " * ((64 - (prefix + len(header) + 1) % 64) % 64) + "\n"
    length = struct.pack("<H" if major == 1 else "<I", len(header))
    return b"\x93NUMPY" + bytes([major, 0]) + length + header.encode("latin-1") + payload


def npy_corpus():
    f4 = struct.pack("<6f", 0, 1, 2, 3, 4, 5)
    return {
        "valid-f4-2x3": npy("<f4", (2, 3), f4),
        "valid-f8-fortran-2x3": npy("<f8", (2, 3), struct.pack("<6d", 0, 3, 1, 4, 2, 5), fortran=True),
        "valid-i4-fortran-2x3x2": npy("<i4", (2, 3, 2), struct.pack("<12i", *range(12)), fortran=True),
        "valid-b1-normalised": npy("|b1", (4,), bytes([0, 1, 7, 0])),
        "valid-i4-format2": npy("<i4", (3,), struct.pack("<3i", -1, 0, 1), major=2),
        "valid-f2-format3": npy("<f2", (2, 2), struct.pack("<4e", 0.5, -1, 2, 65504), major=3),
        "valid-i8-scalar": npy("<i8", (), struct.pack("<q", -7)),
        "valid-u1-empty-0x3": npy("|u1", (0, 3), b""),
        "valid-f8-long-shape": npy("<f8", (1, 1, 1, 1, 1, 1, 1, 1), struct.pack("<d", 1.5)),
        "near-truncated-data": npy("<f4", (2, 3), f4[:20]),
        "near-big-endian": npy(">f4", (2,), f4[:8]),
        "near-negative-dim": npy("<f4", (-2,), f4[:8]),
        "near-huge-empty-strides": npy("<f8", (0, 10**12, 10**12), b""),
        "near-unclosed-shape": npy(None, None, f4, header="{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3"),
        "near-no-descr": npy(None, None, f4, header="{'fortran_order': False, 'shape': (6,), }"),
        "near-version-7": b"\x93NUMPY\x07\x00\x10\x00" + b" " * 16,
        "near-header-length-past-end": b"\x93NUMPY\x01\x00\xff\xff{'descr'",
    }


# ---- safetensors -------------------------------------------------------------------------------------------------

def safetensors(tensors, metadata=None, header_text=None, extra=b""):
    """tensors: [(name, dtype, shape, data bytes)], laid out in order (offsets computed unless header_text)."""
    header, buffer = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(buffer), len(buffer) + len(data)]}
        buffer += data
    text = (header_text if header_text is not None else json.dumps(header, separators=(",", ":"))).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + buffer + extra


def safetensors_corpus():
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    return {
        "valid-f32-i64-metadata": safetensors(
            [("a", "F32", (2, 2), f32), ("b", "I64", (3,), struct.pack("<3q", 1, -2, 3))], {"format": "pt"}),
        "valid-every-dtype": safetensors([
            ("bf16", "BF16", (2,), b"\x80\x3f\x00\x40"), ("bool", "BOOL", (3,), b"\x00\x01\x05"),
            ("f16", "F16", (1,), struct.pack("<e", 1.5)), ("f64", "F64", (1,), struct.pack("<d", -2.5)),
            ("i32", "I32", (1, 1), struct.pack("<i", 7)), ("u8", "U8", (2,), b"\xff\x00")]),
        "valid-empty-header": safetensors([]),
        "valid-zero-size-and-scalar": safetensors([("e", "F32", (0, 3), b""),
                                                   ("s", "F32", (), struct.pack("<f", 2))]),
        "near-overlap": safetensors([], header_text=json.dumps({
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), extra=bytes(12)),
        "near-hole": safetensors([], header_text=json.dumps({
            "a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}), extra=bytes(4)),
        "near-trailing-bytes": safetensors([("a", "F32", (1,), f32[:4])], extra=b"\x00"),
        "near-size-mismatch": safetensors([], header_text=json.dumps({
            "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), extra=bytes(8)),
        "near-bad-dtype": safetensors([("a", "F8", (1,), b"\x00")]),
        "near-not-json": safetensors([], header_text='{"a": {"dtype": "F32", "shape": [1], '),
        "near-header-length-past-end": struct.pack("<Q", 1 << 40) + b"{}",
        # Strides of [0, 2^62, 2^62] overflow int64 although the tensor is empty.
        "regression-shape-0-2p62-2p62": safetensors([], header_text=json.dumps({
            "a": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}})),
    }


# ---- pattern specs -----------------------------------------------------------------------------------------------

SPECS_VALID = [
    "SlidingWindow(3, 2)", "SlidingWindow(-1, 0)", "SlidingWindow(5, -1, alignment='top_left')",
    "Dilated(3, 2)", "Dilated(2, 3, alignment='top_left')", "BlockLocal(7)", "BlockLocal(16, alignment='top-left')",
    "GlobalTokens([0, 7], SlidingWindow(2, 2))", "GlobalTokens(3, BlockLocal(8), alignment='top_left')",
    "BigBird(8, 3, 1, 2, seed=3)", "BigBird(5, 3, 0, 1, seed=11, alignment='top_left')", "BigBird(4, 1, 2, 0)",
    "Neighborhood2D(9, 11, 3)", "Neighborhood2D(12, 12, 5, dilation=2, causal=True)", "Neighborhood2D(7, 7, 7)",
    "WindowAttention2D(8, 12, 4, shift=2)", "WindowAttention2D(6, 6, 3, shift=1) & SlidingWindow(-1, 0)",
    "Neighborhood2D(9, 11, 3) | GlobalTokens([0], SlidingWindow(1, 1))",
    "(SlidingWindow(1, 1) | BlockLocal(6)) & SlidingWindow(-1, 0)", "BigBird(8, 3, 1, 1, seed=5) | Dilated(1, 5)",
    "Full()", "TopK(16)", "BlockTopK(64, 4, local=False, causal=True)", "TopK(8) & SlidingWindow(32, 0)",
    "ReLUAttention(power=3, normalize='sum')", "ReLUAttention(1.5)", "MixedAttention(logits=(0.5, -1))",
    "SlidingWindow(left=4, right=0,)", "  SlidingWindow ( 1 , 1 )  ",
    "TopK(4) | SlidingWindow(1, 1)",  # parses; sparse_attention refuses it
    "(" * 255 + "SlidingWindow(1, 1)" + ")" * 255,  # 256 parentheses open at once: the limit
]
SPECS_NEAR = [
    "", "SlidingWindow(3)", "SlidingWindow(3, 2", "SlidingWindow(a=1, 2)", "Nope(1)", "SlidingWindow(1, 1) |",
    "GlobalTokens([0, 'x'], Full())", "BigBird(8, 3, 1, 2, seed=1.5)", "ReLUAttention(normalize='max')",
    "WindowAttention2D(8, 12, 5)", "Neighborhood2D(9, 11, 4)", "Dilated(1, 0)",
    "SlidingWindow(1, 99999999999999999999)", "SlidingWindow(-2, 0)", "MixedAttention(logits=(1, 2, 3))",
]
# The reproducers of the pattern issues: out-of-range sizes whose range checks overflow, NaN/inf parameters,
# BigBird seeds >= 2^63, nesting beyond the limit.
SPECS_REGRESSION = {
    "regression-neighborhood2d-dilation-overflow": "Neighborhood2D(4, 4, 3, dilation=3074457345618258603)",
    "regression-bigbird-random-blocks-overflow": "BigBird(1, 0, 0, 2305843009213693952)",
    "regression-sliding-window-int64-max": "SlidingWindow(1, 9223372036854775807)",
    "regression-sliding-window-both-int64-max": "SlidingWindow(9223372036854775807, 9223372036854775807)",
    "regression-bigbird-block-int64-max": "BigBird(9223372036854775807, 1, 0, 0)",
    "regression-dilated-huge-and-block-local": "Dilated(7277124529082131342, 4) & BlockLocal(8)",
    "regression-sliding-window-2p31": "SlidingWindow(2147483648, 0)",
    "regression-sliding-window-nan": "SlidingWindow(nan, 1)",
    "regression-relu-power-inf": "ReLUAttention(power=1e999)",
    "regression-bigbird-seed-2p64-1": "BigBird(8, 3, 1, 2, seed=18446744073709551615)",
    "regression-bigbird-seed-minus-1": "BigBird(8, 3, 1, 2, seed=-1)",
    "regression-depth-257": "(" * 257 + "SlidingWindow(1, 1)" + ")" * 257,
    "regression-global-tokens-depth-257": "GlobalTokens([0], " * 256 + "SlidingWindow(1, 1)" + ")" * 256,
}


def pattern_spec_corpus():
    out = {f"valid-{i:02d}": s.encode() for i, s in enumerate(SPECS_VALID)}
    out.update({f"near-{i:02d}": s.encode() for i, s in enumerate(SPECS_NEAR)})
    out.update({k: v.encode() for k, v in SPECS_REGRESSION.items()})
    return out


def large_pattern_specs():
    """Reproducers too large to commit: deep nesting, a very long union, a spec just over 65 536 characters."""
    leaf = "SlidingWindow(1, 1)"
    return {
        "large-nested-parentheses-20000": "(" * 20000 + leaf + ")" * 20000,
        "large-union-1000000-terms": " | ".join([leaf] * 1_000_000),
        "large-global-tokens-depth-5000": "GlobalTokens([0], " * 5000 + leaf + ")" * 5000,
        "large-65537-characters": leaf + " " * (65537 - len(leaf)),
    }


# ---- images ----------------------------------------------------------------------------------------------------

def png(width, height, bit_depth, color_type, rows, interlace=0, palette=None):
    """A PNG with one IDAT; rows: the filtered scanlines (each starting with its filter byte)."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, interlace)
    out = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
    if palette:
        out += chunk(b"PLTE", palette)
    return out + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def jpeg(mode, size, **save):
    from PIL import Image  # Debian python3-pil
    image = Image.new(mode, size)
    image.putdata([tuple((x * 37 + y * 11 + c * 90) % 256 for c in range(len(mode))) if len(mode) > 1
                   else (x * 37 + y * 11) % 256 for y in range(size[1]) for x in range(size[0])])
    buf = io.BytesIO()
    image.save(buf, "JPEG", **save)
    return buf.getvalue()


def with_jpeg_size(data, width, height):
    """The JPEG with the frame size of its SOF0/SOF2 marker replaced (a header that declares a huge image)."""
    i = 2
    while i + 4 <= len(data):
        marker, length = data[i + 1], struct.unpack(">H", data[i + 2:i + 4])[0]
        if marker in (0xC0, 0xC2):
            return data[:i + 5] + struct.pack(">HH", height, width) + data[i + 9:]
        i += 2 + length
    raise ValueError("no SOF marker")


def image_corpus():
    rgb_2x2 = b"\x00" + bytes([255, 0, 0, 0, 255, 0]) + b"\x00" + bytes([0, 0, 255, 128, 128, 128])
    # Adam7 passes of a 3x3 image: (0,0); (2,0); (0,2) (2,2); (1,0); (1,2); row 1.
    adam7_3x3 = b"\x00\x10" + b"\x00\x20" + b"\x00\x30\x40" + b"\x00\x50" + b"\x00\x60" + b"\x00\x70\x80\x90"
    bad_crc = bytearray(png(1, 1, 8, 0, b"\x00\x80"))
    bad_crc[-13] ^= 0xFF  # the last byte of IDAT's CRC (IEND is the last 12 bytes)
    jpeg_420 = jpeg("RGB", (16, 16), quality=50)
    return {
        "valid-png-gray-1x1": png(1, 1, 8, 0, b"\x00\x80"),
        "valid-png-rgb-2x2": png(2, 2, 8, 2, rgb_2x2),
        "valid-png-rgba-2x1": png(2, 1, 8, 6, b"\x01" + bytes([10, 20, 30, 255, 5, 5, 5, 0])),
        "valid-png-gray16-2x2": png(2, 2, 16, 0, b"\x00\x12\x34\xff\xff" + b"\x02\x00\x01\x00\x01"),
        "valid-png-palette-3x1": png(3, 1, 8, 3, b"\x00\x00\x01\x02", palette=bytes(range(9))),
        "valid-png-gray-alpha-1x2": png(1, 2, 8, 4, b"\x00\x40\xff" + b"\x00\x80\x00"),
        "valid-png-interlaced-3x3": png(3, 3, 8, 0, adam7_3x3, interlace=1),
        "valid-jpeg-gray-8x8": jpeg("L", (8, 8), quality=90),
        "valid-jpeg-rgb-420-16x16": jpeg_420,
        "valid-jpeg-rgb-444-8x8": jpeg("RGB", (8, 8), quality=75, subsampling=0),
        "valid-jpeg-progressive-16x8": jpeg("RGB", (16, 8), quality=60, progressive=True),
        "valid-jpeg-cmyk-8x8": jpeg("CMYK", (8, 8), quality=80),
        "near-png-bad-crc": bytes(bad_crc),
        "near-png-truncated": png(2, 2, 8, 2, rgb_2x2)[:-20],
        "near-png-short-data": png(4, 4, 8, 2, b"\x00" * 13),
        "near-jpeg-truncated": jpeg_420[:-40],
        "near-jpeg-headers-only": jpeg_420[:200],
        "near-gif": b"GIF89a\x01\x00\x01\x00\x00\x00\x00;",
        # Decompression bombs: headers that declare 11000 x 11000 (refused from the header, before decoding).
        "regression-jpeg-declares-11000x11000": with_jpeg_size(jpeg_420, 11000, 11000),
        "regression-png-declares-11000x11000": png(11000, 11000, 8, 2, b"\x00" * 64),
    }


CORPORA = {
    "npy": npy_corpus,
    "safetensors": safetensors_corpus,
    "pattern_spec": pattern_spec_corpus,
    "image": image_corpus,
}


def write(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--large", metavar="DIR", type=Path, help="write the large reproducers into DIR/pattern_spec/")
    args = ap.parse_args()
    if args.large:
        write(args.large / "pattern_spec", {k: v.encode() for k, v in large_pattern_specs().items()})
        return
    for target, make in CORPORA.items():
        write(HERE / "corpus" / target, make())


if __name__ == "__main__":
    main()
