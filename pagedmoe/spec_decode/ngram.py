import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's prompt lookup: the longest suffix n-gram (min_n <= n <= max_n) that also occurs earlier in the
    context, at its earliest occurrence, and the up to k tokens that followed it there; [] when none does."""
    if k < 1 or len(token_ids) < 2:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # start i <= len - 1 - n: a token follows every window
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []
