from collections import OrderedDict
from collections.abc import Callable


class BlockPool:
    """Ref-counted KV blocks with an O(1) LRU free list (an OrderedDict used as a linked list): free blocks
    are taken from the front, a freed block goes to the back. A full block may carry its chained hash; it
    stays findable in `cached` after it is freed, until it is reallocated (evicted) in LRU order."""

    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None):
        self.num_blocks, self.on_evict = num_blocks, on_evict
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0
        self.on_cached: Callable[[bytes], None] | None = None  # KV events: a hash entered / left this pool
        self.on_uncached: Callable[[bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise RuntimeError("block pool exhausted")
        block_id, _ = self.free_blocks.popitem(last=False)
        self._evict(block_id)
        self.ref_counts[block_id] = 1
        return block_id

    def allocate_run(self, num_blocks: int) -> list[int] | None:
        """num_blocks free blocks with consecutive ids (static allocation), or None if no such run exists."""
        run = 0
        for block_id, ref_count in enumerate(self.ref_counts):
            run = run + 1 if ref_count == 0 else 0
            if run == num_blocks:
                blocks = list(range(block_id - num_blocks + 1, block_id + 1))
                for b in blocks:
                    del self.free_blocks[b]
                    self._evict(b)
                    self.ref_counts[b] = 1
                return blocks
        return None

    def _evict(self, block_id: int):
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            self.uncache(block_id)
            self.num_evictions += 1

    def incref(self, block_id: int):
        if self.ref_counts[block_id] == 0:
            del self.free_blocks[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_id: int):
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"block {block_id} freed more often than it was referenced")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_blocks[block_id] = None

    def is_shared(self, block_id: int) -> bool:
        return self.ref_counts[block_id] > 1

    def cache(self, block_id: int, block_hash: bytes):
        if block_hash not in self.cached and self.block_hashes[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
            if self.on_cached is not None:
                self.on_cached(block_hash)

    def uncache(self, block_id: int):
        """Forgets a block's hash without offloading it: its KV was never written (its step failed)."""
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hashes[block_id] = None
            if self.on_uncached is not None:
                self.on_uncached(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forgets the hash of every free block; True when no block is in use, so that none stays cached."""
        for block_id in self.free_blocks:
            self.uncache(block_id)
        return self.num_used_blocks == 0

    def num_cached_free_blocks(self) -> int:
        return sum(1 for b in self.free_blocks if self.block_hashes[b] is not None)
