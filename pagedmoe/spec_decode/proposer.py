from dataclasses import dataclass, field

from pagedmoe.spec_decode.config import SpeculativeConfig
from pagedmoe.spec_decode.draft_model import DraftModelProposer
from pagedmoe.spec_decode.eagle import Eagle3Proposer
from pagedmoe.spec_decode.mtp import MTPProposer
from pagedmoe.spec_decode.ngram import propose_ngram


@dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters, since the engine started."""
    num_drafts: int = 0  # sequence-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def copy(self) -> "SpecDecodeStats":
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.num_accepted_tokens_per_pos))

    def record(self, num_draft_tokens: int, num_accepted: int):
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1


def max_draft_tokens(seq, k: int, max_model_len: int) -> int:
    """k, capped so that the drafts and the token after them fit max_tokens and max_model_len."""
    return max(min(k, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - len(seq) - 1), 0)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seqs: list, ks: list[int]) -> list[tuple[list[int], None]]:
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        return [(propose_ngram(seq.token_ids, low, high, k), None) for seq, k in zip(seqs, ks)]


def make_drafter(config, target):
    """The draft model, MTP layer or EAGLE-3 head the worker runs and keeps KV for, else None (n-gram)."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "eagle3":
        return Eagle3Proposer(config, spec, target)
    return MTPProposer(config, spec) if spec.method == "mtp" else DraftModelProposer(config, spec)


def make_proposer(config: SpeculativeConfig | None, drafter=None):
    """What drafts: prompt lookup, or the worker's draft model."""
    if config is None:
        return None
    return NgramProposer(config) if config.method == "ngram" else drafter
