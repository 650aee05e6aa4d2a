"""sattn: self-attention, exact and sparse (Python bindings)."""
from . import _core  # noqa: F401
