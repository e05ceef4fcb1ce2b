from dataclasses import dataclass, field

from pagedmoe.engine.block_hash import update_block_hashes
from pagedmoe.engine.block_pool import BlockPool
from pagedmoe.engine.disk_tier import DiskTier
from pagedmoe.engine.sequence import Sequence

TIERS = ("device", "host", "disk")


@dataclass
class BlockTransfers:
    """Block copies the worker runs before the forward, in field order: every read of a block's old contents
    (spill host->disk, offload device->host, swap out) comes before any write into a reallocated block."""
    spill: list[tuple[int, bytes]] = field(default_factory=list)  # host block -> disk file
    offload: list[tuple[int, int]] = field(default_factory=list)  # device -> host
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # device -> host
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # host -> device
    copy: list[tuple[int, int]] = field(default_factory=list)  # device -> device (copy-on-write)
    load_host: list[tuple[int, int]] = field(default_factory=list)  # host -> device (prefix hit)
    load_disk: list[tuple[bytes, int]] = field(default_factory=list)  # disk file -> device (prefix hit)
    delete: list[bytes] = field(default_factory=list)  # disk files evicted


@dataclass
class PrefixHit:
    block_hash: bytes
    tier: str
    block_id: int | None  # device or host block; None for disk


class KVCacheManager:
    """Maps sequences to paged KV blocks: block tables, prefix caching of full blocks, forks that share
    blocks, copy-on-write, swap, and tiered offload (evicted cached blocks go to the host pool, whose
    evicted cached blocks go to disk; a later prefix hit loads them back)."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int, enable_caching: bool = True,
                 offload: bool = False, num_disk_blocks: int = 0, static_reserve=None, num_lookahead_tokens: int = 0):
        self.block_size, self.enable_caching, self.offload = block_size, enable_caching, offload
        self.num_lookahead_tokens = num_lookahead_tokens  # slots past a step's tokens a draft model writes into
        self.drop_last_hit = False  # MTP: a hit's last block is computed again (its hidden states are needed)
        self.static_reserve = static_reserve  # seq -> tokens to reserve at admission (static allocation mode)
        self.pool = BlockPool(num_blocks, on_evict=self._offload if offload else None)
        self.host_pool = BlockPool(num_host_blocks, on_evict=self._spill if num_disk_blocks else None)
        self.disk = DiskTier(num_disk_blocks) if offload and num_disk_blocks else None
        self.transfers = BlockTransfers()
        self.pinned_host: list[int] = []
        self.num_queried_tokens = 0
        self.num_hit_tokens = dict.fromkeys(TIERS, 0)
        self.num_offloaded_blocks = self.num_spilled_blocks = 0
        self.events = None  # KV events (kv_transfer/kv_events.py), once enable_events is called

    def enable_events(self):
        """Records BlockStored / BlockRemoved for each tier (GPU: this pool, CPU: the host tier, DISK)."""
        from pagedmoe.kv_transfer.kv_events import DISK, HOST, MAIN, KVEventRecorder
        self.events = KVEventRecorder(self.block_size, 4 * (self.pool.num_blocks + self.host_pool.num_blocks
                                                             + (self.disk.num_blocks if self.disk else 0)))
        for pool, medium in ((self.pool, MAIN), (self.host_pool, HOST)):
            pool.on_cached = lambda h, m=medium: self.events.stored(h, m)
            pool.on_uncached = lambda h, m=medium: self.events.removed(h, m)
        self.disk_medium = DISK

    def find_cached_prefix(self, seq: Sequence) -> list[PrefixHit]:
        """The longest cached prefix of seq over all tiers; the last token is always left to compute."""
        if not self.enable_caching or seq.request.needs_prompt_logprobs:
            return []
        update_block_hashes(seq, self.block_size)
        hits = []
        for block_hash in seq.block_hashes[:(len(seq) - 1) // self.block_size]:
            hit = self._lookup(block_hash)
            if hit is None:
                break
            hits.append(hit)
        return hits[:-1] if self.drop_last_hit else hits

    def _lookup(self, block_hash: bytes) -> PrefixHit | None:
        if block_hash in self.pool.cached:
            return PrefixHit(block_hash, "device", self.pool.cached[block_hash])
        if self.offload and block_hash in self.host_pool.cached:
            return PrefixHit(block_hash, "host", self.host_pool.cached[block_hash])
        if self.disk is not None and block_hash in self.disk:
            return PrefixHit(block_hash, "disk", None)
        return None

    def record_prefix_lookup(self, num_queried: int, hits: list[PrefixHit]):
        self.num_queried_tokens += num_queried
        for hit in hits:
            self.num_hit_tokens[hit.tier] += self.block_size

    def take_transfers(self) -> BlockTransfers:
        for block_id in self.pinned_host:
            self.host_pool.free(block_id)
        if self.disk is not None:
            self.disk.pinned.clear()
        self.pinned_host = []
        transfers, self.transfers = self.transfers, BlockTransfers()
        return transfers

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        num_total = -(-self._num_slots(seq, num_new_tokens) // self.block_size)
        return max(num_total - len(seq.block_table), 0) + int(self._needs_copy_on_write(seq, seq.block_table))

    def _num_slots(self, seq: Sequence, num_new_tokens: int) -> int:
        """The step's tokens, plus the lookahead slots a draft model writes, up to the sequence's last token."""
        num_slots = seq.num_computed_tokens + num_new_tokens
        if not self.num_lookahead_tokens:
            return num_slots
        last = seq.num_prompt_tokens + seq.request.params.max_tokens
        with_lookahead = num_slots + self.num_lookahead_tokens
        return with_lookahead if with_lookahead <= last else max(num_slots, last)  # twice a sequence a step: no min()

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hits: list[PrefixHit] = (),
                       delay_cache: bool = False) -> bool:
        """delay_cache (vLLM's delay_cache_blocks): the blocks join the prefix cache at a later allocation, not
        now; for blocks a KV connector loads into, which hold no KV until the load succeeds."""
        if hits and not self._take_cached(seq, num_new_tokens, hits):
            return False
        if self.static_reserve is not None and not seq.block_table and not self._reserve(seq):
            return False
        self._free_dead_blocks(seq)
        if self.num_blocks_needed(seq, num_new_tokens) > self.pool.num_free_blocks:
            return False
        self._grow_tables(seq, num_new_tokens)
        if not delay_cache:
            self._cache_full_blocks(seq, min(seq.num_computed_tokens + num_new_tokens, len(seq)))  # no draft token
        return True

    def _grow_tables(self, seq: Sequence, num_new_tokens: int):
        self._grow(seq, seq.block_table, num_new_tokens)

    def _grow(self, seq: Sequence, table: list[int], num_new_tokens: int):
        """Copy-on-write of the shared block the step writes first, then new blocks up to the step's slots."""
        if self._needs_copy_on_write(seq, table):
            self._copy_on_write(seq, table)
        num_total = -(-self._num_slots(seq, num_new_tokens) // self.block_size)
        table.extend(self.pool.allocate() for _ in range(num_total - len(table)))

    def _free_dead_blocks(self, seq: Sequence):
        """Frees blocks no later query reads (a sliding window's, kv_cache_hybrid.py); every block is live here."""

    def num_blocks_for(self, num_tokens: int) -> int:
        """The most blocks one sequence of num_tokens tokens holds at once."""
        return -(-num_tokens // self.block_size)

    def _reserve(self, seq: Sequence) -> bool:
        blocks = self.pool.allocate_run(-(-self.static_reserve(seq) // self.block_size))
        if blocks is None:
            return False
        seq.block_table = blocks
        return True

    def _take_cached(self, seq: Sequence, num_new_tokens: int, hits: list[PrefixHit]) -> bool:
        num_cached_tokens = len(hits) * self.block_size
        num_new_blocks = -(-(num_cached_tokens + num_new_tokens) // self.block_size) - len(hits)
        if num_new_blocks + self._num_blocks_taken(hits) > self.pool.num_free_blocks:
            return False
        seq.block_table = self._claim(hits)
        seq.num_cached_blocks, seq.num_computed_tokens = len(hits), num_cached_tokens
        return True

    def _num_blocks_taken(self, hits: list[PrefixHit]) -> int:
        """Free device blocks the hits use up: one per host or disk hit, and each cached free block revived."""
        return sum(1 for hit in hits if hit.tier != "device" or self.pool.ref_counts[hit.block_id] == 0)

    def _claim(self, hits: list[PrefixHit]) -> list[int]:
        """The hits' device blocks: every device hit is referenced before any fetch allocates (and evicts)."""
        for hit in hits:
            if hit.tier == "device":
                self.pool.incref(hit.block_id)
        return [hit.block_id if hit.tier == "device" else self._fetch(hit) for hit in hits]

    def _fetch(self, hit: PrefixHit) -> int:
        block_id = self.pool.allocate()
        if hit.tier == "host":
            self.host_pool.incref(hit.block_id)
            self.pinned_host.append(hit.block_id)
            self.transfers.load_host.append((hit.block_id, block_id))
        else:
            self.disk.pin(hit.block_hash)
            self.transfers.load_disk.append((hit.block_hash, block_id))
        self.pool.cache(block_id, hit.block_hash)
        return block_id

    def _offload(self, block_id: int, block_hash: bytes):
        if block_hash in self.host_pool.cached or not self.host_pool.num_free_blocks:
            return
        host_id = self.host_pool.allocate()
        self.transfers.offload.append((block_id, host_id))
        self.host_pool.cache(host_id, block_hash)
        self.pinned_host.append(host_id)
        self.num_offloaded_blocks += 1

    def _spill(self, host_id: int, block_hash: bytes):
        if self.disk is None or block_hash in self.disk:
            return
        stored, evicted = self.disk.add(block_hash)
        self.transfers.delete.extend(evicted)
        if stored:
            self.transfers.spill.append((host_id, block_hash))
            self.num_spilled_blocks += 1
        if self.events is not None:
            self._disk_events([block_hash] if stored else [], evicted)

    def _disk_events(self, stored: list[bytes], removed: list[bytes]):
        for block_hash in removed:
            self.events.removed(block_hash, self.disk_medium)
        for block_hash in stored:
            self.events.stored(block_hash, self.disk_medium)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int):
        num_full = num_tokens // self.block_size
        if not self.enable_caching or num_full <= seq.num_cached_blocks:
            return
        update_block_hashes(seq, self.block_size)
        for index in range(seq.num_cached_blocks, num_full):
            if self.events is not None:
                self.events.describe(seq.block_hashes[index], seq.block_hashes[index - 1] if index else None,
                                     seq.token_ids[index * self.block_size:(index + 1) * self.block_size])
            self.pool.cache(seq.block_table[index], seq.block_hashes[index])
        seq.num_cached_blocks = num_full

    def _needs_copy_on_write(self, seq: Sequence, table: list[int]) -> bool:
        index = seq.num_computed_tokens // self.block_size
        return index < len(table) and self.pool.is_shared(table[index])

    def _copy_on_write(self, seq: Sequence, table: list[int]):
        index = seq.num_computed_tokens // self.block_size
        src, dst = table[index], self.pool.allocate()
        self.transfers.copy.append((src, dst))
        self.pool.free(src)
        table[index] = dst

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

    def discard(self, seq: Sequence):
        """Frees a failed sequence. Its blocks past the committed tokens may hold unwritten KV, so those
        leave the prefix cache unless another sequence shares them."""
        for block_id in seq.block_table[seq.num_computed_tokens // self.block_size:]:
            if not self.pool.is_shared(block_id):
                self.pool.uncache(block_id)
        self.free(seq)

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.host_pool.num_free_blocks

    def swap_out(self, seq: Sequence):
        seq.host_block_table = [self.host_pool.allocate() for _ in seq.block_table]
        self.transfers.swap_out.extend(zip(seq.block_table, seq.host_block_table))
        for block_id in reversed(seq.block_table):
            self.pool.free(block_id)
        seq.block_table, seq.num_cached_blocks = [], 0

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        num_total = -(-self._num_slots(seq, num_new_tokens) // self.block_size)
        return max(num_total, len(seq.host_block_table)) <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence):
        seq.block_table = [self.pool.allocate() for _ in seq.host_block_table]
        self.transfers.swap_in.extend(zip(seq.host_block_table, seq.block_table))
        for block_id in reversed(seq.host_block_table):
            self.host_pool.free(block_id)
        seq.host_block_table = []

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block not in use, in every tier; True when none was in use (the cache is empty)."""
        device_empty, host_empty = self.pool.reset_prefix_cache(), self.host_pool.reset_prefix_cache()
        if self.disk is not None:
            dropped = self.disk.clear()
            self.transfers.delete.extend(dropped)
            if self.events is not None:
                self._disk_events([], dropped)
        if self.events is not None and device_empty and host_empty:
            self.events.cleared()
        return device_empty and host_empty

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def capacity_blocks(self) -> int:
        """The most blocks one sequence can hold."""
        return self.pool.num_blocks
