"""Turns a loaded model's MoE layers, whose expert weights came as references (store.py), into offloaded
ones: each gets an expert cache of as many slots as the byte budget allows for every layer alike."""
import torch
from torch import nn

from pagedmoe.layers.moe.offload.cache import ExpertCache
from pagedmoe.layers.moe.offload.policy import POLICIES
from pagedmoe.layers.moe.offload.prefetch import link_prefetch
from pagedmoe.layers.moe.offload.source import ExpertSource


def expert_bytes(layer, dtype: torch.dtype) -> int:
    return (layer.w13[0].numel() + layer.w2[0].numel()) * dtype.itemsize


def num_slots_for(budget: int, layers: list, dtype: torch.dtype) -> int:
    """Slots a layer: the budget split evenly over the MoE layers, at most every expert."""
    per_expert = expert_bytes(layers[0], dtype)
    num_slots = min(budget // (per_expert * len(layers)), layers[0].num_experts)
    if num_slots < 1:
        raise ValueError(f"expert_cache_memory: {budget} bytes cannot hold one expert in each of the "
                         f"{len(layers)} MoE layers; at least {per_expert * len(layers)} are needed")
    return num_slots


def offload_experts(layers: list, budget: int, policy: str, dtype: torch.dtype, prefetch: str = "readahead"):
    """Gives each layer an ExpertCache over its checkpoint references and drops its dense expert weights
    (never written, so never resident); prefetch: "slots", "readahead" or "off" (prefetch.py). Returns the
    prefetch thread pool, or None."""
    if not layers:
        raise ValueError("expert_cache_memory: the model has no MoE layers to offload")
    num_slots = num_slots_for(budget, layers, dtype)
    for layer in layers:
        refs = layer.__dict__.pop("expert_refs", None)
        if not refs:
            raise ValueError("expert_cache_memory: the checkpoint's experts did not load as offloadable weights")
        source = ExpertSource(refs, layer.num_experts, layer.activation == "swigluoai")
        w13 = torch.empty(num_slots, *layer.w13.shape[1:], dtype=dtype, device=layer.w13.device)
        w2 = torch.empty(num_slots, *layer.w2.shape[1:], dtype=dtype, device=layer.w2.device)
        biases = [None if b is None else b.detach().to(dtype) for b in (layer.w13_bias, layer.w2_bias)]
        layer.expert_cache = ExpertCache(source, w13, w2, POLICIES[policy](layer.num_experts), *biases)
        layer.w13 = nn.Parameter(torch.empty(0, device=w13.device), requires_grad=False)
        layer.w2 = nn.Parameter(torch.empty(0, device=w2.device), requires_grad=False)
    return link_prefetch(layers, prefetch) if prefetch != "off" and len(layers) > 1 else None
