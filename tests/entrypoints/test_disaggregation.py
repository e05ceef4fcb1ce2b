"""Prefill/decode disaggregation on loopback: a prefill server (kv_producer) and a decode server
(kv_consumer) sharing a SharedStorageConnector directory, behind `pagedmoe router --prefill --decode`: the same
greedy tokens as one instance for 8 prompts of different lengths, streamed or not, the decode instance
computing one prompt token a request; both pools free afterwards. Without the prefill's KV (its file gone),
the decode instance computes the prompt itself. A prefill instance that cannot be reached, or whose process is
killed mid-run (P and D as processes of their own), gives the client a 502, never a hang."""
import contextlib
import json
import subprocess
import sys

import httpx
import pytest

from conftest import make_prompts
from server_utils import API_KEY, MODEL, serve, wait_all_blocks_free
from pagedmoe.bench.server import free_port, serve_command, stop_process, wait_healthy
from pagedmoe.entrypoints.router import DisaggregatedRouter, router_in_thread

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def connector(role: str, path) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": role,
                       "kv_connector_extra_config": {"shared_storage_path": str(path)}})


@pytest.fixture(scope="module")
def instances(text_model, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    with serve(text_model[0], num_kv_blocks=128) as single, \
            serve(text_model[0], num_kv_blocks=128, kv_transfer_config=connector("kv_producer", store)) as prefill, \
            serve(text_model[0], num_kv_blocks=128, kv_transfer_config=connector("kv_consumer", store)) as decode:
        yield single, prefill, decode, store


def complete(url: str, prompt, stream: bool = False, model: str | None = MODEL) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": stream, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["text"]
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(c["text"] for e in events for c in e["choices"])


def assert_pair_matches_one_instance(single, prefill, decode, seed: int):
    """8 prompts of 3-70 tokens through the proxy, every other one streamed: one instance's text, the decode
    instance computing only each prompt's last token."""
    prompts = make_prompts(8, seed=seed, min_len=3, max_len=70)
    before = decode.engine.num_prompt_tokens
    with router_in_thread(DisaggregatedRouter(prefill.url, decode.url)) as url:
        for index, prompt in enumerate(prompts):
            stream = index % 2 == 1
            assert complete(url, prompt, stream) == complete(single.url, prompt, stream)
    assert decode.engine.num_prompt_tokens - before == len(prompts)


def test_prefill_then_decode_matches_one_instance(instances):
    single, prefill, decode, _ = instances
    assert_pair_matches_one_instance(single, prefill, decode, seed=6)
    for server in (single, prefill, decode):
        wait_all_blocks_free(server)


def test_decode_without_the_prefill_kv_computes_the_prompt(instances):
    single, _, decode, store = instances
    prompt = make_prompts(1, seed=8, min_len=40, max_len=40)[0]
    before = decode.engine.num_prompt_tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "gone"}}
    response = httpx.post(f"{decode.url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert response.json()["choices"][0]["text"] == complete(single.url, prompt)
    assert decode.engine.num_prompt_tokens - before == len(prompt)
    wait_all_blocks_free(decode)


def test_unreachable_prefill_is_a_502(instances):
    _, _, decode, _ = instances
    with router_in_thread(DisaggregatedRouter("http://127.0.0.1:9", decode.url)) as url:
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [1, 2], "max_tokens": 2},
                              headers=HEADERS, timeout=30)
    assert response.status_code == 502 and "could not be reached" in response.json()["error"]["message"]


