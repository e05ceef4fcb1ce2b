"""/v1/completions: prompt(s) in, n choices per prompt out, whole or streamed."""
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi import Request

from pagedmoe.entrypoints.openai.errors import APIError
from pagedmoe.entrypoints.openai.logprobs import completion_logprobs
from pagedmoe.entrypoints.openai.protocol import CompletionRequest
from pagedmoe.entrypoints.openai.serving import ServingContext, usage, value_errors_as_400
from pagedmoe.entrypoints.openai.streaming import (DONE, Delta, DeltaTracker, SSEResponse, error_event, sse,
                                                   stop_holdback, unless_disconnected)
from pagedmoe.outputs import CompletionOutput

OBJECT = "text_completion"


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: Request):
    ctx.check_model(body.model)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo", code="unsupported")
    with value_errors_as_400():
        params = body.to_sampling_params(body.max_tokens, body.logprobs)
        prompts = [await ctx.text_prompt(prompt) for prompt in body.prompts()]
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    streams = await ctx.open_streams(request_id, prompts, params, body.cache_salt)
    header = {"id": request_id, "object": OBJECT, "created": created, "model": ctx.model_name}
    if body.stream:
        return SSEResponse(_events(ctx, streams, body, header))
    finals = await unless_disconnected(raw, ctx.final_outputs(streams))
    choices = [_choice(index * body.n + out.index, out.text, out, 0, len(out.token_ids), 0, body)
               for index, final in enumerate(finals) for out in final.outputs]
    return {**header, "choices": choices, "usage": usage(finals)}


async def _events(ctx: ServingContext, streams, body: CompletionRequest, header: dict) -> AsyncIterator[str]:
    deltas = defaultdict(lambda: DeltaTracker(stop_holdback(body.stop, body.include_stop_str_in_output)))
    finals = [None] * len(streams)
    try:
        async with contextlib.aclosing(ctx.tracked(streams)) as outputs:
            async for index, final in outputs:
                finals[index] = final
                for out in final.outputs:
                    number = index * body.n + out.index
                    delta = deltas[number].advance(out)
                    if delta is not None:
                        yield sse({**header, "choices": [_delta_choice(number, delta, out, body)]})
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": usage(finals)})
    except Exception as e:
        yield error_event(e)
    yield DONE


def _delta_choice(number: int, delta: Delta, out: CompletionOutput, body: CompletionRequest) -> dict:
    return _choice(number, delta.text, out, delta.token_start, delta.token_end, delta.text_start, body)


def _choice(number: int, text: str, out: CompletionOutput, token_start: int, token_end: int,
            text_offset: int, body: CompletionRequest) -> dict:
    logprobs = None
    if body.logprobs is not None and out.logprobs is not None:
        logprobs = completion_logprobs(out.logprobs[token_start:token_end], out.token_ids[token_start:token_end],
                                       text_offset)
    return {"index": number, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason}
