"""Dense SiLU-gated MLP with a fused gate_up projection (the always-on shared expert)."""
from torch import Tensor, nn

from pagedmoe.layers.linear import GateUpLinear, Linear
from pagedmoe.layers.moe.weight_utils import copy_weight

GATE_UP_SHARDS = {"gate_proj.weight": 0, "up_proj.weight": 1}


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, **factory):
        super().__init__()
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size, **factory)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.gate_up_proj(x))

    def load_weight(self, name: str, tensor: Tensor) -> bool:
        if name in GATE_UP_SHARDS:
            shard = self.gate_up_proj.weight.chunk(2, dim=0)[GATE_UP_SHARDS[name]]
            copy_weight(shard, tensor, name)
        elif name in ("down_proj.weight", "gate_up_proj.weight"):
            copy_weight(self.get_parameter(name), tensor, name)
        else:
            return False
        return True
