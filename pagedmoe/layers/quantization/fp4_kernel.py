"""4-bit E2M1 weights kept packed, and their CPU kernel (csrc/fp4_gemm.cpp): a decode-sized matmul quantises
the activations to int8 per 32 and sums the products of each weight block in integers, so the weight streams
through memory at 4.25 (MXFP4) or 4.5 (NVFP4) bits an element; larger batches decode the weight in panels and
use the float GEMM. Built and loaded by layers/cpu_build.py; RuntimeError where it cannot be (callers then
decode the weight in PyTorch)."""
import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from pagedmoe.layers import cpu_build
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.quantization.mxfp4 import dequantize_mxfp4
from pagedmoe.layers.quantization.nvfp4 import dequantize_nvfp4

SOURCE = Path(__file__).with_name("csrc") / "fp4_gemm.cpp"
ACT_BLOCK = 32
ISA_NAMES = ("scalar", "avx2", "avx512_vnni")


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    library = cpu_build.load_library(SOURCE, compiler, march)
    library.fp4_isa.restype = ctypes.c_int
    for fn in (library.fp4_gemm, library.fp4_dequantize_rows):
        fn.restype = None
    return library


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("m", "n", "k", "block", "scale_kind")]


@dataclass
class PackedFp4Weight:
    """A [n, k] weight as E2M1 codes [n, k / 2] and one scale byte per block of a row: block 32 with E8M0
    scales (MXFP4), or 16 with E4M3 ones and NVFP4's scale_2 in row_scale (float32 [n]: one per row, so that
    merged projections keep their own; None for MXFP4)."""
    codes: Tensor
    scales: Tensor
    block: int
    row_scale: Tensor | None = None

    @classmethod
    def from_mxfp4(cls, blocks: Tensor, scales: Tensor) -> "PackedFp4Weight":
        """blocks [n, G, 16], scales [n, G] (one expert's, as gpt-oss stores them)."""
        return cls(blocks.reshape(blocks.shape[0], -1).contiguous(), scales.contiguous(), 32)

    @classmethod
    def from_nvfp4(cls, weight: Tensor, weight_scale: Tensor, scale_2: Tensor) -> "PackedFp4Weight":
        row_scale = scale_2.float().reshape(()).expand(weight.shape[0]).contiguous()
        return cls(weight.contiguous(), weight_scale.view(torch.uint8).contiguous(), 16, row_scale)

    @classmethod
    def cat(cls, parts: list["PackedFp4Weight"]) -> "PackedFp4Weight":
        """The parts' rows one after another (merged q/k/v or gate/up)."""
        row_scales = [p.row_scale for p in parts]
        row_scale = None if all(r is None for r in row_scales) else torch.cat(
            [torch.ones(p.shape[0]) if r is None else r for p, r in zip(parts, row_scales)])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), parts[0].block,
                   row_scale)

    def rows(self, index: Tensor) -> "PackedFp4Weight":
        row_scale = None if self.row_scale is None else self.row_scale[index].contiguous()
        return PackedFp4Weight(self.codes[index].contiguous(), self.scales[index].contiguous(), self.block, row_scale)

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    def numel(self) -> int:
        """The dense weight's elements (what loading it stands for)."""
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.row_scale is None else self.row_scale.nbytes)

    @property
    def scale_kind(self) -> int:
        return 0 if self.block == 32 else 1

    def dequantize(self) -> Tensor:
        """float32 [n, k], in PyTorch: exactly what the format decoders give."""
        if self.block == 32:
            return dequantize_mxfp4(self.codes.view(*self.scales.shape, 16), self.scales)
        return dequantize_nvfp4(self.codes, self.scales.view(torch.float8_e4m3fn), self.row_scale)

    def kernel_shape(self, m: int) -> Shape:
        n, k = self.shape
        return Shape(m, n, k, self.block, self.scale_kind)


