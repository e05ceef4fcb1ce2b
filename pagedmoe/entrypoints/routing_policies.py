"""How `pagedmoe router` picks a replica. Round robin; or cache-aware as SGLang's router (and vllm-router's
cache_aware, adapted from it) decides: when the replicas' in-flight counts are out of balance (both the
absolute and the relative gap past thresholds) the least-loaded replica; otherwise the replica whose earlier
requests share the longest prefix with this one's text, if that covers more than cache_threshold of it, else
the replica that has seen the least text (the most room in its cache). Text is matched in chained 64-character
chunks (an approximate prefix tree, as the routers keep), each replica's chunks bounded in LRU order."""
import hashlib
import itertools
from collections import OrderedDict

CHUNK_CHARS = 64


def chunk_hashes(text: str) -> list[bytes]:
    hashes, parent = [], b""
    for start in range(0, len(text) - len(text) % CHUNK_CHARS, CHUNK_CHARS):
        parent = hashlib.blake2b(parent + text[start:start + CHUNK_CHARS].encode(), digest_size=16).digest()
        hashes.append(parent)
    return hashes


class RoundRobin:
    def __init__(self, num_replicas: int):
        self.turns = itertools.cycle(range(num_replicas))

    def choose(self, text: str, in_flight: list[int]) -> int:
        return next(self.turns)


class CacheAware:
    def __init__(self, num_replicas: int, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_chunks: int = 1 << 20):
        self.trees = [OrderedDict() for _ in range(num_replicas)]
        self.cache_threshold, self.max_chunks = cache_threshold, max_chunks
        self.balance_abs, self.balance_rel = balance_abs_threshold, balance_rel_threshold

    def choose(self, text: str, in_flight: list[int]) -> int:
        chunks = chunk_hashes(text)
        if self.is_imbalanced(in_flight):
            replica = min(range(len(in_flight)), key=in_flight.__getitem__)
        else:
            replica = self.best_match(chunks, len(text))
        self.insert(replica, chunks)
        return replica

    def is_imbalanced(self, in_flight: list[int]) -> bool:
        high, low = max(in_flight), min(in_flight)
        return high - low > self.balance_abs and high > low * self.balance_rel

    def best_match(self, chunks: list[bytes], num_chars: int) -> int:
        matched = [self.matched_chunks(tree, chunks) for tree in self.trees]
        best = max(range(len(self.trees)), key=matched.__getitem__)
        if num_chars and matched[best] * CHUNK_CHARS / num_chars > self.cache_threshold:
            return best
        return min(range(len(self.trees)), key=lambda r: len(self.trees[r]))

    @staticmethod
    def matched_chunks(tree: OrderedDict, chunks: list[bytes]) -> int:
        return next((i for i, chunk in enumerate(chunks) if chunk not in tree), len(chunks))

    def insert(self, replica: int, chunks: list[bytes]):
        tree = self.trees[replica]
        for chunk in chunks:
            tree.pop(chunk, None)
            tree[chunk] = None
        while len(tree) > self.max_chunks:
            tree.popitem(last=False)


POLICIES = {"round_robin": RoundRobin, "cache_aware": CacheAware}


def add_router_args(parser):
    """`pagedmoe router`'s flags (here, not in router.py, so that building the CLI imports no web stack)."""
    parser.add_argument("--replica", action="append", help="a replica's base URL (repeat)")
    parser.add_argument("--prefill", help="P/D: the prefill instance's base URL (kv_producer)")
    parser.add_argument("--decode", help="P/D: the decode instance's base URL (kv_consumer)")
    parser.add_argument("--policy", choices=sorted(POLICIES), default="cache_aware")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
