"""AsyncLLMEngine: an asyncio front for the synchronous, thread-unsafe LLMEngine.

Design: ONE background thread owns the engine and is the only caller of add_request, step and
abort_request, so the engine needs no locks. A step is seconds of CPU (or GPU launches) that must
never run on the event loop, and a thread is enough to keep it off: torch drops the GIL inside its
kernels. A separate process (vLLM's EngineCore) would also isolate the GIL, at the price of
serialising every output and owning a second copy of the tokenizer/model state; not worth it here.

Data flows one way. Handlers put commands (add, abort) on a thread-safe queue; the engine thread
drains it between steps, blocking on it only when it has nothing to run. Each request has an
asyncio.Queue that the thread feeds with loop.call_soon_threadsafe: first an acceptance or the
rejection (the engine's ValueError, a full waiting queue), then every RequestOutput as soon as a step
produces it. Outputs are copied before they cross threads, because the engine keeps mutating its
metrics and logprob lists. Readers of statistics (metrics, dashboard) get an immutable snapshot that
the thread republishes every `snapshot_interval` seconds; they never touch the engine.

Failure: a request's own failure (the engine isolates it and finishes it with an error output, or
add_request raises something other than ValueError) reaches only its stream, as RequestFailedError.
If the thread dies, it logs the traceback, marks the client dead under the same lock that guards
submission, fails every open request and every queued command, so no awaiting handler can hang and
no later submission is lost in the queue, and then calls `on_death` (the server exits on it).
"""
import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

from pagedmoe.engine.isolation import describe, is_fatal
from pagedmoe.engine.llm_engine import EngineStats, LLMEngine, PromptType
from pagedmoe.outputs import RequestOutput
from pagedmoe.sampling_params import SamplingParams

FREE, USED, SHARED, CACHED = 0, 1, 2, 3
ACCEPTED = object()
IDLE_SNAPSHOT_INTERVAL = 1.0  # seconds between full snapshots of an idle engine
logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; the engine and the other requests go on."""


class RequestRejectedError(RequestFailedError):
    """This request failed inside the engine on its own parameters (e.g. constraints that exclude every token)."""


class QueueFullError(RuntimeError):
    pass


@dataclass(frozen=True)
class EngineSnapshot:
    time: float
    stats: EngineStats
    block_states: tuple[int, ...]  # per KV block: FREE, USED, SHARED or CACHED
    expert_load: list[list[int]]  # per MoE layer, tokens routed to each expert so far; [] when dense


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    stream: "RequestStream"


@dataclass
class _Abort:
    request_id: str


class RequestStream:
    """The asyncio side of one request: an async iterator over its RequestOutputs."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, abort):
        self.request_id, self.loop, self._abort = request_id, loop, abort
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def put(self, item):
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        if item.error is not None:
            failure = RequestRejectedError if item.bad_input else RequestFailedError
            raise failure(f"request {self.request_id} failed: {item.error}")
        return item

    def close(self):
        """Abort the request unless it already finished; frees its KV blocks."""
        if not self.finished:
            self.finished = True
            self._abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 512, snapshot_interval: float = 0.05,
                 on_death=None):
        self.engine = engine  # owned by the engine thread once start() ran
        self.on_death = on_death  # called (from the engine thread) with the error once the engine died
        self.max_waiting_requests, self.snapshot_interval = max_waiting_requests, snapshot_interval
        self.tokenizer = _frontend_tokenizer(engine)
        self.max_model_len = engine.config.max_model_len
        self.snapshot = take_snapshot(engine)
        self._full_snapshot_time = self.snapshot.time
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedmoe-engine", daemon=True)

    @classmethod
    def from_engine_args(cls, model: str, max_waiting_requests: int = 512, **engine_kwargs) -> "AsyncLLMEngine":
        """The engine is built on a thread of its own, not the caller's (see off_main_thread)."""
        return cls(off_main_thread(lambda: LLMEngine.from_engine_args(model, **engine_kwargs)), max_waiting_requests)

    def start(self) -> "AsyncLLMEngine":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0):
        self._stopping.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Returns once the engine accepted the request; raises its ValueError, QueueFullError or
        EngineDeadError otherwise."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), self.abort)
        self._submit(_Add(request_id, prompt, params, arrival_time or time.time(), stream))
        try:
            verdict = await stream.queue.get()
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        if isinstance(verdict, BaseException):
            raise verdict
        return stream

    def abort(self, request_id: str):
        with self._lock:
            if self._error is None:
                self._commands.put(_Abort(request_id))

    def _submit(self, command: _Add):
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"engine is dead: {self._error!r}")
            self._commands.put(command)

    def _run(self):
        try:
            while not self._stopping.is_set():
                was_busy = self.engine.has_unfinished_requests()
                num_commands = self._drain_commands(block=not was_busy)
                outputs = self.engine.step()
                self._deliver(outputs)
                self._publish(changed=was_busy or num_commands > 0 or len(outputs) > 0)
        except BaseException as e:
            self._die(e)
        else:
            self._die(EngineDeadError("engine shut down"))
        finally:
            self.engine.shutdown()  # the other ranks of a multi-process engine stop with it

    def _drain_commands(self, block: bool) -> int:
        num_commands = 0
        try:
            command = self._commands.get(timeout=self.snapshot_interval) if block else self._commands.get_nowait()
            while True:
                self._handle(command)
                num_commands += 1
                command = self._commands.get_nowait()
        except queue.Empty:
            return num_commands

    def _handle(self, command):
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            self._streams.pop(command.request_id, None)
        elif isinstance(command, _Add):
            self._add(command)

    def _add(self, command: _Add):
        if self.engine.get_stats().num_waiting >= self.max_waiting_requests:
            command.stream.put(QueueFullError(f"{self.max_waiting_requests} requests are already waiting"))
            return
        try:
            self.engine.add_request(command.request_id, command.prompt, command.params, command.arrival_time)
        except ValueError as e:
            command.stream.put(e)
            return
        except BaseException as e:
            if is_fatal(e):
                command.stream.put(EngineDeadError(f"engine failed adding the request: {e!r}"))
                raise
            logger.error("request %s failed on admission: %s", command.request_id, describe(e), exc_info=e)
            command.stream.put(RequestFailedError(f"request {command.request_id} failed: {describe(e)}"))
            return
        self._streams[command.request_id] = command.stream
        command.stream.put(ACCEPTED)

    def _deliver(self, outputs: list[RequestOutput]):
        for output in outputs:
            streams = self._streams
            stream = streams.pop(output.request_id, None) if output.finished else streams.get(output.request_id)
            if stream is not None:
                stream.put(_detach(output))

    def _publish(self, changed: bool):
        """Idle with nothing new, a full snapshot (it walks every KV block: ~1 ms) only once a second, for the
        statistics fetched lazily (other ranks' timings); in between only the time moves."""
        now = time.time()
        if changed:
            is_due = not self.engine.has_unfinished_requests() or now - self.snapshot.time >= self.snapshot_interval
        else:
            is_due = now - self._full_snapshot_time >= IDLE_SNAPSHOT_INTERVAL
        if is_due:
            self.snapshot, self._full_snapshot_time = take_snapshot(self.engine), now
        elif not changed:
            self.snapshot = dataclasses.replace(self.snapshot, time=now)

    def _die(self, error: BaseException):
        if not self._stopping.is_set():
            logger.critical("engine died: %s", describe(error), exc_info=error)
        with self._lock:
            self._error = error
        for stream in self._streams.values():
            stream.put(EngineDeadError(f"engine stopped: {error!r}"))
        self._streams.clear()
        while not self._commands.empty():
            command = self._commands.get_nowait()
            if isinstance(command, _Add):
                command.stream.put(EngineDeadError(f"engine stopped: {error!r}"))
        if self.on_death is not None and not self._stopping.is_set():
            self.on_death(error)


