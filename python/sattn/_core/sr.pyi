"""
SattnSR super-resolution and the BasicSR evaluation protocol
"""
from __future__ import annotations
import numpy
import numpy.typing
import typing
__all__: list[str] = ['SrModel', 'downscale', 'mod_crop', 'psnr_y', 'read_image', 'ssim_y', 'upscale_bicubic', 'write_png']
class SrModel:
    """
    The SattnSR model (C++ inference of sr/train/model.py) from a safetensors file written by sr/train/export.py, e.g. sr/weights/sattn_sr_x2.safetensors.
    """
    def __init__(self, path: str) -> None:
        ...
    def forward(self, x: typing.Any, *, attention: str = 'sparse', num_threads: typing.Any = None, routing_in: typing.Any = None, return_routing: bool = False) -> typing.Any:
        """
        The model's unclamped output float32 [3, s*h, s*w] for float32 x [3, h, w] in [0, 1] (the PyTorch
        forward; untiled). routing_in: one uint8/bool per window (blocks in order, windows in partition order,
        as the PyTorch stats list) used instead of the router's decisions (sparse only).
        return_routing=True returns (y, routing uint8 [n], gates float32 [n]).
        """
    def upscale(self, image: typing.Any, *, attention: str = 'sparse', num_threads: typing.Any = None, tile: typing.SupportsInt | typing.SupportsIndex = -1, overlap: typing.SupportsInt | typing.SupportsIndex = -1, self_ensemble: bool = False, profile: bool = False, return_stats: bool = False, max_output_pixels: typing.SupportsInt | typing.SupportsIndex = 134217728, float32_precision: str = 'highest') -> typing.Any:
        """
        Upscale uint8 RGB [H, W, 3] (or gray [H, W], replicated) to uint8 [s*H, s*W, 3].
        attention: 'sparse' (routed windows only, the default) or 'dense' (every window). tile: LR tile size
        (-1 = whole image up to 512x512, else 256, as the CLI; 0 = whole image; >= 16), overlap: context per
        side (-1 = the receptive radius: tiled == untiled).
        self_ensemble: x8 flips/transposes averaged. return_stats=True returns (image, stats): windows_total,
        windows_routed, tiles and, with profile=True, 'stages' [{name, seconds, windows_total, windows_routed}].
        max_output_pixels: larger outputs (s*H * s*W pixels) are refused (ValueError) before any work.
        float32_precision: 'highest', or 'bf16': the matrix products (the window attention's Q·Kᵀ and P·V,
        the convolutions but the first, the projections and the MLP) on bf16-rounded operands with float32 sums
        where the CPU has bf16 products (the CLI's --precision bf16).
        """
    @property
    def config(self) -> dict:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def num_parameters(self) -> int:
        ...
    @property
    def receptive_radius(self) -> int:
        ...
    @property
    def scale(self) -> int:
        ...
def downscale(hr: typing.Any, scale: typing.SupportsInt | typing.SupportsIndex) -> numpy.typing.NDArray[numpy.uint8]:
    """
    BasicSR's LR: HR cropped to a multiple of scale, then MATLAB imresize(HR, 1/scale, 'bicubic').
    """
def mod_crop(image: typing.Any, scale: typing.SupportsInt | typing.SupportsIndex) -> numpy.typing.NDArray[numpy.uint8]:
    """
    The image cropped (bottom/right) to a multiple of scale.
    """
def psnr_y(a: typing.Any, b: typing.Any, border: typing.SupportsInt | typing.SupportsIndex) -> float:
    """
    BasicSR Y-PSNR (BT.601 Y of [0, 1] RGB in the 0-255 range, unrounded), border pixels cropped per side.
    """
def read_image(path: str) -> numpy.typing.NDArray[numpy.uint8]:
    """
    PNG or JPEG file -> uint8 RGB [H, W, 3] (gray replicated, alpha dropped); clear errors for corrupt,
    truncated or unsupported files.
    """
def ssim_y(a: typing.Any, b: typing.Any, border: typing.SupportsInt | typing.SupportsIndex) -> float:
    """
    BasicSR SSIM on the same Y (11x11 Gaussian, sigma 1.5, valid region).
    """
def upscale_bicubic(lr: typing.Any, scale: typing.SupportsInt | typing.SupportsIndex) -> numpy.typing.NDArray[numpy.uint8]:
    """
    MATLAB imresize(LR, scale, 'bicubic'): the bicubic baseline.
    """
def write_png(path: str, image: typing.Any, *, compression_level: typing.SupportsInt | typing.SupportsIndex = 1, num_threads: typing.Any = None) -> None:
    """
    uint8 RGB [H, W, 3] (or gray [H, W], written as RGB) -> 8-bit PNG, replacing `path` atomically.
    compression_level: zlib level 0 (stored) .. 9 (smallest); 1 (the default, as OpenCV's) is the fastest
    that compresses. num_threads: threads compressing bands of rows (None = SATTN_NUM_THREADS or all cores;
    the file's bytes do not depend on it).
    """
