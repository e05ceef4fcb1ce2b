from pagedmoe.engine.block_hash import update_block_hashes
from pagedmoe.engine.kv_cache_manager import KVCacheManager, PrefixHit
from pagedmoe.engine.sequence import Sequence

NULL_BLOCK = -1  # a freed window entry: the runner points it at block 0, which the window masks, never reads
WINDOW_TAG = b"/window"  # a window block's prefix-cache key is its chained hash tagged: it holds other layers' KV


class HybridKVCacheManager(KVCacheManager):
    """KV for a model whose layers mix full and sliding-window attention (gpt-oss), as vLLM's hybrid manager:
    each sequence has a second block table, `seq.window_table`, for the sliding layers, from the same pool (the
    storage gives a full layer and a sliding one the same slot, so a block holds one table's KV). Window blocks
    wholly before the window of a step's first query are freed and become NULL_BLOCK entries; a prefix hit needs
    the full blocks it covers and the window blocks its next query reads."""

    def __init__(self, *args, sliding_window: int, max_step_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.sliding_window, self.max_step_tokens = sliding_window, max_step_tokens

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading window blocks outside the window of a query at position num_computed_tokens (it reads keys
        from num_computed_tokens + 1 - sliding_window on)."""
        return max(0, (num_computed_tokens + 1 - self.sliding_window) // self.block_size)

    def num_blocks_for(self, num_tokens: int) -> int:
        num_full = super().num_blocks_for(num_tokens)
        num_window = -(-(self.sliding_window + self.max_step_tokens + self.num_lookahead_tokens) // self.block_size)
        return num_full + min(num_full, num_window + 1)

    def _free_dead_blocks(self, seq: Sequence):
        num_dead = min(self.num_dead_blocks(seq.num_computed_tokens), len(seq.window_table))
        for index in range(seq.num_window_freed, num_dead):
            self.pool.free(seq.window_table[index])
            seq.window_table[index] = NULL_BLOCK
        seq.num_window_freed = max(seq.num_window_freed, num_dead)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_total = -(-self._num_slots(seq, num_new_tokens) // self.block_size)
        num_window = max(num_total - len(seq.window_table), 0) + int(self._needs_copy_on_write(seq, seq.window_table))
        return super().num_blocks_needed(seq, num_new_tokens) + num_window

    def _grow_tables(self, seq: Sequence, num_new_tokens: int):
        super()._grow_tables(seq, num_new_tokens)
        self._grow(seq, seq.window_table, num_new_tokens)

    def find_cached_prefix(self, seq: Sequence) -> list[PrefixHit]:
        hits = super().find_cached_prefix(seq)
        while hits and None in self._window_hits(seq, len(hits)):
            hits.pop()
        return hits

    def _window_hits(self, seq: Sequence, num_blocks: int) -> list[PrefixHit | None]:
        """The window blocks that a query after num_blocks cached blocks reads."""
        first = self.num_dead_blocks(num_blocks * self.block_size)
        return [self._lookup(seq.block_hashes[i] + WINDOW_TAG) for i in range(first, num_blocks)]

    def _take_cached(self, seq: Sequence, num_new_tokens: int, hits: list[PrefixHit]) -> bool:
        num_cached_tokens = len(hits) * self.block_size
        window_hits = self._window_hits(seq, len(hits))  # all found: find_cached_prefix trimmed the hits
        num_new_blocks = 2 * (-(-(num_cached_tokens + num_new_tokens) // self.block_size) - len(hits))
        if num_new_blocks + self._num_blocks_taken(hits + window_hits) > self.pool.num_free_blocks:
            return False
        blocks = self._claim(hits + window_hits)
        seq.num_window_freed = len(hits) - len(window_hits)
        seq.block_table, seq.window_table = blocks[:len(hits)], [NULL_BLOCK] * seq.num_window_freed + blocks[len(hits):]
        seq.num_cached_blocks, seq.num_computed_tokens = len(hits), num_cached_tokens
        return True

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int):
        start = seq.num_cached_blocks
        super()._cache_full_blocks(seq, num_tokens)
        if self.enable_caching and seq.num_cached_blocks > start:
            update_block_hashes(seq, self.block_size)
            for index in range(max(start, seq.num_window_freed), seq.num_cached_blocks):
                self.pool.cache(seq.window_table[index], seq.block_hashes[index] + WINDOW_TAG)

    def fork(self, parent: Sequence, child: Sequence):
        super().fork(parent, child)
        for block_id in _live(parent.window_table):
            self.pool.incref(block_id)
        for block_id in _live(parent.host_window_table):
            self.host_pool.incref(block_id)
        child.window_table, child.host_window_table = list(parent.window_table), list(parent.host_window_table)
        child.num_window_freed = parent.num_window_freed

    def free(self, seq: Sequence):
        for block_id in reversed(_live(seq.window_table)):
            self.pool.free(block_id)
        for block_id in reversed(_live(seq.host_window_table)):
            self.host_pool.free(block_id)
        seq.window_table, seq.host_window_table, seq.num_window_freed = [], [], 0
        super().free(seq)

    def discard(self, seq: Sequence):
        for block_id in _live(seq.window_table[seq.num_computed_tokens // self.block_size:]):
            if not self.pool.is_shared(block_id):
                self.pool.uncache(block_id)
        super().discard(seq)

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) + len(_live(seq.window_table)) <= self.host_pool.num_free_blocks

    def swap_out(self, seq: Sequence):
        seq.host_window_table = _moved(seq.window_table, self.pool, self.host_pool, self.transfers.swap_out)
        seq.window_table = []
        super().swap_out(seq)

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_total = -(-self._num_slots(seq, num_new_tokens) // self.block_size)
        num_window = max(num_total - seq.num_window_freed, len(_live(seq.host_window_table)))
        return max(num_total, len(seq.host_block_table)) + num_window <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence):
        seq.window_table = _moved(seq.host_window_table, self.host_pool, self.pool, self.transfers.swap_in)
        seq.host_window_table = []
        super().swap_in(seq)


def _live(table: list[int]) -> list[int]:
    return [block_id for block_id in table if block_id != NULL_BLOCK]


def _moved(table: list[int], src_pool, dst_pool, copies: list[tuple[int, int]]) -> list[int]:
    """table's live blocks copied into new blocks of dst_pool (the copies recorded) and freed in src_pool;
    NULL entries kept."""
    moved = [NULL_BLOCK if block_id == NULL_BLOCK else dst_pool.allocate() for block_id in table]
    copies.extend((src, dst) for src, dst in zip(table, moved) if src != NULL_BLOCK)
    for block_id in reversed(_live(table)):
        src_pool.free(block_id)
    return moved
