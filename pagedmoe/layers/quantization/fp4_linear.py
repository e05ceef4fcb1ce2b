"""A linear layer's matmul on a packed 4-bit weight: the int8-dot kernel for decode-sized inputs; past
MAX_DOT_ROWS rows the weight is decoded PANEL_ROWS rows at a time for the float GEMM (the decode then costs
little against the rows it serves), in float32, or in bf16 for bf16 inputs where the CPU has native bf16
(oneDNN's bf16 GEMM there runs 2-3x MKL's float32 one). Without the kernel, the whole weight is decoded in
PyTorch at every call: correct, slow."""
import logging

import torch
from torch import Tensor

from pagedmoe.cpu_info import bf16_is_emulated
from pagedmoe.layers.quantization.fp4_kernel import ACT_BLOCK, Fp4Kernel, PackedFp4Weight

logger = logging.getLogger(__name__)
MAX_DOT_ROWS = 16
PANEL_ROWS = 256
_kernel: Fp4Kernel | None | bool = False  # False: not tried yet


def fp4_kernel() -> Fp4Kernel | None:
    global _kernel
    if _kernel is False:
        try:
            _kernel = Fp4Kernel()
        except RuntimeError as error:
            logger.warning("4-bit weights fall back to PyTorch decoding at every call: %s", error)
            _kernel = None
    return _kernel


def fp4_matmul(x: Tensor, weight: PackedFp4Weight) -> Tensor:
    """x [m, k] -> [m, n]: float32, or bf16 from the bf16 panels."""
    kernel = fp4_kernel()
    if kernel is None or weight.shape[1] % ACT_BLOCK:
        return x.float() @ weight.dequantize().T
    if x.shape[0] <= MAX_DOT_ROWS:
        return kernel.matmul(x, weight)
    dtype = torch.bfloat16 if x.dtype == torch.bfloat16 and not bf16_is_emulated() else torch.float32
    return panel_matmul(kernel, x.to(dtype), weight)


def panel_matmul(kernel: Fp4Kernel, x: Tensor, weight: PackedFp4Weight) -> Tensor:
    """x [m, k] (float32 or bf16) against the weight decoded a panel at a time, in x's dtype."""
    n, k = weight.shape
    out, panel = torch.empty(x.shape[0], n, dtype=x.dtype), torch.empty(min(n, PANEL_ROWS), k)
    for row0 in range(0, n, PANEL_ROWS):
        rows = kernel.dequantize_rows(weight, row0, panel[:min(PANEL_ROWS, n - row0)])
        out[:, row0:row0 + rows.shape[0]] = x @ rows.T.to(x.dtype)
    return out


def fp4_linear(x: Tensor, weight: PackedFp4Weight, bias: Tensor | None = None) -> Tensor:
    """F.linear on a packed weight, in x's dtype."""
    out = fp4_matmul(x.reshape(-1, x.shape[-1]), weight).to(x.dtype)
    out = out if bias is None else out.add_(bias)
    return out.view(*x.shape[:-1], weight.shape[0])
