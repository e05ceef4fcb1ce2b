"""The CPU fused-MoE kernel (csrc/fused_moe.cpp): all routed experts of a layer in one call, each active
expert's weights streamed from memory once, for decode-sized batches. Built and loaded by
layers/cpu_build.py; RuntimeError where it cannot be, and FusedMoE then keeps its expert loop."""
import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedmoe.layers import cpu_build, cpu_linear
from pagedmoe.layers.activation import silu_and_mul
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.cpu_linear import ANY_ROWS, CpuLinear, in_k_pairs, pack_gate_up, pack_panels

SOURCE = Path(__file__).with_name("csrc") / "fused_moe.cpp"
ENTRY_POINTS = {torch.float32: "fused_moe_f32", torch.bfloat16: "fused_moe_bf16"}
# Up to this many (token, expert) pairs per expert on average the kernel beats the oneDNN expert loop; above
# it oneDNN's large-tile GEMMs (AMX for bf16) win: measured on a Sapphire Rapids, 8 experts, 768 -> 1024.
MAX_ROWS_PER_EXPERT = {torch.float32: 64, torch.bfloat16: 16}
# With AMX, bf16 batches past 12 rows per expert run each expert on the AMX tile GEMM instead (alone: 1.2x
# at 8 and 1.9x at 16 rows per expert; in a decode step of 8 experts: even at 6-8, 1.2x at 16), at any number
# of rows: 1.3x oneDNN at 64, and in prefill, where every step routes a new row count to each expert, oneDNN
# JITs a kernel per expert and row count (a 2048-token MoE layer: 98 ms against 40).
MAX_ROWS_PER_EXPERT_AMX = 12


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    return cpu_build.load_library(SOURCE, compiler, march)


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_tokens", "top_k", "num_experts", "hidden", "inter")]


def unsupported_reason(w13: Tensor, w2: Tensor, panel: int) -> str | None:
    if w13.dtype not in ENTRY_POINTS or w2.dtype != w13.dtype or w13.device.type != "cpu":
        return f"the CPU MoE kernel runs float32 and bfloat16 CPU weights, got {w13.dtype} on {w13.device}"
    inter, hidden = w2.shape[2], w2.shape[1]
    if inter % (panel // 2) or hidden % panel:
        return f"the CPU MoE kernel needs intermediate % {panel // 2} == 0 and hidden % {panel} == 0"
    return None


class CpuFusedMoE:
    """out = sum over each token's top-k experts of weight * silu(x W1^T) * (x W3^T) W2^T, in float32,
    from copies of w13 [E, 2I, H] and w2 [E, H, I] packed at construction."""

    def __init__(self, w13: Tensor, w2: Tensor, library: ctypes.CDLL | None = None):
        library = library if library is not None else load_library()
        panel = library.fused_moe_panel()
        if reason := unsupported_reason(w13, w2, panel):
            raise ValueError(reason)
        self.fn = getattr(library, ENTRY_POINTS[w13.dtype])
        self.fn.restype = None
        self.num_experts, self.hidden, self.inter = w2.shape
        w13, w2 = w13.detach(), w2.detach()
        self.w13, self.w2 = pack_gate_up(w13, panel), pack_panels(w2, panel)
        if w13.dtype == torch.bfloat16 and library.fused_moe_bf16_pairs():
            self.w13, self.w2 = in_k_pairs(self.w13), in_k_pairs(self.w2)
        self.experts = amx_experts(w13, w2, self.w13, self.w2, panel)
        rows = MAX_ROWS_PER_EXPERT[w13.dtype] if self.experts is None else MAX_ROWS_PER_EXPERT_AMX
        self.max_pairs = rows * self.num_experts

    def fits(self, x: Tensor, topk_ids: Tensor) -> bool:
        """Whether this batch is decode-sized, where the kernel is the faster path (and no autograd)."""
        return topk_ids.numel() <= self.max_pairs and not (torch.is_grad_enabled() and x.requires_grad)

    def __call__(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if x.dtype != self.w13.dtype or x.shape[-1] != self.hidden:
            raise ValueError(f"x must be {self.w13.dtype} [tokens, {self.hidden}], got {x.dtype} {tuple(x.shape)}")
        x, ids = x.contiguous(), topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        shape = Shape(x.shape[0], ids.shape[1], self.num_experts, self.hidden, self.inter)
        self.fn(*map(ptr, (x, ids, weights, self.w13, self.w2, out)), shape, num_threads())
        return out



class ExpertProjection:
    """One expert's gate_up (gated) or down projection for batches past the fused kernel: the AMX tile GEMM
    on the fused kernel's own packed copy (no third copy of the weights); oneDNN on the original weight only
    where the kernel does not fit (autograd)."""

    def __init__(self, kernel: CpuLinear, weight: Tensor):
        self.kernel, self.weight = kernel, weight
        self.shape = weight.shape  # looped_experts reads the down projection's output width from it

    def __call__(self, x: Tensor, bias: Tensor | None = None) -> Tensor:
        if self.kernel.fits(x):
            return self.kernel(x)
        out = F.linear(x, self.weight)
        return silu_and_mul(out) if self.kernel.gated else out


def amx_experts(w13: Tensor, w2: Tensor, packed_w13: Tensor, packed_w2: Tensor,
                panel: int) -> tuple[list, list] | None:
    """Per-expert projections (of detached w13 / w2) on AMX, where the linear kernel runs bf16 on AMX tiles
    and shares the fused kernel's layout (the same panel width, k-pairs); None elsewhere."""
    try:
        library = cpu_linear.load_library()
    except RuntimeError:
        return None
    if library.linear_panel() != panel or not cpu_linear.uses_amx(library, w13[0]) \
            or not cpu_linear.uses_amx(library, w2[0]) or not library.linear_bf16_pairs():
        return None
    return ([ExpertProjection(CpuLinear(w, library, ANY_ROWS, gated=True, packed=p), w) for w, p in zip(w13, packed_w13)],
            [ExpertProjection(CpuLinear(w, library, ANY_ROWS, packed=p), w) for w, p in zip(w2, packed_w2)])


def call_projection(x: Tensor, projection: ExpertProjection, bias: Tensor | None) -> Tensor:
    return projection(x, bias)
