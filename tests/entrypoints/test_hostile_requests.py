"""Every input that used to kill the engine (issue 12) is refused at the door naming its field, on the server
and through LLM; afterwards the server is healthy, a normal request completes and the KV pool is free.
A request that fails inside a step answers an error alone while the rest of its batch completes."""
import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from conftest import assert_all_blocks_free
from pagedmoe import LLM, SamplingParams
from pagedmoe.bench.server import free_port
from server_utils import (HEADERS, MODEL, is_healthy, serve, server, wait_all_blocks_free,  # noqa: F401
                          wait_until)

BIG = 2**63
COMPLETIONS = [  # (extra fields, field named in the error)
    ({"logprobs": 3000}, "logprobs"),
    ({"logprobs": BIG}, "logprobs"),
    ({"top_k": BIG}, "top_k"),
    ({"seed": BIG}, "seed"),
    ({"min_tokens": 1, "stop_token_ids": [5000]}, "stop_token_ids"),
    ({"min_tokens": 1, "stop_token_ids": [-5000]}, "stop_token_ids"),
    ({"stop_token_ids": [BIG]}, "stop_token_ids"),
    ({"n": 10000}, "n"),
    ({"best_of": 10000}, "best_of"),
    ({"max_tokens": 100000}, "max_tokens"),
]
CHAT = [({"logprobs": True, "top_logprobs": 3000}, "top_logprobs"), ({"top_k": BIG}, "top_k"),
        ({"n": 10000}, "n")]


def _assert_still_serving(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    body = {"model": MODEL, "prompt": "ROMEO", "max_tokens": 3, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    wait_all_blocks_free(server)


@pytest.mark.parametrize("route, fields, param", [("completions", f, p) for f, p in COMPLETIONS]
                         + [("chat/completions", f, p) for f, p in CHAT])
def test_inputs_are_refused_naming_the_field(server, route, fields, param):
    content = {"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"}
    body = {"model": MODEL, "max_tokens": 2, **content, **fields}
    response = httpx.post(f"{server.url}/v1/{route}", json=body, headers=HEADERS)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    _assert_still_serving(server)


@pytest.mark.parametrize("fields, param", COMPLETIONS)
def test_the_same_inputs_offline_raise_value_errors(text_model, fields, param):
    llm = _llm(text_model[0])
    with pytest.raises(ValueError, match=rf"^{param}\b"):
        llm.generate("hi", SamplingParams(**{"max_tokens": 2, **{k: v for k, v in fields.items()}}), use_tqdm=False)
    out = llm.generate("ROMEO", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.finished and out.error is None and len(out.outputs[0].token_ids) >= 1
    assert_all_blocks_free(llm.engine)


_LLMS = {}


def _llm(path: str) -> LLM:
    """One LLM per model for the module: refused inputs must leave it usable, so reusing it is the test."""
    return _LLMS.setdefault(path, LLM(path, dtype="float32", max_model_len=512))


def test_a_request_failing_in_a_step_answers_500_alone(text_model, monkeypatch):
    with serve(text_model[0], num_kv_blocks=256) as running:
        runner, original = running.engine.runner, running.engine.runner._sampling_batch

        def failing(seqs, *args):
            if any(seq.params.seed == 666 for seq in seqs):
                raise RuntimeError("injected sampler failure")
            return original(seqs, *args)
        monkeypatch.setattr(runner, "_sampling_batch", failing)
        bodies = [{"model": MODEL, "prompt": f"ROMEO {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                   **({"seed": 666} if i == 2 else {})} for i in range(4)]
        responses = asyncio.run(_post_all(f"{running.url}/v1/completions", bodies))
        assert responses[2].status_code == 500 and "injected sampler failure" in responses[2].text
        for i in (0, 1, 3):
            assert responses[i].status_code == 200
            assert responses[i].json()["usage"]["completion_tokens"] == 8
        assert httpx.get(f"{running.url}/health").status_code == 200
        wait_all_blocks_free(running)


def test_constraints_that_exclude_every_token_answer_400_alone(text_model):
    """allowed_token_ids of EOS alone under a grammar that must first write "yes": found out in the step, the
    request's own fault (400; on a stream, an invalid_request_error event), while the others go on."""
    excluding = {"model": MODEL, "prompt": "ROMEO", "max_tokens": 4, "allowed_token_ids": [text_model[2].eos_token_id],
                 "structured_outputs": {"choice": ["yes"]}}
    with serve(text_model[0], num_kv_blocks=256) as running:
        url = f"{running.url}/v1/completions"
        bodies = [{"model": MODEL, "prompt": f"ROMEO {i}", "max_tokens": 4, "ignore_eos": True} for i in range(3)]
        responses = asyncio.run(_post_all(url, [bodies[0], excluding, bodies[1], bodies[2]]))
        assert responses[1].status_code == 400 and "no token may be sampled" in responses[1].text
        assert responses[1].json()["error"]["type"] == "invalid_request_error"
        assert all(r.status_code == 200 for i, r in enumerate(responses) if i != 1)
        streamed = httpx.post(url, json={**excluding, "stream": True}, headers=HEADERS, timeout=60)
        assert streamed.status_code == 200 and '"type": "invalid_request_error"' in streamed.text
        wait_all_blocks_free(running)


async def _post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(headers=HEADERS, timeout=60) as client:
        return await asyncio.gather(*(client.post(url, json=body) for body in bodies))


DYING_SERVER = """
import sys
from pagedmoe.worker.model_runner import ModelRunner
original = ModelRunner.execute
def execute(self, sched):
    if any(seq.params.seed == 666 for seq in sched.seqs):
        raise MemoryError("injected: no request explains this")
    return original(self, sched)
ModelRunner.execute = execute
from pagedmoe.entrypoints.cli import main
main(["serve", sys.argv[1], "--port", sys.argv[2], "--dtype", "float32", "--num-kv-blocks", "64"])
"""


def test_engine_death_is_logged_and_the_server_exits_non_zero(text_model):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", DYING_SERVER, text_model[0], str(port)],
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: is_healthy(url) or process.poll() is not None, 120, "server did not come up")
        body = {"model": text_model[0], "prompt": "ROMEO", "max_tokens": 4, "seed": 666}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 503
        started = time.monotonic()
        code = process.wait(20)
        assert code != 0 and time.monotonic() - started < 10
        stderr = process.stderr.read()
        assert "engine died" in stderr and "Traceback" in stderr and "MemoryError: injected" in stderr
    finally:
        process.kill()
        process.wait()
