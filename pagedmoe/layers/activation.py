"""The gated activations of MLPs and experts: act(gate) * up over a [..., 2I] gate_up output."""
import torch
import torch.nn.functional as F
from torch import Tensor

SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    if torch.is_grad_enabled():
        return F.silu(gate) * up
    return F.silu(gate).mul_(up)


def swigluoai_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_LIMIT)
    up = up.clamp(min=-SWIGLU_LIMIT, max=SWIGLU_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_ALPHA))


ACTIVATIONS = {"silu": silu_and_mul, "swigluoai": swigluoai_and_mul}
