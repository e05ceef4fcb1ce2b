"""MXFP4 as gpt-oss ships its experts: `*_blocks` uint8 [..., G, 16] (32 E2M1 codes a block along the input
dim) and `*_scales` uint8 [..., G], an E8M0 power of two 2^(e - 127) per block."""
import torch
from torch import Tensor

from pagedmoe.layers.quantization.fp4 import E2M1_MAX, encode_e2m1, pack_fp4, unpack_fp4

BLOCK = 32
E8M0_NAN = 255


def check_mxfp4(name: str, blocks: Tensor, scales: Tensor):
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}")
    if bool((scales == E8M0_NAN).any()):
        raise ValueError(f"{name}_scales: E8M0 scale 255 (NaN) in the checkpoint")


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """float32 [..., G * 32], exactly as HF's Mxfp4 dequantisation (ldexp of the E2M1 values)."""
    values = unpack_fp4(blocks)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


def quantize_mxfp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks, scales), as HF's quantiser (triton_kernels' downcast) rounds:
    each block's scale is amax / 6 rounded up to a power of two."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4: the input dim {weight.shape[-1]} is not a multiple of {BLOCK}")
    w = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = w.abs().amax(dim=-1, keepdim=True)
    bits = ((amax / E2M1_MAX).view(torch.int32) + 0x007FFFFF) & 0x7F800000
    scale = bits.view(torch.float32)
    codes = encode_e2m1(torch.where(scale > 0, w / scale, torch.zeros_like(w)))
    return pack_fp4(codes), (bits >> 23).squeeze(-1).to(torch.uint8)
