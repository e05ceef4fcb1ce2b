import argparse
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

import pagedmoe.entrypoints.openai.server as server_module
from pagedmoe.entrypoints.cli import DEFAULT_MODEL
from pagedmoe.entrypoints.openai.cli_args import add_serve_args, main
from server_utils import is_healthy, wait_until


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(argv)


def test_serve_args_reach_run_server(monkeypatch):
    calls = []
    monkeypatch.setattr(server_module, "run_server", lambda *args, **kwargs: calls.append((args, kwargs)))
    main(_parse(["/models/x", "--port", "9001", "--api-key", "k", "--max-num-seqs", "4", "--dtype", "float32"]))
    (model, host, port, api_key), kwargs = calls[0]
    assert (model, host, port, api_key) == ("/models/x", "127.0.0.1", 9001, "k")
    assert kwargs["served_model_name"] == "/models/x" and kwargs["max_num_seqs"] == 4 and kwargs["dtype"] == "float32"
    main(_parse([]))
    assert calls[1][0][0] == DEFAULT_MODEL and calls[1][1]["served_model_name"] == "pagedmoe-moe-default"


def test_serve_process_answers_and_stops_on_sigint(text_model):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "pagedmoe.entrypoints.openai.cli_args", text_model[0], "--port", str(port),
               "--served-model-name", "tiny", "--dtype", "float32", "--num-kv-blocks", "64", "--log-level", "warning"]
    process = subprocess.Popen(command, env={**os.environ, "PAGEDMOE_API_KEY": "secret"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: is_healthy(url) or process.poll() is not None, 120, "server did not come up")
        assert process.poll() is None
        body = {"model": "tiny", "prompt": "ROMEO", "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        out = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer secret"}).json()
        assert out["usage"]["completion_tokens"] <= 3 and out["model"] == "tiny"
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


def test_tool_flags_reach_run_server_and_need_each_other(monkeypatch):
    calls = []
    monkeypatch.setattr(server_module, "run_server", lambda *args, **kwargs: calls.append(kwargs))
    main(_parse(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert calls[0]["enable_auto_tool_choice"] is True and calls[0]["tool_call_parser"] == "hermes"
    with pytest.raises(SystemExit, match="--tool-call-parser"):
        main(_parse(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        _parse(["--tool-call-parser", "mistral"])
    assert len(calls) == 1
