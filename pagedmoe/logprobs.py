"""vLLM's logprob types (vllm.logprobs)."""
from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # one entry per output token
PromptLogprobs = list[dict[int, Logprob] | None]  # one entry per prompt token; the first is None
