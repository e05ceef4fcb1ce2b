"""One MoE layer's expert cache: a fixed pool of slots holding at most S of its experts, either plain
(w13 [S, 2I, H], w2 [S, H, I], run one expert at a time) or packed for the CPU fused-MoE kernel (one call for
the resident experts). A step's active experts run resident ones first, then the missing ones in waves of at
most S, each read into a slot the policy frees: every missing expert is read once a step, however many tokens
chose it."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedmoe.layers.moe.cpu_kernel import CpuFusedMoE
from pagedmoe.layers.moe.fused_moe import bias_of, expert_loop
from pagedmoe.layers.moe.offload.source import ExpertSource
from pagedmoe.layers.moe.weight_utils import copy_weight


@dataclass
class ExpertCacheCounters:
    hits: int = 0  # (step, active expert) pairs found resident
    misses: int = 0  # ... read from the checkpoint
    bytes_loaded: int = 0  # every read: on demand and ahead
    prefetch_loads: int = 0  # experts read ahead of their layer
    prefetch_predicted: int = 0  # experts the previous layer's prediction named
    prefetch_correct: int = 0  # ... and the step then used


class ExpertCache:
    predict_next = None  # reads the next layer's predicted experts ahead (prefetch.py), or None
    kernel: CpuFusedMoE | None = None  # the slots packed for the CPU fused-MoE kernel, or None

    def __init__(self, source: ExpertSource, w13: Tensor, w2: Tensor, policy, w13_bias=None, w2_bias=None):
        self.source, self.w13, self.w2, self.policy = source, w13, w2, policy
        self.w13_bias, self.w2_bias = w13_bias, w2_bias  # every expert's, resident (small)
        self.num_slots = w13.shape[0]
        self.expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
        self.counters = ExpertCacheCounters()
        self.slot_of: dict[int, int] = {}  # resident expert -> its slot
        self.predicted: set[int] = set()
        self.pending = None  # the read-ahead in flight (a Future), joined before the layer runs

    @property
    def resident_bytes(self) -> int:
        return self.num_slots * self.expert_bytes

    def use_cpu_kernel(self, activation: str) -> bool:
        """Packs the slots for the CPU fused-MoE kernel (dropping the plain ones); False where it cannot run."""
        biases = [None if b is None else b.new_zeros(self.num_slots, b.shape[1]) for b in (self.w13_bias, self.w2_bias)]
        try:
            self.kernel = CpuFusedMoE(self.w13, self.w2, activation=activation, w13_bias=biases[0], w2_bias=biases[1])
        except (ValueError, RuntimeError):
            return False
        self.w13 = self.w2 = None
        return True

    def slot_for(self, expert: int, keep=frozenset()) -> int | None:
        """The slot holding expert, read into a free slot or the policy's victim outside keep; None when every
        slot holds an expert of keep."""
        if expert in self.slot_of:
            return self.slot_of[expert]
        free = sorted(set(range(self.num_slots)) - set(self.slot_of.values()))
        if not free:
            candidates = [e for e in self.slot_of if e not in keep]
            if not candidates:
                return None
            free = [self.slot_of.pop(self.policy.victim(candidates))]
        self.fill(free[0], expert)
        self.slot_of[expert] = free[0]
        self.counters.bytes_loaded += self.expert_bytes
        return free[0]

    def fill(self, slot: int, expert: int):
        w13, w2 = self.source.load(expert)
        if self.kernel is not None:
            return self.kernel.set_expert(slot, w13, w2, bias_of(self.w13_bias, expert), bias_of(self.w2_bias, expert))
        copy_weight(self.w13[slot], w13, f"expert {expert} gate/up weights")
        copy_weight(self.w2[slot], w2, f"expert {expert} down weights")

    def forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act) -> Tensor:
        """The routed experts' float32 output, as all experts resident would give it."""
        self.wait()
        if self.predict_next is not None:
            self.predict_next(x)
        if self.kernel is not None and x.dtype == self.kernel.w13.dtype:
            return self.kernel_forward(x, topk_weights, topk_ids)
        if self.kernel is not None:
            raise ValueError(f"x must be {self.kernel.w13.dtype} for the offloaded experts, got {x.dtype}")
        return expert_loop(x, topk_weights, topk_ids, self.source.num_experts, self.looped_expert(act),
                           self.resident_first)

    def looped_expert(self, act):
        def run_expert(expert: int, rows: Tensor) -> Tensor:
            slot = self.slot_for(expert)
            self.policy.touch(expert)
            hidden = act(F.linear(rows, self.w13[slot], bias_of(self.w13_bias, expert)))
            return F.linear(hidden, self.w2[slot], bias_of(self.w2_bias, expert))
        return run_expert

    def kernel_forward(self, x: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32)
        for wave in self.waves(self.resident_first(torch.unique(topk_ids).tolist())):
            lookup = torch.full((self.source.num_experts,), -1, dtype=torch.int64)
            lookup[wave] = torch.tensor([self.slot_of[e] for e in wave])
            out += self.kernel_rows(x, topk_weights, lookup[topk_ids])
        return out

    def waves(self, experts: list[int]):
        """experts (resident first) in groups of at most num_slots, each made resident before it is yielded."""
        for start in range(0, len(experts), self.num_slots):
            wave = experts[start:start + self.num_slots]
            for expert in wave:
                self.slot_for(expert, set(wave))
                self.policy.touch(expert)
            yield wave

    def kernel_rows(self, x: Tensor, topk_weights: Tensor, slot_ids: Tensor) -> Tensor:
        """The kernel over every token, in row chunks it takes where the batch is too large for one call."""
        if self.kernel.fits(x, slot_ids):
            return self.kernel(x, topk_weights, slot_ids)
        rows = max(self.kernel.max_pairs // slot_ids.shape[1], 1)
        return torch.cat([self.kernel(x[i:i + rows], topk_weights[i:i + rows], slot_ids[i:i + rows])
                          for i in range(0, x.shape[0], rows)])

    def resident_first(self, active: list[int]) -> list[int]:
        resident = [e for e in active if e in self.slot_of]
        self.counters.hits += len(resident)
        self.counters.misses += len(active) - len(resident)
        self.counters.prefetch_correct += len(self.predicted.intersection(active))
        self.predicted = set()
        return resident + [e for e in active if e not in self.slot_of]

    def wait(self):
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def load_ahead(self, experts: list[int]):
        """Reads predicted experts not resident into slots not holding another predicted one (background)."""
        keep = set(experts)
        for expert in experts:
            if expert not in self.slot_of:
                if self.slot_for(expert, keep) is None:
                    return
                self.counters.prefetch_loads += 1
