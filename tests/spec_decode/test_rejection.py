"""The rejection rule for sampled drafts (Sampler._reject), on hand-computed cases and statistically: over
many rows of one (p, q) pair with drafts drawn from q, the emitted tokens have p's distribution, not q's."""
import torch

from pagedmoe.layers.sampler import Sampler, SamplingBatch

VOCAB = 6


def batch_of(num_rows: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor, top_p: float = 1.0) -> SamplingBatch:
    ones, zeros = torch.ones(num_rows), torch.zeros(num_rows)
    return SamplingBatch(ones, ones * top_p, zeros.long(), zeros, ones, zeros, zeros, None, None, None,
                         [None] * num_rows, -1, draft_ids, draft_probs)


def verify(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, seed: int = 0, top_p: float = 1.0) -> torch.Tensor:
    num_rows = len(drafts)
    logits = p.log().expand(num_rows, VOCAB).clone()
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits, batch_of(num_rows, drafts, q.expand(num_rows, VOCAB).clone(), top_p)).token_ids


def test_a_draft_the_target_likes_more_is_always_kept():
    p, q = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]), torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    assert (verify(p, q, torch.zeros(500, dtype=torch.long)) == 0).all()  # p(0) >= q(0)


def test_a_draft_the_target_rules_out_is_never_kept():
    p, q = torch.tensor([0.0, 0.4, 0.3, 0.2, 0.1, 0.0]), torch.full((VOCAB,), 1 / VOCAB)
    tokens = verify(p, q, torch.zeros(500, dtype=torch.long))
    assert (tokens != 0).all() and (tokens != 5).all()  # rejected, and the residual has no mass there


def test_rows_without_a_draft_sample_as_usual():
    p, q = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]), torch.zeros(VOCAB)
    tokens = verify(p, q, torch.full((4000,), -1, dtype=torch.long))
    assert abs((tokens == 0).double().mean().item() - 0.5) < 0.05


def test_emitted_tokens_have_the_target_distribution():
    """200k rows, TV bound 0.01 (its standard deviation here is about 0.002): near p, and far from q."""
    g = torch.Generator().manual_seed(3)
    p = torch.rand(VOCAB, generator=g, dtype=torch.float64).pow(3).float()
    p, q = p / p.sum(), torch.rand(VOCAB, generator=g).softmax(0)
    drafts = torch.multinomial(q, 200_000, replacement=True, generator=g)
    tokens = verify(p, q, drafts, seed=5)
    empirical = torch.bincount(tokens, minlength=VOCAB).double() / len(tokens)
    assert 0.5 * (empirical - p).abs().sum() < 0.01
    assert 0.5 * (empirical - q).abs().sum() > 0.2
    assert (tokens == drafts).double().mean() > 0.3  # many drafts kept: the rule was exercised both ways


def test_top_p_applies_before_the_rule():
    """Verified against the target's nucleus (top-p 0.7 keeps tokens 0 and 1 only)."""
    p, q = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02]), torch.full((VOCAB,), 1 / VOCAB)
    drafts = torch.multinomial(q, 50_000, replacement=True, generator=torch.Generator().manual_seed(1))
    tokens = verify(p, q, drafts, top_p=0.7)
    assert set(tokens.tolist()) <= {0, 1}
    assert abs((tokens == 0).double().mean().item() - 0.5 / 0.8) < 0.01
