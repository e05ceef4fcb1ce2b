import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from server_utils import API_KEY, HEADERS, MODEL, client, serve, server, wait_all_blocks_free, wait_until  # noqa: F401

PROMPT = "ROMEO: But soft"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5] * 600}, "prompt"),
    ({"prompt": [99999]}, "prompt_token_ids"),
    ({"suffix": "and then"}, "suffix"),
    ({"logit_bias": {"five": 10}}, "logit_bias"),
])
def test_bad_values_are_400_naming_the_field(server, fields, param):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
    error = _error(httpx.post(f"{server.url}/v1/completions", json=body, headers=HEADERS), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    wait_all_blocks_free(server)


def test_bad_values_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert info.value.status_code == 400 and info.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, n=4, best_of=2)
    assert "best_of" in info.value.body["message"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                          ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/metrics"),
                                          ("GET", "/dashboard"), ("GET", "/dashboard/stats"),
                                          ("GET", "/openapi.json"), ("GET", "/nowhere")])
def test_api_key_is_required_everywhere_but_the_probes(server, method, path):
    for headers in ({}, {"Authorization": "Bearer test-ke"}, {"Authorization": API_KEY}):
        response = httpx.request(method, f"{server.url}{path}", headers=headers)
        assert _error(response, 401)["code"] == "invalid_api_key"


def test_only_the_dashboard_page_takes_the_key_in_its_query(server):
    assert httpx.get(f"{server.url}/dashboard?api_key={API_KEY}").status_code == 200
    _error(httpx.get(f"{server.url}/dashboard?api_key=wrong"), 401)
    _error(httpx.get(f"{server.url}/dashboard/stats?api_key={API_KEY}"), 401)
    _error(httpx.get(f"{server.url}/v1/models?api_key={API_KEY}"), 401)


def test_probes_are_open_and_the_openai_client_sees_401(server):
    with pytest.raises(openai.AuthenticationError) as info:
        server.openai(api_key="wrong").models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"), ("GET", "/version")):
        assert httpx.request(method, f"{server.url}{path}").status_code == 200


def test_unknown_model_and_route_are_404(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    assert _error(httpx.get(f"{server.url}/v1/engines", headers=HEADERS), 404)["code"] == "not_found"
    _error(httpx.get(f"{server.url}/nowhere", headers=HEADERS), 404)
    assert _error(httpx.delete(f"{server.url}/v1/models", headers=HEADERS), 405)["type"] == "invalid_request_error"


def test_large_bodies_are_413(server):
    big = {"model": MODEL, "prompt": "x" * (2 << 20)}
    assert _error(httpx.post(f"{server.url}/v1/completions", json=big, headers=HEADERS), 413)["code"] == \
        "request_too_large"

    def chunked():
        for _ in range(40):
            yield b"y" * 65536
    response = httpx.post(f"{server.url}/v1/completions", content=chunked(), headers=HEADERS)
    _error(response, 413)


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": PROMPT, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
])
def test_schema_violations_are_400_naming_the_field(server, body, param):
    error = _error(httpx.post(f"{server.url}/v1/completions", json=body, headers=HEADERS), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == "invalid_schema"


def test_malformed_json_and_chat_schema_are_400(server, client):
    json_headers = {**HEADERS, "Content-Type": "application/json"}
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json", headers=json_headers)
    error = _error(response, 400)
    assert error["code"] == "invalid_json" and error["param"] is None
    assert error["message"].startswith("invalid JSON body: Expecting property name") and "line 1 column 2" in \
        error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"content": "no role"}])
    assert info.value.body["param"] == "messages.0.role"


def test_full_waiting_queue_is_503_with_retry_after(text_model):
    """One running slot and one waiting slot: with a long stream running and a second one waiting,
    a third request is refused at once; once they are gone the server serves again."""
    with serve(text_model[0], max_waiting_requests=1, num_kv_blocks=64, max_num_seqs=1) as srv:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, headers=HEADERS, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as running, \
                    http.stream("POST", "/v1/completions", json=body) as waiting:
                assert running.status_code == waiting.status_code == 200
                refused = http.post("/v1/completions", json={**body, "stream": False})
                error = _error(refused, 503)
                assert error["code"] == "queue_full" and int(refused.headers["Retry-After"]) >= 1
        wait_all_blocks_free(srv)
        done = srv.openai().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert done.choices[0].finish_reason in ("length", "stop")


def test_engine_death_fails_requests_at_once_and_health_turns_503(text_model):
    with serve(text_model[0], num_kv_blocks=64) as srv, ThreadPoolExecutor(1) as pool:
        client = srv.openai()
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        whole = pool.submit(httpx.post, f"{srv.url}/v1/completions", headers=HEADERS, timeout=10,
                            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
        wait_until(lambda: len(srv.engine.requests) == 2, 5, "the second request never reached the engine")

        def broken_step():
            raise RuntimeError("simulated device failure")
        srv.engine.step = broken_step
        start = time.monotonic()
        with pytest.raises(openai.APIError, match="simulated device failure"):
            for _ in stream:
                pass
        assert _error(whole.result(), 503)["code"] == "engine_dead"
        assert time.monotonic() - start < 5
        wait_until(lambda: httpx.get(f"{srv.url}/health").status_code == 503, 5, "/health stayed 200")
        assert _error(httpx.get(f"{srv.url}/health"), 503)["code"] == "engine_dead"
        for method in ("GET", "POST"):
            assert _error(httpx.request(method, f"{srv.url}/ping"), 503)["code"] == "engine_dead"
        refused = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": PROMPT}, headers=HEADERS,
                             timeout=5)
        assert _error(refused, 503)["code"] == "engine_dead"


def test_server_without_tokenizer_takes_token_ids_only(text_model):
    with serve(text_model[0], num_kv_blocks=64, skip_tokenizer_init=True) as srv:
        client = srv.openai()
        out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, logprobs=1,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3 and out.choices[0].logprobs.tokens[0].startswith("token_id:")
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert info.value.body["param"] == "prompt"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
