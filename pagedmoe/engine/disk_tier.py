from collections import OrderedDict


class DiskTier:
    """Bookkeeping of KV blocks kept as files (named by block hash), bounded in blocks, evicted in LRU
    order. Hashes read in the current step are pinned so they are not deleted before the worker loads them.
    The worker does the file I/O; this side only decides."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.hashes: OrderedDict[bytes, None] = OrderedDict()
        self.pinned: set[bytes] = set()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.hashes

    def add(self, block_hash: bytes) -> tuple[bool, list[bytes]]:
        """Store a hash; returns whether it was stored and the hashes evicted to make room."""
        evicted = []
        while len(self.hashes) >= self.num_blocks:
            victim = next((h for h in self.hashes if h not in self.pinned), None)
            if victim is None:
                return False, evicted
            del self.hashes[victim]
            evicted.append(victim)
        self.hashes[block_hash] = None
        return True, evicted

    def pin(self, block_hash: bytes):
        self.hashes.move_to_end(block_hash)
        self.pinned.add(block_hash)

    def clear(self) -> list[bytes]:
        """Forgets every hash not pinned; returns them (their files are to be deleted)."""
        dropped = [h for h in self.hashes if h not in self.pinned]
        for block_hash in dropped:
            del self.hashes[block_hash]
        return dropped