class Fp4Kernel:
    def __init__(self, library: ctypes.CDLL | None = None):
        self.library = library if library is not None else load_library()

    @property
    def isa(self) -> str:
        return ISA_NAMES[self.library.fp4_isa()]

    def matmul(self, x: Tensor, weight: PackedFp4Weight) -> Tensor:
        """x [m, k] -> float32 [m, n], the activations quantised to int8 per 32."""
        x = x.float().contiguous()
        n, k = weight.shape
        if x.dim() != 2 or x.shape[1] != k or k % ACT_BLOCK:
            raise ValueError(f"x {tuple(x.shape)} does not fit a [{n}, {k}] weight (k a multiple of {ACT_BLOCK})")
        out = torch.empty(x.shape[0], n)
        self.library.fp4_gemm(ptr(x), ptr(weight.codes), ptr(weight.scales), ptr(weight.row_scale), ptr(out),
                              weight.kernel_shape(x.shape[0]), num_threads())
        return out

    def dequantize_rows(self, weight: PackedFp4Weight, row0: int, out: Tensor) -> Tensor:
        """Rows [row0, row0 + len(out)) of the weight decoded into out (float32 [rows, k])."""
        self.library.fp4_dequantize_rows(ptr(weight.codes), ptr(weight.scales), ptr(weight.row_scale), ptr(out),
                                         weight.kernel_shape(0), ctypes.c_int64(row0), ctypes.c_int64(out.shape[0]),
                                         num_threads())
        return out


class MoeShape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_tokens", "top_k", "num_experts", "hidden", "inter",
                                                     "block", "scale_kind", "activation")]


class Fp4Experts(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("codes", "scales", "row_scale", "bias")]


MOE_ACTIVATIONS = ("silu", "swigluoai")


def stacked(weights: list[PackedFp4Weight]) -> PackedFp4Weight:
    row_scale = None if weights[0].row_scale is None else torch.stack([w.row_scale for w in weights])
    return PackedFp4Weight(torch.stack([w.codes for w in weights]), torch.stack([w.scales for w in weights]),
                           weights[0].block, row_scale)


def unstacked(weight: PackedFp4Weight) -> list[PackedFp4Weight]:
    """Views of each expert's weight in the stacked tensors (no copy)."""
    row_scales = [None] * len(weight.codes) if weight.row_scale is None else list(weight.row_scale)
    return [PackedFp4Weight(codes, scales, weight.block, row_scale)
            for codes, scales, row_scale in zip(weight.codes, weight.scales, row_scales)]


class Fp4MoE:
    """The routed experts of a MoE layer on 4-bit weights in one kernel call (csrc/fp4_gemm.cpp, fp4_moe):
    out = sum over each token's top-k experts of weight * (act(x W13^T + b13) W2^T + b2), in float32, the
    activations quantised to int8 per 32 before each matmul. w13 [E, 2I, H] (gate rows, then up rows) and
    w2 [E, H, I] stacked; hidden and inter multiples of 32."""

    def __init__(self, w13: PackedFp4Weight, w2: PackedFp4Weight, activation: str, w13_bias: Tensor | None,
                 w2_bias: Tensor | None, library: ctypes.CDLL | None = None):
        self.library = library if library is not None else load_library()
        self.library.fp4_moe.restype = None
        self.w13, self.w2 = w13, w2
        self.num_experts, self.hidden, self.inter = w2.codes.shape[0], w2.codes.shape[1], w2.codes.shape[2] * 2
        if self.hidden % ACT_BLOCK or self.inter % ACT_BLOCK or w13.block != w2.block:
            raise ValueError(f"the 4-bit MoE kernel needs hidden and intermediate sizes in multiples of {ACT_BLOCK}")
        self.activation = MOE_ACTIVATIONS.index(activation)
        self.biases = [None if b is None else b.detach().float().contiguous() for b in (w13_bias, w2_bias)]
        self.structs = [Fp4Experts(*(ptr(t).value for t in (w.codes, w.scales, w.row_scale, bias)))
                        for w, bias in zip((w13, w2), self.biases)]

    def __call__(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        x, ids = x.float().contiguous(), topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.float().contiguous()
        out = torch.empty(x.shape[0], self.hidden)
        shape = MoeShape(x.shape[0], ids.shape[1], self.num_experts, self.hidden, self.inter, self.w13.block,
                         self.w13.scale_kind, self.activation)
        self.library.fp4_moe(ptr(x), ptr(ids), ptr(weights), *self.structs, ptr(out), shape, num_threads())
        return out
