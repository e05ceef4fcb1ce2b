"""The CPU tile-GEMM linear (csrc/linear.cpp) for decode-sized inputs: it streams the weight once per call at
close to the memory bandwidth, where oneDNN's small-M kernels reach about half. Built and loaded by
cpu_build.py; RuntimeError where it cannot be, and Linear then keeps oneDNN / MKL."""
import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from pagedmoe.cpu_info import cpu_flags, kernels_take_every_size
from pagedmoe.layers import cpu_build
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.memory import huge_copy

SOURCE = Path(__file__).with_name("csrc") / "linear.cpp"
ENTRY_POINTS = {torch.float32: "linear_f32", torch.bfloat16: "linear_bf16"}
# Up to this many rows the kernel beats oneDNN's packed GEMM (float32, Sapphire Rapids: 1.3-1.7x at 8-32 rows,
# even at 128); native bfloat16 on AMX tiles at every size (the vector tiles lose to oneDNN's AMX kernels from a
# few rows on) and on avx512_bf16's pair dot products at decode sizes (below); elsewhere see default_max_rows.
# On AMX at every row count: oneDNN reorders the plain bf16 weight into its tile layout on
# every call, which the packed copy never does (1.2-1.4x at 64-256 rows), and JITs a kernel for every new row
# count (3-40 ms each, and prefill and serving row counts change every step); at 512-2048 rows the chunked
# tile GEMM runs at oneDNN's warm speed.
ANY_ROWS = 1 << 62
MAX_ROWS = {torch.float32: 96}
MAX_ROWS_AMX = ANY_ROWS
# Native bf16 without AMX (avx512_bf16: Zen 4, Cooper Lake), on the kernel's pair dot products: against oneDNN's
# packed bf16 GEMM on a Zen 4 EPYC (ms, the 100M bench model's linears, weights from memory) 1.1-1.35x at 1-32
# rows (gate_up at 12 rows 0.243 / 0.318), even at 64 (gate_up 1.021 / 1.058, down 0.562 / 0.522), 3-10%
# slower from 96. Up to here the decode block and stack run the layers too.
MAX_ROWS_BF16_PAIRS = 64


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    return cpu_build.load_library(SOURCE, compiler, march)


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "out_features", "in_features")]


