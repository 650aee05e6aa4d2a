"""PNG/JPEG reading for the SR scripts without PIL: stb_image (Debian libstb-dev) through ctypes.

The tiny C shim is compiled once with the system C compiler into <repo>/build/sr_py/ (git-ignored).
read_image(path) -> uint8 array [H, W, 3]; grayscale files are replicated to RGB (as BasicSR does).
"""
import ctypes
import os
import subprocess

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BUILD = os.path.join(_REPO, "build", "sr_py")
_SRC = r"""
#define STB_IMAGE_IMPLEMENTATION
#define STBI_NO_STDIO_WARNINGS
#include <stb/stb_image.h>
#include <stdlib.h>
/* Returns pixel data (caller frees with sr_free) or NULL; *c = channels in the file. */
unsigned char* sr_load(const char* path, int* w, int* h, int* c) { return stbi_load(path, w, h, c, 0); }
const char* sr_error(void) { return stbi_failure_reason(); }
void sr_free(unsigned char* p) { stbi_image_free(p); }
"""
_lib = None


def _load_lib():
    global _lib
    if _lib is not None:
        return _lib
    os.makedirs(_BUILD, exist_ok=True)
    so = os.path.join(_BUILD, "libsr_stb.so")
    if not os.path.exists(so):
        src = os.path.join(_BUILD, "sr_stb.c")
        with open(src, "w") as f:
            f.write(_SRC)
        tmp = so + ".%d.tmp" % os.getpid()
        subprocess.check_call(["cc", "-O2", "-shared", "-fPIC", "-o", tmp, src])
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    lib.sr_load.restype = ctypes.POINTER(ctypes.c_ubyte)
    lib.sr_load.argtypes = [ctypes.c_char_p] + [ctypes.POINTER(ctypes.c_int)] * 3
    lib.sr_error.restype = ctypes.c_char_p
    lib.sr_free.argtypes = [ctypes.POINTER(ctypes.c_ubyte)]
    _lib = lib
    return lib


def read_image(path):
    """uint8 [H, W, 3] RGB. Gray is replicated to 3 channels; alpha is dropped."""
    lib = _load_lib()
    w, h, c = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    p = lib.sr_load(os.fsencode(path), ctypes.byref(w), ctypes.byref(h), ctypes.byref(c))
    if not p:
        raise IOError("read_image: cannot decode %r: %s" % (path, lib.sr_error().decode()))
    try:
        n = h.value * w.value * c.value
        arr = np.ctypeslib.as_array(p, shape=(n,)).copy().reshape(h.value, w.value, c.value)
    finally:
        lib.sr_free(p)
    if c.value in (1, 2):
        arr = np.repeat(arr[:, :, :1], 3, axis=2)
    return np.ascontiguousarray(arr[:, :, :3])


def list_images(folder):
    exts = (".png", ".jpg", ".jpeg", ".bmp")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(exts))
