"""
sattn native core (use the `sattn` package)
"""
from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
from sattn import DTypeError
from sattn import Error
from sattn import FileFormatError
from sattn import InternalError
from sattn import InvalidArgumentError
from sattn import OutOfMemoryError
from sattn import UnsupportedError
import typing
from . import sr
__all__: list[str] = ['BigBird', 'BlockLocal', 'BlockMask', 'BlockTopK', 'DTypeError', 'Dilated', 'Error', 'FileFormatError', 'Full', 'GlobalTokens', 'InternalError', 'InvalidArgumentError', 'MixedAttention', 'MultiheadAttention', 'Neighborhood2D', 'OutOfMemoryError', 'Pattern', 'ReLUAttention', 'SlidingWindow', 'TopK', 'UnsupportedError', 'WindowAttention2D', 'alibi_slopes', 'block_mask_from_dense', 'diagnose', 'empty_workspace_cache', 'favor_projection', 'flash_attn_varlen', 'flash_attn_varlen_backward', 'get_num_threads', 'kernel_names', 'linear_attention', 'linear_attention_backward', 'parse_pattern', 'read_safetensors', 'selection_mask', 'set_num_threads', 'set_simd_target', 'simd_targets', 'sparse_attention', 'sparse_attention_backward', 'sr', 'workspace_cache_bytes', 'write_safetensors']
class BigBird(Pattern):
    def __init__(self, block: typing.SupportsInt | typing.SupportsIndex, window_blocks: typing.SupportsInt | typing.SupportsIndex, global_blocks: typing.SupportsInt | typing.SupportsIndex, random_blocks: typing.SupportsInt | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex = 0, alignment: str = 'bottom_right') -> None:
        ...
class BlockLocal(Pattern):
    def __init__(self, block: typing.SupportsInt | typing.SupportsIndex, alignment: str = 'bottom_right') -> None:
        ...
