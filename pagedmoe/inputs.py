"""vLLM's prompt dicts (vllm.inputs): a prompt is a string, token ids, or one of these."""
from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]  # requests with different salts never share cached KV blocks


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text of those ids, reported back as RequestOutput.prompt
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt
