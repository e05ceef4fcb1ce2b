"""The expert cache (layers/moe/offload) against hand-computed hits of LRU and LFU on a small routing trace,
its outputs equal to all experts resident, a replay of the bundled model's recorded routing through an
independent LRU model, and the next-layer prefetch predictor's accuracy on that routing."""
import os

import pytest
import torch
from safetensors.torch import save_file

from pagedmoe import LLM, SamplingParams
from pagedmoe.layers.moe.fused_moe import looped_experts, silu_and_mul
from pagedmoe.layers.moe.offload.cache import ExpertCache
from pagedmoe.layers.moe.offload.policy import POLICIES
from pagedmoe.layers.moe.offload.source import ExpertSource
from pagedmoe.layers.moe.offload.store import expert_refs

BUNDLED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "models", "pagedmoe-moe-default")
HIDDEN, INTER, NUM_EXPERTS = 32, 16, 3
TRACE = [0, 0, 0, 1, 2, 1, 2, 0]  # one token a step, routed to one expert
# 2 slots. LRU: miss 0, hit, hit, miss 1, miss 2 (evicts 0), hit 1, hit 2, miss 0 -> 4 hits.
# LFU: 0 used three times stays; 1 and 2 evict each other: miss 0, hit, hit, miss 1, miss 2, miss 1, miss 2, hit 0.
EXPECTED_HITS = {"lru": 4, "lfu": 3}


def write_experts(path) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    w13, w2 = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN), torch.randn(NUM_EXPERTS, HIDDEN, INTER)
    tensors = {}
    for e in range(NUM_EXPERTS):
        tensors[f"experts.{e}.gate_proj.weight"] = w13[e, :INTER].bfloat16()
        tensors[f"experts.{e}.up_proj.weight"] = w13[e, INTER:].bfloat16()
        tensors[f"experts.{e}.down_proj.weight"] = w2[e].bfloat16()
    save_file(tensors, path)
    return w13.bfloat16().float(), w2.bfloat16().float()


@pytest.mark.parametrize("kernel", [False, True], ids=["plain-slots", "kernel-slots"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policies_on_a_hand_computed_trace(tmp_path, policy, kernel):
    path = str(tmp_path / "experts.safetensors")
    w13, w2 = write_experts(path)
    source = ExpertSource(expert_refs(path), NUM_EXPERTS, gpt_oss_layout=False)
    cache = ExpertCache(source, torch.empty(2, 2 * INTER, HIDDEN), torch.empty(2, HIDDEN, INTER),
                        POLICIES[policy](NUM_EXPERTS))
    if kernel:
        assert cache.use_cpu_kernel("silu")
    x, weights = torch.randn(1, HIDDEN), torch.ones(1, 1)
    for expert in TRACE:
        ids = torch.tensor([[expert]])
        want = looped_experts(x, w13, w2, weights, ids, silu_and_mul, None, None)
        torch.testing.assert_close(cache.forward(x, weights, ids, silu_and_mul), want, rtol=1e-5, atol=1e-5)
    assert cache.counters.hits == EXPECTED_HITS[policy]
    assert cache.counters.misses == len(TRACE) - EXPECTED_HITS[policy]
    assert cache.counters.bytes_loaded == cache.counters.misses * cache.expert_bytes


def lru_hits(trace: list[list[int]], num_slots: int) -> int:
    """An independent LRU model: each step's active experts, resident ones first, missing ones evicting the
    least recently used."""
    resident, hits = [], 0  # least recently used first
    for active in trace:
        hits += sum(e in resident for e in active)
        for expert in sorted(active, key=lambda e: e not in resident):
            if expert in resident:
                resident.remove(expert)
            elif len(resident) == num_slots:
                resident.pop(0)
            resident.append(expert)
    return hits


def test_bundled_routing_replays_through_an_independent_lru_and_prefetch_beats_chance():
    """Greedy routing does not depend on the cache, so the three prefetch modes see the same trace: without
    prefetch (and with readahead, which leaves the slots to the policy) the hits are the independent LRU's;
    filling slots ahead raises them; the prediction is right more often than a guess."""
    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "shakespeare_excerpt.txt")).read()
    prompts = [text[i * 300:i * 300 + 200] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for mode in ("off", "readahead", "slots"):
        llm = LLM(BUNDLED, dtype="float32", expert_cache_memory=2 * 3 * 128 * 256 * 4 * 4, expert_prefetch=mode)
        caches = [layer.expert_cache for layer in llm.engine.runner.model.moe_layers]
        traces = [[] for _ in caches]
        for cache, trace in zip(caches, traces):
            record = cache.resident_first
            cache.resident_first = lambda active, record=record, trace=trace: (trace.append(active), record(active))[1]
        for prompt in prompts:
            llm.generate([prompt], params, use_tqdm=False)
        stats = llm.engine.get_stats().expert_cache
        assert caches[0].num_slots == 2 and stats.hits + stats.misses == sum(map(len, sum(traces, [])))
        runs[mode] = stats, traces
    off, readahead, slots = (runs[m][0] for m in ("off", "readahead", "slots"))
    assert runs["off"][1] == runs["readahead"][1] == runs["slots"][1]
    assert off.hits == readahead.hits == sum(lru_hits(trace, 2) for trace in runs["off"][1])
    assert slots.hits > off.hits and slots.prefetch_loads > 0 and readahead.prefetch_loads == 0
    assert (slots.prefetch_predicted, slots.prefetch_correct) == (readahead.prefetch_predicted,
                                                                  readahead.prefetch_correct)
    print(f"bundled model, 2 of 8 slots, LRU: hit rate {off.hit_rate:.3f} without prefetch, {slots.hit_rate:.3f} "
          f"filling slots ahead; prefetch accuracy {slots.prefetch_accuracy:.3f}")
    assert slots.prefetch_accuracy > 2 / 8  # a guess of 2 of 8 experts is right a quarter of the time
