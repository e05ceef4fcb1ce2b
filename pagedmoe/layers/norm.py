import torch
from torch import nn

from pagedmoe.layers import cpu_ops


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale (the order matters for exactness)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := cpu_ops.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
