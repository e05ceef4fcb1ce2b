import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable

from pagedmoe.beam_search import BeamSearchParams
from pagedmoe.structured_output.params import GuidedDecodingParams, StructuredOutputsParams

INT64_MAX = 2**63 - 1
MIN_TEMPERATURE = 1e-2
_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize",
                "spaces_between_special_tokens")
__all__ = ["SamplingParams", "RequestOutputKind", "BeamSearchParams", "StructuredOutputsParams",
           "GuidedDecodingParams"]


class RequestOutputKind(IntEnum):
    """vLLM's: what each RequestOutput of a streamed request holds."""
    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    logit_bias: dict[int, float] | None = None  # added to the logits of those token ids, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never generated (the last token of each is banned after its prefix)
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens (-1: max_model_len)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logits_processors: list[Callable] | None = None  # fn(output_token_ids, logits_row) -> logits_row, per row
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None  # vLLM's older name: moved into structured_outputs
    extra_args: dict[str, Any] | None = None  # carried, unread
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self._check_types()
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None, "guided_decoding", "cannot be given with structured_outputs",
                   self.guided_decoding)
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.logit_bias is not None:
            self.logit_bias = {int(t): min(max(float(b), -100.0), 100.0) for t, b in self.logit_bias.items()}
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE  # as vLLM: smaller ones overflow the logits / temperature

    def _check_types(self):
        """Types and int64 range first, so that no value can overflow a tensor inside a model step."""
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(value is None or _is_int64(value), name, "must be an integer in int64 range", value)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(_is_finite(value), name, "must be a finite number", value)
        for name in _BOOL_FIELDS:
            _check(isinstance(getattr(self, name), bool), name, "must be a boolean", getattr(self, name))
        ids = self.stop_token_ids or []
        _check(isinstance(ids, (list, tuple)) and all(_is_int64(t) for t in ids), "stop_token_ids",
               "must be a list of integers", ids)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        _check(isinstance(stops, (list, tuple)) and all(isinstance(s, str) for s in stops), "stop",
               "must be a string or a list of strings", self.stop)
        self._check_extra_types()

    def _check_extra_types(self):
        bias = self.logit_bias
        _check(bias is None or (isinstance(bias, dict) and all(_is_token_key(t) and _is_finite(b)
                                                                for t, b in bias.items())),
               "logit_bias", "must map token ids to finite numbers", bias)
        allowed = self.allowed_token_ids
        _check(allowed is None or (isinstance(allowed, (list, tuple)) and len(allowed) > 0
                                   and all(_is_int64(t) and t >= 0 for t in allowed)),
               "allowed_token_ids", "must be a non-empty list of token ids", allowed)
        words = self.bad_words
        _check(words is None or (isinstance(words, (list, tuple)) and all(isinstance(w, str) and w for w in words)),
               "bad_words", "must be a list of non-empty strings", words)
        _check(self.truncate_prompt_tokens is None or _is_int64(self.truncate_prompt_tokens), "truncate_prompt_tokens",
               "must be an integer", self.truncate_prompt_tokens)
        _check(isinstance(self.output_kind, RequestOutputKind) or self.output_kind in (0, 1, 2), "output_kind",
               "must be a RequestOutputKind", self.output_kind)
        self.output_kind = RequestOutputKind(self.output_kind)
        procs = self.logits_processors
        _check(procs is None or (isinstance(procs, (list, tuple)) and all(callable(f) for f in procs)),
               "logits_processors", "must be a list of callables", procs)
        for name, cls in (("structured_outputs", StructuredOutputsParams), ("guided_decoding", GuidedDecodingParams)):
            value = getattr(self, name)
            _check(value is None or isinstance(value, cls), name, f"must be a {cls.__name__}", value)
        _check(self.extra_args is None or isinstance(self.extra_args, dict), "extra_args", "must be a dict",
               self.extra_args)

    def _validate(self):
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.seed is None or 0 <= self.seed <= INT64_MAX - self.num_samples, "seed",
               "must be in [0, 2**63 - n)", self.seed)
        _check(self.best_of is None or self.best_of >= self.n, "best_of", "must be >= n", self.best_of)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0", self.repetition_penalty)
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]",
               self.frequency_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               "must be <= max_tokens", self.min_tokens)
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", "must be >= 0", self.logprobs)
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs", "must be >= 0",
               self.prompt_logprobs)
        _check(all(s for s in self.stop_strings), "stop", "must not contain empty strings", self.stop)
        _check(self.detokenize or not self.stop_strings, "stop", "needs detokenize=True (stop strings match text)",
               self.stop)
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
               or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens", "must be >= 1 or -1",
               self.truncate_prompt_tokens)

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int64(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -INT64_MAX - 1 <= value <= INT64_MAX


def _is_token_key(value) -> bool:
    """A logit_bias key: a token id, or its decimal string (as JSON objects carry it)."""
    if isinstance(value, str):
        return value.strip().lstrip("-").isdigit() and _is_int64(int(value)) and int(value) >= 0
    return _is_int64(value) and value >= 0


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, rule: str, value):
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
