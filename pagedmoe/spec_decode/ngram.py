import numpy as np


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's prompt lookup: the longest suffix n-gram (min_n <= n <= max_n) that also occurs earlier in the
    context, at its earliest occurrence, and the up to k tokens that followed it there; [] when none does.
    Every earlier occurrence ends at a position holding the last token: from those candidates backwards, one
    vector comparison per n-gram length (O(L + candidates * max_n), not O(L * max_n))."""
    if k < 1 or len(token_ids) < 2:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # a token follows each
    lengths, alive = np.ones(len(ends), dtype=np.int64), np.ones(len(ends), dtype=bool)
    for back in range(1, min(max_n, len(tokens) - 1)):
        alive &= (ends >= back) & (tokens[np.maximum(ends - back, 0)] == tokens[-1 - back])
        lengths += alive
    if not len(ends) or lengths.max() < min_n:
        return []
    start = int(ends[np.argmax(lengths == lengths.max())]) + 1  # the earliest of the longest
    return tokens[start:start + k].tolist()
