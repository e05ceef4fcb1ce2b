"""The CPU fused-MoE kernel (csrc/fused_moe.cpp): all routed experts of a layer in one call, each active
expert's weights streamed from memory once, for decode-sized batches (bf16 on AMX tiles: batches of any size).
Built and loaded by layers/cpu_build.py; RuntimeError where it cannot be, and FusedMoE then keeps its expert
loop."""
import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from pagedmoe.cpu_info import cpu_flags, kernels_take_every_size
from pagedmoe.layers import cpu_build
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.cpu_linear import ANY_ROWS, in_k_pairs, pack_gate_up, pack_panels
from pagedmoe.memory import huge_copy

SOURCE = Path(__file__).with_name("csrc") / "fused_moe.cpp"
ENTRY_POINTS = {torch.float32: "fused_moe_f32", torch.bfloat16: "fused_moe_bf16"}
# Up to this many (token, expert) pairs per expert on average the kernel beats the oneDNN expert loop; above
# it oneDNN's large-tile GEMMs (AMX for bf16) win: measured on a Sapphire Rapids, 8 experts, 768 -> 1024.
MAX_ROWS_PER_EXPERT = {torch.float32: 64, torch.bfloat16: 16}
# With AMX, bf16 batches of every size run the same kernel on AMX tiles instead: 8 experts 768 -> 1024, 12
# layers, against the vector kernel 1.0x at 4 tokens, 1.2x at 16, 1.4x at 32, 1.9x at 48; against one AMX
# call per expert 1.3-1.75x at 32-128 tokens; and no fall back to oneDNN past decode sizes, which JITs a
# kernel per expert and row count, new in every prefill step (a 2048-token layer: 98 ms against 40).


def max_rows_per_expert(dtype: torch.dtype) -> int:
    """Every size where the expert loop's GEMMs are slower at every size: float32 on MKL off Intel (8 experts
    768 -> 1024, top-2, AMD EPYC, AVX2: the kernel 4.4x over the MKL loop at 16 tokens, 1.7x at 512, 1.2x at
    2048), and bf16 where it is emulated."""
    return ANY_ROWS if kernels_take_every_size(dtype) else MAX_ROWS_PER_EXPERT[dtype]


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    return cpu_build.load_library(SOURCE, compiler, march)


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_tokens", "top_k", "num_experts", "hidden", "inter")]


class Epilogue(ctypes.Structure):
    _fields_ = [("activation", ctypes.c_int64), ("b13", ctypes.c_void_p), ("b2", ctypes.c_void_p)]


KERNEL_ACTIVATIONS = ("silu", "swigluoai")


