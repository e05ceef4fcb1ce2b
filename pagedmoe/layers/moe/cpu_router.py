"""A MoE layer's router on CPU in one C++ call (csrc/router.cpp) for decode-sized batches: logits, top-k,
weights and the step's expert counts, where eager PyTorch issues six ops. It takes the softmax routers
(Mixtral, Qwen-MoE, OLMoE: softmax then top-k, renormalised or not) and gpt-oss's top-k-then-softmax; the
grouped DeepSeek routers stay in PyTorch (routers.py), which is the reference it is tested against."""
import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from pagedmoe.layers import cpu_build, cpu_ops
from pagedmoe.layers.cpu_build import num_threads, ptr
from pagedmoe.layers.moe.routers import RouterConfig

SOURCE = Path(__file__).with_name("csrc") / "router.cpp"
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
KINDS = {"softmax": 0, "topk_softmax": 1}
MAX_TOKENS = 128  # past this the gate's matmul is better done by the BLAS


@functools.cache
def load_library(compiler: str = "c++", march: str = "native") -> ctypes.CDLL:
    return cpu_build.load_library(SOURCE, compiler, march)


class RouterArgs(ctypes.Structure):
    _fields_ = [("gate", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                *((name, ctypes.c_int64) for name in (
                    "hidden", "experts", "top_k", "kind", "renormalize", "round_bf16")),
                ("scaling", ctypes.c_float)]


def unsupported_reason(config: RouterConfig) -> str | None:
    if config.kind not in KINDS or config.has_correction_bias:
        return f"the CPU router takes {sorted(KINDS)} routers without a correction bias, got {config.kind}"
    return None


class CpuRouter:
    """(topk_weights float32 [T, k], topk_ids int64 [T, k]) of x [T, hidden] through a [experts, hidden] gate
    held in float32 (float_gate: a callable giving (weight, bias), converted once per weight version); the
    routed-token counts are added to expert_load ([experts] int64) where given."""

    def __init__(self, config: RouterConfig, float_gate, library: ctypes.CDLL | None = None):
        if reason := unsupported_reason(config):
            raise ValueError(reason)
        self.config, self.float_gate = config, float_gate
        self.library = library if library is not None else load_library()
        self.fns = {dtype: getattr(self.library, f"route_{suffix}") for dtype, suffix in SUFFIXES.items()}
        for fn in self.fns.values():
            fn.restype = None

    def fits(self, x: Tensor) -> bool:
        if not cpu_ops.enabled or x.device.type != "cpu" or x.dtype not in SUFFIXES or x.dim() != 2:
            return False
        return x.shape[0] <= MAX_TOKENS and not (torch.is_grad_enabled() and x.requires_grad)

    def __call__(self, x: Tensor, expert_load: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x, top_k = x.contiguous(), self.config.top_k
        args = self.args(x.dtype)
        weights, ids = torch.empty(x.shape[0], top_k), torch.empty(x.shape[0], top_k, dtype=torch.int64)
        self.fns[x.dtype](ctypes.byref(args), ptr(x), ctypes.c_int64(x.shape[0]), ptr(weights), ptr(ids),
                          ptr(expert_load), num_threads())
        return weights, ids

    def args(self, dtype: torch.dtype) -> RouterArgs:
        """The kernel's arguments for inputs of this dtype, rebuilt when the gate's float32 copy changes."""
        gate = self.float_gate()
        if getattr(self, "_args_of", (None, None))[0] is not gate:
            self._args_of = gate, {}
        built = self._args_of[1]
        if dtype not in built:
            (weight, bias), c = gate, self.config
            round_bf16 = dtype == torch.bfloat16 and not c.fp32_logits  # as the layer's PyTorch logits
            built[dtype] = RouterArgs(weight.data_ptr(), None if bias is None else bias.data_ptr(), weight.shape[1],
                                      weight.shape[0], c.top_k, KINDS[c.kind], c.renormalize, round_bf16,
                                      c.routed_scaling_factor)
        return built[dtype]
