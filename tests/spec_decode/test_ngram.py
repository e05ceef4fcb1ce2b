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
