"""Stream plumbing: merging per-prompt streams, text deltas, SSE framing, and aborting the engine
requests whenever the client goes away."""
import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedmoe.engine.async_engine import EngineDeadError, RequestRejectedError, RequestStream
from pagedmoe.entrypoints.openai.errors import APIError, error_body
from pagedmoe.outputs import CompletionOutput, RequestOutput

DONE = "data: [DONE]\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) in arrival order; closing the generator aborts the unfinished requests."""
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                output = task.result()
                if not streams[index].finished:
                    pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, output
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            stream.close()


@dataclass
class Delta:
    text: str
    text_start: int
    token_start: int
    token_end: int
    finish_reason: str | None


class DeltaTracker:
    """What one choice adds since the last chunk. Holds back the last len(stop) - 1 characters while
    unfinished, because the engine cuts a stop string out of text that may already have been seen."""

    def __init__(self, holdback: int):
        self.holdback, self.sent_chars, self.sent_tokens, self.done = holdback, 0, 0, False

    def advance(self, output: CompletionOutput) -> Delta | None:
        if self.done:
            return None
        finished = output.finish_reason is not None
        end = len(output.text) if finished else max(len(output.text) - self.holdback, self.sent_chars)
        delta = Delta(output.text[self.sent_chars:end], self.sent_chars, self.sent_tokens, len(output.token_ids),
                      output.finish_reason)
        self.sent_chars, self.sent_tokens, self.done = end, len(output.token_ids), finished
        return delta if delta.text or delta.token_end > delta.token_start or finished else None


def stop_holdback(stop: str | list[str] | None, include_stop_str_in_output: bool) -> int:
    stops = [stop] if isinstance(stop, str) else stop or []
    return 0 if include_stop_str_in_output or not stops else max(len(s) for s in stops) - 1


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def error_event(error: Exception) -> str:
    """A failure after the 200 went out: the OpenAI client raises it from the stream."""
    if isinstance(error, RequestRejectedError):  # the request's own parameters, found out while it ran
        return sse(error_body(400, str(error), code="invalid_value"))
    code = "engine_dead" if isinstance(error, EngineDeadError) else "internal_error"
    return sse(error_body(500, str(error), code=code))


class SSEResponse(StreamingResponse):
    """Closes its generator however the response ends, so a disconnect aborts the requests now
    rather than when the garbage collector finalizes the generator."""

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def unless_disconnected(request: Request, work):
    """Runs `work` (a coroutine) and cancels it if the client disconnects first."""
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task not in done:
        raise APIError(499, "client disconnected", code="client_disconnected")
    return task.result()


async def _disconnected(request: Request):
    while (await request.receive())["type"] != "http.disconnect":
        pass