def test_a_remote_kv_that_fails_to_load_fails_its_request_alone(instances, tmp_path):
    """The stored KV is unreadable at the load: that request fails (vLLM's policy "fail"; the server's 500
    names the reason, as for any request the engine fails), the next request is untouched, the pool is free."""
    single, _, decode, store = instances
    engine = decode.engine
    prompt = make_prompts(1, seed=12, min_len=40, max_len=40)[0]
    connector = engine.connector
    seq_key = connector.key_of(type("S", (), {"token_ids": prompt})(), len(prompt) - 1)
    (store / f"{seq_key}.safetensors").write_bytes(b"not a safetensors file")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_prefill": True}}
    bad = httpx.post(f"{decode.url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert bad.status_code == 500 and "SafetensorError" in bad.text
    assert complete(decode.url, [5, 6, 7]) == complete(single.url, [5, 6, 7])
    wait_all_blocks_free(decode)


def metric_total(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pagedmoe:{name}{{"))


@contextlib.contextmanager
def server_process(path: str, kv_transfer_config: str):
    """`pagedmoe serve` in a process of its own (no API key; the model's name is its path)."""
    port = free_port()
    process = subprocess.Popen(serve_command(path, port, {"kv_transfer_config": kv_transfer_config}))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 120, lambda: process.poll() is None)
        yield url, process
    finally:
        stop_process(process, 10)


def test_separate_processes_and_a_killed_prefill(text_model, tmp_path):
    """P and D as their own `pagedmoe serve` processes: tokens as one instance, D computes one prompt token a
    request and ends with no block in use; once the prefill process is killed, requests get a 502 at once."""
    store, path = tmp_path / "kv", text_model[0]
    prompts = make_prompts(4, seed=14, min_len=5, max_len=50)
    with serve(path, num_kv_blocks=128) as single, \
            server_process(path, connector("kv_producer", store)) as (prefill, p_proc), \
            server_process(path, connector("kv_consumer", store)) as (decode, _), \
            router_in_thread(DisaggregatedRouter(prefill, decode)) as url:
        expected = [complete(single.url, p) for p in prompts]
        before = metric_total(decode, "prompt_tokens_total")
        assert [complete(url, p, model=None) for p in prompts] == expected
        assert metric_total(decode, "prompt_tokens_total") - before == len(prompts)
        assert metric_total(decode, "kv_cache_usage_perc") == 0
        p_proc.kill()
        p_proc.wait(10)
        response = httpx.post(f"{url}/v1/completions", json={"prompt": prompts[0], "max_tokens": 4}, timeout=30)
        assert response.status_code == 502


CLIENT = """
import json, sys
import httpx
prompts, url = json.loads(sys.argv[1]), sys.argv[2]
texts = [httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True}, timeout=60).json()["choices"][0]["text"]
         for p in prompts]
print(json.dumps(texts))
"""


def test_prefill_and_decode_in_two_network_namespaces(text_model, tmp_path):
    """The pair on two test hosts (network namespaces over a veth pair, sharing only the storage directory's
    file system): P and the proxy on host 0, D on host 1, a client on host 0; one instance's tokens."""
    from netns import PAIR
    store = tmp_path / "kv"
    run_pair_in_namespaces(text_model[0], tmp_path, PAIR, connector("kv_producer", store),
                           connector("kv_consumer", store), seed=16)


def run_pair_in_namespaces(path: str, tmp_path, hosts, producer: str, consumer: str, seed: int):
    """`pagedmoe serve` P (kv_transfer_config producer) and the router on host 0, D on host 1, a client on
    host 0 sending 3 prompts through the router: one instance's tokens."""
    from netns import in_namespace, two_hosts
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    prompts = make_prompts(3, seed=seed, min_len=5, max_len=40)
    with serve(path, num_kv_blocks=128) as single, two_hosts(hosts):
        expected = [complete(single.url, p) for p in prompts]
        ports = [free_port() for _ in range(3)]
        urls = [f"http://{hosts.addrs[0]}:{ports[0]}", f"http://{hosts.addrs[1]}:{ports[1]}",
                f"http://{hosts.addrs[0]}:{ports[2]}"]
        procs = [in_namespace(0, serve_command(path, ports[0], {"kv_transfer_config": producer})
                              + ["--host", hosts.addrs[0]], hosts),
                 in_namespace(1, serve_command(path, ports[1], {"kv_transfer_config": consumer})
                              + ["--host", hosts.addrs[1]], hosts),
                 in_namespace(0, [sys.executable, "-m", "pagedmoe", "router", "--prefill", urls[0], "--decode",
                                  urls[1], "--host", hosts.addrs[0], "--port", str(ports[2])], hosts)]
        try:
            client = in_namespace(0, [sys.executable, "-c", WAIT_AND_RUN, str(script), json.dumps(prompts), urls[2],
                                      urls[0], urls[1]], hosts, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            out, err = client.communicate(timeout=240)
            assert client.returncode == 0, err[-3000:]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait(10)
    assert json.loads(out.strip().splitlines()[-1]) == expected


WAIT_AND_RUN = """
import runpy, sys, time
import httpx
script, prompts, router, prefill, decode = sys.argv[1:]
deadline = time.monotonic() + 180
for url in (router, prefill, decode):  # every process up before the first request
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.5)
sys.argv = [script, prompts, router]
runpy.run_path(script, run_name="__main__")
"""
