"""sattn.sr: the SattnSR super-resolution model (C++ inference, dense or sparse attention) and the BasicSR evaluation
protocol (MATLAB bicubic, Y-PSNR / SSIM, PNG/JPEG files). Images are numpy uint8 [H, W, 3] RGB ([H, W] gray is
replicated to RGB).

    import sattn.sr as sr
    model = sr.SrModel("sr/weights/sattn_sr_x2.safetensors")
    hr = sr.read_image("baby.png")
    lr = sr.downscale(hr, 2)
    sr_img, stats = model.upscale(lr, attention="sparse", return_stats=True)
    print(sr.psnr_y(sr_img, sr.mod_crop(hr, 2), border=2), stats["windows_routed"], stats["windows_total"])
"""
from ._core.sr import (SrModel, read_image, write_png, downscale, mod_crop, upscale_bicubic,  # noqa: F401
                       psnr_y, ssim_y)

__all__ = ["SrModel", "read_image", "write_png", "downscale", "mod_crop", "upscale_bicubic", "psnr_y", "ssim_y"]
