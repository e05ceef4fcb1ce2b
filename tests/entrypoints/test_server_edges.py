"""Server edges: malformed strings, strict booleans and roles, vLLM's probes, the served model name,
cached-token usage, and tokenisation that keeps the event loop free."""
import importlib.metadata
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from pagedmoe.entrypoints.openai.server import build_app
from server_utils import HEADERS, MODEL, client, serve, server, wait_all_blocks_free  # noqa: F401  (fixtures)

JSON_HEADERS = {**HEADERS, "Content-Type": "application/json"}
LONG = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 3
USER = [{"role": "user", "content": "hi"}]


def _post(server, path: str, body: dict) -> httpx.Response:
    """json.dumps writes a lone surrogate as its \\ud800 escape, as a client's JSON encoder would."""
    return httpx.post(f"{server.url}{path}", content=json.dumps(body), headers=JSON_HEADERS, timeout=30)


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "a\udc00"]}, "prompt.1"),
    ("/v1/completions", {"prompt": "ok", "stop": ["x", "\ud800"]}, "stop.1"),
    ("/v1/completions", {"prompt": "ok", "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": "ok", "user": "\udfff"}, "user"),
    ("/v1/completions", {"prompt": "ok", "logit_bias": {"\ud800": 1}}, "logit_bias.\\ud800"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]},
     "messages.0.name"),
    ("/tokenize", {"prompt": "a\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/detokenize", {"tokens": [5], "model": "\ud800"}, "model"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    error = _error(_post(server, path, body))
    assert error["param"] == param and error["code"] == "invalid_unicode"
    assert error["type"] == "invalid_request_error" and "surrogate" in error["message"]


def test_body_that_is_not_utf8_is_400(server):
    response = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "\xff"}', headers=JSON_HEADERS)
    assert _error(response)["code"] == "invalid_json"
    wait_all_blocks_free(server)


@pytest.mark.parametrize("depth, code", [(40, "invalid_schema"), (900, "invalid_schema"), (5000, "invalid_json")])
def test_deep_nesting_is_400_not_a_recursion_error(server, depth, code):
    nested = "[" * depth + "]" * depth
    for path, body in (("/v1/completions", '{"prompt": "ok", "x": %s}'),
                       ("/tokenize", '{"messages": [{"role": "user", "content": "a", "x": %s}]}')):
        response = httpx.post(f"{server.url}{path}", content=body % nested, headers=JSON_HEADERS)
        assert _error(response)["code"] == code


@pytest.mark.parametrize("path, field", [
    ("/v1/completions", "stream"), ("/v1/completions", "echo"), ("/v1/completions", "ignore_eos"),
    ("/v1/completions", "include_stop_str_in_output"), ("/v1/completions", "skip_special_tokens"),
    ("/v1/chat/completions", "logprobs"), ("/v1/chat/completions", "add_generation_prompt"),
    ("/tokenize", "add_special_tokens"),
])
@pytest.mark.parametrize("value", ["yes", "true", 1, 0])
def test_booleans_are_strict(server, path, field, value):
    body = {"prompt": "ok", "messages": USER, "max_tokens": 1, field: value}
    error = _error(_post(server, path, body))
    assert error["param"] == field and error["code"] == "invalid_schema"


def test_stream_options_include_usage_is_strict(server):
    body = {"prompt": "ok", "stream": True, "stream_options": {"include_usage": 1}}
    assert _error(_post(server, "/v1/completions", body))["param"] == "stream_options.include_usage"


@pytest.mark.parametrize("role", ["bot", "System", "", None])
def test_unknown_roles_are_400(server, role):
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": "hello"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        assert _error(_post(server, path, {"messages": messages}))["param"] == "messages.1.role"


def test_every_known_role_is_accepted(server):
    roles = ["system", "user", "assistant", "tool", "developer"]
    response = _post(server, "/tokenize", {"messages": [{"role": role, "content": "hi"} for role in roles]})
    assert response.status_code == 200 and response.json()["count"] > 0


def test_ping_and_version(server):
    assert httpx.get(f"{server.url}/ping").status_code == httpx.post(f"{server.url}/ping").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": importlib.metadata.version("pagedmoe")}


def test_served_model_name(server):
    """build_app(model_name=...) is what --served-model-name sets: clients must use exactly that name."""
    with TestClient(build_app(server.client, model_name="org/Served-Name")) as http:
        assert [card["id"] for card in http.get("/v1/models").json()["data"]] == ["org/Served-Name"]
        out = http.post("/v1/completions", json={"model": "org/Served-Name", "prompt": "ROMEO", "max_tokens": 2})
        assert out.status_code == 200 and out.json()["model"] == "org/Served-Name"
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "ROMEO", "max_tokens": 2})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    wait_all_blocks_free(server)


def test_completion_usage_reports_cached_prompt_tokens(server, client, text_model):
    prompt = "completions " + LONG
    assert len(text_model[2](prompt).input_ids) >= 48
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    batch = client.completions.create(model=MODEL, prompt=[prompt, "other " + LONG], max_tokens=2)
    assert batch.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens_details.cached_tokens


def test_streamed_chat_usage_reports_cached_prompt_tokens(client):
    messages = [{"role": "user", "content": "chat " + LONG}]

    def cached() -> int:
        chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                     stream_options={"include_usage": True}))
        return chunks[-1].usage.prompt_tokens_details.cached_tokens
    assert cached() == 0
    assert cached() >= 32


def test_tokenizing_megabytes_leaves_health_answering(text_model):
    """The HF tokenizer takes seconds on a few MB; /health must keep answering meanwhile."""
    prompt = LONG * (2_500_000 // len(LONG))
    with serve(text_model[0], num_kv_blocks=64, max_body_bytes=8 << 20) as srv, ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{srv.url}/tokenize", json={"prompt": prompt}, headers=HEADERS, timeout=120)
        time.sleep(0.5)
        answered_while_tokenizing = _health_latencies_until(srv.url, big)
        assert big.result().status_code == 200 and big.result().json()["count"] > 100_000
    assert len(answered_while_tokenizing) >= 2, "the tokenize finished too soon to overlap /health"
    assert max(answered_while_tokenizing) < 1.0


def _health_latencies_until(url: str, job) -> list[float]:
    latencies = []
    while not job.done():
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        if not job.done():
            latencies.append(time.monotonic() - start)
        time.sleep(0.05)
    return latencies


def test_openapi_documents_the_error_responses(server):
    spec = httpx.get(f"{server.url}/openapi.json", headers=HEADERS).json()
    assert spec["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            errors = {status: r for status, r in operation["responses"].items() if status != "200"}
            assert "422" not in errors and "500" in errors, f"{method} {path}"
            for response in errors.values():
                assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    completions = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "401", "404", "413", "500", "503"} <= set(completions)
