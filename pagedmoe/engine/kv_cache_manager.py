from dataclasses import dataclass, field

from pagedmoe.engine.block_pool import BlockPool
from pagedmoe.engine.sequence import Sequence


@dataclass
class BlockTransfers:
    """Copies the worker runs before the forward, in this order: swap out, swap in, copy-on-write."""
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    """Maps sequences to paged KV blocks: block tables, forks that share blocks, copy-on-write, swap."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.transfers = BlockTransfers()

    def take_transfers(self) -> BlockTransfers:
        transfers, self.transfers = self.transfers, BlockTransfers()
        return transfers

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(num_total - len(seq.block_table), 0) + int(self._needs_copy_on_write(seq))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_needed = self.num_blocks_needed(seq, num_new_tokens)
        if num_needed > self.pool.num_free_blocks:
            return False
        if self._needs_copy_on_write(seq):
            self._copy_on_write(seq)
            num_needed -= 1
        seq.block_table.extend(self.pool.allocate() for _ in range(num_needed))
        return True

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
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence):
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        for block_id in reversed(seq.host_block_table):
            self.host_pool.free(block_id)
        seq.block_table, seq.host_block_table = [], []

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.host_pool.num_free_blocks

    def swap_out(self, seq: Sequence):
        seq.host_block_table = [self.host_pool.allocate() for _ in seq.block_table]
        self.transfers.swap_out.extend(zip(seq.block_table, seq.host_block_table))
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        seq.block_table = []

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
