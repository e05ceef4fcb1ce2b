"""FP8 with block scales as DeepSeek-V3 ships it: `weight` float8_e4m3fn [out, in] and `weight_scale_inv`
float32 [ceil(out / 128), ceil(in / 128)], the multiplier of each 128x128 block (the last ones ragged:
DeepSeek-V3's kv_a_proj_with_mqa has 576 rows, four and a half blocks)."""
import torch
from torch import Tensor

BLOCK = 128
E4M3_MAX = 448.0


def scale_grid(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    return (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))


def check_fp8(name: str, weight: Tensor, scale_inv: Tensor | None, block: int = BLOCK):
    if scale_inv is None:
        raise ValueError(f"{name}.weight_scale_inv: missing for a float8 weight")
    if tuple(scale_inv.shape) != scale_grid(tuple(weight.shape), block):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not fit weight_scale_inv "
                         f"{tuple(scale_inv.shape)} ({block}x{block} blocks)")
    if not bool(torch.isfinite(scale_inv).all()) or bool((scale_inv == 0).any()):
        raise ValueError(f"{name}.weight_scale_inv: zero or non-finite block scales")


def expand_blocks(scales: Tensor, rows: int, cols: int, block: int = BLOCK) -> Tensor:
    """[..., R, C] block scales -> [..., rows, cols], each repeated over its block (ragged edges cut)."""
    full = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :rows, :cols]


def dequantize_fp8(weight: Tensor, scale_inv: Tensor, block: int = BLOCK) -> Tensor:
    return weight.float() * expand_blocks(scale_inv.float(), *weight.shape[-2:], block)


def quantize_fp8(weight: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """(float8 weight, scale_inv): each block scaled so its amax is 448 (an all-zero block keeps scale 1)."""
    rows, cols = weight.shape[-2:]
    padded = torch.nn.functional.pad(weight.float(), (0, -cols % block, 0, -rows % block))
    blocks = padded.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # [..., R, block, C, block]
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = weight.float() / expand_blocks(scale_inv, rows, cols, block)
    return q.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale_inv
