"""NVFP4 as NVIDIA ModelOpt exports it: `weight` uint8 [out, in / 2] (E2M1 codes), `weight_scale`
float8_e4m3fn [out, in / 16] (a scale per 16), `weight_scale_2` float32 (per tensor) and `input_scale`
float32 (the activations' scale for W4A4, unused here: weights only). W = e2m1 * (weight_scale * scale_2)."""
import torch
from torch import Tensor

from pagedmoe.layers.quantization.fp4 import E2M1_MAX, encode_e2m1, pack_fp4, unpack_fp4

BLOCK = 16
E4M3_MAX = 448.0


def check_nvfp4(name: str, weight: Tensor, weight_scale: Tensor, scale_2: Tensor | None):
    if weight.dtype != torch.uint8 or weight_scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: NVFP4 weight must be uint8 and weight_scale float8_e4m3fn, got {weight.dtype} "
                         f"and {weight_scale.dtype}")
    if weight_scale.shape != (*weight.shape[:-1], weight.shape[-1] * 2 // BLOCK):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not fit weight_scale "
                         f"{tuple(weight_scale.shape)} (one scale per {BLOCK})")
    if not bool(torch.isfinite(weight_scale.float()).all()):
        raise ValueError(f"{name}.weight_scale: non-finite block scales")
    check_global_scale(f"{name}.weight_scale_2", scale_2)


def check_global_scale(name: str, scale: Tensor | None):
    """vLLM once read missing or zero global scales as 1/0 and produced NaNs (vllm#45212): refused here."""
    if scale is None:
        raise ValueError(f"{name}: missing from the checkpoint")
    if scale.numel() != 1 or not bool(torch.isfinite(scale).all()) or float(scale) <= 0:
        raise ValueError(f"{name}: expected one finite positive scale, got {scale.flatten()[:4].tolist()}")


def dequantize_nvfp4(weight: Tensor, weight_scale: Tensor, scale_2: Tensor) -> Tensor:
    """float32 [out, in]: the block scales times scale_2 (per tensor, or one per row) first, then the codes'
    values (ModelOpt's order)."""
    values = unpack_fp4(weight).view(*weight.shape[:-1], -1, BLOCK)
    scale_2 = scale_2.float()
    scales = weight_scale.float() * (scale_2.reshape(()) if scale_2.numel() == 1 else scale_2[:, None])
    return (values * scales[..., None]).flatten(-2)


def quantize_nvfp4(weight: Tensor) -> dict[str, Tensor]:
    """ModelOpt's NVFP4 rounding: scale_2 = amax / (6 * 448), each block's scale amax / (6 * scale_2) in E4M3.
    Weights only (W4A16_NVFP4): no input_scale, which would take calibration data."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4: the input dim {weight.shape[-1]} is not a multiple of {BLOCK}")
    w = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    scale_2 = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=torch.finfo(torch.float32).tiny)
    block_scale = w.abs().amax(dim=-1) / (E2M1_MAX * scale_2)
    block_scale = torch.where(block_scale == 0, 1.0, block_scale).clamp(min=2 ** -9).to(torch.float8_e4m3fn)
    codes = encode_e2m1(w / (block_scale.float()[..., None] * scale_2))
    return {"weight": pack_fp4(codes.flatten(-2)), "weight_scale": block_scale, "weight_scale_2": scale_2.reshape(())}