def unsupported_reason(w13: Tensor, w2: Tensor, panel: int) -> str | None:
    if w13.dtype not in ENTRY_POINTS or w2.dtype != w13.dtype or w13.device.type != "cpu":
        return f"the CPU MoE kernel runs float32 and bfloat16 CPU weights, got {w13.dtype} on {w13.device}"
    inter, hidden = w2.shape[2], w2.shape[1]
    if inter % (panel // 2) or hidden % panel:
        return f"the CPU MoE kernel needs intermediate % {panel // 2} == 0 and hidden % {panel} == 0"
    return None


class CpuFusedMoE:
    """out = sum over each token's top-k experts of weight * (act(x W13^T + b13) W2^T + b2), in float32, from
    copies of w13 [E, 2I, H] and w2 [E, H, I] (and the biases, where given) packed at construction; act is
    silu(gate) * up or gpt-oss's swigluoai."""

    def __init__(self, w13: Tensor, w2: Tensor, library: ctypes.CDLL | None = None, activation: str = "silu",
                 w13_bias: Tensor | None = None, w2_bias: Tensor | None = None):
        library = library if library is not None else load_library()
        panel = library.fused_moe_panel()
        if reason := unsupported_reason(w13, w2, panel):
            raise ValueError(reason)
        if activation not in KERNEL_ACTIVATIONS:
            raise ValueError(f"activation: the CPU MoE kernel runs {KERNEL_ACTIVATIONS}, got {activation!r}")
        self.panel = panel
        self.b13 = None if w13_bias is None else self.pack_bias(w13_bias.detach())
        self.b2 = None if w2_bias is None else w2_bias.detach().float().contiguous()
        self.epilogue = Epilogue(KERNEL_ACTIVATIONS.index(activation), ptr(self.b13).value, ptr(self.b2).value)
        self.fn = getattr(library, ENTRY_POINTS[w13.dtype])
        self.fn.restype = None
        self.num_experts, self.hidden, self.inter = w2.shape
        self.pairs = w13.dtype == torch.bfloat16 and bool(library.fused_moe_bf16_pairs())
        self.w13, self.w2 = self.pack(w13.detach(), w2.detach())
        self.pack_expert = library.fused_moe_pack_expert
        self.pack_expert.restype = None
        self.pack_expert.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 4
        self.amx_fn = amx_entry_point(library, w13)
        if self.amx_fn is not None:
            self.fn = self.amx_fn
        self.max_pairs = max_rows_per_expert(w13.dtype) * self.num_experts

    def pack(self, w13: Tensor, w2: Tensor) -> tuple[Tensor, Tensor]:
        w13, w2 = pack_gate_up(w13, self.panel), pack_panels(w2, self.panel)
        return tuple(huge_copy(in_k_pairs(w) if self.pairs else w) for w in (w13, w2))

    def pack_bias(self, w13_bias: Tensor) -> Tensor:
        return pack_gate_up(w13_bias.float()[..., None], self.panel).flatten(1)

    def set_expert(self, slot: int, w13: Tensor, w2: Tensor, w13_bias: Tensor | None, w2_bias: Tensor | None):
        """Packs one expert's weights (converted to the kernel's dtype) and biases into slot, in place (offloaded
        experts, moe/offload/)."""
        w13, w2 = (w.to(self.w13.dtype).contiguous() for w in (w13, w2))
        self.pack_expert(*map(ptr, (w13, w2, self.w13[slot], self.w2[slot])), self.inter, self.hidden,
                         w13.element_size(), 2 if self.pairs else 1)
        if self.b13 is not None:
            self.b13[slot] = self.pack_bias(w13_bias[None])[0]
            self.b2[slot] = w2_bias.float()

    def fits(self, x: Tensor, topk_ids: Tensor) -> bool:
        """Whether this batch runs here: decode-sized, or any size on AMX (and no autograd)."""
        if torch.is_grad_enabled() and x.requires_grad:
            return False
        return topk_ids.shape[0] <= self.max_tokens(topk_ids.shape[1])

    def max_tokens(self, top_k: int) -> int:
        """The most tokens of top_k experts each that a call takes: any number on AMX tiles."""
        return ANY_ROWS if self.amx_fn is not None else self.max_pairs // top_k

    def __call__(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if x.dtype != self.w13.dtype or x.shape[-1] != self.hidden:
            raise ValueError(f"x must be {self.w13.dtype} [tokens, {self.hidden}], got {x.dtype} {tuple(x.shape)}")
        x, ids = x.contiguous(), topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        shape = Shape(x.shape[0], ids.shape[1], self.num_experts, self.hidden, self.inter)
        self.fn(*map(ptr, (x, ids, weights, self.w13, self.w2, out)), shape, ctypes.byref(self.epilogue),
                num_threads())
        return out


def amx_entry_point(library: ctypes.CDLL, w13: Tensor):
    """The kernel on AMX tiles, for bf16 experts whose hidden and intermediate sizes fill whole 32-wide
    k-steps, on a CPU (as cpu_info reports it, so PAGEDMOE_CPU_FLAGS can take AMX away in tests) and kernel
    that grant AMX; None elsewhere."""
    hidden, inter = w13.shape[2], w13.shape[1] // 2
    if w13.dtype != torch.bfloat16 or hidden % 32 or inter % 32 or "amx_bf16" not in cpu_flags():
        return None
    if not library.fused_moe_amx():
        return None
    fn = library.fused_moe_amx_bf16
    fn.restype = None
    return fn


