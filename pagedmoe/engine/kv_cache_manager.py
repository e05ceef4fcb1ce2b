from dataclasses import dataclass, field

from pagedmoe.engine.block_hash import update_block_hashes
from pagedmoe.engine.block_pool import BlockPool
from pagedmoe.engine.sequence import Sequence


@dataclass
class BlockTransfers:
    """Copies the worker runs before the forward, in this order: swap out, swap in, copy-on-write."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    """Maps sequences to paged KV blocks: block tables, prefix caching of full blocks, forks that share
    blocks, copy-on-write, swap."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size, self.enable_caching = block_size, enable_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.transfers = BlockTransfers()
        self.num_queried_tokens = self.num_hit_tokens = 0

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq; the last token is always left to compute."""
        if not self.enable_caching or seq.request.needs_prompt_logprobs:
            return []
        update_block_hashes(seq, self.block_size)
        blocks = []
        for block_hash in seq.block_hashes[:(len(seq) - 1) // self.block_size]:
            block_id = self.pool.cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def record_prefix_lookup(self, num_queried: int, num_hit: int):
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    def take_transfers(self) -> BlockTransfers:
        transfers, self.transfers = self.transfers, BlockTransfers()
        return transfers

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(num_total - len(seq.block_table), 0) + int(self._needs_copy_on_write(seq))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        if cached_blocks and not self._take_cached(seq, num_new_tokens, cached_blocks):
            return False
        num_needed = self.num_blocks_needed(seq, num_new_tokens)
        if num_needed > self.pool.num_free_blocks:
            return False
        if self._needs_copy_on_write(seq):
            self._copy_on_write(seq)
            num_needed -= 1
        seq.block_table.extend(self.pool.allocate() for _ in range(num_needed))
        self._cache_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _take_cached(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int]) -> bool:
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_new_blocks = -(-(num_cached_tokens + num_new_tokens) // self.block_size) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + num_revived > self.pool.num_free_blocks:
            return False
        for block_id in cached_blocks:
            self.pool.incref(block_id)
        seq.block_table, seq.num_cached_blocks = list(cached_blocks), len(cached_blocks)
        seq.num_computed_tokens = num_cached_tokens
        return True

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int):
        num_full = num_tokens // self.block_size
        if not self.enable_caching or num_full <= seq.num_cached_blocks:
            return
        update_block_hashes(seq, self.block_size)
        for index in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[index], seq.block_hashes[index])
        seq.num_cached_blocks = num_full

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.pool.is_shared(seq.block_table[index])

    def _copy_on_write(self, seq: Sequence):
        index = seq.num_computed_tokens // self.block_size
        src, dst = seq.block_table[index], self.pool.allocate()
        self.transfers.copy.append((src, dst))
        self.pool.free(src)
        seq.block_table[index] = dst

    def fork(self, parent: Sequence, child: Sequence):
        for block_id in parent.block_table:
            self.pool.incref(block_id)
        for block_id in parent.host_block_table:
            self.host_pool.incref(block_id)
        child.block_table, child.host_block_table = list(parent.block_table), list(parent.host_block_table)

    def free(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        for block_id in reversed(seq.host_block_table):
            self.host_pool.free(block_id)
        seq.block_table, seq.host_block_table, seq.num_cached_blocks = [], [], 0

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.host_pool.num_free_blocks

    def swap_out(self, seq: Sequence):
        seq.host_block_table = [self.host_pool.allocate() for _ in seq.block_table]
        self.transfers.swap_out.extend(zip(seq.block_table, seq.host_block_table))
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        seq.block_table, seq.num_cached_blocks = [], 0

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(num_total, len(seq.host_block_table)) <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence):
        seq.block_table = [self.pool.allocate() for _ in seq.host_block_table]
        self.transfers.swap_in.extend(zip(seq.host_block_table, seq.block_table))
        for block_id in reversed(seq.host_block_table):
            self.host_pool.free(block_id)
        seq.host_block_table = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
