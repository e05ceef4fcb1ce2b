from dataclasses import dataclass, field

import torch

from pagedmoe.logprobs import Logprob, PromptLogprobs, SampleLogprobs  # noqa: F401 (also importable from here)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = field(default=None)
    kv_transfer_params: dict | None = None  # a prefill instance's hand-off for the decode instance (vLLM's)
    bad_input: bool = False  # the error came from the request's own parameters (a server answers 400)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's LLM.embed result."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """vLLM's LLM.encode result."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
