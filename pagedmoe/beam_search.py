from dataclasses import dataclass, field


@dataclass
class BeamSearchParams:
    """vLLM's beam-search parameters (deterministic: the top beam_width continuations by log probability)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 for beam search, got {self.temperature}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt and output
    cum_logprob: float
    text: str = ""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass
class BeamCandidate:
    score: float  # cumulative logprob of the beam extended by token
    beam_index: int
    token_id: int
    logprob: float


def select_beams(candidates: list[BeamCandidate], beam_width: int, eos_token_ids: set[int]):
    """HF's rule: walk candidates best first; an EOS candidate ranked within the first beam_width becomes a
    finished hypothesis, any other fills the next beam until beam_width beams are chosen."""
    chosen, finished = [], []
    for rank, cand in enumerate(sorted(candidates, key=lambda c: -c.score)):
        if cand.token_id in eos_token_ids:
            if rank < beam_width:
                finished.append(cand)
            continue
        chosen.append(cand)
        if len(chosen) == beam_width:
            break
    return chosen, finished


def beam_score(cum_logprob: float, num_output_tokens: int, length_penalty: float) -> float:
    return cum_logprob / max(num_output_tokens, 1) ** length_penalty
