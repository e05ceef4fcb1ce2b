"""A server on the bundled MoE model with its experts offloaded (2 of 8 a layer): /metrics counts the expert
cache's hits, misses and bytes read under vLLM-style names, and /dashboard/stats shows each layer's resident
experts for the heatmap."""
import re

import httpx

from server_utils import HEADERS, MODEL, serve, wait_all_blocks_free
from pagedmoe import DEFAULT_MODEL

EXPERT_BYTES = 3 * 128 * 256 * 4  # the bundled model's experts in float32


def metric(text: str, name: str) -> float:
    found = re.search(rf'^pagedmoe:{name}{{model_name="{MODEL}"}} (\S+)$', text, re.M)
    assert found, f"{name} missing"
    return float(found[1])


def test_metrics_and_dashboard_report_the_expert_cache():
    with serve(DEFAULT_MODEL, expert_cache_memory=2 * 4 * EXPERT_BYTES,
               expert_prefetch="slots") as running:
        client = running.openai()
        out = client.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=16, temperature=0)
        assert out.choices[0].text
        wait_all_blocks_free(running)
        text = httpx.get(f"{running.url}/metrics", headers=HEADERS).text
        hits, misses = metric(text, "expert_cache_hits_total"), metric(text, "expert_cache_misses_total")
        routed = sum(float(v) for v in re.findall(r"^pagedmoe:expert_tokens_total{.*} (\S+)$", text, re.M))
        assert misses > 0 and hits + misses <= routed  # one use per (step, layer, active expert)
        loads = misses + metric(text, "expert_prefetch_loads_total")
        assert metric(text, "expert_cache_loaded_bytes_total") == loads * EXPERT_BYTES
        assert metric(text, "expert_prefetch_correct_total") <= metric(text, "expert_prefetch_predicted_total")
        assert metric(text, "expert_cache_resident_bytes") == 2 * 4 * EXPERT_BYTES
        assert metric(text, "expert_cache_slots") == 2
        stats = httpx.get(f"{running.url}/dashboard/stats", headers=HEADERS).json()["expert_cache"]
        assert stats["slots"] == 2 and len(stats["resident"]) == 4
        assert all(len(layer) == 2 and set(layer) <= set(range(8)) for layer in stats["resident"])
        assert stats["hits"] == hits and stats["misses"] == misses
