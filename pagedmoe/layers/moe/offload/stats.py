"""The expert caches' counters summed over layers, and each layer's resident experts (for the dashboard)."""
from dataclasses import dataclass, fields

from pagedmoe.layers.moe.offload.cache import ExpertCacheCounters


@dataclass
class ExpertCacheStats(ExpertCacheCounters):
    num_slots: int = 0  # a layer
    resident_bytes: int = 0  # every layer's pool
    resident: list[list[int]] | None = None  # per MoE layer, the experts its slots hold

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def prefetch_accuracy(self) -> float:
        """Of the experts the previous layer predicted, the share the step then used."""
        return self.prefetch_correct / max(self.prefetch_predicted, 1)


def expert_cache_stats(layers: list) -> ExpertCacheStats | None:
    caches = [layer.expert_cache for layer in layers if getattr(layer, "expert_cache", None) is not None]
    if not caches:
        return None
    totals = {f.name: sum(getattr(c.counters, f.name) for c in caches) for f in fields(ExpertCacheCounters)}
    return ExpertCacheStats(**totals, num_slots=caches[0].num_slots,
                            resident_bytes=sum(c.resident_bytes for c in caches),
                            resident=[sorted(list(c.slot_of)) for c in caches])
