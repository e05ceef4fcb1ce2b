import math
from dataclasses import dataclass, field

INT64_MAX = 2**63 - 1
MIN_TEMPERATURE = 1e-2
_INT_FIELDS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")


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
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        self._check_types()
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
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

    @property
    def num_samples(self) -> int:
        return self.best_of or self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int64(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -INT64_MAX - 1 <= value <= INT64_MAX


def _is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, rule: str, value):
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
