"""Routed expert computation: group assignments by expert, run the expert MLPs
over contiguous slices (one grouped matmul, or a loop over active experts),
then weight by the router and sum each token's top-k outputs."""
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedmoe.layers.linear import packed_linear

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


def expert_counts(topk_ids: Tensor, num_experts: int) -> Tensor:
    return torch.bincount(topk_ids.flatten(), minlength=num_experts)


def grouped_mm_supported(x: Tensor, w13: Tensor, w2: Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad):
        return False
    if x.device.type == "cpu":
        return True
    aligned = w13.shape[-1] % 8 == 0 and w2.shape[-1] % 8 == 0
    return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)


def grouped_linear(x_sorted: Tensor, weight: Tensor, counts: Tensor) -> Tensor:
    offsets = counts.cumsum(0).to(torch.int32)
    return torch._grouped_mm(x_sorted, weight.transpose(1, 2), offs=offsets)


def looped_linear(x_sorted: Tensor, weights: Tensor | list[Tensor], counts: Tensor, linear=F.linear) -> Tensor:
    """One `linear` per active expert over its contiguous slice; weights [E, out, in] or E pre-packed copies."""
    out = x_sorted.new_empty(x_sorted.shape[0], weights[0].shape[0])
    ends = counts.cumsum(0).tolist()
    for expert, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        if end > start:
            out[start:end] = linear(x_sorted[start:end], weights[expert])
    return out


def expert_linear(x_sorted: Tensor, weight: Tensor | list[Tensor], counts: Tensor, bias: Tensor | None,
                  sorted_ids: Tensor, use_grouped_mm: bool) -> Tensor:
    if isinstance(weight, list):
        out = looped_linear(x_sorted, weight, counts, packed_linear)
    else:
        out = (grouped_linear if use_grouped_mm else looped_linear)(x_sorted, weight, counts)
    return out if bias is None else out + bias[sorted_ids]


def combine(out_sorted: Tensor, order: Tensor, topk_weights: Tensor) -> Tensor:
    out = torch.empty_like(out_sorted).index_copy_(0, order, out_sorted)
    out = out.view(*topk_weights.shape, out_sorted.shape[-1]).float()
    return (out * topk_weights.float().unsqueeze(-1)).sum(dim=1)


def fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  activation: str = "silu", w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
                  use_grouped_mm: bool | None = None, packed: tuple[list, list] | None = None) -> Tensor:
    """packed: per-expert pre-packed (w13, w2) copies (FusedMoE.pack); used instead of w13 / w2 when given."""
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x, w13, w2)
    top_k = topk_ids.shape[1]
    counts = expert_counts(topk_ids, w13.shape[0])
    if packed is not None:
        w13, w2 = packed
    sorted_ids, order = torch.sort(topk_ids.flatten(), stable=True)
    x_sorted = x[order // top_k]
    hidden = expert_linear(x_sorted, w13, counts, w13_bias, sorted_ids, use_grouped_mm)
    hidden = ACTIVATIONS[activation](hidden)
    out_sorted = expert_linear(hidden, w2, counts, w2_bias, sorted_ids, use_grouped_mm)
    return combine(out_sorted, order, topk_weights).to(x.dtype)
