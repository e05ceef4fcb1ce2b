"""One MoE layer's routed experts as they lie in the checkpoint: reads expert e's gate/up rows and down
weights into a slot, in the layout FusedMoE computes with (w13 [2I, H], gate rows then up; w2 [H, I])."""
import re

import torch
from torch import Tensor

from pagedmoe.layers.moe.offload.store import ExpertWeightRef

PER_EXPERT = re.compile(r"experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
PROJS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def deinterleaved_t(gate_up: Tensor) -> Tensor:
    """gpt-oss's [H, 2I] with gate and up columns interleaved -> [2I, H], gate rows then up rows."""
    return gate_up.reshape(gate_up.shape[0], -1, 2).permute(2, 1, 0).reshape(-1, gate_up.shape[0])


class ExpertSource:
    def __init__(self, refs: dict[str, ExpertWeightRef], num_experts: int, gpt_oss_layout: bool):
        self.fused = {name: refs[name] for name in ("experts.gate_up_proj", "experts.down_proj") if name in refs}
        self.per_expert = {}
        for name, ref in refs.items():
            if match := PER_EXPERT.fullmatch(name):
                self.per_expert[(int(match[1]), PROJS[match[2]])] = ref
        self.num_experts, self.gpt_oss_layout = num_experts, gpt_oss_layout
        self.check_complete()

    def check_complete(self):
        if len(self.fused) == 2:
            return
        for expert in range(self.num_experts):
            for proj in ("gate", "up", "down"):
                if (expert, proj) not in self.per_expert:
                    raise ValueError(f"expert_cache_memory: the checkpoint has no {proj} weight for expert {expert}")

    def advise(self, expert: int):
        """Starts the page cache reading expert's bytes (readahead prefetch)."""
        if self.fused:
            return [ref.advise(expert) for ref in self.fused.values()]
        for proj in ("gate", "up", "down"):
            self.per_expert[(expert, proj)].advise()

    def load(self, expert: int) -> tuple[Tensor, Tensor]:
        """Expert's w13 [2I, H] and w2 [H, I] as stored (dtype), read from the checkpoint."""
        if self.fused:
            return self.load_fused(expert)
        gate, up, down = (self.per_expert[(expert, proj)] for proj in ("gate", "up", "down"))
        w13 = torch.empty((gate.shape[0] + up.shape[0], *gate.shape[1:]), dtype=gate.dtype)
        gate.read_into(w13[:gate.shape[0]])
        up.read_into(w13[gate.shape[0]:])
        return w13, down.read()

    def load_fused(self, expert: int) -> tuple[Tensor, Tensor]:
        gate_up, down = (self.fused[n].read(expert) for n in ("experts.gate_up_proj", "experts.down_proj"))
        if self.gpt_oss_layout:  # stored [H, 2I] interleaved and [I, H]
            return deinterleaved_t(gate_up), down.t()
        return gate_up, down
