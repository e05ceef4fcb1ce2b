"""E2M1, the 4-bit float of MXFP4 and NVFP4: bit 3 the sign, bits 2..0 an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Two codes a byte, the low nibble first (element 2j), as OpenAI, ModelOpt and HF pack them."""
import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX = 6.0
# |x| up to each bound rounds to the next magnitude; ties go to the even code, as ModelOpt's _cast_fp4 does
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


def unpack_fp4(packed: Tensor) -> Tensor:
    """uint8 [..., n] -> float32 [..., 2n]."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).long()
    return lut[codes].flatten(-2)


def encode_e2m1(x: Tensor) -> Tensor:
    """Float values (already divided by their scale) -> E2M1 codes (uint8), rounded to nearest, ties to even,
    saturating at +-6."""
    magnitude = x.abs().float()
    bounds = torch.tensor(_BOUNDS, device=x.device)
    codes = torch.searchsorted(bounds, magnitude.contiguous())
    codes += torch.isin(magnitude, torch.tensor(_TIES_UP, device=x.device)).long()
    return (codes.clamp(max=7) | (x < 0).long() << 3).to(torch.uint8)


def pack_fp4(codes: Tensor) -> Tensor:
    """uint8 codes [..., 2n] -> [..., n], element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