class BlockMask:
    """
    Work list of the block-sparse kernel (see docs/sparse.md).
    """
    def computed_pairs(self, head_slot: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
        ...
    def partial_pairs(self, head_slot: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
        ...
    @property
    def heads(self) -> int:
        ...
    @property
    def k_perm(self) -> numpy.typing.NDArray[numpy.int32]:
        ...
    @property
    def len_k(self) -> int:
        ...
    @property
    def len_q(self) -> int:
        ...
    @property
    def num_q_blocks(self) -> int:
        ...
    @property
    def q_block_start(self) -> numpy.typing.NDArray[numpy.int32]:
        ...
    @property
    def q_perm(self) -> numpy.typing.NDArray[numpy.int32]:
        ...
    @property
    def ranges(self) -> numpy.typing.NDArray[numpy.int32]:
        ...
    @property
    def row_ptr(self) -> numpy.typing.NDArray[numpy.int64]:
        ...
class BlockTopK(Pattern):
    def __init__(self, block: typing.SupportsInt | typing.SupportsIndex, k_blocks: typing.SupportsInt | typing.SupportsIndex, local: bool = True, causal: bool = False) -> None:
        ...
class Dilated(Pattern):
    def __init__(self, window: typing.SupportsInt | typing.SupportsIndex, dilation: typing.SupportsInt | typing.SupportsIndex, alignment: str = 'bottom_right') -> None:
        ...
class Full(Pattern):
    def __init__(self) -> None:
        ...
class GlobalTokens(Pattern):
    def __init__(self, indices: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], base: Pattern, alignment: str = 'bottom_right') -> None:
        ...
class MixedAttention(Pattern):
    def __init__(self, logits: tuple[typing.SupportsFloat | typing.SupportsIndex, typing.SupportsFloat | typing.SupportsIndex] = (0.0, 0.0)) -> None:
        ...
class MultiheadAttention:
    """
    
    torch.nn.MultiheadAttention (PyTorch 2.x semantics) on sattn's exact attention; numpy in and out.
    
    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                       kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, seed=0)
    
    Masks are bool or float of the query's dtype (uint8 raises DTypeError, as torch 2.x refuses it). Bool masks
    keep torch MHA's polarity: True = may NOT attend / is padding. is_causal is a hint that attn_mask is the causal
    mask; sattn checks it. A query row with no allowed key gives attention 0 (torch 2.x: the same with
    need_weights=False outside its eval fast path, NaN otherwise). See docs/mha.md.
    """
    def __call__(self, *args, **kwargs) -> typing.Any:
        ...
    def __init__(self, embed_dim: typing.SupportsInt | typing.SupportsIndex, num_heads: typing.SupportsInt | typing.SupportsIndex, dropout: typing.SupportsFloat | typing.SupportsIndex = 0.0, bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: typing.SupportsInt | typing.SupportsIndex | None = None, vdim: typing.SupportsInt | typing.SupportsIndex | None = None, batch_first: bool = False, device: typing.Any = None, dtype: typing.Any = None, *, seed: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def __repr__(self) -> str:
        ...
    def eval(self) -> MultiheadAttention:
        ...
    def forward(self, query: typing.Any, key: typing.Any, value: typing.Any, key_padding_mask: typing.Any = None, need_weights: bool = True, attn_mask: typing.Any = None, average_attn_weights: bool = True, is_causal: bool = False) -> tuple:
        """
        Returns (attn_output, attn_weights or None); shapes as torch.nn.MultiheadAttention.forward.
        """
    def load_safetensors(self, path: str) -> None:
        """
        Loads a torch state_dict saved as safetensors.
        """
    def load_state_dict(self, state_dict: dict, strict: bool = True) -> None:
        """
        Copies parameters from a dict of arrays keyed by torch's names; strict: error on missing or unexpected keys (a wrong shape is always an error).
        """
    def reset_parameters(self, seed: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
    def save_safetensors(self, path: str) -> None:
        ...
    def set_dropout_seed(self, seed: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def state_dict(self) -> dict:
        """
        A dict of numpy arrays with torch's state_dict key names (copies).
        """
    def train(self, mode: bool = True) -> MultiheadAttention:
        ...
    @property
    def _qkv_same_embed_dim(self) -> bool:
        ...
    @property
    def add_zero_attn(self) -> bool:
        ...
    @property
    def batch_first(self) -> bool:
        ...
    @property
    def dropout(self) -> float:
        ...
    @property
    def dtype(self) -> numpy.dtype[typing.Any]:
        ...
    @property
    def embed_dim(self) -> int:
        ...
    @property
    def head_dim(self) -> int:
        ...
    @property
    def kdim(self) -> int:
        ...
    @property
    def num_heads(self) -> int:
        ...
    @property
    def num_threads(self) -> int:
        ...
    @num_threads.setter
    def num_threads(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    @property
    def training(self) -> bool:
        ...
    @property
    def vdim(self) -> int:
        ...
class Neighborhood2D(Pattern):
    def __init__(self, height: typing.SupportsInt | typing.SupportsIndex, width: typing.SupportsInt | typing.SupportsIndex, kernel: typing.SupportsInt | typing.SupportsIndex, dilation: typing.SupportsInt | typing.SupportsIndex = 1, causal: bool = False) -> None:
        ...
class Pattern:
    """
    A sparse attention pattern; combine with | and &.
    """
    @staticmethod
    def parse(spec: str) -> Pattern:
        """
        Parse a pattern spec such as 'SlidingWindow(256, 256)'.
        """
    def __and__(self, arg0: Pattern) -> Pattern:
        ...
    def __eq__(self, arg0: Pattern) -> bool:
        ...
    def __hash__(self) -> int:
        ...
    def __or__(self, arg0: Pattern) -> Pattern:
        ...
    def __repr__(self) -> str:
        ...
    def allowed(self, h: typing.SupportsInt | typing.SupportsIndex, i: typing.SupportsInt | typing.SupportsIndex, j: typing.SupportsInt | typing.SupportsIndex, len_q: typing.SupportsInt | typing.SupportsIndex, len_k: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def block_mask(self, len_q: typing.SupportsInt | typing.SupportsIndex, len_k: typing.SupportsInt | typing.SupportsIndex, heads: typing.SupportsInt | typing.SupportsIndex = 1, block: typing.SupportsInt | typing.SupportsIndex = 64) -> BlockMask:
        ...
    def dense_mask(self, len_q: typing.SupportsInt | typing.SupportsIndex, len_k: typing.SupportsInt | typing.SupportsIndex | None = None, heads: typing.SupportsInt | typing.SupportsIndex = 1) -> numpy.ndarray[typing.Any, numpy.dtype[typing.Any]]:
        """
        Bool mask (True = may attend) [heads or 1, Lq, Lk].
        """
    @property
    def head_dependent(self) -> bool:
        ...
class ReLUAttention(Pattern):
    def __init__(self, power: typing.SupportsFloat | typing.SupportsIndex = 2.0, normalize: str = 'none') -> None:
        ...
class SlidingWindow(Pattern):
    def __init__(self, left: typing.SupportsInt | typing.SupportsIndex, right: typing.SupportsInt | typing.SupportsIndex, alignment: str = 'bottom_right') -> None:
        ...
class TopK(Pattern):
    def __init__(self, k: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
class WindowAttention2D(Pattern):
    def __init__(self, height: typing.SupportsInt | typing.SupportsIndex, width: typing.SupportsInt | typing.SupportsIndex, window: typing.SupportsInt | typing.SupportsIndex, shift: typing.SupportsInt | typing.SupportsIndex = 0) -> None:
        ...
def _backward(dout: typing.Any, query: typing.Any, key: typing.Any, value: typing.Any, out: typing.Any, lse: typing.Any, attn_mask: typing.Any, key_padding_mask: typing.Any, key_lengths: typing.Any, causal: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, dropout_p: typing.SupportsFloat | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, kernel: str | None, strict: bool, num_threads: typing.Any, need_dmask: bool, float32_precision: str = 'highest', positions: tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex] = (0, 0, 1)) -> tuple:
    """
    Private: 4-D backward. Returns (dq, dk, dv, dmask or None, kernel name).
    """
def _describe(query: typing.Any, key: typing.Any, value: typing.Any, attn_mask: typing.Any, key_padding_mask: typing.Any, key_lengths: typing.Any, causal: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, dropout_p: typing.SupportsFloat | typing.SupportsIndex, enable_gqa: bool) -> dict:
    """
    Private: validates a call of PyTorch's layout given by (shape, dtype name) pairs (None = absent); returns its
    4-D problem's sizes as a dict. The checks and messages are describe_attention's.
    """
def _explain(query: typing.Any, key: typing.Any, value: typing.Any, attn_mask: typing.Any, key_padding_mask: typing.Any, key_lengths: typing.Any, causal: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, dropout_p: typing.SupportsFloat | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, backward: bool, need_lse: bool, need_weights: bool, need_dmask: bool, float32_precision: str = 'highest') -> tuple:
    """
    Private: (problem description, [(kernel, None if eligible else why not)] in registry order, [(SIMD target,
    None if the fused kernel would run its build else why not)] widest first).
    """
def _forward(query: typing.Any, key: typing.Any, value: typing.Any, attn_mask: typing.Any, key_padding_mask: typing.Any, key_lengths: typing.Any, causal: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, dropout_p: typing.SupportsFloat | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, kernel: str | None, strict: bool, num_threads: typing.Any, need_lse: bool, need_weights: bool, float32_precision: str = 'highest', positions: tuple[typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex, typing.SupportsInt | typing.SupportsIndex] = (0, 0, 1)) -> tuple:
    """
    Private: 4-D forward. Returns (out, lse or None, weights or None, kernel name).
    """
def _torch_sdpa_backward(grad_out: typing.Any, query: typing.Any, key: typing.Any, value: typing.Any, out: typing.Any, lse: typing.Any, attn_mask: typing.Any, key_padding_mask: typing.Any, causal: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, dropout_p: typing.SupportsFloat | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, num_threads: typing.SupportsInt | typing.SupportsIndex, dq: typing.Any, dk: typing.Any, dv: typing.Any, dmask: typing.Any, float32_precision: str = 'highest') -> str:
    """
    Private (sattn.torch): 4-D SDPA backward into dq/dk/dv (and dmask); returns the kernel name.
    """
def _torch_sdpa_forward(query: typing.Any, key: typing.Any, value: typing.Any, attn_mask: typing.Any, key_padding_mask: typing.Any, causal: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, dropout_p: typing.SupportsFloat | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex, num_threads: typing.SupportsInt | typing.SupportsIndex, out: typing.Any, lse: typing.Any, float32_precision: str = 'highest') -> str:
    """
    Private (sattn.torch): 4-D SDPA forward into out/lse; returns the kernel name.
    """
def _torch_sparse_backward(grad_out: typing.Any, query: typing.Any, key: typing.Any, value: typing.Any, out: typing.Any, lse: typing.Any, pattern: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, enable_gqa: bool, key_padding_mask: typing.Any, block: typing.SupportsInt | typing.SupportsIndex, alibi_slopes: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None, softcap: typing.SupportsFloat | typing.SupportsIndex, bias: typing.Any, rel_pos_bias: typing.Any, num_threads: typing.SupportsInt | typing.SupportsIndex, indices: typing.Any, dq: typing.Any, dk: typing.Any, dv: typing.Any, dbias: typing.Any, drel_pos_bias: typing.Any, float32_precision: str = 'highest') -> None:
    """
    Private (sattn.torch): sparse attention backward into dq/dk/dv (and dbias, drel_pos_bias).
    """
def _torch_sparse_forward(query: typing.Any, key: typing.Any, value: typing.Any, pattern: str, scale: typing.SupportsFloat | typing.SupportsIndex | None, enable_gqa: bool, key_padding_mask: typing.Any, block: typing.SupportsInt | typing.SupportsIndex, alibi_slopes: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None, softcap: typing.SupportsFloat | typing.SupportsIndex, bias: typing.Any, rel_pos_bias: typing.Any, num_threads: typing.SupportsInt | typing.SupportsIndex, out: typing.Any, lse: typing.Any, indices: typing.Any, float32_precision: str = 'highest') -> None:
    """
    Private (sattn.torch): sparse attention forward into out/lse (and indices).
    """
def _torch_sparse_selection_shape(pattern: str, batch: typing.SupportsInt | typing.SupportsIndex, heads_q: typing.SupportsInt | typing.SupportsIndex, len_q: typing.SupportsInt | typing.SupportsIndex, len_k: typing.SupportsInt | typing.SupportsIndex) -> list[int]:
    """
    Private (sattn.torch): shape of a sparse pattern's indices output.
    """
def _torch_varlen_backward(grad_out: typing.Any, q: typing.Any, k: typing.Any, v: typing.Any, out: typing.Any, lse: typing.Any, cu_seqlens_q: typing.Any, cu_seqlens_k: typing.Any, max_seqlen_q: typing.SupportsInt | typing.SupportsIndex, max_seqlen_k: typing.SupportsInt | typing.SupportsIndex, causal: bool, scale: typing.SupportsFloat | typing.SupportsIndex | None, num_threads: typing.SupportsInt | typing.SupportsIndex, dq: typing.Any, dk: typing.Any, dv: typing.Any, float32_precision: str = 'highest') -> None:
    """
    Private (sattn.torch): packed variable-length backward into dq/dk/dv.
    """
def _torch_varlen_forward(q: typing.Any, k: typing.Any, v: typing.Any, cu_seqlens_q: typing.Any, cu_seqlens_k: typing.Any, max_seqlen_q: typing.SupportsInt | typing.SupportsIndex, max_seqlen_k: typing.SupportsInt | typing.SupportsIndex, causal: bool, scale: typing.SupportsFloat | typing.SupportsIndex | None, num_threads: typing.SupportsInt | typing.SupportsIndex, out: typing.Any, lse: typing.Any, float32_precision: str = 'highest') -> None:
    """
    Private (sattn.torch): packed variable-length forward into out/lse.
    """
def alibi_slopes(heads: typing.SupportsInt | typing.SupportsIndex) -> list[float]:
    ...
def block_mask_from_dense(mask: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], block: typing.SupportsInt | typing.SupportsIndex = 64, block_k: typing.SupportsInt | typing.SupportsIndex | None = None) -> BlockMask:
    """
    FlexAttention's create_block_mask: bool [Lq, Lk] or [H, Lq, Lk] (True = may attend) -> BlockMask.
    """
def diagnose(query: typing.Any, key: typing.Any, value: typing.Any, attn_mask: typing.Any = None, key_padding_mask: typing.Any = None, is_causal: bool = False, causal_alignment: str = 'top_left', scale: typing.SupportsFloat | typing.SupportsIndex | None = None, expect: str | None = None) -> typing.Any:
    """
    Health diagnostics of one attention call, as a dict {'findings': [{'code', 'heads', 'message'}], 'stats'}.
    Masks keep sattn/SDPA polarity: bool attn_mask True = may attend (float: additive); key_padding_mask bool
    [B, Lk] True = padding, or int [B] lengths. expect='causal' flags weight above the diagonal (alignment:
    causal_alignment); expect='padding' flags weight on padded keys -- the key_padding_mask/lengths then say
    where the padding is and are not applied. Codes: saturated_softmax, unscaled_scores, fully_masked_rows,
    nan_or_inf, causal_leak, padding_leak, mask_polarity_suspect, nondeterministic.
    """
def empty_workspace_cache() -> None:
    """
    Returns the scratch kept for the next call (workspace_cache_bytes()) to the system.
    """
def favor_projection(head_dim: typing.SupportsInt | typing.SupportsIndex, num_features: typing.SupportsInt | typing.SupportsIndex, seed: typing.SupportsInt | typing.SupportsIndex = 0) -> numpy.typing.NDArray[numpy.float64]:
    """
    The FAVOR+ projection omega [m, D] used by linear_attention.
    """
def flash_attn_varlen(q: typing.Any, k: typing.Any, v: typing.Any, cu_seqlens_q: typing.Any, cu_seqlens_k: typing.Any, max_seqlen_q: typing.SupportsInt | typing.SupportsIndex, max_seqlen_k: typing.SupportsInt | typing.SupportsIndex, causal: bool = False, scale: typing.SupportsFloat | typing.SupportsIndex | None = None, return_lse: bool = False, float32_precision: str = 'highest') -> typing.Any:
    """
    Attention over packed variable-length sequences (FlashAttention's varlen convention; causal is bottom-right within each sequence). q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; returns out [total_q, Hq, Dv] and, with return_lse=True, (out, lse [Hq, total_q]). float32_precision as in scaled_dot_product_attention ('highest', 'high' or 'bf16').
    """
def flash_attn_varlen_backward(dout: typing.Any, q: typing.Any, k: typing.Any, v: typing.Any, out: typing.Any, lse: typing.Any, cu_seqlens_q: typing.Any, cu_seqlens_k: typing.Any, max_seqlen_q: typing.SupportsInt | typing.SupportsIndex, max_seqlen_k: typing.SupportsInt | typing.SupportsIndex, causal: bool = False, scale: typing.SupportsFloat | typing.SupportsIndex | None = None, float32_precision: str = 'highest') -> tuple:
    """
    Gradients (dq, dk, dv) of flash_attn_varlen from its out and lse.
    """
def get_num_threads() -> int:
    """
    Threads a call with num_threads=None uses: set_num_threads()'s value, else $SATTN_NUM_THREADS, else the number of online cores.
    """
def kernel_names() -> list[str]:
    """
    Names of the registered attention kernels, in the order the registry tries them (reference last).
    """
def linear_attention(query: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], key: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], value: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], feature_map: str = 'elu', num_features: typing.SupportsInt | typing.SupportsIndex | None = None, causal: bool = False, seed: typing.SupportsInt | typing.SupportsIndex = 0, enable_gqa: bool = True, num_threads: typing.SupportsInt | typing.SupportsIndex = 0) -> numpy.ndarray[typing.Any, numpy.dtype[typing.Any]]:
    """
    Linear attention phi(Q)(phi(K)^T V) / phi(Q)(phi(K)^T 1) with phi = elu+1 or FAVOR+ ('favor+').
    """
def linear_attention_backward(dout: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], query: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], key: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], value: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], feature_map: str = 'elu', num_features: typing.SupportsInt | typing.SupportsIndex | None = None, causal: bool = False, seed: typing.SupportsInt | typing.SupportsIndex = 0, enable_gqa: bool = True, num_threads: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple[numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], numpy.ndarray[typing.Any, numpy.dtype[typing.Any]]]:
    """
    Backward of linear_attention: (dq, dk, dv).
    """
