"""PNG/JPEG reading for the SR scripts: sattn.sr.read_image (libpng, libjpeg-turbo), the decoder of `sattn sr eval`.

sattn is imported from the environment (pip install .) or else from <repo>/build/python (scripts/bootstrap builds it).
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


def read_image(path):
    """uint8 [H, W, 3] RGB. Gray is replicated to 3 channels; alpha is dropped."""
    return _sattn_sr().read_image(os.fspath(path))


def list_images(folder):
    exts = (".png", ".jpg", ".jpeg")
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(exts))
