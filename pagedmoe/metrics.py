"""LLM.get_metrics: the engine's stats as vLLM's metric objects (vllm.v1.metrics.reader), under vLLM's names."""
from dataclasses import dataclass, field

from pagedmoe.engine.llm_engine import EngineStats


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)


def engine_metrics(stats: EngineStats, labels: dict[str, str]) -> list[Metric]:
    gauges = {"num_requests_running": stats.num_running, "num_requests_waiting": stats.num_waiting,
              "kv_cache_usage_perc": stats.kv_cache_usage}
    counters = {"prompt_tokens": stats.num_prompt_tokens, "generation_tokens": stats.num_generation_tokens,
                "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
                "num_preemptions": stats.num_preemptions_recompute + stats.num_preemptions_swap}
    metrics = [Gauge(f"vllm:{name}", dict(labels), value) for name, value in gauges.items()]
    metrics += [Counter(f"vllm:{name}", dict(labels), value) for name, value in counters.items()]
    return metrics + _spec_decode_metrics(stats.spec_decode, labels)


def _spec_decode_metrics(spec, labels: dict[str, str]) -> list[Metric]:
    if spec is None:
        return []
    counters = {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
                "num_accepted_tokens": spec.num_accepted_tokens}
    return ([Counter(f"vllm:spec_decode_{name}", dict(labels), value) for name, value in counters.items()]
            + [Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                      list(spec.num_accepted_tokens_per_pos))])