def parse_pattern(spec: str) -> Pattern:
    """
    Parse a pattern spec (the Python constructor syntax).
    """
def read_safetensors(path: str, with_metadata: bool = False) -> typing.Any:
    """
    Reads a safetensors file into {name: numpy array} (and the __metadata__ dict when with_metadata); BF16
    tensors come back as ml_dtypes.bfloat16 arrays (a DTypeError naming the tensor without ml_dtypes).
    """
def selection_mask(pattern: Pattern, indices: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], len_q: typing.SupportsInt | typing.SupportsIndex, len_k: typing.SupportsInt | typing.SupportsIndex) -> numpy.ndarray[typing.Any, numpy.dtype[typing.Any]]:
    """
    Bool [B, Hq, Lq, Lk] mask of the selection returned by sparse_attention(..., return_indices=True).
    """
def set_num_threads(num_threads: typing.Any) -> None:
    """
    Sets the default thread count of calls made with num_threads=None (process-wide). None or 0 restores the default ($SATTN_NUM_THREADS, else the number of online cores).
    """
def set_simd_target(name: str) -> None:
    """
    Selects the SIMD target of every component: 'amx', 'avx512bf16', 'avx512', 'avx2', 'sse4', 'portable' or 'auto' (the widest this CPU runs). Raises InvalidArgumentError for an unknown name and UnsupportedError when this CPU cannot run it. Takes effect for calls that start after it returns.
    """