def _detach(output: RequestOutput) -> RequestOutput:
    """A copy the event loop may read while the engine keeps appending to the originals."""
    outputs = [dataclasses.replace(o, logprobs=None if o.logprobs is None else list(o.logprobs))
               for o in output.outputs]
    prompt_logprobs = None if output.prompt_logprobs is None else list(output.prompt_logprobs)
    return dataclasses.replace(output, outputs=outputs, prompt_logprobs=prompt_logprobs,
                               metrics=copy.copy(output.metrics))


def take_snapshot(engine: LLMEngine) -> EngineSnapshot:
    pool = engine.kv.pool
    hashes = getattr(pool, "block_hashes", None) or [None] * pool.num_blocks
    states = tuple(SHARED if count > 1 else USED if count == 1 else FREE if block_hash is None else CACHED
                   for count, block_hash in zip(pool.ref_counts, hashes))
    stats = engine.get_stats()
    return EngineSnapshot(time.time(), stats, states, _as_lists(getattr(stats, "expert_load", None)))


def _as_lists(load) -> list[list[int]]:
    if load is None:
        return []
    return [[int(x) for x in (layer.tolist() if hasattr(layer, "tolist") else layer)] for layer in load]


def _frontend_tokenizer(engine: LLMEngine):
    """The event loop's own tokenizer: the engine's may be in use by the engine thread."""
    if engine.tokenizer is None:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(engine.config.tokenizer)


def off_main_thread(build):
    """build() run on a short-lived thread, its result returned or its error raised here. Loading a model runs
    OpenMP regions, and libgomp keeps a team of threads for each thread that ran one: built on the server's main
    thread, that idle team stayed beside the engine thread's, and with more OpenMP threads than cores libgomp
    barely spin-waits, so each parallel region of a step paid for waking its threads. A 144-token prompt took
    124.1 ms on the engine thread of a main-thread-built engine against 115.5 ms when built off it (Zen 4, 2
    cores, float32 qwen3-100m); the builder's team goes when its thread ends."""
    result: dict = {}

    def run():
        try:
            result["value"] = build()
        except BaseException as error:  # re-raised on the caller's thread
            result["error"] = error

    thread = threading.Thread(target=run, name="pagedmoe-engine-build", daemon=True)  # Ctrl-C during a load exits
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
