"""MATLAB-compatible bicubic imresize (what BasicSR and the SR papers use), in numpy float64.

For an output index x (1-based) the input coordinate is u = x/s + 0.5*(1 - 1/s); the cubic kernel (a = -0.5)
is widened by 1/s when shrinking (antialiasing: 4/s taps, weight s*cubic(s*d)); weights are normalised to sum 1;
out-of-range taps use symmetric (mirror, edge repeated) padding; the height is resized first, then the width;
uint8 inputs are computed in doubles and rounded to uint8 once at the end (round half away from zero, clipped).
"""
import numpy as np


def cubic(x):
    """Keys cubic kernel with a = -0.5 (MATLAB's 'bicubic')."""
    ax = np.abs(x)
    ax2, ax3 = ax * ax, ax * ax * ax
    return ((1.5 * ax3 - 2.5 * ax2 + 1.0) * (ax <= 1)
            + (-0.5 * ax3 + 2.5 * ax2 - 4.0 * ax + 2.0) * ((ax > 1) & (ax <= 2)))


def resize_matrix(in_len, out_len, scale, antialias=True):
    """Dense [out_len, in_len] float64 matrix M with resized = M @ signal (MATLAB contributions())."""
    kernel_width = 4.0
    shrink = scale < 1 and antialias
    if shrink:
        kernel_width /= scale
    x = np.arange(1, out_len + 1, dtype=np.float64)
    u = x / scale + 0.5 * (1.0 - 1.0 / scale)
    left = np.floor(u - kernel_width / 2.0)
    taps = int(np.ceil(kernel_width)) + 2
    idx = left[:, None] + np.arange(taps)[None, :]          # 1-based input indices
    d = u[:, None] - idx
    w = scale * cubic(d * scale) if shrink else cubic(d)
    w = w / w.sum(axis=1, keepdims=True)
    # symmetric padding: MATLAB aux = [1..n, n..1]
    aux = np.concatenate([np.arange(in_len), np.arange(in_len - 1, -1, -1)])
    src = aux[np.mod(idx.astype(np.int64) - 1, 2 * in_len)]
    m = np.zeros((out_len, in_len), dtype=np.float64)
    rows = np.repeat(np.arange(out_len), taps)
    np.add.at(m, (rows, src.ravel()), w.ravel())
    return m


def imresize(img, scale, out_shape=None):
    """img: [H, W] or [H, W, C], uint8 or float. Returns uint8 for uint8 input (one rounding), else float64.

    scale: factor (0.5 = halve). out_shape (H', W') defaults to ceil(H*scale), ceil(W*scale) as in MATLAB."""
    is_u8 = img.dtype == np.uint8
    a = img.astype(np.float64)
    squeeze = a.ndim == 2
    if squeeze:
        a = a[:, :, None]
    h, w = a.shape[:2]
    if out_shape is None:
        out_shape = (int(np.ceil(h * scale - 1e-9)), int(np.ceil(w * scale - 1e-9)))
    mh = resize_matrix(h, out_shape[0], scale)
    mw = resize_matrix(w, out_shape[1], scale)
    a = np.ascontiguousarray(a.transpose(2, 0, 1))   # [C, H, W]
    a = np.matmul(mh[None], a)                       # height first
    a = np.matmul(a, mw.T[None])                     # then width
    a = a.transpose(1, 2, 0)
    if squeeze:
        a = a[:, :, 0]
    if is_u8:
        # MATLAB uint8 conversion: round half away from zero, saturate
        return np.clip(np.floor(a + 0.5), 0, 255).astype(np.uint8)
    return a


def downscale(hr_u8, s):
    """LR = imresize(HR, 1/s, 'bicubic') on uint8; HR must already be cropped to a multiple of s."""
    return imresize(hr_u8, 1.0 / s)


def upscale_bicubic(lr_u8, s):
    return imresize(lr_u8, float(s))


def mod_crop(img, s):
    h, w = img.shape[:2]
    return img[: h - h % s, : w - w % s]
