"""FusedMoE: router gate + routed experts (w13 [E, 2I, H], w2 [E, H, I]) + optional shared expert."""
import logging
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedmoe.layers.linear import can_pack, nbytes, pack_weight
from pagedmoe.layers.moe.cpu_kernel import KERNEL_ACTIVATIONS, CpuFusedMoE, load_library, unsupported_reason
from pagedmoe.layers.moe.cpu_router import CpuRouter
from pagedmoe.layers.moe.cpu_router import unsupported_reason as router_unsupported_reason
from pagedmoe.layers.moe.fused_moe import ACTIVATIONS, expert_counts, fused_experts, looped_experts
from pagedmoe.layers.moe.offload.store import ExpertWeightRef
from pagedmoe.layers.moe.routers import RouterConfig, select_experts
from pagedmoe.layers.moe.shared_expert import SharedExpert
from pagedmoe.layers.moe.weight_utils import copy_weight
from pagedmoe.layers.quantization.fp4_kernel import Fp4MoE, PackedFp4Weight, stacked, unstacked
from pagedmoe.layers.quantization import fp4_linear

PER_EXPERT_NAME = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
GATE_PROJS, UP_PROJS = ("w1", "gate_proj"), ("w3", "up_proj")
FUSED_NAMES = {"experts.gate_up_proj": "w13", "experts.down_proj": "w2",
               "experts.gate_up_proj_bias": "w13_bias", "experts.down_proj_bias": "w2_bias"}
logger = logging.getLogger(__name__)
ALIASES = {"router.weight": "gate.weight", "router.bias": "gate.bias",
           "gate.e_score_correction_bias": "e_score_correction_bias"}


def deinterleave(gate_up: Tensor) -> Tensor:
    return torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)


def from_gpt_oss_layout(name: str, tensor: Tensor) -> Tensor:
    if name == "experts.gate_up_proj":
        return deinterleave(tensor).transpose(1, 2)
    if name == "experts.gate_up_proj_bias":
        return deinterleave(tensor)
    if name == "experts.down_proj":
        return tensor.transpose(1, 2)
    return tensor


def deinterleave_index(rows: int) -> Tensor:
    return torch.cat([torch.arange(0, rows, 2), torch.arange(1, rows, 2)])


def find_part(parts: dict, expert: int, names: tuple[str, ...]) -> PackedFp4Weight | None:
    return next((parts[(expert, n)] for n in names if (expert, n) in parts), None)