def pack_panels(weight: Tensor, panel: int) -> Tensor:
    """[..., N, K] -> [..., N / panel, K, panel]: a panel's weights in the order one tile streams them."""
    *outer, n, k = weight.shape
    return weight.reshape(*outer, n // panel, panel, k).transpose(-1, -2).contiguous()


def pack_gate_up(gate_up: Tensor, panel: int) -> Tensor:
    """[..., 2I, K] (gate rows, then up rows) -> [..., I / (panel / 2), K, panel]: each panel's first half
    is panel / 2 gate columns, its second half the matching up columns."""
    *outer, two_inter, k = gate_up.shape
    half = panel // 2
    gate, up = (w.reshape(*outer, two_inter // 2 // half, half, k) for w in gate_up.chunk(2, dim=-2))
    return torch.cat([gate, up], dim=-2).transpose(-1, -2).contiguous()


def in_k_pairs(packed: Tensor) -> Tensor:
    """[..., K, panel] -> [..., K / 2, panel, 2], the layout of avx512_bf16's pair dot products."""
    *outer, k, panel = packed.shape
    return packed.reshape(*outer, k // 2, 2, panel).transpose(-1, -2).contiguous()


def pack_for(library: ctypes.CDLL, weight: Tensor, panel: int, gated: bool = False) -> Tensor:
    packed = (pack_gate_up if gated else pack_panels)(weight.detach(), panel)
    return huge_copy(in_k_pairs(packed) if weight.dtype == torch.bfloat16 and library.linear_bf16_pairs() else packed)


def unsupported_reason(weight: Tensor, panel: int) -> str | None:
    if weight.dtype not in ENTRY_POINTS or weight.device.type != "cpu" or weight.dim() != 2:
        return f"the CPU linear kernel runs 2-D float32 and bfloat16 CPU weights, got {weight.dtype} on {weight.device}"
    if weight.shape[0] % panel or weight.shape[1] % 2:  # gated: 2I % panel, i.e. I % (panel / 2)
        return f"the CPU linear kernel needs out_features % {panel} == 0 and even in_features"
    return None


def uses_amx(library: ctypes.CDLL, weight: Tensor) -> bool:
    """bf16 weights whose in_features fill whole AMX tiles (32), on a CPU (as cpu_info reports it, so
    PAGEDMOE_CPU_FLAGS can take AMX away in tests) and kernel that grant AMX."""
    if weight.dtype != torch.bfloat16 or weight.shape[1] % 32 or "amx_bf16" not in cpu_flags():
        return False
    return bool(library.linear_amx())


def default_max_rows(dtype: torch.dtype, on_amx: bool, bf16_pairs: bool = False) -> int:
    """Every row count where the alternative is slower at every size: AMX, bf16 on an x86 CPU without native
    bf16 (widened here against oneDNN's emulation: 3-5x from 16 rows on an AMD EPYC, AVX2), and float32 where
    torch's BLAS is MKL off Intel (blas_is_tuned) on AVX2; decode sizes for bf16 on avx512_bf16's pair dot
    products and for float32 off Intel with AVX-512, whose larger inputs take oneDNN's packed copy
    (keeps_packed_copy)."""
    if on_amx:
        return MAX_ROWS_AMX
    if kernels_take_every_size(dtype):
        return MAX_ROWS[dtype] if dtype == torch.float32 and "avx512f" in cpu_flags() else ANY_ROWS
    return MAX_ROWS_BF16_PAIRS if dtype == torch.bfloat16 and bf16_pairs else MAX_ROWS.get(dtype, 0)


def keeps_packed_copy(dtype: torch.dtype, max_rows: int) -> bool:
    """Whether a layer whose kernel takes up to max_rows keeps oneDNN's packed copy for larger inputs, where it
    beats F.linear: bf16 (5-8% from 256 rows on a Zen 4 EPYC) and float32 off Intel (MKL's sgemm untuned; on
    the Zen 4 oneDNN's packed GEMM was also 1.05-1.35x faster than the tile kernel from 256 rows). On Intel
    MKL is as fast as the packed copy, so float32 weights are held twice, not three times."""
    return max_rows < ANY_ROWS and (dtype == torch.bfloat16 or kernels_take_every_size(dtype))


class CpuLinear:
    """F.linear(x, weight, bias) from a copy of weight [N, K] packed at construction; gated: weight is a
    gate_up [2I, K] and the call returns silu(x gate^T) * (x up^T), [..., I] (no bias)."""

    def __init__(self, weight: Tensor, library: ctypes.CDLL | None = None, max_rows: int | None = None,
                 gated: bool = False):
        """max_rows: the most rows a call runs here (None: the default for the dtype and ISA)."""
        library = library if library is not None else load_library()
        panel = library.linear_panel()
        if reason := unsupported_reason(weight, panel):
            raise ValueError(reason)
        self.gated, self.on_amx = gated, uses_amx(library, weight)
        name = "linear_amx_bf16" if self.on_amx else ENTRY_POINTS[weight.dtype]
        self.fn = getattr(library, ("gated_" if gated else "") + name)
        self.fn.restype = None
        self.out_features, self.in_features = weight.shape[0] // (2 if gated else 1), weight.shape[1]
        pairs = bool(library.linear_bf16_pairs())
        self.max_rows = max_rows if max_rows is not None else default_max_rows(weight.dtype, self.on_amx, pairs)
        self.weight = pack_for(library, weight, panel, gated)

    def fits(self, x: Tensor) -> bool:
        """Whether x is decode-sized, where the kernel is the faster path (and no autograd)."""
        return x.numel() <= self.max_rows * self.in_features and not (torch.is_grad_enabled() and x.requires_grad)

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.dtype != self.weight.dtype or x.shape[-1] != self.in_features:
            raise ValueError(f"x must be {self.weight.dtype} [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        shape = Shape(rows.shape[0], self.out_features, self.in_features)
        if self.gated:
            self.fn(ptr(rows), ptr(self.weight), ptr(out), shape, num_threads())
        else:
            bias = None if bias is None else bias.detach().to(x.dtype).contiguous()
            self.fn(ptr(rows), ptr(self.weight), ptr(bias), ptr(out), shape, num_threads())
        return out.view(*x.shape[:-1], self.out_features)