def simd_targets() -> dict:
    """
    The SIMD target selected for the process ('selected': $SATTN_SIMD, set_simd_target()'s, or the widest this CPU runs), the targets this CPU runs ('available', widest first), and the build each component runs ('fused', 'sparse_tiles', 'topk', 'nn': the widest it was compiled for, no wider than 'selected').
    """
def sparse_attention(query: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], key: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], value: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], pattern: Pattern, scale: typing.SupportsFloat | typing.SupportsIndex | None = None, enable_gqa: bool = False, *, key_padding_mask: numpy.ndarray | None = None, return_lse: bool = False, return_indices: bool = False, block: typing.SupportsInt | typing.SupportsIndex = 64, alibi_slopes: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None = None, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0, bias: numpy.ndarray | None = None, rel_pos_bias: numpy.ndarray | None = None, num_threads: typing.SupportsInt | typing.SupportsIndex = 0, float32_precision: str = 'highest') -> typing.Any:
    """
    Sparse attention of q [B, Hq, Lq, D], k [B, Hkv, Lk, D], v [B, Hkv, Lk, Dv] under `pattern`; returns out [B, Hq, Lq, Dv] (and lse [B, Hq, Lq] with return_lse=True). float32_precision='bf16' lets float32 inputs take the bf16 products where the CPU has them (docs/sparse.md).
    """
