"""Request bodies of the OpenAI API plus vLLM's sampling extras. Types are checked here, values by
SamplingParams and the engine; both answer 400 naming the field."""
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from pagedmoe.sampling_params import SamplingParams

MAX_NESTING = 32
Role = Literal["system", "user", "assistant", "tool", "developer"]


def check_strings(value, path: tuple = ()):
    """Refuses the first string UTF-8 cannot encode (JSON's "\\ud800" escapes decode to lone
    surrogates, which neither the tokenizer nor a JSON response can take), and nesting deeper than
    MAX_NESTING (pydantic and the chat template recurse into it)."""
    if len(path) > MAX_NESTING:
        raise PydanticCustomError("too_deep", f"nested deeper than {MAX_NESTING} levels", {"path": list(path[:8])})
    if isinstance(value, str):
        if not (value.isascii() or _encodes(value)):
            raise PydanticCustomError("invalid_unicode", "not valid Unicode (a lone UTF-16 surrogate)",
                                      {"path": list(path)})
    elif isinstance(value, dict):
        for key, item in value.items():
            check_strings(key, path + (key,))
            check_strings(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, (str, dict, list)):  # skips token id lists fast
                check_strings(item, path + (index,))


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class RequestModel(BaseModel):
    """Checks every string of the raw body (extra fields included) before any field sees it; the
    error's ctx carries the path, which the error handler adds to `param`."""

    @model_validator(mode="before")
    @classmethod
    def _well_formed(cls, data):
        check_strings(data)
        return data


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingRequest(RequestModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    min_tokens: int = 0
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when streaming, got {self.best_of}")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        names = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
                 "ignore_eos", "min_tokens", "skip_special_tokens")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(prompt)


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                raise ValueError("messages: only text content parts are supported")
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool = True

    def to_chat_sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_sampling_params(self.max_completion_tokens or self.max_tokens, logprobs)


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
