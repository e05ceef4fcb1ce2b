"""Request bodies of the OpenAI API plus vLLM's sampling extras. Types are checked here, values by
SamplingParams and the engine; both answer 400 naming the field."""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator
from pydantic_core import PydanticCustomError

from pagedmoe.beam_search import BeamSearchParams
from pagedmoe.sampling_params import SamplingParams, StructuredOutputsParams

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


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" or "json_schema"."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's structured_outputs object; exactly one of json, regex, choice, grammar, json_object."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: str | None = None
    disable_fallback: StrictBool = False
    disable_any_whitespace: StrictBool = True
    disable_additional_properties: StrictBool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    def to_params(self) -> StructuredOutputsParams:
        fields = self.model_dump(exclude_none=True)
        return StructuredOutputsParams(json=fields.pop("json_", None), **fields)


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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: StrictBool = True
    prompt_logprobs: int | None = None
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted for vLLM scripts: xgrammar is the one backend
    guided_whitespace_pattern: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's P/D hand-off (see kv_transfer/connector.py)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams | BeamSearchParams:
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise ValueError(f"best_of must equal n ({self.n}) when streaming, got {self.best_of}")
        if self.use_beam_search:
            return self.to_beam_search_params(max_tokens, structured)
        names = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "stop", "stop_token_ids", "include_stop_str_in_output",
                 "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "logit_bias",
                 "allowed_token_ids", "bad_words", "truncate_prompt_tokens")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        extra = {"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None
        return SamplingParams(**given, max_tokens=max_tokens, logprobs=logprobs, structured_outputs=structured,
                              prompt_logprobs=self.engine_prompt_logprobs, extra_args=extra)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def to_beam_search_params(self, max_tokens: int | None, structured) -> BeamSearchParams:
        """vLLM's use_beam_search: n beams, deterministic, whole answers only."""
        if self.stream:
            raise ValueError("use_beam_search cannot be streamed: beams reorder until the search ends")
        if structured is not None:
            raise ValueError("use_beam_search cannot be combined with structured outputs or tools")
        if max_tokens is None:
            raise ValueError("max_tokens is required with use_beam_search")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
                                length_penalty=self.length_penalty)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False
    suffix: str | None = None

    def to_completion_params(self, structured: StructuredOutputsParams | None):
        if self.suffix is not None:
            raise ValueError("suffix is not supported: pagedmoe models have no fill-in-the-middle prompt")
        return self.to_sampling_params(self.max_tokens, self.logprobs, structured)

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs returns the prompt's logprobs too, as OpenAI's API does."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

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


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" for part in self.content):
                raise ValueError("messages: only text content parts are supported")
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool = True

    def to_chat_sampling_params(self, structured: StructuredOutputsParams | None = None):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_sampling_params(self.max_completion_tokens or self.max_tokens, logprobs, structured)


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
