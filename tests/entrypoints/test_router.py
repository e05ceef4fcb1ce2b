"""`pagedmoe router` in front of two real pagedmoe servers: round robin alternates; cache-aware sends
requests sharing a long prefix to the same replica (whose prefix cache then hits), spreads unrelated ones,
and falls back to the least-loaded replica when loads are out of balance; streams pass through whole; an
unreachable replica answers 502 in OpenAI's error shape. Policies are also tested on their own."""
import contextlib
import socket

import httpx
import openai
import pytest

from server_utils import API_KEY, MODEL, serve, wait_all_blocks_free
from pagedmoe.entrypoints.router import Router, router_in_thread
from pagedmoe.entrypoints.routing_policies import CHUNK_CHARS, CacheAware, RoundRobin


@contextlib.contextmanager
def running_router(replicas: list[str], policy: str):
    router = Router(replicas, policy)
    with router_in_thread(router) as url:
        yield url, router


@pytest.fixture(scope="module")
def replicas(text_model):
    with serve(text_model[0], num_kv_blocks=256) as a, serve(text_model[0], num_kv_blocks=256) as b:
        yield a, b


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def test_round_robin_alternates_and_streams(replicas):
    with running_router([r.url for r in replicas], "round_robin") as (url, router):
        for _ in range(4):
            out = client(url).completions.create(model=MODEL, prompt="ROMEO: hello", max_tokens=4, temperature=0)
            assert out.choices[0].text
        chunks = list(client(url).completions.create(model=MODEL, prompt="JULIET:", max_tokens=6, temperature=0,
                                                      stream=True))
        direct = client(replicas[0].url).completions.create(model=MODEL, prompt="JULIET:", max_tokens=6,
                                                            temperature=0)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == direct.choices[0].text
        assert router.routed == [3, 2] and router.in_flight == [0, 0]
    for replica in replicas:
        wait_all_blocks_free(replica)


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(replicas):
    system = "You are a royal herald of Verona. " * 12  # ~400 characters, 25 blocks of this tokenizer or more
    hits_before = [r.engine.get_stats().prefix_cache_hits for r in replicas]
    with running_router([r.url for r in replicas], "cache_aware") as (url, router):
        for question in ("Who comes?", "What news?", "Where is Romeo?", "Is it day?"):
            client(url).chat.completions.create(model=MODEL, max_tokens=3, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
        first = router.routed.index(4)  # all four on one replica
        other = "An unrelated prompt about the weather in Mantua, " * 4
        client(url).completions.create(model=MODEL, prompt=other, max_tokens=2, temperature=0)
        assert router.routed[1 - first] == 1  # new text goes to the replica that has seen the least
    hits = [r.engine.get_stats().prefix_cache_hits - h for r, h in zip(replicas, hits_before)]
    assert hits[first] > 0


def test_unreachable_replica_is_a_502(replicas):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with running_router([dead], "round_robin") as (url, router):
        response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                              headers={"Authorization": f"Bearer {API_KEY}"})
        assert response.status_code == 502 and response.json()["error"]["code"] == "bad_gateway"
        assert router.in_flight == [0]
        assert httpx.post(f"{url}/v1/completions", content=b"[1, 2").status_code == 400


def test_policies_alone():
    rr = RoundRobin(3)
    assert [rr.choose("x", [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    policy = CacheAware(2, balance_abs_threshold=4, balance_rel_threshold=1.5)
    text = "a" * (4 * CHUNK_CHARS)
    first = policy.choose(text, [0, 0])
    assert policy.choose(text + " more", [0, 0]) == first  # the whole prefix matches
    assert policy.choose("b" * (4 * CHUNK_CHARS), [0, 0]) == 1 - first  # no match: the emptier replica
    loads = [10, 0] if first == 0 else [0, 10]
    assert policy.choose(text, loads) == 1 - first  # out of balance: the least loaded, match or not
