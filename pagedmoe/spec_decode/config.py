import json
import os
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model", "eagle3", "mtp")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": ..,
    "prompt_lookup_max": .., "disable_by_batch_size": ..}, or {"method": "draft_model", "model": DIR,
    "draft_sample_method": "greedy" | "probabilistic"}, {"method": "eagle3", "model": HEAD_DIR}, {"method": "mtp"}."""
    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model's or EAGLE-3 head's directory
    draft_sample_method: str = "greedy"  # draft tokens by argmax, or sampled from the draft's distribution
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None  # no new drafts while more sequences than this are running
    adaptive: bool = True  # pagedmoe's: speculate only at batch sizes where it measures faster (adaptive.py)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, got {self.method!r}")
        self._check_model()
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int >= 1, "
                             f"got {self.num_speculative_tokens!r}")
        self._default_lookup()
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 1")

    def _check_model(self):
        needs_model = self.method in ("draft_model", "eagle3")
        if needs_model and not (isinstance(self.model, str) and os.path.isdir(self.model)):
            raise ValueError(f"speculative_config.model: method {self.method!r} needs the draft's directory, "
                             f"got {self.model!r}")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(f"speculative_config.draft_sample_method must be one of {list(DRAFT_SAMPLE_METHODS)}, "
                             f"got {self.draft_sample_method!r}")

    @property
    def uses_hidden_states(self) -> bool:
        """Whether the proposer drafts from the target's hidden states (MTP), whose KV entry at a position
        also depends on the token after it: a prefix-cache hit's last block is computed again."""
        return self.method in ("mtp", "eagle3")

    @property
    def uses_draft_kv(self) -> bool:
        """Whether the proposer keeps KV of its own in the target's blocks (it writes past the step's tokens)."""
        return self.method != "ngram"

    def _default_lookup(self):
        """As vLLM: both unset -> 5; one set -> the other takes its value."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        low, high = (5, 5) if low is None and high is None else (low or high, high or low)
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min!r} and {self.prompt_lookup_max!r}")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high


def parse_speculative_config(value: "dict | str | SpeculativeConfig | None") -> SpeculativeConfig | None:
    """The engine argument as a dict, a JSON string (the CLI's --speculative-config) or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config: not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict or JSON object, got {type(value).__name__}")
    names = {f.name for f in fields(SpeculativeConfig)}
    if unknown := sorted(set(value) - names):
        raise ValueError(f"speculative_config: unknown keys {unknown}")
    if missing := sorted({"method", "num_speculative_tokens"} - set(value)):
        raise ValueError(f"speculative_config: missing {missing}")
    return SpeculativeConfig(**value)
