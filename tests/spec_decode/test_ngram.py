"""Prompt lookup against vLLM's own test vectors (tests/v1/spec_decode/test_ngram.py)."""
from pagedmoe.spec_decode.ngram import propose_ngram


def test_the_tokens_after_the_earlier_occurrence_of_the_suffix():
    assert propose_ngram([1, 2, 3, 4, 1, 2, 3], 2, 2, 3) == [4, 1, 2]


def test_the_longest_suffix_wins():
    assert propose_ngram([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 3, 4, 2) == [1, 2]  # the 4-gram, not [5, 1]


def test_the_earliest_occurrence_wins():
    assert propose_ngram([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 3, 3, 2) == [100, 1]


def test_no_match_no_drafts():
    assert propose_ngram([1, 2, 3, 4, 5], 1, 3, 3) == []
    assert propose_ngram([1, 2, 3, 1, 2], 3, 3, 3) == []  # the 2-gram repeats, but min_n is 3
    assert propose_ngram([7], 1, 3, 3) == [] and propose_ngram([1, 1, 1], 1, 2, 0) == []


def test_drafts_stop_at_the_end_of_the_context():
    assert propose_ngram([5, 6, 5], 1, 1, 4) == [6, 5]


def reference_ngram(token_ids, min_n, max_n, k):
    """The definition, directly: for n from the longest, the first earlier window equal to the suffix."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def test_matches_the_definition_on_random_contexts():
    import random
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice((2, 3, 6))) for _ in range(rng.randrange(1, 40))]
        min_n = rng.randrange(1, 4)
        max_n, k = min_n + rng.randrange(0, 4), rng.randrange(0, 6)
        assert propose_ngram(tokens, min_n, max_n, k) == (reference_ngram(tokens, min_n, max_n, k) if k else [])
