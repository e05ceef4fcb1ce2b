"""Helpers shared by the server tests. Not a conftest.py: tests/ imports its conftest by the bare
name `conftest`, which a second conftest.py here would shadow for the directories collected later.
Test modules import the fixtures below (each module then gets its own server)."""
import contextlib
import socket
import threading
import time
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from conftest import assert_all_blocks_free
from pagedmoe.engine.async_engine import AsyncLLMEngine
from pagedmoe.engine.llm_engine import LLMEngine
from pagedmoe.entrypoints.openai.server import build_app

API_KEY = "test-key"
MODEL = "tiny-qwen3"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Server:
    url: str
    engine: LLMEngine
    client: AsyncLLMEngine

    def openai(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)


@contextlib.contextmanager
def serve(model_dir: str, max_waiting_requests: int = 512, max_body_bytes: int = 1 << 20,
          app_options: dict | None = None, **engine_kwargs):
    """The real app under uvicorn in a background thread, on a free localhost port. app_options: more
    build_app arguments (e.g. the tool-call flags)."""
    engine = LLMEngine.from_engine_args(model_dir, dtype="float32", **engine_kwargs)
    client = AsyncLLMEngine(engine, max_waiting_requests).start()
    app = build_app(client, api_key=API_KEY, model_name=MODEL, max_body_bytes=max_body_bytes, **(app_options or {}))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "uvicorn did not start")
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", engine, client)
    finally:
        server.should_exit = True
        thread.join(10)
        client.shutdown()
        sock.close()


def wait_until(condition, timeout: float, message: str):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


def wait_all_blocks_free(server: Server, timeout: float = 10):
    """The engine thread frees blocks asynchronously: poll (bounded), then check the whole pool."""
    pool = server.engine.kv.pool
    wait_until(lambda: pool.num_free_blocks == pool.num_blocks and not server.engine.has_unfinished_requests(),
               timeout, f"KV blocks still in use: {pool.num_used_blocks}")
    assert_all_blocks_free(server.engine)


@pytest.fixture(scope="module")
def server(text_model):
    with serve(text_model[0], num_kv_blocks=512, max_num_seqs=64) as running:
        yield running


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server.openai()


def is_healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
