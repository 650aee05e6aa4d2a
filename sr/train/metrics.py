"""BasicSR-compatible PSNR / SSIM on the Y channel (BT.601, 16..235 range, unrounded float)."""
import numpy as np
import torch
import torch.nn.functional as F


def rgb_to_y(img_u8):
    """[H, W, 3] uint8 (or float in 0..255) -> float64 Y in 0..255: 16 + 65.481R + 128.553G + 24.966B on [0,1]."""
    a = img_u8.astype(np.float64) / 255.0
    return 16.0 + a[..., 0] * 65.481 + a[..., 1] * 128.553 + a[..., 2] * 24.966


def psnr_y(sr_u8, hr_u8, border, round_y=False):
    """BasicSR protocol (round_y=False). round_y=True rounds Y to integers first, as MATLAB's rgb2ycbcr on uint8
    does (the protocol behind the published bicubic tables)."""
    y1, y2 = rgb_to_y(sr_u8), rgb_to_y(hr_u8)
    if round_y:
        y1, y2 = np.floor(y1 + 0.5), np.floor(y2 + 0.5)
    if border:
        y1, y2 = y1[border:-border, border:-border], y2[border:-border, border:-border]
    mse = np.mean((y1 - y2) ** 2)
    return float("inf") if mse == 0 else 10.0 * np.log10(255.0 ** 2 / mse)


def _gauss11():
    g = np.exp(-((np.arange(11) - 5.0) ** 2) / (2 * 1.5 ** 2))
    g /= g.sum()
    return np.outer(g, g)


def ssim_y(sr_u8, hr_u8, border):
    """SSIM (Wang et al.) as BasicSR calculate_ssim: 11x11 Gaussian sigma 1.5, 'valid' windows only."""
    y1, y2 = rgb_to_y(sr_u8), rgb_to_y(hr_u8)
    if border:
        y1, y2 = y1[border:-border, border:-border], y2[border:-border, border:-border]
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    k = torch.from_numpy(_gauss11())[None, None]
    t1 = torch.from_numpy(np.ascontiguousarray(y1))[None, None]
    t2 = torch.from_numpy(np.ascontiguousarray(y2))[None, None]
    f = lambda t: F.conv2d(t, k)  # valid region only
    mu1, mu2 = f(t1), f(t2)
    s1 = f(t1 * t1) - mu1 ** 2
    s2 = f(t2 * t2) - mu2 ** 2
    s12 = f(t1 * t2) - mu1 * mu2
    m = ((2 * mu1 * mu2 + c1) * (2 * s12 + c2)) / ((mu1 ** 2 + mu2 ** 2 + c1) * (s1 + s2 + c2))
    return float(m.mean())
