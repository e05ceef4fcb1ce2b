"""Verification by sample-then-compare: the target's sampler draws a token at every draft position (the row
of the last committed token, then one per draft, each conditioned on the drafts before it), and draft i is
kept while it equals the draw at its position. The first disagreeing draw is emitted in its place, or, with
every draft kept, the draw after the last one (the bonus token). Each emitted token is a draw from the
target's distribution given the tokens before it, so the output is distributed exactly as without
speculation; this is the rejection rule min(1, p/q) for a deterministic proposer (q one-hot)."""


def num_accepted(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many leading drafts the draws agree with; sampled_token_ids has one draw per draft and one more."""
    if len(sampled_token_ids) != len(draft_token_ids) + 1:
        raise ValueError(f"sampled_token_ids: need {len(draft_token_ids) + 1} draws, got {len(sampled_token_ids)}")
    count = 0
    while count < len(draft_token_ids) and draft_token_ids[count] == sampled_token_ids[count]:
        count += 1
    return count


def emitted_tokens(draft_token_ids: list[int], sampled_token_ids: list[int]) -> list[int]:
    """The tokens a step yields: the accepted drafts and the draw after them (1 to k + 1 tokens)."""
    return sampled_token_ids[:num_accepted(draft_token_ids, sampled_token_ids) + 1]
