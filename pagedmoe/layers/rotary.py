import math

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedmoe.layers import cpu_ops


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with a precomputed cos/sin table, computed exactly as HF does per forward."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos, sin = self.float_tables()
        if cpu_ops.can_rotate(q, positions, cos) and cpu_ops.can_rotate(k, positions, cos):
            return cpu_ops.rotary_(q, positions, cos, sin), cpu_ops.rotary_(k, positions, cos, sin)
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def float_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin in float32 for the CPU kernel. A bf16 model's tables were cast with it: their float32
        copies keep the values HF rotates by (its tables cast to the activations' dtype)."""
        if self.cos.dtype == torch.float32:
            return self.cos, self.sin
        if getattr(self, "_float_of", None) is not self.cos:
            self._float_of, self._float = self.cos, (self.cos.float(), self.sin.float())
        return self._float


class InterleavedRotaryEmbedding(RotaryEmbedding):
    """DeepSeek's RoPE over interleaved pairs (x0, x1), (x2, x3), ...: returns the rotated evens then the rotated
    odds, exactly as HF's apply_rotary_pos_emb_interleave (dot products equal the complex-pair form of V2)."""

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        half = self.cos.shape[-1] // 2
        cos = self.cos[positions, :half].to(q.dtype).unsqueeze(1)
        sin = self.sin[positions, :half].to(q.dtype).unsqueeze(1)
        return rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    evens, odds = x[..., 0::2], x[..., 1::2]
    return torch.cat((evens * cos - odds * sin, odds * cos + evens * sin), dim=-1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(rope_parameters: dict, scale: float) -> float:
    """DeepSeek's yarn correction of the softmax scale: times mscale(factor, mscale_all_dim) twice."""
    mscale_all_dim = rope_parameters.get("mscale_all_dim", 0)
    if rope_parameters.get("rope_type", "default") == "default" or not mscale_all_dim:
        return scale
    mscale = yarn_mscale(rope_parameters["factor"], mscale_all_dim)
    return scale * mscale * mscale
