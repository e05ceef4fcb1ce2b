"""Top-k expert selection. Each router maps router_logits [T, E] to
(topk_weights [T, k] float32, topk_ids [T, k] int64), sorted by selection score.
Ties are broken exactly as torch.topk breaks them on the same float32 scores."""
from dataclasses import dataclass

import torch
from torch import Tensor


def normalize(topk_weights: Tensor) -> Tensor:
    return topk_weights / topk_weights.sum(dim=-1, keepdim=True)


def softmax_topk(router_logits: Tensor, top_k: int, renormalize: bool,
                 routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = normalize(topk_weights)
    return topk_weights * routed_scaling_factor, topk_ids


def group_mask(group_scores: Tensor, topk_group: int, num_experts: int) -> Tensor:
    num_tokens, num_groups = group_scores.shape
    group_ids = torch.topk(group_scores, topk_group, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    return keep.unsqueeze(-1).expand(num_tokens, num_groups, num_experts // num_groups).reshape(num_tokens, -1)


def grouped_scores(scores: Tensor, n_group: int) -> Tensor:
    return scores.view(scores.shape[0], n_group, -1)


def softmax_group_topk(router_logits: Tensor, top_k: int, n_group: int, topk_group: int,
                       routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    group_scores = grouped_scores(probs, n_group).amax(dim=-1)
    probs = probs.masked_fill(~group_mask(group_scores, topk_group, probs.shape[-1]), 0.0)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    return topk_weights * routed_scaling_factor, topk_ids


def sigmoid_group_topk(router_logits: Tensor, top_k: int, n_group: int, topk_group: int,
                       correction_bias: Tensor | None, renormalize: bool,
                       routed_scaling_factor: float = 1.0) -> tuple[Tensor, Tensor]:
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    group_scores = torch.topk(grouped_scores(choice, n_group), 2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~group_mask(group_scores, topk_group, choice.shape[-1]), float("-inf"))
    topk_ids = torch.topk(choice, top_k, dim=-1)[1]
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


def topk_softmax(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    topk_logits, topk_ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(topk_logits, dim=-1), topk_ids


ROUTER_KINDS = ("softmax", "softmax_group", "sigmoid_group", "topk_softmax")


@dataclass(frozen=True)
class RouterConfig:
    kind: str = "softmax"
    top_k: int = 2
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False
    fp32_logits: bool = False

    def __post_init__(self):
        if self.kind not in ROUTER_KINDS:
            raise ValueError(f"unknown router kind {self.kind!r}, expected one of {ROUTER_KINDS}")


def select_experts(config: RouterConfig, router_logits: Tensor,
                   correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    c = config
    if c.kind == "softmax":
        return softmax_topk(router_logits, c.top_k, c.renormalize, c.routed_scaling_factor)
    if c.kind == "softmax_group":
        return softmax_group_topk(router_logits, c.top_k, c.n_group, c.topk_group, c.routed_scaling_factor)
    if c.kind == "sigmoid_group":
        return sigmoid_group_topk(router_logits, c.top_k, c.n_group, c.topk_group, correction_bias,
                                  c.renormalize, c.routed_scaling_factor)
    return topk_softmax(router_logits, c.top_k)
