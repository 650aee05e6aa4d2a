"""sattn: self-attention, exact and sparse (Python bindings)."""
from . import _core  # noqa: F401
from ._core import MultiheadAttention, read_safetensors, write_safetensors  # noqa: F401,E402  (bind_nn.cpp)
