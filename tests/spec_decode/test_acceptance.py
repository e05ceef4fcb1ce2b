"""The verification rule on hand-computed cases (vLLM's test_rejection_sampler greedy vectors)."""
import pytest

from pagedmoe.spec_decode.acceptance import emitted_tokens, num_accepted
from pagedmoe.spec_decode.proposer import SpecDecodeStats


def test_all_accepted_plus_the_bonus_token():
    assert emitted_tokens([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]


def test_the_first_rejection_emits_the_target_token_and_stops():
    assert num_accepted([1, 2, 3], [1, 5, 3, 4]) == 1
    assert emitted_tokens([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert emitted_tokens([1, 2, 3], [9, 2, 3, 4]) == [9]  # a later agreement does not count


def test_no_drafts_is_a_plain_decode():
    assert emitted_tokens([], [7]) == [7]


def test_the_draws_must_cover_every_draft_and_one_more():
    with pytest.raises(ValueError, match="sampled_token_ids"):
        num_accepted([1, 2], [1, 2])


def test_stats_count_drafts_and_acceptance_per_position():
    stats = SpecDecodeStats()
    stats.record(3, 2)
    stats.record(1, 0)
    stats.record(0, 0)  # no drafts: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 4, 2)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