def join_gate_up(gate: PackedFp4Weight | None, up: PackedFp4Weight | None) -> PackedFp4Weight | None:
    return None if gate is None or up is None else PackedFp4Weight.cat([gate, up])


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, router: RouterConfig,
                 activation: str = "silu", expert_bias: bool = False, gate_bias: bool = False,
                 shared_intermediate_size: int = 0, shared_expert_gate: bool = False, **factory):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.router, self.activation = router, activation
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.w13_bias = self.w2_bias = None
        if expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, **factory))
            self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        self.gate = nn.Linear(hidden_size, num_experts, bias=gate_bias, **factory)
        self.e_score_correction_bias = (
            nn.Buffer(torch.zeros(num_experts, dtype=torch.float32, device=factory.get("device")))
            if router.has_correction_bias else None)
        self.shared_experts = (SharedExpert(hidden_size, shared_intermediate_size, **factory)
                               if shared_intermediate_size else None)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, **factory) if shared_expert_gate else None

    packed_experts: tuple[list[Tensor], list[Tensor]] | None = None
    expert_map = None  # expert parallel: this rank's slots and the routing of pairs to them (distributed/)
    token_exchange = None  # data-parallel attention: every rank's tokens in, this rank's rows out
    fp4_experts: tuple[list[PackedFp4Weight], list[PackedFp4Weight]] | None = None  # 4-bit, from the checkpoint
    expert_cache = None  # offloaded experts: a pool of slots filled from the checkpoint (offload/)

    triton_experts = None  # the Triton fused-MoE kernels (triton_moe.py), where the moe backend is "triton"

    def use_triton(self):
        from pagedmoe.layers.moe.triton_moe import triton_fused_experts
        self.triton_experts = triton_fused_experts

    def pack(self, min_bytes: int = 0):
        if self.fp4_experts is not None or self.expert_cache is not None or self.triton_experts is not None:
            return
        if can_pack(self.w13[0]) and can_pack(self.w2[0]) and nbytes(self.w2[0]) >= min_bytes:
            self.packed_experts = ([pack_weight(w) for w in self.w13], [pack_weight(w) for w in self.w2])

    cpu_experts: CpuFusedMoE | None = None
    cpu_kernel_kind = "moe"

    cpu_router: CpuRouter | None = None

    def use_cpu_router(self) -> bool:
        """Routes decode-sized batches in one C++ call (cpu_router.py); False where it does not apply."""
        if self.gate.weight.device.type != "cpu" or router_unsupported_reason(self.router):
            return False
        try:
            self.cpu_router = CpuRouter(self.router, self.float_gate)
        except RuntimeError as error:
            logger.warning("the MoE router falls back to PyTorch: %s", error)
            return False
        return True

    def use_cpu_kernel(self, min_bytes: int = 0) -> bool:
        """Runs decode-sized batches through the CPU fused-MoE kernel, and larger ones through the unpacked
        expert loop (as fast as oneDNN's packed copies there), so the weights are held twice, not three times.
        False where the kernel does not apply (activation, biases, shapes). The router takes its kernel too."""
        self.use_cpu_router()
        if self.expert_cache is not None:
            return self.expert_cache.use_cpu_kernel(self.activation)
        if self.fp4_experts is not None:
            return False
        panel = load_library().fused_moe_panel()
        if self.activation not in KERNEL_ACTIVATIONS or unsupported_reason(self.w13, self.w2, panel):
            return False
        if nbytes(self.w2[0]) < min_bytes:
            return False
        self.cpu_experts = CpuFusedMoE(self.w13, self.w2, activation=self.activation, w13_bias=self.w13_bias,
                                       w2_bias=self.w2_bias)
        self.packed_experts = None
        return True

    def on_cpu_kernels_only(self) -> bool:
        """Routed experts alone on the CPU router and fused-MoE kernel, as routed_output picks them: no shared
        experts, expert or data parallelism, offloading, 4-bit or Triton experts."""
        if self.cpu_router is None or self.cpu_experts is None:
            return False
        return all(getattr(self, name) is None for name in (
            "shared_experts", "expert_map", "token_exchange", "expert_cache", "fp4_experts", "triton_experts"))

    def routed_output(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        if self.expert_cache is not None:
            return self.expert_cache.forward(x, topk_weights, topk_ids, ACTIVATIONS[self.activation]).to(x.dtype)
        if self.triton_experts is not None and self.fp4_experts is None:
            return self.triton_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.activation,
                                       self.w13_bias, self.w2_bias).to(x.dtype)
        if self.fp4_moe is not None and topk_ids.numel() <= fp4_linear.MAX_DOT_ROWS * self.num_experts:
            return self.fp4_moe(x, topk_weights, topk_ids).to(x.dtype)
        if self.fp4_experts is not None:
            return looped_experts(x, *self.fp4_experts, topk_weights, topk_ids, ACTIVATIONS[self.activation],
                                  self.w13_bias, self.w2_bias, fp4_linear.fp4_linear).to(x.dtype)
        if self.cpu_experts is not None:
            if self.cpu_experts.fits(x, topk_ids):
                return self.cpu_experts(x, topk_weights, topk_ids).to(x.dtype)
            return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.activation, self.w13_bias,
                                 self.w2_bias, use_grouped_mm=False)
        return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.activation,
                             self.w13_bias, self.w2_bias, packed=self.packed_experts)

    def router_logits(self, x: Tensor) -> Tensor:
        if self.router.fp32_logits:
            return F.linear(x.float(), *self.float_gate())
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # float32 sums rounded to bf16, as oneDNN's bf16 GEMM computes them, without its ~25 us a call at
            # router sizes (gpt-oss's 576 x 16: 24.5 us against 5.9)
            return F.linear(x.float(), *self.float_gate()).to(x.dtype)
        return self.gate(x)

    def float_gate(self) -> tuple[Tensor, Tensor | None]:
        """The router's weight and bias in float32, converted once per version of the weight."""
        weight, bias = self.gate.weight, self.gate.bias
        key = (weight.data_ptr(), weight._version, None if bias is None else bias._version)
        if getattr(self, "_float_gate_key", None) != key:
            self._float_gate = (weight.detach().float(), None if bias is None else bias.detach().float())
            self._float_gate_key = key
        return self._float_gate

    def route(self, x: Tensor, expert_load: Tensor | None) -> tuple[Tensor, Tensor]:
        """select(x), with the routed-token counts added to expert_load ([experts] int64) where given."""
        countable = expert_load is None or expert_load.dtype == torch.int64 and expert_load.is_contiguous()
        if self.cpu_router is not None and countable and self.cpu_router.fits(x):
            return self.cpu_router(x, expert_load)
        topk_weights, topk_ids = self.select(x)
        if expert_load is not None:
            expert_load += expert_counts(topk_ids, self.num_experts)
        return topk_weights, topk_ids

    def select(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's top-k experts and their weights."""
        return select_experts(self.router, self.router_logits(x), self.e_score_correction_bias)

    def shared_output(self, x: Tensor) -> Tensor:
        out = self.shared_experts(x)
        return out if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * out

    def forward(self, x: Tensor, expert_load: Tensor | None = None) -> Tensor:
        own = x
        if self.token_exchange is not None:
            x = self.token_exchange.gather(x)
        topk_weights, topk_ids = self.route(x, expert_load)
        if self.expert_map is not None:
            topk_ids = self.expert_map.local_ids(topk_ids)
        out = self.routed_output(x, topk_weights, topk_ids)
        if self.token_exchange is not None:
            out = self.token_exchange.combine(out)
        return out if self.shared_experts is None else out + self.shared_output(own)

    def expert_shard(self, expert: int, proj: str) -> Tensor:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range for {self.num_experts} experts")
        if proj in GATE_PROJS:
            return self.w13[expert, :self.intermediate_size]
        if proj in UP_PROJS:
            return self.w13[expert, self.intermediate_size:]
        return self.w2[expert]

    def load_weight(self, name: str, tensor: Tensor) -> bool:
        """Load one checkpoint tensor named relative to the MoE block; False if the name is unknown."""
        if isinstance(tensor, (PackedFp4Weight, list)):
            return self.load_fp4(name, tensor)
        if isinstance(tensor, ExpertWeightRef):  # offloaded: read into the expert cache's slots on demand
            self.__dict__.setdefault("expert_refs", {})[name] = tensor
            return True
        if match := PER_EXPERT_NAME.fullmatch(name):
            copy_weight(self.expert_shard(int(match[1]), match[2]), tensor, name)
            return True
        if name in FUSED_NAMES:
            if self.activation == "swigluoai":
                tensor = from_gpt_oss_layout(name, tensor)
            name = FUSED_NAMES[name]
        name = ALIASES.get(name, name).replace("shared_expert.", "shared_experts.")
        if name.startswith("shared_experts.") and self.shared_experts is not None:
            return self.shared_experts.load_weight(name.removeprefix("shared_experts."), tensor)
        return self.load_own(name, tensor)

    def load_fp4(self, name: str, weight: PackedFp4Weight | list[PackedFp4Weight]) -> bool:
        """4-bit experts: gpt-oss's fused ones (a list, gate and up rows interleaved), or one expert's
        projection at a time; the experts switch to them once every projection has loaded."""
        parts = self.__dict__.setdefault("fp4_parts", {})
        if name in ("experts.gate_up_proj", "experts.down_proj"):
            if self.activation == "swigluoai" and name == "experts.gate_up_proj":
                weight = [w.rows(deinterleave_index(w.shape[0])) for w in weight]
            parts.update({(e, "w13" if "gate_up" in name else "w2"): w for e, w in enumerate(weight)})
        elif match := PER_EXPERT_NAME.fullmatch(name):
            parts[(int(match[1]), match[2])] = weight
        else:
            return False
        self.set_fp4_if_complete(parts)
        return True

    def set_fp4_if_complete(self, parts: dict):
        w13, w2 = [], []
        for e in range(self.num_experts):
            gate, up = find_part(parts, e, GATE_PROJS), find_part(parts, e, UP_PROJS)
            gate_up = parts.get((e, "w13")) or join_gate_up(gate, up)
            down = parts.get((e, "w2")) or find_part(parts, e, ("w2", "down_proj"))
            if gate_up is None or down is None:
                return
            w13.append(gate_up)
            w2.append(down)
        expected = (tuple(self.w13.shape[1:]), tuple(self.w2.shape[1:]))
        if (w13[0].shape, w2[0].shape) != expected:
            raise ValueError(f"4-bit experts of shapes {w13[0].shape} and {w2[0].shape}, expected {expected}")
        self.set_fp4_experts(stacked(w13), stacked(w2))
        self.fp4_parts = {}
        self.w13 = nn.Parameter(torch.empty(0, device=self.w13.device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, device=self.w2.device), requires_grad=False)

    fp4_moe: Fp4MoE | None = None

    def set_fp4_experts(self, w13: PackedFp4Weight, w2: PackedFp4Weight):
        """The experts on 4-bit weights: one kernel call for decode-sized batches (Fp4MoE), an expert loop
        over views of the same tensors past that, or where the kernel cannot run."""
        self.fp4_experts = (unstacked(w13), unstacked(w2))
        try:
            self.fp4_moe = Fp4MoE(w13, w2, self.activation, self.w13_bias, self.w2_bias)
        except (RuntimeError, ValueError) as error:
            logger.warning("4-bit experts run one expert at a time: %s", error)

    def load_own(self, name: str, tensor: Tensor) -> bool:
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        if name not in params:
            return False
        copy_weight(params[name], tensor, name)
        return True
