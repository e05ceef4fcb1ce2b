"""What every endpoint shares: the model check, prompt building, and the path request -> engine
streams -> (tracked) outputs."""
import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jinja2

from pagedmoe.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedmoe.entrypoints.openai.errors import APIError, bad_request
from pagedmoe.entrypoints.openai.metrics import ServerMetrics
from pagedmoe.entrypoints.openai.protocol import ChatMessage, Tool
from pagedmoe.entrypoints.openai.streaming import merge_streams
from pagedmoe.outputs import RequestOutput
from pagedmoe.sampling_params import SamplingParams


@contextlib.contextmanager
def value_errors_as_400():
    try:
        yield
    except ValueError as e:
        raise bad_request(e) from e


@dataclass
class ServingContext:
    """`tokenizer_thread` runs every tokenizer call off the event loop (a multi-MB prompt takes
    seconds; the HF tokenizer releases the GIL meanwhile). One thread, because a fast tokenizer
    instance is not safe to call from several threads at once; it also keeps calls in arrival order."""
    client: AsyncLLMEngine
    model_name: str
    metrics: ServerMetrics
    auto_tool_parser: str | None = None  # --tool-call-parser, when --enable-auto-tool-choice is on
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pagedmoe-tokenizer"))

    def check_model(self, model: str | None):
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    @property
    def tokenizer(self):
        if self.client.tokenizer is None:
            raise APIError(400, "prompt: text needs a tokenizer (the server skipped it); send token ids",
                           param="prompt", code="invalid_value")
        return self.client.tokenizer

    async def in_tokenizer_thread(self, function, *args, **kwargs):
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, call)

    async def text_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> dict:
        if not isinstance(prompt, str):
            return {"prompt_token_ids": list(prompt)}
        encoded = await self.in_tokenizer_thread(self.tokenizer, prompt, add_special_tokens=add_special_tokens)
        return {"prompt": prompt, "prompt_token_ids": encoded.input_ids}

    async def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[Tool] | None = None) -> dict:
        with value_errors_as_400():
            conversation = [m.as_template_input() for m in messages]
        tools = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
        try:
            text = await self.in_tokenizer_thread(self.tokenizer.apply_chat_template, conversation, tools=tools,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt)
        except (ValueError, jinja2.TemplateError) as e:
            raise APIError(400, f"messages: chat template failed: {e}", param="messages", code="invalid_value")
        return await self.text_prompt(text, add_special_tokens=False)

    def truncated(self, prompt: dict, keep: int | None) -> dict:
        """vLLM's truncate_prompt_tokens, applied where vLLM applies it (the frontend): the last `keep`
        prompt tokens (-1: max_model_len). The text no longer matches, so only the ids go on."""
        if keep is None:
            return prompt
        ids = prompt["prompt_token_ids"]
        keep = self.client.max_model_len if keep == -1 else keep
        return prompt if len(ids) <= keep else {"prompt_token_ids": ids[-keep:]}

    async def open_streams(self, request_id: str, prompts: list[dict], params: SamplingParams,
                           cache_salt: str | None) -> list[RequestStream]:
        """One engine request per prompt; cache_salt rides in the prompt dict, where the engine reads it."""
        arrival, streams = time.time(), []
        try:
            for index, prompt in enumerate(prompts):
                salted = prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}
                streams.append(await self.client.add_request(f"{request_id}-{index}", salted, params, arrival))
        except ValueError as e:
            _close_all(streams)
            raise bad_request(e) from e
        except BaseException:
            _close_all(streams)
            raise
        return streams

    async def tracked(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        trackers = [self.metrics.tracker() for _ in streams]
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for index, output in merged:
                trackers[index].observe(output)
                yield index, output

    async def final_outputs(self, streams: list[RequestStream]) -> list[RequestOutput]:
        finals = [None] * len(streams)
        async for index, output in self.tracked(streams):
            finals[index] = output
        return finals


def _close_all(streams: list[RequestStream]):
    for stream in streams:
        stream.close()


def usage(finals: list[RequestOutput]) -> dict:
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
    completion_tokens = sum(len(choice.token_ids) for out in finals for choice in out.outputs)
    cached_tokens = sum(out.num_cached_tokens for out in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def kv_transfer_params(finals: list[RequestOutput]) -> dict:
    """vLLM's top-level kv_transfer_params of a prefill instance's response, which a P/D proxy hands on."""
    params = next((out.kv_transfer_params for out in finals if out.kv_transfer_params), None)
    return {"kv_transfer_params": params} if params else {}
