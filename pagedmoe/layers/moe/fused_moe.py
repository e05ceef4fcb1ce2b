"""Routed expert computation: each active expert runs its MLP over the tokens routed to it, either in
a loop over experts (CPU, training) or as two grouped matmuls over the tokens sorted by expert; the outputs
are weighted by the router and summed per token in float32."""
import torch
import torch.nn.functional as F
from torch import Tensor

from pagedmoe.layers.activation import ACTIVATIONS, silu_and_mul, swigluoai_and_mul  # noqa: F401 (re-exported)
from pagedmoe.layers.linear import packed_linear

def expert_counts(topk_ids: Tensor, num_experts: int) -> Tensor:
    return torch.bincount(topk_ids.flatten(), minlength=num_experts)


def routed_order(topk_ids: Tensor) -> Tensor:
    """The (token, slot) pairs sorted by expert, pairs of id -1 (expert parallel: elsewhere) left out."""
    ids = topk_ids.flatten()
    order = torch.argsort(ids, stable=True)
    return order[int((ids < 0).sum()):]


def grouped_mm_supported(x: Tensor, w13: Tensor, w2: Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or w13.requires_grad or w2.requires_grad):
        return False
    if x.device.type == "cpu":
        return True
    aligned = w13.shape[-1] % 8 == 0 and w2.shape[-1] % 8 == 0
    return aligned and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (8, 0)


def grouped_linear(x_sorted: Tensor, weight: Tensor, counts: Tensor, bias: Tensor | None,
                   sorted_ids: Tensor) -> Tensor:
    offsets = counts.cumsum(0).to(torch.int32)
    out = torch._grouped_mm(x_sorted, weight.transpose(1, 2), offs=offsets)
    return out if bias is None else out + bias[sorted_ids]


def combine(out_sorted: Tensor, order: Tensor, topk_weights: Tensor) -> Tensor:
    shape = (topk_weights.numel(), out_sorted.shape[-1])
    out = out_sorted.new_empty(shape) if len(order) == shape[0] else out_sorted.new_zeros(shape)
    out = out.index_copy_(0, order, out_sorted)
    out = out.view(*topk_weights.shape, out_sorted.shape[-1]).float()
    return (out * topk_weights.float().unsqueeze(-1)).sum(dim=1)


def grouped_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                    act, w13_bias: Tensor | None, w2_bias: Tensor | None) -> Tensor:
    """All experts in two grouped matmuls over the token copies sorted by expert (CUDA, and CPU unpacked)."""
    order = routed_order(topk_ids)
    sorted_ids = topk_ids.flatten()[order]
    counts = torch.bincount(sorted_ids, minlength=w13.shape[0])
    hidden = act(grouped_linear(x[order // topk_ids.shape[1]], w13, counts, w13_bias, sorted_ids))
    out_sorted = grouped_linear(hidden, w2, counts, w2_bias, sorted_ids)
    return combine(out_sorted, order, topk_weights)


def scale_rows(x: Tensor, weights: Tensor) -> Tensor:
    return x * weights if torch.is_grad_enabled() else x.mul_(weights)


def bias_of(bias: Tensor | None, expert: int) -> Tensor | None:
    return None if bias is None else bias[expert]


def looped_experts(x: Tensor, w13: Tensor | list[Tensor], w2: Tensor | list[Tensor], topk_weights: Tensor,
                   topk_ids: Tensor, act, w13_bias: Tensor | None, w2_bias: Tensor | None,
                   linear=F.linear) -> Tensor:
    """One MLP call per active expert (expert_loop)."""
    def run_expert(expert: int, rows: Tensor) -> Tensor:
        hidden = act(linear(rows, w13[expert], bias_of(w13_bias, expert)))
        return linear(hidden, w2[expert], bias_of(w2_bias, expert))
    return expert_loop(x, topk_weights, topk_ids, len(w13), run_expert)


def expert_loop(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, num_experts: int, run_expert,
                expert_order=sorted) -> Tensor:
    """run_expert(expert, rows) over each active expert's contiguous slice of the token copies sorted by
    expert, the experts in expert_order(active experts), then one router-weighted index_add_ of all rows
    into a float32 output (so the order never changes the result)."""
    order = routed_order(topk_ids)
    token_ids = order // topk_ids.shape[1]
    x_sorted = x.index_select(0, token_ids)
    out_sorted = x.new_empty(x_sorted.shape)
    ends = torch.bincount(topk_ids.flatten()[order], minlength=num_experts).cumsum(0).tolist()
    spans = {e: (start, end) for e, (start, end) in enumerate(zip([0] + ends[:-1], ends)) if end > start}
    for expert in expert_order(list(spans)):
        start, end = spans[expert]
        out_sorted[start:end] = run_expert(expert, x_sorted[start:end])
    weights = topk_weights.flatten()[order].float().unsqueeze(-1)
    out = x.new_zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    return out.index_add_(0, token_ids, scale_rows(out_sorted.float(), weights))


def fused_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                  activation: str = "silu", w13_bias: Tensor | None = None, w2_bias: Tensor | None = None,
                  use_grouped_mm: bool | None = None, packed: tuple[list, list] | None = None) -> Tensor:
    """packed: per-expert pre-packed (w13, w2) copies (FusedMoE.pack); used instead of w13 / w2 when given."""
    act = ACTIVATIONS[activation]
    if packed is not None:
        out = looped_experts(x, *packed, topk_weights, topk_ids, act, w13_bias, w2_bias, packed_linear)
    elif use_grouped_mm if use_grouped_mm is not None else grouped_mm_supported(x, w13, w2):
        out = grouped_experts(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias)
    else:
        out = looped_experts(x, w13, w2, topk_weights, topk_ids, act, w13_bias, w2_bias)
    return out.to(x.dtype)
