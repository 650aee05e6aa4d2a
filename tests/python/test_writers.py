"""The module's file writers (sattn.sr.write_png, sattn.write_safetensors, MultiheadAttention.save_safetensors): a
failed write raises sattn.FileFormatError (an OSError) naming the path, and an existing file is replaced whole,
with its permission bits, or not at all."""
import os
import re
import stat

import numpy as np
import pytest

import sattn
import sattn.sr


def write_png(path):
    sattn.sr.write_png(path, np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3))


def write_safetensors(path):
    sattn.write_safetensors(path, {"a": np.ones((4, 4), np.float32)})


def save_mha(path):
    sattn.MultiheadAttention(8, 2).save_safetensors(path)


WRITERS = [write_png, write_safetensors, save_mha]


@pytest.mark.parametrize("write", WRITERS, ids=lambda w: w.__name__)
def test_full_device_raises(write):
    with pytest.raises(sattn.FileFormatError, match="cannot write '/dev/full': No space left on device") as e:
        write("/dev/full")
    assert isinstance(e.value, OSError)


@pytest.mark.parametrize("write", WRITERS, ids=lambda w: w.__name__)
def test_missing_directory_raises_naming_the_path(tmp_path, write):
    path = str(tmp_path / "missing" / "out.bin")
    with pytest.raises(sattn.FileFormatError, match=re.escape(f"cannot write '{path}'")):
        write(path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("write", WRITERS, ids=lambda w: w.__name__)
def test_existing_file_replaced_whole_with_its_mode(tmp_path, write):
    path = tmp_path / "out.bin"
    path.write_bytes(b"old contents")
    os.chmod(path, 0o640)
    write(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary left beside it
    if write is write_png:
        assert np.array_equal(sattn.sr.read_image(str(path)), np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3))
    else:
        assert sattn.read_safetensors(str(path))