def sparse_attention_backward(dout: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], query: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], key: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], value: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], out: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], lse: numpy.ndarray[typing.Any, numpy.dtype[typing.Any]], pattern: Pattern, scale: typing.SupportsFloat | typing.SupportsIndex | None = None, enable_gqa: bool = False, *, key_padding_mask: numpy.ndarray | None = None, block: typing.SupportsInt | typing.SupportsIndex = 64, alibi_slopes: collections.abc.Sequence[typing.SupportsFloat | typing.SupportsIndex] | None = None, softcap: typing.SupportsFloat | typing.SupportsIndex = 0.0, bias: numpy.ndarray | None = None, rel_pos_bias: numpy.ndarray | None = None, num_threads: typing.SupportsInt | typing.SupportsIndex = 0, indices: numpy.ndarray | None = None, float32_precision: str = 'highest') -> tuple:
    """
    Backward of sparse_attention: returns (dq, dk, dv, grads) with grads a dict of parameter gradients ('bias', 'rel_pos_bias', 'logits' for MixedAttention) for the options given. float32_precision='bf16' lets float32 inputs take the bf16 products where the CPU has them (docs/sparse.md).
    """
def workspace_cache_bytes() -> int:
    """
    Bytes of freed large kernel scratch (4 MiB and more: packed tiles, partial gradients) kept for the next call, at most 8 blocks and $SATTN_WORKSPACE_CACHE_MB MiB (default 1024; 0 disables the cache).
    """
def write_safetensors(path: str, tensors: dict, metadata: collections.abc.Mapping[str, str] | None = None) -> None:
    """
    Writes {name: numpy array} as a safetensors file.
    """
__version__: str = '0.1.0'
