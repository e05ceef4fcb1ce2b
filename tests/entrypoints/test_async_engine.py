import asyncio
import threading

import pytest

from conftest import assert_all_blocks_free
from pagedmoe import SamplingParams
from pagedmoe.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from pagedmoe.engine.llm_engine import LLMEngine
from pagedmoe.entrypoints.openai.streaming import DeltaTracker, stop_holdback
from pagedmoe.outputs import CompletionOutput
from server_utils import wait_until

PROMPT = "ROMEO: But soft"


@pytest.fixture
def engine(text_model) -> LLMEngine:
    return LLMEngine.from_engine_args(text_model[0], dtype="float32", num_kv_blocks=64, max_num_seqs=2)


def run(client: AsyncLLMEngine, coro):
    try:
        return asyncio.run(asyncio.wait_for(coro, 30))
    finally:
        client.shutdown()


def test_outputs_stream_in_order_from_the_engine_thread(engine):
    client = AsyncLLMEngine(engine).start()
    callers = set()

    async def collect():
        stream = await client.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outputs = []
        async for output in stream:
            callers.add(threading.current_thread().name)
            outputs.append(output)
        return outputs
    outputs = run(client, collect())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4, 5, 6]
    assert [o.finished for o in outputs] == [False] * 5 + [True]
    assert callers == {threading.main_thread().name} and client.snapshot.stats.num_finished_requests == 1
    assert_all_blocks_free(engine)


def test_rejections_raise_from_add_request(engine):
    client = AsyncLLMEngine(engine, max_waiting_requests=0).start()

    async def add():
        with pytest.raises(QueueFullError):
            await client.add_request("full", PROMPT, SamplingParams())
        client.max_waiting_requests = 8
        with pytest.raises(ValueError, match="prompt"):
            await client.add_request("empty", [], SamplingParams())
    run(client, add())
    assert_all_blocks_free(engine)


def test_closing_a_stream_aborts_and_frees(engine):
    client = AsyncLLMEngine(engine, snapshot_interval=0.01).start()

    async def abandon():
        stream = await client.add_request("r", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        stream.close()
        await asyncio.to_thread(wait_until, lambda: not engine.has_unfinished_requests(), 10, "not aborted")
    run(client, abandon())
    assert_all_blocks_free(engine)


def test_engine_death_fails_open_and_new_requests(engine):
    client = AsyncLLMEngine(engine).start()

    async def die():
        stream = await client.add_request("r", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        engine.step = lambda: 1 / 0
        with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await client.add_request("late", PROMPT, SamplingParams())
    run(client, die())
    assert not client.is_healthy and isinstance(client.error, ZeroDivisionError)


def test_shutdown_fails_in_flight_requests(engine):
    client = AsyncLLMEngine(engine).start()

    async def stop():
        stream = await client.add_request("r", PROMPT, SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        await asyncio.to_thread(client.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
    run(client, stop())


def _output(text: str, num_tokens: int, finish_reason=None) -> CompletionOutput:
    return CompletionOutput(0, text, list(range(num_tokens)), None, None, finish_reason)


def test_delta_tracker_never_streams_text_a_stop_string_later_removes():
    tracker = DeltaTracker(stop_holdback(["END"], include_stop_str_in_output=False))
    sent = [tracker.advance(_output("abcE", 1)), tracker.advance(_output("abcEN", 2)),
            tracker.advance(_output("abc", 3, "stop")), tracker.advance(_output("abc", 3, "stop"))]
    assert [d.text if d else None for d in sent] == ["ab", "c", "", None]
    assert sent[2].finish_reason == "stop" and (sent[1].token_start, sent[1].token_end) == (1, 2)
    assert stop_holdback("END", include_stop_str_in_output=True) == 0 and stop_holdback(None, False) == 0


def test_an_idle_engine_keeps_its_snapshot_and_only_moves_its_time(engine, monkeypatch):
    import pagedmoe.engine.async_engine as async_engine
    taken = []
    take = async_engine.take_snapshot
    monkeypatch.setattr(async_engine, "take_snapshot", lambda e: taken.append(1) or take(e))
    client = AsyncLLMEngine(engine, snapshot_interval=0.01).start()

    async def idle_then_serve():
        first, num_taken = client.snapshot.time, len(taken)  # the constructor takes the first
        await asyncio.sleep(0.3)
        assert client.snapshot.time > first and len(taken) == num_taken
        stream = await client.add_request("r", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
        async for _ in stream:
            pass
        await asyncio.to_thread(wait_until, lambda: client.snapshot.stats.num_finished_requests == 1, 5, "stale")
        return num_taken
    num_taken_idle = run(client, idle_then_serve())
    assert len(taken) > num_taken_idle
    assert_all_blocks_free(engine)


def test_from_engine_args_builds_the_engine_off_the_callers_thread(text_model, monkeypatch):
    """The server's main thread runs no OpenMP region (async_engine.off_main_thread): the engine is built on a
    thread of its own, which then ends; a build error still reaches the caller."""
    builders, build = [], LLMEngine.from_engine_args

    def recorded(*args, **kwargs):
        builders.append(threading.current_thread())
        return build(*args, **kwargs)
    monkeypatch.setattr(LLMEngine, "from_engine_args", recorded)
    client = AsyncLLMEngine.from_engine_args(text_model[0], dtype="float32", num_kv_blocks=64).start()
    assert builders[0] is not threading.current_thread() and not builders[0].is_alive()

    async def generate():
        stream = await client.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        return [output async for output in stream][-1].outputs[0].token_ids
    assert len(run(client, generate())) == 3
    with pytest.raises(ValueError, match="dtype"):
        AsyncLLMEngine.from_engine_args(text_model[0], dtype="float13")
