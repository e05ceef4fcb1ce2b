import hashlib
from array import array

from pagedmoe.engine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    """Chained block hash: sha256(parent hash, the block's token ids, extra keys). Stable across processes,
    so it can also name blocks in an on-disk tier."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if salt:
        h.update(salt.encode())
    return h.digest()


def update_block_hashes(seq: Sequence, block_size: int):
    """Extend seq.block_hashes to every full block of its tokens; the salt enters the first block only
    and reaches the rest through the chain."""
    for index in range(len(seq.block_hashes), len(seq.token_ids) // block_size):
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        tokens = seq.token_ids[index * block_size:(index + 1) * block_size]
        seq.block_hashes.append(hash_block(parent, tokens, seq.request.cache_salt if index == 0 else None))
