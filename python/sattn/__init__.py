"""sattn: self-attention, exact and sparse (Python bindings)."""
from . import _core  # noqa: F401
from ._core import flash_attn_varlen, flash_attn_varlen_backward  # noqa: F401,E402  (fused area)
