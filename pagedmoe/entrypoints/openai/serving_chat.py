"""/v1/chat/completions: messages through the chat template, n assistant replies, whole or streamed."""
import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator

from fastapi import Request

from pagedmoe.entrypoints.openai.errors import APIError
from pagedmoe.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs
from pagedmoe.entrypoints.openai.output_constraints import errors_named_after, structured_outputs
from pagedmoe.entrypoints.openai.protocol import ChatCompletionRequest
from pagedmoe.entrypoints.openai.serving import ServingContext, kv_transfer_params, usage, value_errors_as_400
from pagedmoe.entrypoints.openai.streaming import (DONE, Delta, DeltaTracker, SSEResponse, error_event, sse,
                                                   stop_holdback, unless_disconnected)
from pagedmoe.entrypoints.openai.tool_calls import (ToolDeltaTracker, ToolPlan, plan_tools, tool_finish_reason,
                                                    tool_message)
from pagedmoe.outputs import CompletionOutput


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request):
    ctx.check_model(body.model)
    plan = plan_tools(body, ctx.auto_tool_parser)
    with value_errors_as_400():
        source, constraint = structured_outputs(body, plan.schema)
        params = body.to_chat_sampling_params(constraint)
    prompt = await ctx.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
    prompt = ctx.truncated(prompt, body.truncate_prompt_tokens)
    request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    with _chat_field_names(), errors_named_after(source):
        streams = await ctx.open_streams(request_id, [prompt], params, body.cache_salt)
    header = {"id": request_id, "created": created, "model": ctx.model_name}
    if body.stream:
        return SSEResponse(_events(ctx, streams, body, plan, {**header, "object": "chat.completion.chunk"}))
    finals = await unless_disconnected(raw, ctx.final_outputs(streams))
    choices = [_choice(out, body, plan) for out in finals[0].outputs]
    response = {**header, "object": "chat.completion", "choices": choices, "usage": usage(finals)}
    response |= kv_transfer_params(finals)
    if body.prompt_logprobs is not None:  # vLLM's extra, beside the choices
        response["prompt_logprobs"] = prompt_logprobs(finals[0].prompt_logprobs)
    return response


def _choice(out: CompletionOutput, body: ChatCompletionRequest, plan: ToolPlan) -> dict:
    message, finish_reason = {"role": "assistant", "content": out.text}, out.finish_reason
    if plan.parser is not None:
        extraction = plan.parser.extract(out.text)
        message, finish_reason = tool_message(extraction), tool_finish_reason(plan.parser, bool(extraction.calls),
                                                                                 out.finish_reason)
    return {"index": out.index, "message": message, "logprobs": _logprobs(out, 0, len(out.token_ids), body),
            "finish_reason": finish_reason, "stop_reason": out.stop_reason}


async def _events(ctx: ServingContext, streams, body: ChatCompletionRequest, plan: ToolPlan,
                  header: dict) -> AsyncIterator[str]:
    roles = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(body.n)]
    yield sse({**header, "choices": roles})
    deltas = defaultdict(lambda: DeltaTracker(stop_holdback(body.stop, body.include_stop_str_in_output)))
    tools = defaultdict(lambda: ToolDeltaTracker(plan.parser))
    final = None
    try:
        async with contextlib.aclosing(ctx.tracked(streams)) as outputs:
            async for _, final in outputs:
                for out in final.outputs:
                    delta = deltas[out.index].advance(out)
                    if delta is None:
                        continue
                    if plan.parser is None:
                        choice = _delta_choice(out, delta, {"content": delta.text}, out.finish_reason, body)
                    else:
                        choice = _tool_delta_choice(out, delta, tools[out.index], body)
                    if choice is not None:
                        yield sse({**header, "choices": [choice]})
        if body.include_usage:
            yield sse({**header, "choices": [], "usage": usage([final])})
    except Exception as e:
        yield error_event(e)
    yield DONE


def _tool_delta_choice(out: CompletionOutput, delta: Delta, tracker: ToolDeltaTracker,
                       body: ChatCompletionRequest) -> dict | None:
    """What the tool parser makes of the text sent so far; None while it holds everything back."""
    finished = delta.finish_reason is not None
    message = tracker.advance(out.text[:delta.text_start + len(delta.text)], finished)
    if not (message or finished or delta.token_end > delta.token_start and body.logprobs):
        return None
    finish_reason = tool_finish_reason(tracker.parser, tracker.made_calls, out.finish_reason) if finished \
        else out.finish_reason
    return _delta_choice(out, delta, message, finish_reason, body)


def _delta_choice(out: CompletionOutput, delta: Delta, message: dict, finish_reason: str | None,
                  body: ChatCompletionRequest) -> dict:
    return {"index": out.index, "delta": message, "logprobs": _logprobs(out, delta.token_start, delta.token_end, body),
            "finish_reason": finish_reason, "stop_reason": out.stop_reason}


@contextlib.contextmanager
def _chat_field_names():
    """The engine checks its `logprobs` count, which chat requests spell `top_logprobs`."""
    try:
        yield
    except APIError as e:
        if e.param == "logprobs":
            e.param, e.message = "top_logprobs", "top_logprobs" + e.message.removeprefix("logprobs")
        raise


def _logprobs(out: CompletionOutput, start: int, end: int, body: ChatCompletionRequest) -> dict | None:
    if not body.logprobs or out.logprobs is None:
        return None
    return chat_logprobs(out.logprobs[start:end], out.token_ids[start:end], body.top_logprobs or 0)
