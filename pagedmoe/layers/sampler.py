from dataclasses import dataclass

import torch

from pagedmoe.layers import cpu_ops


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device."""
    temperature: torch.Tensor  # [R]; 0 means greedy
    top_p: torch.Tensor
    top_k: torch.Tensor  # [R]; 0 means off
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    output_counts: torch.Tensor | None  # [R, V] occurrences of each token in the output so far
    prompt_mask: torch.Tensor | None  # [R, V] tokens present in the prompt
    banned: torch.Tensor | None  # [R, V] tokens masked out (stop tokens before min_tokens)
    generators: list[torch.Generator | None]
    max_num_logprobs: int  # -1: no logprobs needed
    draft_token_ids: torch.Tensor | None = None  # [R] a draft sampled from a distribution q to verify, or -1
    draft_probs: torch.Tensor | None = None  # [R, V] that q (rows with a draft only)
    logit_bias: torch.Tensor | None = None  # [R, V] added to the logits (-inf: never sampled)
    token_bitmask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32: bit t of a row set = token t allowed

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    @property
    def is_plain_greedy(self) -> bool:
        """Every row the argmax of its raw logits: greedy, no logprobs, penalties, masks, bias or drafts to
        verify against a distribution."""
        masks = (self.output_counts, self.banned, self.logit_bias, self.token_bitmask, self.draft_probs)
        return self.max_num_logprobs < 0 and all(m is None for m in masks) and self.all_greedy


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R]
    logprobs: torch.Tensor | None  # [R] logprob of the sampled token under the model's distribution
    ranks: torch.Tensor | None
    top_ids: torch.Tensor | None  # [R, N]
    top_logprobs: torch.Tensor | None


class Sampler:
    """Vectorised over the batch: penalties, masking, greedy or temperature/top-k/top-p/min-p sampling
    by inverting each row's CDF at one uniform draw, with per-row generators for seeded requests."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_num_logprobs >= 0 else None
        logits = apply_penalties(logits, batch)
        logits = apply_constraints(logits, batch)
        token_ids = greedy(logits)
        if not batch.all_greedy:
            sampled = self._sample(logits, batch)
            token_ids = torch.where(batch.temperature == 0, token_ids, sampled)
        return gather_logprobs(raw_logprobs, token_ids, batch.max_num_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = sampling_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)
        token_ids = inverse_cdf(probs, uniform_noise(range(len(probs)), batch.generators, self.generator))
        if batch.draft_probs is not None:
            token_ids = self._reject(probs, token_ids, batch)
        return token_ids

    def _reject(self, probs, token_ids, batch: SamplingBatch) -> torch.Tensor:
        """Rows verifying a draft d ~ q (Leviathan et al. 2023): d is kept with probability min(1, p(d) / q(d)),
        else the row draws from norm(max(0, p - q)). P(x) = min(p, q)(x) + max(0, p - q)(x) = p(x): the
        row's token is distributed as the target's. A rejection never draws d (its residual is 0)."""
        rows = (batch.draft_token_ids >= 0).nonzero().squeeze(1)
        drafts, p, q = batch.draft_token_ids[rows], probs[rows], batch.draft_probs[rows].float()
        p_draft, q_draft = p.gather(1, drafts[:, None])[:, 0], q.gather(1, drafts[:, None])[:, 0]
        uniform = uniform_noise(rows.tolist(), batch.generators, self.generator).to(p.device)
        accept = uniform * q_draft <= p_draft
        residual = (p - q).clamp_(min=0)
        has_residual = residual.sum(dim=-1) > 0
        recovered = inverse_cdf(torch.where(has_residual[:, None], residual, p),
                                uniform_noise(rows.tolist(), batch.generators, self.generator))
        recovered = torch.where(has_residual, recovered, token_ids[rows])
        token_ids = token_ids.clone()
        token_ids[rows] = torch.where(accept, drafts, recovered)
        return token_ids


class NoTokenAllowedError(ValueError):
    """The request's own constraints leave no token to sample: its input's fault, not the engine's."""
    is_bad_input = True  # engine/isolation.py: a server answers it with a 400


def apply_constraints(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """min_tokens bans, logit_bias / allowed_token_ids / bad_words, then the grammar's bitmask. A row left
    with no token raises: the engine fails that request alone (engine/isolation.py)."""
    if batch.banned is not None:
        logits = logits.masked_fill(batch.banned, float("-inf"))
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    if batch.token_bitmask is not None:
        logits = logits.masked_fill(~unpack_bitmask(batch.token_bitmask, logits.shape[-1]), float("-inf"))
    if batch.logit_bias is not None or batch.token_bitmask is not None:
        if bool(torch.isneginf(logits.amax(dim=-1)).any()):
            raise NoTokenAllowedError("no token may be sampled: allowed_token_ids, logit_bias, bad_words and "
                                      "the structured output's grammar together exclude every token")
    return logits


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool, bit j of word w for token 32 w + j (xgrammar's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    token_ids = cpu_ops.greedy_argmax(logits)
    return logits.argmax(dim=-1) if token_ids is None else token_ids


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    if batch.output_counts is None:
        return logits
    seen = batch.output_counts > 0
    if batch.prompt_mask is not None:
        seen = seen | batch.prompt_mask
    penalty = torch.where(seen, batch.repetition_penalty[:, None], 1.0)
    logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - batch.frequency_penalty[:, None] * batch.output_counts
    return logits - batch.presence_penalty[:, None] * (batch.output_counts > 0)


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """The distribution rows sample from: temperature (0, greedy, as 1), then top-k, top-p and min-p."""
    temperature = torch.where(temperature == 0, 1.0, temperature)
    logits = logits / temperature[:, None]
    rows = ((top_k > 0) | (top_p < 1) | (min_p > 0)).nonzero().squeeze(1)
    if len(rows) == len(logits):
        logits = filter_top_k_top_p_min_p(logits, top_k, top_p, min_p)
    elif len(rows):  # the sort costs more than the rest of sampling: only rows with a filter pay it
        logits[rows] = filter_top_k_top_p_min_p(logits[rows], top_k[rows], top_p[rows], min_p[rows])
    return logits.softmax(dim=-1)


def filter_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                             min_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    top_k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
    drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    drop[:, 0] = False
    return logits.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row r's token is the first whose cumulative probability passes uniform[r] * (the row's total): one
    random number a row, where a race of exponentials needs one per vocab entry (17 ns each on CPU). The
    clamp keeps float64 rounding at the top end off trailing zero-probability tokens."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniform.to(cdf.device) * cdf[:, -1])[:, None]
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    last_possible = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(token_ids, last_possible)


def uniform_noise(rows, generators: list[torch.Generator | None],
                  default: torch.Generator) -> torch.Tensor:
    """U[0, 1) per row, float64 (float32 draws exact zeros too often), seeded rows from their generator."""
    noise = torch.empty(len(rows), dtype=torch.float64, device=default.device).uniform_(generator=default)
    for index, row in enumerate(rows):
        if generators[row] is not None:
            noise[index] = torch.empty(1, dtype=torch.float64).uniform_(generator=generators[row]).item()
    return noise


def gather_logprobs(raw_logprobs: torch.Tensor | None, token_ids: torch.Tensor, num_top: int) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(token_ids, None, None, None, None)
    token_logprobs = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (raw_logprobs > token_logprobs[:, None]).sum(dim=-1) + 1
    top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1) if num_top > 0 else (None, None)
    return SamplerOutput(token_ids, token_logprobs, ranks, top_ids, top_logprobs)
