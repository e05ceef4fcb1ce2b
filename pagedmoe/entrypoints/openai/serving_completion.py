"""/v1/completions: prompt(s) in, n choices per prompt out, whole or streamed."""
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from pagedmoe.entrypoints.openai.logprobs import completion_logprobs, echo_logprobs, joined_logprobs, prompt_logprobs
from pagedmoe.entrypoints.openai.output_constraints import errors_named_after, structured_outputs
from pagedmoe.entrypoints.openai.protocol import CompletionRequest
from pagedmoe.entrypoints.openai.serving import ServingContext, kv_transfer_params, usage, value_errors_as_400
from pagedmoe.entrypoints.openai.streaming import (DONE, DeltaTracker, SSEResponse, error_event, sse, stop_holdback,
                                                   unless_disconnected)
from pagedmoe.outputs import CompletionOutput, RequestOutput

OBJECT = "text_completion"


@dataclass
class PromptPart:
    """What a choice shows of its prompt: the echoed text (and its logprobs), vLLM's prompt_logprobs."""
    text: str = ""
    logprobs: dict | None = None
    prompt_logprobs: list | None = None


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: Request):
    ctx.check_model(body.model)
    with value_errors_as_400():
        source, constraint = structured_outputs(body)
        params = body.to_completion_params(constraint)
        prompts = [ctx.truncated(await ctx.text_prompt(prompt), body.truncate_prompt_tokens)
                   for prompt in body.prompts()]
    request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    with errors_named_after(source):
        streams = await ctx.open_streams(request_id, prompts, params, body.cache_salt)
    header = {"id": request_id, "object": OBJECT, "created": created, "model": ctx.model_name}
    if body.stream:
        return SSEResponse(_events(ctx, streams, body, header))
    finals = await unless_disconnected(raw, ctx.final_outputs(streams))
    choices = []
    for index, final in enumerate(finals):
        part = await _prompt_part(ctx, final, body)
        choices += [_choice(index * body.n + out.index, out.text, out, 0, len(out.token_ids), body, part)
                    for out in final.outputs[:body.n]]
    return {**header, "choices": choices, "usage": usage(finals)} | kv_transfer_params(finals)


async def _events(ctx: ServingContext, streams, body: CompletionRequest, header: dict) -> AsyncIterator[str]:
    deltas = defaultdict(lambda: DeltaTracker(stop_holdback(body.stop, body.include_stop_str_in_output)))
    finals, parts, started = [None] * len(streams), {}, set()
    try:
        async with contextlib.aclosing(ctx.tracked(streams)) as outputs:
            async for index, final in outputs:
                finals[index] = final
                for out in final.outputs:
                    number = index * body.n + out.index
                    delta = deltas[number].advance(out)
                    if delta is None:
                        continue
                    if index not in parts:
                        parts[index] = await _prompt_part(ctx, final, body)
                    choice = _choice(number, delta.text, out, delta.token_start, delta.token_end, body, parts[index],
                                     delta.text_start, first=number not in started)
                    started.add(number)
                    yield sse({**header, "choices": [choice]})
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": usage(finals)})
    except Exception as e:
        yield error_event(e)
    yield DONE


async def _prompt_part(ctx: ServingContext, final: RequestOutput, body: CompletionRequest) -> PromptPart:
    part = PromptPart(prompt_logprobs=prompt_logprobs(final.prompt_logprobs) if body.prompt_logprobs else None)
    if not body.echo:
        return part
    ids = final.prompt_token_ids
    part.text = final.prompt if final.prompt is not None else await ctx.in_tokenizer_thread(ctx.tokenizer.decode, ids)
    if body.logprobs is not None and final.prompt_logprobs is not None:
        first = await ctx.in_tokenizer_thread(ctx.tokenizer.decode, ids[:1])
        part.logprobs = echo_logprobs(final.prompt_logprobs, ids, first)
    return part


def _choice(number: int, text: str, out: CompletionOutput, token_start: int, token_end: int,
            body: CompletionRequest, part: PromptPart, text_start: int = 0, first: bool = True) -> dict:
    """text_start: where `text` starts in the output (a stream's delta). The prompt part goes with the
    first chunk of a choice; the echoed text comes before the output."""
    logprobs = None
    if body.logprobs is not None and out.logprobs is not None:
        logprobs = completion_logprobs(out.logprobs[token_start:token_end], out.token_ids[token_start:token_end],
                                       text_start + len(part.text))
        logprobs = joined_logprobs(part.logprobs, logprobs) if first else logprobs
    choice = {"index": number, "text": (part.text if first else "") + text, "logprobs": logprobs,
              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
    if first and part.prompt_logprobs is not None:
        choice["prompt_logprobs"] = part.prompt_logprobs
    return choice
