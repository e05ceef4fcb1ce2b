"""Data-parallel attention's KV: one KV manager per data-parallel rank, each over that rank's own pool (block
ids are the rank's own), so a rank holds only its sequences' KV (DeepSeek's latent cache is not duplicated as
under tensor parallelism). A sequence joins the partition with the most free blocks when first scheduled and
stays there; forks stay with their parent. The engine and scheduler see one manager."""
from dataclasses import dataclass, field

from pagedmoe.engine.kv_cache_manager import BlockTransfers, KVCacheManager
from pagedmoe.engine.sequence import Sequence


@dataclass
class PartitionedTransfers:
    """The step's block copies for each data-parallel rank."""
    by_rank: list[BlockTransfers] = field(default_factory=list)


class CombinedPool:
    """Read-only totals over the partitions' pools (stats, the dashboard, tests' "all blocks free")."""

    def __init__(self, pools: list):
        self.pools = pools

    num_blocks = property(lambda self: sum(p.num_blocks for p in self.pools))
    num_free_blocks = property(lambda self: sum(p.num_free_blocks for p in self.pools))
    num_used_blocks = property(lambda self: sum(p.num_used_blocks for p in self.pools))
    ref_counts = property(lambda self: [c for p in self.pools for c in p.ref_counts])
    block_hashes = property(lambda self: [h for p in self.pools for h in p.block_hashes])


class DataParallelKVManager:
    def __init__(self, managers: list[KVCacheManager]):
        self.managers = managers
        self.block_size, self.enable_caching = managers[0].block_size, managers[0].enable_caching
        self.num_assigned = [0] * len(managers)  # sequences each rank has taken
        self.pool = CombinedPool([m.pool for m in managers])
        self.host_pool = CombinedPool([m.host_pool for m in managers])
        self.events = None
        self.drop_last_hit = False  # speculative decoding (MTP / EAGLE) is refused with several ranks
    capacity_blocks = property(lambda self: self.managers[0].pool.num_blocks)  # what one sequence may use
    num_queried_tokens = property(lambda self: sum(m.num_queried_tokens for m in self.managers))
    num_offloaded_blocks = property(lambda self: sum(m.num_offloaded_blocks for m in self.managers))
    num_spilled_blocks = property(lambda self: sum(m.num_spilled_blocks for m in self.managers))

    @property
    def num_hit_tokens(self) -> dict[str, int]:
        return {tier: sum(m.num_hit_tokens[tier] for m in self.managers) for tier in self.managers[0].num_hit_tokens}

    def of(self, seq: Sequence) -> KVCacheManager:
        if seq.dp_rank is None:
            seq.dp_rank = max(range(len(self.managers)), key=lambda r: self.managers[r].pool.num_free_blocks)
            self.num_assigned[seq.dp_rank] += 1
        return self.managers[seq.dp_rank]

    def fork(self, parent: Sequence, child: Sequence):
        child.dp_rank = parent.dp_rank
        self.of(parent).fork(parent, child)

    def take_transfers(self) -> PartitionedTransfers:
        return PartitionedTransfers([m.take_transfers() for m in self.managers])

    def num_blocks_for(self, num_tokens: int) -> int:
        return self.managers[0].num_blocks_for(num_tokens)

    def record_prefix_lookup(self, num_queried: int, hits):
        self.managers[0].record_prefix_lookup(num_queried, hits)  # counters only: the totals sum the partitions

    def reset_prefix_cache(self) -> bool:
        return all([m.reset_prefix_cache() for m in self.managers])

    def enable_events(self):
        raise ValueError("kv_events_config: KV events are not published with data_parallel_size > 1 yet")


def _routed(name: str):
    def method(self, seq: Sequence, *args, **kwargs):
        return getattr(self.of(seq), name)(seq, *args, **kwargs)
    method.__name__ = name
    return method


for _name in ("find_cached_prefix", "allocate_slots", "free", "discard", "can_swap_out", "swap_out", "can_swap_in",
              "swap_in"):
    setattr(DataParallelKVManager, _name, _routed(_name))
