"""Prometheus metrics under vLLM's names with a `pagedmoe:` prefix, in a per-app registry.
Engine state is read from the engine thread's latest snapshot at scrape time; request latencies
are observed by the handlers from the engine's per-request timestamps."""
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pagedmoe.engine.async_engine import AsyncLLMEngine
from pagedmoe.outputs import RequestOutput

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
WINDOW = 4096


class EngineCollector(Collector):
    def __init__(self, client: AsyncLLMEngine, model_name: str):
        self.client, self.labels = client, {"model_name": model_name}

    def collect(self):
        snap = self.client.snapshot
        stats = snap.stats
        yield self._gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", stats.kv_cache_usage)
        yield self._counter("prefix_cache_queries", "Prefix cache queries, in tokens.",
                            getattr(stats, "prefix_cache_queries", 0))
        yield self._counter("prefix_cache_hits", "Prefix cache hits, in tokens.",
                            getattr(stats, "prefix_cache_hits", 0))
        yield self._counter("num_preemptions", "Preemptions (recompute and swap).",
                            stats.num_preemptions_recompute + stats.num_preemptions_swap)
        yield self._counter("prompt_tokens", "Prefill tokens processed.", stats.num_prompt_tokens)
        yield self._counter("generation_tokens", "Tokens generated.", stats.num_generation_tokens)
        if snap.expert_load:
            yield self._expert_tokens(snap.expert_load)
        if getattr(stats, "spec_decode", None) is not None:
            yield from self._spec_decode(stats.spec_decode)
        if getattr(stats, "parallel", None) is not None:
            yield from self._parallel(stats.parallel)
        if getattr(stats, "expert_cache", None) is not None:
            yield from self._expert_cache(stats.expert_cache)

    def _expert_cache(self, cache):
        yield self._counter("expert_cache_hits", "Active experts of a layer's step found resident.", cache.hits)
        yield self._counter("expert_cache_misses", "Active experts of a layer's step read from the checkpoint.",
                            cache.misses)
        yield self._counter("expert_cache_loaded_bytes", "Expert bytes read from the checkpoint.", cache.bytes_loaded)
        yield self._counter("expert_prefetch_loads", "Experts read ahead of their layer.", cache.prefetch_loads)
        yield self._counter("expert_prefetch_predicted", "Experts the previous layer's router predicted.",
                            cache.prefetch_predicted)
        yield self._counter("expert_prefetch_correct", "Predicted experts the step then used.",
                            cache.prefetch_correct)
        yield self._gauge("expert_cache_resident_bytes", "Bytes of the expert caches' slots.", cache.resident_bytes)
        yield self._gauge("expert_cache_slots", "Expert slots of each MoE layer.", cache.num_slots)

    def _parallel(self, parallel):
        yield self._gauge("parallel_world_size", "Ranks of the engine (tensor / expert parallel).",
                          parallel.world_size)
        yield self._counter("parallel_steps", "Steps run by every rank.", parallel.num_steps)
        yield self._labelled(CounterMetricFamily, "parallel_comm_seconds", "Rank 0's seconds in each collective.",
                             "kind", parallel.comm_seconds.items())
        yield self._rank_seconds(parallel.rank_seconds)
        if parallel.rank_expert_tokens:
            yield self._labelled(CounterMetricFamily, "parallel_rank_expert_tokens",
                                 "Routed expert tokens each rank computed.", "rank",
                                 enumerate(parallel.rank_expert_tokens))
            yield self._gauge("expert_load_imbalance", "Max / mean of the ranks' expert tokens (1: balanced).",
                              parallel.expert_imbalance or 1.0)

    def _rank_seconds(self, rank_seconds: list[dict[str, float]]) -> CounterMetricFamily:
        family = CounterMetricFamily("pagedmoe:parallel_rank_seconds", "Each rank's seconds in its forwards "
                                     "(kind forward) and in each collective.", labels=[*self.labels, "rank", "kind"])
        for rank, by_kind in enumerate(rank_seconds):
            for kind, seconds in by_kind.items():
                family.add_metric([*self.labels.values(), str(rank), kind], seconds)
        return family

    def _labelled(self, kind, name: str, doc: str, label: str, values):
        family = kind(f"pagedmoe:{name}", doc, labels=[*self.labels, label])
        for key, value in values:
            family.add_metric([*self.labels.values(), str(key)], value)
        return family

    def _spec_decode(self, spec):
        yield self._counter("spec_decode_num_drafts", "Sequence-steps that verified draft tokens.", spec.num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens verified.", spec.num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens)
        family = CounterMetricFamily("pagedmoe:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position.",
                                     labels=[*self.labels, "position"])
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            family.add_metric([*self.labels.values(), str(position)], count)
        yield family

    def _gauge(self, name: str, doc: str, value) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"pagedmoe:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value) -> CounterMetricFamily:
        family = CounterMetricFamily(f"pagedmoe:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _expert_tokens(self, load: list[list[int]]) -> CounterMetricFamily:
        family = CounterMetricFamily("pagedmoe:expert_tokens", "Tokens routed to each expert of each MoE layer.",
                                     labels=[*self.labels, "layer", "expert"])
        for layer, counts in enumerate(load):
            for expert, count in enumerate(counts):
                family.add_metric([*self.labels.values(), str(layer), str(expert)], count)
        return family


class ServerMetrics:
    def __init__(self, client: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(client, model_name))
        self.model_name = model_name
        self.request_success = Counter("pagedmoe:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=self.registry)
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between two tokens of a request.")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.recent = {"ttft": deque(maxlen=WINDOW), "itl": deque(maxlen=WINDOW)}

    def _histogram(self, name: str, doc: str):
        return Histogram(f"pagedmoe:{name}", doc, ["model_name"], buckets=LATENCY_BUCKETS,
                         registry=self.registry).labels(self.model_name)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)

    def percentiles(self, name: str) -> dict:
        values = sorted(self.recent[name])
        if not values:
            return {"p50": None, "p99": None, "count": 0}
        return {"p50": _percentile(values, 0.50), "p99": _percentile(values, 0.99), "count": len(values)}


class RequestTracker:
    """Observes one request's latencies from the timestamps carried by its outputs."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics, self.last_token_time = metrics, None

    def observe(self, output: RequestOutput):
        m, metrics = output.metrics, self.metrics
        if m.last_token_time is None:
            return
        if self.last_token_time is None:
            self._record("ttft", metrics.ttft, m.first_token_time - m.arrival_time)
        elif m.last_token_time > self.last_token_time:
            self._record("itl", metrics.itl, m.last_token_time - self.last_token_time)
        self.last_token_time = m.last_token_time
        if output.finished:
            metrics.e2e.observe(m.last_token_time - m.arrival_time)
            reason = output.outputs[0].finish_reason or "unknown"
            metrics.request_success.labels(metrics.model_name, reason).inc()

    def _record(self, name: str, histogram, seconds: float):
        histogram.observe(seconds)
        self.metrics.recent[name].append(seconds)


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)]
