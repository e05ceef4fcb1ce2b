"""Prefetch: layer L's input hidden states through layer L+1's router name the experts L+1 will most likely
run (Mixtral-offloading's speculative prefetch). Mode "slots": those not resident are read into L+1's slots on
a background thread while layer L computes, and L+1 joins the read before it runs. Mode "readahead": the page
cache is asked to read their bytes from disk (posix_fadvise WILLNEED), and the slots are left to the policy:
on a CPU whose cores all compute, a thread filling slots slows every parallel op, and wrong guesses evict
experts the policy would have kept."""
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor


MODES = ("auto", "slots", "readahead", "off")


class NextLayerPrefetch:
    """pool: the thread that fills slots (mode "slots"), or None (mode "readahead")."""

    def __init__(self, next_layer, pool: ThreadPoolExecutor | None):
        self.next_layer, self.pool = next_layer, pool

    def __call__(self, x: Tensor):
        cache = self.next_layer.expert_cache
        experts = predicted_experts(self.next_layer.select(x)[1], self.next_layer.num_experts, cache.num_slots)
        cache.wait()
        cache.predicted = set(experts)
        cache.counters.prefetch_predicted += len(experts)
        if self.pool is not None:
            cache.pending = self.pool.submit(cache.load_ahead, experts)
            return
        for expert in experts:
            if expert not in cache.slot_of:
                cache.source.advise(expert)


def predicted_experts(topk_ids: Tensor, num_experts: int, limit: int) -> list[int]:
    """The experts the routing picks, most tokens first, at most limit of them."""
    counts = torch.bincount(topk_ids.flatten(), minlength=num_experts)
    ranked = torch.argsort(counts, descending=True, stable=True)[:limit]
    return [e for e in ranked.tolist() if counts[e] > 0]


def link_prefetch(layers: list, mode: str) -> ThreadPoolExecutor | None:
    """Each offloaded MoE layer predicts the next one's experts; in mode "slots" one background thread reads
    for all (returned)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="expert-prefetch") if mode == "slots" else None
    for layer, next_layer in zip(layers, layers[1:]):
        layer.expert_cache.predict_next = NextLayerPrefetch(next_layer, pool)
    return pool
