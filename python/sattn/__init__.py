"""sattn: self-attention, exact and sparse (Python bindings)."""
from . import _core  # noqa: F401
from ._core import (__version__, Error, InvalidArgumentError, DTypeError, OutOfMemoryError, UnsupportedError,  # noqa: F401,E501
                    FileFormatError, InternalError, kernel_names, get_num_threads, set_num_threads,
                    simd_targets, set_simd_target)
from ._attention import (scaled_dot_product_attention, scaled_dot_product_attention_backward,  # noqa: F401
                         attention_weights, explain_kernels, KernelReport, describe, AttentionDescription)
from ._core import MultiheadAttention, read_safetensors, write_safetensors  # noqa: F401,E402  (bind_nn.cpp)
from ._core import diagnose  # noqa: F401  (bind_tools.cpp)
from ._core import flash_attn_varlen, flash_attn_varlen_backward  # noqa: F401,E402  (fused area)
from ._core import *  # noqa: F401,F403
