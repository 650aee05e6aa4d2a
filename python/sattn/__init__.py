"""sattn: self-attention, exact and sparse (Python bindings)."""
from . import _core  # noqa: F401
from ._core import *  # noqa: F401,F403
