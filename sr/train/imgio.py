"""PNG/JPEG reading for the SR scripts: sattn.sr.read_image (libpng, libjpeg-turbo), the decoder of `sattn sr eval`.

sattn is imported from the environment (pip install .) or else from <repo>/build/python (scripts/bootstrap builds it).
Where neither has it (a GPU machine that trains without a build of sattn), Pillow decodes instead: the same pixels for
8-bit PNG, and it also reads lossless WebP copies of the training set (smaller to carry there).
read_image(path) -> uint8 array [H, W, 3]; grayscale files are replicated to RGB (as BasicSR does).
"""
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sattn_sr():
    try:
        import sattn.sr as sr
    except ImportError:
        build = os.path.join(_REPO, "build", "python")
        if not os.path.isdir(os.path.join(build, "sattn")):
            raise ImportError("sr/train reads images with sattn.sr.read_image: build sattn first (scripts/bootstrap, "
                              "or pip install .)") from None
        sys.path.insert(0, build)
        import sattn.sr as sr
    return sr


def _pillow_read(path):
    import numpy as np
    from PIL import Image
    with Image.open(path) as im:
        if im.mode not in ("L", "LA", "P", "RGB", "RGBA"):
            raise ValueError("%s: Pillow mode %s is not an 8-bit image" % (path, im.mode))
        return np.ascontiguousarray(np.asarray(im.convert("RGB")))


def read_image(path):
    """uint8 [H, W, 3] RGB. Gray is replicated to 3 channels; alpha is dropped."""
    path = os.fspath(path)
    if path.lower().endswith(".webp"):
        return _pillow_read(path)
    try:
        sr = _sattn_sr()
    except ImportError:
        try:
            import PIL  # noqa: F401
        except ImportError:
            raise ImportError("sr/train reads images with sattn.sr.read_image, or with Pillow where sattn is not "
                              "built: build sattn (scripts/bootstrap, or pip install .) or install Pillow") from None
        return _pillow_read(path)
    return sr.read_image(path)


def list_images(folder):
    exts = (".png", ".jpg", ".jpeg", ".webp")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(exts))
