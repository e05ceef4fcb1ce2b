"""A pagedmoe OpenAI server for `bench serve` to load: in this process (uvicorn in a thread) or a
`python -m pagedmoe serve` subprocess (its own GIL: the load generator does not steal the engine's time)."""
import contextlib
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float, alive=lambda: True):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("bench serve: the server process exited before it became healthy")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"bench serve: {url}/health not ready after {timeout:.0f} s")


@contextlib.contextmanager
def inprocess_server(model: str, engine_kwargs: dict, max_waiting_requests: int = 4096, timeout: float = 120):
    """The real app (build_app over an AsyncLLMEngine) under uvicorn in a daemon thread on a free port."""
    import uvicorn

    from pagedmoe.engine.async_engine import AsyncLLMEngine
    from pagedmoe.entrypoints.openai.server import build_app
    client = AsyncLLMEngine.from_engine_args(model, max_waiting_requests, **engine_kwargs).start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(client, model_name=model), log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        wait_healthy(url, timeout, thread.is_alive)
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        client.shutdown()
        sock.close()


def serve_command(model: str, port: int, engine_kwargs: dict) -> list[str]:
    """`python -m pagedmoe serve MODEL --port P` plus every engine option that differs from False/None."""
    command = [sys.executable, "-m", "pagedmoe", "serve", model, "--port", str(port), "--log-level", "warning",
               "--max-waiting-requests", "4096"]
    for name, value in sorted(engine_kwargs.items()):
        flag = "--" + name.replace("_", "-")
        if value is True:
            command.append(flag)
        elif value is not None and value is not False:
            command += [flag, str(value)]
    return command


@contextlib.contextmanager
def subprocess_server(model: str, engine_kwargs: dict, timeout: float = 300):
    port = free_port()
    process = subprocess.Popen(serve_command(model, port, engine_kwargs))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout, lambda: process.poll() is None)
        yield url
    finally:
        stop_process(process, 15)


def stop_process(process: subprocess.Popen, grace_s: float):
    """SIGTERM, then SIGKILL if it has not exited after grace_s seconds."""
    process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def server_for(args, engine_kwargs: dict):
    """The URL to load: --url as given, or a server this command starts (--server inprocess|subprocess)."""
    if args.url:
        return contextlib.nullcontext(args.url.rstrip("/"))
    if args.server == "inprocess":
        return inprocess_server(args.model, engine_kwargs)
    return subprocess_server(args.model, engine_kwargs)
